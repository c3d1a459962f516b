"""A torchtitan decoder whose sublayers are wrapped in s2hc connections of any family.

:class:`S2HCDecoder` is torchtitan 0.3.0's ``Decoder`` (embedding, ``layers``, final norm, ``lm_head``) with
:class:`s2hc.Connections` around every branch: the state the family carries (n streams ``(B, T, n, C)``, one
stream, or AttnRes's tuple of sources) is made from the embeddings after ``tok_embeddings``, passed through every
:class:`S2HCBlock` (attention, then MLP, each ``connection(x, branch, ...)``) and read back to ``(B, T, C)`` (the
sum, mean or the family's learned head) before the final norm. The blocks are llama3's or qwen3's dense blocks
(their attention, feed-forward and norms, built from their configs), so torchtitan's ``parallelize_llama`` /
``parallelize_qwen3`` apply activation checkpointing, per-block ``torch.compile`` and FSDP2 (``fully_shard`` per
block; under a bfloat16 policy :func:`parallelize` first makes each connection a float32 unit of its own) as for
its own models.

Initialisation. torchtitan builds the model on ``meta``, shards it, materialises it with ``to_empty`` and then
calls ``init_weights`` (``Module.init_states``), which knows only its own modules. :meth:`S2HCDecoder.init_states`
then builds the same :class:`s2hc.Connections` on the CPU, draws its random parameters per parameter from
``init_seed`` (:func:`s2hc.init_rng.redraw`, s2hc's default ``init_rng``), and copies every parameter and buffer
(the families' constant tables too) into the model, into each rank's shard when FSDP has made it a DTensor: the
connections start at exactly s2hc's values, on every rank and whatever the parallelism.

Tensor parallelism (``--parallelism.tensor_parallel_degree``, with ``--parallelism.spmd_backend partial_dtensor``):
the branches take torchtitan's llama3 / qwen3 plan (colwise q/k/v and w1/w3, rowwise wo and w2, sequence parallelism
around the norms by default); :func:`replicate_connections` replicates the connections' parameters on the TP mesh and
has every rank compute them on local tensors, for all tokens or for its sequence shard (they mix streams per token),
the streams handed to and taken from the branches as DTensors of the plan's activation placement.

Not supported (refused in ``update_from_config``): pipeline parallelism (the state between stages would be a
family's own structure, AttnRes's growing tuple of sources, and the stream ends sit on the first and last stage),
and context parallelism (not tried). See docs/distributed.md, "torchtitan".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.decoder import Decoder, TransformerBlock
from torchtitan.models.llama3 import Llama3Model, parallelize_llama
from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.module import Module, ModuleDict

from ..connection.precision import connection_modules, lowers_precision, shard_connections
from ..connection.stack import Connections
from ..init_rng import redraw
from ..yaml_safety import load_yaml

__all__ = ["ARCHITECTURES", "S2HCBlock", "S2HCDecoder", "causal_sdpa", "replicate_connections", "s2hc_model_config",
           "s2hc_model_spec"]

#: The torchtitan models whose dense blocks, config hooks and parallelize function an S2HCDecoder reuses.
ARCHITECTURES: dict[str, tuple[type, Callable]] = {
    "llama3": (Llama3Model, parallelize_llama),
    "qwen3": (Qwen3Model, parallelize_qwen3),
}


class _Identity(Module):
    """No norm: the gated residual's branches read a normalised state, and heads that normalise replace the final
    norm."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config | None = None):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class S2HCBlock(TransformerBlock):
    """A dense decoder block (llama3's and qwen3's attention, feed-forward and norms) whose two branches run inside
    s2hc connections: ``x = attention_connection(x, attention branch); feed_forward_connection(x, MLP branch)``,
    ``x`` being whatever state the family carries. The connections are built by the decoder (one
    :class:`s2hc.Connections` for the whole model) and passed in."""

    @dataclass(kw_only=True, slots=True)
    class Config(TransformerBlock.Config):
        pre_norms: bool = True
        """The branches keep their RMSNorm (False for the gated residual, whose read is normalised)."""

    def __init__(self, config: Config, *, connections: tuple[nn.Module, nn.Module]):
        super().__init__()
        if config.feed_forward is None or config.moe is not None:
            raise ValueError("S2HCBlock wraps dense blocks: a feed_forward and no moe")
        self.attention = config.attention.build()
        self.feed_forward = config.feed_forward.build()
        self.attention_norm = config.attention_norm.build() if config.pre_norms else _Identity.Config().build()
        self.ffn_norm = config.ffn_norm.build() if config.pre_norms else _Identity.Config().build()
        self.attention_connection, self.feed_forward_connection = connections

    #: The dtype a branch gets its input in (None: the streams'). :func:`parallelize` sets bfloat16 under a bfloat16
    #: FSDP2 policy, whose float32 streams would otherwise meet the branch's bfloat16 parameters.
    compute_dtype: torch.dtype | None = None

    #: Under tensor parallelism, the mesh and placements of the activations torchtitan's branches take (replicated,
    #: or a sequence shard) that the local streams are handed over as (:func:`replicate_connections`); None without.
    tp_activation: tuple[Any, list] | None = None

    def _attention(self, h: torch.Tensor, attention_masks: Any, positions: torch.Tensor | None) -> torch.Tensor:
        h = _distributed(_cast(h, self.compute_dtype), self.tp_activation)
        return _local(self.attention(self.attention_norm(h), attention_masks, positions))

    def _feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        h = _distributed(_cast(h, self.compute_dtype), self.tp_activation)
        return _local(self.feed_forward(self.ffn_norm(h)))

    def forward(self, x: Any, attention_masks: Any, positions: torch.Tensor | None = None) -> Any:
        x = self.attention_connection(x, self._attention, attention_masks, positions)
        return self.feed_forward_connection(x, self._feed_forward)


