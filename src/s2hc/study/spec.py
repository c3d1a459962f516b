"""A study's grid, read from YAML and checked whole before anything runs.

A study config (``configs/study-*.yaml``)::

    description: what the study asks              # optional, shown in the report
    train: {preset: tiny, max_steps: 300, ...}    # TrainConfig keys shared by every run (as in `s2hc train` configs)
    n_streams: [4]                                # stream counts of every family but residual (default [4])
    seeds: 3                                      # a count (seeds 0, 1, 2) or a list of seeds (at most 1000)
    families:                                     # one configuration per entry and stream count
      - residual
      - mhc
      - s2hc:rotation=expm                        # FAMILY:KEY=VALUE[,KEY=VALUE]
      - {family: s2hc, n_streams: [2, 4, 8]}      # or a mapping: family, options, n_streams
    settings:                                     # optional: every family is trained under each of these
      - {weight_decay_on: matrices}               # (TrainConfig keys over `train:`; model_overrides merge key by key)
      - {weight_decay_on: all, weight_decay: 1.43, seeds: 4}   # `seeds`: this setting's own (count or list)
    factorial:                                    # optional: main effects and interactions of two-level factors
      - factors: {projection_init: [zero, normal], weight_decay_on: [matrices, all]}
        where: {family: s2hc}                     # which configurations make the cells (see .factorial)
    baselines: [residual, mhc]                    # paired differences against these (default)
    preregistered: {...}                          # optional: the confirmatory test, fixed before the runs
                                                  # (see .preregistered)
    diagnostics_tokens: 2048                      # positions measured by the trained-model diagnostics
    nproc: 1                                      # processes (GPUs) per run: `s2hc train --nproc N` (torchrun)

A configuration is a family with its options at one stream count under one of the ``settings`` (none given: the
``train:`` settings alone); ``settings`` make the axes that are not the family's (a depth sweep:
``{model_overrides: {n_layers: 8}}``, ``{model_overrides: {n_layers: 16}}``), and a configuration is paired only
with a baseline trained under the same settings.

``n_streams`` is ``n_streams`` of a training config; the older name ``streams`` is read with a notice on
stderr. Every grid point becomes a :class:`~s2hc.config.TrainConfig` here, so an unknown key, family or option, or a
value out of range, is refused with the point named before the first run starts.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checks import check_int, check_streams
from ..config import (
    MAX_SEED,
    MAX_SEEDS,
    TrainConfig,
    check_seed_count,
    grid_fields,
    load_yaml_config,
    parse_assignment,
    shown_fields,
)
from ..connection import HyperConnection, forms
from ..connection.forms import check_family, options
from ..init_rng import DEFAULT_INIT_RNG
from ..mixers import REFERENCE_FAMILY
from ..models.model_config import CONNECTION_OPTIONS
from ..rundir import load_checkpoint
from ..train.init_from import upcycles
from .factorial import parse_designs
from .preregistered import parse_preregistered

KEYS = ("description", "train", "n_streams", "streams", "seeds", "families", "settings", "factorial", "baselines",
        "preregistered",
        "diagnostics_tokens", "nproc")
MODEL_OVERRIDES = "model_overrides"  # the TrainConfig key whose settings merge key by key (``model_overrides.dim``)
GRID_KEYS = grid_fields()  # set by the grid, not by `train:` (TrainConfig's field metadata says which)
DEFAULT_DIAGNOSTICS_TOKENS = 2048
DEFAULT_BASELINES = (forms.RESIDUAL.name, REFERENCE_FAMILY)  # what every configuration is paired with, unless told
#: Bounds of the counts a grid file sets beside its runs' (which TrainConfig bounds): the diagnostics hold
#: per-token matrices of every connection in memory, and a run's processes are GPUs of one machine or more.
MAX_DIAGNOSTICS_TOKENS, MAX_NPROC = 1_000_000, 1024
#: HyperConnection's own options a grid entry may set (beside the family's), with their defaults.
CONNECTION_DEFAULTS = {name: parameter.default for name, parameter in
                       inspect.signature(HyperConnection.__init__).parameters.items()
                       if name in CONNECTION_OPTIONS}


@dataclass(frozen=True)
class Configuration:
    """One family with its options at one stream count; the unit that seeds repeat."""

    family: str
    options: tuple[tuple[str, Any], ...]
    n_streams: int
    #: Training settings of this configuration over the study's ``train:`` (``("weight_decay_on", "all")``,
    #: ``("model_overrides.n_layers", 16)``), in the order the study config gives them.
    settings: tuple[tuple[str, Any], ...] = ()
    #: The seeds of this configuration when its setting gives its own (``settings: [{..., seeds: 4}]``): the
    #: costly cells of a grid get more seeds than the others. None: the study's seeds.
    seeds: tuple[int, ...] | None = None

    @property
    def label(self) -> str:
        """``"s2hc n=4"``, ``"s2hc (rotation=expm) n=4"``, ``"residual"``, ``"mhc n=4 [n_layers=16]"``: how tables
        name it."""
        settings = ", ".join(f"{_short(k)}={_word(v)}" for k, v in self.settings)
        suffix = f" [{settings}]" if settings else ""
        options = ", ".join(f"{k}={_word(v)}" for k, v in self.options)
        streams = "" if self.one_stream else f" n={self.n_streams}"
        return f"{self.family}{f' ({options})' if options else ''}{streams}{suffix}"

    @property
    def one_stream(self) -> bool:
        """Whether the family's form has one stream whatever n the others use (the residual, AttnRes)."""
        return forms.get(self.family).max_streams == 1

    @property
    def slug(self) -> str:
        """``"s2hc-n4-rotation-expm"``, ``"mhc-n4-n_layers-16"``: the label as a file name."""
        parts = [self.family] + ([] if self.one_stream else [f"n{self.n_streams}"])
        parts += [f"{k}-{_word(v)}" for k, v in self.options]
        parts += [f"{_short(k)}-{_word(v)}" for k, v in self.settings]
        return re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(parts))

    def run_name(self, seed: int) -> str:
        return f"{self.slug}-seed{seed}"


