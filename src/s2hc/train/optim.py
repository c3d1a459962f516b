"""AdamW (or Muon with AdamW) with one weight-decay rule for every family. The learning-rate schedules are
:mod:`s2hc.schedule`'s (:func:`learning_rate` is imported from there, where it was defined before).

Which parameters decay is decided by what each one is (the module that owns it and its attribute name), never
by its shape, so the rule is the same whichever family the connections mix with (:data:`WEIGHT_DECAY_RULES`,
``TrainConfig.weight_decay_on``):

- ``"matrices"`` (default): the model's weight matrices and embeddings (every ``nn.Linear`` weight, the token
  and learned position embeddings, the LM head; a tied head is the embedding, one parameter) and each
  connection's dynamic projection (``HyperConnection.projection``, ``HyperHead.projection``; the gated
  residual's ``read_down``, ``read_up``, ``write``) decay toward 0. Nothing else does: no connection bias, scale
  α, γ, static matrix (mHC's ``(n, n)`` bias, HC's static matrix) or norm weight, whatever its shape, no learned
  stream scaling (LSS, a scale like a norm's weight), and no norm weight or bias of the model.
- ``"all"``: the s²HC authors' one AdamW group (their ``litgpt/pretrain.py`` passes ``model.parameters()``
  with ``weight_decay: 0.1``): every parameter decays. Their connection norm is ``F.normalize(x) · sqrt(nC) ·
  (1 + γ)`` with γ starting at 0, so their decay pulls its scale toward 1; s2hc stores that scale directly
  (``HyperConnection.norm_weight``, starting at 1), so here it decays toward 1 (``"decay_toward": 1.0`` in its
  group, applied by a hook :func:`make_optimizer` installs). Everything else decays toward 0, the model's own
  norm weights included: litgpt's Qwen3 RMSNorm stores and applies its weight directly, as s2hc's does, so the
  authors' runs decay it toward 0; Gemma's ``1 + w`` RMSNorm (``norm_unit_offset``) stores ``w``, whose decay
  toward 0 pulls its scale toward 1. The gated residual's norm weight is stored as Qwen stores it (``1 + w``, w
  at 0), so it decays toward 0.

- ``"2d"``: every parameter with two or more dimensions, whatever it is: s2hc's rule before these two, kept to
  reproduce runs trained with it (the committed study of docs/results.md). It is ``"matrices"`` plus mHC's and HC's
  ``(n, n)`` static matrices, the only connection biases with two dimensions, and the ``(n, C)`` learned stream
  scaling (which hc-stream-collapse's ``p.dim() >= 2`` rule decays too): not the same rule for every family.

Which optimizer updates a parameter (``TrainConfig.optimizer``, :data:`OPTIMIZERS`) is decided the same way, by what
it is (:func:`optimizer_of_parameters`): ``"adamw"`` updates every parameter; ``"muon"`` gives torch's
``torch.optim.Muon`` the hidden matrices, the ``nn.Linear`` weights of the blocks' branches (``Attention``'s
``q/k/v/o_proj``, ``MLP``'s ``gate/up/down_proj``), and AdamW everything else: the embeddings, the LM head (tied or
not), every bias and norm weight, and every parameter of the multi-stream machinery (inside a
:class:`~s2hc.connection.ConnectionModule`: small, and no hidden matrix; their scalars and biases no matrix at all).
Each optimizer applies the run's weight-decay rule to its own parameters (the branches' matrices decay toward 0 under
every rule). Muon's step is scaled by ``adjust_lr_fn="match_rms_adamw"`` (0.2 · lr · sqrt(max(A, B)) for an (A, B)
matrix, Moonshot's rule), so one ``lr`` gives both optimizers about the same update RMS, and both follow the one
schedule; momentum 0.95 and Nesterov are torch's defaults. :class:`MuonWithAdamW` steps, zeroes and saves the two as
one optimizer.

docs/training.md ("Weight decay", "Optimizer: AdamW or Muon") states the rules by parameter name and what each
does to a family's biases.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection

import torch
from torch import nn

from ..config import OPTIMIZERS, WEIGHT_DECAY_RULES
from ..connection import ConnectionModule
from ..models.transformer import MLP, Attention, RMSNorm
from ..schedule import learning_rate as learning_rate  # where it was defined before s2hc.schedule

NORMS = (RMSNorm, nn.LayerNorm)
#: The blocks' branches: the ``nn.Linear`` weights directly inside one are the hidden matrices Muon updates.
BRANCHES = (Attention, MLP)
#: How Muon scales its orthogonalised update (torch.optim.Muon's ``adjust_lr_fn``): to AdamW's update RMS.
MUON_LR_ADJUSTMENT = "match_rms_adamw"
#: The group settings the rule decides; restored after every ``load_state_dict`` (see :func:`make_optimizer`).
RULE_KEYS = ("weight_decay", "decay_toward")


def check_optimizer(name: str) -> str:
    """``name`` when it is one of :data:`OPTIMIZERS`; ValueError naming the allowed ones otherwise."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {name!r}")
    return name


