"""``S2HCForCausalLM``: the s2hc transformer as a Hugging Face ``PreTrainedModel`` with ``generate()``.

The wrapped :class:`s2hc.models.Transformer` is ``model.model``, so the weights are the s2hc state dict with a
``model.`` prefix. Decoding uses a key/value cache (Hugging Face's ``DynamicCache``, or
:class:`s2hc.models.transformer.KVCache`): hyper-connections mix streams per token, so attention is the only
state, and cached decoding gives the uncached tokens. Left-padded batches work: positions are derived from
``attention_mask`` when ``position_ids`` is not given, and padding keys are never attended to.

Training with transformers: ``labels`` give the shifted next-token loss (``num_items_in_batch``, which ``Trainer``
passes, makes it a sum over that many tokens, as transformers' own causal LMs do, so gradient accumulation
averages over tokens); ``gradient_checkpointing_enable()`` / ``activation_checkpointing_enable()`` (and
``TrainingArguments(gradient_checkpointing=True)``) checkpoint whole blocks
(:meth:`s2hc.models.Transformer.set_activation_checkpointing`). ``save_pretrained`` writes the two loader stubs
and ``auto_map`` beside the weights (:mod:`s2hc.hf.remote_code`), so every saved directory, an export or a model
trained from one, loads again with or without ``trust_remote_code``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
import transformers
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..mixers.mhc_lite import PermutationMixture, permutation_matrices
from ..models import Transformer
from ..models.transformer import KVCache
from .configuration import S2HCConfig
from .remote_code import AUTO_MAP, write_stubs

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
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel") -> None:
        """The package's own classes are never custom code: ``import s2hc.hf`` registers them, and their
        :meth:`save_pretrained` writes the loader stubs. transformers calls this on the class a remote-code load
        returns; for the stubs' subclasses it does what transformers does, but an export written before the stubs
        defined subclasses hands back this class, and marking it would make ``save_pretrained`` copy
        ``s2hc/hf/modeling.py`` (see :mod:`s2hc.hf.remote_code`)."""
        if cls.__module__ != __name__:
            super().register_for_auto_class(auto_class)

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs):
        """transformers' ``save_pretrained``, with ``auto_map`` in ``config.json`` and the two loader stubs
        (``configuration_s2hc.py``, ``modeling_s2hc.py``, :mod:`s2hc.hf.remote_code`) beside the weights, so that
        the directory loads with ``trust_remote_code=True`` where s2hc is installed but not imported."""
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **AUTO_MAP}
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True) and os.path.isdir(save_directory):
            write_stubs(save_directory)
        return result

    def _set_gradient_checkpointing(
        self,
        enable: bool = True,
        gradient_checkpointing_func: Callable = torch.utils.checkpoint.checkpoint,
        every_n_layers: int = 1,
    ) -> None:
        """Where transformers' ``gradient_checkpointing_enable(gradient_checkpointing_kwargs, every_n_layers)``
        (and ``..._disable()``) lands: the s2hc model's whole-block checkpointing, through the checkpoint
        function transformers built (non-reentrant unless its kwargs say otherwise)."""
        self.model.set_activation_checkpointing(
            enable, every_n_layers=every_n_layers, checkpoint_fn=gradient_checkpointing_func if enable else None
        )

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
    Hugging Face causal LM (greedy, sampling, beam search), with or without ``use_cache``.

    ``use_cache`` not given: a given cache is used, and a new one is made when ``config.use_cache`` says so, except
    in training mode with gradients enabled (a ``Trainer`` step): a cache is decoding state, and blocks that append
    to one are never checkpointed (a recomputation would append twice)."""

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
        if use_cache is None:  # a given cache is used; a new one is made for decoding, not for a training step
            training = self.training and torch.is_grad_enabled()
            use_cache = cache is not None or (bool(getattr(self.config, "use_cache", True)) and not training)
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
            # token t predicts label t + 1; a sum over num_items_in_batch tokens when Trainer counts them
            num_items = kwargs.get("num_items_in_batch")
            loss = F.cross_entropy(
                logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten().to(logits.device), ignore_index=-100,
                reduction="mean" if num_items is None else "sum",
            )
            if num_items is not None:
                loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            logits = logits[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            logits = logits[:, logits_to_keep]
        output = CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache if use_cache else None})
        if return_dict is False:
            return output.to_tuple()
        return output
