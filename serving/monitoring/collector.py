"""Python's garbage collector and the server. A pass holds the GIL, and with it the engine loop and the event loop: a
long one is a stall for every playing stream. Full passes scanned startup's objects (the model, JAX's and the
libraries' own) every time, about 80 ms under load; a serving process freezes them once warm (`freeze_startup`),
and full passes then took 16-23 ms (bench/host_serving.py at 60 rps). How long each pass holds the process is
timed, one timer per process whatever number of apps it serves, and each app's registry exports it as the
histogram `qtts_gc_pause_seconds{generation}` beside `qtts_gc_frozen_objects` and the objects the passes freed,
`qtts_gc_collected_objects_total{generation}`: a long pass over few live objects is one that freed much garbage."""

from __future__ import annotations

import bisect
import gc
import itertools
import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


class Pauses:
    """Counts of passes per generation and duration bucket, their total time and the objects they freed (a
    `gc.callbacks` entry)."""

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self._started = 0.0
        self.counts = [[0] * (len(BUCKETS) + 1) for _ in range(3)]  # the last: over the largest bucket
        self.seconds = [0.0] * 3
        self.collected = [0] * 3

    def __call__(self, phase: str, info: dict) -> None:
        now = self._clock()
        if phase == "start":
            self._started = now
            return
        pause, generation = now - self._started, info["generation"]
        self.seconds[generation] += pause
        self.collected[generation] += info.get("collected", 0)
        self.counts[generation][bisect.bisect_left(BUCKETS, pause)] += 1


_pauses: Pauses | None = None


def pauses() -> Pauses:
    """The process's timer, installed on first use."""
    global _pauses
    if _pauses is None:
        _pauses = Pauses()
        gc.callbacks.append(_pauses)
    return _pauses


def freeze_startup() -> None:
    """Collect once, then move every object alive into the collector's permanent generation, which its passes never
    scan. For a process's entry point once its server is warm, and again once the engine's background warm-up has
    compiled the larger rungs (`Engine.on_compiled`: with only the first stage's objects frozen, the passes under
    load still held the process for tens of ms): a process that hosts app after app (the tests) would keep each
    one's objects for ever."""
    gc.collect()
    gc.freeze()


class PauseCollector:
    """A prometheus-client collector of the process's timer and frozen objects (register one per app registry)."""

    def __init__(self, timer: Pauses | None = None):
        self.pauses = timer if timer is not None else pauses()  # a timer of its own reports only what it was fed

    def collect(self):
        family = HistogramMetricFamily("qtts_gc_pause_seconds", "Garbage-collector passes by generation: each holds "
                                       "the GIL, and with it the engine loop", labels=["generation"])
        for generation, counts in enumerate(self.pauses.counts):
            cumulative = list(itertools.accumulate(counts))
            buckets = [(f"{b:g}", c) for b, c in zip(BUCKETS, cumulative)] + [("+Inf", cumulative[-1])]
            family.add_metric([str(generation)], buckets, self.pauses.seconds[generation])
        yield family
        freed = CounterMetricFamily("qtts_gc_collected_objects", "Objects the garbage collector's passes freed, by "
                                    "generation", labels=["generation"])
        for generation, n in enumerate(self.pauses.collected):
            freed.add_metric([str(generation)], n)
        yield freed
        yield GaugeMetricFamily("qtts_gc_frozen_objects", "Objects frozen out of the collector's passes (startup's, "
                                "once warm)", value=gc.get_freeze_count())
