"""DeepSeek-V4.1's single-pass mHC (``family="mhc-lagged"``, :mod:`s2hc.hf.deepseek_v41`) against the released code.

The release is ``nemo-automodel==0.7.0`` (``nemo_automodel/components/models/deepseek_v41``), which is not a
dependency of s2hc's test environment (it pins transformers 5.18 and pulls CUDA packages). Two references:

- ``released``: nemo-automodel's own ``DeepseekV41HyperConnection`` (``layers.py``) and the handoff of its
  ``DeepseekV41Block.forward`` and ``DeepseekV41Model.forward`` (``model.py``), run on stub attention and FFN
  branches, when ``nemo_automodel`` imports (its wheel unzipped on ``PYTHONPATH`` is enough: those modules import
  with this environment's torch and transformers). Skipped otherwise. The release computes every coefficient and
  the read and write in float32 (``.float()``) whatever the streams' dtype, so it is compared at float32 rounding
  (1e-5), in float32 and with float64 streams.
- ``transcription``: the released equations written out here (:func:`transcribed_mix`, :func:`transcribed_model`,
  line for line from ``layers.py`` and ``model.py`` but without the casts to float32), checked against the release
  at float32 rounding where it imports, and against s2hc in float64 to 1e-10 relative (and in float32 to 1e-5),
  always.

Compared: one site's ``pre``, ``post``, ``H_res = combᵀ`` and output given a carried ``pre``; a chain of three
layers (six sites, the lag is the point: each site reading the previous site's ``pre``, the first one-hot on stream
0, the final norm's input the last FFN site's collapse), outputs and gradients; the converter's round trips (exact)
and its one-line refusals; the float32 rule on the carried ``pre``.
"""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch
from torch import nn

import s2hc
from s2hc.connection import forms
from s2hc.connection.forms.lagged_mhc import LaggedHyperConnection
from s2hc.hf import deepseek_v41 as dv41
from s2hc.models import ModelConfig, Transformer

DIM, N, LAYERS = 16, 4, 3
TOL32 = dict(rtol=1e-5, atol=1e-5)


def _released():
    try:
        from nemo_automodel.components.models.deepseek_v41 import layers, model
    except Exception:  # not installed, or it fails to import here
        return None
    return types.SimpleNamespace(layers=layers, model=model)


RELEASED = _released() if importlib.util.find_spec("nemo_automodel") is not None else None
needs_release = pytest.mark.skipif(RELEASED is None, reason="nemo-automodel 0.7.0 (deepseek_v41) does not import")


def config(n=N, dim=DIM, iterations=7, hc_eps=1e-4, rms_norm_eps=1e-5, layers=LAYERS) -> dict:
    """A tiny config as ``config.json`` would hold it; the epsilons differ from each other and from the defaults."""
    return {"model_type": "deepseek_v41", "text_config": {
        "model_type": "deepseek_v41_text", "hidden_size": dim, "hc_mult": n, "hc_sinkhorn_iters": iterations,
        "hc_eps": hc_eps, "rms_norm_eps": rms_norm_eps, "num_hidden_layers": layers}}


