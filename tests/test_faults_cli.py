"""No traceback for a user's mistake: every bad command line, unwritable output
path, full disk and bad model ends in one line ``s2hc CMD: error: ...`` naming the argument or file, with exit
status 2 (1 for a run that failed on a full disk or out of memory); a real bug still raises.

Most cases run in-process through :func:`s2hc.cli.main` (fast); two run the installed entry point in a subprocess.
"""

from __future__ import annotations

import errno
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import SMALL_MODEL

from s2hc import cli
from s2hc.data.shards import stored_cache_dir

SMALL = "model_overrides={" + ", ".join(f"{k}: {v}" for k, v in SMALL_MODEL.items()) + "}"
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.fixture(scope="module")
def places(tiny_checkpoint, corpus_file, tmp_path_factory) -> dict[str, str]:
    """``{run}``: a real checkpoint; ``{corpus}``: a text file; ``{file}``: a plain file; ``{cache}``: a token
    cache (warm for ``{corpus}``); ``{tmp}``: a fresh directory."""
    root = tmp_path_factory.mktemp("faults")
    (root / "file").write_text("not a directory\n")
    return {"run": str(tiny_checkpoint), "corpus": str(corpus_file), "file": str(root / "file"),
            "cache": str(Path(tiny_checkpoint).parent / "cache"), "tmp": str(root)}


def tiny_train(places: dict[str, str]) -> list[str]:
    """Training options that make a run take a second (the tiny preset shrunk, 2 steps, the corpus file)."""
    return ["--preset", "tiny", "--max-steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1",
            "--data", places["corpus"], "--cache-dir", places["cache"], "--no-progress", "--set", SMALL]


