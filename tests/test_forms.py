"""The connection forms (s2hc.connection.forms): the registry, Attention Residuals against an independent
reference, the wide residual, what each declares, and the models both build."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import Branch, assert_close_to_scale, random_model

import s2hc
from s2hc import mixers
from s2hc.connection import build_connection, forms
from s2hc.connection.forms import AttnResConnection, WideResidual
from s2hc.connection.forms.attn_res import block_size_for
from s2hc.models import ModelConfig, Transformer, get_preset
from s2hc.params import count_connection_params
from s2hc.train.optim import make_optimizer

TINY = dict(vocab_size=64, dim=16, n_heads=2, ffn_dim=32, max_seq_len=16)


# ------------------------------------------------------------------------------------------------ registry


def test_every_family_is_one_form_in_the_documented_order():
    assert s2hc.families() == ["residual", *mixers.REGISTRY, "gated-residual", "attn-res", "wide-residual",
                                "vp-residual", "affine-residual", "mhc-lagged"]
    assert [form.name for form in forms.FORMS] == s2hc.families()
    assert all(forms.get(name).name == name for name in s2hc.families())
    assert all(isinstance(forms.get(name), forms.HyperConnectionForm) for name in mixers.REGISTRY)


def test_an_unknown_family_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"^--family must be one of \['residual', .*'mhc-lagged'\], got 'nope'$"):
        forms.get("nope", "--family")
    with pytest.raises(ValueError, match="got 3"):
        forms.check_family(3)


@pytest.mark.parametrize(("family", "declared"), [
    ("residual", dict(default_streams=1, pre_norms=True, default_stream_reduce="sum", stream_scaling=False,
                      mixes_streams=False)),
    ("s2hc", dict(default_streams=4, pre_norms=True, default_stream_reduce="sum", stream_scaling=True,
                  mixes_streams=True, has_res=True, compute_options=True)),
    ("gated-residual", dict(default_streams=4, pre_norms=False, default_stream_reduce="head", mixes_streams=True,
                            has_res=False, compute_options=False, min_streams=2)),
    ("attn-res", dict(default_streams=1, max_streams=1, pre_norms=True, default_stream_reduce="head",
                      stream_scaling=False, mixes_streams=False)),
    ("wide-residual", dict(default_streams=4, min_streams=2, pre_norms=True, default_stream_reduce="sum",
                           mixes_streams=False, has_res=False, compute_options=False)),  # its own maps instead
    ("vp-residual", dict(default_streams=1, max_streams=1, pre_norms=True, default_stream_reduce="sum",
                         stream_scaling=False, mixes_streams=False)),
    ("affine-residual", dict(default_streams=1, max_streams=1, pre_norms=True, default_stream_reduce="sum",
                             stream_scaling=False, mixes_streams=False)),
    ("mhc-lagged", dict(default_streams=4, pre_norms=True, default_stream_reduce="head", stream_scaling=False,
                        mixes_streams=True, has_res=True, compute_options=True)),  # its state a pair
])
def test_what_each_form_declares(family, declared):
    form = forms.get(family)
    assert {key: getattr(form, key) for key in declared} == declared


def test_a_model_takes_what_its_form_declares():
    assert Transformer(get_preset("tiny", family="gated-residual", n_streams=2, **TINY)).blocks[0].attn_norm is None
    attn_res = Transformer(get_preset("tiny", family="attn-res", n_layers=2, **TINY))
    assert attn_res.config.stream_reduce == "head" and type(attn_res.stream_head).__name__ == "AttnResHead"
    assert attn_res.blocks[0].attn_norm is not None


# ------------------------------------------------------------------------------ Attention Residuals


def reference_attn_res(model: Transformer, ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Logits of an AttnRes model computed from the paper's equations, without s2hc's connection code: the
    sources as a list (the embedding, then each completed block's sum and the running one), each sublayer's
    softmax over ``q_l · RMSNorm_g(v_i)`` written out, the block bookkeeping by counting sublayers."""
    config = model.config
    h = model.embed(ids)
    rope_mask = model_inputs(model, ids)
    blocks, partial, done = [h], None, 0

    def read(module, sources):
        stacked = torch.stack(sources)  # (S, B, T, C)
        keys = stacked * torch.rsqrt(stacked.pow(2).mean(-1, keepdim=True) + module.eps) * module.key_norm_weight
        weights = torch.softmax(keys @ module.query, dim=0)  # (S, B, T)
        return (weights.unsqueeze(-1) * stacked).sum(0)

    for block in model.blocks:
        attention = functools.partial(block.attention_branch, rope=rope_mask[0], mask=rope_mask[1])
        for connection, branch in ((block.attn_hc, attention), (block.mlp_hc, block.mlp_branch)):
            sources = blocks + ([] if partial is None else [partial])
            out = branch(read(connection, sources))
            partial = out if partial is None else partial + out
            done += 1
            if done % block_size == 0:
                blocks.append(partial)
                partial = None
    final = read(model.stream_head, blocks + ([] if partial is None else [partial]))
    assert config.stream_reduce == "head"
    return model.lm_head(model.norm(final))