def _word(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _short(key: str) -> str:
    """A setting's name in labels: ``model_overrides.n_layers`` is ``n_layers``."""
    return key.removeprefix(f"{MODEL_OVERRIDES}.")


def apply_settings(train: dict[str, Any], settings) -> dict[str, Any]:
    """``train`` with ``settings`` (``(key, value)`` pairs, ``model_overrides.KEY`` merged into its mapping) set
    over it; ``train`` is left as it was."""
    merged = {**train, MODEL_OVERRIDES: dict(train.get(MODEL_OVERRIDES) or {})}
    for key, value in settings:
        if key.startswith(f"{MODEL_OVERRIDES}."):
            merged[MODEL_OVERRIDES][_short(key)] = value
        else:
            merged[key] = value
    if not merged[MODEL_OVERRIDES] and MODEL_OVERRIDES not in train:
        del merged[MODEL_OVERRIDES]
    return merged


@dataclass(frozen=True)
class StudySpec:
    """A checked study: the shared training settings, the configurations and the seeds."""

    train: dict[str, Any]
    configurations: tuple[Configuration, ...]
    seeds: tuple[int, ...]
    baselines: tuple[str, ...] = DEFAULT_BASELINES
    #: The two-level designs whose main effects and interactions the report computes (:mod:`.factorial`).
    factorial: tuple[dict[str, Any], ...] = ()
    diagnostics_tokens: int = DEFAULT_DIAGNOSTICS_TOKENS
    description: str = ""
    nproc: int = 1
    title: str = "s2hc study"  # the report's heading (`s2hc compare` names itself)
    #: The confirmatory test written before the runs (:mod:`.preregistered`); None: every comparison is exploratory.
    preregistered: dict[str, Any] | None = None

    def run_config(self, configuration: Configuration, seed: int, out: str | Path) -> TrainConfig:
        """The TrainConfig of one run, written to ``out``."""
        return TrainConfig.from_dict({
            **apply_settings(self.train, configuration.settings), "family": configuration.family,
            "n_streams": configuration.n_streams,
            "family_options": dict(configuration.options), "seed": seed, "out": str(out),
        })

    def seeds_of(self, configuration: Configuration) -> tuple[int, ...]:
        """The seeds ``configuration`` is trained with: its setting's own, else the study's."""
        return self.seeds if configuration.seeds is None else configuration.seeds

    def runs(self) -> list[tuple[Configuration, int]]:
        """Every (configuration, seed), seed by seed: the order runs start in (a study cut short has every
        configuration at its first seeds)."""
        seeds = dict.fromkeys(s for c in self.configurations for s in self.seeds_of(c))  # in the order given
        return [(c, seed) for seed in seeds for c in self.configurations if seed in self.seeds_of(c)]

    def grid(self) -> dict[str, Any]:
        """What decides the runs (training settings, configurations, seeds): a study directory keeps one."""
        data = self.to_dict()
        return {key: data[key] for key in ("train", "configurations", "seeds")}

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["configurations"] = [
            {"family": c.family, "options": dict(c.options), "n_streams": c.n_streams, "label": c.label,
             **({"settings": dict(c.settings)} if c.settings else {}),  # absent without: older grids still grow
             **({"seeds": list(c.seeds)} if c.seeds is not None else {})}
            for c in self.configurations
        ]
        if self.preregistered is None:
            del data["preregistered"]
        data["factorial"] = list(self.factorial)
        if not data["factorial"]:
            del data["factorial"]
        return data


def _entry(entry: Any, default_streams: list[int], where: str) -> list[Configuration]:
    """The configurations of one ``families:`` entry (one per stream count)."""
    if isinstance(entry, str):
        family, _, option_text = entry.partition(":")
        options = dict(parse_assignment(part, f"{where} {entry!r}") for part in option_text.split(",") if part.strip())
        streams = default_streams
    elif isinstance(entry, dict):
        unknown = sorted(set(entry) - {"family", "options", "n_streams", "streams"})
        if unknown or "family" not in entry:
            raise ValueError(f"{where}: a mapping entry takes 'family' (required), 'options' and 'n_streams'; "
                             f"got {sorted(entry)}")
        family, options = entry["family"], entry.get("options") or {}
        if not isinstance(options, dict):
            raise ValueError(f"{where}: 'options' must be a mapping of option to value, got {options!r}")
        given = _n_streams(entry, where)
        streams = default_streams if given is None else _streams(given, f"{where} n_streams")
    else:
        raise ValueError(f"{where}: expected FAMILY, FAMILY:KEY=VALUE or a mapping, got {entry!r}")
    family = check_family(str(family).strip(), where)
    form = forms.get(family)
    if not form.allowed_options() and options:
        raise ValueError(f"{where}: {family} takes no options, got {options!r}")
    if form.max_streams == 1:
        return [Configuration(family, tuple(sorted(options.items())), 1)]
    frozen = tuple(sorted(options.items()))
    return [Configuration(family, frozen, n) for n in streams]


def _n_streams(values: dict[str, Any], where: str) -> Any:
    """The ``n_streams`` of a study config or of a mapping entry, read under its older name ``streams`` too (with
    a one-line notice on stderr); None when neither is given."""
    if "streams" not in values:
        return values.get("n_streams")
    if "n_streams" in values:
        raise ValueError(f"{where}: gives both 'n_streams' and 'streams' (its older name); keep 'n_streams'")
    print(f"s2hc study: {where}: 'streams' is deprecated, call it 'n_streams' (the same stream counts, as in "
          "training configs)", file=sys.stderr)
    return values["streams"]


def _streams(value: Any, where: str) -> list[int]:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ValueError(f"{where} is empty; give stream counts, e.g. [4]")
    return [check_streams(where, v) for v in values]


def _seeds(value: Any, name: str = "seeds") -> tuple[int, ...]:
    if isinstance(value, list):
        if not value:
            raise ValueError(f"{name} is empty; give a count (e.g. 3) or a list of seeds")
        if len(value) > MAX_SEEDS:
            raise ValueError(f"{name} lists {len(value)} seeds; at most {MAX_SEEDS} (a run each per configuration)")
        seeds = tuple(check_int(name, v, minimum=0, maximum=MAX_SEED) for v in value)
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"{name} lists a seed twice: {list(seeds)}")
        return seeds
    return tuple(range(check_seed_count(name, value)))


