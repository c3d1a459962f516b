"""Where a model's random initial values come from (``init_rng``): common random numbers across configurations.

- ``"per_parameter"`` (default): every randomly drawn parameter is drawn from a generator of its own, seeded from a
  hash of (the model's seed, the parameter's qualified name, its distribution's kind, ``"normal"`` or
  ``"uniform"``). Its value then depends on nothing else: two models that differ in one option (a projection
  start, learned stream scaling, another family) share every other parameter bit for bit, so a paired
  difference over seeds measures the option, not the option plus a fresh draw of the whole model. The std is not
  in the hash: a parameter whose std changes (``weight_init``) keeps its standard-normal noise, rescaled.
- ``"sequential"``: torch's global generator, in the order the modules draw (what s2hc did before
  ``"per_parameter"``, and what the studies committed before it used: their rows reproduce under it). An option
  that draws one more tensor then shifts every draw after it.

Modules whose parameters start random say how they are drawn with a ``random_init() -> {name: Draw}`` method
(names relative to the module); :func:`redraw` re-draws them per parameter. Parameters that start at a constant
(biases, norms, zero projections, gate biases) do not depend on any generator and are left alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["DEFAULT_INIT_RNG", "Draw", "INIT_RNGS", "check_init_rng", "parameter_generator", "parameter_seed",
           "random_seed", "redraw"]

INIT_RNGS = ("per_parameter", "sequential")
DEFAULT_INIT_RNG = "per_parameter"
_KINDS = ("normal", "uniform")


def check_init_rng(value: object) -> str:
    """``value`` if it is one of :data:`INIT_RNGS`; ValueError naming ``init_rng`` otherwise."""
    if not isinstance(value, str) or value not in INIT_RNGS:
        raise ValueError(f"init_rng must be one of {list(INIT_RNGS)}, got {value!r}")
    return value


@dataclass(frozen=True)
class Draw:
    """How one parameter's initial values are drawn: ``"normal"``, N(shift, scale²), or ``"uniform"``,
    U(shift − scale, shift + scale)."""

    kind: str
    scale: float
    shift: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {list(_KINDS)}, got {self.kind!r}")

    @torch.no_grad()
    def fill_(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """``tensor`` drawn in place: from torch's global generator (``generator=None``, the sequential draw),
        or from a CPU ``generator`` in float32, then copied (the same values on every device and dtype)."""
        if tensor.is_meta:  # a model built on the meta device (counted, or loaded into later) has no values
            return tensor
        if generator is None:
            if self.kind == "normal":
                return tensor.normal_(self.shift, self.scale)
            return tensor.uniform_(self.shift - self.scale, self.shift + self.scale)
        values = torch.empty(tensor.shape, dtype=torch.float32, device="cpu")
        if self.kind == "normal":
            values.normal_(0.0, 1.0, generator=generator).mul_(self.scale)
        else:
            values.uniform_(-1.0, 1.0, generator=generator).mul_(self.scale)
        return tensor.copy_(values.add_(self.shift))


def parameter_seed(seed: int, name: str, kind: str) -> int:
    """A 63-bit seed from (``seed``, ``name``, ``kind``): SHA-256, so that no two names share a stream and no
    Python hash randomisation enters it."""
    digest = hashlib.sha256(f"{int(seed)}\0{name}\0{kind}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def parameter_generator(seed: int, name: str, kind: str) -> torch.Generator:
    """A CPU generator seeded with :func:`parameter_seed`."""
    return torch.Generator().manual_seed(parameter_seed(seed, name, kind))


def random_seed() -> int:
    """One draw from torch's global generator: the model's seed when none is given (so that
    ``torch.manual_seed(s)`` before building a model still decides its weights)."""
    return int(torch.randint(0, 2**62, (1,), device="cpu").item())  # on the CPU inside `with torch.device("meta")`


def redraw(model: nn.Module, seed: int) -> None:
    """Re-draw, per parameter, every parameter that a submodule of ``model`` declares in ``random_init()`` (the
    qualified name is relative to ``model``). Parameters on the meta device have no values and are skipped."""
    for prefix, module in model.named_modules():
        declared = getattr(module, "random_init", None)
        if module is model or declared is None:
            continue
        for local, draw in declared().items():
            parameter = module.get_parameter(local)
            if not parameter.is_meta:
                draw.fill_(parameter, parameter_generator(seed, f"{prefix}.{local}", draw.kind))