def model_inputs(model, ids):
    from s2hc.models.transformer import attention_inputs

    return attention_inputs(model.config, torch.arange(ids.shape[1])).for_layer(False)


@pytest.mark.parametrize(("options", "block_size"), [({"variant": "full"}, 1), ({"block_size": 2}, 2),
                                                     ({"block_size": 3}, 3), ({}, 1)])
def test_attn_res_computes_the_papers_equations(options, block_size):
    """Against the reference above with every query and key-norm weight moved off its start (so no softmax is
    uniform): Full (block size 1), Block with a size that divides the 8 sublayers and one that does not, and the
    default (8 blocks over 8 sublayers: one sublayer each)."""
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny", family="attn-res", n_layers=4, family_options=options, **TINY)).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("query", "key_norm_weight")):
                p.add_(torch.randn_like(p))
    assert model.blocks[0].attn_hc.block_size == block_size
    ids = torch.randint(0, 64, (2, 7))
    torch.testing.assert_close(model(ids), reference_attn_res(model, ids, block_size), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("sublayers", [1, 2, 7, 8, 9, 16, 64, 65])
def test_block_attn_res_defaults_to_eight_blocks(sublayers):
    """The smallest block size that makes at most eight blocks (the paper's N = 8)."""
    size = block_size_for("block", None, sublayers)
    assert math.ceil(sublayers / size) <= 8
    assert size == 1 or math.ceil(sublayers / (size - 1)) > 8
    assert block_size_for("full", None, sublayers) == 1


@pytest.mark.parametrize(("variant", "size", "layers", "sources"), [("full", None, 4, 9), ("block", 2, 4, 5),
                                                                    ("block", 3, 4, 4), ("block", None, 16, 9)])
def test_the_state_holds_one_source_per_block(variant, size, layers, sources):
    """Memory: Full keeps every sublayer's output (2L + 1 sources), Block one per block and the embedding."""
    options = {"variant": variant} if size is None else {"variant": variant, "block_size": size}
    model = Transformer(get_preset("tiny", family="attn-res", n_layers=layers, family_options=options, **TINY))
    ids = torch.randint(0, 64, (1, 5))
    state = model.run_blocks(model.expand_streams(model.embed(ids)), model_attention_inputs(model, ids))
    assert isinstance(state, tuple) and len(state) == sources


def model_attention_inputs(model, ids):
    from s2hc.models.transformer import attention_inputs

    return attention_inputs(model.config, torch.arange(ids.shape[1]))


@pytest.mark.parametrize(("family", "n", "options"), [("attn-res", 1, {}), ("attn-res", 1, {"variant": "full"}),
                                                      ("wide-residual", 2, {}), ("wide-residual", 4, {})])
def test_both_start_as_the_residual_model_with_the_same_weights(family, n, options):
    """Built with one init_seed (common random numbers), every shared weight is the residual model's, and at step 0
    the logits are its logits: exact for the wide residual (copies of one stream; n = 2 and 4 sum exactly), up to
    the norms' float32 arithmetic for AttnRes (its sublayers read means, which RMSNorm takes to the same input).
    The norms' epsilon is made negligible so that only the function is compared."""
    base = dict(n_layers=3, norm_eps=1e-30, **TINY)
    residual = Transformer(get_preset("tiny", **base), init_seed=5).double()
    other = Transformer(get_preset("tiny", family=family, n_streams=n, family_options=options, **base),
                        init_seed=5).double()
    shared = {k: v for k, v in other.state_dict().items() if k in residual.state_dict()}
    assert all(torch.equal(v, residual.state_dict()[k]) for k, v in shared.items())
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(other(ids), residual(ids), rtol=0, atol=1e-5)


def test_attn_res_without_its_output_query_reads_the_residual_stream():
    """``stream_reduce="sum"``: the sources' sum, the embedding plus every output, which is the residual stream."""
    model = Transformer(get_preset("tiny", family="attn-res", n_layers=2, stream_reduce="sum", **TINY)).double()
    sources = tuple(torch.randn(2, 3, 16, dtype=torch.float64) for _ in range(4))
    torch.testing.assert_close(model.reduce_streams(sources), sum(sources[1:], sources[0]))
    mean = Transformer(get_preset("tiny", family="attn-res", n_layers=2, stream_reduce="mean", **TINY))
    torch.testing.assert_close(mean.reduce_streams(sources), sum(sources[1:], sources[0]) / 4)
    assert model.stream_head is None


@pytest.mark.parametrize("sources", [1, 3, 9])
def test_the_depth_read_is_liger_kernels_attn_res(sources):
    """Against Liger-Kernel's AttnRes (``liger_kernel.ops.attn_res``: one Triton kernel fusing the key RMSNorm, the
    query's dot, the softmax over sources and the weighted sum; run here under the Triton interpreter): the read
    and the gradients of every source, the query and the key norm's weight."""
    pytest.importorskip("triton")
    attn_res = pytest.importorskip("liger_kernel.ops.attn_res")
    torch.manual_seed(sources)
    read = forms.attn_res.DepthAttention(16)
    with torch.no_grad():
        read.query.normal_()
        read.key_norm_weight.normal_()
    values = [torch.randn(2, 5, 16, requires_grad=True) for _ in range(sources)]
    h = read(tuple(values))
    upstream = torch.randn_like(h)
    ours = torch.autograd.grad((h * upstream).sum(), [*values, read.query, read.key_norm_weight])
    stacked = torch.stack([v.detach() for v in values]).requires_grad_()
    query = read.query.detach().clone().requires_grad_()
    gain = read.key_norm_weight.detach().clone().requires_grad_()
    theirs_h = attn_res.LigerAttnResFunction.apply(stacked, query, gain, read.eps)
    theirs = torch.autograd.grad((theirs_h * upstream).sum(), [stacked, query, gain])
    assert_close_to_scale(h, theirs_h)
    assert_close_to_scale(torch.stack(ours[:sources]), theirs[0])
    assert_close_to_scale(ours[-2], theirs[1])
    assert_close_to_scale(ours[-1], theirs[2])


def test_attn_res_connection_gradients_are_exact():
    torch.manual_seed(0)
    connection = AttnResConnection(6, sublayer=3, block_size=2).double()
    with torch.no_grad():
        connection.query.normal_()
        connection.key_norm_weight.normal_()
    branch = Branch(6).double()
    sources = tuple(torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def run(*inputs):
        return connection(inputs, branch)

    assert torch.autograd.gradcheck(run, sources)
    params = (connection.query, connection.key_norm_weight)
    assert torch.autograd.gradcheck(lambda q, g: connection.weights(sources) * 0 + _weights(sources, q, g), params)


def _weights(sources, query, gain):
    stacked = torch.stack(sources)
    keys = F.rms_norm(stacked, (stacked.shape[-1],), gain, 1e-6)
    return torch.softmax(keys @ query, dim=0).movedim(0, -1)


def test_attn_res_refuses_what_it_cannot_be():
    with pytest.raises(ValueError, match=r"n_streams must be 1 for family='attn-res', got 4"):
        get_preset("tiny", family="attn-res", n_streams=4)
    with pytest.raises(ValueError, match=r"'variant' of 'attn-res' must be one of \['block', 'full'\], got 'x'"):
        get_preset("tiny", family="attn-res", family_options={"variant": "x"})
    with pytest.raises(ValueError, match=r"variant='full' reads every sublayer \(block_size 1\), got block_size=3"):
        get_preset("tiny", family="attn-res", family_options={"variant": "full", "block_size": 3})
    with pytest.raises(ValueError, match="block_size"):
        get_preset("tiny", family="attn-res", family_options={"block_size": 0})
    with pytest.raises(ValueError, match="lss_init scales several streams"):
        get_preset("tiny", family="attn-res", lss_init=0.5)
    connection = AttnResConnection(4, sublayer=2, block_size=1)
    with pytest.raises(ValueError, match=r"expects 3 sources here .* got 2"):
        connection(tuple(torch.zeros(1, 2, 4) for _ in range(2)), Branch(4))
    with pytest.raises(TypeError, match="takes the depth sources, a tuple"):
        connection(torch.zeros(1, 2, 3, 4), Branch(4))


def test_attn_res_decodes_with_the_cache_as_without():
    model = random_model("attn-res", 1, n_layers=3, family_options={"block_size": 2}).double()
    ids = torch.randint(0, 1024, (2, 9))
    from s2hc.models.transformer import KVCache

    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        first = model(ids[:, :5], cache=cache)
        rest = model(ids[:, 5:], cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, rtol=1e-9, atol=1e-9)


# -------------------------------------------------------------------------------------------- wide residual


def test_the_wide_residual_is_the_dense_read_and_write_it_says():
    torch.manual_seed(0)
    n, c = 3, 5
    connection = WideResidual(c, n, layer_index=4)
    read, write = connection.read.detach(), connection.write.detach()
    expected_read = torch.zeros(c, n * c)
    expected_read[:, (4 % n) * c:(4 % n + 1) * c] = torch.eye(c)
    assert torch.equal(read, expected_read) and torch.equal(write, torch.eye(c).repeat(n, 1))
    with torch.no_grad():
        connection.read.normal_()
        connection.write.normal_()
    branch = Branch(c)
    x = torch.randn(2, 4, n, c)
    flat = x.reshape(2, 4, n * c)
    expected = flat + branch(flat @ connection.read.T) @ connection.write.T
    torch.testing.assert_close(connection(x, branch), expected.reshape(2, 4, n, c))


def test_wide_residual_gradients_are_exact():
    torch.manual_seed(0)
    connection = WideResidual(4, 3, layer_index=1).double()
    branch = Branch(4).double()
    x = torch.randn(2, 3, 3, 4, dtype=torch.float64, requires_grad=True)
    read = torch.randn_like(connection.read, requires_grad=True)
    write = torch.randn_like(connection.write, requires_grad=True)

    def run(x, read, write):
        return torch.func.functional_call(connection, {"read": read, "write": write}, (x, branch))

    assert torch.autograd.gradcheck(run, (x, read, write))


def test_one_step_breaks_the_wide_residuals_symmetry():
    """The blocks start as copies of one stream; the reads of different layers differ, so the first step's
    gradients differ block by block and the copies part."""
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny", family="wide-residual", n_streams=2, n_layers=2, **TINY), init_seed=0)
    ids = torch.randint(0, 64, (2, 9))
    F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    grad = model.blocks[0].attn_hc.write.grad.view(2, 16, 16)  # the next block reads block 1 only
    assert not torch.allclose(grad[0], grad[1])
    last = model.blocks[1].mlp_hc.write.grad.view(2, 16, 16)  # only the symmetric sum reads the last write
    torch.testing.assert_close(last[0], last[1])


def test_wide_residual_refuses_one_stream():
    with pytest.raises(ValueError, match=r"n_streams must be at least 2 for family='wide-residual', got 1"):
        get_preset("tiny", family="wide-residual", n_streams=1)
    with pytest.raises(ValueError, match=r"family='wide-residual' takes no family_options, got \['rank'\]"):
        get_preset("tiny", family="wide-residual", n_streams=2, family_options={"rank": 3})


# --------------------------------------------------------------------------------- counts and optimiser


@pytest.mark.parametrize(("family", "n", "per_sublayer"), [
    ("attn-res", 1, lambda c, n: 2 * c),  # a query and the key norm's weight
    ("wide-residual", 4, lambda c, n: 2 * n * c * c),  # read C × nC and write nC × C
    ("wide-residual", 2, lambda c, n: 2 * n * c * c),
])
def test_connection_parameters_match_the_formula(family, n, per_sublayer):
    layers, dim = 3, 24
    assert count_connection_params(family, layers=layers, dim=dim, n_streams=n) == 2 * layers * per_sublayer(dim, n)
    model = Transformer(get_preset("tiny", family=family, n_streams=n, n_layers=layers, **{**TINY, "dim": dim}))
    head = 2 * dim if family == "attn-res" else 0  # the output query and its key norm
    assert model.num_connection_params() == 2 * layers * per_sublayer(dim, n) + head


def test_the_weight_decay_rule_knows_the_new_forms():
    """The wide residual's read and write are weight matrices (they decay under "matrices"); AttnRes's queries and
    key-norm weights are not (they do not)."""
    for family, n, decayed in (("wide-residual", 2, {"read", "write"}), ("attn-res", 1, set())):
        model = Transformer(get_preset("tiny", family=family, n_streams=n, n_layers=1, **TINY))
        optimizer = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95))
        names = {id(p): name for name, p in model.named_parameters()}
        decay = {names[id(p)].rsplit(".", 1)[-1] for group in optimizer.param_groups if group["weight_decay"]
                 for p in group["params"] if "_hc." in names[id(p)] or "stream_head" in names[id(p)]}
        assert decay == decayed, family