class S2HCDecoder(Decoder):
    """torchtitan's decoder with s2hc connections around every branch (module docstring).

    ``streams`` is the :class:`s2hc.Connections` of the whole model with its per-sublayer connections handed to
    the blocks (``layers[i].attention_connection`` is sublayer ``2 i``, ``feed_forward_connection`` ``2 i + 1``):
    what it keeps is the stream expansion (and its learned scaling, ``lss_init``) and the final read (and its
    learned head, ``stream_reduce="head"``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Decoder.Config):
        architecture: str = "llama3"
        """Whose config hooks (RoPE length, sharding specs, FLOPs) and parallelize function: llama3 or qwen3."""
        family: str = "s2hc"
        """Any of s2hc.families()."""
        n_streams: int | None = None
        """The streams n (None: the family's default)."""
        stream_reduce: str | None = None
        """The final read: sum, mean or head (None: the family's default)."""
        lss_init: float | None = None
        """Learned stream scaling after the expansion, started at this value (None: none)."""
        family_options: str = ""
        """The family's options as a YAML mapping, e.g. ``{iterations: 10}`` or ``{block_size: 2}``."""
        init_seed: int = 0
        """The seed of the connections' per-parameter random draws (s2hc.init_rng); the same on every rank."""

        def options(self) -> dict[str, Any]:
            options = load_yaml(self.family_options) if self.family_options.strip() else {}
            if not isinstance(options, dict):
                raise ValueError(f"family_options must be a YAML mapping, got {self.family_options!r}")
            return options

        def connections(self) -> Connections:
            """The model's :class:`s2hc.Connections`, built on the current default device."""
            return Connections(self.dim, 2 * len(self.layers), self.family, n_streams=self.n_streams,
                               stream_reduce=self.stream_reduce, lss_init=self.lss_init,
                               norm_eps=self.norm.eps, **self.options())

        def update_from_config(self, *, config, **kwargs) -> None:
            base = ARCHITECTURES[self.architecture][0]
            base.Config.update_from_config(self, config=config, **kwargs)
            parallelism = config.parallelism
            refused = {"pipeline": parallelism.pipeline_parallel_degree,
                       "context": parallelism.context_parallel_degree}
            for name, degree in refused.items():
                if degree > 1:
                    raise NotImplementedError(
                        f"s2hc.torchtitan supports data and tensor parallelism (FSDP2, HSDP, DDP, TP with or without "
                        f"sequence parallelism), not {name} parallelism (degree {degree}): docs/distributed.md, "
                        f"'torchtitan'")
            if parallelism.tensor_parallel_degree > 1 and parallelism.spmd_backend != "partial_dtensor":
                raise NotImplementedError(
                    f"s2hc.torchtitan's tensor parallelism runs with --parallelism.spmd_backend partial_dtensor, not "
                    f"{parallelism.spmd_backend!r}: its connections compute on local tensors between DTensor "
                    f"branches, tested with that backend only (the default, spmd_types, refuses torchtitan's own "
                    f"llama3 FSDP under torch 2.13): docs/distributed.md, 'torchtitan'")

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            return ARCHITECTURES[self.architecture][0].Config.get_nparams_and_flops(self, model, seq_len)

    def __init__(self, config: Config):
        Module.__init__(self)
        if config.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)}, got {config.architecture!r}")
        self.config = config
        streams = config.connections()
        sublayers = list(streams.connections)
        streams.connections = nn.ModuleList()  # each block holds its own two
        self.tok_embeddings = config.tok_embeddings.build()
        self.streams = streams
        self.layers = ModuleDict()
        for i, layer_config in enumerate(config.layers):
            layer_config = dataclasses.replace(layer_config, pre_norms=streams.pre_norms)
            self.layers[str(i)] = layer_config.build(connections=(sublayers[2 * i], sublayers[2 * i + 1]))
        self.norm = config.norm.build() if streams.final_norm else _Identity.Config(
            sharding_config=_gathering(config.norm.sharding_config)).build()
        self.lm_head = config.lm_head.build()
        self.enable_weight_tying = config.enable_weight_tying
        if self.enable_weight_tying:
            self.tok_embeddings.weight = self.lm_head.weight

    #: The dtype the streams are made in (None: the embedding's), and the one the final norm and LM head get (None:
    #: the streams'). :func:`parallelize` sets float32 and bfloat16 under a bfloat16 FSDP2 policy, whose embedding
    #: comes out in bfloat16 (docs/distributed.md, "Mixed precision").
    stream_dtype: torch.dtype | None = None
    compute_dtype: torch.dtype | None = None
    #: As :attr:`S2HCBlock.tp_activation`, for the final norm.
    tp_activation: tuple[Any, list] | None = None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, attention_masks: Any = None):
        h = _local(self.tok_embeddings(tokens))
        x = self.streams.expand(_cast(h, self.stream_dtype))
        for layer in self.layers.values():
            x = layer(x, attention_masks, positions)
        h = self.norm(_distributed(_cast(self.streams.reduce(x), self.compute_dtype), self.tp_activation))
        if self._skip_lm_head:
            return h
        return self.lm_head(h)

    def s2hc_modules(self) -> dict[str, nn.Module]:
        """The s2hc modules by their names in this model: each block's two connections, the stream scaling and
        the head where the family has them."""
        found = {}
        for key, layer in self.layers.items():
            found[f"layers.{key}.attention_connection"] = _unwrap(layer).attention_connection
            found[f"layers.{key}.feed_forward_connection"] = _unwrap(layer).feed_forward_connection
        for name in ("scale", "head"):
            if getattr(self.streams, name) is not None:
                found[f"streams.{name}"] = getattr(self.streams, name)
        return found

    def verify_module_protocol(self) -> None:
        """torchtitan's check that every submodule is one of its ``Module`` s, except s2hc's own modules (plain
        ``nn.Module`` s, initialised by :meth:`init_states`)."""
        s2hc_names = {"streams", "streams.connections", *self.s2hc_modules()}
        failures = [f"{fqn!r} ({type(module).__name__})" for fqn, module in self.named_modules()
                    if not isinstance(module, Module)
                    and not any(fqn == name or fqn.startswith(name + ".") for name in s2hc_names)]
        if failures:
            raise RuntimeError(f"The following modules do not satisfy the Module protocol: {', '.join(failures)}")

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        """torchtitan's initialisation of its own modules, then s2hc's starting values in every connection."""
        super().init_states(buffer_device=buffer_device)
        with torch.device("cpu"):
            fresh = self.config.connections()
        redraw(fresh, self.config.init_seed)
        sources = {f"streams.{name}": getattr(fresh, name) for name in ("scale", "head")}
        for key in self.layers:
            sources[f"layers.{key}.attention_connection"] = fresh.connections[2 * int(key)]
            sources[f"layers.{key}.feed_forward_connection"] = fresh.connections[2 * int(key) + 1]
        for name, module in self.s2hc_modules().items():
            copy_states(sources[name], module)


