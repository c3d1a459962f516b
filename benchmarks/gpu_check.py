"""Helpers of ``benchmarks/gpu_check.sh``: describe the environment, archive each step's files, summarise.

    python benchmarks/gpu_check.py env DIR              # versions, GPU; prints them, writes DIR/env.json
    python benchmarks/gpu_check.py archive OUT_DIR      # OUT_DIR/current/* appended to OUT_DIR/raw.tar, removed
    python benchmarks/gpu_check.py summarize OUT_DIR    # OUT_DIR/summary.md and OUT_DIR/summary.json
    python benchmarks/gpu_check.py finish-step OUT_DIR  # archive, then summarize (after every step)
    python benchmarks/gpu_check.py verdict OUT_DIR      # summarize, print the verdict; exit 0 (passed) or 1 (failed)

The device returns at most 8 files from its output folder, so OUT_DIR holds only these (:data:`TOP_FILES`):
``summary.md`` and ``summary.json`` (rebuilt after every step, so a run cut short still has one),
``steps.jsonl`` (one line per finished step: ``name``, ``kind`` ``setup``/``connection``/``kernels``/``tests``/
``bench``/``tool``, ``tier`` ``core``/``extra``, ``status`` ``ok``/``failed``/``cut``/``skipped``, ``rc``,
``seconds``, ``limit_s``, ``args``, ``note``; ``cut`` is a step stopped at its time limit, which older files call
``timeout``), ``console.log`` (everything the script printed), ``raw.tar`` (an uncompressed tar, appended after
every step: every raw file of every finished step), and ``current/`` with the files of the step in progress,
at most three (what a run killed mid-step still returns). A step ``NAME`` writes ``NAME.log`` (its output),
and as its kind has them ``NAME.json`` (``s2hc bench --json``), ``NAME.jsonl`` (events as they happen:
``s2hc bench --jsonl``, ``kernel_check.py --jsonl``, ``connection_time.py --jsonl``), ``NAME.xml`` (pytest's JUnit
XML); ``env`` writes ``env.txt`` and ``env.json``.

``summarize`` reads all of it (the tar's members, the step in progress, and loose files of the older layout
with one file per result in OUT_DIR) and never fails on a missing or broken file: what is missing is said in
the summary. A bench without its JSON (cut by its time limit) is summarised from its events: its rows when
they were written, else the median ratios of the repetitions it finished.

**The verdict** (:func:`verdict`): failed when a step failed (a non-zero exit that is not the time limit's), or when
a test, kernel case or connection case that finished reports a failure, also inside a step cut for time; passed
otherwise, whatever was cut for time or skipped with its reason: how fast or busy the machine is decides how much
is measured, never whether the check passes. Standard library only, so it runs wherever the script runs;
``tar -xf raw.tar`` unpacks the raw files anywhere.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# DeepSeek's mHC (Manifold-Constrained Hyper-Connections): 6.7 % more training time at n = 4, with its fused
# kernels, recomputation and communication overlap, in large-scale bf16 training. Not the setting of this
# check's steps of one model on one GPU: a reference point, not a like-for-like comparison.
MHC_PUBLISHED_OVERHEAD_PCT = 6.7
PEER = "hyper-connections:mhc"
STATUSES = ("ok", "failed", "cut", "skipped")  # cut: stopped at its time limit (for time), never a failure
ARCHIVE, CURRENT = "raw.tar", "current"
TOP_FILES = ("summary.md", "summary.json", "steps.jsonl", "console.log", ARCHIVE)
MAX_FILES, MAX_FILE_BYTES, MAX_TOTAL_BYTES = 8, 16 << 20, 64 << 20  # what the device returns
NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")
TAIL_LINES = 12


# ------------------------------------------------------------------------------------------- env


def environment() -> dict[str, Any]:
    """Python, torch (and its CUDA), triton, the GPU, and the versions of the packages the check uses."""
    import importlib.metadata
    import platform

    info: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable,
                            "platform": platform.platform()}  # fmt: skip
    for package in ("torch", "triton", "transformers", "hyper-connections", "torch-einops-utils", "einops",
                    "numpy", "tokenizers", "pyyaml", "tqdm", "hypothesis", "pytest", "pytest-xdist",
                    "pytest-timeout", "s2hc"):  # fmt: skip
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()
        info["cpu_threads"] = torch.get_num_threads()
        info["allow_tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = props.name
            info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
            info["gpu_capability"] = f"{props.major}.{props.minor}"
            info["gpu_multiprocessors"] = props.multi_processor_count
            info["gpu_count"] = torch.cuda.device_count()
            info["bf16_supported"] = torch.cuda.is_bf16_supported()
    except Exception as error:  # report, never fail: this is the first thing the check prints
        info["torch_error"] = repr(error)
    for module in ("s2hc", "hyper_connections"):
        try:
            imported = __import__(module)
            info[f"{module}_path"] = str(Path(imported.__file__).parent)
        except Exception as error:
            info[f"{module}_path"] = None
            info[f"{module}_error"] = repr(error)
    return info


def write_environment(out: Path) -> int:
    info = environment()
    out.mkdir(parents=True, exist_ok=True)
    (out / "env.json").write_text(json.dumps(info, indent=2) + "\n")
    for key, value in info.items():
        print(f"{key}: {value}")
    return 0


# --------------------------------------------------------------------------------- the raw files


def archive(out: Path) -> list[str]:
    """Append every file of ``out/current`` to ``out/raw.tar`` (created when absent) and remove it; the names
    archived. A tar appended to is readable after each append, so a run cut later keeps every finished step."""
    current = out / CURRENT
    files = sorted(p for p in current.iterdir() if p.is_file()) if current.is_dir() else []
    if not files:
        return []
    with tarfile.open(out / ARCHIVE, "a") as tar:
        for path in files:
            tar.add(path, arcname=path.name)
    for path in files:
        path.unlink()
    return [path.name for path in files]


class RawFiles:
    """The raw files of a check, by name: loose files in OUT_DIR (the older layout), then the members of
    ``raw.tar`` (the last of a name wins), then the step in progress in ``current/``."""

    def __init__(self, out: Path):
        self.out = out
        self.files: dict[str, bytes] = {}
        self.archive_error: str | None = None
        self.archived: list[str] = []
        for path in sorted(out.iterdir()) if out.is_dir() else []:
            if path.is_file() and path.name not in TOP_FILES:
                self.files[path.name] = path.read_bytes()
        if (out / ARCHIVE).is_file():
            try:
                with tarfile.open(out / ARCHIVE, "r") as tar:
                    for member in tar:
                        if member.isfile():
                            data = tar.extractfile(member)
                            self.files[Path(member.name).name] = data.read() if data else b""
                            self.archived.append(Path(member.name).name)
            except (tarfile.TarError, OSError, EOFError) as error:  # a tar cut mid-append: keep what was read
                self.archive_error = f"{ARCHIVE} unreadable after {len(self.archived)} members: {error}"
        self.in_progress: list[str] = []
        if (out / CURRENT).is_dir():
            for path in sorted((out / CURRENT).iterdir()):
                try:
                    self.files[path.name] = path.read_bytes()
                    self.in_progress.append(path.name)
                except OSError:  # archived and removed while being read: it is in the tar now
                    continue

    def text(self, name: str) -> str | None:
        data = self.files.get(name)
        return None if data is None else data.decode("utf-8", errors="replace")

    def first(self, *names: str) -> tuple[str, str] | None:
        """The first of ``names`` that exists: ``(name, text)``."""
        for name in names:
            text = self.text(name)
            if text is not None:
                return name, text
        return None


def returned_files(out: Path) -> dict[str, Any]:
    """What the device would return of ``out``: each file's path and size, and the rules it breaks (at most 8
    files, 16 MiB each and 64 MiB together, at most 2 folders down, names of letters, digits, ``.``, ``_``, ``-``)."""
    files = sorted(p for p in out.rglob("*") if p.is_file()) if out.is_dir() else []
    listed = [{"path": str(p.relative_to(out)), "bytes": p.stat().st_size} for p in files]
    problems = []
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files, more than {MAX_FILES}")
    for p, entry in zip(files, listed):
        parts = p.relative_to(out).parts
        if len(parts) > 3:
            problems.append(f"{entry['path']}: more than 2 folders down")
        if not all(NAME_OK.match(part) for part in parts):
            problems.append(f"{entry['path']}: a name outside [A-Za-z0-9._-]")
        if entry["bytes"] > MAX_FILE_BYTES:
            problems.append(f"{entry['path']}: {entry['bytes']} bytes, over 16 MiB")
    total = sum(e["bytes"] for e in listed)
    if total > MAX_TOTAL_BYTES:
        problems.append(f"{total} bytes together, over 64 MiB")
    return {"files": listed, "count": len(files), "bytes": total, "problems": problems}


# ------------------------------------------------------------------------------------ reading


def read_steps(out: Path) -> list[dict[str, Any]]:
    """The records of ``steps.jsonl`` (``timeout``, the older name, read as ``cut``); a line that is not JSON becomes
    a ``failed`` step saying so."""
    path = out / "steps.jsonl"
    if not path.is_file():
        return []
    steps = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            step = json.loads(line)
        except json.JSONDecodeError:
            steps.append({"name": f"line {i}", "kind": "?", "status": "failed", "note": f"unreadable: {line!r}"})
            continue
        if step.get("status") == "timeout":  # the older files' name for a step stopped at its time limit
            step["status"] = "cut"
        steps.append(step)
    return steps


def read_jsonl(text: str | None) -> list[dict[str, Any]]:
    """The JSON objects of ``text``'s lines; a line cut off by a kill (the last, usually) is left out."""
    records = []
    for line in (text or "").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_junit(text: str | None) -> dict[str, Any] | None:
    """Counts of a JUnit XML file (pytest's ``--junitxml``) and the failed tests' ids; None without the file."""
    if text is None:
        return None
    try:
        root = ET.fromstring(text)
    except ET.ParseError as error:
        return {"error": f"unreadable JUnit XML: {error}"}
    counts = {"total": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    for case in root.iter("testcase"):
        counts["total"] += 1
        test_id = ".".join(part for part in (case.get("classname"), case.get("name")) if part)
        if case.find("failure") is not None:
            counts["failed"] += 1
            counts["failures"].append(test_id)
        elif case.find("error") is not None:
            counts["errors"] += 1
            counts["failures"].append(test_id)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


_RESULT = re.compile(r"(?:^|\s)(?:(?P<id1>\S+::\S+) (?P<s1>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)"
                     r"|(?P<s2>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (?P<id2>\S+::\S+))")


def read_pytest_log(text: str | None, name: str = "tests.log") -> dict[str, Any] | None:
    """Counts from pytest's verbose lines (``tests/x.py::test PASSED``, or with xdist ``PASSED tests/x.py::test``)
    when there is no JUnit XML: a run cut short by its time limit still says what had finished."""
    if text is None:
        return None
    results: dict[str, str] = {}
    for line in text.splitlines():
        match = _RESULT.search(line)
        if match:
            results[match["id1"] or match["id2"]] = match["s1"] or match["s2"]
    if not results:
        return None
    statuses = list(results.values())
    return {
        "total": len(results), "passed": statuses.count("PASSED") + statuses.count("XPASS"),
        "failed": statuses.count("FAILED"), "errors": statuses.count("ERROR"),
        "skipped": statuses.count("SKIPPED") + statuses.count("XFAIL"),
        "failures": [test for test, status in results.items() if status in ("FAILED", "ERROR")],
        "partial": f"from {name}: no JUnit XML, the run did not finish",
    }  # fmt: skip


def read_tests(raw: RawFiles, step: dict[str, Any]) -> dict[str, Any]:
    """One test step's counts: from ``NAME.xml``, else from the verbose lines of ``NAME.log``."""
    name = step["name"]
    junit = raw.first(f"{name}.xml")
    log = raw.first(f"{name}.log")
    counts = read_junit(junit[1]) if junit else None
    if counts is None and log:
        counts = read_pytest_log(log[1], log[0])
    return {"name": name, "status": step.get("status"), "args": step.get("args"), "counts": counts}


def _option(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _compact_row(row: dict[str, Any]) -> dict[str, Any]:
    peak = row.get("peak_mem_bytes")
    return {
        "label": row["label"], "family": row["family"], "n_streams": row["n_streams"],
        "batch_size": row.get("batch_size"), "seq_len": row.get("seq_len"),
        "step_ms": row["step_s"] * 1e3, "step_ratio": row["step_ratio_vs_residual"],
        "ratio_min": row.get("step_ratio_min"), "ratio_max": row.get("step_ratio_max"),
        "tokens_per_s": row.get("tokens_per_s"), "peak_mem_mib": None if peak is None else peak / 2**20,
        "peak_mem_ratio": row.get("peak_mem_ratio_vs_residual"), "params": row.get("params"),
    }  # fmt: skip


def rows_from_repetitions(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows from a bench's ``repetition`` events alone (a bench cut before its rows): per variant the median of
    its step times and of its ratios to residual within each finished repetition; no memory."""
    start = next((e for e in events if e.get("event") == "start"), {})
    built = {e["label"]: e for e in events if e.get("event") == "built" and "label" in e}
    reps = [e["step_s"] for e in events if e.get("event") == "repetition" and isinstance(e.get("step_s"), dict)]
    if not reps:
        return []
    tokens = (start.get("batch_size") or 0) * (start.get("seq_len") or 0) or None
    rows = []
    for label in reps[0]:
        times = [rep[label] for rep in reps if label in rep]
        ratios = [rep[label] / rep["residual"] for rep in reps if label in rep and rep.get("residual")]
        step_s = statistics.median(times)
        rows.append({
            "label": label, "family": built.get(label, {}).get("family", label.split(":")[0]),
            "n_streams": built.get(label, {}).get("n_streams"), "batch_size": start.get("batch_size"),
            "seq_len": start.get("seq_len"), "step_ms": step_s * 1e3,
            "step_ratio": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios) if ratios else None, "ratio_max": max(ratios) if ratios else None,
            "tokens_per_s": tokens / step_s if tokens else None, "peak_mem_mib": None, "peak_mem_ratio": None,
            "params": None,
        })  # fmt: skip
    return rows


def read_bench(raw: RawFiles, step: dict[str, Any]) -> dict[str, Any]:
    """One bench step: its settings (from its arguments and its JSON or events) and its rows, compacted. Without
    the JSON, the rows of its events, else the ratios of the repetitions it finished (``partial`` says which)."""
    args = shlex.split(step.get("args") or "")
    layers = _option(args, "--layers")
    streams = _option(args, "--streams")
    name = step["name"]
    run: dict[str, Any] = {
        "name": name, "status": step.get("status"), "args": step.get("args"),
        "preset": _option(args, "--preset"), "layers": int(layers) if layers else None,
        "compiled": "--compile" in args, "n_streams": int(streams) if streams else None,
        "device": _option(args, "--device"), "dtype": _option(args, "--dtype") or "float32", "machine": None,
        "peer": None, "rows": [], "built_s": {}, "error": None, "partial": None,
    }  # fmt: skip
    events = read_jsonl(raw.text(f"{name}.jsonl"))
    run["built_s"] = {e["label"]: e.get("seconds") for e in events if e.get("event") == "built" and "label" in e}
    start = next((e for e in events if e.get("event") == "start"), None)
    if start:
        run.update(machine=start.get("machine"), device=start.get("device", run["device"]),
                   dtype=start.get("dtype", run["dtype"]), peer=start.get("peer"))  # fmt: skip
        for key, field in (("preset", "preset"), ("n_streams", "n_streams"), ("compiled", "compiled")):
            if run[key] in (None, False):  # a step without arguments (cut in progress): its settings event says
                run[key] = start.get(field, run[key])
    found = raw.first(f"{name}.json", f"bench-{name}.json")
    data = None
    if found is not None:
        try:
            data = json.loads(found[1])
        except json.JSONDecodeError:
            run["error"] = f"no JSON ({found[0]} empty or unreadable; status {step.get('status')})"
    else:
        run["error"] = f"no JSON ({name}.json missing; status {step.get('status')})"
    if isinstance(data, dict):
        run["error"] = None
        run.update(machine=data.get("machine"), device=data.get("device", run["device"]), peer=data.get("peer"),
                   dtype=data.get("dtype", run["dtype"]))  # fmt: skip
        rows = data.get("steps", [])
    else:
        rows = [e for e in events if e.get("event") == "row"]
        if rows:
            run["partial"] = f"rows from {name}.jsonl (the bench stopped after them)"
    for row in rows:
        run["preset"] = row.get("preset", run["preset"])
        run["compiled"] = row.get("compiled", run["compiled"])
        run["dtype"] = row.get("dtype", run["dtype"])
        run["rows"].append(_compact_row(row))
    if not run["rows"]:
        run["rows"] = rows_from_repetitions(events)
        if run["rows"]:
            reps = [e for e in events if e.get("event") == "repetition"]
            run["partial"] = (f"{len(reps)} of {reps[-1].get('repeats', '?')} repetitions, from {name}.jsonl "
                              "(cut before its rows: no memory)")  # fmt: skip
    if run["rows"]:
        run["error"] = None
    return run


def read_kernels(raw: RawFiles, step: dict[str, Any]) -> dict[str, Any]:
    """The kernel check's results (``NAME.jsonl`` of ``kernel_check.py``): environment, copy bandwidth, cases."""
    records = read_jsonl(raw.text(f"{step['name']}.jsonl"))
    env = next((r for r in records if r.get("kind") == "environment"), None)
    copies = [r for r in records if r.get("kind") == "copy"]
    cases = [r for r in records if r.get("kind") == "case"]
    done = next((r for r in records if r.get("kind") == "done"), None)
    big = next((c for c in copies if "n" not in c), None)
    return {
        "name": step["name"], "status": step.get("status"), "environment": env,
        "copy_gbs": big.get("gbs") if big else None, "copies": copies, "cases": cases, "done": done,
        "passed": sum(1 for c in cases if c.get("ok")), "failed": [c for c in cases if not c.get("ok")],
    }  # fmt: skip


def read_connection(raw: RawFiles, step: dict[str, Any]) -> dict[str, Any]:
    """The connection timing's results (``NAME.jsonl`` of ``connection_time.py``): environment, copy bandwidth, the
    floors, and the cases, each with its time over the residual add's on the same path and dtype."""
    records = read_jsonl(raw.text(f"{step['name']}.jsonl"))
    env = next((r for r in records if r.get("kind") == "environment"), None)
    copy = next((r for r in records if r.get("kind") == "copy"), None)
    floors = [r for r in records if r.get("kind") == "floor"]
    cases = [r for r in records if r.get("kind") == "case"]
    timed = {(c.get("family"), c.get("dtype"), c.get("path")): c for c in cases if c.get("ms")}
    for case in cases:
        residual = timed.get(("residual", case.get("dtype"), case.get("path")))
        case["vs_residual"] = case["ms"] / residual["ms"] if case.get("ms") and residual else None
    return {
        "name": step["name"], "status": step.get("status"), "environment": env,
        "copy_gbs": copy.get("gbs") if copy else None, "floors": floors, "cases": cases,
        "done": next((r for r in records if r.get("kind") == "done"), None),
        "failed": [c for c in cases if not c.get("ok", True)], "timed": len(timed),
    }  # fmt: skip


def verdict(summary: dict[str, Any]) -> dict[str, Any]:
    """Whether the check passed: failed when a step failed, or when a test, kernel case or connection case that
    finished failed (inside a step cut for time too); a step cut for time or skipped with its reason is no failure."""
    failures = [f"step `{s.get('name')}` failed (exit {s.get('rc')})" for s in summary["steps"]
                if s.get("status") == "failed"]  # fmt: skip
    for run in summary["tests"]:
        counts = run["counts"] or {}
        bad = (counts.get("failed") or 0) + (counts.get("errors") or 0)
        if bad:
            failures.append(f"{bad} tests failed in `{run['name']}` ({run['status']}): "
                            + ", ".join(counts.get("failures", [])[:5]))  # fmt: skip
    for check in summary["kernels"]:
        if check["failed"]:
            failures.append(f"{len(check['failed'])} kernel cases failed in `{check['name']}` ({check['status']})")
    for check in summary["connections"]:
        if check["failed"]:
            failures.append(f"{len(check['failed'])} connection cases failed in `{check['name']}` "
                            f"({check['status']})")
    counts = summary["step_counts"]
    return {"passed": not failures, "failures": failures,
            "text": ("passed: every step ok, skipped with its reason or cut for time" if not failures
                     else "failed: " + "; ".join(failures))
            + f" ({counts['ok']} ok, {counts['cut']} cut for time, {counts['skipped']} skipped, "
            f"{counts['failed']} failed)"}  # fmt: skip


def overheads(benches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """s2hc's step-time overhead over residual at n = 4 in every bench run, against mHC's published 6.7 %,
    with mhc's and the peer's overhead in the same run for context."""
    results = []
    for run in benches:
        pct = {row["label"]: (row["step_ratio"] - 1) * 100 for row in run["rows"] if row["step_ratio"] is not None}
        for row in run["rows"]:
            if row["family"] != "s2hc" or row["n_streams"] != 4 or row["step_ratio"] is None:
                continue
            overhead = (row["step_ratio"] - 1) * 100
            results.append({
                "run": run["name"], "label": row["label"], "preset": run["preset"], "layers": run["layers"],
                "compiled": run["compiled"], "dtype": run["dtype"], "step_ratio": row["step_ratio"],
                "overhead_pct": overhead, "published_pct": MHC_PUBLISHED_OVERHEAD_PCT,
                "vs_published_pct_points": overhead - MHC_PUBLISHED_OVERHEAD_PCT,
                "mhc_overhead_pct": pct.get("mhc"), "peer_overhead_pct": pct.get(PEER),
                "partial": run["partial"],
            })  # fmt: skip
    return results


def tail(raw: RawFiles, step: dict[str, Any], lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of a step's log (``NAME.log``, or ``env.txt``)."""
    found = raw.first(f"{step['name']}.log", f"bench-{step['name']}.log", f"{step['name']}.txt")
    return found[1].rstrip("\n").splitlines()[-lines:] if found else []


def _step_kind(name: str) -> str:
    if name.startswith("bench-"):
        return "bench"
    if name in ("kernels", "connection"):
        return name
    return "tests" if name.endswith("tests") else "tool"


def in_progress_steps(raw: RawFiles, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pseudo-records of the step whose files are still in ``current/`` (a run killed during it: cut for time),
    status ``cut``."""
    known = {s.get("name") for s in steps}
    names = dict.fromkeys(Path(name).stem for name in raw.in_progress)
    return [{"name": name, "kind": _step_kind(name), "status": "cut", "rc": None, "seconds": None, "limit_s": None,
             "args": "", "note": "in progress when the run ended (cut for time): its files are in current/"}
            for name in names if name not in known and name != "env"]  # fmt: skip


def summarize(out: Path) -> dict[str, Any]:
    raw = RawFiles(out)
    steps = read_steps(out)
    steps += in_progress_steps(raw, steps)
    env = None
    if raw.text("env.json"):
        try:
            env = json.loads(raw.text("env.json"))
        except json.JSONDecodeError:
            env = None
    mode = next((s.get("mode") for s in steps if s.get("mode")), None)
    kinds = ("bench", "tests", "kernels", "connection")
    by_kind = {kind: [s for s in steps if s.get("kind") == kind] for kind in kinds}
    benches = [read_bench(raw, s) for s in by_kind["bench"]]
    tests = [read_tests(raw, s) for s in by_kind["tests"]]
    counts = {status: sum(1 for s in steps if s.get("status") == status) for status in STATUSES}
    tails = {s["name"]: tail(raw, s) for s in steps if s.get("status") in ("failed", "cut")
             or (s.get("kind") == "tool" and s.get("status") != "skipped")}  # fmt: skip
    summary = {
        "out_dir": str(out), "mode": mode, "generated": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "environment": env, "steps": steps, "step_counts": counts,
        "seconds": sum(s.get("seconds") or 0 for s in steps),
        "connections": [read_connection(raw, s) for s in by_kind["connection"]],
        "kernels": [read_kernels(raw, s) for s in by_kind["kernels"]],
        "tests": tests, "benches": benches, "s2hc_vs_mhc_published": overheads(benches), "tails": tails,
        "in_progress": raw.in_progress,
        "archive": {"members": raw.archived, "error": raw.archive_error},
    }  # fmt: skip
    summary["verdict"] = verdict(summary)
    returned = summary["returned"] = returned_files(out)  # the summaries, when not written yet, are added here
    for name in ("summary.md", "summary.json"):
        if not (out / name).exists():
            returned["count"] += 1
            returned["files"].append({"path": name, "bytes": None})
    if returned["count"] > MAX_FILES and not any("files, more" in p for p in returned["problems"]):
        returned["problems"].insert(0, f"{returned['count']} files, more than {MAX_FILES}")
    _write(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    _write(out / "summary.md", markdown(summary))
    return summary


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole (a temporary file renamed over it), so a kill never leaves half a summary."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


# ----------------------------------------------------------------------------------- markdown


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def _precision(dtype: str | None) -> str:
    return "bf16 autocast" if dtype == "bfloat16" else "float32"


def _run_title(run: dict[str, Any]) -> str:
    layers = run["layers"]
    depth = f", {layers} layer{'s' if layers != 1 else ''} (--layers)" if layers else ""
    mode = "compiled" if run["compiled"] else "eager"
    shape = ""
    if run["rows"]:
        first = run["rows"][0]
        shape = f", batch {first['batch_size']} x {first['seq_len']}"
    where = f" on {run['device']}" if run["device"] else ""
    return (f"`{run['name']}`: {run['preset']}{depth}, {_precision(run['dtype'])}, {mode}, n = {run['n_streams']}"
            f"{shape}{where}")  # fmt: skip


def _kernel_lines(check: dict[str, Any]) -> list[str]:
    env = check["environment"] or {}
    lines = [f"### `{check['name']}` ({check['status']})", ""]
    if not check["cases"]:
        return lines + ["No case finished (see the step's log in `raw.tar`)."]
    meaningful = env.get("device") == "cuda"
    copy = check["copy_gbs"]
    lines.append(
        f"{env.get('gpu') or env.get('device')}; T = {env.get('tokens')} tokens, C = {env.get('dim')}; "
        f"{check['passed']}/{len(check['cases'])} cases passed"
        + (f"; device copy {copy:,.0f} GB/s (read + written)" if copy and meaningful else "")
        + ("" if meaningful else "; times under the CPU interpreter are not measurements")
        + ". Errors: the largest of ‖a − ref‖/‖ref‖ and max|a − ref|/max|ref| over outputs and gradients, "
        "against float64."
    )
    lines += [
        "",
        "| piece | n | dtype | ok | triton error | torch error | fwd triton ms (GB/s, % copy) | fwd torch ms "
        "| bwd triton ms (GB/s, % copy) | bwd torch ms |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]

    def speed(ms, rate):
        if ms is None:
            return "-"
        if not (meaningful and rate):
            return f"{ms:.3f}"
        return f"{ms:.3f} ({rate:,.0f}" + (f", {rate / copy:.0%})" if copy else ")")

    for case in check["cases"]:
        piece = case["piece"] + (f" {case['family']} K={case['K']}" if case.get("K") else "")
        worst = case.get("worst_error") or {}
        t = case.get("timing") or {}
        lines.append(
            f"| {piece} | {case['n']} | {case['dtype']} | {'yes' if case.get('ok') else '**no**'} | "
            f"{_num(worst.get('triton'), '.1e')} | {_num(worst.get('torch'), '.1e')} | "
            f"{speed(t.get('triton_fwd_ms'), t.get('triton_fwd_gbs'))} | {speed(t.get('torch_fwd_ms'), None)} | "
            f"{speed(t.get('triton_bwd_ms'), t.get('triton_bwd_gbs'))} | {speed(t.get('torch_bwd_ms'), None)} |"
        )
    for case in check["failed"]:
        lines.append(f"- failed: {case['piece']} n={case['n']} {case['dtype']}: {'; '.join(case.get('problems', []))}")
    return lines


def _connection_lines(check: dict[str, Any]) -> list[str]:
    env = check["environment"] or {}
    lines = [f"### `{check['name']}` ({check['status']})", ""]
    if not check["cases"] and not check["floors"]:
        return lines + ["No result was written (see the step's log in `raw.tar`)."]
    meaningful = bool(env.get("meaningful"))
    copy = check["copy_gbs"]
    n = env.get("streams")
    lines.append(
        f"{env.get('gpu') or env.get('device')}; B·T = {env.get('tokens')}, C = {env.get('dim')}, n = {n}; "
        + (f"device copy {copy:,.0f} GB/s (read + written, measured in the step; the H200's datasheet: 4,800). "
           if copy and meaningful else "times on the CPU are not measurements. ")
        + "Floor: the fewest bytes the connection must move (`benchmarks/kernel_bytes.py`): two passes, "
        "8n + 5 vectors of C per token (the streams not staying in cache across the branch), one pass 5n + 3; the "
        "residual add 6. x floor: the time over the two-pass floor's at the copy bandwidth (1.0: only the floor's "
        "bytes, at copy speed). x residual: over the residual add's, same path and dtype. First call: compilation "
        "included. Error: the worst n-wide result against the eager path, ‖a − ref‖/‖ref‖."
    )  # fmt: skip
    if check["floors"]:
        lines += ["", "| family | dtype | two-pass floor | one-pass floor | Triton kernels (model) |",
                  "|---|---|---:|---:|---:|"]  # fmt: skip
        for floor in check["floors"]:
            model = "-"
            if floor.get("model_bytes") is not None:
                vectors = floor.get("model_vectors")
                model = (f"{floor['model_ms']:.3f} ms ({floor['model_bytes'] / 1e9:.2f} GB"
                         + (f", {vectors:.0f} vectors" if vectors else "") + ")")  # fmt: skip
            lines.append(f"| {floor['family']} | {floor['dtype']} | {floor['two_pass_ms']:.3f} ms "
                         f"({floor['vectors_two_pass']} vectors, {floor['two_pass_bytes'] / 1e9:.2f} GB) | "
                         f"{floor['one_pass_ms']:.3f} ms | {model} |")  # fmt: skip
    lines += ["", "| family | dtype | path | fwd+bwd | fwd | bwd | x floor | x residual | first call | error |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for case in check["cases"]:
        head = f"| {case.get('family')} | {case.get('dtype')} | {case.get('path')} |"
        if case.get("skipped"):
            lines.append(f"{head} skipped: {case['skipped']} | | | | | | |")
        elif case.get("ms") is None:
            lines.append(f"{head} **failed**: {'; '.join(case.get('problems', []))} | | | | | | |")
        else:
            flag = "" if case.get("ok", True) else " **no**"
            lines.append(
                f"{head} {case['ms']:.3f} ms{flag} | {case['fwd_ms']:.3f} | {case['bwd_ms']:.3f} | "
                f"{_num(case.get('x_floor'), '.2f', 'x')} | {_num(case.get('vs_residual'), '.2f', 'x')} | "
                f"{_num(case.get('first_call_s'), '.1f', ' s')} | {_num(case.get('worst_error'), '.1e')} |")
    for case in check["failed"]:
        lines.append(f"- failed: {case.get('family')} {case.get('dtype')} {case.get('path')}: "
                     f"{'; '.join(case.get('problems', []))}")  # fmt: skip
    return lines


def markdown(summary: dict[str, Any]) -> str:
    lines = [f"# GPU check: summary ({summary['mode'] or 'unknown mode'})", ""]
    env = summary.get("environment") or {}
    if env:
        gpu = env.get("gpu") or "no GPU"
        lines += [
            f"Environment: {gpu}; torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), triton {env.get('triton')}, "
            f"Python {env.get('python')}, hyper-connections {env.get('hyper-connections') or 'absent'}.",
            "",
        ]
    counts = summary["step_counts"]
    judged = summary["verdict"]
    lines += [f"**Verdict: {judged['text']}.**", ""]
    lines += [f"Generated {summary['generated']}; {summary['seconds']:.0f} s of steps. Steps: "
              + ", ".join(f"{counts[s]} {s}" for s in STATUSES) + " (cut: stopped at its time limit, what it wrote "
              "kept; no failure).", ""]  # fmt: skip
    if summary["in_progress"]:
        lines += [f"**Cut during a step**: its files are in `current/`: {', '.join(summary['in_progress'])}.", ""]
    lines += ["## Steps", "", "| step | kind | tier | status | rc | seconds | limit |",
              "|---|---|---|---|---:|---:|---:|"]  # fmt: skip
    for step in summary["steps"]:
        note = f" ({step['note']})" if step.get("note") else ""
        lines.append(f"| {step.get('name')} | {step.get('kind')} | {step.get('tier') or '-'} | {step.get('status')}"
                     f"{note} | {_num(step.get('rc'), 'd')} | {_num(step.get('seconds'), '.0f')} | "
                     f"{_num(step.get('limit_s'), '.0f')} |")  # fmt: skip
    lines += ["", "## Connection: one call, forward + backward, against the memory-traffic floor", ""]
    if not summary["connections"]:
        lines.append("The connection timing did not run.")
    for check in summary["connections"]:
        lines += _connection_lines(check) + [""]
    lines += ["", "## Kernels: correctness against float64, time and bandwidth", ""]
    if not summary["kernels"]:
        lines.append("The kernel check did not run.")
    for check in summary["kernels"]:
        lines += _kernel_lines(check) + [""]
    lines += ["", "## Tests", ""]
    if not summary["tests"]:
        lines.append("No test step ran.")
    for run in summary["tests"]:
        tests = run["counts"]
        head = f"- `{run['name']}` ({run['status']}): "
        if run["status"] == "skipped":
            lines.append(head + "the budget was spent.")
        elif tests is None:
            lines.append(head + "no results (no JUnit XML and no verbose line in its log).")
        elif "error" in tests:
            lines.append(head + tests["error"])
        else:
            partial = f" (partial, {tests['partial']})" if tests.get("partial") else ""
            lines.append(head + f"{tests['total']} tests{partial}: {tests['passed']} passed, {tests['failed']} failed, "
                         f"{tests['errors']} errors, {tests['skipped']} skipped.")  # fmt: skip
            lines += [f"  - failed: `{name}`" for name in tests["failures"]]
    lines += [
        "",
        "## Training step time and peak memory against residual",
        "",
        "Training steps (forward, cross-entropy, backward, AdamW) of `s2hc bench`, each family interleaved with "
        "residual in every repetition; ratios median [min, max] over the repetitions. bf16 autocast: the forward "
        "under torch.autocast(bfloat16) with float32 weights, as `s2hc train --dtype bfloat16` runs. Built: "
        "seconds to build the model and run its warm-up steps (compilation included).",
    ]
    for run in summary["benches"]:
        lines += ["", f"### {_run_title(run)}", ""]
        if run["status"] == "skipped":
            lines.append("Skipped: the budget was spent.")
            continue
        if run["error"]:
            lines.append(f"Not measured: {run['error']}.")
            continue
        if run["partial"]:
            lines += [f"Partial: {run['partial']}.", ""]
        lines += [
            "| family | n | step | vs residual | tokens/s | peak memory | vs residual | built |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in run["rows"]:
            ratio = _num(row["step_ratio"], ".2f", "x")
            if row["ratio_min"] is not None and row["ratio_max"] is not None:
                ratio += f" [{row['ratio_min']:.2f}, {row['ratio_max']:.2f}]"
            lines.append(
                f"| {row['label']} | {_num(row['n_streams'], 'd')} | {row['step_ms']:,.1f} ms | {ratio} | "
                f"{_num(row['tokens_per_s'], ',.0f')} | {_num(row['peak_mem_mib'], ',.0f', ' MiB')} | "
                f"{_num(row['peak_mem_ratio'], '.2f', 'x')} | {_num(run['built_s'].get(row['label']), '.1f', ' s')} |"
            )
        if run.get("peer") and run["peer"] != "present":
            lines += ["", str(run["peer"])]
    devices = " or ".join(sorted({str(run["device"]).upper() for run in summary["benches"] if run["rows"]})) or "GPU"
    lines += [
        "",
        f"## s2hc's overhead at n = 4 against mHC's published {MHC_PUBLISHED_OVERHEAD_PCT} %",
        "",
        f"DeepSeek's mHC reports {MHC_PUBLISHED_OVERHEAD_PCT} % more training time at n = 4 with its fused "
        "kernels, recomputation and overlapped communication in large-scale bf16 training; the rows below are "
        f"steps of one smaller model on one {devices}: a reference point, not a like-for-like comparison (the bf16 "
        "autocast rows are the closer setting). Overhead = (step ratio to residual - 1) x 100.",
        "",
    ]
    rows = summary["s2hc_vs_mhc_published"]
    if not rows:
        lines.append("No s2hc row at n = 4 was measured.")
    else:
        lines += [
            "| run | precision | variant | s2hc overhead | vs 6.7 % | mhc (same run) "
            "| hyper-connections:mhc (same run) |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        for row in rows:
            lines.append(
                f"| {row['run']} | {_precision(row['dtype'])} | {row['label']} | {row['overhead_pct']:+.1f} % | "
                f"{row['vs_published_pct_points']:+.1f} points | {_num(row['mhc_overhead_pct'], '+.1f', ' %')} | "
                f"{_num(row['peer_overhead_pct'], '+.1f', ' %')} |"
            )
    if summary["tails"]:
        lines += ["", "## Logs of the steps that failed, timed out or are tools (last lines)", ""]
        for name, last in summary["tails"].items():
            lines += [f"`{name}`:", "", "```", *(last or ["(no log)"]), "```", ""]
    returned = summary["returned"]
    archive_note = summary["archive"]["error"] or f"{len(summary['archive']['members'])} members"
    lines += [
        "",
        "## Files",
        "",
        f"{returned['count']} files in the output folder (the device returns at most {MAX_FILES}), "
        f"{returned['bytes'] / 2**20:.2f} MiB; `{ARCHIVE}`: {archive_note} (`tar -xf {ARCHIVE}`). "
        + ("Problems: " + "; ".join(returned["problems"]) + "." if returned["problems"] else "Within the limits."),
        "",
    ]
    lines += [f"- `{f['path']}`" + ("" if f["bytes"] is None else f" ({f['bytes']:,} bytes)")
              for f in returned["files"]]  # fmt: skip
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="print the environment, write DIR/env.json").add_argument("out", type=Path)
    for name, text in (("archive", "append OUT_DIR/current/* to OUT_DIR/raw.tar"),
                       ("summarize", "write OUT_DIR/summary.md and summary.json"),
                       ("finish-step", "archive, then summarize"),
                       ("verdict", "summarize, print the verdict; exit 0 when passed, 1 when failed")):  # fmt: skip
        sub.add_parser(name, help=text).add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "env":
        return write_environment(args.out)
    if not args.out.is_dir():
        parser.error(f"{args.out} is not a directory")
    if args.command in ("archive", "finish-step"):
        names = archive(args.out)
        if args.command == "archive" or names:
            print(f"archived into {ARCHIVE}: {', '.join(names) or 'nothing'}")
        if args.command == "archive":
            return 0
    summary = summarize(args.out)
    if args.command == "verdict":
        print(f"verdict: {summary['verdict']['text']}")
        return 0 if summary["verdict"]["passed"] else 1
    counts = summary["step_counts"]
    tested = [t["counts"] for t in summary["tests"] if t["counts"] and "error" not in t["counts"]]
    passed, total = sum(t["passed"] for t in tested), sum(t["total"] for t in tested)
    tests = f"tests {passed}/{total} passed" if tested else "no tests"
    kernels = [f"kernels {k['passed']}/{len(k['cases'])} passed" for k in summary["kernels"]]
    print(f"summary: {args.out / 'summary.md'} (steps: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES)
          + f"; {', '.join([*kernels, tests])}; {summary['returned']['count']} files)")  # fmt: skip
    if summary["returned"]["problems"]:
        print("returned files: " + "; ".join(summary["returned"]["problems"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