def test_build_connection_builds_each_forms_module():
    assert type(build_connection(8, 1, family="attn-res", sublayer=3, n_sublayers=8)).__name__ == "AttnResConnection"
    assert type(build_connection(8, 3, family="wide-residual")).__name__ == "WideResidual"
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['rank'\] for family 'attn-res'"):
        build_connection(8, 1, family="attn-res", rank=3)


def test_model_config_round_trips_the_new_forms():
    for family, n, options in (("attn-res", 1, {"variant": "full"}), ("wide-residual", 3, {})):
        config = get_preset("tiny", family=family, n_streams=n, family_options=options)
        assert ModelConfig.from_dict(config.to_dict()) == config


# ------------------------------------------------------------------------- through the command line


@pytest.mark.parametrize(("family", "streams", "options"), [("attn-res", 1, ["block_size=2"]),
                                                            ("wide-residual", 3, [])])
def test_train_export_reload_and_diagnose(family, streams, options, corpus_file, tmp_path, capsys):
    """``s2hc train --family attn-res`` and ``--family wide-residual`` train, export and reload through
    transformers with identical logits; ``s2hc diagnose`` measures AttnRes's depth softmax and the wide
    residual's streams."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from s2hc.cli import main
    from s2hc.rundir import load_model, read_metrics

    run = tmp_path / "run"
    argv = ["train", "--family", family, "--streams", str(streams), "--preset", "tiny", "--data", str(corpus_file),
            "--cache-dir", str(tmp_path / "cache"), "--out", str(run), "--max-steps", "3", "--warmup-steps", "1",
            "--batch-size", "2", "--seq-len", "32", "--eval-every", "3", "--eval-batches", "1", "--no-progress",
            "--diagnostics-every", "3", "--set", "model_overrides={dim: 32, n_layers: 2, n_heads: 2, ffn_dim: 64}"]
    argv += [item for option in options for item in ("--family-option", option)]
    assert main(argv) == 0
    records = [r for r in read_metrics(run) if "diagnostics" in r]
    assert records, "a diagnostics record"
    if family == "attn-res":
        assert len(records[-1]["diagnostics"]["depth_effective_sources"]) == 5  # 4 sublayers and the output
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    model, _ = load_model(run)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 4096, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model.eval()(ids), rtol=0, atol=0)
    capsys.readouterr()
    assert main(["diagnose", "--static", str(tmp_path / "hf"), "--out", str(tmp_path / "static")]) == 2
    refused = capsys.readouterr().err.strip().splitlines()  # says what --static reads, not an internal check
    assert len(refused) == 1 and f"family {family!r}, which has no residual matrix" in refused[0]
    assert "s2hc diagnose RUN" in refused[0] and "HyperConnection" not in refused[0]
    assert main(["diagnose", str(run), "--out", str(tmp_path / "diag"), "--tokens", "64"]) == 0
    report = (tmp_path / "diag" / "report.md").read_text()
    assert ("## Depth attention" in report) == (family == "attn-res")
    assert ("## Learned maps" in report) == (family == "wide-residual")
    assert ("read_effective_blocks" in report) == (family == "wide-residual")
    assert "H_res" not in report and "column-sum" not in report and "spectral norm" not in report
    diagnostics = records[-1]["diagnostics"]
    if family == "wide-residual":  # its maps: what the loggers carry too
        assert diagnostics["layers"] == [f"blocks.{i // 2}.{('attn', 'mlp')[i % 2]}_hc" for i in range(4)]
        assert len(diagnostics["map_read_start_distance"]) == 4 and "spectral_norm_max" not in diagnostics
        assert diagnostics["map_read_effective_blocks"][0] < 3  # reads about one block, as it started
    from s2hc.loggers import scalars

    logged = scalars(records[-1])
    key = "hc/map_write_effective_blocks/blocks.1.mlp_hc" if family == "wide-residual" else \
        "hc/depth_effective_sources/output"
    assert key in logged


@pytest.mark.slow
@pytest.mark.parametrize(("family", "n", "options"), [("attn-res", 1, {"block_size": 2}), ("wide-residual", 2, {})])
def test_compiled_blocks_compute_what_eager_blocks_do(family, n, options):
    """``--compile`` compiles each block in place (``block.compile()``): AttnRes's tuple of sources, one more per
    block, and the wide residual's maps give the eager values and gradients."""
    torch.manual_seed(0)
    eager = random_model(family, n, n_layers=2, vocab_size=64, family_options=options).train()
    compiled = random_model(family, n, n_layers=2, vocab_size=64, family_options=options).train()
    for block in compiled.blocks:
        block.compile()
    ids = torch.randint(0, 64, (2, 8))
    results = []
    for model in (eager, compiled):
        loss = model(ids).float().square().mean()
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[1][1], results[0][1]):  # inductor reorders float32 sums: to 1e-4 of each gradient's scale
        assert_close_to_scale(a, b, 1e-4)


