"""``S2HCConfig``: the Hugging Face configuration of an s2hc transformer (any residual family).

The whole :class:`s2hc.models.ModelConfig` is stored under the key ``s2hc`` of ``config.json``; the usual
Hugging Face names (``hidden_size``, ``num_hidden_layers``, ``vocab_size``, ``max_position_embeddings`` ...)
are written beside it as read-only mirrors for tools that look for them (lm-eval reads
``max_position_embeddings`` as the context length).
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from ..models import ModelConfig

MODEL_TYPE = "s2hc"

# Hugging Face name -> ModelConfig field, mirrored for tools that read the standard names.
MIRRORS = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "head_dim": "head_dim",
    "intermediate_size": "ffn_dim",
    "max_position_embeddings": "max_seq_len",
}


class S2HCConfig(PretrainedConfig):
    """Configuration of :class:`s2hc.hf.S2HCForCausalLM`.

    ``S2HCConfig(s2hc=ModelConfig(...).to_dict(), eos_token_id=..., ...)``; ``s2hc`` is validated by
    :class:`~s2hc.models.ModelConfig` (ValueError naming the bad field). ``model_config()`` rebuilds the
    ``ModelConfig``. Every layer is declared ``"full_attention"`` in ``layer_types``: a Hugging Face cache then
    keeps all positions of every layer, and the model applies Gemma-style sliding windows with its own mask.
    """

    model_type = MODEL_TYPE

    def __init__(self, s2hc: dict[str, Any] | None = None, **kwargs: Any):
        model = ModelConfig.from_dict(s2hc) if s2hc else ModelConfig()
        self.s2hc = model.to_dict()
        for name, field in MIRRORS.items():
            kwargs.pop(name, None)
            setattr(self, name, getattr(model, field))
        kwargs.pop("layer_types", None)
        self.layer_types = ["full_attention"] * model.n_layers
        kwargs["tie_word_embeddings"] = model.tie_embeddings
        kwargs.setdefault("use_cache", True)
        super().__init__(**kwargs)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig") -> None:
        """Leaves the package's own class unmarked (see :meth:`s2hc.hf.S2HCForCausalLM.register_for_auto_class`):
        a marked config makes ``save_pretrained`` copy ``s2hc/hf/configuration.py`` and its relative imports."""
        if cls.__module__ != __name__:
            super().register_for_auto_class(auto_class)

    def model_config(self) -> ModelConfig:
        """The :class:`~s2hc.models.ModelConfig` this configuration holds."""
        return ModelConfig.from_dict(self.s2hc)
