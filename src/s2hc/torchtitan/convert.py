"""A torchtitan run's weights as an :class:`s2hc.models.Transformer` with the same logits.

:class:`~s2hc.torchtitan.model.S2HCDecoder` and s2hc's ``Transformer`` compute the same function with other names
and, for llama3's blocks, another RoPE layout: torchtitan's ``ComplexRoPE`` rotates adjacent feature pairs
``(2j, 2j + 1)`` of a head, s2hc (as Hugging Face) the halves ``(j, j + D / 2)``, so the query and key projections
(and a QK-norm's weight) have their output features reordered per head, as transformers' own Llama conversion does.
qwen3's ``CosSinRoPE`` is already rotate-half. The connections, the stream scaling and the learned head are the
same s2hc modules in both, copied as they are.

- :func:`to_model_config`: the :class:`~s2hc.models.ModelConfig` of an ``S2HCDecoder.Config``.
- :func:`to_s2hc_state`: a torchtitan state dict (``model.state_dict()``, whose fused ``wqkv`` torchtitan already
  writes as ``wq`` / ``wk`` / ``wv``) as the ``Transformer``'s.
- :func:`read_dcp_state`: the model's tensors of a DCP checkpoint directory written by torchtitan's trainer
  (``DUMP/checkpoint/step-N``: the model's tensors at the top level beside ``optimizer``, ``lr_scheduler``, ...),
  read in one process with s2hc's safe DCP reader (nothing unpickled but data).
- :func:`load_checkpoint`: both, a ``Transformer`` with the checkpoint's weights; :func:`convert` writes it as an
  s2hc run directory (``config.yaml`` and ``checkpoint.pt``) that ``s2hc export``, ``eval`` and ``diagnose`` read.

From the command line (in the torchtitan environment; ``s2hc export`` then runs in one with the ``hf`` extra)::

    python -m s2hc.torchtitan.convert DUMP/checkpoint/step-1000 --config s2hc_debugmodel --out runs/from-titan

Logits agree in float32 to rounding (``tests/test_torchtitan.py``) where torchtitan's attention is causal over the
whole sequence: SDPA (the CPU), or FlexAttention on a single document; torchtitan's per-document masks over packed
documents have no counterpart in ``Transformer``, which is causal over its input.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torchtitan.models.common import ComplexRoPE, CosSinRoPE
from torchtitan.models.common.attention import FusedQKVLinear, GQAttention, QKVLinear
from torchtitan.models.common.feed_forward import FeedForward

from ..connection import forms
from ..models import ModelConfig, Transformer
from .model import S2HCDecoder

__all__ = ["convert", "load_checkpoint", "read_dcp_state", "to_model_config", "to_s2hc_state"]


def _fail(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{name} must be {allowed} to convert to s2hc, got {value!r}")


def _bias(linear_config: Any) -> bool:
    return bool(getattr(linear_config, "bias", False))


def _layer_settings(config: S2HCDecoder.Config, index: int) -> dict[str, Any]:
    """What s2hc's ModelConfig needs from torchtitan's layer ``index``; every layer must give the same."""
    layer = config.layers[index]
    where = f"layers[{index}]"
    attention = layer.attention
    if type(attention) is not GQAttention.Config:
        raise _fail(f"{where}.attention", type(attention).__name__, "GQAttention.Config")
    if layer.moe is not None or type(layer.feed_forward) is not FeedForward.Config:
        raise _fail(f"{where}.feed_forward", type(layer.feed_forward).__name__, "a dense FeedForward.Config (SwiGLU)")
    qkv = attention.qkv_linear
    if type(qkv) is FusedQKVLinear.Config:
        qkv_bias = _bias(qkv.wqkv)
    elif type(qkv) is QKVLinear.Config:
        if _bias(qkv.wq) != _bias(qkv.wkv):
            raise _fail(f"{where}.attention.qkv_linear", "wq and wkv with different biases", "one bias setting")
        qkv_bias = _bias(qkv.wq)
    else:
        raise _fail(f"{where}.attention.qkv_linear", type(qkv).__name__, "FusedQKVLinear.Config or QKVLinear.Config")
    ffn = layer.feed_forward
    biases = {_bias(ffn.w1), _bias(ffn.w2), _bias(ffn.w3)}
    if len(biases) > 1:
        raise _fail(f"{where}.feed_forward", "w1, w2, w3 with different biases", "one bias setting")
    rope = attention.rope
    if type(rope) not in (ComplexRoPE.Config, CosSinRoPE.Config):
        raise _fail(f"{where}.attention.rope", type(rope).__name__, "ComplexRoPE.Config or CosSinRoPE.Config")
    if rope.scaling == "yarn":
        raise _fail(f"{where}.attention.rope.scaling", rope.scaling, "'none' or 'llama'")
    n_heads = attention.n_heads
    head_dim = attention.head_dim if attention.head_dim is not None else config.dim // n_heads
    if rope.dim != head_dim:
        raise _fail(f"{where}.attention.rope.dim", rope.dim, f"the head dimension {head_dim}")
    norms = [config.norm] + ([layer.attention_norm, layer.ffn_norm] if layer.attention_norm is not None else [])
    norms += [attention.qk_norm] if attention.qk_norm is not None else []
    eps = {norm.eps for norm in norms}
    if len(eps) > 1:
        raise _fail(f"{where} norms' eps", sorted(eps), "one epsilon for every norm (s2hc's norm_eps)")
    scaling = None
    if rope.scaling == "llama":
        scaling = {"rope_type": "llama3", "factor": rope.scaling_factor, "low_freq_factor": rope.low_freq_factor,
                   "high_freq_factor": rope.high_freq_factor,
                   "original_max_position_embeddings": rope.original_max_position_embeddings}
    return {"n_heads": n_heads, "n_kv_heads": attention.n_kv_heads or n_heads, "head_dim": head_dim,
            "ffn_dim": ffn.w1.out_features, "qkv_bias": qkv_bias, "out_bias": _bias(attention.wo),
            "mlp_bias": biases.pop(), "rope_theta": rope.theta, "rope_scaling": scaling,
            "max_seq_len": rope.max_seq_len, "qk_norm": attention.qk_norm is not None, "norm_eps": eps.pop(),
            "interleaved_rope": type(rope) is ComplexRoPE.Config}


def _settings(config: S2HCDecoder.Config) -> dict[str, Any]:
    if not isinstance(config, S2HCDecoder.Config):
        raise ValueError(f"config must be an S2HCDecoder.Config, got {type(config).__name__}")
    settings = [_layer_settings(config, index) for index in range(len(config.layers))]
    for index, other in enumerate(settings[1:], start=1):
        differing = sorted(key for key in other if other[key] != settings[0][key])
        if differing:
            raise ValueError(f"layers[{index}] differs from layers[0] in {differing}; s2hc's Transformer has one "
                             "shape for every layer")
    return settings[0]


def to_model_config(config: S2HCDecoder.Config) -> ModelConfig:
    """The :class:`~s2hc.models.ModelConfig` of the s2hc ``Transformer`` that computes what an
    :class:`~s2hc.torchtitan.model.S2HCDecoder` of ``config`` computes: its sizes, RoPE (base, Llama 3 scaling),
    QK-norm, biases, tying, norm epsilon, ``max_seq_len`` (the RoPE table's length) and its family, streams, read,
    stream scaling and family options. ValueError naming what s2hc's Transformer cannot hold (MoE, YaRN, layers of
    different shapes, norms of different epsilons)."""
    settings = _settings(config)
    settings.pop("interleaved_rope")
    form = forms.get(config.family)
    return ModelConfig(
        vocab_size=config.vocab_size, dim=config.dim, n_layers=len(config.layers), norm="rmsnorm", mlp="swiglu",
        pos="rope", tie_embeddings=bool(config.enable_weight_tying), **settings, family=config.family,
        n_streams=form.default_streams if config.n_streams is None else config.n_streams,
        family_options=config.options(), stream_reduce=config.stream_reduce, lss_init=config.lss_init)


# s2hc's name -> torchtitan's, per block (``{i}`` the layer) and for the rest of the model
_BLOCK_NAMES = (
    ("attn.q_proj.", "attention.qkv_linear.wq."), ("attn.k_proj.", "attention.qkv_linear.wk."),
    ("attn.v_proj.", "attention.qkv_linear.wv."), ("attn.o_proj.", "attention.wo."),
    ("attn.q_norm.", "attention.q_norm."), ("attn.k_norm.", "attention.k_norm."),
    ("attn_norm.", "attention_norm."), ("mlp_norm.", "ffn_norm."),
    ("mlp.gate_proj.", "feed_forward.w1."), ("mlp.up_proj.", "feed_forward.w3."),
    ("mlp.down_proj.", "feed_forward.w2."),
    ("attn_hc.", "attention_connection."), ("mlp_hc.", "feed_forward_connection."),
)  # fmt: skip
_MODEL_NAMES = (("embed.", "tok_embeddings."), ("stream_scale.", "streams.scale."),
                ("stream_head.", "streams.head."), ("norm.", "norm."), ("lm_head.", "lm_head."))
_BLOCK = re.compile(r"blocks\.(\d+)\.(.*)")
# The tensors whose output features RoPE rotates: reordered from adjacent pairs to halves under ComplexRoPE.
_ROTATED = ("attn.q_proj.", "attn.k_proj.", "attn.q_norm.", "attn.k_norm.")


def torchtitan_name(name: str) -> str:
    """The name in torchtitan's state dict of the s2hc ``Transformer``'s tensor ``name``."""
    match = _BLOCK.fullmatch(name)
    prefix, rest, table = "", name, _MODEL_NAMES
    if match:
        prefix, rest, table = f"layers.{match[1]}.", match[2], _BLOCK_NAMES
    for ours, theirs in table:
        if rest.startswith(ours):
            return prefix + theirs + rest[len(ours):]
    raise ValueError(f"s2hc tensor {name!r} has no torchtitan counterpart")


def _halves(tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Output features ``(H · D, ...)`` of a projection (or ``(D,)`` of a QK-norm) from torchtitan's adjacent-pair
    RoPE layout to rotate-half: per head, features ``0, 2, 4, ...`` then ``1, 3, 5, ...``."""
    rest = tensor.shape[1:]
    heads = tensor.shape[0] // head_dim
    return tensor.reshape(heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(tensor.shape)


def _expected(model_config: ModelConfig) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return Transformer(model_config, init_rng="sequential").state_dict()


def to_s2hc_state(state: Mapping[str, torch.Tensor], config: S2HCDecoder.Config) -> dict[str, torch.Tensor]:
    """``state``, a torchtitan :class:`~s2hc.torchtitan.model.S2HCDecoder`'s state dict of ``config`` (plain or
    DTensor values; with the split ``wq`` / ``wk`` / ``wv`` torchtitan's state dicts and checkpoints hold), as the
    state dict of ``Transformer(to_model_config(config))``: renamed, the query and key features reordered for
    ComplexRoPE, float32 as saved. ValueError naming the torchtitan tensor that is missing, misshapen or not part
    of such a model."""
    from torch.distributed.tensor import DTensor

    settings = _settings(config)
    expected = _expected(to_model_config(config))
    converted: dict[str, torch.Tensor] = {}
    used = set()
    for name, target in expected.items():
        source = torchtitan_name(name)
        if source not in state:
            raise ValueError(f"torchtitan tensor {source!r} is missing (s2hc's {name!r}, shape "
                             f"{tuple(target.shape)})")
        value = state[source]
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if not isinstance(value, torch.Tensor) or value.shape != target.shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"torchtitan tensor {source!r} has shape {shape}; s2hc's {name!r} needs "
                             f"{tuple(target.shape)}")
        value = value.detach().cpu()
        rest = _BLOCK.fullmatch(name)
        if settings["interleaved_rope"] and rest and rest[2].startswith(_ROTATED):
            value = _halves(value, settings["head_dim"])
        converted[name] = value.clone()
        used.add(source)
    extra = sorted(set(state) - used)
    if extra:
        raise ValueError(f"torchtitan tensor {extra[0]!r} is not part of an s2hc model of this config "
                         f"({len(extra)} such tensor(s))")
    return converted