def test_a_comparison_of_the_new_forms_measures_and_reports_each(corpus_file, tmp_path):
    """``s2hc compare`` with AttnRes and the wide residual: each run is measured (AttnRes's row keeps its depth
    softmax, the wide residual's read and write maps), counted (its FLOPs) and given a verdict against residual."""
    from helpers import small_config

    from s2hc.study import compare

    base = small_config(corpus_file, tmp_path, max_steps=4, eval_every=2, checkpoint_every=0, log_every=1, seed=5)
    report = compare(base, ["residual", "attn-res", "wide-residual"], seeds=1, out=tmp_path / "cmp").read_text()
    rows = {row["family"]: row for row in json.loads((tmp_path / "cmp" / "results.json").read_text())["rows"]}
    assert rows["attn-res"]["n_streams"] == 1 and rows["attn-res"]["diagnostics"] is None
    reads = rows["attn-res"]["depth_attention"]["reads"]
    assert [r["sources"] for r in reads] == [1, 2, 3, 4, 5]  # SMALL_MODEL: 2 layers, Full at this depth, the head
    assert rows["wide-residual"]["diagnostics"] is None  # no residual matrix: its own maps instead
    maps = rows["wide-residual"]["learned_maps"]["connections"]
    assert len(maps) == 4 and all(len(m["read_share"]) == 4 for m in maps)
    assert all(row["cost"]["flops"]["train_per_token"] > 0 for row in rows.values())
    assert "- **attn-res** against `residual`" in report and "- **wide-residual n=4** against `residual`" in report


