"""Decoder-only transformers whose sublayers are wrapped by hyper-connections, and their presets.

>>> from s2hc.models import Transformer, get_preset
>>> model = Transformer(get_preset("tiny", family="s2hc", n_streams=4))
>>> (model.config.n_streams, model.num_hc_params() > 0)
(4, True)

- :class:`ModelConfig` (``config.py``): every shape and architecture switch, and ``mixer`` / ``n_streams`` /
  ``family_options``; ``to_dict`` / ``from_dict`` for YAML and JSON.
- :data:`PRESETS` / :func:`get_preset`: ``tiny`` and ``small`` for CPUs; ``gpt2-small`` (124 M),
  ``gpt2-medium`` (355 M), ``qwen3-0.6b`` (untied, 752 M), ``gemma3-1b`` (1.00 B), ``qwen2.5-1.5b``
  (1.54 B), all with ``family="residual"`` until overridden.
- :class:`Transformer` (``transformer.py``): ``forward(input_ids (B, T)) -> logits (B, T, vocab)``.

Measured cost of one ``tiny`` training step (forward, cross-entropy, backward, AdamW; batch 8 × sequence
256, float32, torch 2.13 CPU, 2 cores, median of 10 steps with other jobs on the machine): ``residual``
0.28-0.32 s, ``s2hc`` n = 4 0.42-0.48 s, ``mhc`` n = 4 0.53-0.67 s. ``small`` (6.2 M parameters):
0.73-0.81 s residual, 1.05-1.15 s s2hc n = 4.
"""

from .config import PRESETS, ModelConfig, get_preset
from .transformer import Transformer

__all__ = ["ModelConfig", "PRESETS", "Transformer", "get_preset"]
