"""The snapshot the engine publishes after every iteration, so that admission and metrics never read its slots
or queue."""

from __future__ import annotations

import dataclasses

from qtts_jax.engine.config import rung
from qtts_jax.engine.scheduler import prefill_calls


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

    # A cost not timed yet counts as none: only a warm-up times the prefill and first-frame programs, and a server
    # started without one (QTTS_WARMUP=0) still answers (an idle server admits anyway).

    def step_cost(self, live: int, frames: int) -> float:
        return self.step_costs.get((rung(self.ladder, max(live, 1)), frames), 0.0)

    def first_cost(self, newcomers: int) -> float:
        """Newcomers' first frames: one program per iteration, of at most the largest first-frame rung each."""
        return cost_in_calls(self.first_costs, newcomers)

    def prefill_cost(self, requests: int) -> float:
        """Prefilling `requests` together (largest prompt bucket), in the calls the engine makes of them."""
        return prefill_cost(self.prefill_costs, requests)


def prefill_cost(costs: dict, n: int) -> float:
    """Cost of prefilling `n` requests in the cheapest calls of the sizes `costs` holds (size -> seconds); none
    while nothing is timed."""
    if not costs:
        return 0.0
    return sum(costs[s] for s in prefill_calls(tuple(sorted(costs.items())), n))


def largest_first(sizes: tuple[int, ...], n: int) -> tuple[int, ...]:
    """Calls of `n` rows (at least one) of the ascending `sizes`: full calls of the largest size, then one of the
    smallest size that holds the rest."""
    full, rest = divmod(max(n, 1), sizes[-1])
    return (sizes[-1],) * full + ((rung(sizes, rest),) if rest else ())


def cost_in_calls(costs: dict, n: int) -> float:
    """Cost of `n` rows through `largest_first` calls of the sizes `costs` holds (size -> seconds); none while
    nothing is timed."""
    if not costs:
        return 0.0
    return sum(costs[s] for s in largest_first(tuple(sorted(costs)), n))
