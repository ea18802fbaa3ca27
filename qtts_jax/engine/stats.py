"""The snapshot the engine publishes after every iteration, so that admission and metrics never read its slots
or queue."""

from __future__ import annotations

import dataclasses

from qtts_jax.engine.config import rung


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """What the engine publishes after every iteration (under its lock) for admission and metrics."""

    slots: int
    live: int  # streams holding a slot
    queued: int  # requests waiting for one
    oldest_wait_s: float  # how long the first of them has waited
    frames_left: tuple[int, ...]  # per stream in a slot: frames it may still produce (0 once its LM is done)
    queued_frames: tuple[int, ...]  # per waiting request: its frame cap
    ladder: tuple[int, ...]
    prefill_sizes: tuple[int, ...]
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

    def step_cost(self, live: int, frames: int) -> float:
        return self.step_costs[(rung(self.ladder, max(live, 1)), frames)]

    def first_cost(self, newcomers: int) -> float:
        return self.first_costs[rung(self.ladder, max(newcomers, 1))]

    def prefill_cost(self, requests: int) -> float:
        """Prefilling `requests` together: full calls of the largest size, then one for the rest."""
        top = self.prefill_sizes[-1]
        full, rest = divmod(max(requests, 1), top)
        return full * self.prefill_costs[top] + (self.prefill_costs[rung(self.prefill_sizes, rest)] if rest else 0.0)
