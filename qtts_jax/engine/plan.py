"""One iteration's plan: what the loop will run on the device, decided from numbers before it dispatches anything.

The functions here compose the scheduler's rules (`scheduler`) over the cost model (`costs`) for the streams the
loop holds, reduced to numbers: how many waiting requests start, the prefill calls they go in, which newcomers
decode their first frame in their own program, and the step's rows, per-row frame limits and frames. The loop
executes the plan through the runner's calls and records what comes back. The codec call (`codec_call`) is decided
later in the iteration: it counts the newcomers' first frames, which are read from the device first.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from qtts_jax.engine.config import EngineConfig, rung
from qtts_jax.engine.costs import Costs
from qtts_jax.engine.scheduler import StepPlan, chunks_due, first_chunk_alone, newcomers_that_fit, step_frames
from qtts_jax.engine.stream import FRAME_SECONDS


@dataclasses.dataclass(frozen=True)
class PrefillCall:
    """One prefill call: the newcomers at `rows` (positions among those admitted), all of one prompt `bucket`, in a
    call compiled for `size` requests (padded)."""

    bucket: int
    rows: tuple[int, ...]
    size: int


@dataclasses.dataclass(frozen=True)
class IterationPlan:
    """What one iteration runs, in order: the prefills, the newcomers' first-frame program, then the step."""

    prefills: tuple[PrefillCall, ...]
    first_rung: int  # rows of the first-frame program (0: no newcomer)
    decode_first: tuple[bool, ...]  # per newcomer: its first frame is decoded in that program (goes out alone)
    held: tuple[bool, ...]  # per newcomer: its one-frame first chunk waits for the step's frames instead
    step_rows: tuple[int, ...]  # positions among the candidates (the playing streams, then the newcomers)
    step_rung: int
    limits: tuple[int, ...]  # per step row: the most frames it may make (its live text may end sooner)
    step: StepPlan | None  # the step's frames and the iteration's predicted seconds (None: no step)
    extra_s: float  # the newcomers' prefill and first frame, predicted: they run ahead of the step


@dataclasses.dataclass(frozen=True)
class CodecCall:
    """One codec call: the streams at `rows` (positions among those with frames waiting) decode `counts` frames
    each, in a call of `rung` rows and `frames` frames (padded)."""

    rows: tuple[int, ...]
    counts: tuple[int, ...]
    rung: int
    frames: int


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The compiled sizes the loop may use now (a background warm-up adds to them)."""

    ladder: tuple[int, ...]
    first: tuple[int, ...]
    step: tuple[int, ...]
    codec: tuple[int, ...]
    prefill: tuple[int, ...]


def admissions(waiting: int, min_headroom_s: float | None, live: int, costs: Costs, margin_s: float) -> int:
    """How many of `waiting` requests start now: `scheduler.newcomers_that_fit`, each m newcomers' prefill and first
    frame then a one-frame step of the `live` rows and m, against the least headroom of the streams with audio out.
    All of them when nothing is timed yet (no costs to judge by)."""
    if not waiting or not costs.steps:
        return waiting
    return newcomers_that_fit(waiting, min_headroom_s, margin_s,
                              lambda m: costs.newcomers(m, m) + costs.until_audio(live + m, 1))


def prefills(buckets: list[int], costs: Costs, sizes: tuple[int, ...]) -> tuple[PrefillCall, ...]:
    """The prefill calls of the newcomers whose prompt buckets are `buckets`: one group per bucket, each split into
    the calls the cost model finds cheapest (`Costs.prefill_split`)."""
    groups = collections.defaultdict(list)
    for j, bucket in enumerate(buckets):
        groups[bucket].append(j)
    calls = []
    for bucket, rows in groups.items():
        at = 0
        for size in costs.prefill_split(sizes, len(rows)):
            part = tuple(rows[at : at + size])
            at += size
            calls.append(PrefillCall(bucket, part, rung(sizes, len(part))))
    return tuple(calls)


def schedule(calls: tuple[PrefillCall, ...], headroom: np.ndarray, new_next: np.ndarray,
             allowed: list[int | None], costs: Costs, sizes: Sizes, config: EngineConfig, margin_s: float,
             first_late_s: float) -> IterationPlan:
    """The iteration's plan from numbers: `calls` the newcomers' prefills; `headroom` the playing streams' audio in
    hand (those with audio out); `new_next` each newcomer's next chunk in frames; `allowed` per candidate (the
    playing streams, then the newcomers) the frames its text allows this step (None: no limit; a newcomer's
    counts its first frame out); `first_late_s` how much later than their programs newcomers' first audio goes
    out (measured behind the codec call ahead of them). A newcomer whose first chunk is one frame decodes it in its
    own program, so it goes out ahead of the step, only while its next audio can follow before that frame has
    played (`scheduler.first_chunk_alone`); else it is held for the step's frames: an admitted stream never runs
    dry 80 ms into its audio because the engine is loaded."""
    new = len(new_next)
    rows = len(allowed)
    one = np.asarray(new_next) == 1
    alone = bool(new) and first_chunk_alone(costs.until_audio(rows, min(sizes.step)), first_late_s, margin_s)
    decode = one & alone
    extra = costs.newcomers(sum(len(c.rows) for c in calls), new)
    stepping = tuple(j for j, a in enumerate(allowed) if a is None or a > 0)
    step, limits = None, ()
    if stepping:
        b = rung(sizes.ladder, rows)
        step_costs = {n: costs.step(b, n) for n in sizes.step}
        delivery = {n: costs.delivery_after(b, n) for n in step_costs}
        step = step_frames(step_costs, headroom, FRAME_SECONDS if decode.any() else None, extra, margin_s,
                           config.max_step_s, delivery, first_late_s)
        limits = tuple(step.frames if allowed[j] is None else min(step.frames, allowed[j]) for j in stepping)
    return IterationPlan(
        prefills=calls, first_rung=rung(sizes.first, new) if new else 0, decode_first=tuple(decode.tolist()),
        held=tuple((one & ~alone).tolist()), step_rows=stepping,
        step_rung=rung(sizes.ladder, len(stepping)) if stepping else 0, limits=limits, step=step, extra_s=extra)


def codec_call(pending: np.ndarray, want: np.ndarray, lm_done: np.ndarray, headroom: np.ndarray, lead_s: float,
               horizon_s: float, ladder: tuple[int, ...], codec_sizes: tuple[int, ...],
               step: int | None) -> CodecCall | None:
    """The codec call of the streams with frames waiting (`scheduler.chunks_due` over their numbers); while one
    below its lead waits on a step of `step` frames, no wider than the codec chunk that step's cost counts.
    None when no chunk is due."""
    counts = chunks_due(pending=pending, want=want, lm_done=lm_done, headroom=headroom, lead_s=lead_s,
                        horizon_s=horizon_s, most=max(codec_sizes),
                        width=None if step is None else rung(codec_sizes, step))
    rows = tuple(j for j, f in enumerate(counts) if f)
    if not rows:
        return None
    return CodecCall(rows, tuple(int(counts[j]) for j in rows), rung(ladder, len(rows)),
                     rung(codec_sizes, max(int(counts[j]) for j in rows)))