def site_params(seed: int, n=N, dim=DIM, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """One site's ``fn`` ``(2n + n², nC)``, ``base``, ``scale``, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    width = n * (n + 2)
    return {"fn": (0.3 * torch.randn(width, n * dim, generator=g)).to(dtype),
            "base": torch.randn(width, generator=g).to(dtype),
            "scale": (0.5 + torch.rand(3, generator=g)).to(dtype)}


def checkpoint(seed=0, layers=LAYERS, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """The hyper-connection tensors of a released checkpoint, by their on-disk names."""
    return {f"layers.{i}.hc_{site}_{name}": value
            for i in range(layers) for j, site in enumerate(("attn", "ffn"))
            for name, value in site_params(seed + 10 * i + j, dtype=dtype).items()}


# ------------------------------------------------------------------------------ the transcription


def transcribed_sinkhorn(x: torch.Tensor, repeat: int, eps: float) -> torch.Tensor:
    """``sinkhorn_normalize_torch`` of ``deepseek_v4/optimized_kernels.py``."""
    x = x.softmax(dim=-1) + eps
    x = x / (x.sum(dim=-2, keepdim=True) + eps)
    for _ in range(repeat - 1):
        x = x / (x.sum(dim=-1, keepdim=True) + eps)
        x = x / (x.sum(dim=-2, keepdim=True) + eps)
    return x


def transcribed_mix(params, x, n, iterations, hc_eps, norm_eps):
    """``DeepseekV41HyperConnection.forward`` in the dtype of ``x`` ``(B, T, n, C)``: ``(pre, post, comb)``."""
    flat = x.flatten(2)
    mixes = flat @ params["fn"].to(x.dtype).T * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    scale = params["scale"].to(x.dtype)
    scales = torch.cat((scale[0].expand(n), scale[1].expand(n), scale[2].expand(n * n)))
    logits = params["base"].to(x.dtype) + mixes * scales
    pre = torch.sigmoid(logits[..., :n]) + hc_eps
    post = 2 * torch.sigmoid(logits[..., n:2 * n])
    comb = transcribed_sinkhorn(logits[..., 2 * n:].unflatten(-1, (n, n)), iterations, hc_eps)
    return pre, post, comb


def transcribed_collapse(x, pre):
    return (pre.unsqueeze(-1) * x).sum(2)


def transcribed_expand(output, residual, post, comb):
    return post.unsqueeze(-1) * output.unsqueeze(-2) + (comb.unsqueeze(-1) * residual.unsqueeze(-2)).sum(2)


def transcribed_model(state, h, branches, norm, n, iterations, hc_eps, norm_eps):
    """``DeepseekV41Model.forward`` around ``DeepseekV41Block.forward``, the branches given: one-hot first read,
    each site collapsing with the previous site's ``pre``, the final collapse with the last FFN site's."""
    x = h.unsqueeze(2).expand(-1, -1, n, -1)
    pre = torch.zeros(*h.shape[:2], n, dtype=h.dtype)
    pre[..., 0] = 1
    for layer, (attn, ffn) in enumerate(branches):
        for site, branch in (("attn", attn), ("ffn", ffn)):
            params = {name: state[f"layers.{layer}.hc_{site}_{name}"] for name in ("fn", "base", "scale")}
            mix = transcribed_mix(params, x, n, iterations, hc_eps, norm_eps)
            out = branch(transcribed_collapse(x, pre))
            x, pre = transcribed_expand(out, x, mix[1], mix[2]), mix[0]
    return norm(transcribed_collapse(x, pre))


# ------------------------------------------------------------------------------ branches shared by all


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, seed=0):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim, generator=torch.Generator().manual_seed(seed)))

    def forward(self, x):
        return self.weight.to(x.dtype) * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)


class Branch(nn.Module):
    """A pre-norm branch: ``tanh`` of a linear map for the attention, a small MLP for the FFN."""

    def __init__(self, dim, seed, mlp=False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.norm = RMSNorm(dim, seed=seed)
        self.w1 = nn.Parameter(torch.randn(dim, dim, generator=g) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(dim, dim, generator=g) / dim**0.5) if mlp else None

    def inner(self, h):  # what the released block calls its attn / ffn (after its own norm)
        y = h @ self.w1.to(h.dtype)
        return torch.tanh(y) if self.w2 is None else torch.nn.functional.silu(y) @ self.w2.to(h.dtype)

    def forward(self, h):
        return self.inner(self.norm(h))


def branches(layers=LAYERS, dim=DIM):
    return [(Branch(dim, 100 + 2 * i), Branch(dim, 101 + 2 * i, mlp=True)) for i in range(layers)]


def s2hc_chain(state, hf, h, pairs, norm, **compute):
    """s2hc's connections of the config, loaded from the checkpoint: expand, the six sites, the head, the norm."""
    options = dv41.connection_options(hf)
    connections = s2hc.Connections(options["dim"], 2 * len(pairs), family="mhc-lagged", n_streams=options["n_streams"],
                                   **{k: options[k] for k in ("iterations", "hc_eps", "eps")})
    converted = dv41.state_from_hf(state, hf, n_layers=len(pairs))
    for i, connection in enumerate(connections):
        prefix = f"blocks.{i // 2}.{('attn_hc', 'mlp_hc')[i % 2]}."
        connection.load_state_dict({k.removeprefix(prefix): v for k, v in converted.items() if k.startswith(prefix)})
        if compute:
            connection.set_options(**compute)
    connections = connections.to(h.dtype)
    x = connections.expand(h)
    for i, branch in enumerate(b for pair in pairs for b in pair):
        x = connections[i](x, branch)
    return norm(connections.reduce(x)), connections


def settings_of(hf):
    text = hf["text_config"]
    return dict(n=text["hc_mult"], iterations=text["hc_sinkhorn_iters"], hc_eps=text["hc_eps"],
                norm_eps=text["rms_norm_eps"])


# ------------------------------------------------------------------------------ one site


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_site_is_the_transcription(dtype):
    hf, params = config(), site_params(0)
    connection = dv41.connection_from_hf(hf, params).to(dtype)
    x = torch.randn(2, 5, N, DIM, generator=torch.Generator().manual_seed(1), dtype=dtype)
    carried = torch.softmax(torch.randn(2, 5, N, generator=torch.Generator().manual_seed(2), dtype=dtype), -1)
    pre, post, comb = transcribed_mix(params, x, **settings_of(hf))
    branch = Branch(DIM, 3).to(dtype)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else TOL32
    for fused in (True, False):
        ours = connection.coefficients(x, fused=fused)
        torch.testing.assert_close(ours[0], pre, **tol)
        torch.testing.assert_close(ours[1], post, **tol)
        torch.testing.assert_close(ours[2], comb.mT, **tol)  # H_res = combᵀ
        connection.set_options(fused=fused)
        out, handed = connection((x, carried), branch)
        expected = transcribed_expand(branch(transcribed_collapse(x, carried)), x, post, comb)
        torch.testing.assert_close(out, expected, **tol)
        torch.testing.assert_close(handed, pre, **tol)  # this site's pre goes on to the next site


@needs_release
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_transcription_and_s2hc_are_the_released_site(dtype):
    """nemo-automodel's DeepseekV41HyperConnection: its (pre, post, comb), collapse and expand; float32 inside."""
    hf, params = config(), site_params(0)
    released = RELEASED.layers.DeepseekV41HyperConnection(types.SimpleNamespace(
        hc_mult=N, hc_sinkhorn_iters=7, hc_eps=1e-4, rms_norm_eps=1e-5, hidden_size=DIM, initializer_range=0.02))
    released.load_state_dict(params)
    x = torch.randn(2, 5, N, DIM, generator=torch.Generator().manual_seed(1), dtype=dtype)
    carried = torch.softmax(torch.randn(2, 5, N, generator=torch.Generator().manual_seed(2)), -1)  # float32 always
    mix = released(x)
    assert mix.pre.dtype == mix.post.dtype == mix.comb.dtype == torch.float32
    for got, expected in zip(transcribed_mix(params, x.double(), **settings_of(hf)), mix):
        torch.testing.assert_close(got, expected.double(), **TOL32)
    connection = dv41.connection_from_hf(hf, params).to(dtype)
    branch = Branch(DIM, 3).to(dtype)
    expected = released.expand(branch(released.collapse(x, carried)), x, mix)
    out, handed = connection((x, carried.to(connection.coefficients(x)[0].dtype)), branch)
    torch.testing.assert_close(out.double(), expected.double(), **TOL32)
    torch.testing.assert_close(handed.double(), mix.pre.double(), **TOL32)


# ------------------------------------------------------------------------------ the chain: the lag


@pytest.mark.parametrize("compute", [{}, {"fused": False}, {"recompute": True}],
                         ids=["eager", "reference", "recompute"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_three_layers_are_the_transcription_with_gradients(dtype, compute):
    hf, state = config(), checkpoint()
    pairs, norm = branches(), RMSNorm(DIM, seed=9)
    for module in (norm, *(b for pair in pairs for b in pair)):
        module.to(dtype)
    h = torch.randn(2, 6, DIM, generator=torch.Generator().manual_seed(4), dtype=dtype, requires_grad=True)
    ours, connections = s2hc_chain(state, hf, h, pairs, norm, **compute)
    hf_state = {k: v.to(dtype).requires_grad_() for k, v in state.items()}
    expected = transcribed_model(hf_state, h, pairs, norm, **settings_of(hf))
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else TOL32
    torch.testing.assert_close(ours, expected, **tol)
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(5), dtype=dtype)
    grad_ours = torch.autograd.grad((ours * weights).sum(), [h, *connections.parameters()])
    grad_ref = torch.autograd.grad((expected * weights).sum(), [h, *hf_state.values()])
    torch.testing.assert_close(grad_ours[0], grad_ref[0], **tol)  # through every site and every carried pre
    mapped = dv41.state_from_hf(dict(zip(hf_state, grad_ref[1:])), hf)  # the gradients map as the parameters do
    names = [f"blocks.{i // 2}.{('attn_hc', 'mlp_hc')[i % 2]}.{name}"
             for i, connection in enumerate(connections) for name, _ in connection.named_parameters()]
    for name, grad in zip(names, grad_ours[1:]):
        torch.testing.assert_close(grad, mapped[name], **tol, msg=name)


def test_the_lag_is_what_is_compared():
    """Reading each site with its own pre (DeepSeek-V4's mHC on the same weights) gives another function."""
    hf, state = config(), checkpoint()
    pairs, norm = branches(), RMSNorm(DIM, seed=9)
    h = torch.randn(2, 6, DIM, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        lagged, _ = s2hc_chain(state, hf, h, pairs, norm)
        x = h.unsqueeze(2).expand(-1, -1, N, -1)
        for i, branch in enumerate(b for pair in pairs for b in pair):
            params = {name: state[f"layers.{i // 2}.hc_{('attn', 'ffn')[i % 2]}_{name}"] for name in ("fn", "base",
                                                                                                       "scale")}
            pre, post, comb = transcribed_mix(params, x, **settings_of(hf))
            x = transcribed_expand(branch(transcribed_collapse(x, pre)), x, post, comb)
        unlagged = norm(x.mean(2))
    assert (lagged - unlagged).abs().max() > 1e-2


@needs_release
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_three_layers_are_the_released_model(dtype):
    """``DeepseekV41Model.forward`` and ``DeepseekV41Block.forward`` themselves (their attention and MoE replaced by
    the stub branches, no Engram, no vision): the released handoff against s2hc's connections, at float32 rounding."""
    hf, state = config(), checkpoint()
    pairs, norm = branches(), RMSNorm(DIM, seed=9)
    embed = nn.Embedding(32, DIM)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(32, DIM, generator=torch.Generator().manual_seed(6)))
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(7))
    text = types.SimpleNamespace(hc_mult=N, hc_sinkhorn_iters=7, hc_eps=1e-4, rms_norm_eps=1e-5, hidden_size=DIM,
                                 initializer_range=0.02)

    class Attention(nn.Module):
        def __init__(self, branch):
            super().__init__()
            self.branch = branch

        def forward(self, h, *, state, **_):
            return types.SimpleNamespace(hidden_states=self.branch.inner(h), state=state)

    class FFN(nn.Module):
        gate = None

        def __init__(self, branch):
            super().__init__()
            self.branch = branch

        def forward(self, h, padding_mask=None):
            return self.branch.inner(h)

    model = RELEASED.model
    blocks = {}
    for i, (attn, ffn) in enumerate(pairs):
        block = model.DeepseekV41Block.__new__(model.DeepseekV41Block)
        nn.Module.__init__(block)
        block.attn, block.ffn, block.attn_norm, block.ffn_norm = Attention(attn), FFN(ffn), attn.norm, ffn.norm
        block.attn_hc = RELEASED.layers.DeepseekV41HyperConnection(text)
        block.ffn_hc = RELEASED.layers.DeepseekV41HyperConnection(text)
        block.engram = None
        for site, hc in (("attn", block.attn_hc), ("ffn", block.ffn_hc)):
            hc.load_state_dict({name: state[f"layers.{i}.hc_{site}_{name}"] for name in ("fn", "base", "scale")})
        blocks[str(i)] = block
    released = model.DeepseekV41Model.__new__(model.DeepseekV41Model)
    nn.Module.__init__(released)
    released.config, released.embed_tokens, released.engram_hash = text, embed, None
    released.layers, released.norm = nn.ModuleDict(blocks), norm
    for module in (embed, norm, *(b for pair in pairs for b in pair)):  # the hyper-connections stay float32, as
        module.to(dtype)  # the release keeps them (_keep_in_fp32_modules_strict), else it refuses its carried pre
    with torch.no_grad():
        expected, _ = released(ids)
        ours, _ = s2hc_chain(state, hf, embed(ids), pairs, norm)
    torch.testing.assert_close(ours.double(), expected.double(), **TOL32)


# ------------------------------------------------------------------------------ the float32 rule


def test_a_carried_pre_below_float32_is_refused_as_the_release_refuses_it():
    connection = dv41.connection_from_hf(config(), site_params(0))
    x = torch.randn(1, 3, N, DIM)
    with pytest.raises(TypeError, match=r"carried pre must be torch.float32 for torch.float32 streams .*got "
                                        r"torch.bfloat16"):
        connection((x, torch.full((1, 3, N), 0.25, dtype=torch.bfloat16)), torch.tanh)
    with pytest.raises(TypeError, match="takes the state"):
        connection(x, torch.tanh)
    state = forms.get("mhc-lagged").expand(torch.randn(1, 3, DIM, dtype=torch.bfloat16), N)
    assert state[0].dtype == torch.bfloat16 and state[1].dtype == torch.float32  # the first read: one-hot, float32
    assert state[1][..., 0].eq(1).all() and state[1][..., 1:].eq(0).all()
    out = connection.to(torch.bfloat16)(state, torch.tanh)
    assert out[0].dtype == torch.bfloat16 and out[1].dtype == torch.float32


# ------------------------------------------------------------------------------ the converter


def test_round_trips_are_exact_and_the_model_loads_them():
    hf, state = config(), checkpoint()
    ours = dv41.state_from_hf({**state, "layers.0.attn_norm.weight": torch.ones(DIM)}, hf)  # others left alone
    back = dv41.state_to_hf(ours, hf)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    nemo = {f"model.layers.{k.split('.')[1]}.{k.split('.')[2].split('_')[1]}_hc.{k.split('_')[-1]}": v
            for k, v in state.items()}  # nemo-automodel's module tree
    assert all(torch.equal(dv41.state_from_hf(nemo, hf)[k], v) for k, v in ours.items())
    model = Transformer(ModelConfig(**{**dv41.model_options(hf), "vocab_size": 32, "n_heads": 2, "n_kv_heads": 2,
                                       "ffn_dim": 32, "max_seq_len": 16}))
    missing, unexpected = model.load_state_dict(ours, strict=False)
    assert not unexpected and not any("_hc." in name for name in missing)
    again = dv41.state_to_hf(model, hf)
    assert all(torch.equal(again[k], state[k]) for k in state)
    for i, connection in enumerate(m for m in model.modules() if isinstance(m, LaggedHyperConnection)):
        site = f"layers.{i // 2}.hc_{('attn', 'ffn')[i % 2]}_"
        expected = {name: state[site + name] for name in ("fn", "base", "scale")}
        got = dv41.connection_to_hf(connection, hf)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert model.config.stream_reduce == "head" and model.config.family_options == {
        "iterations": 7, "hc_eps": 1e-4, "eps": 1e-5}


def test_the_defaults_are_deepseek_v41s():
    assert forms.options("mhc-lagged") == {"iterations": 20, "alpha": 0.01, "hc_eps": 1e-6}
    connection = s2hc.Connections(DIM, 2, family="mhc-lagged")[0]
    assert (connection.eps, connection.mixer.iterations, connection.mixer.hc_eps) == (1e-20, 20, 1e-6)
    assert dv41.MODEL_TYPE == "deepseek_v41"


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: s.pop("layers.1.hc_ffn_base"), r"has no 'layers.1.hc_ffn_base' \(nor 'model.layers.1.ffn_hc.base'\)"),
    (lambda s: s.__setitem__("layers.0.hc_attn_fn", torch.zeros(3, 3)), r"'fn' has shape \(3, 3\), expected"),
    (lambda s: s.__setitem__("layers.3.hc_attn_fn", torch.zeros(3)), r"a tensor of layer 3, but the model has 3"),
    (lambda s: s.__setitem__("model.layers.0.attn_hc.fn", s["layers.0.hc_attn_fn"]), "holds layer 0's attn 'fn' twice"),
])
def test_bad_checkpoints_are_one_line_errors(change, message):
    state = checkpoint()
    change(state)
    with pytest.raises(ValueError, match=message) as raised:
        dv41.state_from_hf(state, config())
    assert "\n" not in str(raised.value)