def parse_spec(values: dict[str, Any], overrides: list[str] = (), source: str = "the study config",
               title: str = "s2hc study") -> StudySpec:
    """A :class:`StudySpec` from the mapping of a study config; ``overrides`` are ``KEY=VALUE`` settings of
    ``train`` (``--set``); ``title``: the report's heading. ValueError naming the problem (and the grid point) for
    anything a run would refuse."""
    unknown = sorted(set(values) - set(KEYS))
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown}; allowed: {list(KEYS)}")
    train = values.get("train") or {}
    if not isinstance(train, dict):
        raise ValueError(f"{source}: 'train' must be a mapping of TrainConfig keys, got {train!r}")
    train = {**train, **dict(parse_assignment(text) for text in overrides)}
    fixed = sorted(set(train) & set(GRID_KEYS))
    if fixed:
        raise ValueError(f"{source}: train sets {fixed}, which the grid sets for every run (families, n_streams, "
                         "seeds, --out); remove them from train")
    TrainConfig.from_dict(train)  # unknown keys and bad values, named once, before the grid
    # Recorded in the grid whether given or not: a grid recorded before the field drew sequentially (runner._computed).
    train.setdefault("init_rng", DEFAULT_INIT_RNG)
    families = values.get("families")
    if not isinstance(families, list) or not families:
        raise ValueError(f"{source}: 'families' is missing or empty; list at least one family, e.g. [residual, s2hc]")
    given = _n_streams(values, source)
    default_streams = _streams([4] if given is None else given, f"{source}: n_streams")
    configurations: list[Configuration] = []
    setting_index: list[int] = []  # which settings entry each configuration comes from
    for number, (settings, setting_seeds) in enumerate(_settings(values.get("settings"), source)):
        for index, entry in enumerate(families):
            for configuration in _entry(entry, default_streams, f"{source}: families[{index}]"):
                configuration = dataclasses.replace(configuration, settings=settings, seeds=setting_seeds)
                if configuration in configurations:
                    raise ValueError(f"{source}: {configuration.label!r} is listed twice")
                configurations.append(configuration)
                setting_index.append(number)
    baselines = values.get("baselines", list(DEFAULT_BASELINES))
    if not isinstance(baselines, list):
        raise ValueError(f"{source}: 'baselines' must be a list of families, got {baselines!r}")
    spec = StudySpec(
        train=train,
        configurations=tuple(configurations),
        seeds=_seeds(values.get("seeds", 3)),
        baselines=tuple(check_family(b, f"{source}: baselines") for b in baselines),
        diagnostics_tokens=check_int(f"{source}: diagnostics_tokens",
                                     values.get("diagnostics_tokens", DEFAULT_DIAGNOSTICS_TOKENS), minimum=1,
                                     maximum=MAX_DIAGNOSTICS_TOKENS),
        description=str(values.get("description") or "").strip(),
        nproc=check_int(f"{source}: nproc", values.get("nproc", 1), maximum=MAX_NPROC),
        title=title,
    )
    seen: dict[tuple, tuple[Configuration, int]] = {}
    for configuration, number in zip(spec.configurations, setting_index):  # every option checked as the run will
        try:
            config = spec.run_config(configuration, spec.seeds_of(configuration)[0], "unused")
        except ValueError as error:
            raise ValueError(f"{source}: {configuration.label}: {error}") from None
        model = (_model_key(config), _training_key(config))
        if model in seen and seen[model][1] != number:
            raise ValueError(f"{source}: settings[{seen[model][1]}] and settings[{number}] train the same runs once "
                             f"train: and the defaults are applied ({seen[model][0].label!r} and "
                             f"{configuration.label!r}; {', '.join(shown_fields())} change what a run shows, not what "
                             "it trains); list each setting once")
        if model in seen:
            raise ValueError(f"{source}: {seen[model][0].label!r} and {configuration.label!r} are the same "
                             "configuration once the family's defaults are applied (it would be trained twice); list "
                             "it once")
        seen[model] = (configuration, number)
    designs = parse_designs(values.get("factorial"), spec.configurations,
                            lambda configuration, key: configuration_value(spec, configuration, key), source)
    registered = parse_preregistered(values.get("preregistered"), spec.configurations,
                                     lambda entry, where: _entry(entry, default_streams, where), source)
    spec = dataclasses.replace(spec, factorial=designs, preregistered=registered)
    if train.get("init_from"):
        _check_init_from(str(train["init_from"]), spec.configurations, source)
    return spec


