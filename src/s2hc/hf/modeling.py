"""``S2HCForCausalLM``: the s2hc transformer as a Hugging Face ``PreTrainedModel`` with ``generate()``.

The wrapped :class:`s2hc.models.Transformer` is ``model.model``, so the weights are the s2hc state dict with a
``model.`` prefix. Decoding uses a key/value cache (Hugging Face's ``DynamicCache``, or
:class:`s2hc.models.transformer.KVCache`): hyper-connections mix streams per token, so attention is the only
state, and cached decoding gives the uncached tokens. Left-padded batches work: positions are derived from
``attention_mask`` when ``position_ids`` is not given, and padding keys are never attended to.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import transformers
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..mixers.mhc_lite import PermutationMixture, permutation_matrices
from ..models import Transformer
from ..models.transformer import KVCache
from .configuration import S2HCConfig

_MAJOR = int(transformers.__version__.split(".")[0])
# The field of the output (and the forward keyword) that carries the cache: `cache` from transformers 5.x
# on, `past_key_values` before.
_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


def _new_cache(config: S2HCConfig):
    """An empty Hugging Face ``DynamicCache`` (every layer full), or s2hc's own cache without one."""
    try:
        from transformers import DynamicCache
    except ImportError:  # pragma: no cover - every supported transformers has it
        return KVCache()
    try:
        return DynamicCache(config=config)
    except TypeError:  # older signatures take no config
        return DynamicCache()


class S2HCPreTrainedModel(PreTrainedModel):
    config_class = S2HCConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Block"]

    def _init_weights(self, module) -> None:
        """Restore the fixed, non-persistent buffers (Helmert bases, permutation tables) that transformers
        leaves empty when it builds the model on the meta device and then loads the saved weights. Weights are
        not touched: :class:`s2hc.models.Transformer` initialises itself, its hyper-connections included."""
        for name, exact in getattr(module, "_constants", {}).items():  # Mixer.register_constant
            if module._buffers.get(name) is not None:
                module._buffers[name] = exact.to(device=module._buffers[name].device)
        if isinstance(module, PermutationMixture):
            old = module.permutations
            module.permutations = permutation_matrices(module.size).flatten(1).to(device=old.device, dtype=old.dtype)


class S2HCForCausalLM(S2HCPreTrainedModel, GenerationMixin):
    """Causal language model: ``forward(input_ids, attention_mask, position_ids, cache / past_key_values,
    labels, use_cache)`` -> ``CausalLMOutputWithPast(loss, logits, cache)``; ``generate()`` works as for any
    Hugging Face causal LM (greedy, sampling, beam search), with or without ``use_cache``."""

    # The LM head shares the embedding when the s2hc config says so (tie_word_embeddings mirrors it).
    _tied_weights_keys = (
        {"model.lm_head.weight": "model.embed.weight"} if _MAJOR >= 5 else ["model.lm_head.weight"]
    )

    def __init__(self, config: S2HCConfig):
        super().__init__(config)
        self.model = Transformer(config.model_config())
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        past_key_values=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        **kwargs,
    ):
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("S2HCForCausalLM takes input_ids (inputs_embeds are not supported)")
        cache = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = bool(getattr(self.config, "use_cache", True))
        if use_cache and cache is None:
            cache = _new_cache(self.config)
        if not use_cache:
            cache = None
        if position_ids is None and attention_mask is not None and not bool(attention_mask.all()):
            # left padding: each sequence's positions count its real tokens only
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            position_ids = positions[:, -input_ids.shape[1]:]
        if cache is None and attention_mask is None and position_ids is None:
            logits = self.model(input_ids)
        else:
            logits = self.model(input_ids, cache=cache, attention_mask=attention_mask, position_ids=position_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten().to(logits.device), ignore_index=-100
            )
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            logits = logits[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            logits = logits[:, logits_to_keep]
        output = CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache if use_cache else None})
        if return_dict is False:
            return output.to_tuple()
        return output