def check_rule(on: str) -> str:
    """``on`` when it names a rule of :data:`WEIGHT_DECAY_RULES`; ValueError naming the allowed ones otherwise."""
    if on not in WEIGHT_DECAY_RULES:
        raise ValueError(f"on must be one of {list(WEIGHT_DECAY_RULES)}, got {on!r}")
    return on


def _owned_parameters(model: nn.Module):
    """``(name, parameter, owner, attribute, in_connection)`` for every parameter of ``model``, once each (a tied
    parameter under its first name, as ``named_parameters`` gives it), in ``model.parameters()`` order."""
    seen: set[int] = set()
    connections: list[str] = []
    for prefix, module in model.named_modules():
        if isinstance(module, ConnectionModule):  # a connection, a learned head, the stream scaling
            connections.append(prefix + ".")
        inside = any((prefix + ".").startswith(c) for c in connections)
        for attribute, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            yield (f"{prefix}.{attribute}" if prefix else attribute), p, module, attribute, inside


def _matrices_rule(name: str, owner: nn.Module, attribute: str, in_connection: bool) -> bool:
    """Whether the parameter decays under ``"matrices"``: what it is decides, not its shape."""
    if in_connection:  # the token-driven projections decay; gates' biases, scales and norm weights do not
        return isinstance(owner, ConnectionModule) and attribute in owner.projections
    if isinstance(owner, (nn.Linear, nn.Embedding)) and attribute == "weight":
        return True
    if isinstance(owner, NORMS) or (isinstance(owner, nn.Linear) and attribute == "bias"):
        return False
    raise ValueError(f"parameter {name!r} ({type(owner).__name__}.{attribute}) is none of the kinds the weight-decay "
                     "rule knows (a Linear or Embedding weight, a Linear bias, a norm's weight or bias, or a "
                     "connection's); say in s2hc.train.optim whether it decays")


def decay_targets(model: nn.Module, on: str = "matrices") -> dict[str, float | None]:
    """Parameter name -> the value rule ``on`` decays it toward (0.0, or 1.0 for a connection's norm weight under
    ``"all"``), or None when it does not decay; every parameter of ``model`` once, in ``parameters()`` order.
    ValueError for an unknown ``on``, and for a parameter whose kind the rule does not know."""
    check_rule(on)
    targets: dict[str, float | None] = {}
    for name, _, owner, attribute, in_connection in _owned_parameters(model):
        decays = _matrices_rule(name, owner, attribute, in_connection)  # also refuses an unknown kind
        if on == "all":
            unit = isinstance(owner, ConnectionModule) and attribute in owner.unit_parameters
            targets[name] = 1.0 if unit else 0.0
        elif on == "2d":
            targets[name] = 0.0 if getattr(owner, attribute).dim() >= 2 else None
        else:
            targets[name] = 0.0 if decays else None
    return targets