def test_streams_without_a_family_suggest_one():
    with pytest.raises(ValueError, match=r"n_streams must be 1 for family='residual', got 4: several streams need a "
                                         r"multi-stream family \(family='s2hc'"):
        get_preset("tiny", n_streams=4)


def test_a_set_value_without_its_space_gets_a_hint():
    from s2hc.config import parse_assignment

    assert parse_assignment("model_overrides={dim: 32}") == ("model_overrides", {"dim": 32})
    with pytest.raises(ValueError, match=r"reads as a key 'dim:32' without a value; YAML needs a space after the "
                                         r"colon \(dim: 32\), e.g. model_overrides=\{dim: 32, n_layers: 2\}"):
        parse_assignment("model_overrides={dim:32, n_layers: 2}")
    assert parse_assignment("rotation=a:b") == ("rotation", "a:b")  # a plain string with a colon is kept


def test_params_gives_the_connection_flops_the_model_count_has(capsys):
    """``s2hc params`` counts each family's connection FLOPs per token as the model's FLOP count does."""
    from s2hc.cli import main
    from s2hc.flops import model_flops

    assert main(["params", "--families", "attn-res,wide-residual,s2hc", "--layers", "3", "--dim", "16",
                 "--json"]) == 0
    rows = {row["family"]: row for row in json.loads(capsys.readouterr().out)}
    for family, n in (("attn-res", 1), ("wide-residual", 4), ("s2hc", 4)):
        config = get_preset("tiny", family=family, n_streams=n, **{**TINY, "n_layers": 3})
        part = model_flops(config, 8)["parts"]["connections"]
        assert rows[family]["flops_per_token"] == part["matmul"] + part["elementwise"], family
    assert rows["wide-residual"]["flops_per_token"] == 6 * (4 * 4 * 16 * 16 + 4 * 16)  # read, write, add


