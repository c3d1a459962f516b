"""s2hc's families in torchtitan's decoder (the ``torchtitan`` extra): ``torchrun ... -m torchtitan.train --module
s2hc.torchtitan --config s2hc_debugmodel``, torchtitan's own trainer, parallelisms and checkpoints
(docs/distributed.md, "torchtitan").

- :mod:`~s2hc.torchtitan.model`: :class:`S2HCDecoder`, a torchtitan decoder (llama3 or qwen3 dense blocks) whose
  attention and MLP are wrapped in the connections of any family of :func:`s2hc.families`, built by
  :class:`s2hc.Connections` and initialised to s2hc's own starting values; :func:`s2hc_model_spec`.
- :mod:`~s2hc.torchtitan.config_registry`: the ``--config`` functions (a debug size, the paper's Qwen3-0.6B), with
  s2hc's embedded corpus and tokenizer as the default data.
- :mod:`~s2hc.torchtitan.optim`: torchtitan's DistMuon over the branches' matrices and AdamW over the rest, routed as
  s2hc's harness routes them (``config(..., optimizer="muon")``).
- :mod:`~s2hc.torchtitan.convert`: a torchtitan run's weights (its model's state dict or its DCP checkpoint) as an
  :class:`s2hc.models.Transformer` with the same logits, or as an s2hc run directory that ``s2hc export`` reads.

Importing this package without torchtitan raises :class:`s2hc.extras.MissingExtra` naming the extra.
"""

from __future__ import annotations

from ..extras import require

require("torchtitan", "s2hc.torchtitan")
require("torchtitan.trainer", "s2hc.torchtitan")  # torchtitan 0.3.0 imports triton without declaring it

from .convert import convert, load_checkpoint, to_model_config, to_s2hc_state  # noqa: E402
from .model import S2HCBlock, S2HCDecoder, s2hc_model_config, s2hc_model_spec  # noqa: E402

__all__ = ["S2HCBlock", "S2HCDecoder", "convert", "load_checkpoint", "s2hc_model_config", "s2hc_model_spec",
           "to_model_config", "to_s2hc_state"]
