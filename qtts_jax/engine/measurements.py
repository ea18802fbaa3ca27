"""What the loop measures as it runs, and how each measurement feeds its plans: the cost of a step iteration per
(rung, frames), how long after an iteration's start its audio goes out, how late newcomers' first audio goes out
behind a codec call, and the lateness beyond plan that the margin covers (`scheduler.Jitter`).

The tables live on the engine (`engine` below: a `core.Engine`; the warm-up seeds them and the stats snapshot
reads them); this module only starts, updates and forgets them, and imports nothing of the loop's."""

from __future__ import annotations

import collections

from qtts_jax.engine.costs import Costs
from qtts_jax.engine.scheduler import Jitter


def ema(old: float | None, new: float) -> float:
    """The loop's running averages of what it measures: `new` alone when nothing was measured before."""
    return new if old is None else 0.8 * old + 0.2 * new


def start(engine) -> None:
    """The engine's tables, empty: a warm-up seeds the costs, the iterations measure the rest."""
    e = engine
    e.step_costs = {}  # (rung, frames) -> seconds per iteration, measured
    e.idle_step_costs = {}  # the same, as the warm-up timed them on the idle engine
    e.prefill_costs = {}  # requests -> seconds, measured
    e.first_costs = {}  # rung -> seconds of newcomers' first frame and its audio, measured
    e._recent_frame_s = collections.deque(maxlen=64)
    e.late_chunks = 0  # chunks handed out after their stream's listener ran dry
    forget(e)
    e._margin_s = e.config.min_margin_s  # this iteration's margin, read once from `jitter`


def forget(engine) -> None:
    """Drop the measured iteration time, delivery delays and jitter (a new clock): the next iterations measure them
    anew."""
    e = engine
    e._iteration_s = 0.0
    e._delivery_s = 0.0  # iteration start -> the previous iteration's audio handed out (EMA)
    # the same by the shape (rows, frames) of the codec call that made the audio: a wider call takes longer
    e._delivery = {}
    # newcomers' first chunks: seconds after the iteration's start + their prefill and first frame, by the shape of
    # the codec call that ran ahead of them on the device (what they wait for)
    e.first_late = {}
    # the least of each shape's recent samples, what the planner counts on: counting on it never lets a newcomer's
    # next audio come after its first has played (behind calls of one shape it varies little)
    e._late = {}
    e.jitter = Jitter(e.config.min_margin_s)  # lateness beyond plan


def costs(engine) -> Costs:
    """The cost model over what the loop has measured so far (its own tables, not copies)."""
    e = engine
    return Costs(e.step_costs, e.prefill_costs, e.first_costs, e.sizes.ladder, e._delivery_s, e._delivery,
                 e.sizes.codec)


def iteration(engine, elapsed: float, plan) -> None:
    """An iteration took `elapsed` seconds: what a step iteration really takes (host work included, the newcomers'
    predicted share not) goes to its cost, and how much longer than predicted to the jitter."""
    e, step = engine, plan.step
    e._iteration_s = ema(e._iteration_s or None, elapsed)
    if step is not None:
        e.jitter.add(elapsed - step.predicted_s)
        key = (plan.step_rung, step.frames)
        e.step_costs[key] = ema(e.step_costs.get(key), max(elapsed - plan.extra_s, 0.0))


def first_late(engine, ahead: tuple[int, int], seconds: float) -> None:
    """Newcomers' first audio went out `seconds` after their own programs, behind a codec call of shape `ahead`."""
    samples = engine.first_late.setdefault(ahead, collections.deque(maxlen=64))
    samples.append(max(seconds, 0.0))
    engine._late[ahead] = min(samples)


def delivery(engine, shape: tuple[int, int], seconds: float) -> None:
    """A codec call of `shape` had its audio out `seconds` after the iteration's start: the delay the step planner
    adds to an iteration whose codec call has that shape (its variation goes to the jitter)."""
    e = engine
    if (known := e._delivery.get(shape)) is not None:  # the first measurement sets it; later ones vary
        e.jitter.add(seconds - known)
    e._delivery[shape] = ema(known, seconds)
    e._delivery_s = ema(e._delivery_s or None, seconds)
