"""The training configuration: one flat dataclass, read from YAML and overridden from the command line.

Every field carries its help text; ``s2hc train`` and ``s2hc compare`` build their flags from these fields
(:func:`option_fields`), so a new setting is added here once. KEY=VALUE overrides (``--set``, bench options,
family options) are parsed by :func:`parse_assignment`, the one place that reads such values.

Every value is checked by type and range when a TrainConfig is made, before anything runs: the type comes from
the field's annotation (``str``, ``int``, ``float``, ``bool``, ``dict``), numbers must be finite and in range
(:data:`FLOAT_RANGES`, ``lr`` at most :data:`MAX_LR`), and family options by the type their family's constructor
declares (:func:`check_family_options`); ValueError naming the key, the value and what is allowed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .checks import check_bool, check_float, check_int, check_str, check_streams, did_you_mean
from .connection import COMPUTE_OPTIONS, KERNELS, forms
from .connection.forms import check_family, default_streams
from .data.sources import MAX_VAL_FRACTION, STREAMING_CHOICES, SourceSpec
from .data.sources import required_packages as data_packages
from .data.tokenizer import required_packages as tokenizer_packages
from .devices import AUTOCAST_NAMES, DEVICE_NAME
from .extras import check_available
from .init_rng import DEFAULT_INIT_RNG, check_init_rng
from .loggers import logger_packages, parse_loggers
from .models import PRESETS, get_preset
from .schedule import DEFAULT_DECAY_FRACTION, MAX_DEFAULT_WARMUP, SCHEDULES, span_and_warmup, warmup_warnings
from .yaml_safety import MAX_YAML_VALUES as MAX_YAML_VALUES  # s2hc.config's names before the module existed
from .yaml_safety import YAMLRefused, load_yaml, yaml_problem

PARALLEL_MODES = ("auto", "none", "ddp", "fsdp")
#: Which parameters AdamW decays (s2hc.train.optim): weight matrices, embeddings and the connections' projections
#: (s2hc's rule), every parameter (the s²HC authors' one group), or every parameter of two or more dimensions
#: (s2hc's rule before these: the committed study of docs/results.md was trained with it).
WEIGHT_DECAY_RULES = ("matrices", "all", "2d")
#: The optimizers a run may use (s2hc.train.optim): AdamW for every parameter, or torch's Muon for the attention and
#: MLP matrices with AdamW for the rest (embeddings, LM head, biases, norms, every connection parameter).
OPTIMIZERS = ("adamw", "muon")

# The range of every number, checked before anything runs (types come from the field's annotation).
NONNEGATIVE_INTS = (  # the other ints are >= 1 (n_streams also <= MAX_STREAMS, seed in [0, MAX_SEED])
    "eval_every", "checkpoint_every", "warmup_steps", "diagnostics_every", "keep_checkpoints")
MAX_SEED = 2**32 - 1
#: The most seeds one study or comparison trains each configuration with (a run per seed): statistics settle after
#: tens; 10**11 from a YAML edit would be materialised as a list of runs before any starts.
MAX_SEEDS = 1000
#: AdamW moves every weight by about lr per step: above 1 a step is larger than the weights themselves
#: (and lr / (1 - beta1) overflows float32 inside the optimizer near 1e38).
MAX_LR = 1.0
FLOAT_RANGES: dict[str, dict[str, Any]] = {
    "lr": dict(positive=True, maximum=MAX_LR),
    "min_lr_ratio": dict(minimum=0.0, maximum=1.0),
    "decay_fraction": dict(positive=True, maximum=1.0),
    "weight_decay": dict(minimum=0.0),
    "beta1": dict(minimum=0.0, maximum=1.0, open_maximum=True),
    "beta2": dict(minimum=0.0, maximum=1.0, open_maximum=True),
    "grad_clip": dict(minimum=0.0),
    "validation_fraction": dict(positive=True, maximum=MAX_VAL_FRACTION),
}


# The groups of TrainConfig's fields (the metadata "group" of each): what makes the model, the residual family, the
# data the model sees, the optimisation schedule, and the run itself.
MODEL, FAMILY, DATA, SCHEDULE, RUN = "model", "family", "data", "schedule", "run"
GROUPS = (MODEL, FAMILY, DATA, SCHEDULE, RUN)


def _check_group(group: str) -> None:
    if group not in GROUPS:
        raise ValueError(f"group must be one of {list(GROUPS)}, got {group!r}")


def _setting(default: Any, help: str, group: str, *, flag: bool = True, resumable: bool = False, grid: bool = False,
             inherited: bool = True, shown: bool = False):
    """A TrainConfig field and what the rest of s2hc needs to know of it (its metadata), stated once here.

    ``help``: its command-line help. ``group``: one of :data:`GROUPS`. ``flag``: whether ``s2hc train`` gives it a
    flag of its own (otherwise only ``--set``). ``resumable``: whether it may change on ``--resume`` (it does
    not change what is computed). ``grid``: set per run by whoever lays out several runs (a study's grid),
    never by the shared ``train:`` settings. ``inherited``: copied from a source run to a run made from it
    (``s2hc upcycle`` of an s2hc run); off for what names the run itself. ``shown``: changes only what the run
    shows and where it logs, never what it computes or writes into its run directory's record (a resumable
    field; a study may change it and still grow)."""
    _check_group(group)
    if shown and not resumable:
        raise ValueError("a shown field is resumable too")
    metadata = {"help": help, "group": group, "flag": flag, "resumable": resumable, "grid": grid,
                "inherited": inherited, "shown": shown}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainConfig:
    """Everything a run needs; stored in every checkpoint so that a run can be resumed or rebuilt.

    The model is a preset (``s2hc.models.PRESETS``) with ``family``, ``n_streams``, ``family_options`` and
    any other ``ModelConfig`` field overridden through ``model_overrides``. ``batch_size`` is per process
    and micro-step: the global batch is ``batch_size × grad_accum × world_size`` sequences.
    """

    # the model
    preset: str = _setting("tiny", f"model preset, one of {', '.join(PRESETS)}", MODEL)
    tokenizer: str = _setting("s2hc-bpe-4k", "'s2hc-bpe-4k', 'gpt2', a tokenizer.json path or a Hub name", MODEL)
    model_overrides: dict = _setting({}, "other ModelConfig fields, e.g. {dim: 64}", MODEL, flag=False)
    # the residual family
    family: str = _setting("residual", "residual family (s2hc.families())", FAMILY, flag=False)
    n_streams: int | None = _setting(None, "streams n (None: 1 for residual, else 4)", FAMILY, flag=False)
    family_options: dict = _setting({}, "options of the family, e.g. {iterations: 10}", FAMILY, flag=False)
    # the data
    data: str = _setting("embedded", "'embedded', a .txt/.jsonl/.json/.parquet file, a datasets.save_to_disk folder, "
                         "a directory of them, or hf:NAME[:CONFIG]", DATA)
    cache_dir: str | None = _setting(
        None, "where token shards are cached (None: $S2HC_CACHE_DIR/tokens or ~/.cache/s2hc/tokens)", DATA,
        resumable=True)
    seq_len: int = _setting(256, "tokens per sequence", DATA)
    batch_size: int = _setting(8, "sequences per micro-step (per process)", DATA)
    grad_accum: int = _setting(1, "micro-steps per optimizer step", DATA)
    data_seed: int | None = _setting(None, "seed of the data order alone (default: seed), to vary one but not both",
                                     DATA)
    text_field: str = _setting("text", "the field (JSON key, Parquet column, dataset feature) that holds the text",
                               DATA)
    validation_data: str | None = _setting(
        None, "a separate validation source, as data (None: validation_fraction of data is held out)", DATA)
    validation_text_field: str | None = _setting(
        None, "the field of validation_data that holds the text (None: text_field)", DATA)
    validation_fraction: float = _setting(
        0.05, "share of the documents of data held out for validation (without validation_data)", DATA)
    max_documents: int | None = _setting(None, "read at most this many documents of each split (None: all)", DATA)
    max_tokens: int | None = _setting(None, "tokenise at most this many tokens of each split (None: all)", DATA)
    data_split: str = _setting(
        "train", "the split of an hf: dataset or a save_to_disk DatasetDict to read (of validation_data too)", DATA)
    data_files: str | None = _setting(
        None, "data_files of an hf: dataset (a file, glob or comma-separated list; e.g. hf:json with local files)",
        DATA)
    streaming: str = _setting(
        "auto", "tokenise the data chunk by chunk as training reads it: 'auto' (hf: sources and local ones over "
        "1 GiB), 'always' or 'never' (all before step 1)", DATA)
    # the schedule: AdamW (or Muon with AdamW), a learning-rate schedule (s2hc.schedule) with linear warmup
    max_steps: int = _setting(1000, "optimizer steps", SCHEDULE, resumable=True)
    schedule_steps: int | None = _setting(
        None, "steps the schedule spans: it reaches its floor there and holds it after (None: max_steps; a "
        "resume that changes max_steps keeps the run's, so the learning rate never jumps)", SCHEDULE, resumable=True)
    lr: float = _setting(6e-4, "peak learning rate", SCHEDULE)
    lr_schedule: str = _setting(
        "cosine", "after the warmup: 'cosine' (decay to the floor over the schedule), 'wsd' (warmup-stable-decay: lr "
        "held, then a linear decay to the floor over the schedule's last decay_fraction) or 'constant' (lr held)",
        SCHEDULE)
    decay_fraction: float | None = _setting(
        None, f"the share of the schedule a 'wsd' schedule decays over, in (0, 1] (None: {DEFAULT_DECAY_FRACTION})",
        SCHEDULE)
    min_lr_ratio: float = _setting(0.1, "floor of the schedule, as a fraction of lr", SCHEDULE)
    warmup_steps: int | None = _setting(
        None, f"linear warmup steps (None: a tenth of the schedule, at most {MAX_DEFAULT_WARMUP})", SCHEDULE)
    weight_decay: float = _setting(
        0.1, "weight decay (AdamW's, and Muon's for its matrices), of the parameters weight_decay_on names", SCHEDULE)
    weight_decay_on: str = _setting(
        "matrices", "which parameters decay: 'matrices' (weight matrices, embeddings, the connections' projections) "
        "'all' (the s²HC authors' one group; connection norm weights toward 1) or '2d' (every parameter of two or "
        "more dimensions: the rule before these, which also decays mHC's and HC's (n, n) biases)", SCHEDULE)
    optimizer: str = _setting(
        "adamw", "'adamw' (every parameter) or 'muon' (torch's Muon for the attention and MLP matrices, AdamW for "
        "embeddings, LM head, biases, norms and connections; lr is AdamW's update RMS: match_rms_adamw)", SCHEDULE)
    beta1: float = _setting(0.9, "AdamW beta1", SCHEDULE)
    beta2: float = _setting(0.95, "AdamW beta2", SCHEDULE)
    grad_clip: float = _setting(1.0, "gradient-norm clipping (0: off)", SCHEDULE)
    # the run: where it starts from, what it records, where it runs
    seed: int = _setting(1337, "seed of initialisation and data order", RUN, grid=True)
    init_rng: str = _setting(
        DEFAULT_INIT_RNG, "where the initial weights' random values come from: 'per_parameter' (each parameter from "
        "its own generator, seeded by the seed and its name: runs that differ in one option share every other "
        "weight) or 'sequential' (torch's global generator in module order, before per_parameter)", RUN)
    init_from: str | None = _setting(
        None, "run directory or checkpoint whose weights start this run (a residual one is upcycled to the run's "
        "family, see `s2hc upcycle`); the optimizer and the schedule start fresh", RUN, inherited=False)
    eval_every: int = _setting(100, "steps between validation losses (0: only at the end)", RUN, resumable=True)
    eval_batches: int = _setting(20, "validation batches per evaluation", RUN)
    checkpoint_every: int = _setting(100, "steps between checkpoints (0: only at the end)", RUN, resumable=True)
    keep_checkpoints: int = _setting(
        0, "also keep the newest K checkpoints by step (0: only the latest, overwritten)", RUN, resumable=True)
    keep_best: bool = _setting(False, "also keep the checkpoint of the lowest validation loss", RUN, resumable=True)
    activation_checkpointing: bool = _setting(
        False, "recompute each block in the backward pass instead of keeping its activations", RUN, resumable=True)
    log_every: int = _setting(10, "steps between metrics lines", RUN, resumable=True)
    diagnostics_every: int = _setting(
        0, "steps between hyper-connection diagnostics in metrics.jsonl (0: off)", RUN, resumable=True)
    device: str = _setting(
        "auto", "'auto' (cuda when available, else cpu), 'cpu', 'cuda' or 'cuda:N'", RUN, resumable=True)
    dtype: str = _setting("auto", "'auto' (bfloat16 autocast where supported, else float32), 'float32', 'bfloat16'",
                          RUN)
    compile: bool = _setting(
        False, "torch.compile each block (then shard / replicate, in torchtitan's order)", RUN, resumable=True)
    connection: dict = _setting({}, "how connections compute, e.g. {recompute: true, kernels: triton}", RUN,
                                flag=False, resumable=True)
    parallel: str = _setting("auto", "'auto' (DDP with several processes), 'none', 'ddp' or 'fsdp' (FSDP2)", RUN,
                             resumable=True)
    progress: bool = _setting(
        True, "progress bar (off, or when stderr is not a terminal: a line per log_every steps and per evaluation)",
        RUN, resumable=True, shown=True)
    logger: str | None = _setting(
        None, "experiment loggers besides metrics.jsonl, comma-separated: csv, tensorboard, wandb, mlflow",
        RUN, resumable=True, shown=True)
    logger_dir: str | None = _setting(
        None, "where tensorboard, wandb and mlflow write (None: the run directory; a study sets its own)", RUN,
        flag=False, resumable=True, inherited=False, shown=True)
    logger_group: str | None = _setting(
        None, "the loggers' group of runs: W&B group, MLflow experiment (None: none, MLflow's 's2hc'; a study: its "
        "directory's name)", RUN, flag=False, resumable=True, inherited=False, shown=True)
    out: str = _setting("runs/train", "run directory", RUN, flag=False, resumable=True, grid=True, inherited=False)

    def __post_init__(self) -> None:
        """Every value checked by type and range before anything runs; ValueError naming the key otherwise."""
        check_family(self.family)
        if self.n_streams is None:
            self.n_streams = default_streams(self.family)
        for f in fields(self):
            self._check_field(f.name, f.type)
        if self.weight_decay_on not in WEIGHT_DECAY_RULES:
            raise ValueError(f"weight_decay_on must be one of {list(WEIGHT_DECAY_RULES)}, got {self.weight_decay_on!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {list(PARALLEL_MODES)}, got {self.parallel!r}")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {list(SCHEDULES)}, got {self.lr_schedule!r}")
        if self.decay_fraction is not None and self.lr_schedule != "wsd":
            raise ValueError(f"decay_fraction={self.decay_fraction!r} is the decay of lr_schedule 'wsd', and "
                             f"lr_schedule is {self.lr_schedule!r}; set lr_schedule: wsd, or leave decay_fraction out")
        check_init_rng(self.init_rng)
        if self.streaming not in STREAMING_CHOICES:
            raise ValueError(f"streaming must be one of {list(STREAMING_CHOICES)}, got {self.streaming!r}")
        if self.dtype not in AUTOCAST_NAMES:
            raise ValueError(f"dtype must be one of {list(AUTOCAST_NAMES)}, got {self.dtype!r}")
        if not DEVICE_NAME.fullmatch(self.device):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        self._check_connection()
        if self.validation_text_field is not None and self.validation_data is None:
            raise ValueError(f"validation_text_field={self.validation_text_field!r} names the text field of "
                             "validation_data, which is not given; without it validation is held out of data and "
                             "read with text_field")
        self.logger = ",".join(parse_loggers(self.logger)) or None
        self._check_model_overrides()
        self.family_options = check_family_options(self.family, self.n_streams, self.family_options)
        model = self.model_config()  # the preset, model_overrides and the family's options, as the model sees them
        if self.seq_len > model.max_seq_len:  # else refused only by the first forward pass
            raised = yaml.safe_dump({**self.model_overrides, "max_seq_len": self.seq_len}, default_flow_style=True,
                                    width=float("inf")).strip()
            raise ValueError(f"seq_len={self.seq_len} is more than the model's max_seq_len={model.max_seq_len} "
                             f"(preset {self.preset!r}); lower seq_len, or raise max_seq_len: "
                             f"--set \"model_overrides={raised}\"")

    @property
    def schedule_span(self) -> int:
        """The steps the schedule spans (``schedule_steps``, else ``max_steps``): the learning rate decays to
        ``min_lr_ratio × lr`` at this step and stays there (``lr_schedule: constant``: it never decays)."""
        return span_and_warmup(self.max_steps, self.schedule_steps, self.warmup_steps)[0]

    @property
    def warmup(self) -> int:
        """The linear warmup steps: ``warmup_steps``, else a tenth of :attr:`schedule_span`, at most
        :data:`~s2hc.schedule.MAX_DEFAULT_WARMUP`."""
        return span_and_warmup(self.max_steps, self.schedule_steps, self.warmup_steps)[1]

    def _check_field(self, name: str, kind: str) -> None:
        value = getattr(self, name)
        if kind.endswith(" | None"):
            if value is None:
                return
            kind = kind.removesuffix(" | None")
        if kind == "str":
            check_str(name, value, empty=name == "logger")  # "": no loggers (a resume may turn them off)
        elif kind == "bool":
            check_bool(name, value)
        elif kind == "dict":
            if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
                raise ValueError(f"{name} must be a mapping of names to values, got {value!r}")
        elif kind == "float":
            setattr(self, name, check_float(name, value, **FLOAT_RANGES.get(name, {})))
        elif name == "n_streams":
            check_streams(name, value)
        elif name in ("seed", "data_seed"):
            check_int(name, value, minimum=0, maximum=MAX_SEED)
        else:
            check_int(name, value, minimum=0 if name in NONNEGATIVE_INTS else 1)

    def _check_model_overrides(self) -> None:
        """Refuse the family's settings in ``model_overrides``: :meth:`model_config` sets them from the top-level
        keys, so the run would train another model than the config says."""
        for key in family_fields():
            if key in self.model_overrides:
                raise ValueError(f"model_overrides.{key} is set from the top-level '{key}' key; move "
                                 f"{key}: {self.model_overrides[key]!r} out of model_overrides (it would be ignored)")

    def _check_connection(self) -> None:
        unknown = sorted(set(self.connection) - set(COMPUTE_OPTIONS))
        if unknown:
            raise ValueError(
                f"connection must be a dict with keys from {list(COMPUTE_OPTIONS)}, got {self.connection!r}"
            )
        for name in ("fused", "recompute"):
            if name in self.connection:
                check_bool(f"connection.{name}", self.connection[name])
        if "kernels" in self.connection and self.connection["kernels"] not in KERNELS:
            raise ValueError(f"connection.kernels must be one of {list(KERNELS)}, got {self.connection['kernels']!r}")

    def check_extras(self) -> None:
        """:class:`~s2hc.extras.MissingExtra` for an optional package this run needs and does not have (its data,
        tokenizer or kernels): checked before the run directory is written, so the retry is not refused."""
        check_available(data_packages(self.data), f"data={self.data!r}")
        if self.validation_data is not None:
            check_available(data_packages(self.validation_data), f"validation_data={self.validation_data!r}")
        check_available(tokenizer_packages(self.tokenizer), f"tokenizer={self.tokenizer!r}")
        if self.connection.get("kernels") == "triton":
            check_available(("triton",), "connection.kernels='triton'")
        for name in parse_loggers(self.logger):
            check_available(logger_packages(name), f"--logger {name}")

    def schedule_warnings(self) -> list[str]:
        """What in the schedule is probably not meant (one line each, :func:`s2hc.schedule.warmup_warnings`): a
        warmup as long as the run, whose learning rate then rises throughout and never decays (nor, when longer,
        reaches ``lr``). The default warmup (a tenth of the schedule) never is."""
        return warmup_warnings(self.max_steps, self.warmup_steps, self.lr)

    def learning_rate(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based) of this run's schedule
        (:func:`s2hc.schedule.learning_rate`)."""
        from .schedule import learning_rate

        return learning_rate(step, peak=self.lr, warmup_steps=self.warmup, max_steps=self.schedule_span,
                             min_ratio=self.min_lr_ratio, kind=self.lr_schedule, decay_fraction=self.decay_fraction)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - allowed)
        if unknown:
            hint = f" ({did_you_mean(unknown, allowed)})" if did_you_mean(unknown, allowed) else ""
            raise ValueError(f"unknown config key(s) {unknown}{hint}; allowed: {sorted(allowed)}")
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
        return get_preset(self.preset, **overrides)

    def source_spec(self) -> SourceSpec:
        """How this run reads and tokenises its data (a :class:`~s2hc.data.sources.SourceSpec`, besides the source,
        tokenizer, cache and split): every caller that tokenises the run's data passes it, so the run's training
        and validation splits are the same everywhere (training, ``eval``, ``diagnose``, a study's rows).
        ``validation_data`` -> ``val_source``, ``validation_text_field`` -> ``val_text_field``,
        ``validation_fraction`` -> ``val_fraction``, ``data_split`` -> ``hf_split``; the others keep their names.
        All but ``streaming`` enter the token cache's key (``val_text_field`` only when it differs from
        ``text_field``, so the token caches of runs without it keep their keys)."""
        return SourceSpec(
            text_field=self.text_field,
            val_source=self.validation_data,
            val_text_field=self.validation_text_field,
            val_fraction=self.validation_fraction,
            max_documents=self.max_documents,
            hf_split=self.data_split,
            data_files=self.data_files,
            max_tokens=self.max_tokens,
            streaming=self.streaming,
        )


