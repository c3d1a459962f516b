"""Decoder-only transformers whose sublayers are wrapped by hyper-connections, and their presets.

>>> from s2hc.models import Transformer, get_preset
>>> model = Transformer(get_preset("tiny", family="s2hc", n_streams=4))
>>> (model.config.n_streams, model.num_connection_params() > 0)
(4, True)

- :class:`ModelConfig` (``model_config.py``): every shape and architecture switch, and ``family`` / ``n_streams`` /
  ``family_options``; ``to_dict`` / ``from_dict`` for YAML and JSON.
- :data:`PRESETS` / :func:`get_preset`: ``tiny`` and ``small`` for CPUs; ``gpt2-small`` (124 M),
  ``gpt2-medium`` (355 M), ``qwen3-0.6b`` (untied, 752 M), ``gemma3-1b`` (1.00 B), ``qwen2.5-1.5b``
  (1.54 B), ``llama3.2-1b`` (tied, 1.24 B), ``mistral-7b`` (7.24 B), all with ``family="residual"`` until overridden.
- :class:`Transformer` (``transformer.py``): ``forward(input_ids (B, T)) -> logits (B, T, vocab)``.
- ``widen.py``: a residual model widened into n streams that compute its function (``upcycle_model``, used by
  ``s2hc upcycle`` and ``train --init-from``).

Step times of the presets with each family are measured in ``docs/benchmarks.md``.
"""

from .model_config import PRESETS, ModelConfig, get_preset
from .transformer import Transformer

__all__ = ["ModelConfig", "PRESETS", "Transformer", "get_preset"]