def parameter_groups(model: nn.Module, weight_decay: float, on: str = "matrices",
                     only: Collection[str] | None = None) -> list[dict]:
    """AdamW parameter groups for rule ``on`` (see the module docstring): each group a dict with ``params``, their
    ``names``, ``weight_decay`` (``weight_decay`` or 0.0) and ``decay_toward`` (0.0, or 1.0 for the connections'
    norm weights under ``"all"``). Empty groups are left out; every trainable parameter is in exactly one (of
    those named in ``only``, when given: one optimizer's share, :func:`optimizer_of_parameters`).

    ``"decay_toward"`` other than 0 is honoured only by an optimizer from :func:`make_optimizer` (AdamW alone
    decays toward 0); torch's AdamW accepts the extra keys, so ``torch.optim.AdamW(groups)`` also works."""
    targets = decay_targets(model, on)
    groups: dict[float | None, dict] = {}  # by target: toward 0, none, toward 1 (decaying first, as before)
    for target in (0.0, None, 1.0):
        rate = 0.0 if target is None else float(weight_decay)
        groups[target] = {"params": [], "names": [], "weight_decay": rate, "decay_toward": target or 0.0}
    for name, p, *_ in _owned_parameters(model):
        if p.requires_grad and (only is None or name in only):
            groups[targets[name]]["params"].append(p)
            groups[targets[name]]["names"].append(name)
    return [group for group in groups.values() if group["params"]]


def decayed_parameter_names(model: nn.Module, on: str = "matrices") -> list[str]:
    """The names of the parameters rule ``on`` decays (toward 0 or 1), in ``parameters()`` order."""
    return [name for name, target in decay_targets(model, on).items() if target is not None]


def optimizer_of_parameters(model: nn.Module, optimizer: str = "muon") -> dict[str, str]:
    """Parameter name -> the optimizer that updates it under ``optimizer`` (:data:`OPTIMIZERS`): ``"muon"`` for
    the ``weight`` of an ``nn.Linear`` directly inside one of the blocks' branches (:data:`BRANCHES`) and outside
    every connection, ``"adamw"`` for every other parameter (all of them under ``"adamw"``); every parameter of
    ``model`` once, in ``parameters()`` order. What a parameter is decides (its owner and attribute), never its
    shape: ValueError for one Muon would get that is not a matrix, and for an unknown ``optimizer``."""
    check_optimizer(optimizer)
    branch_linears = {id(child) for module in model.modules() if isinstance(module, BRANCHES)
                      for child in module.children() if isinstance(child, nn.Linear)}
    routes: dict[str, str] = {}
    for name, p, owner, attribute, in_connection in _owned_parameters(model):
        muon = optimizer == "muon" and not in_connection and id(owner) in branch_linears and attribute == "weight"
        if muon and p.dim() != 2:
            raise ValueError(f"parameter {name!r} ({type(owner).__name__}.{attribute}, shape {tuple(p.shape)}) is a "
                             "branch's weight but not a matrix, and Muon updates matrices alone; say in "
                             "s2hc.train.optim which optimizer updates it")
        routes[name] = "muon" if muon else "adamw"
    return routes