def read_dcp_state(directory: str | Path, config: S2HCDecoder.Config) -> dict[str, torch.Tensor]:
    """The model's tensors of a DCP checkpoint directory written by torchtitan's trainer for ``config``
    (``DUMP/checkpoint/step-N``), as torchtitan's model state dict names them, full (unsharded) and float32 as
    saved; its optimizer, scheduler and data-loader state are not read. Read with s2hc's DCP reader, which
    unpickles nothing but data. ValueError naming a tensor that the checkpoint lacks or holds in another shape,
    or the directory when it is no DCP checkpoint."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..rundir.sharded import load_sharded_into, read_sharded_metadata

    directory = Path(directory)
    metadata = read_sharded_metadata(directory).state_dict_metadata
    with torch.device("meta"):
        names = config.build().state_dict()
    state = {}
    for name, meta in names.items():
        saved = metadata.get(name)
        if not isinstance(saved, TensorStorageMetadata):
            raise ValueError(f"torchtitan tensor {name!r} is missing from checkpoint {str(directory)!r}")
        if tuple(saved.size) != tuple(meta.shape):
            raise ValueError(f"torchtitan tensor {name!r} has shape {tuple(saved.size)} in checkpoint "
                             f"{str(directory)!r}; this config's model needs {tuple(meta.shape)}")
        state[name] = torch.empty(tuple(saved.size), dtype=saved.properties.dtype)
    load_sharded_into(directory, state)
    return state


def load_checkpoint(source: str | Path | Mapping[str, torch.Tensor], config: S2HCDecoder.Config) -> Transformer:
    """An s2hc ``Transformer`` of :func:`to_model_config` with the weights of ``source``: a torchtitan DCP
    checkpoint directory (:func:`read_dcp_state`) or a torchtitan model state dict, of a model of ``config``."""
    state = read_dcp_state(source, config) if isinstance(source, (str, Path)) else source
    converted = to_s2hc_state(state, config)
    model = Transformer(to_model_config(config), init_rng="sequential")
    model.load_state_dict(converted)
    return model


def _tokenizer(trainer: Any) -> str:
    """The tokenizer of a torchtitan run for s2hc's config: s2hc's own when the run used the package's data
    directory (the corpus configs), else the ``tokenizer.json`` in its ``hf_assets_path``."""
    from ..data.tokenizer import DEFAULT_TOKENIZER, shipped_tokenizer_path

    assets = Path(str(trainer.hf_assets_path)).expanduser()
    if assets.resolve() == Path(str(shipped_tokenizer_path())).parent.resolve():
        return DEFAULT_TOKENIZER
    return str((assets / "tokenizer.json").resolve())


def convert(source: str | Path | Mapping[str, torch.Tensor], trainer: Any, out: str | Path, *,
            tokenizer: str | None = None, overwrite: bool = False) -> Path:
    """Write the s2hc run directory ``out`` (``config.yaml``, ``checkpoint.pt``) holding ``source``, torchtitan's DCP
    checkpoint directory (or its model's state dict) of ``trainer`` (the run's ``Trainer.Config``, whose
    ``model_spec.model`` is an ``S2HCDecoder.Config``); returns the checkpoint's path. The run's config is the
    model as ``model_overrides`` of the ``tiny`` preset, the run's sequence length, and ``tokenizer`` (default:
    :func:`_tokenizer`'s), so ``s2hc export``, ``eval`` and ``diagnose`` rebuild this very model. The step is the
    directory's ``step-N``, 0 otherwise. ValueError (nothing written) as :func:`load_checkpoint` and for an ``out``
    that holds a run (without ``overwrite``) or other files."""
    from ..config import TrainConfig, family_fields
    from ..rundir import CHECKPOINT, Checkpoint, write_config
    from ..rundir.checkpoint import save_checkpoint
    from ..rundir.guard import notice, run_files
    from ..rundir.layout import is_run_entry
    from ..rundir.schema import new_run_id
    from ..rundir.staging import check_replaceable, replace_directory

    def check_run_out() -> None:  # as s2hc upcycle checks its --out: no run there unless overwrite, nothing else
        found = run_files(out)
        if found and not overwrite:
            raise ValueError(f"--out {str(out)!r} already holds a run ({', '.join(found)}); pass --overwrite to "
                             f"replace it, or choose another --out")
        check_replaceable(out, "--out", "an s2hc run", is_run_entry)

    config = trainer.model_spec.model
    model = load_checkpoint(source, config)
    settings = model.config.to_dict()
    families = family_fields()
    run = TrainConfig.from_dict({
        "preset": "tiny", "tokenizer": tokenizer or _tokenizer(trainer),
        "model_overrides": {key: value for key, value in settings.items() if key not in families},
        **{key: settings[key] for key in families},
        "seq_len": min(trainer.training.seq_len, model.config.max_seq_len), "out": str(out)})
    if run.model_config() != model.config:  # the run's config must rebuild this very model
        raise ValueError(f"the converted model does not round-trip through its run configuration: "
                         f"{run.model_config()} != {model.config}")
    step = re.fullmatch(r"step-(\d+)", Path(source).name) if isinstance(source, (str, Path)) else None
    check_run_out()
    with replace_directory(out, argument="--out", kind="an s2hc run", allowed=is_run_entry, lock_inside=True,
                           check=check_run_out, log=notice) as run_dir:
        write_config(run_dir, run.to_dict())
        save_checkpoint(run_dir / CHECKPOINT, Checkpoint(
            config=run.to_dict(), model_config=settings, step=int(step[1]) if step else 0,
            model=model.state_dict(), run_id=new_run_id()))
    return Path(out).expanduser() / CHECKPOINT


def _trainer_config(name: str, module: str) -> Any:
    """``--module MODULE --config NAME``'s ``Trainer.Config``, found as torchtitan's trainer finds it."""
    try:
        registry = importlib.import_module(f"{module}.config_registry")
    except ModuleNotFoundError:
        registry = importlib.import_module(module)
    return getattr(registry, name)()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m s2hc.torchtitan.convert",
        description="Write a torchtitan run's DCP checkpoint of an s2hc.torchtitan model as an s2hc run directory "
        "(config.yaml, checkpoint.pt) that s2hc export, eval and diagnose read.")
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="torchtitan's DCP directory, DUMP/checkpoint/step-N")
    parser.add_argument("--config", required=True, help="the run's --config (e.g. s2hc_debugmodel)")
    parser.add_argument("--module", default="s2hc.torchtitan", help="the run's --module (default s2hc.torchtitan)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the s2hc run directory to write")
    parser.add_argument("--tokenizer", default=None,
                        help="the run's tokenizer for s2hc (default: s2hc-bpe-4k for the corpus configs, else "
                        "HF_ASSETS_PATH/tokenizer.json)")
    parser.add_argument("--overwrite", action="store_true", help="replace a run already in DIR")
    args = parser.parse_args(argv)
    try:
        trainer = _trainer_config(args.config, args.module)
        path = convert(args.checkpoint, trainer, args.out, tokenizer=args.tokenizer, overwrite=args.overwrite)
    except ValueError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

