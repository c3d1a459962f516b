"""Running lm-eval tasks on an s2hc model: task names and suites, offline checks, the paper's table.

``paper8`` is the s²HC paper's benchmark suite: PIQA, BoolQ, MMLU and TruthfulQA (mc2) 0-shot, WinoGrande
5-shot, HellaSwag 10-shot, ARC-Easy and ARC-Challenge 25-shot (the paper's MMLU is 0-shot). Its datasets
come from the Hugging Face Hub; offline (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``) without them in the
local cache, or with the Hub unreachable, :func:`run_tasks` raises :class:`HubUnavailable` with one sentence.

:func:`format_paper8_table` lays out results as the paper's table (accuracy in %, one row per model, the
average of the eight in the last column).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..extras import require
from ..hub import offline_if_unreachable, offline_variable
from ..reports import fixed, table
from .offline import GROUPS, TASKS, tasks_dir

PAPER8_NAME = "paper8"


@dataclass(frozen=True)
class Benchmark:
    column: str  # the paper's column title
    task: str  # the lm-eval task (or group) name
    shots: int
    metric: str  # the lm-eval metric shown in the table
    dataset: str  # its Hugging Face Hub dataset repository


PAPER8 = (
    Benchmark("PIQA", "piqa", 0, "acc_norm", "baber/piqa"),
    Benchmark("BoolQ", "boolq", 0, "acc", "aps/super_glue"),
    Benchmark("MMLU", "mmlu", 0, "acc", "cais/mmlu"),
    Benchmark("TruthfulQA", "truthfulqa_mc2", 0, "acc", "truthfulqa/truthful_qa"),
    Benchmark("WinoGrande", "winogrande", 5, "acc", "allenai/winogrande"),
    Benchmark("HellaSwag", "hellaswag", 10, "acc_norm", "Rowan/hellaswag"),
    Benchmark("ARC-E", "arc_easy", 25, "acc_norm", "allenai/ai2_arc"),
    Benchmark("ARC-C", "arc_challenge", 25, "acc_norm", "allenai/ai2_arc"),
)
SHIPPED = (*TASKS, *GROUPS)
OFFLINE_HINT = f"the offline tasks {', '.join(SHIPPED)} need no network"


class HubUnavailable(RuntimeError):
    """A task needs a dataset from the Hugging Face Hub and cannot get it (offline, or no network)."""


class UnknownTask(ValueError):
    """A task name that is neither an lm-eval task, group or tag, nor one of s2hc's."""


def _hub_cache() -> Path:
    try:
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE)
    except ImportError:  # pragma: no cover
        return Path(os.environ.get("HF_HUB_CACHE", Path.home() / ".cache" / "huggingface" / "hub"))


def cached_datasets(repos) -> dict[str, bool]:
    """Whether each Hub dataset repository has files in the local Hugging Face cache."""
    root = _hub_cache()
    return {repo: (root / ("datasets--" + repo.replace("/", "--")) / "snapshots").is_dir() for repo in repos}


def check_paper8_reachable() -> None:
    """Raise :class:`HubUnavailable` (one sentence) when the Hub is switched off and paper8's datasets are not
    all in the local cache; do nothing otherwise (whether the network works shows when they load)."""
    variable = offline_variable()
    if variable is None:
        return
    missing = sorted(repo for repo, cached in cached_datasets({b.dataset for b in PAPER8}).items() if not cached)
    if missing:
        raise HubUnavailable(
            f"the paper8 suite downloads its datasets ({', '.join(b.column for b in PAPER8)}) from the Hugging Face "
            f"Hub, which is switched off here ({variable}={os.environ[variable]}) and {len(missing)} of them "
            f"({', '.join(missing)}) are not in the local cache; run it once with network access, or use "
            f"--tasks {','.join(SHIPPED)}, which need no network"
        )


@contextlib.contextmanager
def _quiet_git_hash():
    """lm-eval records the git commit of the working directory by running ``git describe`` with git's stderr
    left open, so outside a repository every evaluation prints ``fatal: not a git repository``. The same record,
    with git's complaint discarded, for the duration of the call."""
    evaluator = importlib.import_module("lm_eval.evaluator")
    original = getattr(evaluator, "get_git_commit_hash", None)

    def quiet() -> str | None:
        try:
            done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() or None

    if original is not None:
        evaluator.get_git_commit_hash = quiet
    try:
        yield
    finally:
        if original is not None:
            evaluator.get_git_commit_hash = original


def _is_network_error(error: BaseException) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        module = type(error).__module__ or ""
        name = type(error).__name__
        if isinstance(error, (ConnectionError, TimeoutError)) or name in (
            "OfflineModeIsEnabled", "LocalEntryNotFoundError", "ConnectError", "ConnectTimeout", "ReadTimeout",
            "MaxRetryError", "NameResolutionError", "DatasetNotFoundError",
        ) or (module.split(".")[0] in ("requests", "httpx", "urllib3") and isinstance(error, OSError)):  # fmt: skip
            return True
        error = error.__cause__ or error.__context__
    return False


# ---- task names -------------------------------------------------------------------------------------------


def parse_tasks(text: str | list[str]) -> list[str]:
    """``"a, b,paper8"`` -> ``["a", "b", "paper8"]`` (order kept, duplicates dropped); ValueError if empty."""
    items = text if isinstance(text, list) else text.split(",")
    names = list(dict.fromkeys(name.strip() for name in items if name and name.strip()))
    if not names:
        raise ValueError(f"no task named in {text!r}")
    return names


