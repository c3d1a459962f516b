"""Widening a residual model into n streams that keep its function (function-preserving upcycling): a residual
model's weights in a hyper-connection model that computes the same.

The streams start as copies of the embedding. Every connection reads ``h = Σ_i H_pre,i X_i`` and writes
``X'_i = Σ_j H_res,ij X_j + H_post,i F(h)``; the model's output is ``Σ_i X_i`` before the final norm. Let the
read be uniform (``H_pre,i = 1/n``), the writes sum to ``n`` (``Σ_i H_post,i = n``) and the columns of ``H_res``
sum to 1. Then the streams' sum ``S`` moves as ``S' = S + n F(S/n)``: the mean ``S/n`` follows the residual
model's ``h' = h + F(h)`` exactly. The paper's model sums the streams at the end, ``n`` times the residual
model's output, which the final norm does not see except through its ε (a relative error of about
``ε / mean(h²)``, 1e-2 for a freshly initialised model); an upcycled model therefore takes their mean
(``stream_reduce="mean"``) and computes the source's function to rounding. ``H_res``'s rows summing to 1 as well
keeps the streams' mean the mixing's fixed point, so the streams are free to differ around it.

With the coefficient projections at zero (their initial value) every ``H`` is its bias alone, the same for every
token. The read bias is ``logit(1/n)``; the write biases give the favoured stream ``layer_index mod n`` (as the
paper's initialisation does) ``1 + spread`` and the others ``1 − spread/(n − 1)``. The writes are not uniform,
so the streams separate after the first write and the mixing receives real gradients from the second step (at
step 0 the loss sees only the streams' mean, which ``H_res`` keeps); with
uniform writes they would stay copies, and ``H_res`` would never matter. The biases are
:func:`s2hc.connection.init.upcycling_biases`, which a model built from scratch gets too with the connection
option ``gate_init="residual"``.

Which families qualify each family's class says (:meth:`s2hc.mixers.Mixer.upcycle_refusal`): those whose
``H_res`` has rows and columns summing to 1 whatever its parameters are (``mhc-lite``, ``kromhc``, ``s2hc``,
``isometric``, ``identity``) and ``mhc`` (Sinkhorn: rows exact, columns to its tolerance). ``hc`` (unconstrained)
and ``orthogonal`` (a rotation keeps norms, not sums) are refused: they would match at step 0 only because their
``H_res`` starts at the identity, and nothing in them keeps the streams' sum the residual stream's. Every
qualifying family keeps its own initialisation of ``H_res`` (near or exactly ``I``).
"""

from __future__ import annotations

from ..connection import Connection, forms
from ..connection.init import DEFAULT_SPREAD, upcycling_biases  # their home is the connection (gate_init="residual")
from .model_config import ModelConfig
from .transformer import Transformer

__all__ = ["DEFAULT_SPREAD", "check_upcyclable", "upcyclable_families", "upcycle_model", "upcycling_biases"]

def upcyclable_families() -> list[str]:
    """The families :func:`upcycle_model` accepts."""
    return [form.name for form in forms.FORMS if form.upcycle_refusal() is None]


def check_upcyclable(family: str, argument: str = "--family") -> str:
    """``family`` if a residual model can be upcycled into it function-preservingly; ValueError saying why not."""
    reason = forms.get(family, argument).upcycle_refusal()
    if reason is not None:
        raise ValueError(f"{argument} {family!r} cannot start from a residual model with the same function: "
                         f"{reason}; choose one of {upcyclable_families()}")
    return family


def upcycle_model(source: Transformer, family: str, n_streams: int, family_options: dict | None = None,
                  spread: float = DEFAULT_SPREAD) -> Transformer:
    """A ``family`` model with ``n_streams`` streams that computes what the residual ``source`` computes.

    Every weight of ``source`` is copied; each connection's coefficient projection stays zero, its gate biases
    are :func:`upcycling_biases` and its mixer keeps the family's initialisation. ValueError for a source that is
    not residual, a family that does not qualify (:func:`check_upcyclable`), fewer than 2 streams or a bad
    ``spread``.
    """
    if forms.get(source.config.family) is not forms.RESIDUAL:
        raise ValueError(f"the source model must be residual (one stream) to upcycle, got family "
                         f"{source.config.family!r} with {source.config.n_streams} streams")
    check_upcyclable(family)
    if n_streams < 2:
        raise ValueError(f"--streams must be >= 2 to upcycle into {family!r}, got {n_streams}")
    config = ModelConfig.from_dict({**source.config.to_dict(), "family": family, "n_streams": n_streams,
                                    "family_options": dict(family_options or {}), "stream_reduce": "mean"})
    target = Transformer(config).to(next(source.parameters()).dtype)
    missing, unexpected = target.load_state_dict(source.state_dict(), strict=False)
    if unexpected or any("_hc." not in name for name in missing):  # pragma: no cover - the same architecture
        raise ValueError(f"the source's weights do not fit the {family} model: missing {missing}, "
                         f"unexpected {unexpected}")
    for module in target.modules():
        if isinstance(module, Connection):
            module.start_as_residual(spread)
    return target
