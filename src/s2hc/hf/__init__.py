"""Hugging Face ``transformers`` integration (the ``hf`` extra): both directions between s2hc and ``transformers``.

- :mod:`~s2hc.hf.convert`: Qwen3 / Qwen2.5 / Gemma3 / GPT-2 / Llama / Mistral configs and weights into an s2hc
  :class:`~s2hc.models.Transformer` and back (:func:`config_from_hf`, :func:`load_hf_state_dict`,
  :func:`~s2hc.hf.convert.to_hf_state_dict`; logit parity tested), one module each in :mod:`~s2hc.hf.architectures`.
- :mod:`~s2hc.hf.configuration`, :mod:`~s2hc.hf.modeling`, :mod:`~s2hc.hf.export`: an s2hc checkpoint as a
  ``transformers`` model (``S2HCConfig``, ``S2HCForCausalLM``, :func:`export`).
- :mod:`~s2hc.hf.deepseek_v4`: DeepSeek-V4's mHC connection and head parameters, both ways, for
  ``HyperConnection(family="mhc", variant="deepseek-v4")`` and :class:`s2hc.HyperHead`.
- :mod:`~s2hc.hf.qwen4_exp`: Qwen's gated residual (transformers' ``Qwen4ExpTextGatedResidual``, its connection and
  its ``use_combine=False`` head) parameters, both ways, for :class:`s2hc.GatedResidual` and :class:`s2hc.GatedHead`.

Importing this package registers the model type ``"s2hc"`` with ``AutoConfig`` and ``AutoModelForCausalLM``::

    import s2hc.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    s2hc.hf.export("runs/s2hc", "exported/")        # or: s2hc export runs/s2hc --out exported/
    model = AutoModelForCausalLM.from_pretrained("exported/")
    tokenizer = AutoTokenizer.from_pretrained("exported/")
    out = model.generate(**tokenizer("ROMEO.", return_tensors="pt"), max_new_tokens=20)

Without ``import s2hc.hf`` (for example inside lm-eval's ``hf`` model type), pass ``trust_remote_code=True``
to ``AutoModelForCausalLM`` and ``AutoTokenizer`` (which reads ``config.json`` too): the exported directory
holds two stub modules that subclass these classes from the installed s2hc (:mod:`~s2hc.hf.remote_code`), which
must be installed wherever it is loaded (``pip install 's2hc[hf]'``).
"""

from __future__ import annotations

from ..extras import require

require("transformers", "s2hc.hf")

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration import MODEL_TYPE, S2HCConfig
from .convert import config_from_hf, load_hf_state_dict, to_hf_state_dict
from .export import export, from_s2hc
from .modeling import S2HCForCausalLM, S2HCPreTrainedModel

AutoConfig.register(MODEL_TYPE, S2HCConfig, exist_ok=True)
AutoModelForCausalLM.register(S2HCConfig, S2HCForCausalLM, exist_ok=True)

__all__ = [
    "S2HCConfig",
    "S2HCForCausalLM",
    "S2HCPreTrainedModel",
    "config_from_hf",
    "export",
    "from_s2hc",
    "load_hf_state_dict",
    "to_hf_state_dict",
]