def make_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
                   on: str = "matrices", optimizer: str = "adamw") -> torch.optim.AdamW | MuonWithAdamW:
    """``optimizer="adamw"``: AdamW over :func:`parameter_groups` (rule ``on``). ``"muon"``: a
    :class:`MuonWithAdamW`, torch's Muon over the branches' matrices and AdamW over the rest
    (:func:`optimizer_of_parameters`), each with rule ``on``'s groups of its own parameters, Muon with
    ``adjust_lr_fn="match_rms_adamw"`` (:data:`MUON_LR_ADJUSTMENT`) and torch's momentum 0.95 with Nesterov.

    Each optimizer gets two hooks that stay with it: after each step a group with ``decay_toward`` c ≠ 0 gets
    ``lr · weight_decay · c`` added, and after each ``load_state_dict`` the rule's group settings
    (:data:`RULE_KEYS`) are set again from the rule. AdamW's step is ``p ← p(1 − lr·wd) − lr·u`` (Muon's too, u
    its orthogonalised update, scaled); adding ``lr·wd·c`` makes it ``p ← p − lr·wd·(p − c) − lr·u``, decay toward
    c. The settings are restored after a load because the loaded ones come from the file
    (torch.distributed.checkpoint maps them by parameter name, so a checkpoint from an earlier rule would bring its
    own).
    """
    check_optimizer(optimizer)
    check_rule(on)
    if optimizer == "adamw":
        # The fused CPU/GPU kernel is numerically the same update; foreach is the portable default.
        return _with_hooks(torch.optim.AdamW(_groups(model, weight_decay, on), lr=lr, betas=betas))
    routes = optimizer_of_parameters(model, "muon")
    adamw_names = {name for name, route in routes.items() if route == "adamw"}
    muon_groups = _groups(model, weight_decay, on, set(routes) - adamw_names)
    if not muon_groups:
        raise ValueError("optimizer='muon' found no trainable branch matrix (attention or MLP nn.Linear weight) to "
                         "update; use optimizer='adamw'")
    adamw = _with_hooks(torch.optim.AdamW(_groups(model, weight_decay, on, adamw_names), lr=lr, betas=betas))
    muon = _with_hooks(torch.optim.Muon(muon_groups, lr=lr, adjust_lr_fn=MUON_LR_ADJUSTMENT))
    return MuonWithAdamW(adamw, muon)


def _groups(model: nn.Module, weight_decay: float, on: str, only: Collection[str] | None = None) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "names"} for g in parameter_groups(model, weight_decay, on, only)]