def fill(argv: list[str], places: dict[str, str]) -> list[str]:
    return [item.format(**places) for item in argv]


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``(status, stdout, the last line of stderr)``, checking that stderr holds no traceback."""
    status = cli.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    return status, out, lines[-1] if lines else ""


def assert_error(line: str, command: str, *fragments: str) -> None:
    assert line.startswith(f"s2hc {command}: error: "), line
    for fragment in fragments:
        assert fragment in line, (fragment, line)


# ------------------------------------------------------------------------------------------- bad command lines

BAD_COMMAND_LINES = [  # (argv, exit status, fragments of the error line)
    (["train", "--set", "grad_clip=abc"], 2, ["grad_clip must be a finite number >= 0, got 'abc'"]),
    (["train", "--set", "min_lr_ratio=abc"], 2, ["min_lr_ratio must be a finite number in [0, 1]"]),
    (["train", "--set", "weight_decay=abc"], 2, ["weight_decay must be a finite number >= 0"]),
    (["train", "--set", "beta1=abc"], 2, ["beta1 must be a finite number in [0, 1)"]),
    (["train", "--set", "data=5"], 2, ["data must be a string, got int 5"]),
    (["train", "--set", "out=[1,2]"], 2, ["out must be a string, got list [1, 2]"]),
    (["train", "--set", "compile=maybe"], 2, ["compile must be true or false, got 'maybe'"]),
    (["train", "--set", "lr=.inf"], 2, ["lr must be a finite number in (0, 1], got inf"]),
    (["train", "--set", "lr=inf"], 2, ["lr must be a finite number"]),
    (["train", "--lr", "1e38"], 2, ["lr must be a finite number in (0, 1], got 1e+38"]),
    (["train", "--lr", "nan"], 2, ["lr must be a finite number"]),
    (["train", "--set", "grad_clip=.nan"], 2, ["grad_clip must be a finite number >= 0, got nan"]),
    (["train", "--family", "mhc", "--family-option", "alpha=.nan"], 2, ["family option 'alpha' of 'mhc'"]),
    (["train", "--family", "s2hc", "--family-option", "rotation=foo"], 2, ["rotation must be one of"]),
    (["train", "--family", "s2hc", "--streams", "100000"], 2, ["n_streams must be at most 64"]),
    (["train", "--family", "mhc-lite", "--streams", "7"], 2, ["allow_large=True"]),
    (["train", "--out", ""], 2, ["empty"]),
    (["train", "--batch-size", "0"], 2, ["batch_size must be an integer >= 1, got 0"]),
    (["train", "--max-steps", "abc"], 2, ["--max-steps", "invalid int value"]),
    (["train", "--set", "lr"], 2, ["--set expects KEY=VALUE"]),
    (["train", "--set", "bogus=1"], 2, ["unknown config key(s) ['bogus']"]),
    (["train", "--set", "seed=100000000000000000000000"], 2, ["seed must be an integer in [0, 4294967295]"]),
    (["train", "--config", "{tmp}/missing.yaml"], 2, ["missing.yaml", "does not exist"]),
    (["train", "--config", "{file}"], 2, ["must hold a mapping"]),
    (["compare", "--families", "residual,nope"], 2, ["--families", "'nope'"]),
    (["compare", "--set", "beta2=1"], 2, ["beta2 must be a finite number in [0, 1)"]),
    (["params", "--streams", "100000"], 2, ["--streams must be at most 64"]),
    (["params", "--streams", "13", "--families", "mhc-lite"], 2, ["mhc-lite at n_streams=13", "12 streams"]),
    (["params", "--streams", "13", "--families", "kromhc"], 2, ["kromhc at n_streams=13"]),
    (["params", "--layers", "0"], 2, ["--layers", "must be an integer >= 1"]),
    (["params", "--families", ","], 2, ["--families", "no family named"]),
    (["eval", "{tmp}/missing-run"], 2, ["missing-run", "does not exist"]),
    (["eval", "{file}"], 2, ["not an s2hc checkpoint"]),
    (["eval", "{run}", "--device", "tpu"], 2, ["tpu"]),
    (["eval", "{run}", "--dtype", "float8"], 2, ["--dtype", "invalid choice"]),
    (["eval", "{run}", "--data", "{tmp}/nothing.txt", "--no-progress"], 2, ["nothing.txt", "does not exist"]),
    (["generate", "{run}", "--prompt", "x", "--temperature", "nan"], 2, ["--temperature", "finite number"]),
    (["generate", "{run}", "--prompt", "x", "--max-new-tokens", "100000"], 2, ["max_new_tokens=100000"]),
    (["export", "{tmp}/missing-run", "--out", "{tmp}/hf"], 2, ["missing-run", "does not exist"]),
    (["export", "{file}", "--out", "{tmp}/hf"], 2, ["not an s2hc checkpoint"]),
    (["diagnose"], 2, ["exactly one"]),
    (["diagnose", "{tmp}/missing-run"], 2, ["missing-run", "does not exist"]),
    (["diagnose", "--synthetic", "--streams", "100000"], 2, ["--streams must be at most 64"]),
    (["diagnose", "--synthetic", "--families", "nope"], 2, ["'nope'"]),
    (["bench", "--preset", "huge"], 2, ["preset must be one of"]),
    (["bench", "--device", "tpu"], 2, ["--device", "tpu"]),
]


@pytest.mark.parametrize(("argv", "status", "fragments"), BAD_COMMAND_LINES,
                         ids=[" ".join(a)[:60] for a, _, _ in BAD_COMMAND_LINES])
def test_a_bad_command_line_ends_in_one_line_naming_what_is_wrong(argv, status, fragments, places, capsys,
                                                                  monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing may be written where the tests run
    code, _, line = run_cli(fill(argv, places), capsys)
    assert code == status
    assert_error(line, argv[0], *(fragment.format(**places) for fragment in fragments))
    assert not (tmp_path / "runs").exists()  # refused before anything was made


def test_the_entry_point_prints_no_traceback(tmp_path):
    # The real executable, as a user runs it: a non-finite lr is refused before any data is read.
    command = [sys.executable, "-m", "s2hc", "train", "--max-steps", "1", "--batch-size", "2", "--seq-len", "32",
               "--set", "lr=.inf", "--out", str(tmp_path / "X")]
    process = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert process.returncode == 2
    assert "Traceback" not in process.stderr
    assert process.stderr.strip().splitlines()[-1] == (
        "s2hc train: error: lr must be a finite number in (0, 1], got inf"
    )
    assert not (tmp_path / "X").exists()


# ------------------------------------------------------------------------------------------- unwritable paths

WRITERS = {  # a command that writes, with {path} where the output goes, and the argument the error names
    "train --out": (["train", "{train}", "--out", "{path}"], "--out"),
    "compare --out": (["compare", "--families", "residual", "{train}", "--out", "{path}"], "--out"),
    "export OUT_DIR": (["export", "{run}", "--out", "{path}"], "out_dir"),
    "diagnose --out": (["diagnose", "{run}", "--data", "{corpus}", "--cache-dir", "{cache}", "--tokens", "32",
                        "--out", "{path}"], "--out"),
    "diagnose --synthetic --out": (["diagnose", "--synthetic", "--layers", "2", "--tokens", "8", "--families", "mhc",
                                    "--sweep", "", "--out", "{path}"], "--out"),
    "eval --out": (["eval", "{run}", "--data", "{corpus}", "--cache-dir", "{cache}", "--max-batches", "1",
                       "--no-progress", "--out", "{path}"], "--out"),
    "eval --cache-dir": (["eval", "{run}", "--data", "{corpus}", "--cache-dir", "{path}", "--max-batches", "1",
                          "--no-progress"], "--cache-dir"),
    "train --cache-dir": (["train", "{train}", "--cache-dir", "{path}", "--out", "{tmp}/{name}"], "--cache-dir"),
}


def bad_path(kind: str, places: dict[str, str], tmp_path: Path) -> str:
    if kind == "under a file":
        return f"{places['file']}/sub"
    if kind == "an existing file":
        return places["file"]
    if kind == "under /proc":
        return "/proc/s2hc-no-such-thing/out"
    if kind in ("a dangling link", "under a dangling link"):
        link = tmp_path / "dangling"
        link.symlink_to(tmp_path / "gone")
        return str(link) if kind == "a dangling link" else f"{link}/out"
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o500)
    return str(readonly / "out")


def expand(argv: list[str], places: dict[str, str], path: str, name: str) -> list[str]:
    expanded = []
    for item in argv:
        if item == "{train}":
            expanded += tiny_train(places)
        else:
            expanded.append(item.format(path=path, name=name, **places))
    return expanded


@pytest.mark.parametrize("kind", ["under a file", "an existing file", "under /proc", "read-only directory",
                                  "a dangling link", "under a dangling link"])
@pytest.mark.parametrize("writer", list(WRITERS))
def test_an_unwritable_output_is_refused_in_one_line(writer, kind, places, capsys, tmp_path, monkeypatch):
    if kind == "read-only directory" and IS_ROOT:
        pytest.skip("root ignores permissions (the /proc and under-a-file cases stand in)")
    monkeypatch.chdir(tmp_path)
    argv, argument = WRITERS[writer]
    path = bad_path(kind, places, tmp_path)
    name = f"run-{abs(hash((writer, kind)))}"
    code, _, line = run_cli(expand(argv, places, path, name), capsys)
    assert code == 2
    assert_error(line, argv[0], argument, repr(path), *(["dangling symbolic link"] if "dangling" in kind else []))


# ------------------------------------------------------------------------------------------------- full disk


def fail_fsync_for(monkeypatch, name: str) -> None:
    """``os.fsync`` raises ENOSPC for files called ``name``: a disk that fills up as that file is written."""
    real = os.fsync

    def fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        if name in Path(target).name:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd to name a file descriptor")
def test_a_full_disk_while_writing_eval_results_is_one_line_and_exit_1(places, capsys, tmp_path, monkeypatch):
    fail_fsync_for(monkeypatch, "perplexity.json")
    out = tmp_path / "results"
    argv = ["eval", places["run"], "--data", places["corpus"], "--cache-dir", places["cache"], "--max-batches", "1",
            "--no-progress", "--out", str(out)]
    code, stdout, line = run_cli(argv, capsys)
    assert code == 1
    assert "perplexity" in stdout  # the result was printed before the write failed
    assert_error(line, "eval", "perplexity.json", "No space left on device")
    assert not out.exists()  # no half-written file, no temporary file: the directory made for it is gone too


def test_a_full_disk_while_tokenising_removes_the_partial_shard(places, capsys, tmp_path, monkeypatch):
    from s2hc.data import shards

    def full(file, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards, "_write_all", full)
    cache = tmp_path / "cache"
    argv = ["eval", places["run"], "--data", places["corpus"], "--cache-dir", str(cache), "--max-batches", "1",
            "--no-progress"]
    code, _, line = run_cli(argv, capsys)
    assert code == 1
    assert_error(line, "eval", "val.bin", "No space left on device")
    assert not [p for p in cache.rglob("*") if p.is_file()]  # nothing a later run would trust


def test_a_full_disk_during_export_is_one_line_and_exit_1(places, capsys, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from s2hc.hf.modeling import S2HCForCausalLM

    def save_pretrained(self, *args, **kwargs):  # what safetensors raises on a full disk
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(S2HCForCausalLM, "save_pretrained", save_pretrained)
    code, _, line = run_cli(["export", places["run"], str(tmp_path / "hf")], capsys)
    assert code == 1
    assert_error(line, "export", "model.safetensors", "No space left on device")


@pytest.fixture
def small_filesystem(tmp_path):
    """A real 256 KiB tmpfs, mounted for the test (skipped where mounting is not allowed)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root and mount permission)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_real_full_disk_during_export(places, capsys, small_filesystem):
    pytest.importorskip("transformers")
    code, _, line = run_cli(["export", places["run"], str(small_filesystem / "hf")], capsys)
    assert code == 1
    assert_error(line, "export", str(small_filesystem / "hf"), "No space left on device")