def test_a_reentrant_checkpoint_keeps_attn_res_gradients():
    """transformers' gradient checkpointing defaults to the reentrant checkpoint, which sees only tensors passed as
    arguments: AttnRes's sources are passed one by one, so the gradients are the plain model's."""
    import torch.utils.checkpoint

    model = random_model("attn-res", 1, n_layers=3, vocab_size=64, family_options={"block_size": 2}).train()
    ids = torch.randint(0, 64, (2, 8))
    model(ids).square().mean().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    reentrant = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    model.set_activation_checkpointing(checkpoint_fn=reentrant)
    model(ids).square().mean().backward()
    for before, p in zip(plain, model.parameters()):
        torch.testing.assert_close(p.grad, before, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("family", ["vp-residual", "affine-residual", "wide-residual"])
def test_the_learned_maps_of_a_form_without_a_residual_matrix_are_recorded_and_diagnosed(family, corpus_file,
                                                                                        tmp_path):
    """Whatever a form's ``measures()`` returns reaches metrics.jsonl (and so the loggers) and ``s2hc diagnose``,
    with no H_res number: the same code for every such form."""
    from helpers import small_config

    from s2hc.diagnostics import diagnose_checkpoint
    from s2hc.loggers import scalars
    from s2hc.rundir import read_metrics
    from s2hc.train import train

    n = forms.get(family).default_streams
    result = train(small_config(corpus_file, tmp_path, family=family, n_streams=n, max_steps=2, diagnostics_every=2))
    record = [r for r in read_metrics(result.out) if "diagnostics" in r][-1]
    maps = {key: value for key, value in record["diagnostics"].items() if key.startswith("map_")}
    assert maps and all(len(values) == 4 for values in maps.values())
    assert any(key.startswith("hc/map_") for key in scalars(record))
    diagnosed = diagnose_checkpoint(result.out, out=tmp_path / "diag")
    report = (tmp_path / "diag" / "report.md").read_text()
    assert len(diagnosed["learned_maps"]["connections"]) == 4 and "## Learned maps" in report
    assert "H_res" not in report.replace("No residual matrix", "")
