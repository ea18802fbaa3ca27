"""An iteration's codec call: which streams' frames it decodes and how many, dispatched right behind the step; and,
once the sender thread has handed its audio out, what that settles (`engine` below: a `core.Engine`; this module
imports nothing of the loop's)."""

from __future__ import annotations

import numpy as np

from qtts_jax.engine import measurements
from qtts_jax.engine.handout import HandOut
from qtts_jax.engine.plan import codec_call
from qtts_jax.engine.stream import Stream


def decode_audio(engine, now: float, coming: dict[Stream, int], step: int | None,
                 held: frozenset[Stream] = frozenset()) -> HandOut | None:
    """Hand every stream's due frames (`plan.codec_call`: below its lead, all it has; past it, its schedule's next
    size) to ONE codec call, each row with its own frame count. `coming` are the streams whose frames are being
    made by the step queued ahead of this call, and how many: they count as made (a stream that ends early makes
    fewer; `bookkeeping.settle_audio` corrects the counts once the step is read). While a stream below its lead
    waits on it, the call is no wider than the codec chunk that the cost of a step of `step` frames counts (the
    calibration's), so it ends when the step planner said. `held`: newcomers whose first frame waited for this
    step (`IterationPlan.held`): their first chunk is every frame they have, up to the codec's largest chunk."""
    e, c = engine, engine.config
    waiting = [s for s in e.slots if s is not None and s.pending + coming.get(s, 0) > 0]
    if not waiting:
        return None
    call = codec_call(
        pending=np.array([s.pending + coming.get(s, 0) for s in waiting]),
        want=np.array([min(s.pending + coming.get(s, 0), max(e.sizes.codec)) if s in held
                       else s.next_chunk_frames() for s in waiting]),
        lm_done=np.array([s.lm_done or s.waiting_text for s in waiting]),  # none coming soon: all out
        # a listener that ran dry waiting for live text gets what there is at once, as one below its lead
        headroom=np.array([0.0 if s.resumes else np.nan if (h := s.buffered(now)) is None else h for s in waiting]),
        lead_s=c.lead_s, horizon_s=e._iteration_s + e._delivery_s + e._margin_s,
        ladder=e.sizes.ladder, codec_sizes=e.sizes.codec, step=step)
    if call is None:
        return None
    due = [(waiting[j], f) for j, f in zip(call.rows, call.counts)]
    b, n = call.rung, call.frames
    idx = np.full(b, c.slots, np.int32)
    fresh = np.zeros(b, bool)
    start, count = np.zeros(b, np.int32), np.zeros(b, np.int32)
    for j, (s, f) in enumerate(due):
        idx[j], fresh[j], start[j], count[j] = s.slot, s.fresh_codec, s.decoded, f
        s.fresh_codec = False
        s.decoded += f
        s.pending -= f
        s.inflight = f
    return HandOut(e.runner.codec(idx, fresh, start, count, n), due, (b, n))


def settle_handout(engine, t0: float, shape: tuple[int, int], due: list, now: float, late: int) -> None:
    """After `handout.send_audio`: streams with nothing left finish; how long after the iteration's start `t0` the
    audio of a codec call of `shape` went out is measured (`measurements.delivery`)."""
    measurements.delivery(engine, shape, now - t0)
    engine.late_chunks += late
    for s, _ in due:
        s.inflight = 0
        if not s.finished and s.lm_done and s.pending == 0:
            engine._finish(s)