#: What s2hc computed before a field existed, where that is not (or may stop being) the field's default: a run
#: configured before it resumes computing what it did (before ``streaming``, every source was tokenised whole before
#: step 1; before ``optimizer``, AdamW updated every parameter, and before ``lr_schedule`` every schedule was the
#: cosine, which stay so should the defaults ever change).
BEFORE_FIELD = {"streaming": "never", "init_rng": "sequential", "optimizer": "adamw", "lr_schedule": "cosine"}


def completed_settings(stored: dict[str, Any]) -> dict[str, Any]:
    """A run's stored settings (its ``config.yaml``, a checkpoint's config) with every field added since read as
    that s2hc computed it: :data:`BEFORE_FIELD`'s value, else the field's default (``schedule_steps`` unset: the
    schedule spans the run's ``max_steps``, as it did). A run whose ``seq_len`` was above its preset's
    ``max_seq_len`` with no ``model_overrides.max_seq_len`` was trained when s2hc raised the model's
    ``max_seq_len`` to ``seq_len`` (it now refuses such a config): it reads with that override, so it still
    loads and resumes as the model it trained."""
    settings = {**TrainConfig().to_dict(), **BEFORE_FIELD, **stored}
    overrides = settings.get("model_overrides")
    if isinstance(overrides, dict) and "max_seq_len" not in overrides and isinstance(settings.get("seq_len"), int):
        with contextlib.suppress(ValueError, TypeError):  # an unknown preset: TrainConfig names it
            if settings["seq_len"] > get_preset(settings["preset"]).max_seq_len:
                settings["model_overrides"] = {**overrides, "max_seq_len": settings["seq_len"]}
    return settings


