"""``s2hc upcycle``: a pretrained residual model as a hyper-connection run directory with the same function.

SOURCE is a Hugging Face model directory (``config.json`` and ``model.safetensors``, sharded with its index, or
``pytorch_model.bin``) of an architecture :mod:`s2hc.hf.architectures` registers (Qwen3, Qwen2 / Qwen2.5, Gemma3,
GPT-2, Llama, Mistral), or an s2hc run directory (or checkpoint) of a ``residual`` model. The result is an
ordinary run directory at step 0 (``config.yaml`` and ``checkpoint.pt``, no optimizer state) whose model computes
the source's logits to rounding (:mod:`s2hc.models.widen` says why and which families qualify): ``s2hc eval``,
``diagnose``, ``export`` and ``generate`` work on it, and ``s2hc train --init-from RUN_DIR`` continues pretraining
from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .config import TrainConfig, family_fields, inherited_fields
from .connection import forms
from .data.tokenizer import check_tokenizer_fits, get_tokenizer
from .extras import check_available
from .io import read_json_object
from .models import Transformer
from .models.widen import DEFAULT_SPREAD, check_upcyclable, upcycle_model
from .rundir import CHECKPOINT, Checkpoint, checkpoint_paths, load_model, write_config
from .rundir.checkpoint import save_checkpoint, weights_only_refusal
from .rundir.guard import notice, run_files
from .rundir.layout import is_run_entry
from .rundir.schema import new_run_id
from .rundir.staging import check_replaceable, replace_directory


def _read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model directory (single or sharded safetensors, or pytorch_model.bin)."""
    from .hf.weights import INDEX, read_safetensors

    if (directory / INDEX).is_file():
        return read_safetensors(directory)[0]
    if (directory / "model.safetensors").is_file():
        return read_safetensors(directory / "model.safetensors")[0]
    if (directory / "pytorch_model.bin").is_file():
        return _read_pytorch_weights(directory / "pytorch_model.bin")
    raise ValueError(f"SOURCE {str(directory)!r} has no model.safetensors, model.safetensors.index.json or "
                     "pytorch_model.bin")


