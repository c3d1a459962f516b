"""Upcycling: a residual model's weights in a hyper-connection model that computes the same logits at step 0.

Every qualifying family at n = 2, 3, 4, 8 (mhc-lite up to its limit) in float32 (≤ 1e-4, in practice rounding)
and under bfloat16 autocast (as close as the source's own bfloat16 run); the streams separate and the mixing
gets real gradients; the Hugging Face sources of every architecture the presets load, through the command line;
`train --init-from`; eval, diagnose and export on the result; and the refusals.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import small_config
from test_hf_parity import ARCHITECTURES, VOCAB, hf_config, randomise, tokens

from s2hc.cli import main
from s2hc.diagnostics import collect, diagnose_checkpoint, mixing_connections
from s2hc.models import Transformer, get_preset
from s2hc.models.widen import check_upcyclable, upcyclable_families, upcycle_model, upcycling_biases
from s2hc.rundir import load_checkpoint, load_model, read_metrics
from s2hc.train import train
from s2hc.train.init_from import load_initial_weights

transformers = pytest.importorskip("transformers")

# The mixing families whose rows and columns sum to 1, and the wide residual (it starts as its source by
# construction: one block read, every block written), and DeepSeek-V4.1's single-pass mHC (its first read is stream
# 0 of the copies, the embedding).
FAMILIES = ["identity", "mhc", "mhc-lite", "kromhc", "s2hc", "isometric", "ihc", "wide-residual", "mhc-lagged"]
TOLERANCE = 1e-4
#: DeepSeek's Sinkhorn keeps the streams' mean only to 1 − hc_eps per connection (measured in
#: test_deepseek_v4_mhc_upcycles_to_within_its_epsilon); with hc_eps = 0 the single-pass mHC is exact too.
UPCYCLE_OPTIONS = {"mhc-lagged": {"hc_eps": 0.0}}


def source_model(seed: int = 0, **shape) -> Transformer:
    """A residual model with weights far from their initialisation (O(1) activations)."""
    torch.manual_seed(seed)
    model = Transformer(get_preset("tiny", **{"dim": 64, "n_layers": 3, "n_heads": 4, "ffn_dim": 128, **shape}))
    randomise(model, seed)
    return model.eval()


def test_the_qualifying_families_are_those_whose_rows_and_columns_sum_to_one():
    assert upcyclable_families() == FAMILIES
    for family, reason in (("hc", "unconstrained"), ("orthogonal", "keeps norms, not sums"),
                           ("residual", "nothing to upcycle")):
        with pytest.raises(ValueError, match=f"--family '{family}' cannot start .*{reason}.*choose one of"):
            check_upcyclable(family)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_the_upcycled_model_computes_the_source_function_in_float32(family, n):
    if family == "mhc-lite" and n > 6:
        pytest.skip("mhc-lite refuses n > 6 without allow_large")
    source = source_model()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = source(ids)
        got = upcycle_model(source, family, n, UPCYCLE_OPTIONS.get(family)).eval()(ids)
    assert expected.std() > 0.5
    assert (got - expected).abs().max().item() <= TOLERANCE


def test_deepseek_v4_mhc_upcycles_to_within_its_epsilon():
    """DeepSeek-V4's Sinkhorn divides by (sum + hc_eps), so each H_res keeps the streams' mean only to 1 − hc_eps:
    over k connections the mean shrinks by about k·hc_eps relative to the branches. Measured in float64 (no
    rounding): that error and no more; with hc_eps = 0 the variant is as exact as the paper's mhc. H_pre's
    offset is compensated exactly (its bias is logit(1/n − hc_eps))."""
    source = source_model().double()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    connections = 2 * source.config.n_layers
    with torch.no_grad():
        expected = source(ids)
        paper = upcycle_model(source, "mhc", 4).eval()(ids)
        exact = upcycle_model(source, "mhc", 4, {"variant": "deepseek-v4", "hc_eps": 0.0}).eval()(ids)
        default = upcycle_model(source, "mhc", 4, {"variant": "deepseek-v4"}).eval()(ids)
    assert (exact - expected).abs().max().item() == pytest.approx((paper - expected).abs().max().item(), rel=1e-6)
    error = (default - expected).abs().max().item()
    bound = connections * 1e-6 * expected.abs().max().item()
    assert bound / 10 < error <= bound + TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_the_upcycled_model_is_as_close_as_the_source_itself_under_bfloat16(family):
    source = source_model()
    upcycled = upcycle_model(source, family, 4).eval()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exact = source(ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            source_bf16, upcycled_bf16 = source(ids).float(), upcycled(ids).float()
    rounding = (source_bf16 - exact).abs().max().item()
    assert rounding > 0  # bfloat16 did round
    assert (upcycled_bf16 - exact).abs().max().item() <= 2 * rounding


def test_the_upcycling_coefficients():
    pre, post = upcycling_biases(4, layer_index=5, spread=0.5)
    assert torch.sigmoid(pre).tolist() == pytest.approx([0.25] * 4)
    assert (2 * torch.sigmoid(post)).tolist() == pytest.approx([1 - 0.5 / 3, 1.5, 1 - 0.5 / 3, 1 - 0.5 / 3])
    model = upcycle_model(source_model(), "s2hc", 4)
    x = torch.randn(2, 5, 4, 64)
    for _, hc in mixing_connections(model):
        with torch.no_grad():
            H = hc.matrices(x)
        torch.testing.assert_close(H["pre"], torch.full((2, 5, 4), 0.25))  # the same for every token
        torch.testing.assert_close(H["post"].sum(-1), torch.full((2, 5), 4.0))
        assert H["post"].std(-1).min() > 0.2  # not uniform: the streams separate after the first write
        for dim in (-1, -2):  # rows and columns sum to 1
            torch.testing.assert_close(H["res"].sum(dim), torch.ones(2, 5, 4), atol=1e-6, rtol=0)
    for spread in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="spread must be in \\(0, 1\\)"):
            upcycling_biases(4, 0, spread)


def _loss(model, ids):
    return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), torch.roll(ids, -1, 1).flatten())


def test_the_streams_separate_and_the_mixing_learns_from_the_first_steps():
    """Non-uniform writes make the streams differ after the first write, so the reads' gradients differ between
    streams from the first step; with uniform writes the streams would be copies, the reads would stay uniform,
    and the model a residual model for ever. At the upcycling point the loss sees only the streams' sum, so H_res
    itself gets no gradient; after one step the reads are no longer uniform, and every H_res between the first
    (copies in) and the last (sum out) gets a real one: the same in float32 and float64, not rounding noise."""
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    model = upcycle_model(source_model(), "s2hc", 4)
    similarity = collect(model, ids).summary()["stream_similarity"]["offdiagonal"]["mean"]
    assert similarity[0] == pytest.approx(1.0) and max(similarity[1:]) < 0.999
    _loss(model, ids).backward()
    read_spread = [hc.bias_pre.grad.std().item() for _, hc in mixing_connections(model)]
    assert read_spread[0] < 1e-6 * min(read_spread[1:])  # the first connection reads copies

    uniform = upcycle_model(source_model(), "s2hc", 4).double()  # float64: no rounding noise to tell apart
    with torch.no_grad():
        for _, hc in mixing_connections(uniform):
            hc.bias_post.zero_()  # H_post = 1 for every stream: uniform writes
    _loss(uniform, ids).backward()
    assert max(hc.bias_pre.grad.std().item() for _, hc in mixing_connections(uniform)) < 1e-9 * min(read_spread[1:])

    def res_gradients(dtype, steps):
        copy = upcycle_model(source_model(), "s2hc", 4).to(dtype)
        optimizer = torch.optim.SGD(copy.parameters(), lr=0.1)
        for _ in range(steps):
            optimizer.zero_grad()
            _loss(copy, ids).backward()
            optimizer.step()
        optimizer.zero_grad()
        _loss(copy, ids).backward()
        return [hc.projection.grad[:, 8:].norm().item() for _, hc in mixing_connections(copy)]  # the d_res columns

    assert max(res_gradients(torch.float64, steps=0)) < 1e-12
    g32, g64 = res_gradients(torch.float32, steps=1), res_gradients(torch.float64, steps=1)
    assert max(g64[0], g64[-1]) < 1e-9 * min(g64[1:-1])
    assert min(g64[1:-1]) > 1e-6 and g32[1:-1] == pytest.approx(g64[1:-1], rel=1e-3)


def test_only_residual_sources_and_at_least_two_streams():
    s2hc_model = upcycle_model(source_model(), "s2hc", 4)
    with pytest.raises(ValueError, match="source model must be residual"):
        upcycle_model(s2hc_model, "mhc", 4)
    with pytest.raises(ValueError, match="--streams must be >= 2"):
        upcycle_model(source_model(), "mhc", 1)


# ------------------------------------------------------------------------------ Hugging Face directories


def hf_reference(arch: str):
    """A random Hugging Face model of ``arch`` with the shipped tokenizer's 4 096 tokens: upcycle refuses a
    tokenizer larger than the model, and the export writes that tokenizer beside the weights."""
    config = hf_config(arch)
    config.vocab_size = 4096
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomise(reference, 0)
    return reference


@pytest.fixture(scope="module", params=[*ARCHITECTURES, "llama-rope-scaling", "llama-tied"])  # the registry's
def hf_directory(request, tmp_path_factory):
    reference = hf_reference(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(directory)  # config.json + model.safetensors
    return request.param, reference, directory


def test_upcycle_command_on_every_architecture_the_presets_load(hf_directory, tmp_path):
    arch, reference, directory = hf_directory
    out = tmp_path / "run"
    args = ["upcycle", str(directory), "--family", "s2hc", "--streams", "4", "--out", str(out)]
    assert main([*args, "--tokenizer", "s2hc-bpe-4k"]) == 0
    model, config = load_model(out)
    assert (config.family, config.n_streams, model.config.stream_reduce) == ("s2hc", 4, "mean")
    assert load_checkpoint(out).step == 0
    ids = tokens()
    with torch.no_grad():
        diff = (model.eval()(ids) - reference(input_ids=ids).logits).abs().max().item()
    assert diff <= TOLERANCE, f"{arch}: {diff:.3g}"


@pytest.mark.parametrize("arch", ["qwen3", "llama-rope-scaling", "mistral"])
def test_an_upcycled_model_exports_and_loads_in_transformers(arch, tmp_path):
    reference = hf_reference(arch)
    source, run, exported = tmp_path / arch, tmp_path / "run", tmp_path / "export"
    reference.save_pretrained(source)
    assert main(["upcycle", str(source), "--family", "mhc", "--out", str(run), "--tokenizer", "s2hc-bpe-4k"]) == 0
    assert main(["export", str(run), "--out", str(exported)]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    ids = tokens()
    with torch.no_grad():
        assert (loaded(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max() <= TOLERANCE


def test_the_upcycle_help_names_every_architecture_it_reads(capsys):
    from s2hc.hf import architectures

    assert main(["upcycle", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for model_type in architectures.model_types():
        assert model_type in text, model_type
    for name in ("Qwen3", "Qwen2.5", "Gemma3", "GPT-2", "Llama", "Mistral"):
        assert name in text, name


def test_an_unsupported_architecture_is_refused_and_nothing_is_written(tmp_path, capsys):
    directory = tmp_path / "falcon"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    assert main(["upcycle", str(directory), "--family", "s2hc", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "model_type must be one of" in err and "'falcon'" in err and len(err.strip().splitlines()) == 1
    assert repr(str(directory / "config.json")) in err and "'llama', 'mistral'" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, message", [
    (["--family", "hc"], "'hc' cannot start from a residual model"),
    (["--family", "orthogonal"], "keeps norms, not sums"),
    (["--family", "s2hc", "--streams", "1"], "--streams must be >= 2"),
    (["--family", "s2hc", "--spread", "1.5"], "argument --spread: must be a number in (0, 1)"),
    (["--family", "nope"], "--family must be one of"),
])
def test_bad_upcycling_requests_are_refused(args, message, tiny_residual, tmp_path, capsys):
    assert main(["upcycle", str(tiny_residual), *args, "--out", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_missing_source_and_hyper_connection_source_are_refused(tiny_checkpoint, tmp_path, capsys):
    assert main(["upcycle", str(tmp_path / "nothing"), "--family", "s2hc", "--out", str(tmp_path / "a")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["upcycle", str(tiny_checkpoint), "--family", "s2hc", "--out", str(tmp_path / "b")]) == 2
    assert "upcycling starts from a residual model" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["llama-rope-scaling", "mistral"])
def test_an_upcycled_hf_model_trains_with_init_from(arch, corpus_file, tmp_path):
    """Llama (RoPE scaling) and Mistral (every layer sliding) upcycled runs continue pretraining, and the
    continued run exports."""
    source, run, continued = tmp_path / arch, tmp_path / "run", tmp_path / "continued"
    hf_reference(arch).save_pretrained(source)
    assert main(["upcycle", str(source), "--family", "s2hc", "--out", str(run), "--tokenizer", "s2hc-bpe-4k"]) == 0
    assert main(["train", "--init-from", str(run), "--out", str(continued), "--max-steps", "2", "--seq-len", "32",
                 "--data", str(corpus_file), "--no-progress"]) == 0
    model, trained = load_model(continued)
    assert (trained.family, trained.init_from) == ("s2hc", str(run))
    assert (model.config.rope_scaling is None) == (arch == "mistral")
    assert model.config.layer_types() == (["local"] * 2 if arch == "mistral" else ["global"] * 2)
    assert all(math.isfinite(r["loss"]) for r in read_metrics(continued) if "loss" in r)
    assert main(["export", str(continued), "--out", str(tmp_path / "export")]) == 0


# ------------------------------------------------------------------------- run directories and training


@pytest.fixture(scope="module")
def tiny_residual(corpus_file, tmp_path_factory):
    """A residual run of the small model, 6 steps."""
    config = small_config(corpus_file, tmp_path_factory.mktemp("residual"), family="residual", n_streams=1,
                          max_steps=6)
    train(config)
    return config.out


def test_a_residual_run_upcycles_and_training_continues_from_it(tiny_residual, corpus_file, tmp_path):
    run, continued = tmp_path / "upcycled", tmp_path / "continued"
    assert main(["upcycle", tiny_residual, "--family", "s2hc", "--out", str(run)]) == 0
    source, _ = load_model(tiny_residual)
    model, config = load_model(run)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert (model(ids) - source(ids)).abs().max() <= TOLERANCE
    assert config.data == str(corpus_file)  # the source's settings, ready to continue
    # eval and diagnose work on the upcycled run directory
    assert diagnose_checkpoint(run, data=str(corpus_file), tokens=64)["family"] == "s2hc"
    assert main(["eval", str(run), "--data", str(corpus_file), "--max-batches", "1"]) == 0
    # --init-from takes the model settings from the upcycled run; training starts from its weights
    assert main(["train", "--init-from", str(run), "--out", str(continued), "--max-steps", "2",
                 "--data", str(corpus_file), "--no-progress"]) == 0
    _, trained = load_model(continued)
    assert (trained.family, trained.n_streams, trained.init_from) == ("s2hc", 4, str(run))
    assert all(math.isfinite(r["loss"]) for r in read_metrics(continued) if "loss" in r)


def test_init_from_a_residual_run_upcycles_on_the_way_in(tiny_residual):
    source, _ = load_model(tiny_residual)
    model = Transformer(source.config.__class__.from_dict(
        {**source.config.to_dict(), "family": "mhc-lite", "n_streams": 3, "stream_reduce": "mean"}))
    load_initial_weights(model, tiny_residual)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert (model(ids) - source(ids)).abs().max() <= TOLERANCE
    other = Transformer(source.config.__class__.from_dict({**source.config.to_dict(), "dim": 48}))
    with pytest.raises(ValueError, match="holds a model of another shape .*dim: 32 there, 48 here"):
        load_initial_weights(other, tiny_residual)


def test_train_init_from_a_residual_run_with_a_family_refuses_one_that_cannot_keep_the_function(
        tiny_residual, tmp_path, capsys):
    assert main(["train", "--init-from", tiny_residual, "--family", "hc", "--out", str(tmp_path / "x")]) == 2
    assert "'hc' cannot start from a residual model" in capsys.readouterr().err


def test_a_run_from_weights_first_measures_them_and_upcycled_starts_where_residual_does(
        tiny_residual, corpus_file, tmp_path):
    def first_validation(family: str, streams: str) -> tuple[int, float]:
        out = tmp_path / family
        assert main(["train", "--init-from", tiny_residual, "--family", family, "--streams", streams,
                     "--out", str(out), "--max-steps", "2", "--eval-every", "2", "--data", str(corpus_file),
                     "--no-progress"]) == 0
        first = next(r for r in read_metrics(out) if "val_loss" in r)
        return first["step"], first["val_loss"]

    step, residual = first_validation("residual", "1")
    assert step == 0
    assert first_validation("s2hc", "4") == pytest.approx((0, residual), abs=1e-5)
    assert first_validation("mhc", "4") == pytest.approx((0, residual), abs=1e-5)
