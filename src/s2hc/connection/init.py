"""How a connection starts: its coefficient projection (``projection_init``) and its gate biases
(``gate_init``), two :class:`~s2hc.connection.HyperConnection` options (docs/mixers.md, "Initialisation").

``projection_init``:

- ``"zero"`` (default, every paper's text): ``W = 0``, so every ``H`` is its bias alone, the same for every token.
- ``"normal"`` (the s²HC authors' code): ``W ~ N(0, std²)`` with ``std = sqrt(2 / (5 C))``, C the width of one
  stream (their ``n_embd``). Their ``initialize_weights`` (``litgpt/pretrain.py``) re-draws every ``nn.Linear``
  with that std, and s²HC's ``to_alpha_pre``, ``to_alpha_residual``, ``to_beta`` are ``nn.Linear(n·C, ·)``
  (``litgpt/hyper_conn/shc.py``), so the zeros their ``__init__`` writes are overwritten. The std is the same for
  HC's per-stream projection (fan-in C, not n·C): one formula, C, for both forms.

``gate_init``:

- ``"papers"`` (default): sigmoid gates (mHC and after) with biases −1 except +1 at stream ``layer_index mod n``
  (read weights σ(±1) = 0.73 / 0.27, writes twice that, 1.46 / 0.54); HC's tanh gates read stream
  ``layer_index mod n`` alone (``b_pre`` one-hot) and write 1 to every stream (``b_post = 1``).
- ``"residual"``: the gates upcycling gives (:mod:`s2hc.models.widen`), :func:`residual_targets`: ``H_pre = 1/n``
  for every stream and ``Σ H_post = n``, stream ``layer_index mod n`` writing ``1 + spread`` and the others
  ``1 − spread/(n − 1)``. With the projection at zero and ``H_res``'s columns summing to 1 (every family at
  init), the streams' mean follows a residual model's stream exactly, so a model whose output is that mean
  (``stream_reduce="mean"``) computes its residual counterpart's function at step 0 while its streams separate
  after the first write. ``H_res``'s gradient is zero at step 0 (the loss sees only the streams' mean, which
  ``H_res`` keeps) and grows as the read gates learn to differ, as after upcycling. Sigmoid gates get the logits
  of the targets (:func:`upcycling_biases`); tanh gates (``b + α tanh(d)``, ``b`` is the value at ``d = 0``) the
  targets themselves.
"""

from __future__ import annotations

import math

import torch

from ..init_rng import Draw

__all__ = [
    "DEFAULT_SPREAD", "GATE_INITS", "PROJECTION_INITS", "check_gate_init", "check_projection_init", "gate_biases",
    "initial_projection", "projection_draw", "projection_std", "residual_targets", "upcycling_biases",
]  # fmt: skip

PROJECTION_INITS = ("zero", "normal")
GATE_INITS = ("papers", "residual")
#: How much more than 1 the favoured stream writes with ``gate_init="residual"`` (and by default in upcycling).
DEFAULT_SPREAD = 0.5


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return value


def check_projection_init(value: object) -> str:
    """``value`` if it is one of :data:`PROJECTION_INITS`; ValueError naming ``projection_init`` otherwise."""
    return _check_choice("projection_init", value, PROJECTION_INITS)


def check_gate_init(value: object) -> str:
    """``value`` if it is one of :data:`GATE_INITS`; ValueError naming ``gate_init`` otherwise."""
    return _check_choice("gate_init", value, GATE_INITS)


def projection_std(dim: int) -> float:
    """``sqrt(2 / (5 · dim))``, the s²HC authors' std for every linear layer, ``dim`` the stream width C."""
    return math.sqrt(2.0 / (5.0 * dim))


def initial_projection(shape: tuple[int, int], dim: int, projection_init: str) -> torch.Tensor:
    """A projection of ``shape`` (``(n·C, 2n + K)``, or ``(C, 2 + n)`` for HC's per-stream form), in the default
    dtype: zeros, or ``N(0, projection_std(dim)²)`` drawn from torch's global generator (so a seeded model is
    reproducible)."""
    projection = torch.zeros(shape)
    if check_projection_init(projection_init) == "normal":
        projection_draw(dim).fill_(projection)
    return projection


