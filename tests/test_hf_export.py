"""transformers integration: export -> AutoModelForCausalLM / AutoTokenizer -> identical logits and tokens,
every residual family through save/load, cached and uncached generate(), lm-eval's `hf` model on the export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from s2hc import families
from s2hc.cli import main
from s2hc.connection import forms
from s2hc.data import get_tokenizer
from s2hc.evaluate import generate_tokens
from s2hc.models import Transformer, get_preset
from s2hc.rundir import load_model

transformers = pytest.importorskip("transformers")

import helpers  # noqa: E402
from helpers import OFFLINE_ENV  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from s2hc.hf import S2HCConfig, S2HCForCausalLM, from_s2hc  # noqa: E402
from s2hc.hf.export import hf_tokenizer  # noqa: E402

TEXTS = [
    "ROMEO.\nBut soft, what light through yonder window breaks?",
    "In the beginning God created the heaven and the earth.\n\n  And the earth was without form",
    "Of Man’s first disobedience — and the fruit… ä ö ü 1611",
]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    """The shared 3-step s2hc (n = 4) checkpoint (tests/conftest.py)."""
    return tiny_checkpoint


@pytest.fixture(scope="module")
def exported(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "model"
    assert main(["export", str(tiny), "--out", str(out)]) == 0
    return out


def random_model(*args, **kwargs) -> Transformer:
    """helpers.random_model with the shipped tokenizer's 4 096-token vocabulary."""
    return helpers.random_model(*args, **{"vocab_size": 4096, **kwargs})


# ---- export -> from_pretrained -------------------------------------------------------------------------


def test_export_loads_with_auto_classes_and_gives_identical_logits(tiny, exported):
    model, config = load_model(tiny)
    model.eval()
    hf = AutoModelForCausalLM.from_pretrained(exported).eval()
    assert isinstance(hf, S2HCForCausalLM) and hf.config.model_config() == model.config
    tokenizer = AutoTokenizer.from_pretrained(exported)
    ours = get_tokenizer(config.tokenizer)
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == ours.encode(text) and tokenizer.decode(ids) == text
    batch = torch.tensor([ours.encode(TEXTS[0])])
    with torch.no_grad():
        assert torch.equal(hf(batch).logits, model(batch))
        assert torch.equal(hf(input_ids=batch, use_cache=False).logits, model(batch))
    assert tokenizer.eos_token_id == ours.eot_id == hf.config.eos_token_id == hf.generation_config.pad_token_id


def test_export_directory_contents(tiny, exported):
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "configuration_s2hc.py", "modeling_s2hc.py", "s2hc_training.json"} <= names  # fmt: skip
    config = json.loads((exported / "config.json").read_text())
    model, train_config = load_model(tiny)
    assert config["model_type"] == "s2hc" and config["s2hc"] == model.config.to_dict()
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_s2hc.S2HCForCausalLM"
    assert config["max_position_embeddings"] == model.config.max_seq_len and config["tie_word_embeddings"] is True
    provenance = json.loads((exported / "s2hc_training.json").read_text())
    assert provenance["step"] == 3 and provenance["train_config"] == train_config.to_dict()


def test_trust_remote_code_loads_without_importing_s2hc(exported):
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "assert 's2hc' not in sys.modules\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(exported)!r}, trust_remote_code=True)\n"
        f"t = AutoTokenizer.from_pretrained({str(exported)!r})\n"
        "out = m.generate(**t('ROMEO.', return_tensors='pt'), max_new_tokens=3, do_sample=False)\n"
        "print(type(m).__name__, out.shape[1] - len(t('ROMEO.')['input_ids']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **OFFLINE_ENV}, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["S2HCForCausalLM", "3"]


