"""Reading a transformers config as the converters of production designs do: a setting by attribute or key (a
config object or its ``config.json`` as a dict), the text model's settings of a multimodal config, and a required
setting refused in one line naming the design."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def get(config: Any, name: str) -> Any:
    """Setting ``name`` of ``config``, None where it has none."""
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def text_settings(hf_config: Any, design: str, model_type: str, model_types: Iterable[str]) -> Any:
    """The text model's settings of ``hf_config``: its ``text_config`` when its model type is ``model_type`` (the
    multimodal model's, or none given and a ``text_config`` there), else the config itself. ValueError (one line)
    for a model type not in ``model_types`` or a missing ``text_config``."""
    given = get(hf_config, "model_type")
    if given is not None and given not in model_types:
        raise ValueError(f"the {design} config must have model_type one of {list(model_types)}, got {given!r}")
    nested = get(hf_config, "text_config")
    if given == model_type or (given is None and nested is not None):
        if nested is None:
            raise ValueError(f"the {design} config (model_type {model_type!r}) has no text_config")
        return nested
    return hf_config


def required(text: Any, name: str, design: str) -> Any:
    """Setting ``name`` of ``text``; ValueError naming the design and the setting when it has none."""
    value = get(text, name)
    if value is None:
        raise ValueError(f"the {design} config has no {name!r}")
    return value


__all__ = ["get", "required", "text_settings"]
