"""Kept checkpoints (``keep_checkpoints``, ``keep_best``): ``RUN/checkpoints/step-00000100.pt`` (or ``.dcp/``) for
the newest K steps and ``RUN/checkpoints/best.pt`` for the lowest validation loss, beside the latest; a resume
continues them; ``--step N|best`` picks one in eval, generate, export and diagnose; a write cut short anywhere
leaves only complete checkpoints. Tiny runs of a few steps; the references are the model's own weights recorded
after every step and the run's metrics.jsonl, not the kept files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import small_config
from hypothesis import given
from hypothesis import strategies as st

import s2hc.train.loop as loop
from s2hc.cli import main
from s2hc.rundir import (
    kept_checkpoints,
    load_checkpoint,
    load_model,
    parse_step,
    read_metrics,
    resolve_checkpoint,
)
from s2hc.rundir.guard import clear_run
from s2hc.rundir.layout import is_kept_temporary, is_run_entry, kept_name, parse_kept_name
from s2hc.train import train

K = 3


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokens")  # one token cache for the module: tokenised once


def kept_config(corpus_file, cache, root, **changes):
    values = dict(cache_dir=str(cache), max_steps=6, warmup_steps=1, lr=3e-3, checkpoint_every=1, eval_every=1,
                  log_every=1, keep_checkpoints=K, keep_best=True)
    return small_config(corpus_file, root, **{**values, **changes})


class Recorder:
    """The model's weights after every optimizer step (taken from the model, not from any file; a resumed run
    replays a step exactly, so one recorder serves a run and its resumes), and the validation loss a run is made
    to measure (``losses``: step -> loss; None: the real ones)."""

    def __init__(self, monkeypatch, losses: dict[int, float] | None = None):
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.step = 0
        real_step, recorder = loop._Run.optimizer_step, self

        def optimizer_step(run):
            real_step(run)
            recorder.step = run.step
            recorder.weights[run.step] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                                          for k, v in run.model.state_dict().items()}  # FSDP: whole tensors

        monkeypatch.setattr(loop._Run, "optimizer_step", optimizer_step)
        if losses is not None:
            monkeypatch.setattr(loop, "evaluate", lambda *args: losses[recorder.step])


def val_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r}


def assert_holds(path: Path, step: int, weights: dict[str, torch.Tensor]) -> None:
    """``path`` loads (checksums verified), names ``step`` and holds exactly the model of that step."""
    saved = load_checkpoint(path)
    assert saved.step == step
    assert saved.model.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(saved.model[name], tensor), (path, name)


def assert_only_complete_checkpoints(run_dir: Path) -> None:
    """Every name in RUN/checkpoints/ is a kept checkpoint that loads, verified; nothing temporary anywhere."""
    run_dir = Path(run_dir)
    for path in (run_dir / "checkpoints").iterdir():
        assert parse_kept_name(path.name) is not None, path
        load_checkpoint(path, with_model=False)  # verified
    leftovers = [p for p in run_dir.rglob("*") if p.name.endswith((".tmp", ".old"))]
    assert not leftovers


# A validation loss that falls, rises and falls again: its lowest is neither the first step nor the last, nor
# among the 3 newest, and the two last (a resume's, after step 4) are lower than any of 3 and 4's.
LOSSES = {1: 4.0, 2: 2.0, 3: 3.5, 4: 2.5, 5: 3.0, 6: 2.25}
DOWN = {1: 4.0, 2: 3.0, 3: 2.0, 4: 1.0}  # a new best at every step


@pytest.fixture(scope="module")
def run(corpus_file, cache, tmp_path_factory):
    """6 steps, a checkpoint and a (made-up, non-monotonic) validation loss after each, keep 3 and the best;
    with the weights after every step."""
    with pytest.MonkeyPatch.context() as patch:
        recorder = Recorder(patch, LOSSES)
        config = kept_config(corpus_file, cache, tmp_path_factory.mktemp("kept"))
        train(config)
    return Path(config.out), recorder.weights


# ------------------------------------------------------------------------------------------ names and steps


@given(st.integers(0, 10**12), st.booleans())
def test_kept_names_read_back_and_sort_by_step(step, sharded):
    name = kept_name(step, sharded)
    assert parse_kept_name(name) == (step, sharded)
    assert is_kept_temporary(f".{name}.s2hc-0123abcd.tmp") and not parse_kept_name(f".{name}.s2hc-0123abcd.tmp")
    assert is_kept_temporary(f"{kept_name(step, True)}.tmp") and is_kept_temporary(f"{kept_name(step, True)}.old")
    assert not is_kept_temporary(f"{kept_name(step, False)}.old") and not is_kept_temporary(f".{name}.mine.tmp")
    if step < 10**8:  # zero-padded: the names sort as the steps do
        assert (kept_name(step, sharded) < kept_name(step + 1, sharded))


@given(st.integers(0, 10**12))
def test_a_step_is_a_number_or_best(step):
    assert parse_step(step) == parse_step(str(step)) == step
    assert parse_step("best") == "best"


@pytest.mark.parametrize("bad", [-1, "-1", "1.5", "latest", "", True, None, 2.0])
def test_a_step_that_is_not_one_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"step must be a step number >= 0 or 'best', got "):
        parse_step(bad)


def test_overwrite_removes_the_kept_checkpoints(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step-00000001.pt").write_text("x")
    (tmp_path / "notes.txt").write_text("mine")
    assert is_run_entry("checkpoints")
    clear_run(tmp_path, log=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# ------------------------------------------------------------------------------------- what a run keeps


def test_the_newest_k_steps_are_kept_each_holding_its_step(run):
    run_dir, weights = run
    kept = kept_checkpoints(run_dir)
    steps = sorted(weights)[-K:]
    assert [k for k in kept if k != "best"] == steps
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == \
        sorted([kept_name(s, False) for s in steps] + ["best.pt"])
    for step in steps:
        assert_holds(kept[step], step, weights[step])
        assert resolve_checkpoint(run_dir, step) == resolve_checkpoint(run_dir, str(step)) == kept[step]
    assert_holds(run_dir / "checkpoint.pt", max(weights), weights[max(weights)])
    # written once: the newest step checkpoint is a byte-for-byte copy of the latest's file, never the file itself
    assert (kept[max(steps)].read_bytes() == (run_dir / "checkpoint.pt").read_bytes())
    assert not os.path.samefile(kept[max(steps)], run_dir / "checkpoint.pt")
    assert_only_complete_checkpoints(run_dir)


def test_the_best_checkpoint_is_that_of_the_lowest_validation_loss(run):
    run_dir, weights = run
    losses = val_losses(run_dir)
    assert losses == LOSSES  # the made-up losses were what the run measured
    best_step = min(losses, key=losses.get)
    assert best_step not in (min(losses), max(losses))  # neither the first evaluation nor the last
    best = resolve_checkpoint(run_dir, "best")
    assert best == run_dir / "checkpoints" / "best.pt"
    assert_holds(best, best_step, weights[best_step])
    assert load_checkpoint(best, with_model=False).history.val_loss == min(losses.values())
    model, _ = load_model(run_dir, step="best")
    assert all(torch.equal(t, weights[best_step][k]) for k, t in model.state_dict().items())


def test_a_resume_continues_the_numbering_the_pruning_and_the_best_loss(corpus_file, cache, tmp_path, monkeypatch):
    """4 steps, then resumed to 6: the steps kept are still the newest 3 (step 3 pruned by the resumed run), and
    the best of before the resume (step 2) stays the best, though the resumed run's first losses are the lowest
    it measures itself."""
    config = kept_config(corpus_file, cache, tmp_path, max_steps=4)
    recorder = Recorder(monkeypatch, LOSSES)
    train(config)
    assert list(kept_checkpoints(config.out)) == [2, 3, 4, "best"]
    train(config.replace(max_steps=6), resume=True)
    kept = kept_checkpoints(config.out)
    assert list(kept) == [4, 5, 6, "best"]
    for step in (4, 5, 6):
        assert_holds(kept[step], step, recorder.weights[step])
    losses = val_losses(config.out)
    assert losses == LOSSES
    # a resumed run that forgot the best loss would have taken step 5's 3.0, then step 6's 2.25
    assert load_checkpoint(kept["best"], with_model=False).step == min(losses, key=losses.get) == 2
    assert_only_complete_checkpoints(Path(config.out))


def test_without_the_options_only_the_latest_is_written(corpus_file, cache, tmp_path):
    config = kept_config(corpus_file, cache, tmp_path, max_steps=2, keep_checkpoints=0, keep_best=False)
    train(config)
    assert sorted(p.name for p in Path(config.out).iterdir()) == ["checkpoint.pt", "config.yaml", "metrics.jsonl"]
    with pytest.raises(ValueError, match=r"keeps no best checkpoint \(a run keeps one with --keep-best\); it keeps "
                                         r"step 2 and no best checkpoint$"):
        resolve_checkpoint(config.out, "best")
    assert resolve_checkpoint(config.out, 2) == Path(config.out) / "checkpoint.pt"  # the latest is of step 2


def test_sharded_runs_keep_sharded_checkpoints_copied_from_the_latest(corpus_file, cache, tmp_path, monkeypatch):
    recorder = Recorder(monkeypatch)
    config = kept_config(corpus_file, cache, tmp_path, parallel="fsdp", max_steps=4, keep_checkpoints=2)
    train(config)
    kept = kept_checkpoints(config.out)
    assert list(kept) == [3, 4, "best"] and all(p.suffix == ".dcp" for p in kept.values())
    for step in (3, 4):
        assert_holds(kept[step], step, recorder.weights[step])
    losses = val_losses(config.out)
    assert_holds(kept["best"], min(losses, key=losses.get), recorder.weights[min(losses, key=losses.get)])
    latest = Path(config.out) / "checkpoint.dcp"
    for file in latest.iterdir():
        assert (kept[4] / file.name).read_bytes() == file.read_bytes()
    assert_only_complete_checkpoints(Path(config.out))


def test_the_rollback_a_damaged_latest_advises_leaves_the_other_kept_checkpoints_as_they_were(corpus_file, cache,
                                                                                               tmp_path, capsys):
    """`cp checkpoints/step-3.pt checkpoint.pt` writes into the file checkpoint.pt names: were the kept ones hard
    links to the latest, it would rewrite step-4.pt and best.pt with step 3, and `--step 4` would read step 3."""
    config = kept_config(corpus_file, cache, tmp_path, max_steps=4)
    train(config)
    run_dir = Path(config.out)
    kept = kept_checkpoints(run_dir)
    assert list(kept) == [2, 3, 4, "best"]
    files = [run_dir / "checkpoint.pt", *kept.values()]
    assert all(os.stat(path).st_nlink == 1 for path in files)  # no two names share a file
    before = {path: path.read_bytes() for path in kept.values()}
    shutil.copyfile(kept[3], run_dir / "checkpoint.pt")  # as cp does: into the existing file
    assert {path: path.read_bytes() for path in kept.values()} == before
    assert load_checkpoint(run_dir, step=4).step == 4 and load_checkpoint(run_dir, step="best").step == 4
    from s2hc.evaluate import checkpoint_perplexity

    assert main(["eval", str(run_dir), "--step", "4", "--max-batches", "1", "--batch-size", "2", "--no-progress",
                 "--out", str(tmp_path / "eval")]) == 0
    loss = json.loads((tmp_path / "eval" / "perplexity.json").read_text())["loss"]
    step_3 = checkpoint_perplexity(run_dir / "checkpoint.pt", max_batches=1, batch_size=2, progress=False).loss
    assert loss != step_3  # step 4's model, not the rolled-back latest's
    train(config, resume=True)  # resumes from step 3, and steps 4 again
    assert load_checkpoint(run_dir, with_model=False).step == 4
    assert_only_complete_checkpoints(run_dir)


# ------------------------------------------------------------------------------- writes cut short (kill -9)


class Killed(BaseException):
    """What a SIGKILL does to a write: it stops there; no handler of s2hc (they catch OSError, Exception) runs."""


def kill_at(monkeypatch, module, name, when):
    """Replace ``module.name`` by a function that raises Killed when ``when(*args)`` holds (after calling the
    real one when ``when`` returns "after"), else calls the real one."""
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        moment = when(*args)
        if moment == "before":
            raise Killed(name)
        result = real(*args, **kwargs)
        if moment == "after":
            raise Killed(name)
        return result

    monkeypatch.setattr(module, name, wrapper)


def _named(path, prefix: str) -> bool:
    return Path(path).name.startswith(prefix)


MOMENTS = {
    # a step checkpoint copied to its temporary name, not yet renamed
    "renaming a step": dict(module=os, name="replace", when=lambda src, dst: "before"
                            if _named(src, ".step-00000003") else None),
    # the best one written first (a new best at step 3), the latest not yet copied from it
    "before the latest follows the best": dict(
        module=shutil, name="copyfileobj", when=lambda src, dst, *rest: "before"
        if _named(src.name, "best") and _named(dst.name, ".checkpoint") else None),
    # a copy half written
    "copying a step": dict(module=shutil, name="copyfileobj",
                           when=lambda src, dst, *rest: "before" if _named(dst.name, ".step-00000003") else None),
    # a sharded best being swapped in: the old one moved aside, the new one not yet renamed into place
    "swapping a sharded best in": dict(module=os, name="replace", sharded=True,
                                       when=lambda src, dst: "before" if Path(src).name == "best.dcp.tmp"
                                       and Path(dst).with_name("best.dcp.old").exists() else None),
    # a sharded step checkpoint pruned: renamed aside, its removal cut short
    "pruning a sharded step": dict(module=shutil, name="rmtree", sharded=True,
                                   when=lambda path, *rest: "before" if _named(path, ".step-00000001") else None),
}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_write_cut_short_leaves_only_complete_checkpoints_and_the_run_resumes(corpus_file, cache, tmp_path,
                                                                               monkeypatch, moment):
    spec = MOMENTS[moment]
    config = kept_config(corpus_file, cache, tmp_path, max_steps=4, keep_checkpoints=2,
                         parallel="fsdp" if spec.get("sharded") else "none")
    recorder = Recorder(monkeypatch, DOWN)
    with monkeypatch.context() as patch:
        kill_at(patch, spec["module"], spec["name"], spec["when"])
        with pytest.raises(Killed):
            train(config)
    run_dir = Path(config.out)
    for path in kept_checkpoints(run_dir).values():  # what a reader finds now: complete checkpoints only
        saved = load_checkpoint(path)
        assert_holds(path, saved.step, recorder.weights[saved.step])
    train(config, resume=True)  # the guard removes what the cut write left, puts a cut swap's checkpoint back
    assert_only_complete_checkpoints(run_dir)
    kept = kept_checkpoints(run_dir)
    steps = [k for k in kept if k != "best"]
    assert len(steps) == 2 and steps[-1] == 4  # the newest 2 (a step cut short while written is not among them)
    for step in steps:
        assert_holds(kept[step], step, recorder.weights[step])
    assert val_losses(run_dir) == DOWN
    assert_holds(kept["best"], 4, recorder.weights[4])


def test_a_damaged_latest_is_refused_by_resume_as_before_naming_the_kept_ones(run, capsys):
    run_dir, weights = run
    copy = run_dir.parent / "damaged"
    shutil.copytree(run_dir, copy)  # copies: no file shares its bytes with the module's run any more
    latest = copy / "checkpoint.pt"
    data = bytearray(latest.read_bytes())
    data[len(data) // 2] ^= 0x10
    latest.write_bytes(bytes(data))
    kept = rf"'{copy}/checkpoints' \(step-00000004.pt, step-00000005.pt, step-00000006.pt, best.pt\) over it$"
    with pytest.raises(ValueError, match=rf"is damaged: checksum mismatch .* or start the run again with --overwrite, "
                                         rf"or resume from a kept checkpoint: copy an intact one of {kept}"):
        load_checkpoint(copy)
    capsys.readouterr()
    assert main(["train", "--out", str(copy), "--resume"]) == 2  # refused, as without kept checkpoints
    line = error_line(capsys)
    assert "is damaged: checksum mismatch" in line and line.endswith("best.pt) over it")
    assert_holds(resolve_checkpoint(copy, 5), 5, weights[5])  # the others are intact


# --------------------------------------------------------------------------- the commands: --step N|best


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    return lines[-1]


def test_eval_and_generate_read_the_step_or_the_best_asked_for(run, tmp_path, capsys):
    run_dir, weights = run
    perplexity = {}
    for step in ("4", "best", None):
        out = tmp_path / f"eval-{step}"
        assert main(["eval", str(run_dir), *(["--step", step] if step else []), "--max-batches", "1",
                     "--batch-size", "2", "--no-progress", "--out", str(out)]) == 0
        perplexity[step] = json.loads((out / "perplexity.json").read_text())["loss"]
    from s2hc.evaluate import checkpoint_perplexity

    for step in ("4", "best"):
        expected = checkpoint_perplexity(resolve_checkpoint(run_dir, step), max_batches=1, batch_size=2,
                                         progress=False).loss
        assert perplexity[step] == pytest.approx(expected, rel=1e-6)
    assert len(set(perplexity.values())) == 3  # three different models
    capsys.readouterr()
    assert main(["generate", str(run_dir), "--step", "5", "--prompt", "To be", "--max-new-tokens", "2",
                 "--temperature", "0"]) == 0


def test_export_and_diagnose_read_the_step_or_the_best_asked_for(run, tmp_path, capsys):
    run_dir, weights = run
    losses = val_losses(run_dir)
    best_step = min(losses, key=losses.get)
    assert main(["diagnose", str(run_dir), "--step", "best", "--tokens", "32"]) == 0
    report = json.loads((run_dir / "diagnostics" / "best" / "diagnostics.json").read_text())
    assert report["checkpoint"] == str(run_dir / "checkpoints" / "best.pt")
    pytest.importorskip("transformers", reason="s2hc export needs the hf extra")
    pytest.importorskip("safetensors", reason="s2hc export needs the hf extra")
    for step, expected in (("5", 5), ("best", best_step)):
        out = tmp_path / f"hf-{step}"
        assert main(["export", str(run_dir), "--step", step, "--out", str(out)]) == 0
        assert json.loads((out / "s2hc_training.json").read_text())["step"] == expected


@pytest.mark.parametrize("command", [
    ["eval"], ["generate", "--prompt", "x"], ["export", "--out", "{tmp}/hf"], ["diagnose"],
])
def test_a_step_not_kept_is_refused_in_one_line_naming_those_that_are(run, tmp_path, capsys, command):
    run_dir, _ = run
    losses = val_losses(run_dir)
    name, *rest = [part.replace("{tmp}", str(tmp_path)) for part in command]
    if name == "export":
        pytest.importorskip("transformers", reason="s2hc export needs the hf extra")
    assert main([name, str(run_dir), "--step", "2", *rest]) == 2
    assert error_line(capsys).endswith(
        f"run directory {str(run_dir)!r} keeps no checkpoint of step 2; it keeps steps 4, 5, 6 and best "
        f"(step {min(losses, key=losses.get)})")
    assert main([name, str(run_dir / "checkpoint.pt"), "--step", "4", *rest]) == 2
    assert "is a checkpoint itself; give its run directory, or no step" in error_line(capsys)
    for bad in ("last", "-1", "4.5"):  # not a step: refused naming the steps there are
        assert main([name, str(run_dir), "--step", bad, *rest]) == 2
        assert error_line(capsys).endswith(
            f"--step {bad!r}: must be a step number >= 0 or 'best'; run directory {str(run_dir)!r} keeps steps 4, 5, 6 "
            f"and best (step {min(losses, key=losses.get)})")
    assert not (tmp_path / "hf").exists()


def listing(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", ["best.pt", "step-00000005.pt"])
def test_a_kept_checkpoint_of_another_run_is_refused_by_resume_and_step(run, corpus_file, cache, tmp_path, capsys,
                                                                        name):
    run_dir, _ = run
    mine = tmp_path / "mine"
    shutil.copytree(run_dir, mine)
    (tmp_path / "other").mkdir()
    other = kept_config(corpus_file, cache, tmp_path / "other", max_steps=2)
    train(other)
    shutil.copyfile(Path(other.out) / "checkpoints" / "best.pt", mine / "checkpoints" / name)
    before = listing(mine)
    capsys.readouterr()
    refused = (f"checkpoints '{mine}/checkpoints/{name}' and '{mine}/checkpoint.pt' belong to two different runs "
               "(run ids ")
    assert main(["train", "--out", str(mine), "--resume", "--max-steps", "7"]) == 2
    assert refused in error_line(capsys)
    step = "best" if name == "best.pt" else "5"
    assert main(["eval", str(mine), "--step", step, "--max-batches", "1", "--no-progress"]) == 2
    line = error_line(capsys)
    assert refused in line and line.endswith("move it out (a run directory holds one run's checkpoints)")
    with pytest.raises(ValueError, match="belong to two different runs"):
        load_model(mine, step=step)
    assert listing(mine) == before  # nothing written, nothing pruned
    assert load_checkpoint(mine, step=4).step == 4  # the run's own are read as before


def test_a_checkpoints_folder_that_is_a_link_is_refused_and_nothing_outside_the_run_is_touched(run, tmp_path,
                                                                                             capsys):
    run_dir, _ = run
    mine, outside = tmp_path / "mine", tmp_path / "outside"
    shutil.copytree(run_dir, mine)
    (mine / "checkpoints").rename(outside)
    (outside / ".step-00000009.pt.s2hc-0123abcd.tmp").write_bytes(b"what a cleaning would remove")
    (mine / "checkpoints").symlink_to(outside, target_is_directory=True)
    before = listing(outside)
    capsys.readouterr()
    refused = f"{str(mine / 'checkpoints')!r} is a symbolic link (to {str(outside)!r}); a run keeps its checkpoints"
    assert main(["eval", str(mine), "--step", "5", "--max-batches", "1", "--no-progress"]) == 2
    assert refused in error_line(capsys)
    assert main(["train", "--out", str(mine), "--resume", "--max-steps", "7"]) == 2
    assert refused in error_line(capsys)
    with pytest.raises(ValueError, match="is a symbolic link"):
        kept_checkpoints(mine)
    assert listing(outside) == before
    assert load_checkpoint(mine, with_model=False).step == 6  # the latest alone still reads
    # one kept checkpoint that is a link: refused too
    (mine / "checkpoints").unlink()
    (mine / "checkpoints").mkdir()
    (mine / "checkpoints" / "step-00000005.pt").symlink_to(outside / "step-00000005.pt")
    assert main(["eval", str(mine), "--step", "5", "--max-batches", "1", "--no-progress"]) == 2
    assert "step-00000005.pt' is a symbolic link" in error_line(capsys)
    assert listing(outside) == before
