"""``s2hc upcycle``: a pretrained residual model as a hyper-connection run directory with the same function.

SOURCE is a Hugging Face model directory (``config.json`` and ``model.safetensors``, sharded with its index, or
``pytorch_model.bin``) of an architecture :mod:`s2hc.hf.convert` reads (Qwen3, Qwen2 / Qwen2.5, Gemma3, GPT-2),
or an s2hc run directory (or checkpoint) of a ``residual`` model. The result is an ordinary run directory at
step 0 (``config.yaml`` and ``checkpoint.pt``, no optimizer state) whose model computes the source's logits to
rounding (:mod:`s2hc.models.upcycle` says why and which families qualify): ``s2hc eval``, ``diagnose``,
``export`` and ``generate`` work on it, and ``s2hc train --init-from RUN_DIR`` continues pretraining from it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .config import TrainConfig
from .hf.convert import config_from_hf, load_hf_state_dict
from .hf.weights import INDEX, read_safetensors
from .mixers import RESIDUAL
from .models import Transformer
from .models.upcycle import DEFAULT_SPREAD, check_upcyclable, upcycle_model
from .rundir import CHECKPOINT, checkpoint_paths, load_model, open_run_directory, write_config
from .rundir.checkpoint import save_checkpoint
from .rundir.guard import notice

# The model keys a TrainConfig keeps outside model_overrides.
_FAMILY_KEYS = ("family", "n_streams", "family_options")
# The preset recorded for each architecture (every model setting is in model_overrides, so it only names it).
_PRESET_OF = {"qwen3": "qwen3-0.6b", "qwen2": "qwen2.5-1.5b", "gemma3": "gemma3-1b", "gemma3_text": "gemma3-1b",
              "gpt2": "gpt2-small"}


def _read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model directory (single or sharded safetensors, or pytorch_model.bin)."""
    if (directory / INDEX).is_file():
        return read_safetensors(directory)[0]
    if (directory / "model.safetensors").is_file():
        return read_safetensors(directory / "model.safetensors")[0]
    if (directory / "pytorch_model.bin").is_file():
        return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"SOURCE {str(directory)!r} has no model.safetensors, model.safetensors.index.json or "
                     "pytorch_model.bin")


def _hf_tokenizer(directory: Path, model_type: str) -> str:
    if (directory / "tokenizer.json").is_file():
        return str((directory / "tokenizer.json").resolve())
    if model_type == "gpt2":
        return "gpt2"  # the GPT-2 BPE, read offline (s2hc.data.tokenizer)
    raise ValueError(f"SOURCE {str(directory)!r} has no tokenizer.json; name the tokenizer with --tokenizer")


def read_source(source: str | Path, tokenizer: str | None = None) -> tuple[Transformer, dict[str, Any]]:
    """``(residual model, TrainConfig values)`` of SOURCE: a Hugging Face model directory or a residual s2hc run
    directory or checkpoint. ValueError naming what is wrong: a missing path, an architecture not supported, a
    model that is not residual."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"SOURCE {str(source)!r} does not exist")
    if path.is_dir() and (path / "config.json").is_file() and not checkpoint_paths(path):
        hf_config = json.loads((path / "config.json").read_text())
        model_type = hf_config.get("model_type")
        model = Transformer(config_from_hf(hf_config))
        load_hf_state_dict(model, _read_hf_weights(path))
        settings = model.config.to_dict()
        values = {"preset": _PRESET_OF[model_type], "tokenizer": tokenizer or _hf_tokenizer(path, model_type),
                  "model_overrides": {k: v for k, v in settings.items() if k not in _FAMILY_KEYS}}
        return model, values
    model, config = load_model(path)
    if model.config.family != RESIDUAL:
        raise ValueError(f"SOURCE {str(source)!r} holds a {model.config.family!r} model with "
                         f"{model.config.n_streams} streams; upcycling starts from a residual model")
    values = {k: v for k, v in config.to_dict().items() if k not in ("out", "init_from", *_FAMILY_KEYS)}
    return model, {**values, **({"tokenizer": tokenizer} if tokenizer else {})}


def upcycle(source: str | Path, family: str, n_streams: int, out: str | Path, *, family_options: dict | None = None,
            spread: float = DEFAULT_SPREAD, tokenizer: str | None = None, overwrite: bool = False) -> Path:
    """Write the run directory ``out`` holding SOURCE upcycled to ``family`` with ``n_streams`` streams.

    Everything is checked before anything is written (the family, the streams, the source, the run directory);
    returns the checkpoint's path."""
    check_upcyclable(family)
    model, values = read_source(source, tokenizer)
    upcycled = upcycle_model(model, family, n_streams, family_options, spread)
    overrides = {**values.get("model_overrides", {}), "vocab_size": upcycled.config.vocab_size,
                 "stream_reduce": "mean"}
    config = TrainConfig.from_dict({**values, "model_overrides": overrides, "family": family,
                                    "n_streams": n_streams, "family_options": dict(family_options or {}),
                                    "out": str(out)})
    if config.model_config() != upcycled.config:  # the run's configuration must rebuild this very model
        raise ValueError(f"the upcycled model does not round-trip through its run configuration: "
                         f"{config.model_config()} != {upcycled.config}")
    with open_run_directory(out, overwrite=overwrite, log=notice):
        run_dir = Path(out).expanduser()
        write_config(run_dir, config.to_dict())
        history = {"step_times": [], "train_loss": None, "val_loss": None}
        save_checkpoint(run_dir / CHECKPOINT, {
            "config": config.to_dict(), "model_config": upcycled.config.to_dict(), "step": 0,
            "model": upcycled.state_dict(), "history": history, "upcycled_from": str(source),
            "world_size": 1,
        })
    return run_dir / CHECKPOINT
