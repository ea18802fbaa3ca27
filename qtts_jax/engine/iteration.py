"""One iteration's device half: its plan dispatched through the runner (`execute`), and what comes back read in
the order that keeps host work overlapping the device's (`update`).

What `execute` leaves in flight is an `IterationResult`: outputs not yet read and the sender thread's work not yet
done (`engine` below: a `core.Engine`; this module imports nothing of the loop's)."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import numpy as np

from qtts_jax.engine import measurements
from qtts_jax.engine.bookkeeping import record, settle_audio, take_first
from qtts_jax.engine.decoding import decode_audio, settle_handout
from qtts_jax.engine.handout import HandOut, send_first, stamp_prefilled
from qtts_jax.engine.plan import IterationPlan
from qtts_jax.engine.profile import PartTimer
from qtts_jax.engine.runner import StepOutcome
from qtts_jax.engine.stream import Stream


@dataclasses.dataclass(frozen=True)
class IterationResult:
    """An executed plan, in flight: the newcomers and the step's rows as streams (the plan names them by
    position), the step's outcome, and the sender thread's work started for this iteration (the previous codec
    call's hand-out, the newcomers' prefill stamp and their first chunks)."""

    new: list[Stream]
    stepping: list[Stream]
    held: frozenset[Stream]  # newcomers whose one-frame first chunk waits for the step's frames
    limits: np.ndarray  # per step row: the most frames it may make
    step: StepOutcome | None
    handed: concurrent.futures.Future | None
    prefilled: concurrent.futures.Future | None
    first: concurrent.futures.Future | None


def execute(engine, plan: IterationPlan, candidates: list[Stream], new: list[Stream], joined: list[Stream],
            prefill_done, handing, parts: PartTimer) -> IterationResult:
    """Dispatch the plan's device calls after its prefills (`admission.admit` dispatched those, so the device starts
    while the host plans): the newcomers' first-frame program, then the step. Between the two, the sender thread is
    given the newcomers' prefill stamp and first chunks, so they go out as the device finishes them while this
    thread is held by the step's dispatch. The codec call is not here: which frames it decodes depends on the
    newcomers' first frames, read back in `update`."""
    e = engine
    first = None
    if new:  # their first frame and its audio (one program), ahead of the step
        idx, mask = rows(new, plan.first_rung, e.config.slots)
        fresh, decode = np.zeros(plan.first_rung, bool), np.zeros(plan.first_rung, bool)
        fresh[: len(new)], decode[: len(new)] = [s.fresh_codec for s in new], plan.decode_first
        first = e.runner.first(idx, mask, fresh, decode), decode[: len(new)]
    stamping = None if prefill_done is None else e.sender.submit(stamp_prefilled, e.clock, joined, prefill_done)
    sending = e.sender.submit(send_first, e.clock, new, *first) if first is not None else None
    parts.mark("dispatch")
    stepping = [candidates[j] for j in plan.step_rows]
    limits, out = np.array(plan.limits, np.int32), None
    if plan.step is not None:
        idx, _ = rows(stepping, plan.step_rung, e.config.slots)
        out = e.runner.step(idx, np.pad(limits, (0, plan.step_rung - len(stepping))), plan.step.frames)
    parts.mark("dispatch")
    held = frozenset(s for s, h in zip(new, plan.held) if h)
    return IterationResult(new, stepping, held, limits, out, handing, stamping, sending)


def update(engine, plan: IterationPlan, result: IterationResult, t0: float, ahead: tuple[int, int] | None,
           compiled: int, parts: PartTimer) -> HandOut | None:
    """Take back what `execute` left in flight: the previous hand-out's bookkeeping, the newcomers' first frames,
    then the codec call queued right behind the step (counting on the frames the step makes: it reads them where
    the step writes them), and last the step's outputs, the one host sync per step. Returns that codec call: the
    sender hands its audio out at the next iteration's start."""
    e = engine
    if result.prefilled is not None:
        result.prefilled.result()
    if result.handed is not None:
        settle_handout(e, t0, ahead, *result.handed.result())
        parts.mark("hand_out")
    if result.first is not None:
        first = result.first.result()
        if ahead is not None and e.runner.compiled_on_demand == compiled:
            measurements.first_late(e, ahead, first[2] - t0 - plan.extra_s)  # what the planner counts on
        take_first(result.new, *first, e._finish)
        parts.mark("first")
    step = plan.step
    coming = {} if step is None else {s: int(f) for s, f in zip(result.stepping, result.limits) if not s.lm_done}
    handout = decode_audio(e, e.clock(), coming, None if step is None else step.frames, result.held)
    parts.mark("codec_dispatch")
    if result.step is not None:
        frames, valid = np.asarray(result.step.frames), np.asarray(result.step.valid)
        parts.mark("device_wait")
        now = e.clock()
        e._recent_frame_s.append((now - t0) / step.frames)
        record(result.stepping, frames, valid, now, e._finish, result.limits)
        if handout is not None:
            settle_audio(handout)
    parts.mark("bookkeeping")
    return handout


def rows(streams: list[Stream], b: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Slot indices of a call of `b` rows (padding aimed past the last of the `slots`) and which rows are live."""
    idx = np.full(b, slots, np.int32)
    idx[: len(streams)] = [s.slot for s in streams]
    mask = np.zeros(b, bool)
    mask[: len(streams)] = True
    return idx, mask
