"""``s2hc compare``: a study with one axis, families (× seeds), from a training config and a family list.

``compare(base, ["residual", "mhc", "s2hc"], seeds=2)`` is the study whose spec :func:`compare_spec` returns::

    train: {...}                     # base's settings that differ from TrainConfig's defaults
    n_streams: [4]                   # --streams (residual always runs with 1)
    seeds: [base.seed, base.seed + 1]
    families: [residual, {family: mhc, options: ...}, ...]   # --family-option: every family that takes options

run by :func:`~.runner.run_study` one run at a time, so that its runs, ``results.json`` and ``report.md`` are
the study's (``OUT/runs/residual-seed1337/``, ...). What differs is how an existing ``OUT`` is treated, as
``s2hc train`` treats a run directory: without ``resume`` or ``overwrite`` none of the runs may exist yet;
``resume`` keeps finished runs, resumes unfinished ones and starts missing ones (at least one must exist);
``overwrite`` starts every run again.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from ..config import TrainConfig, check_seed_count
from ..connection import forms
from ..connection.forms import default_streams
from ..diagnostics.report import DEFAULT_TOKENS
from ..rundir import check_run_directory, holds_run
from . import runner
from .runner import Run, run_study, run_threads
from .spec import DEFAULT_BASELINES, GRID_KEYS, StudySpec, parse_spec

TITLE = "s2hc compare"


def compare_spec(base: TrainConfig, families: list[str | tuple[str, dict]], seeds: int = 1,
                 n_streams: int | None = None, family_options: dict[str, Any] | None = None) -> StudySpec:
    """The one-axis study of ``families`` trained as ``base`` with ``seeds`` seeds (``base.seed``, +1, ...);
    ``n_streams``: streams of every family but residual (default: the family's, 4). A family is a name or a pair
    ``(name, options)`` (``s2hc compare --families attn-res:block_size=2``); ``family_options``
    (``--family-option``, over ``base.family_options``) apply to every family that takes options, below its own; a
    family that takes none (the residual baseline) is left as it is, and one that takes options but not one of these
    is refused, named. ValueError as a study spec refuses it otherwise (a family twice, an option a family does not
    take)."""
    check_seed_count("--seeds", seeds)  # before a list of seeds is made
    defaults = TrainConfig().to_dict()
    train = {key: value for key, value in base.to_dict().items()
             if key not in GRID_KEYS and value != defaults.get(key)}
    common = {**base.family_options, **(family_options or {})}
    pairs = [(entry, {}) if isinstance(entry, str) else (entry[0], dict(entry[1])) for entry in families]
    names = [family for family, _ in pairs]
    entries: list[Any] = []
    for family, own in pairs:
        form = forms.get(family)
        allowed = form.allowed_options()
        if not allowed and not own:  # the residual: one stream whatever n the others use, no options
            entries.append(family)
            continue
        if allowed:
            unknown = sorted(set(common) - set(allowed))
            if unknown:
                raise ValueError(f"--family-option {', '.join(unknown)}: family {family!r} does not take "
                                 f"{'it' if len(unknown) == 1 else 'them'} (it takes {', '.join(allowed)}); "
                                 f"give it as FAMILY:KEY=VALUE in --families to the families that do")
        streams = 1 if form.max_streams == 1 else n_streams or default_streams(family)
        entry: dict[str, Any] = {"family": family, "n_streams": [streams]}
        options = {**(common if allowed else {}), **own}
        if options:
            entry["options"] = options
        entries.append(entry)
    values = {
        "description": f"`s2hc compare`: {', '.join(names)} trained alike, a study with one axis (families).",
        "train": train,
        "seeds": [base.seed + k for k in range(seeds)],
        "families": entries,
        "baselines": [b for b in DEFAULT_BASELINES if b in names],
        "diagnostics_tokens": DEFAULT_TOKENS,
    }
    return parse_spec(values, source="s2hc compare", title=TITLE)


def compare(base: TrainConfig, families: list[str | tuple[str, dict]], seeds: int = 1, out: str | Path = "runs/compare",
            n_streams: int | None = None, resume: bool = False, overwrite: bool = False, log=None,
            family_options: dict[str, Any] | None = None) -> Path:
    """Train ``base`` once per family in ``families`` (and per seed) as the study :func:`compare_spec` describes,
    then write ``out/report.md`` (the study's report, without its statistics or figures when their packages are
    missing). Every run is checked before the first starts (see the module). Returns the report's path."""
    if resume and overwrite:
        raise ValueError("--resume continues the runs in --out and --overwrite replaces them: give one of them")
    if not str(out).strip():
        raise ValueError("--out is empty; name the comparison's directory, e.g. --out runs/compare")
    spec = compare_spec(base, families, seeds, n_streams, family_options)
    out = Path(out).expanduser()
    runs = [Run(configuration, seed, out) for configuration, seed in spec.runs()]
    if resume and not any(holds_run(run.run_dir) for run in runs):
        raise ValueError(f"--resume: {str(out)!r} holds none of these runs to resume "
                         f"({', '.join(run.name for run in runs)}); check --out, or drop --resume to start them")
    for run in runs:  # all refusals before the first run starts
        check_run_directory(run.run_dir, resume=resume and holds_run(run.run_dir), overwrite=overwrite)
    jobs = 1
    threads = run_threads(jobs, base.device)
    if threads is not None and log is not None:
        log(f"each run trains with {threads} torch thread(s): {runner.available_cores()} core(s), {jobs} run at a time"
            + (" (OMP_NUM_THREADS)" if os.environ.get("OMP_NUM_THREADS") else ""))
    with _thread_environment(threads):
        return run_study(spec, out, jobs=jobs, device=base.device, log=log, strict=False, fresh=overwrite)


@contextlib.contextmanager
def _thread_environment(threads: int | None):
    """``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` set to ``threads`` for the runs started inside (each run is a
    process that inherits them), as they were afterwards."""
    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
    before = {name: os.environ.get(name) for name in names}
    if threads is not None:
        os.environ.update(dict.fromkeys(names, str(threads)))
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


__all__ = ["TITLE", "compare", "compare_spec"]
