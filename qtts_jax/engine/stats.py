"""The snapshot the engine publishes after every iteration, so that admission and metrics never read its slots
or queue."""

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