@pytest.mark.parametrize("family", families())
def test_every_family_survives_save_and_load(family, tmp_path):
    """Fixed buffers (Helmert bases, permutation tables) are rebuilt after transformers' meta-device load."""
    model = random_model(family, 1 if forms.get(family).max_streams == 1 else 3)
    hf = from_s2hc(model, get_tokenizer())
    hf.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 4096, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids))
    for (name, a), (_, b) in zip(model.named_buffers(), loaded.model.named_buffers()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("family", ["gated-residual", "mhc"])
def test_learned_stream_scaling_survives_save_and_load(family, tmp_path):
    model = random_model(family, 3, lss_init=0.5)
    assert model.stream_scale is not None and (family != "gated-residual" or model.stream_head is not None)
    from_s2hc(model, get_tokenizer()).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.model_config() == model.config
    assert torch.equal(loaded.model.stream_scale.scale, model.stream_scale.scale)
    ids = torch.randint(0, 4096, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids))


def test_an_untied_qwen3_shape_survives_save_and_load(tmp_path):
    model = random_model("s2hc", 4, preset="qwen3-0.6b", n_kv_heads=1, head_dim=16)
    assert not model.config.tie_embeddings
    from_s2hc(model).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.model.lm_head.weight is not loaded.model.embed.weight
    ids = torch.randint(0, 4096, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids))


