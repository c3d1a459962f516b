"""The training configuration: one flat dataclass, read from YAML and overridden from the command line.

Every field carries its help text; ``s2hc train`` and ``s2hc compare`` build their flags from these fields
(:func:`option_fields`), so a new setting is added here once. KEY=VALUE overrides (``--set``, bench options,
family options) are parsed by :func:`parse_assignment`, the one place that reads such values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from .checks import check_int
from .connection import COMPUTE_OPTIONS
from .devices import AUTOCAST_NAMES
from .mixers import check_family, default_streams
from .models import get_preset

PARALLEL_MODES = ("auto", "none", "ddp", "fsdp")


def _setting(default: Any, help: str, **metadata: Any):
    """A TrainConfig field with its command-line help (``flag=False``: no flag of its own, only ``--set``)."""
    if isinstance(default, dict):
        return field(default_factory=dict, metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class TrainConfig:
    """Everything a run needs; stored in every checkpoint so that a run can be resumed or rebuilt.

    The model is a preset (``s2hc.models.PRESETS``) with ``family``, ``n_streams``, ``family_options`` and
    any other ``ModelConfig`` field overridden through ``model_overrides``. ``batch_size`` is per process
    and micro-step: the global batch is ``batch_size × grad_accum × world_size`` sequences.
    """

    # model
    preset: str = _setting("tiny", "model preset (s2hc.models.PRESETS)")
    family: str = _setting("residual", "residual family (s2hc.families())", flag=False)
    n_streams: int | None = _setting(None, "streams n (None: 1 for residual, else 4)", flag=False)
    family_options: dict = _setting({}, "options of the family, e.g. {iterations: 10}", flag=False)
    model_overrides: dict = _setting({}, "other ModelConfig fields, e.g. {dim: 64}", flag=False)
    # data
    data: str = _setting("embedded", "'embedded', a .txt/.jsonl/.parquet file or directory, or hf:NAME[:CONFIG]")
    tokenizer: str = _setting("s2hc-bpe-4k", "'s2hc-bpe-4k', 'gpt2', a tokenizer.json path or a Hub name")
    cache_dir: str | None = _setting(
        None, "where token shards are cached (None: $S2HC_CACHE_DIR/tokens or ~/.cache/s2hc/tokens)"
    )
    seq_len: int = _setting(256, "tokens per sequence")
    batch_size: int = _setting(8, "sequences per micro-step (per process)")
    grad_accum: int = _setting(1, "micro-steps per optimizer step")
    # optimisation (AdamW, cosine with linear warmup and a floor)
    max_steps: int = _setting(1000, "optimizer steps")
    lr: float = _setting(6e-4, "peak learning rate")
    min_lr_ratio: float = _setting(0.1, "floor of the cosine schedule, as a fraction of lr")
    warmup_steps: int = _setting(100, "linear warmup steps")
    weight_decay: float = _setting(0.1, "AdamW weight decay (matrices only)")
    beta1: float = _setting(0.9, "AdamW beta1")
    beta2: float = _setting(0.95, "AdamW beta2")
    grad_clip: float = _setting(1.0, "gradient-norm clipping (0: off)")
    # bookkeeping
    seed: int = _setting(1337, "seed of initialisation and data order")
    eval_every: int = _setting(100, "steps between validation losses (0: only at the end)")
    eval_batches: int = _setting(20, "validation batches per evaluation")
    checkpoint_every: int = _setting(100, "steps between checkpoints (0: only at the end)")
    log_every: int = _setting(10, "steps between metrics lines")
    diagnostics_every: int = _setting(0, "steps between hyper-connection diagnostics in metrics.jsonl (0: off)")
    device: str = _setting("auto", "'auto' (cuda when available, else cpu), 'cpu', 'cuda' or 'cuda:N'")
    dtype: str = _setting("auto", "'auto' (bfloat16 autocast where supported, else float32), 'float32', 'bfloat16'")
    compile: bool = _setting(False, "torch.compile each block (then shard / replicate, in torchtitan's order)")
    connection: dict = _setting({}, "how connections compute, e.g. {recompute: true, kernels: triton}", flag=False)
    parallel: str = _setting("auto", "'auto' (DDP with several processes), 'none', 'ddp' or 'fsdp' (FSDP2)")
    progress: bool = _setting(True, "progress bar")
    out: str = _setting("runs/train", "run directory", flag=False)

    def __post_init__(self) -> None:
        check_family(self.family)
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
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {list(PARALLEL_MODES)}, got {self.parallel!r}")
        unknown = sorted(set(self.connection) - set(COMPUTE_OPTIONS)) if isinstance(self.connection, dict) else None
        if unknown != []:
            raise ValueError(
                f"connection must be a dict with keys from {list(COMPUTE_OPTIONS)}, got {self.connection!r}"
            )
        if self.dtype not in AUTOCAST_NAMES:
            raise ValueError(f"dtype must be one of {list(AUTOCAST_NAMES)}, got {self.dtype!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}; allowed: {sorted(allowed)}")
        return cls(**values)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes``; ``n_streams`` is re-derived when only ``family`` changes."""
        values = self.to_dict()
        if "family" in changes and "n_streams" not in changes:
            values["n_streams"] = None
        values.update(changes)
        return TrainConfig.from_dict(values)

    def model_config(self):
        """The ``ModelConfig`` this run trains: the preset, its overrides, and the residual family."""
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
        raise ValueError(
            f"config file {str(path)!r} must hold a mapping of keys to values, got {type(values).__name__}"
        )
    return values


def parse_assignment(text: str, argument: str = "--set") -> tuple[str, Any]:
    """``"lr=3e-4"`` -> ``("lr", 0.0003)``: the value is parsed as YAML, so numbers, booleans, bare words and
    dicts work (``rotation=expm``, ``recompute=true``, ``model_overrides={dim: 64}``). ValueError naming
    ``argument`` when there is no ``=``, no key, or the value is not YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"{argument} expects KEY=VALUE, got {text!r}")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError:
        raise ValueError(f"{argument}: the value of {key.strip()!r} is not valid YAML: {value!r}") from None


def option_fields() -> list[dataclasses.Field]:
    """The TrainConfig fields that get a command-line flag of their own (``--max-steps`` for ``max_steps``)."""
    return [f for f in fields(TrainConfig) if f.metadata.get("flag", True)]