def task_manager(names: list[str]):
    """An lm-eval ``TaskManager`` that knows the shipped tasks, and lm-eval's own only when ``names`` need
    them (indexing lm-eval's ~15 000 task files takes tens of seconds)."""
    from lm_eval.tasks import TaskManager

    needs_defaults = any(name not in SHIPPED for name in names)
    return TaskManager(include_path=str(tasks_dir()), include_defaults=needs_defaults)


def check_task_names(names: list[str], manager) -> None:
    """UnknownTask (one sentence) naming every task ``manager`` does not know."""
    known = set(manager.all_tasks)
    unknown = [name for name in names if name not in known and not manager.match_tasks([name])]
    if unknown:
        raise UnknownTask(
            f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(repr(n) for n in unknown)}: not an lm-eval "
            f"task, group or tag, nor one of s2hc's ({', '.join(SHIPPED)}, {PAPER8_NAME})"
        )


# ---- running ----------------------------------------------------------------------------------------------


def _merge(into: dict | None, results: dict) -> dict:
    if into is None:
        return results
    for key, value in results.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict) and key != "config":
            into[key].update(value)
    return into


def run_tasks(
    lm,
    tasks: str | list[str],
    *,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    bootstrap_iters: int = 1000,
    seed: int = 1234,
    log_samples: bool = False,
    verbosity: str | None = "WARNING",
) -> dict[str, Any]:
    """Evaluate an lm-eval model ``lm`` (an :class:`~s2hc.evaluate.harness.S2HCLM` or any ``LM``) on ``tasks``
    with ``lm_eval.simple_evaluate``; returns lm-eval's results dict (``results``, ``n-shot``, ``configs``...).

    ``tasks``: names or a comma-separated string of lm-eval tasks, groups or tags, the shipped offline tasks,
    and ``paper8`` (each of its tasks with its own number of shots; ``num_fewshot`` applies to the others).
    ``limit``: examples per task (a fraction if < 1). Errors: :class:`UnknownTask`, :class:`HubUnavailable`.
    """
    lm_eval = require("lm_eval", "lm-eval tasks")
    names = parse_tasks(tasks)
    plan: dict[int | None, list[str]] = {}
    if PAPER8_NAME in names:
        check_paper8_reachable()
        for bench in PAPER8:
            plan.setdefault(bench.shots, []).append(bench.task)
    others = [n for n in names if n != PAPER8_NAME]
    if others:
        plan.setdefault(num_fewshot, []).extend(n for n in others if n not in plan.get(num_fewshot, []))
    manager = task_manager([n for group in plan.values() for n in group])
    check_task_names(others, manager)
    merged = None
    for shots, group in plan.items():
        try:
            remote = any(n not in SHIPPED for n in group)
            with _quiet_git_hash(), offline_if_unreachable() if remote else contextlib.nullcontext():
                results = lm_eval.simple_evaluate(
                    model=lm, tasks=group, num_fewshot=shots, limit=limit, task_manager=manager,
                    bootstrap_iters=bootstrap_iters, log_samples=log_samples, verbosity=verbosity,
                    random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                )  # fmt: skip
        except Exception as error:  # noqa: BLE001 - only network failures are translated
            remote = [n for n in group if n not in SHIPPED]
            if remote and _is_network_error(error):
                plural = len(remote) > 1
                raise HubUnavailable(
                    f"task{'s' if plural else ''} {', '.join(remote)} could not get {'their' if plural else 'its'} "
                    f"data from the Hugging Face Hub ({type(error).__name__}: offline or no network); run with "
                    f"network access once to fill the cache, or use {', '.join(SHIPPED)}, which need no network"
                ) from error
            raise
        merged = _merge(merged, results)
    return merged


# ---- tables -----------------------------------------------------------------------------------------------


def _score(results: dict, bench: Benchmark, metrics: dict[str, str] | None) -> float | None:
    metric = (metrics or {}).get(bench.column, bench.metric)
    entry = results.get("results", results).get(bench.task, {})
    for key in (f"{metric},none", metric):
        if isinstance(entry.get(key), (int, float)):
            return 100.0 * float(entry[key])
    return None


def format_paper8_table(rows: dict[str, dict], *, metrics: dict[str, str] | None = None) -> str:
    """The s²HC paper's benchmark table as Markdown: one row per ``label -> lm-eval results`` (the dict
    :func:`run_tasks` or ``simple_evaluate`` returns), accuracy in % with two decimals, and ``Avg.``, the
    mean of the eight (``–`` where a benchmark is missing). ``metrics`` overrides a column's metric
    (``{"PIQA": "acc"}``)."""
    header = ["Model", *(b.column for b in PAPER8), "Avg."]
    cells = []
    for label, results in rows.items():
        scores = [_score(results, b, metrics) for b in PAPER8]
        average = sum(scores) / len(scores) if all(s is not None for s in scores) else None
        cells.append([label, *(fixed(s, 2) for s in (*scores, average))])
    lines = table(header, cells)
    used = {b.column: (metrics or {}).get(b.column, b.metric) for b in PAPER8}
    shots = "; ".join(
        f"{', '.join(b.column for b in PAPER8 if b.shots == n)} {n}-shot" for n in sorted({b.shots for b in PAPER8})
    )
    norm = [c for c, m in used.items() if m == "acc_norm"]
    caption = f"Accuracy (%), lm-evaluation-harness; {shots}" + (
        f"; length-normalised accuracy (acc_norm) for {', '.join(norm)}." if norm else "."
    )
    return caption + "\n\n" + "\n".join(lines)


def format_results_table(results: dict) -> str:
    """lm-eval's own Markdown table of every task and group in ``results``."""
    from lm_eval.utils import make_table

    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    return table