def test_a_real_read_only_filesystem(places, capsys, small_filesystem):
    subprocess.run(["mount", "-o", "remount,ro", str(small_filesystem)], check=True, capture_output=True)
    code, _, line = run_cli(["diagnose", "--synthetic", "--layers", "2", "--tokens", "8", "--families", "mhc",
                             "--sweep", "", "--out", str(small_filesystem / "d")], capsys)
    assert code == 2
    assert_error(line, "diagnose", "--out", str(small_filesystem / "d"), "ead-only")


# ----------------------------------------------------------------------------------- evaluation of bad models


def patch_loaded_model(monkeypatch, change) -> None:
    """Every checkpoint that evaluation, generation and export load gets ``change(model)`` applied: a model gone
    bad elsewhere (the checkpoint writer refuses to save non-finite weights, so it cannot come from a run)."""
    from s2hc.evaluate import loading
    from s2hc.rundir import load_model

    def load(*args, **kwargs):
        model, config = load_model(*args, **kwargs)
        with torch.no_grad():
            change(model)
        return model, config

    monkeypatch.setattr(loading, "load_model", load)
    try:
        export = importlib.import_module("s2hc.hf.export")  # the module (s2hc.hf.export is also the function)
    except ImportError:
        return
    monkeypatch.setattr(export, "load_model", load)


