"""Where the loop's iterations spend their wall time, logged now and then: the evidence for tuning the loop."""

from __future__ import annotations

import collections
import logging
import time

log = logging.getLogger(__name__)


class PartTimer:
    """Wall time of each part of one iteration (always the real clock: tests may simulate the loop's)."""

    def __init__(self):
        self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def mark(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self.last
        self.last = now


class IterationProfile:
    """Where busy iterations spend their time, logged as means every `every_s` (the evidence for tuning the
    loop: host work that does not overlap the device shows up outside `device_wait`)."""

    def __init__(self, every_s: float = 2.0):
        self.every_s = every_s
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.since, self.iterations, self.sums = now, 0, collections.Counter()

    def add(self, parts: PartTimer, **counts: float) -> None:
        """`parts`' seconds, and `counts`: numbers averaged as they are (streams, frames, the margin in ms)."""
        self.iterations += 1
        self.sums.update(parts.seconds)
        self.sums.update({k: float(v) for k, v in counts.items()})
        now = time.perf_counter()
        if now - self.since >= self.every_s:
            mean = {k: round(v / self.iterations * (1 if k in counts else 1e3), 2) for k, v in self.sums.items()}
            log.info("iterations: %d in %.1f s; mean per iteration (ms, or count): %s", self.iterations,
                     now - self.since, mean)
            self._reset(now)

