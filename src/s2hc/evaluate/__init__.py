"""Evaluation of s2hc checkpoints: perplexity, lm-evaluation-harness, offline tasks, generation.

- :func:`checkpoint_perplexity` / :func:`perplexity` (``s2hc eval CHECKPOINT --perplexity``): perplexity on any
  token source, the embedded corpus's held-out split by default, in the training loop's validation windows.
- :mod:`s2hc.evaluate.harness` (needs ``lm-eval``, the ``eval`` extra): ``S2HCLM``, the lm-eval model
  registered as ``s2hc``; :func:`run_tasks` (``s2hc eval CHECKPOINT --tasks ...``) runs lm-eval tasks, the
  shipped offline ones and the paper's suite ``paper8``; :func:`format_paper8_table` lays out the paper's table.
- :mod:`s2hc.evaluate.offline`: the tasks ``s2hc_nextline`` and ``s2hc_ppl`` (group ``s2hc_offline``) built from
  the embedded corpus's held-out split and shipped with their data; :func:`tasks_dir` is their include path.
- :func:`generate_tokens` (``s2hc generate``): batched greedy or sampled decoding with a KV cache.
- ``python -m s2hc.evaluate ARGS``: lm-eval's own command line with the ``s2hc`` model and the shipped tasks
  registered (``--model s2hc --model_args checkpoint=PATH --tasks s2hc_nextline``).

Importing this package does not import lm-eval; :func:`run_tasks` and ``S2HCLM`` do.
"""

from __future__ import annotations

from .generation import generate_tokens
from .loading import load_for_eval
from .offline import tasks_dir
from .perplexity import PerplexityResult, checkpoint_perplexity, perplexity

__all__ = [
    "PAPER8",
    "PerplexityResult",
    "S2HCLM",
    "checkpoint_perplexity",
    "format_paper8_table",
    "generate_tokens",
    "load_for_eval",
    "perplexity",
    "run_tasks",
    "tasks_dir",
]


def __getattr__(name: str):
    if name == "S2HCLM":
        from .harness import S2HCLM

        return S2HCLM
    if name in ("PAPER8", "run_tasks", "format_paper8_table", "format_results_table", "HubUnavailable", "UnknownTask"):
        from . import suites

        return getattr(suites, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
