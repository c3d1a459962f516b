"""The Hugging Face architectures s2hc converts, one module each, and the registry that finds them by model type.

Each module declares one :class:`~s2hc.hf.architectures.common.Architecture`: its ``model_types``, the s2hc
preset an upcycled run records, ``config_from_hf`` (the :class:`~s2hc.models.ModelConfig` fields of a Hugging
Face config), the weight names both ways, and the tokenizer to use when a model directory has none.
:mod:`s2hc.hf.convert` and ``s2hc upcycle`` dispatch through :data:`REGISTRY`; adding an architecture is one
new module here and one line below (docs/design.md section 4).

>>> get("gemma3").preset, get("gpt2").tokenizer
('gemma3-1b', 'gpt2')
"""

from __future__ import annotations

from .common import Architecture
from .gemma3 import GEMMA3
from .gpt2 import GPT2
from .llama import LLAMA
from .mistral import MISTRAL
from .qwen2 import QWEN2
from .qwen3 import QWEN3

__all__ = ["ARCHITECTURES", "Architecture", "REGISTRY", "get", "model_types"]

ARCHITECTURES: tuple[Architecture, ...] = (QWEN3, QWEN2, GEMMA3, GPT2, LLAMA, MISTRAL)

REGISTRY: dict[str, Architecture] = {t: arch for arch in ARCHITECTURES for t in arch.model_types}


def model_types() -> list[str]:
    """Every ``config.json`` model type s2hc converts, in registry order."""
    return list(REGISTRY)


def get(model_type: object) -> Architecture:
    """The architecture of Hugging Face ``model_type``; ValueError naming the allowed model types otherwise."""
    if not isinstance(model_type, str) or model_type not in REGISTRY:
        raise ValueError(f"model_type must be one of {model_types()}, got {model_type!r}")
    return REGISTRY[model_type]