def test_export_into_an_export_needs_overwrite_and_shows_no_progress_bar(tiny, tmp_path, capsys):
    """A second export to the same --out is refused, as `s2hc train` refuses a directory holding a run, unless
    --overwrite; and transformers' "Writing model shards ... 100%|███" bar stays out of non-terminal output."""
    out = tmp_path / "model"
    assert main(["export", str(tiny), "--out", str(out)]) == 0
    first = capsys.readouterr()
    assert "Writing model shards" not in first.err + first.out and "█" not in first.err
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert main(["export", str(tiny), "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"s2hc export: error: {str(out)!r} already holds an export (") and "--overwrite" in line
    assert (out / "model.safetensors").stat().st_mtime_ns == before  # untouched
    assert main(["export", str(tiny), "--out", str(out), "--overwrite"]) == 0
    assert transformers.utils.logging.is_progress_bar_enabled()  # the bars are back for whoever comes next


def test_bfloat16_export(tiny, tmp_path):
    assert main(["export", str(tiny), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert hf.model.embed.weight.dtype == torch.bfloat16
    model, _ = load_model(tiny)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits.float(), model(ids), atol=0.1, rtol=0.05)


def test_config_is_validated_and_registered():
    assert AutoConfig.for_model("s2hc").__class__ is S2HCConfig
    with pytest.raises(ValueError, match="family must be one of"):
        S2HCConfig(s2hc={"family": "nope"})
    config = S2HCConfig(s2hc=get_preset("tiny", family="s2hc", n_streams=4).to_dict())
    assert (config.hidden_size, config.num_hidden_layers, config.layer_types) == (128, 4, ["full_attention"] * 4)


def test_gpt2_tokenizer_exports_as_the_same_encoding():
    pytest.importorskip("tiktoken")
    ours = get_tokenizer("gpt2")
    theirs = hf_tokenizer(ours)
    for text in TEXTS:
        assert theirs(text)["input_ids"] == ours.encode(text)
    assert theirs.eos_token_id == ours.eot_id == 50256


# ---- generate() with and without the KV cache -----------------------------------------------------------

FAMILIES = {
    "s2hc-4": dict(family="s2hc", n_streams=4),
    "residual": dict(family="residual", n_streams=1),
    "gemma3-window": dict(family="mhc", n_streams=2, preset="gemma3-1b", n_heads=2, n_kv_heads=1, head_dim=16,
                          sliding_window=5, sliding_window_pattern=2, query_pre_attn_scalar=16.0),
    "gpt2-learned": dict(family="kromhc", n_streams=4, preset="gpt2-small"),
    "gated-residual-lss": dict(family="gated-residual", n_streams=3, lss_init=0.5),
    "attn-res-block": dict(family="attn-res", n_streams=1, n_layers=3, family_options={"block_size": 2}),
    "wide-residual": dict(family="wide-residual", n_streams=3),
}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_gives_the_same_tokens_with_and_without_the_cache(family):
    model = random_model(**FAMILIES[family])
    tokenizer = get_tokenizer()
    hf = from_s2hc(model, tokenizer)
    fast = hf_tokenizer(tokenizer)
    fast.padding_side = "left"
    prompts = ["ROMEO.\nBut soft, what light", "And God said", "Of Man's first disobedience, and"]
    batch = fast(prompts, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=8, do_sample=False, min_new_tokens=8)
    cached = hf.generate(**batch, use_cache=True, **kwargs)
    uncached = hf.generate(**batch, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    new = cached[:, batch["input_ids"].shape[1]:].tolist()
    assert new == generate_tokens(model, [tokenizer.encode(p) for p in prompts], 8)  # s2hc's own decoding
    alone = hf.generate(**fast(prompts[1:2], return_tensors="pt"), use_cache=True, **kwargs)
    assert alone[0, -8:].tolist() == new[1]  # left padding changes nothing
    assert len({tuple(t) for t in new}) == 3


# ---- lm-eval's own `hf` model on the exported directory -------------------------------------------------


def test_lm_eval_hf_model_scores_the_export_as_the_s2hc_adapter_does(tiny, exported):
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from s2hc.evaluate.harness import S2HCLM

    hf = HFLM(pretrained=str(exported), trust_remote_code=True, batch_size=2, device="cpu")
    ours = S2HCLM(checkpoint=str(tiny), batch_size=3, progress=False)
    requests = [Instance("loglikelihood", {}, pair, 0) for pair in
                [("ROMEO.\nBut soft", ", what light"), ("", "Hello world"), ("And God said", " Let there be light")]]
    for (a, greedy_a), (b, greedy_b) in zip(
        hf.loglikelihood(requests, disable_tqdm=True), ours.loglikelihood(requests)
    ):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b
    rolling = [Instance("loglikelihood_rolling", {}, (" ".join(TEXTS) * 4,), 0)]
    assert hf.loglikelihood_rolling(rolling, disable_tqdm=True)[0] == pytest.approx(
        ours.loglikelihood_rolling(rolling)[0], abs=1e-3
    )
    until = [Instance("generate_until", {}, ("ROMEO.", {"until": ["\n\n"], "max_gen_toks": 8}), 0)]
    assert hf.generate_until(until, disable_tqdm=True) == ours.generate_until(until)


@pytest.mark.parametrize("preset, cls", [("tiny", "LlamaForCausalLM"), ("qwen3-0.6b", "Qwen3ForCausalLM"),
                                         ("llama3.2-1b", "LlamaForCausalLM")])
def test_a_residual_model_exports_to_transformers_own_class(preset, cls, tmp_path):
    """``to_native``: a residual model as transformers' Llama or Qwen3 class, the same logits (RoPE scaling,
    untied heads and QK-norm included), saved and loaded without s2hc's modules."""
    from s2hc.hf.export import to_native

    shapes = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64, max_seq_len=64)
    model = random_model("residual", 1, preset=preset, **shapes)
    hf = to_native(model, get_tokenizer())
    assert type(hf).__name__ == cls
    hf.save_pretrained(tmp_path)
    assert not (tmp_path / "modeling_s2hc.py").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 4096, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids), rtol=1e-4, atol=1e-4)


def test_native_export_of_a_run_and_what_it_refuses(tiny, corpus_file, tmp_path, capsys):
    """``s2hc export --native``: refused for a model with streams (in one line, naming the other export); a residual
    run exports and loads as transformers' own class."""
    assert main(["export", str(tiny), "--out", str(tmp_path / "n"), "--native"]) == 2
    assert "a native transformers class holds the residual model only, got family 's2hc'" in capsys.readouterr().err
    from s2hc.train import train

    run = helpers.small_config(corpus_file, tmp_path, family="residual", n_streams=1, max_steps=2)
    train(run)
    assert main(["export", run.out, "--out", str(tmp_path / "native"), "--native"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    model, _ = load_model(run.out)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model.eval()(ids), rtol=1e-4, atol=1e-4)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    from s2hc.hf.export import to_native

    with pytest.raises(ValueError, match="no native transformers class computes this model"):
        to_native(random_model("residual", 1, preset="gemma3-1b", n_heads=2, n_kv_heads=1, head_dim=16))
