"""``s2hc compare``: a study with one axis, families (× seeds), from a training config and a family list.

``compare(base, ["residual", "mhc", "s2hc"], seeds=2)`` is the study whose spec :func:`compare_spec` returns::

    train: {...}                     # base's settings that differ from TrainConfig's defaults
    n_streams: [4]                   # --streams (residual always runs with 1)
    seeds: [base.seed, base.seed + 1]
    families: [residual, {family: mhc, options: ...}, ...]   # --family-option: every family but residual

run by :func:`~.runner.run_study` one run at a time, so that its runs, ``results.json`` and ``report.md`` are
the study's (``OUT/runs/residual-seed1337/``, ...). What differs is how an existing ``OUT`` is treated, as
``s2hc train`` treats a run directory: without ``resume`` or ``overwrite`` none of the runs may exist yet;
``resume`` keeps finished runs, resumes unfinished ones and starts missing ones (at least one must exist);
``overwrite`` starts every run again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import TrainConfig, check_seed_count
from ..connection import forms
from ..connection.forms import default_streams
from ..diagnostics.report import DEFAULT_TOKENS
from ..rundir import check_run_directory, holds_run
from .runner import Run, run_study
from .spec import DEFAULT_BASELINES, GRID_KEYS, StudySpec, parse_spec

TITLE = "s2hc compare"


def compare_spec(base: TrainConfig, families: list[str], seeds: int = 1, n_streams: int | None = None) -> StudySpec:
    """The one-axis study of ``families`` trained as ``base`` with ``seeds`` seeds (``base.seed``, +1, ...);
    ``n_streams``: streams of every family but residual (default: the family's, 4). ValueError as a study spec
    refuses it (a family twice, an option a family does not take)."""
    check_seed_count("--seeds", seeds)  # before a list of seeds is made
    defaults = TrainConfig().to_dict()
    train = {key: value for key, value in base.to_dict().items()
             if key not in GRID_KEYS and value != defaults.get(key)}
    entries: list[Any] = []
    for family in families:
        form = forms.get(family)
        if not form.allowed_options():  # the residual: one stream whatever n the others use, no options
            entries.append(family)
            continue
        streams = 1 if form.max_streams == 1 else n_streams or default_streams(family)
        entry: dict[str, Any] = {"family": family, "n_streams": [streams]}
        if base.family_options:
            entry["options"] = dict(base.family_options)
        entries.append(entry)
    values = {
        "description": f"`s2hc compare`: {', '.join(families)} trained alike, a study with one axis (families).",
        "train": train,
        "seeds": [base.seed + k for k in range(seeds)],
        "families": entries,
        "baselines": [b for b in DEFAULT_BASELINES if b in families],
        "diagnostics_tokens": DEFAULT_TOKENS,
    }
    return parse_spec(values, source="s2hc compare", title=TITLE)


def compare(base: TrainConfig, families: list[str], seeds: int = 1, out: str | Path = "runs/compare",
            n_streams: int | None = None, resume: bool = False, overwrite: bool = False, log=None) -> Path:
    """Train ``base`` once per family in ``families`` (and per seed) as the study :func:`compare_spec` describes,
    then write ``out/report.md`` (the study's report, without its statistics or figures when their packages are
    missing). Every run is checked before the first starts (see the module). Returns the report's path."""
    if resume and overwrite:
        raise ValueError("--resume continues the runs in --out and --overwrite replaces them: give one of them")
    if not str(out).strip():
        raise ValueError("--out is empty; name the comparison's directory, e.g. --out runs/compare")
    spec = compare_spec(base, families, seeds, n_streams)
    out = Path(out).expanduser()
    runs = [Run(configuration, seed, out) for configuration, seed in spec.runs()]
    if resume and not any(holds_run(run.run_dir) for run in runs):
        raise ValueError(f"--resume: {str(out)!r} holds none of these runs to resume "
                         f"({', '.join(run.name for run in runs)}); check --out, or drop --resume to start them")
    for run in runs:  # all refusals before the first run starts
        check_run_directory(run.run_dir, resume=resume and holds_run(run.run_dir), overwrite=overwrite)
    return run_study(spec, out, jobs=1, device=base.device, log=log, strict=False, fresh=overwrite)


__all__ = ["TITLE", "compare", "compare_spec"]