def _local(h: torch.Tensor) -> torch.Tensor:
    """``h`` as a plain tensor: under tensor parallelism torchtitan's branches and embedding return DTensors
    (replicated, or a sequence shard under sequence parallelism), and the streams between them are the local tensors
    every rank holds (each rank computes the connections of its tokens, :func:`replicate_connections`). The
    gradient goes back with the DTensor's own placements. Without tensor parallelism ``h`` is returned as it is."""
    from torch.distributed.tensor import DTensor

    return h.to_local() if isinstance(h, DTensor) else h


def _distributed(h: torch.Tensor, activation: tuple[Any, list] | None) -> torch.Tensor:
    """The local ``h`` as the DTensor torchtitan's modules take (``activation``: mesh and placements), whose
    gradient comes back whole (replicated) or as the sequence shard; ``h`` itself without tensor parallelism."""
    if activation is None:
        return h
    from torch.distributed.tensor import DTensor

    mesh, placements = activation
    return DTensor.from_local(h, mesh, placements, run_check=False)


def _gathering(norm_sharding: Any) -> Any:
    """The final norm's activation sharding without its weight, for the identity that replaces it (a family whose
    learned read is normalised): under sequence parallelism it gathers the sequence before the LM head, as
    torchtitan's final norm does."""
    if norm_sharding is None:
        return None
    from torchtitan.protocols.sharding import ShardingConfig

    return ShardingConfig(in_src_shardings={"x": norm_sharding.in_src_shardings["input"]},
                          out_src_shardings=norm_sharding.out_src_shardings,
                          out_dst_shardings=norm_sharding.out_dst_shardings)