def schedule_of(settings: dict[str, Any]) -> tuple[int, int]:
    """``(steps the schedule spans, warmup steps)`` of a run's settings (a TrainConfig's dict, completed):
    ``schedule_steps`` else ``max_steps``; ``warmup_steps`` else a tenth of that span, at most
    :data:`~s2hc.schedule.MAX_DEFAULT_WARMUP` (:func:`s2hc.schedule.span_and_warmup`)."""
    return span_and_warmup(settings["max_steps"], settings.get("schedule_steps"), settings.get("warmup_steps"))


def check_seed_count(name: str, value: Any) -> int:
    """A number of seeds per configuration (``s2hc compare --seeds``, a study's ``seeds: N``): an integer in
    ``[1, MAX_SEEDS]``; ValueError naming ``name`` otherwise."""
    return check_int(name, value, maximum=MAX_SEEDS)


def check_family_options(family: str, n_streams: int, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for ``family`` at ``n_streams`` streams, each checked by the type its constructor declares
    (a ``float`` option must be a finite number, ``alpha=.nan`` is refused), then by building the family on the
    meta device (nothing allocated), so that a value the family refuses (``rotation=foo``, n > 6 for mhc-lite
    without ``allow_large``) fails here, before any data is read. Returns the options, numeric strings of
    float options converted. Unknown options are left to :class:`~s2hc.models.ModelConfig`, which names them."""
    check_streams("n_streams", n_streams)
    return forms.get(family).check_option_values(options, n_streams)


def shipped_configs() -> dict[str, str]:
    """Name -> text of every YAML config shipped in the package (``s2hc/configs/``; the repository's ``configs/``
    links to it), so that a pip install has them too: ``s2hc configs NAME > NAME.yaml``."""
    folder = resources.files(__package__).joinpath("configs")
    files = sorted((p for p in folder.iterdir() if p.name.endswith(".yaml")), key=lambda p: p.name)
    return {p.name.removesuffix(".yaml"): p.read_text(encoding="utf-8") for p in files}


def config_path(text: str | Path) -> Path:
    """The YAML file a command's config argument names (``s2hc train --config``, ``s2hc study CONFIG``): ``text``
    when such a path exists, or ``text.yaml`` (an edited copy, ``s2hc configs NAME > NAME.yaml``), so a file of
    that name in the working directory comes first; else the shipped config of that name (``demo-tiny`` or
    ``demo-tiny.yaml``, as :func:`shipped_configs` and ``s2hc configs`` name them); ValueError in one line naming
    the shipped ones (and the one meant, when close) when it is neither, or when ``text`` is empty."""
    if not str(text).strip():
        raise ValueError(f"the config is empty ({str(text)!r}); name a YAML file or a shipped config such as "
                         "demo-tiny (`s2hc configs` lists them)")
    path = Path(text).expanduser()
    for candidate in (path, path.with_name(path.name + ".yaml")):
        if candidate.exists():
            return candidate
    name = str(text).removesuffix(".yaml")
    shipped = shipped_configs()
    if name in shipped:
        return Path(str(resources.files(__package__).joinpath("configs").joinpath(f"{name}.yaml")))
    hint = did_you_mean(name, shipped)
    raise ValueError(f"config file {str(text)!r} does not exist and is not the name of a shipped config"
                     f"{f'; {hint}' if hint else ''} (shipped: {', '.join(shipped)}; `s2hc configs` says what each "
                     "is for)")


def load_yaml_config(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML config file; ValueError naming the file when it is missing, a directory, not UTF-8,
    not YAML (one line: the parser's problem, line and column, not its multi-line excerpt) or not a mapping."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"config file {str(path)!r} is a directory; name a YAML file")
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        values = load_yaml(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as error:
        raise ValueError(f"config file {str(path)!r} is not UTF-8 text (byte {error.start}); a config is "
                         "UTF-8 YAML") from None
    except YAMLRefused as error:
        raise ValueError(f"config file {str(path)!r} is refused: {error.problem}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {yaml_problem(error)}") from None
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
        parsed = load_yaml(value)
    except YAMLRefused as error:
        raise ValueError(f"{argument}: the value of {key.strip()!r} is refused: {error.problem}") from None
    except yaml.YAMLError:
        shown = repr(value) if len(value) <= 200 else f"{value[:100]!r}... ({len(value):,} characters)"
        raise ValueError(f"{argument}: the value of {key.strip()!r} is not valid YAML: {shown}") from None
    glued = _glued_key(parsed)
    if glued is not None:  # {dim:32} is YAML for {"dim:32": None}: a mapping without its space
        name, _, rest = glued.partition(":")
        raise ValueError(f"{argument}: the value of {key.strip()!r} reads as a key {glued!r} without a value; YAML "
                         f"needs a space after the colon ({name}: {rest}), e.g. {key.strip()}="
                         f"{value.replace(glued, f'{name}: {rest}')}")
    return key.strip(), parsed


def _glued_key(value: Any) -> str | None:
    """A mapping key like ``"dim:32"`` with no value, anywhere in ``value``: what ``{dim:32}`` parses to."""
    if isinstance(value, dict):
        for key, item in value.items():
            if item is None and isinstance(key, str) and ":" in key and not key.startswith(":"):
                return key
            found = _glued_key(item)
            if found is not None:
                return found
    elif isinstance(value, list):
        return next((found for item in value if (found := _glued_key(item)) is not None), None)
    return None


def option_fields() -> list[dataclasses.Field]:
    """The TrainConfig fields that get a command-line flag of their own (``--max-steps`` for ``max_steps``)."""
    return [f for f in fields(TrainConfig) if f.metadata["flag"]]


# ------------------------------------------------------------------- lists computed from the field metadata


def _names(keep) -> tuple[str, ...]:
    return tuple(f.name for f in fields(TrainConfig) if keep(f.metadata))


def fields_of(*groups: str) -> tuple[str, ...]:
    """The names of the TrainConfig fields in ``groups`` (of :data:`GROUPS`), in declaration order."""
    for group in groups:
        _check_group(group)
    return _names(lambda meta: meta["group"] in groups)


def family_fields() -> tuple[str, ...]:
    """``family``, ``n_streams``, ``family_options``: the ModelConfig fields a TrainConfig keeps outside
    ``model_overrides`` (there they would be overwritten without a word)."""
    return fields_of(FAMILY)


def model_fields() -> tuple[str, ...]:
    """The fields that make the model and its vocabulary (the model and family groups): a run started from another
    (``init_from``) takes those it does not set from it."""
    return fields_of(MODEL, FAMILY)


def resumable_fields() -> tuple[str, ...]:
    """The fields that may change on ``--resume`` without changing what is computed."""
    return _names(lambda meta: meta["resumable"])


def shown_fields() -> tuple[str, ...]:
    """The fields that change only what a run shows and where it logs (the progress bar, the loggers)."""
    return _names(lambda m: m["shown"])


def grid_fields() -> tuple[str, ...]:
    """The fields a study's grid sets per run (the family group, ``seed``, ``out``), not its ``train:`` settings."""
    return _names(lambda meta: meta["group"] == FAMILY or meta["grid"])


def inherited_fields() -> tuple[str, ...]:
    """The fields a run made from another run's configuration copies (all but those naming the run itself)."""
    return _names(lambda meta: meta["inherited"])