def _settings(value: Any, source: str) -> list[tuple[tuple[tuple[str, Any], ...], tuple[int, ...] | None]]:
    """The ``settings:`` list as ``(key, value)`` tuples (``model_overrides`` flattened to
    ``model_overrides.KEY``), each with its own seeds (None: the study's); one empty tuple when none are given.
    ValueError naming the entry for a key the grid sets, a mapping that is not one, or a settings entry given twice;
    values are checked by the runs' TrainConfig."""
    if value is None:
        return [((), None)]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{source}: 'settings' must be a non-empty list of mappings of TrainConfig keys, e.g. "
                         f"[{{weight_decay_on: matrices}}, {{weight_decay_on: all}}]; got {value!r}")
    out: list[tuple[tuple[str, Any], ...]] = []
    for index, entry in enumerate(value):
        where = f"{source}: settings[{index}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping of TrainConfig keys, got {entry!r}")
        seeds = _seeds(entry["seeds"], f"{where} seeds") if "seeds" in entry else None
        entry = {key: setting for key, setting in entry.items() if key != "seeds"}
        fixed = sorted(set(entry) & set(GRID_KEYS))
        if fixed:
            raise ValueError(f"{where} sets {fixed}, which the grid sets for every run (families, n_streams, "
                             "--out); list families under 'families' instead")
        pairs: list[tuple[str, Any]] = []
        for key, setting in entry.items():
            if key == MODEL_OVERRIDES:
                if not isinstance(setting, dict) or not setting:
                    raise ValueError(f"{where}: {MODEL_OVERRIDES} must be a non-empty mapping of ModelConfig keys, "
                                     f"got {setting!r}")
                pairs += [(f"{MODEL_OVERRIDES}.{k}", v) for k, v in setting.items()]
            else:
                pairs.append((str(key), setting))
        for earlier, (pairs_before, _) in enumerate(out):
            if sorted(pairs, key=repr) == sorted(pairs_before, key=repr):
                raise ValueError(f"{where} repeats settings[{earlier}]: {entry!r}; list each setting once")
        out.append((tuple(pairs), seeds))
    return out