def replicate_connections(model: nn.Module, tp_mesh: Any, *, sequence_parallel: bool) -> list[nn.Module]:
    """Tensor parallelism for the connections: their parameters replicated on ``tp_mesh`` (DTensors ``Replicate()``,
    so that FSDP2 shards them on the data-parallel mesh beside the branches' and the gradient norm sees one mesh),
    each connection module computing on local tensors: its parameters handed to its forward as ``to_local()``
    views, its streams local (:func:`_local`). They are small and mix the streams per token, so every TP rank
    computes them whole for its tokens: all of them (their gradients then equal on every rank: ``Replicate``), or
    under sequence parallelism its sequence shard (their gradients partial sums: ``Partial``, summed across the
    mesh by FSDP2's reduction as for torchtitan's norm weights). Returns the connection modules."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    grad_placements = [Partial()] if sequence_parallel else [Replicate()]
    model.tp_activation = (tp_mesh, [Shard(1)] if sequence_parallel else [Replicate()])
    for layer in model.layers.values():
        _unwrap(layer).tp_activation = model.tp_activation
    modules = connection_modules(model)
    for module in modules:
        for owner in module.modules():
            for name, parameter in list(owner.named_parameters(recurse=False)):
                replicated = distribute_tensor(parameter.data, tp_mesh, [Replicate()], src_data_rank=None)
                owner.register_parameter(name, nn.Parameter(replicated, requires_grad=parameter.requires_grad))
        module.forward = _on_local_parameters(module, module.forward, grad_placements)
    return modules


def _on_local_parameters(module: nn.Module, forward: Callable, grad_placements: list) -> Callable:
    """``forward`` run with every DTensor parameter of ``module`` swapped for its local view (in the forward itself,
    after FSDP2's hooks have made the parameters whole), so that the connection's arithmetic, its constant tables
    and the tensors it makes stay plain tensors, which DTensor would refuse to mix."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call swaps with

    def forward_on_local_parameters(*args: Any, **kwargs: Any) -> Any:
        local = {name: parameter.to_local(grad_placements=grad_placements)
                 for name, parameter in module.named_parameters() if isinstance(parameter, DTensor)}
        with _reparametrize_module(module, local):
            return forward(*args, **kwargs)

    return forward_on_local_parameters


def _cast(h: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``h`` in ``dtype`` (None: as it is): what FSDP2's ``cast_forward_inputs``, which torchtitan turns off, would
    do for a branch, or for the final norm and LM head, under a bfloat16 policy."""
    return h if dtype is None or h.dtype == dtype else h.to(dtype)


def parallelize(parallelize_fn: Callable) -> Callable:
    """``parallelize_fn`` (torchtitan's ``parallelize_llama`` / ``parallelize_qwen3``) preceded, under a bfloat16 (or
    float16) ``training.mixed_precision_param``, by :func:`s2hc.connection.precision.shard_connections` on the same
    data-parallel mesh: every connection module a float32 FSDP2 unit of its own, the streams made in float32
    (:attr:`S2HCDecoder.stream_dtype`), the branches given their input in bfloat16 (torchtitan's blocks already
    cast nothing they receive). The coefficient path then computes in float32 from float32 parameters and the
    streams are never rounded. A connection unit inside a block that torchtitan compiles with ``fullgraph=True``
    is refused by dynamo, so with ``compile.enable`` the connection modules are compiled instead (each with its
    branches inlined), before they are sharded."""

    def parallelize_s2hc(model: nn.Module, *, parallel_dims, training, parallelism, compile_config, **kwargs):
        from torchtitan.config import TORCH_DTYPE_MAP
        from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy

        if parallel_dims.tp_enabled:
            replicate_connections(model, parallel_dims.get_mesh("tp"),
                                  sequence_parallel=parallelism.enable_sequence_parallel)
        param_dtype = TORCH_DTYPE_MAP[training.mixed_precision_param]
        if lowers_precision(param_dtype) and not kwargs.get("skip_dp"):
            options: dict[str, Any] = {}
            if parallelism.spmd_backend in ("full_dtensor", "spmd_types"):
                from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh

                options["mesh"], options["dp_mesh_dims"] = resolve_fsdp_mesh(parallel_dims)
            else:
                names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
                options["mesh"] = parallel_dims.get_mesh(names)
            if training.enable_cpu_offload:
                from torch.distributed.fsdp import CPUOffloadPolicy

                options["offload_policy"] = CPUOffloadPolicy()
            options["reshard_after_forward"] = get_fsdp_reshard_after_forward_policy(
                parallelism.fsdp_reshard_after_forward, parallel_dims.pp_enabled)
            if compile_config.enable and "model" in compile_config.components:
                for module in connection_modules(model):
                    module.compile(backend=compile_config.backend, fullgraph=True)
                compile_config = dataclasses.replace(compile_config, enable=False)
            shard_connections(model, **options)
            model.stream_dtype, model.compute_dtype = torch.float32, param_dtype
            for layer in model.layers.values():
                _unwrap(layer).compute_dtype = param_dtype
        return parallelize_fn(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                              compile_config=compile_config, **kwargs)

    return parallelize_s2hc


def _unwrap(layer: nn.Module) -> nn.Module:
    """The block inside torchtitan's wrappers (activation checkpointing's CheckpointWrapper, torch.compile's
    OptimizedModule); FSDP2 wraps none."""
    while not isinstance(layer, S2HCBlock):
        layer = getattr(layer, "_checkpoint_wrapped_module", None) or getattr(layer, "_orig_mod", None)
        if layer is None:
            raise TypeError("a layer of S2HCDecoder that is not an S2HCBlock")
    return layer


@torch.no_grad()
def copy_states(source: nn.Module, target: nn.Module) -> None:
    """Every parameter and buffer of ``source`` (a freshly built s2hc module, on the CPU) into ``target``'s, which
    may be materialised on another device or sharded (a DTensor gets its own shard of the same full value)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    values = dict(source.named_parameters())
    values.update(source.named_buffers())
    states = dict(target.named_parameters())
    states.update(target.named_buffers())
    if values.keys() != states.keys():
        raise RuntimeError(f"s2hc module's states differ from a fresh one's: {sorted(values.keys() ^ states.keys())}")
    for name, state in states.items():
        value = values[name].to(dtype=state.dtype)
        if isinstance(state, DTensor):
            value = distribute_tensor(value.to(state.device_mesh.device_type), state.device_mesh, state.placements,
                                      src_data_rank=None)  # every rank holds the same full value: no communication
        else:
            value = value.to(state.device)
        state.copy_(value)


def causal_sdpa(config: Decoder.Config) -> Decoder.Config:
    """``config`` with every layer's inner attention plain causal SDPA (no per-document mask): the backend for a
    CPU, where FlexAttention has no backward."""
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def s2hc_model_config(base: Decoder.Config, family: str = "s2hc", *, architecture: str = "llama3",
                      n_streams: int | None = None, stream_reduce: str | None = None, lss_init: float | None = None,
                      family_options: str = "", init_seed: int = 0) -> S2HCDecoder.Config:
    """``base`` (a torchtitan llama3 or qwen3 dense config: its sizes, blocks, RoPE, inits) with ``family``'s
    connections around every branch."""
    layers = [S2HCBlock.Config(**{f.name: getattr(layer, f.name) for f in dataclasses.fields(TransformerBlock.Config)})
              for layer in base.layers]
    shared = {f.name: getattr(base, f.name) for f in dataclasses.fields(Decoder.Config) if f.name != "layers"}
    config = S2HCDecoder.Config(**shared, layers=layers, architecture=architecture, family=family,
                                n_streams=n_streams, stream_reduce=stream_reduce, lss_init=lss_init,
                                family_options=family_options, init_seed=init_seed)
    config.connections()  # a bad family or option: its ValueError now, not inside the trainer
    return config


def s2hc_model_spec(config: S2HCDecoder.Config, flavor: str) -> ModelSpec:
    """The ``ModelSpec`` a ``Trainer.Config`` takes: ``config`` with its architecture's parallelize function (AC,
    per-block compile, FSDP2); no pipelining function (refused), no Hugging Face state-dict adapter."""
    return ModelSpec(name=f"s2hc-{config.architecture}", flavor=flavor, model=config,
                     parallelize_fn=parallelize(ARCHITECTURES[config.architecture][1]), pipelining_fn=None,
                     post_optimizer_build_fn=None, state_dict_adapter=None)
