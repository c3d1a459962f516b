"""What a checkpoint holds: one dataclass that every writer fills and every reader reads.

A checkpoint is written by the training loop (:class:`s2hc.train.checkpointer.Checkpointer`, every
``checkpoint_every`` steps) and by ``s2hc upcycle`` (step 0, weights only), and read by resuming, ``init_from``,
evaluation, diagnostics, export and the studies. They all go through :class:`Checkpoint`, so a new entry is
added here once, with its version.

On disk (:mod:`s2hc.rundir.checkpoint`) it is a dict of plain data and tensors, ``torch.save``-d and read with
``weights_only=True``, tagged ``{"format": "s2hc-checkpoint", "version": V}`` and closed by a SHA-256 of the
rest. Versions:

- 1: the entries below without ``written_by``; no checksum (read unverified).
- 2: adds the checksum.
- 3: adds ``written_by`` (``"s2hc 0.1.0"``), so that a checkpoint that does not fit this s2hc's model can say
  which s2hc wrote it.
- 4: adds ``run_id``, drawn when a run starts and kept by its resumes, so that a checkpoint put into another run's
  directory (a kept ``best.pt`` copied from elsewhere) is told from the run's own.

Every version is read into the same :class:`Checkpoint`; what an older one lacks takes its default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

FORMAT = "s2hc-checkpoint"
VERSION = 4
READABLE = (1, 2, 3, 4)


def writer() -> str:
    """``"s2hc X.Y.Z"``: what :attr:`Checkpoint.written_by` records."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"s2hc {version('s2hc')}"
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "s2hc (not installed)"


def new_run_id() -> str:
    """A fresh :attr:`Checkpoint.run_id`: 16 random hex digits."""
    import secrets

    return secrets.token_hex(8)


@dataclass
class History:
    """What the loop measured so far; a resumed run continues it, and a finished run read again reports it.

    ``step_times``: one per optimizer step, in seconds: the wall time of the interval between two reads of the
    steps' values (a log, evaluation or checkpoint step) divided by its steps, since a step itself does not wait
    for the device (s2hc.train.step_values); tokens/s is taken from their median;
    ``train_loss``: the last step's training loss; ``val_loss``: the last validation loss (None before one)."""

    step_times: list[float] = field(default_factory=list)
    train_loss: float | None = None
    val_loss: float | None = None

    @classmethod
    def from_dict(cls, values: Any, where: str) -> History:
        if not isinstance(values, dict) or set(values) - {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"{where}: 'history' must be a mapping with keys step_times, train_loss and val_loss, "
                             f"got {values!r}")
        return cls(step_times=list(values.get("step_times", [])), train_loss=values.get("train_loss"),
                   val_loss=values.get("val_loss"))


@dataclass
class Checkpoint:
    """One checkpoint of one run.

    Attributes:
        config: the run's :class:`~s2hc.config.TrainConfig` as a dict (``to_dict()``).
        model_config: its model's :class:`~s2hc.models.ModelConfig` as a dict; with the vocabulary sized to the
            tokenizer, so it rebuilds the model where ``config`` alone may not.
        step: optimizer steps taken (0 for an upcycled run).
        history: :class:`History`.
        world_size: processes that trained it (the global batch is checked against it on resume).
        model: the model's state dict (name -> tensor); None when read ``with_model=False``.
        optimizer: the optimizer's state dict, in single-file checkpoints of training runs (None: a fresh
            optimizer, as after ``s2hc upcycle``; sharded ones keep it in their shards).
        loader: the data loader's position (None: the data starts at the beginning).
        rng: every random generator's state (None: not restored).
        upcycled_from: the source an ``s2hc upcycle`` run was made from.
        written_by: the s2hc that wrote it (version 3 on; None for older files).
        run_id: the run it belongs to (:func:`new_run_id` when the run started; version 4 on, None for older files
            and for a checkpoint no run wrote).
        path: where it was read from (set by the reader; not stored).
    """

    config: dict[str, Any]
    model_config: dict[str, Any]
    step: int
    history: History = field(default_factory=History)
    world_size: int = 1
    model: dict[str, Any] | None = None
    optimizer: dict[str, Any] | None = None
    loader: dict[str, Any] | None = None
    rng: dict[str, Any] | None = None
    upcycled_from: str | None = None
    written_by: str | None = None
    run_id: str | None = None
    path: str | None = field(default=None, compare=False)

    # Entries with a value only in some checkpoints: left out of the payload when None.
    _OPTIONAL = ("model", "optimizer", "loader", "rng", "upcycled_from", "run_id")
    _NOT_STORED = ("path",)

    def payload(self) -> dict[str, Any]:
        """The stored entries (without the format tag, the version and the checksum, which the writer adds)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self._NOT_STORED}
        values["history"] = dataclasses.asdict(self.history)
        values["written_by"] = self.written_by or writer()
        return {k: v for k, v in values.items() if not (k in self._OPTIONAL and v is None)}

    def header(self) -> dict[str, Any]:
        """The stored entries but the model and optimizer tensors: a sharded checkpoint's ``extra.pt``."""
        return {k: v for k, v in self.payload().items() if k not in ("model", "optimizer")}

    @classmethod
    def from_payload(cls, payload: dict[str, Any], path: str, version: int) -> Checkpoint:
        """The checkpoint in ``payload`` (stored entries, tag, version and checksum already removed) of file
        format ``version``; ValueError naming ``path`` when an entry is missing, unknown or of the wrong kind
        (a file another program wrote with our tag)."""
        known = {f.name for f in dataclasses.fields(cls)} - set(cls._NOT_STORED)
        if version < 3:
            known.discard("written_by")
        if version < 4:
            known.discard("run_id")
        unknown = sorted(set(payload) - known)
        missing = sorted({"config", "model_config", "step"} - set(payload))
        if unknown or missing:
            raise ValueError(f"{path!r} is not an s2hc checkpoint of version {version}: "
                             f"{'missing ' + str(missing) if missing else ''}"
                             f"{', ' if missing and unknown else ''}{'unknown ' + str(unknown) if unknown else ''}")
        step = payload["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{path!r}: 'step' must be an integer >= 0, got {step!r}")
        for name in ("config", "model_config"):
            if not isinstance(payload[name], dict):
                raise ValueError(f"{path!r}: {name!r} must be a mapping, got {type(payload[name]).__name__}")
        run_id = payload.get("run_id")
        if run_id is not None and not (isinstance(run_id, str) and 0 < len(run_id) <= 64):
            raise ValueError(f"{path!r}: 'run_id' must be a string of 1 to 64 characters, got {run_id!r:.80}")
        values = dict(payload)
        values["history"] = History.from_dict(payload.get("history", {}), repr(path))
        return cls(**values, path=path)