def configuration_value(spec: StudySpec, configuration: Configuration, key: str) -> Any:
    """What ``configuration`` trains with for ``key`` (a factorial design's factor): ``family``, ``n_streams``, a
    family or connection option (its default filled in), ``model_overrides.KEY`` (the model's value) or a
    TrainConfig key; KeyError when it is none of those."""
    config = spec.run_config(configuration, spec.seeds[0], "unused")
    if key == "family":
        return config.family
    if key == "n_streams":
        return config.n_streams
    if key.startswith(f"{MODEL_OVERRIDES}."):
        return getattr(config.model_config(), _short(key))
    family_options = _option_defaults(config.family)
    family_options.update(config.family_options)
    if key in family_options:
        return family_options[key]
    if key in config.to_dict():
        return getattr(config, key)
    raise KeyError(key)


def _option_defaults(family: str) -> dict[str, Any]:
    """The options ``family`` takes with their defaults, the connection's own (:data:`CONNECTION_DEFAULTS`) among
    them; none for a form that takes none (the residual)."""
    return {**CONNECTION_DEFAULTS, **options(family)} if forms.get(family).allowed_options() else {}


def _model_key(config: TrainConfig) -> tuple:
    """What tells two grid points' models apart: family, streams and every option with the family's and the
    connection's defaults filled in (``s2hc`` and ``s2hc:rotation=cayley`` are one model), values as checked
    (``alpha=1e-2``, a string in YAML 1.1, is 0.01)."""
    defaults = _option_defaults(config.family)
    effective = {**defaults, **config.family_options}
    return config.family, config.n_streams, tuple(sorted((k, repr(v)) for k, v in effective.items()))


def _training_key(config: TrainConfig) -> str:
    """What tells two grid points' training apart besides the family and its options (:func:`_model_key`): every
    other setting as the run resolves it (``lr: 1e-3`` and ``lr: 0.001``, a value equal to ``train:``'s or to the
    default, keys in any order are one setting) and the model it builds; the seed, the run directory and what
    only shows (:func:`~s2hc.config.shown_fields`: ``logger: csv`` and ``logger: tensorboard`` train one model)
    aside."""
    # the last two: in the model, resolved; the shown fields (the loggers, the bar) change what a run shows, not what
    # it trains: two settings that differ only there would train the same model twice
    aside = ("seed", "out", "family_options", MODEL_OVERRIDES, *shown_fields())
    settings = {k: v for k, v in config.to_dict().items() if k not in aside}
    model = {k: v for k, v in config.model_config().to_dict().items() if k != "family_options"}
    return json.dumps({"train": settings, "model": model}, sort_keys=True, default=repr)


def _check_init_from(path: str, configurations: tuple[Configuration, ...], source: str) -> None:
    """Every configuration can start from the run ``path`` (``train: {init_from: ...}``): it exists, and a
    residual source is upcycled only into families that keep its function; another source starts only its own
    family. ValueError naming the configuration."""
    try:
        stored = load_checkpoint(path, with_model=False).config
    except ValueError as error:
        raise ValueError(f"{source}: train.init_from {path!r} cannot be read ({error}); train that run first") from None
    for configuration in configurations:
        argument = f"{source}: {configuration.label}: family (from a residual run)"
        if not upcycles(stored["family"], configuration.family, argument) and configuration.family != stored["family"]:
            raise ValueError(f"{source}: {configuration.label}: init_from {path!r} holds a {stored['family']!r} "
                             f"model; only its own family or, from a residual run, an upcyclable one can start there")


def load_spec(path: str | Path, overrides: list[str] = ()) -> StudySpec:
    """:func:`parse_spec` of the YAML file ``path``."""
    return parse_spec(load_yaml_config(path), overrides, source=str(path))