def _read_pytorch_weights(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``pytorch_model.bin``, loaded with ``weights_only`` (a pickle that would run code is
    refused, never executed). ValueError naming ``file`` when it is not such a file or holds no name -> tensor
    mapping."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - pickle, zip and torch errors all mean "not a weights file"
        raise ValueError(f"{str(file)!r} is not a PyTorch weights file, or is damaged ({weights_only_refusal(error)}); "
                         "it must be a state dict saved with torch.save") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{str(file)!r} holds a {type(state).__name__}, not a state dict (tensor names -> "
                         "tensors)")
    return state


def _read_hf_config(directory: Path) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face model directory: a JSON object. ValueError naming the file when
    it is unreadable, not JSON or not an object."""
    return read_json_object(directory / "config.json", "a Hugging Face config.json is a JSON object")


def _hf_tokenizer(directory: Path, default: str | None) -> str:
    """The directory's ``tokenizer.json``, else the architecture's ``default`` tokenizer (GPT-2's BPE)."""
    if (directory / "tokenizer.json").is_file():
        return str((directory / "tokenizer.json").resolve())
    if default is not None:
        return default
    raise ValueError(f"SOURCE {str(directory)!r} has no tokenizer.json; name the tokenizer with --tokenizer")


def read_source(source: str | Path, tokenizer: str | None = None) -> tuple[Transformer, dict[str, Any]]:
    """``(residual model, TrainConfig values)`` of SOURCE: a Hugging Face model directory or a residual s2hc run
    directory or checkpoint. ValueError naming what is wrong: a missing path, an architecture not supported, a
    model that is not residual."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"SOURCE {str(source)!r} does not exist")
    if path.is_dir() and (path / "config.json").is_file() and not checkpoint_paths(path):
        return _read_hf_source(path, tokenizer)
    model, config = load_model(path)
    if model.form is not forms.RESIDUAL:
        raise ValueError(f"SOURCE {str(source)!r} holds a {model.config.family!r} model with "
                         f"{model.config.n_streams} streams; upcycling starts from a residual model")
    kept = set(inherited_fields()) - set(family_fields())  # the upcycled run has its own family
    values = {k: v for k, v in config.to_dict().items() if k in kept}
    return model, {**values, **({"tokenizer": tokenizer} if tokenizer else {})}


def _read_hf_source(path: Path, tokenizer: str | None) -> tuple[Transformer, dict[str, Any]]:
    """:func:`read_source` of a Hugging Face model directory (the hf extra: transformers' converters' home)."""
    check_available(("transformers",), "a Hugging Face SOURCE")
    from .hf import architectures
    from .hf.convert import config_from_hf, load_hf_state_dict

    hf_config = _read_hf_config(path)
    try:
        architecture = architectures.get(hf_config.get("model_type"))
        model = Transformer(config_from_hf(hf_config))
    except ValueError as error:  # a key missing or not supported: say which file it is in
        raise ValueError(f"{str(path / 'config.json')!r}: {error}") from None
    load_hf_state_dict(model, _read_hf_weights(path))
    settings = model.config.to_dict()
    values = {"preset": architecture.preset, "tokenizer": tokenizer or _hf_tokenizer(path, architecture.tokenizer),
              "model_overrides": {k: v for k, v in settings.items() if k not in family_fields()},
              # the default window, unless the model's positions are fewer (a run must fit what forward accepts)
              "seq_len": min(TrainConfig().seq_len, model.config.max_seq_len)}
    return model, values


_KIND = "an s2hc run"


def check_not_own_input(source: str | Path, out: str | Path) -> None:
    """ValueError when ``out`` is SOURCE, inside it or holds it: writing the run would remove its own input
    (``upcycle RUN --out RUN --overwrite`` used to read the run, then delete it and its metrics)."""
    source_path, out_path = Path(source).expanduser().resolve(), Path(out).expanduser().resolve()
    if out_path == source_path or out_path.is_relative_to(source_path) or source_path.is_relative_to(out_path):
        raise ValueError(f"--out {str(out)!r} is, holds or lies inside SOURCE {str(source)!r}; upcycle never "
                         f"writes over its own input: choose another --out")


def check_run_out(out: str | Path, overwrite: bool) -> None:
    """ValueError unless the run may be written to ``out``: it holds no run (or ``overwrite``) and nothing that
    is not a run's. Changes nothing; :func:`upcycle` checks again under the lock."""
    found = run_files(out)
    if found and not overwrite:  # upcycle has no --resume: a run there is replaced or left alone
        raise ValueError(f"--out {str(out)!r} already holds a run ({', '.join(found)}); pass --overwrite to "
                         f"replace it, or choose another --out")
    check_replaceable(out, "--out", _KIND, is_run_entry)


def upcycle(source: str | Path, family: str, n_streams: int, out: str | Path, *, family_options: dict | None = None,
            spread: float = DEFAULT_SPREAD, tokenizer: str | None = None, overwrite: bool = False) -> Path:
    """Write the run directory ``out`` holding SOURCE upcycled to ``family`` with ``n_streams`` streams.

    Everything is checked before anything is read or written (``out`` is not SOURCE, inside it or around it;
    the family, the streams, the run directory), then the source, then the model; returns the checkpoint's path.
    The run directory is complete or absent: built beside ``out`` and swapped in whole
    (:func:`s2hc.rundir.staging.replace_directory`), so a kill leaves either the run that was there (or
    nothing) or the new one, never a ``config.yaml`` without its checkpoint, and running it again just works."""
    check_not_own_input(source, out)
    check_upcyclable(family)
    check_run_out(out, overwrite)
    model, values = read_source(source, tokenizer)
    upcycled = upcycle_model(model, family, n_streams, family_options, spread)
    overrides = {**values.get("model_overrides", {}), "vocab_size": upcycled.config.vocab_size,
                 "stream_reduce": "mean"}
    config = TrainConfig.from_dict({**values, "model_overrides": overrides, "family": family,
                                    "n_streams": n_streams, "family_options": dict(family_options or {}),
                                    "out": str(out)})
    config.check_extras()  # the run's tokenizer ('gpt2' for a GPT-2 SOURCE) must load where the run is used
    # A --tokenizer with more tokens than the model's embedding would make a run that eval, train and the
    # others refuse: refused here, naming the source, before anything is written.
    check_tokenizer_fits(get_tokenizer(config.tokenizer), upcycled.config.vocab_size, source)
    if config.model_config() != upcycled.config:  # the run's configuration must rebuild this very model
        raise ValueError(f"the upcycled model does not round-trip through its run configuration: "
                         f"{config.model_config()} != {upcycled.config}")
    with replace_directory(out, argument="--out", kind=_KIND, allowed=is_run_entry, lock_inside=True,
                           check=lambda: check_run_out(out, overwrite), log=notice) as run_dir:
        write_config(run_dir, config.to_dict())
        save_checkpoint(run_dir / CHECKPOINT, Checkpoint(
            config=config.to_dict(), model_config=upcycled.config.to_dict(), step=0, model=upcycled.state_dict(),
            upcycled_from=str(source), run_id=new_run_id()))
    return Path(out).expanduser() / CHECKPOINT