def test_bad_configs_and_connections_are_one_line_errors():
    with pytest.raises(ValueError, match=r"one of \['deepseek_v41', 'deepseek_v41_text'\], got 'deepseek_v4'"):
        dv41.connection_options({"model_type": "deepseek_v4", "hidden_size": DIM})
    with pytest.raises(ValueError, match="has no 'hc_eps'"):
        dv41.connection_options({"hidden_size": DIM, "hc_mult": N, "hc_sinkhorn_iters": 3, "rms_norm_eps": 1e-6})
    with pytest.raises(ValueError, match="must be an s2hc connection of family 'mhc-lagged'.* family 'mhc'"):
        dv41.connection_to_hf(s2hc.HyperConnection(DIM, N, family="mhc", variant="deepseek-v4"))
    connection = dv41.connection_from_hf(config(), site_params(0))
    with pytest.raises(ValueError, match=r"has iterations=7, but the DeepSeek-V4.1 config needs 20"):
        dv41.connection_to_hf(connection, config(iterations=20))
    with pytest.raises(ValueError, match=r"the s2hc state has no tensors of 'blocks.2.attn_hc'"):
        dv41.state_to_hf({k: v for k, v in dv41.state_from_hf(checkpoint(), config()).items()
                          if not k.startswith("blocks.2.")}, config())


