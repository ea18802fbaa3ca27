"""The snapshot the engine publishes after every iteration, so that admission and metrics never read its slots
or queue, and how it is built from the engine's streams and measurements (`engine` below: a `core.Engine`, read
under its lock; this module imports nothing of the loop's)."""

from __future__ import annotations

import dataclasses

from qtts_jax.engine.costs import Costs


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """What the engine publishes after every iteration (under its lock) for admission and metrics."""

    slots: int  # streams it holds at most now: every slot, once a background warm-up has compiled every rung
    live: int  # streams holding a slot
    queued: int  # requests waiting for one
    oldest_wait_s: float  # how long the first of them has waited
    frames_left: tuple[int, ...]  # per stream in a slot: frames it may still produce (0 once its LM is done)
    queued_frames: tuple[int, ...]  # per waiting request: its frame cap
    ladder: tuple[int, ...]
    step_sizes: tuple[int, ...]  # frames a step call may run
    headroom_margin_s: float  # headroom the loop keeps in hand beyond an iteration's predicted cost (measured)
    step_costs: dict  # (rung, frames) -> seconds of one iteration stepping that many frames (step + codec)
    prefill_costs: dict  # requests per call -> seconds (largest prompt bucket)
    first_costs: dict  # rung -> seconds of newcomers' first frame and its audio
    iteration_s: float  # recent iteration time (EMA)
    min_headroom_s: float | None  # least playback headroom among playing streams
    iterations: int
    recent_frame_s: tuple[float, ...]  # seconds per frame of recent step calls (for histograms)
    lead_s: float = 1.0  # the playback lead each stream builds
    late_chunks: int = 0  # chunks the engine handed out after its stream's listener ran dry, since start
    delivery_s: float = 0.0  # from an iteration's start to the previous iteration's audio going out (measured)
    # how much later than their prefill and first frame newcomers' first audio goes out behind a codec call (the
    # least over the calls' shapes measured: admission does not know which call a newcomer will wait behind)
    first_late_s: float = 0.0
    compiling: int = 0  # programs a background warm-up has still to compile and time (the slots grow after them)
    # the `Stream.id` of each entry of `frames_left` and of `queued_frames`, in their order: admission finds a long
    # input's part in flight by it
    live_ids: tuple[int, ...] = ()
    queued_ids: tuple[int, ...] = ()

    @property
    def costs(self) -> Costs:
        """The published costs as the cost model reads them (one delivery delay for every codec call's shape)."""
        return Costs(self.step_costs, self.prefill_costs, self.first_costs, self.ladder, self.delivery_s)


def snapshot(engine) -> EngineStats:
    """The engine's streams, sizes and measurements now (called under its lock)."""
    e, now = engine, engine.clock()
    headrooms = [h for s in e.slots if s is not None and (h := s.buffered(now)) is not None and not s.lm_done
                 and not s.waiting_text]
    return EngineStats(
        **occupancy(e, now), **sizes(e), headroom_margin_s=e._margin_s, lead_s=e.config.lead_s,
        late_chunks=e.late_chunks, step_costs=dict(e.step_costs), prefill_costs=dict(e.prefill_costs),
        first_costs=dict(e.first_costs), iteration_s=e._iteration_s,
        min_headroom_s=min(headrooms) if headrooms else None,
        iterations=e.iterations, recent_frame_s=tuple(e._recent_frame_s), delivery_s=e._delivery_s,
        first_late_s=min(e._late.values(), default=0.0),
    )


def occupancy(engine, now: float) -> dict:
    """The fields of the streams in slots and the queue, read together (under the engine's lock), so that their
    counts and frames agree."""
    in_slots = [s for s in engine.slots if s is not None]
    queued = list(engine.queue)
    # per stream in a slot: frames it may still produce (0 once its LM is done)
    left = tuple(0 if s.lm_done else max(s.frames_cap - len(s.codes), 0) for s in in_slots)
    return dict(live=len(in_slots), frames_left=left, queued=len(queued),
                queued_frames=tuple(s.frames_cap for s in queued), live_ids=tuple(s.id for s in in_slots),
                queued_ids=tuple(s.id for s in queued),
                oldest_wait_s=now - queued[0].timings.submitted if queued else 0.0)


def sizes(engine) -> dict:
    """The fields a background warm-up changes (read under the engine's lock, which it takes to change them)."""
    s = engine.sizes
    return dict(slots=max(s.ladder), ladder=s.ladder, step_sizes=s.step,
                compiling=engine._compiling)