def _with_hooks(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    optimizer.register_step_post_hook(_decay_toward)
    optimizer.register_load_state_dict_post_hook(_restore_rule([dict(g) for g in optimizer.param_groups]))
    return optimizer


class MuonWithAdamW:
    """Muon over the branches' matrices and AdamW over every other parameter, used as one optimizer.

    ``param_groups``: AdamW's then Muon's, the very dicts (setting a group's ``lr``, as the schedule does, sets
    that optimizer's); ``state``: both states (their keys, the parameters, are disjoint) in one dict; ``step``,
    ``zero_grad``; ``state_dict`` / ``load_state_dict``: ``{"adamw": ..., "muon": ...}``, each optimizer's own (a
    state of one optimizer alone is refused). ``optimizers``: the two, for
    ``torch.distributed.checkpoint.state_dict``, which takes several and keys their states by parameter name
    (:mod:`s2hc.train.checkpointer`; the checkpoint then holds one ``state`` and the groups of both)."""

    name = "muon"

    def __init__(self, adamw: torch.optim.AdamW, muon: torch.optim.Muon):
        self.adamw, self.muon = adamw, muon

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return self.adamw, self.muon

    @property
    def param_groups(self) -> list[dict]:
        return [*self.adamw.param_groups, *self.muon.param_groups]

    @property
    def state(self) -> dict:
        """Both states in one dict (made anew; each parameter's entry is its optimizer's own, not a copy)."""
        return {**self.adamw.state, **self.muon.state}

    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        if keys != ["adamw", "muon"]:
            raise ValueError(f"this optimizer state is not Muon with AdamW's (keys {keys!r}, not ['adamw', 'muon']): "
                             "a state written by optimizer 'adamw' cannot continue under 'muon'")
        self.adamw.load_state_dict(state_dict["adamw"])
        self.muon.load_state_dict(state_dict["muon"])

    def __repr__(self) -> str:
        return f"MuonWithAdamW(adamw={self.adamw!r}, muon={self.muon!r})"


def optimizer_parts(optimizer) -> tuple[torch.optim.Optimizer, ...]:
    """The torch optimizers ``optimizer`` (from :func:`make_optimizer`) is made of: AdamW alone, or AdamW and Muon."""
    return tuple(getattr(optimizer, "optimizers", (optimizer,)))


def optimizer_name(optimizer) -> str:
    """Which of :data:`OPTIMIZERS` ``optimizer`` (from :func:`make_optimizer`) is."""
    return MuonWithAdamW.name if isinstance(optimizer, MuonWithAdamW) else "adamw"


def other_optimizer_refused(where: str, written: str, used: str) -> str:
    """The one-line refusal of a resume whose state was written by optimizer ``written`` under ``used``."""
    return (f"the run in {where!r} was trained with optimizer {written!r}, not {used!r}: the state of one optimizer "
            f"cannot continue under the other; resume with --optimizer {written}, or start another --out with "
            f"--init-from {where} (its weights, a fresh optimizer)")


@torch.no_grad()
def _decay_toward(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        shift = group["lr"] * group["weight_decay"] * group.get("decay_toward", 0.0)
        if shift:
            for p in group["params"]:
                if p.grad is not None:  # AdamW leaves a parameter without a gradient alone: so does its decay
                    p.add_(shift)


def _restore_rule(settings: list[dict]) -> Callable[[torch.optim.Optimizer], None]:
    """A load hook: every group gets the rule's settings back, and any setting the file lacked (an AdamW default:
    betas, eps, ...) from the optimizer as it was made; ``params``, ``lr`` and the state are the file's."""

    def restore(optimizer: torch.optim.Optimizer) -> None:
        for group, made in zip(optimizer.param_groups, settings, strict=True):
            for key, value in made.items():
                if key in RULE_KEYS:
                    group[key] = value
                elif key != "params":
                    group.setdefault(key, value)

    return restore


# ------------------------------------------------------------------------------------------- the run's record


def weight_decay_record(model: nn.Module, weight_decay: float, on: str = "matrices") -> dict:
    """What a run records of its weight decay (``metrics.jsonl``): the rule, the rate, and the names of the
    parameters that decay (``decayed``; ``toward_one``: those of them decaying toward 1) and that do not
    (``not_decayed``). Names are shortened to patterns where every layer agrees (``blocks.*.attn_hc.projection``
    stands for that parameter of every block); a pattern whose instances differ is written out name by name."""
    targets = decay_targets(model, on)
    return {"on": on, "rate": float(weight_decay),
            "decayed": _patterns(targets, lambda t: t is not None),
            "toward_one": _patterns(targets, lambda t: t == 1.0),
            "not_decayed": _patterns(targets, lambda t: t is None)}


def optimizer_record(model: nn.Module, optimizer: str = "adamw") -> dict:
    """What a run records of its optimizer (``metrics.jsonl``): its ``name``; under ``"muon"`` also the lr
    adjustment and the names (patterns, as :func:`weight_decay_record`'s) of the parameters each one updates."""
    if check_optimizer(optimizer) == "adamw":
        return {"name": "adamw"}
    routes = optimizer_of_parameters(model, optimizer)
    return {"name": optimizer, "adjust_lr_fn": MUON_LR_ADJUSTMENT,
            "muon": _patterns(routes, lambda route: route == "muon"),
            "adamw": _patterns(routes, lambda route: route == "adamw")}


def _patterns(targets: dict, keep: Callable[[object], bool]) -> list[str]:
    """The names whose target ``keep`` accepts, each index (``.3.``) as ``*`` where all names of that pattern share
    their target, else in full; first-seen order."""
    members: dict[str, list[str]] = {}
    for name in targets:
        members.setdefault(re.sub(r"(?<=\.)\d+(?=\.)", "*", name), []).append(name)
    out: list[str] = []
    for pattern, names in members.items():
        kinds = {targets[n] for n in names}
        if len(kinds) == 1:
            out += [pattern] if keep(kinds.pop()) else []
        else:
            out += [n for n in names if keep(targets[n])]
    return out