def scale_by_50(model) -> None:
    for p in model.parameters():
        p.mul_(50)


def poison(model) -> None:
    next(model.parameters()).fill_(float("nan"))


def test_eval_perplexity_of_a_huge_loss_is_inf_not_an_overflow(places, capsys, monkeypatch):
    patch_loaded_model(monkeypatch, scale_by_50)
    argv = ["eval", places["run"], "--perplexity", "--data", places["corpus"], "--cache-dir", places["cache"],
            "--max-batches", "1", "--no-progress"]
    code, out, _ = run_cli(argv, capsys)
    assert code == 0
    assert out.startswith("perplexity inf (loss ")


@pytest.mark.parametrize("argv", [
    ["eval", "{run}", "--perplexity", "--data", "{corpus}", "--cache-dir", "{cache}", "--no-progress"],
    ["generate", "{run}", "--prompt", "ROMEO.", "--temperature", "0", "--max-new-tokens", "4"],
    ["generate", "{run}", "--prompt", "ROMEO.", "--temperature", "0.8", "--max-new-tokens", "4"],
    ["export", "{run}", "--out", "{tmp}/hf-nan"],
], ids=["eval", "greedy generate", "sampled generate", "export"])
def test_a_model_with_nan_weights_is_refused_naming_the_checkpoint(argv, places, capsys, monkeypatch):
    if argv[0] == "export":
        pytest.importorskip("transformers")
    patch_loaded_model(monkeypatch, poison)
    code, out, line = run_cli(fill(argv, places), capsys)
    assert code == 2
    assert_error(line, argv[0], repr(places["run"]), "non-finite weights")
    assert out == "" and not Path(places["tmp"], "hf-nan").exists()


