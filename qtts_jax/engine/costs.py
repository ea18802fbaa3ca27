"""The cost model: what a call or an iteration costs, from the engine's measured tables.

The loop's scheduler, admission and the stats snapshot all predict with these functions, so a rule for how a cost
adds up lives in one place. A cost not timed yet counts as none: only a warm-up times the prefill and first-frame
programs, and a server started without one (`Settings.warmup` off) still answers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

from qtts_jax.engine.config import rung


@dataclasses.dataclass(frozen=True)
class Costs:
    """A view of the measured tables (the engine's own dicts, or the snapshot's copies) and the sizes they are for."""

    steps: Mapping[tuple[int, int], float]  # (rung, frames) -> seconds of a step iteration (step + codec)
    prefills: Mapping[int, float]  # requests per call -> seconds (largest prompt bucket)
    firsts: Mapping[int, float]  # rung -> seconds of newcomers' first frame and its audio
    ladder: tuple[int, ...]  # the live-batch rungs in use
    delivery_s: float = 0.0  # from an iteration's end to its audio going out, over every codec call
    # the same by the (rows, frames) rungs of the codec call that made the audio; empty: `delivery_s` for all
    delivery: Mapping[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    codec_sizes: tuple[int, ...] = ()

    def step(self, rows: int, frames: int) -> float:
        """A step iteration of `frames` frames over `rows` live rows (at their rung)."""
        return self.steps.get((rung(self.ladder, max(rows, 1)), frames), 0.0)

    def delivery_after(self, rows: int, frames: int) -> float:
        """From the end of that iteration to its audio going out: its codec call is as wide as the step, and a
        wider call takes longer (until a shape is measured, the average over every call)."""
        if not self.delivery:
            return self.delivery_s
        return self.delivery.get((rung(self.ladder, rows), rung(self.codec_sizes, frames)), self.delivery_s)

    def until_audio(self, rows: int, frames: int) -> float:
        """A step iteration and the wait until its audio goes out."""
        return self.step(rows, frames) + self.delivery_after(rows, frames)

    def prefill(self, requests: int) -> float:
        """Prefilling `requests` together (largest prompt bucket), in the calls the engine makes of them."""
        if not self.prefills:
            return 0.0
        return sum(self.prefills[s] for s in prefill_calls(tuple(sorted(self.prefills.items())), requests))

    def first(self, newcomers: int) -> float:
        """Newcomers' first frames: calls of the largest first-frame rung, then one that holds the rest."""
        if not self.firsts:
            return 0.0
        return sum(self.firsts[s] for s in largest_first(tuple(sorted(self.firsts)), newcomers))

    def newcomers(self, prefilled: int, first: int) -> float:
        """Prefilling `prefilled` requests and the first-frame program of `first` newcomers, ahead of the step."""
        return (self.prefill(prefilled) if prefilled else 0.0) + (self.first(first) if first else 0.0)

    def prefill_split(self, sizes: tuple[int, ...], n: int) -> tuple[int, ...]:
        """The prefill calls `n` newcomers of one prompt bucket go in: the cheapest by the measured costs of the
        compiled `sizes`; until each is timed, calls of the largest size and one that holds the rest."""
        if all(r in self.prefills for r in sizes):
            return prefill_calls(tuple((r, self.prefills[r]) for r in sizes), n)
        return largest_first(sizes, n)

    def frame_s_with_arrivals(self, rows: int, step_sizes: tuple[int, ...], budget_s: float) -> float:
        """Seconds per frame of `rows` playing streams while a request arrives every iteration: each iteration
        prefills one and runs its first frame before a step it joins, of as many frames as can go out within
        `budget_s` (the newcomer's one frame of audio: `newcomer_budget`); the cheapest per frame of those steps."""
        sizes = [n for n in step_sizes if self.until_audio(rows, n) <= budget_s] or [1]
        return min((self.newcomers(1, 1) + self.step(rows, n)) / n for n in sizes)


def newcomer_budget(newcomer_audio_s: float, first_late_s: float, margin_s: float) -> float:
    """Seconds a step and its delivery may take for newcomers' next audio to reach them before their first chunk
    has played, less the margin (their listeners start `first_late_s` after the newcomers' own programs). The
    engine plans by it; admission predicts the engine's steps by it."""
    return newcomer_audio_s + first_late_s - margin_s


def largest_first(sizes: tuple[int, ...], n: int) -> tuple[int, ...]:
    """Calls of `n` rows (at least one) of the ascending `sizes`: full calls of the largest size, then one of the
    smallest size that holds the rest."""
    full, rest = divmod(max(n, 1), sizes[-1])
    return (sizes[-1],) * full + ((rung(sizes, rest),) if rest else ())


def prefill_calls(costs: tuple[tuple[int, float], ...], n: int) -> tuple[int, ...]:
    """The call sizes, largest first, that prefill `n` requests for the least summed cost, from `costs`: (size,
    seconds) of each compiled call size, measured. Calls of the largest size while at least that many remain, then
    the cheapest mix for the rest (fewer calls where two mixes cost the same), each call padded to its size. A call
    of few rows is launch-bound and a padded one computes its empty rows: with sizes 1, 8, 64 and 128, ten
    requests went into one call of 64, which under steady arrivals made every prefill cost a wide call's time."""
    top = max(size for size, _ in costs)
    full, rest = divmod(max(n, 1), top)
    return (top,) * full + _cheapest_mixes(costs)[rest]


@functools.lru_cache(maxsize=16)
def _cheapest_mixes(costs: tuple[tuple[int, float], ...]) -> tuple[tuple[int, ...], ...]:
    """For every count below the largest size, its cheapest mix of sizes, largest first: one table per set of
    measured costs, which change only as the warm-up times its programs, so admission, asking once per request of a
    burst, reads it rather than solving it again."""
    table = dict(costs)
    sizes = sorted(table)
    best: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]
    for m in range(1, sizes[-1]):
        best.append(min(((table[s] + best[max(m - s, 0)][0], (s,) + best[max(m - s, 0)][1]) for s in sizes),
                        key=lambda option: (option[0], len(option[1]))))
    return tuple(tuple(sorted(mix, reverse=True)) for _, mix in best)
