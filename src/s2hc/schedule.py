"""The learning-rate schedules: the rate of every optimizer step, from a run's settings alone.

Every schedule starts with a linear warmup to the peak ``lr`` over ``warmup_steps`` and spans ``schedule_steps``
(else ``max_steps``; a resume to more steps keeps the run's span, so its rate never jumps), after which it holds
its last rate (``TrainConfig.lr_schedule``):

- ``"cosine"`` (the default): a cosine decay from the peak to ``min_lr_ratio × lr`` over the rest of the span.
- ``"wsd"``, warmup-stable-decay (the trapezoid of MiniCPM and torchtitan): the peak held, then a linear decay
  over the last ``decay_fraction`` of the span (:data:`DEFAULT_DECAY_FRACTION`), whose last step runs at
  ``min_lr_ratio × lr``.
- ``"constant"``: the peak held after the warmup, for ever (the span and the floor do not apply).

:func:`span_and_warmup` says how many steps the schedule spans and warms up when ``schedule_steps`` and
``warmup_steps`` are left unset; :func:`learning_rate` gives the rate of a 0-based step. Nothing here reads a
TrainConfig: :mod:`s2hc.config` checks the settings, the training loop asks the rate of each step.

>>> [round(learning_rate(s, peak=1.0, warmup_steps=2, max_steps=10, min_ratio=0.1, kind="wsd"), 2) for s in range(11)]
[0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.55, 0.1, 0.1]
"""

from __future__ import annotations

import math

#: The schedules ``lr_schedule`` names.
SCHEDULES = ("cosine", "wsd", "constant")
#: The share of the span a ``wsd`` schedule decays over when ``decay_fraction`` is unset: its last fifth, the
#: cooldown that matches a cosine's loss at that length (Hägele et al., 2024).
DEFAULT_DECAY_FRACTION = 0.2
#: The default warmup (``warmup_steps`` unset): a tenth of the schedule, at most this many steps, so that a short run
#: warms up for a tenth of itself and a long one for as long as s2hc's fixed default did (100 steps).
MAX_DEFAULT_WARMUP = 100


def span_and_warmup(max_steps: int, schedule_steps: int | None, warmup_steps: int | None) -> tuple[int, int]:
    """``(steps the schedule spans, warmup steps)``: ``schedule_steps`` else ``max_steps``; ``warmup_steps`` else a
    tenth of that span, at most :data:`MAX_DEFAULT_WARMUP`."""
    span = max_steps if schedule_steps is None else schedule_steps
    return span, min(MAX_DEFAULT_WARMUP, span // 10) if warmup_steps is None else warmup_steps


def decay_start(span: int, warmup_steps: int, decay_fraction: float | None) -> int:
    """The first step (0-based) of a ``wsd`` schedule's decay: the last ``decay_fraction`` of the span (rounded to
    whole steps, at least one), never before the warmup ends."""
    fraction = DEFAULT_DECAY_FRACTION if decay_fraction is None else decay_fraction
    return max(warmup_steps, span - max(1, round(fraction * span)))


def learning_rate(step: int, *, peak: float, warmup_steps: int, max_steps: int, min_ratio: float,
                  kind: str = "cosine", decay_fraction: float | None = None) -> float:
    """The rate for optimizer step ``step`` (0-based) of the schedule ``kind`` (:data:`SCHEDULES`): linear warmup
    to ``peak`` over ``warmup_steps``, then ``cosine`` decay to ``min_ratio × peak`` at ``max_steps`` (the steps
    the schedule spans: a run's ``TrainConfig.schedule_span``, which a resume to more steps keeps), ``wsd`` (the
    peak, then a linear decay over the last ``decay_fraction`` of the span, reaching that floor on its last step)
    or ``constant`` (the peak); after ``max_steps`` the floor (``constant``: the peak)."""
    if kind not in SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {list(SCHEDULES)}, got {kind!r}")
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if kind == "constant":
        return peak
    floor = min_ratio * peak
    if step >= max_steps:
        return floor
    if kind == "wsd":
        start = decay_start(max_steps, warmup_steps, decay_fraction)
        if step < start:
            return peak
        return peak - (peak - floor) * (step - start + 1) / (max_steps - start)  # the span's last step: the floor
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def warmup_warnings(max_steps: int, warmup_steps: int | None, lr: float) -> list[str]:
    """What in the warmup is probably not meant (one line each): a warmup as long as the run, whose learning rate
    then rises throughout and never decays (nor, when longer, reaches ``lr``). The default warmup (a tenth of the
    schedule) never is."""
    if warmup_steps is None or warmup_steps < max_steps:
        return []
    if warmup_steps == max_steps:
        effect = f"reaches lr={lr:g} only at its last step and never decays"
    else:
        effect = f"reaches {lr * max_steps / warmup_steps:.3g}, {max_steps / warmup_steps:.0%} of lr={lr:g}"
    tenth = f" (a tenth of the run would be {max_steps // 10})" if max_steps >= 10 else ""
    return [f"warmup_steps={warmup_steps} is not below max_steps={max_steps}: the learning rate rises for the whole "
            f"run and {effect}; lower warmup_steps{tenth}"]
