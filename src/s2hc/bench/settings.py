"""What one bench measures and how: :class:`BenchSettings`, every value checked when it is made.

``s2hc bench`` builds one from its arguments (:mod:`s2hc.cli.bench`); :func:`s2hc.bench.measure.benchmark_steps`
and :func:`s2hc.bench.run.run_bench` take it whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checks import check_bool, check_int, check_streams
from ..devices import AUTOCAST_NAMES, resolve_device
from ..models import ModelConfig, get_preset


@dataclass(frozen=True)
class BenchSettings:
    """The settings of a bench run.

    The model: ``preset`` with ``overrides`` (other :class:`~s2hc.models.ModelConfig` fields, e.g.
    ``{"n_layers": 2}``: ``s2hc bench --layers``), ``n_streams`` the streams of the families that have several (the
    coefficient-path table's and the parameter table's too). A training step: ``batch_size`` sequences of
    ``seq_len`` tokens, compiled with ``compile``, every variant also with its blocks checkpointed beside it with
    ``activation_checkpointing``. Timing: ``repeats`` interleaved repetitions of ``steps`` timed steps per variant,
    after ``warmup`` untimed steps (two when compiling); ``memory``: also the peak memory of a step. What else runs
    (:func:`s2hc.bench.run.run_bench`): ``coefficients``, the coefficient-path table; ``peer``, the
    ``hyper-connections`` package's mHC when it is importable. Where: ``device`` (a name of
    :func:`s2hc.devices.resolve_device`, kept as the :class:`torch.device` it resolves to) and ``dtype``, the
    precision, one of :data:`s2hc.devices.AUTOCAST_NAMES` (``TrainConfig.dtype``'s names).

    ValueError naming the field, its value and what is allowed for anything else (an unknown preset or override:
    :func:`s2hc.models.get_preset`'s)."""

    preset: str = "small"
    overrides: dict = field(default_factory=dict)
    n_streams: int = 4
    batch_size: int = 8
    seq_len: int = 256
    compile: bool = False
    activation_checkpointing: bool = False
    repeats: int = 3
    steps: int = 2
    warmup: int = 1
    memory: bool = True
    coefficients: bool = True
    peer: bool = True
    device: torch.device | str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.overrides, dict) or not all(isinstance(key, str) for key in self.overrides):
            raise ValueError(f"overrides must be a mapping of ModelConfig fields to values, got {self.overrides!r}")
        object.__setattr__(self, "overrides", dict(self.overrides))  # the caller's dict stays the caller's
        self.model_config()  # the preset and the overrides, named by get_preset when refused
        check_streams("n_streams", self.n_streams)
        for name in ("batch_size", "seq_len", "repeats", "steps"):
            check_int(name, getattr(self, name))
        check_int("warmup", self.warmup, minimum=0)
        for name in ("compile", "activation_checkpointing", "memory", "coefficients", "peer"):
            check_bool(name, getattr(self, name))
        object.__setattr__(self, "device", resolve_device(self.device))
        if self.dtype not in AUTOCAST_NAMES:
            raise ValueError(f"dtype must be one of {list(AUTOCAST_NAMES)}, got {self.dtype!r}")

    def model_config(self) -> ModelConfig:
        """The preset with the overrides (before a family is set: the residual model's)."""
        return get_preset(self.preset, **self.overrides)