def test_perplexity_and_generation_refuse_nan_logits_at_once():
    from helpers import random_model

    from s2hc.evaluate import generate_tokens, perplexity
    from s2hc.evaluate.perplexity import exp_or_inf

    assert exp_or_inf(1.0) == pytest.approx(2.718281828) and exp_or_inf(1e4) == float("inf")
    model = random_model()
    with torch.no_grad():
        poison(model)
    tokens = torch.randint(0, 1024, (4096,)).numpy()
    with pytest.raises(ValueError, match=r"loss is NaN on tokens:- \(within its first 2 windows\)"):
        perplexity(model, tokens, 32, batch_size=2, progress=False)
    for temperature in (0.0, 0.8):
        with pytest.raises(ValueError, match="logits are NaN"):
            generate_tokens(model, [[1, 2, 3]], 4, temperature=temperature, generator=torch.Generator())


# --------------------------------------------------------------------------------- a shared checkpoint's cache


def test_eval_never_writes_into_a_cache_path_stored_by_another_machine(places, capsys, tmp_path, monkeypatch):
    from s2hc.cli import evaluate as cli_evaluate
    from s2hc.evaluate.loading import load_for_eval

    elsewhere = tmp_path / "other-machine" / "cache"  # does not exist here

    def load(*args, **kwargs):
        model, tokenizer, config = load_for_eval(*args, **kwargs)
        return model, tokenizer, config.replace(cache_dir=str(elsewhere))

    monkeypatch.setattr(cli_evaluate, "load_for_eval", load)
    monkeypatch.setenv("S2HC_CACHE_DIR", str(tmp_path / "here"))
    argv = ["eval", places["run"], "--data", places["corpus"], "--max-batches", "1", "--no-progress"]
    code, out, _ = run_cli(argv, capsys)
    assert code == 0 and out.startswith("perplexity ")
    assert not (tmp_path / "other-machine").exists()
    assert list((tmp_path / "here" / "tokens").rglob("val.bin"))  # the default cache of this machine


def test_stored_cache_dir_is_used_only_where_it_is_a_writable_directory(tmp_path):
    assert stored_cache_dir(None) is None
    assert stored_cache_dir(str(tmp_path / "missing")) is None
    (tmp_path / "file").write_text("x")
    assert stored_cache_dir(str(tmp_path / "file")) is None
    assert stored_cache_dir(str(tmp_path)) == tmp_path


# ------------------------------------------------------------------------------------------------- the funnel


@pytest.mark.parametrize(("raised", "status", "line"), [
    (ValueError("a bad\nvalue"), 2, "s2hc params: error: a bad value"),
    (OSError(errno.ENOSPC, "No space left on device", "/data/x.bin"), 1,
     "s2hc params: error: '/data/x.bin': No space left on device; the disk is full"),
    (PermissionError(errno.EACCES, "Permission denied", "/data/x"), 2,
     "s2hc params: error: '/data/x': Permission denied; choose a writable location"),
    (OSError(errno.EROFS, "Read-only file system", "/ro/x"), 2, "s2hc params: error: '/ro/x': Read-only file system"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to "
                  "allocate 79999200000 bytes."), 1, "s2hc params: error: out of memory ("),
    (KeyboardInterrupt(), 130, "s2hc params: interrupted"),
])
def test_the_funnel_turns_a_users_problem_into_one_line(raised, status, line, capsys, monkeypatch):
    def run(args):
        raise raised

    monkeypatch.setattr(cli.params, "run", run)
    code, _, last = run_cli(["params"], capsys)
    assert code == status
    assert last.startswith(line), last


@pytest.mark.parametrize("bug", [RuntimeError("an internal error"), KeyError("x"), TypeError("x"),
                                 AttributeError("x")])
def test_the_funnel_lets_a_real_bug_raise(bug, monkeypatch):
    def run(args):
        raise bug

    monkeypatch.setattr(cli.params, "run", run)
    with pytest.raises(type(bug)):
        cli.main(["params"])


def test_s2hc_traceback_lets_every_error_raise_for_debugging(monkeypatch):
    def run(args):
        raise ValueError("shown with its traceback")

    monkeypatch.setattr(cli.params, "run", run)
    monkeypatch.setenv("S2HC_TRACEBACK", "1")
    with pytest.raises(ValueError, match="shown with its traceback"):
        cli.main(["params"])


def test_a_refused_command_leaves_no_output_directory_behind(places, capsys, tmp_path):
    argv = ["eval", places["run"], "--data", str(tmp_path / "no-such-data.txt"), "--out", str(tmp_path / "a" / "b")]
    code, _, line = run_cli(argv, capsys)
    assert code == 2
    assert_error(line, "eval", "no-such-data.txt", "does not exist")
    assert not (tmp_path / "a").exists()