def test_diagnose_static_reads_a_checkpoint_in_its_released_names(tmp_path, capsys):
    """A checkpoint as the release stores it (``layers.{i}.hc_{attn,ffn}_*`` in safetensors, ``config.json`` with a
    ``text_config``): each site's matrices at d = 0 are the transcription's of a zero input, the family
    ``mhc-lagged``, no head; a hyper-head tensor or a missing setting is refused in one line."""
    import json

    from safetensors.torch import save_file

    from s2hc.cli import main
    from s2hc.hf.static import diagnose_static

    tensors = {**checkpoint(seed=5), "layers.3.hc_attn_base": torch.zeros(N * (N + 2))}  # a layer past the model's
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config()))
    result = diagnose_static(tmp_path)
    assert (result["layout"], result["family"], result["n_streams"], result["head_weights"]) == (
        "deepseek_v41", "mhc-lagged", N, None)
    assert result["family_options"] == {"iterations": 7, "hc_eps": 1e-4, "eps": 1e-5}
    assert result["depth"] == 2 * LAYERS
    zero = torch.zeros(1, 1, N, DIM, dtype=torch.float64)
    for index in range(2 * LAYERS):
        layer, site = divmod(index, 2)
        params = {k[len(f"layers.{layer}.hc_{('attn', 'ffn')[site]}_"):]: v.double() for k, v in tensors.items()
                  if k.startswith(f"layers.{layer}.hc_{('attn', 'ffn')[site]}_")}
        pre, post, comb = transcribed_mix(params, zero, N, 7, 1e-4, 1e-5)
        for key, expected in (("pre", pre[0, 0]), ("post", post[0, 0]), ("res", comb[0, 0].T)):
            got = torch.tensor(result["matrices"][key][index], dtype=torch.float64)
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    out = tmp_path / "report"
    assert main(["diagnose", "--static", str(tmp_path), "--out", str(out)]) == 0
    assert "each site's read weights (pre) are read by the next site" in (out / "report.md").read_text()

    save_file({**checkpoint(seed=5), "hc_head_base": torch.zeros(N)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"hc_head_base is a hyper-head's; DeepSeek-V4.1 has none"):
        diagnose_static(tmp_path)
    save_file(checkpoint(seed=5), str(tmp_path / "model.safetensors"))
    broken = config()
    del broken["text_config"]["hc_sinkhorn_iters"]
    (tmp_path / "config.json").write_text(json.dumps(broken))
    capsys.readouterr()
    assert main(["diagnose", "--static", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "hc_sinkhorn_iters" in error[0], error