def projection_draw(dim: int) -> Draw:
    """How ``projection_init="normal"`` draws: N(0, :func:`projection_std` ``(dim)²``)."""
    return Draw("normal", projection_std(dim))


def residual_targets(n_streams: int, layer_index: int, spread: float = DEFAULT_SPREAD) -> tuple[torch.Tensor, ...]:
    """``(pre, post)`` ``(n,)`` float64: ``H_pre = 1/n`` for every stream; ``H_post = 1 + spread`` at stream
    ``layer_index mod n`` and ``1 − spread/(n − 1)`` elsewhere (sum ``n``). ValueError for ``spread`` outside
    (0, 1) (every ``H_post`` must lie in (0, 2), the sigmoid write's range) or fewer than 2 streams (``H_pre = 1``
    is the sigmoid gate's limit, not a value it takes)."""
    if not 0 < spread < 1:
        raise ValueError(f"spread must be in (0, 1) (so that every H_post lies in (0, 2)), got {spread!r}")
    if n_streams < 2:
        raise ValueError(f"n_streams must be >= 2 for residual-equivalent gates (H_pre = 1/n), got {n_streams}")
    n = n_streams
    post = torch.full((n,), 1.0 - spread / (n - 1), dtype=torch.float64)
    post[layer_index % n] = 1.0 + spread
    return torch.full((n,), 1.0 / n, dtype=torch.float64), post


def upcycling_biases(n_streams: int, layer_index: int, spread: float = DEFAULT_SPREAD,
                     pre_offset: float = 0.0, post_scale: float = 2.0,
                     post_offset: float = 0.0) -> tuple[torch.Tensor, ...]:
    """``(bias_pre, bias_post)`` ``(n,)`` float32 of a sigmoid-gated connection whose gates give
    :func:`residual_targets`. ``pre_offset``: a constant the connection adds to ``H_pre`` after its gate
    (DeepSeek-V4's ``hc_eps``), taken off the gate's target so that ``H_pre`` is still ``1/n``; likewise
    ``H_post = post_scale · σ(b) + post_offset`` (2σ(b) but for Hy4's iHC). ValueError when a write target lies
    outside that gate's range (a magnitude below ``1 + spread``)."""
    pre, post = residual_targets(n_streams, layer_index, spread)
    share = (post - post_offset) / post_scale
    with torch.device("cpu"):  # the range check reads values, which a model built on meta does not have
        written = residual_targets(n_streams, layer_index, spread)[1]
    if not bool((((written - post_offset) / post_scale > 0) & ((written - post_offset) / post_scale < 1)).all()):
        raise ValueError(f"the residual start's writes {sorted(set(written.tolist()))} lie outside the write gate's "
                         f"range ({post_offset}, {post_offset + post_scale}) (its magnitude {post_scale}); use a "
                         "smaller spread or a larger magnitude")
    return torch.logit(pre - pre_offset).float(), torch.logit(share).float()  # H_pre = σ(b) + offset, m σ(b) + offset


def gate_biases(gate_init: str, gate: str, n_streams: int, layer_index: int, pre_offset: float = 0.0,
                post_scale: float = 2.0, post_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bias_pre, bias_post)`` ``(n,)`` float32 for ``gate_init`` (:data:`GATE_INITS`) and the mixer's ``gate``
    (``"sigmoid"`` or ``"tanh"``), favouring stream ``layer_index mod n``; see the module docstring."""
    n, favoured = n_streams, layer_index % n_streams
    if check_gate_init(gate_init) == "residual":
        if gate == "tanh":  # b + α tanh(d) is b at d = 0: the targets themselves
            pre, post = residual_targets(n, layer_index)
            return (pre - pre_offset).float(), post.float()
        return upcycling_biases(n, layer_index, pre_offset=pre_offset, post_scale=post_scale, post_offset=post_offset)
    if gate == "tanh":  # HC: read one stream, write to all
        b_pre, b_post = torch.zeros(n), torch.ones(n)
        b_pre[favoured] = 1.0
        return b_pre, b_post
    b_pre = torch.full((n,), -1.0)  # mHC and after: sigmoid gates, bias −1 except +1 at the favoured stream
    b_pre[favoured] = 1.0
    return b_pre, b_pre.clone()
