"""Where a run's settings come from when it starts from a run: its own (a resume), or another's model.

``s2hc train --out RUN --resume`` continues ``RUN`` with the settings it was started with (:func:`run_settings`);
what the command gives is a change to them, which ``train`` accepts only where it is resumable.

``s2hc train --init-from RUN`` continues pretraining from ``RUN``'s model with a fresh optimizer and schedule.
When ``RUN`` holds a residual model and the new run another family, the weights are upcycled on the way in
(:func:`s2hc.models.widen.upcycle_model`): the new model computes the source's function at step 0.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from ..config import TrainConfig, completed_settings, family_fields, model_fields
from ..connection import forms
from ..models import Transformer
from ..models.widen import check_upcyclable, upcycle_model
from ..rundir import CONFIG, checkpoint_paths, load_checkpoint, load_model, peek_checkpoint, read_config


def run_settings(out) -> dict[str, Any]:
    """The settings the run in ``out`` was last started (or resumed) with: its ``config.yaml``, else its checkpoint's
    configuration, fields added since completed (:func:`~s2hc.config.completed_settings`); empty when ``out`` holds
    neither (``train(..., resume=True)`` then refuses it).

    ValueError in one line naming ``config.yaml`` and the key when the file is damaged or was edited into what no
    run wrote (:func:`check_run_config`); nothing is written before."""
    saved = read_config(out)
    if saved is not None:
        check_run_config(out, saved)
    elif checkpoint_paths(out):
        saved = load_checkpoint(out, with_model=False).config
    return completed_settings(saved) if saved else {}


def check_run_config(out, saved: dict[str, Any]) -> None:
    """ValueError naming ``RUN/config.yaml`` and the key unless ``saved`` (its settings) is what a run writes there:
    known keys of values TrainConfig accepts, and the model the run's checkpoint holds (a family, preset or model
    setting changed by hand would resume another model's weights under another name). Its remedy: correct the key,
    or remove the file, when the run has a checkpoint (a resume then takes the checkpoint's own settings)."""
    path = Path(out).expanduser() / CONFIG
    has_checkpoint = bool(checkpoint_paths(out))
    remedy = ("correct it, or remove the file to resume with the settings in the run's checkpoint" if has_checkpoint
              else "correct it")
    unknown = sorted(set(saved) - {f.name for f in dataclasses.fields(TrainConfig)}, key=str)
    if unknown:
        raise ValueError(f"{str(path)!r}: unknown key {_shown(unknown[0])}{' and others' if len(unknown) > 1 else ''}"
                         f" (a run's config.yaml holds TrainConfig's keys; `s2hc train --help` lists them); {remedy}")
    settings = completed_settings(saved)
    try:
        TrainConfig.from_dict(settings)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{str(path)!r}: {_first_line(error)}; {remedy}") from None
    if not has_checkpoint:
        return
    stored = completed_settings(peek_checkpoint(out).config)
    for key in model_fields():
        if settings.get(key) != stored.get(key):
            raise ValueError(
                f"{str(path)!r} sets {key}: {_shown(settings.get(key))}, but the run's checkpoint was trained with "
                f"{key}: {_shown(stored.get(key))} (the file was changed by hand?); {remedy}")


def _shown(value: Any) -> str:
    """``value`` as a message shows it: its repr, cut at 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0].strip() if lines else type(error).__name__


def resumed_settings(out, changes: dict[str, Any]) -> dict[str, Any]:
    """The settings of the run in ``out`` with ``changes`` over them (``family_options`` merged key by key); what
    ``s2hc train --out OUT --resume`` with flags trains."""
    saved = run_settings(out)
    values = {**saved, **changes}
    if "family_options" in changes and isinstance(saved.get("family_options"), dict):
        values["family_options"] = {**saved["family_options"], **changes["family_options"]}
    return values


def resume_config(out, **changes: Any) -> TrainConfig:
    """The TrainConfig that continues the run in ``out``, with ``changes`` (resumable ones: ``max_steps=2000``)::

        train(resume_config("runs/mine", max_steps=2000), resume=True)
    """
    return TrainConfig.from_dict({**resumed_settings(out, changes), "out": str(out)})


def inherit_model_settings(values: dict[str, Any]) -> dict[str, Any]:
    """TrainConfig ``values`` completed from the run in ``values["init_from"]`` (unchanged without one).

    The model keys ``values`` leaves unset come from the source's stored configuration; a run of another family
    than a residual source's gets ``stream_reduce: mean`` (what upcycling needs to be exact). ValueError when the
    source is not a checkpoint, or cannot be upcycled into the requested family.
    """
    source = values.get("init_from")
    if not source:
        return values
    stored = load_checkpoint(source, with_model=False).config
    out = dict(values)
    explicit_family = "family" in values
    for key in model_fields():
        if key not in out and key in stored:
            if key in family_fields() and explicit_family:
                continue  # a new family takes its own defaults
            out[key] = stored[key]
    if upcycles(stored["family"], out.get("family", forms.RESIDUAL.name), "family (with init_from a residual run)"):
        out["model_overrides"] = {"stream_reduce": "mean", **dict(out.get("model_overrides") or {})}
    return out


def upcycles(source_family: str, family: str, argument: str = "family") -> bool:
    """Whether a run of ``family`` starting from a ``source_family`` run upcycles it (a residual source, another
    family); ValueError naming ``argument`` when ``family`` cannot keep a residual source's function."""
    if forms.get(source_family) is not forms.RESIDUAL or forms.get(family) is forms.RESIDUAL:
        return False
    check_upcyclable(family, argument)
    return True


@torch.no_grad()
def load_initial_weights(model: Transformer, path: str) -> None:
    """Copy the weights of the checkpoint ``path`` into ``model``, upcycling a residual source to ``model``'s
    family. ValueError when the shapes differ (naming the differing settings)."""
    source, _ = load_model(path)
    target = model.config
    if upcycles(source.config.family, target.family):
        source = upcycle_model(source, target.family, target.n_streams, target.family_options)
    if source.config != target:
        mine, theirs = target.to_dict(), source.config.to_dict()
        differ = ", ".join(f"{k}: {theirs.get(k)!r} there, {mine[k]!r} here" for k in mine if mine[k] != theirs.get(k))
        raise ValueError(f"init_from {path!r} holds a model of another shape ({differ}); drop the settings that "
                         "change the model, which are then taken from it")
    model.load_state_dict(source.state_dict())
