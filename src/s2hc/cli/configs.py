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

    return config_kind(load_yaml(text))


def config_kind(values) -> str:
    """``"study"`` for the values of a study grid (a ``train`` mapping or a ``families`` list), else ``"train"``."""
    return "study" if isinstance(values, dict) and ("train" in values or "families" in values) else "train"


def read_config(text: str, command: str) -> tuple[dict, str]:
    """``(values, source)`` of the config a command's config argument ``text`` names
    (:func:`s2hc.config.config_path`): ``source`` is how messages name it (a shipped config by its name, not its
    path inside the installed package). ValueError in one line when ``text`` names a config of the other kind
    (``command`` ``"train"`` for ``s2hc train``/``compare``, ``"study"`` for ``s2hc study``), saying which command
    reads it."""
    from importlib import resources

    from ..config import config_path, load_yaml_config

    path = config_path(text)
    name = str(text).removesuffix(".yaml")
    shipped = str(path) == str(resources.files("s2hc").joinpath("configs", f"{name}.yaml"))
    source = name if shipped else str(path)
    values = load_yaml_config(path)
    kind = config_kind(values)
    if kind != command:
        how = (f"s2hc study {text} --out DIR" if kind == "study" else
               f"s2hc train --config {text} (or s2hc compare --config {text})")
        raise ValueError(f"{source} is a {'study' if kind == 'study' else 'training'} config: {how}")
    return values, source


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
