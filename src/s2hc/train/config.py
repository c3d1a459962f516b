"""The training configuration: one flat dataclass, read from YAML and overridden from the command line."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from ..checks import check_int
from ..mixers import default_streams
from ..connection import COMPUTE_OPTIONS


@dataclass
class TrainConfig:
    """Everything a run needs; stored in every checkpoint so that a run can be resumed or rebuilt.

    The model is a preset (``s2hc.models.PRESETS``) with ``family``, ``n_streams``, ``family_options`` and
    any other ``ModelConfig`` field overridden through ``model_overrides``. ``batch_size`` is per process
    and micro-step: the global batch is ``batch_size × grad_accum × world_size`` sequences.
    """

    # model
    preset: str = "tiny"
    family: str = "residual"
    n_streams: int | None = None  # None: 1 for residual, 4 otherwise
    family_options: dict = field(default_factory=dict)
    model_overrides: dict = field(default_factory=dict)
    # data
    data: str = "embedded"
    tokenizer: str = "s2hc-bpe-4k"
    cache_dir: str | None = None  # None: $S2HC_CACHE_DIR/tokens or ~/.cache/s2hc/tokens
    seq_len: int = 256
    batch_size: int = 8
    grad_accum: int = 1
    # optimisation (AdamW, cosine with linear warmup and a floor)
    max_steps: int = 1000
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # bookkeeping
    seed: int = 1337
    eval_every: int = 100
    eval_batches: int = 20
    checkpoint_every: int = 100
    log_every: int = 10
    diagnostics_every: int = 0  # 0: off; N: every N steps a "diagnostics" record in metrics.jsonl (s2hc.diagnostics)
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 autocast where the device supports it, float32 on CPU
    compile: bool = False  # torch.compile each block (then shard / replicate, in torchtitan's order)
    connection: dict = field(default_factory=dict)  # how connections compute, e.g. {recompute: true, kernels: triton}
    parallel: str = "auto"  # auto: DDP under torchrun with several processes; or none, ddp, fsdp (FSDP2)
    progress: bool = True
    out: str = "runs/train"

    def __post_init__(self) -> None:
        if self.n_streams is None:
            self.n_streams = default_streams(self.family)
        positive = ("seq_len", "batch_size", "grad_accum", "max_steps", "eval_batches", "log_every", "n_streams")
        for name in positive:
            check_int(name, getattr(self, name))
        for name in ("eval_every", "checkpoint_every", "warmup_steps", "seed", "diagnostics_every"):
            check_int(name, getattr(self, name), minimum=0)
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"lr must be a number > 0, got {self.lr!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError(f"grad_clip and weight_decay must be >= 0, got {self.grad_clip!r}, {self.weight_decay!r}")
        if self.parallel not in ("auto", "none", "ddp", "fsdp"):
            raise ValueError(f"parallel must be one of ['auto', 'none', 'ddp', 'fsdp'], got {self.parallel!r}")
        unknown = sorted(set(self.connection) - set(COMPUTE_OPTIONS)) if isinstance(self.connection, dict) else None
        if unknown != []:
            raise ValueError(
                f"connection must be a dict with keys from {list(COMPUTE_OPTIONS)}, got {self.connection!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be one of ['auto', 'bfloat16', 'float32'], got {self.dtype!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}; allowed: {sorted(allowed)}")
        return cls(**values)

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with ``changes``; ``n_streams`` is re-derived when only ``family`` changes."""
        values = self.to_dict()
        if "family" in changes and "n_streams" not in changes:
            values["n_streams"] = None
        values.update(changes)
        return TrainConfig.from_dict(values)

    def model_config(self):
        """The ``ModelConfig`` this run trains: the preset, its overrides, and the residual family."""
        from ..models import get_preset

        overrides = dict(self.model_overrides)
        overrides.update(family=self.family, n_streams=self.n_streams, family_options=dict(self.family_options))
        overrides.setdefault("max_seq_len", max(self.seq_len, get_preset(self.preset).max_seq_len))
        return get_preset(self.preset, **overrides)


def load_yaml_config(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML config file; ValueError naming the file when it is missing or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {error}") from None
    if not isinstance(values, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of keys to values, got {type(values).__name__}")
    return values


def parse_assignment(text: str) -> tuple[str, Any]:
    """``"lr=3e-4"`` -> ``("lr", 0.0003)``: the value is parsed as YAML, so numbers, booleans and dicts work."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--set expects KEY=VALUE, got {text!r}")
    return key.strip(), yaml.safe_load(value)
