"""``s2hc configs [NAME]``: the YAML configs shipped in the package, listed, or one printed to copy and edit.

A clone has them in ``configs/``; a pip install has them only inside the package, where every command that takes
a config file finds them by name (``s2hc study study-smoke``, ``s2hc train --config demo-tiny``:
:func:`s2hc.config.config_path`); ``s2hc configs study-smoke > study-smoke.yaml`` writes one out to edit.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

# s2hc.config (torch) and yaml are imported by run (s2hc.cli's start time).

SUMMARY = {"configs": "list the shipped YAML configs, or print one"}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "configs", help=SUMMARY["configs"],
        description="Without NAME, list the YAML configs shipped with s2hc (those of the repository's configs/) "
        "and what each is for; with NAME, print that config, e.g. `s2hc configs study-smoke > study-smoke.yaml`, "
        "then `s2hc study study-smoke.yaml --out runs/study-smoke`.",
    )
    parser.add_argument("name", nargs="?", metavar="NAME", help="a shipped config's name (as listed)")
    parser.set_defaults(func=run, subparser=parser)


def _purpose(text: str, width: int = 90) -> str:
    """The first sentence of a config's opening comment, shortened to ``width`` characters."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").strip())
    first = " ".join(lines)
    sentence = first.split(". ")[0].rstrip(".") + "." if first else ""
    return textwrap.shorten(sentence, width, placeholder=" …")


def _command(text: str) -> str:
    """The command that reads a config: a study grid has a ``train`` mapping; the others are TrainConfigs."""
    from ..config import load_yaml

    values = load_yaml(text)
    return "study" if isinstance(values, dict) and "train" in values else "train"


def run(args: argparse.Namespace) -> int:
    from ..config import shipped_configs

    configs = shipped_configs()
    if args.name is not None:
        name = args.name.removesuffix(".yaml")
        if name not in configs:
            raise ValueError(f"argument NAME: no shipped config {args.name!r}; allowed: {', '.join(configs)}")
        sys.stdout.write(configs[name])
        return 0
    width = max(map(len, configs))
    for name, text in configs.items():
        print(f"{name:<{width}}  {_command(text):<5}  {_purpose(text)}")
    print("\nprint one with `s2hc configs NAME > NAME.yaml` to edit it, or name it as it is: `train` ones to "
          "`s2hc train --config NAME` or `s2hc compare --config NAME`, `study` ones to `s2hc study NAME`")
    return 0
