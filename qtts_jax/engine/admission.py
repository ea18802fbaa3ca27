"""Which waiting requests take a free slot this iteration, and their prefill calls dispatched at once, so the
device starts while the host plans the rest (`engine` below: a `core.Engine`; this module imports nothing of the
loop's)."""

from __future__ import annotations

import jax

from qtts_jax.engine import measurements
from qtts_jax.engine.plan import PrefillCall, admissions, prefills
from qtts_jax.engine.stream import Stream


def admit(engine) -> tuple[list[Stream], tuple[PrefillCall, ...], jax.Array | None]:
    """Give waiting requests free slots and prefill them together (`plan.prefills`: the cheapest calls per prompt
    bucket); as many as one first-frame program takes and the playing streams' headroom pays for
    (`plan.admissions`), the rest wait. Returns the admitted streams, their prefill calls and a small output of the
    last one to wait on (the state itself goes on to the step, donated)."""
    e = engine
    joined = []
    with e._lock:
        free = [i for i, s in enumerate(e.slots) if s is None]
        free = free[: max(e.sizes.ladder) - (len(e.slots) - len(free))]  # the rungs compiled so far
        now = e.clock()
        heads = [h for s in e.slots if s is not None and not s.waiting_text and (h := s.buffered(now)) is not None]
        limit = admissions(min(len(free), len(e.queue), max(e.sizes.first)), min(heads, default=None),
                           sum(s is not None and not s.lm_done for s in e.slots), measurements.costs(e), e._margin_s)
        while free and e.queue and len(joined) < limit:
            stream = e.queue.popleft()
            if stream.cancelled:
                e._finish(stream, error="cancelled")
                continue
            stream.slot = free.pop(0)
            joined.append(stream)
    if not joined:
        return [], (), None
    now = e.clock()
    for stream in joined:
        e.slots[stream.slot] = stream
        stream.timings.admitted = now
        voice = stream.job.request.voice
        if voice is not None and voice.ref_codes is not None:
            e.runner.load_voice(stream.slot, voice.ref_codes)
            stream.fresh_codec = False
    calls = prefills([s.job.bucket for s in joined], measurements.costs(e), e.sizes.prefill)
    done = None
    for call in calls:
        done = e.runner.prefill(call.bucket, [(joined[j].slot, joined[j].job) for j in call.rows], call.size)
    return joined, calls, done
