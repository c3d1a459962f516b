"""Muon with AdamW in torchtitan's trainer, routed by s2hc's own rule (:mod:`s2hc.train.optim`).

torchtitan 0.3.0 has a Muon: ``DistMuon`` (``torchtitan.distributed.flex_shard``, optimizer name ``"DistMuon"`` in an
``OptimizersContainer`` param group), which gathers each matrix (``Owned``: one rank computes its Newton–Schulz
iterations whole) from its FSDP shards. :func:`muon_optimizer` gives it what s2hc's harness gives torch's Muon
(:func:`s2hc.train.optim.optimizer_of_parameters`, decided on the s2hc ``Transformer`` of the same model and carried
over by name with :func:`s2hc.torchtitan.convert.torchtitan_name`): the ``nn.Linear`` weights of the blocks'
branches (attention ``wq``/``wk``/``wv``/``wo``, feed-forward ``w1``/``w2``/``w3``); and AdamW everything else: the
embedding, the LM head, every norm weight and bias, and every parameter of the connections, the stream scaling and
the learned head. AdamW's groups follow s2hc's ``"matrices"`` weight-decay rule (the embedding, the LM head and the
connections' token-driven projections decay; no norm weight, bias or connection scalar does), Muon's matrices decay,
and Muon's step is scaled with ``adjust_lr_fn="match_rms_adamw"`` (s2hc's
:data:`~s2hc.train.optim.MUON_LR_ADJUSTMENT`) so that one learning rate serves both. DistMuon refuses any device but
CUDA ("DistMuon requires one CUDA device per process"): on a CPU only the routing is tested
(``tests/test_torchtitan.py``).

One difference from s2hc's harness: torchtitan fuses the query, key and value projections into one ``wqkv``
parameter (``fuse_qkv=True``, its default), which Muon then orthogonalises as one matrix, where s2hc's harness
orthogonalises ``q_proj``, ``k_proj`` and ``v_proj`` each alone.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torchtitan.components.checkpointer.utils import _WRAPPER_PREFIXES
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.models.common.attention import FusedQKVLinear

from ..models import Transformer
from ..train.optim import MUON_LR_ADJUSTMENT, decay_targets, optimizer_of_parameters
from .convert import to_model_config, torchtitan_name
from .model import S2HCDecoder

__all__ = ["muon_optimizer", "optimizer_routes"]

# A dot between two segments of a name, and any wrapper segments torchtitan's canonical names leave out.
_WRAPPERS = r"\.(?:(?:" + "|".join(map(re.escape, (*_WRAPPER_PREFIXES, "_orig_mod"))) + r")\.)*"
_SPLIT_QKV = re.compile(r"(layers\.\d+\.attention\.qkv_linear\.)w[qkv]\.(weight|bias)")


def optimizer_routes(config: S2HCDecoder.Config) -> dict[str, tuple[str, bool]]:
    """torchtitan parameter name -> ``(optimizer, decays)`` for a model of ``config``: ``"muon"`` or ``"adamw"`` as
    s2hc's harness routes the same parameter of its own model, and whether weight decay applies (Muon's matrices
    always; AdamW's by the ``"matrices"`` rule). A tied embedding is listed under both its names; a fused ``wqkv``
    takes the route its three parts share (ValueError if they did not)."""
    with torch.device("meta"):
        model = Transformer(to_model_config(config), init_rng="sequential")
    routes = optimizer_of_parameters(model, "muon")
    targets = decay_targets(model, "matrices")
    fused = {index for index, layer in enumerate(config.layers)
             if isinstance(layer.attention.qkv_linear, FusedQKVLinear.Config)}
    found: dict[str, tuple[str, bool]] = {}
    for name, route in routes.items():
        route_of = (route, route == "muon" or targets[name] is not None)
        names = [torchtitan_name(name)]
        if name == "embed.weight" and config.enable_weight_tying:
            names.append("lm_head.weight")
        for titan in names:
            split = _SPLIT_QKV.fullmatch(titan)
            if split and int(titan.split(".")[1]) in fused:
                titan = f"{split[1]}wqkv.{split[2]}"
                if found.get(titan, route_of) != route_of:
                    raise ValueError(f"the parts of {titan!r} take different optimizers; s2hc routes q, k and v "
                                     "alike")
            found[titan] = route_of
    return found


def muon_optimizer(config: S2HCDecoder.Config, *, lr: float, weight_decay: float = 0.1,
                   betas: tuple[float, float] = (0.9, 0.95)) -> OptimizersContainer.Config:
    """torchtitan's ``OptimizersContainer.Config`` for ``config``'s model: ``DistMuon`` over the branches' matrices
    (each computed whole on one rank, ``Owned``; momentum 0.95 with Nesterov, torch's and DistMuon's defaults), AdamW
    over the rest in a decaying and a non-decaying group (:func:`optimizer_routes`), every group at ``lr``. Each
    group names its parameters exactly, so a parameter no group claims is torchtitan's error, not a silent
    default."""
    from torchtitan.distributed.flex_shard import BucketConfig, ComputeLayout, Owned
    from torchtitan.distributed.parallel_dims import MeshAxisName

    routes = optimizer_routes(config)

    def exactly(names: list[str]) -> str:
        """These names and no other, matched as torchtitan matches them: on the wrapped model's names, which
        activation checkpointing and compile interleave with their wrappers' segments."""
        def name(fqn: str) -> str:
            return _WRAPPERS.join(map(re.escape, fqn.split(".")))
        return "^(?:" + "|".join(map(name, names)) + ")$"

    muon = sorted(name for name, (route, _) in routes.items() if route == "muon")
    decayed = sorted(name for name, (route, decays) in routes.items() if route == "adamw" and decays)
    kept = sorted(name for name, (route, decays) in routes.items() if route == "adamw" and not decays)
    adamw = {"lr": lr, "betas": betas, "eps": 1e-8}
    owned = ComputeLayout(shardings_by_mesh_axis={MeshAxisName.DP_SHARD.value: Owned()})
    groups = [ParamGroupConfig(pattern=exactly(muon), optimizer_name="DistMuon",
                               optimizer_kwargs={"lr": lr, "weight_decay": weight_decay, "foreach": False,
                                                 "adjust_lr_fn": MUON_LR_ADJUSTMENT}),
              ParamGroupConfig(pattern=exactly(decayed), optimizer_name="AdamW",
                               optimizer_kwargs={**adamw, "weight_decay": weight_decay})]
    if kept:
        groups.append(ParamGroupConfig(pattern=exactly(kept), optimizer_name="AdamW",
                                       optimizer_kwargs={**adamw, "weight_decay": 0.0}))
    factory: dict[str, Any] = {"compute_sharding_by_fqn": dict.fromkeys(muon, owned),
                               "bucket_configs": (BucketConfig(name="matrices", patterns=tuple(muon)),)}
    return OptimizersContainer.Config(implementation="foreach", param_groups=groups,
                                      optimizer_factory_kwargs_by_name={"DistMuon": factory})
