"""A stand-in for the engine's `Runner` that runs no model: every call answers from numpy and costs what the same
call costs on the H200 (the 0.6B shape, bf16 codec, cuBLAS GEMMs: bench/results/nnx-ab-0.6b-256-h200.json,
compile-flags-0.6b-256-h200.json, kernels-codec-0.6b-256-h200.json), linear in rows between 16 and 256. With it the
engine loop, and a whole server around it, run on a CPU as they would on the GPU, less what XLA does on the host
inside a call unless asked (`RealTimeRunner(xla_host=True)`): the benchmarks that time the host's own work use it
(bench/host_loop.py, bench/host_serving.py).

Two runners: `NumpyRunner` advances a simulated clock by each call's cost (the loop's host work then takes no
simulated time at all); `RealTimeRunner` queues the calls on one simulated device that runs them one after
another, each output ready when the device has done its call (reading it earlier waits: in real time it sleeps,
releasing the GIL, as waiting on a GPU does; on a simulated `Clock` it moves the clock on, so the host and the
device overlap as they do on a GPU while the host's own work takes no time: bench/schedule_sim.py).

`scale` multiplies every cost: a slower card, or a larger model, to a first approximation."""

from __future__ import annotations

import functools
import time

import numpy as np

from qtts_jax.codec.config import SAMPLES_PER_FRAME
from qtts_jax.engine.config import EngineConfig
from qtts_jax.engine.runner import Calibration, FirstOutcome, StepOutcome


def _linear(rows: int, at16: float, at256: float) -> float:
    return at16 + (at256 - at16) * max(rows - 16, 0) / 240


def step_s(rows: int, frames: int) -> float:
    """8.8 ms at 16 rows and 13.8 at 256 per frame (one-frame steps; 4-frame steps cost 4x as much)."""
    return frames * _linear(rows, 0.0088, 0.0138)


def codec_s(rows: int, frames: int) -> float:
    """12.2 ms at 256 rows for one frame, 53.5 ms for eight (bf16); 3 ms at 16 rows."""
    return _linear(rows, 0.003, 0.0122) * (1 + 3.39 * (frames - 1) / 7)


def first_s(rows: int) -> float:
    """15.5 ms at 64 rows, 12 ms at 16."""
    return _linear(rows, 0.012, 0.029)


def prefill_s(requests: int) -> float:
    """12.7 ms for 32 requests of the 128-row bucket."""
    return 0.003 + 0.0003 * requests


# What XLA does on the host inside each call (the `host_ms` of bench/compile.py, the iteration profile's dispatch
# phases; H200, 0.6B shape, bench/results/command-buffers-0.6b-h200.json, capacity-0.6b-256-h200-run14.json):
# launching the layer and code-predictor loops' kernels one trip at a time costs about 2.2 ms plus 1.8 ms per
# frame; a codec call about 4 ms, a first-frame call 1.5, a prefill 1. The launch queue holds about 30 ms of the
# device's work, so a call also returns no sooner than that before the device will have finished it (a 256-row
# 4-frame step of 51 ms returned after 21 ms, the device idle before it).
LAUNCH_AHEAD_S = 0.030
# Inside a call XLA lets go of the GIL and takes it back about 8 times, each time waiting for the thread that holds
# it (bench/results/gil-handoff-h100.json: beside a thread spinning in Python at the 5 ms switch interval, a call
# whose host time is 2.2 ms took 43 ms, one of 21 ms took 66). In real time a held call sleeps in that many parts.
GIL_TAKES = 8


def step_host_s(frames: int) -> float:
    return 0.0022 + 0.0018 * frames


CODEC_HOST_S, FIRST_HOST_S, PREFILL_HOST_S = 0.004, 0.0015, 0.001


class Clock:
    """A simulated clock: advanced by the simulated device, never by the host's own work."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def wait_until(self, t: float) -> None:
        self.now = max(self.now, t)


class NumpyRunner:
    """The runner's calls answered at once, each advancing `clock` by its cost."""

    compiled_on_demand = 0  # it compiles nothing

    def __init__(self, config: EngineConfig, clock: Clock | None = None, seed: int = 0, scale: float = 1.0):
        self.config, self.clock, self.scale = config, clock, scale
        self.rng = np.random.default_rng(seed)

    def _done(self, cost: float, value, host: float = 0.0):
        """`value` once the device has spent `cost`; `host`: the call's own host time (`RealTimeRunner` only)."""
        self.clock.now += cost * self.scale
        return value

    def prefill(self, bucket, items, size):
        return self._done(prefill_s(size), np.zeros(1), PREFILL_HOST_S)

    def first(self, idx, live, fresh, decode) -> FirstOutcome:
        out = (self.rng.integers(0, 2048, (1, len(idx), 16)), np.asarray(live)[None],
               np.zeros((len(idx), SAMPLES_PER_FRAME), np.float32))
        return FirstOutcome(*self._done(first_s(len(idx)), out, FIRST_HOST_S))

    def step(self, idx, limits, frames) -> StepOutcome:
        valid = np.arange(frames)[:, None] < np.asarray(limits)[None]
        out = (self.rng.integers(0, 2048, (frames, len(idx), 16)), valid)
        return StepOutcome(*self._done(step_s(len(idx), frames), out, step_host_s(frames)))

    def codec(self, idx, fresh, start, count, frames):
        return self._done(codec_s(len(idx), frames), np.zeros((len(idx), frames * SAMPLES_PER_FRAME), np.float32),
                          CODEC_HOST_S)

    def append_text(self, slot, start, ids, cap) -> None:
        pass

    def load_voice(self, slot, ref_codes) -> None:
        pass

    def primed_state(self, ref_codes) -> None:
        pass

    def compile(self, keys) -> None:
        pass

    def stored(self, keys) -> bool:
        return False

    def compile_elsewhere(self, keys) -> None:
        return None

    def warm_voices(self) -> None:
        pass

    def scratch(self) -> None:
        pass

    def calibrate(self, keys, on=None, settled: bool = True) -> Calibration:
        c, k = self.config, self.scale
        return Calibration(
            steps={(a, n): k * (step_s(a, n) + codec_s(a, min(n, max(c.schedule))))
                   for kind, a, n in keys if kind == "step"},
            firsts={a: k * first_s(a) for kind, a, n in keys if kind == "step" and n == 1 and a in c.first_sizes},
            prefills={n: k * prefill_s(n) for kind, a, n in keys if kind == "insert"})


class Pending:
    """A device output of `RealTimeRunner`: its value once the simulated device has run the call."""

    def __init__(self, value: np.ndarray, ready: float, wait_until):
        self.value, self.ready, self.wait_until = value, ready, wait_until

    def __array__(self, dtype=None, copy=None):
        self.wait_until(self.ready)
        return self.value if dtype is None else self.value.astype(dtype)


def _sleep_until(t: float, takes: int = 1) -> None:
    """Sleep until `t` in `takes` parts, each waking to take the GIL back."""
    for left in range(takes, 0, -1):
        if (wait := (t - time.perf_counter()) / left) > 0:
            time.sleep(wait)


class RealTimeRunner(NumpyRunner):
    """`NumpyRunner`'s answers from a device queue: one simulated device runs the calls in order, and each output is
    ready when the device has done its call; in real time, or on `clock` (a simulated `Clock`). `busy` sums the
    device's seconds.

    `jitter_s`: every call costs an extra delay drawn from an exponential of this mean, as a real card's calls vary
    (on the H100, the step's host-driven loop trips held the engine thread 10-40 ms for the same shape): the loop
    learns the mean from what it measures; the tail is what its margin must cover.

    `xla_host`: every call also holds its calling thread (the GIL released, as XLA's launches do, and taken back
    `GIL_TAKES` times in real time) for its own host time and until the device is within `LAUNCH_AHEAD_S` of
    finishing it, as a GPU call does; off, a call returns at once."""

    def __init__(self, config: EngineConfig, seed: int = 0, clock: Clock | None = None, scale: float = 1.0,
                 jitter_s: float = 0.0, xla_host: bool = False):
        super().__init__(config, clock, seed, scale)
        self.now = time.perf_counter if clock is None else clock
        self.wait_until = _sleep_until if clock is None else clock.wait_until
        self.hold_until = functools.partial(_sleep_until, takes=GIL_TAKES) if clock is None else clock.wait_until
        self.free = 0.0
        self.busy = 0.0
        self.jitter_s = jitter_s
        self.xla_host = xla_host
        self._jitter = np.random.default_rng(seed + 1)

    def _done(self, cost: float, value, host: float = 0.0):
        cost *= self.scale
        if self.jitter_s:
            cost += self._jitter.exponential(self.jitter_s)
        called = self.now()
        self.free = max(self.free, called) + cost
        self.busy += cost
        if self.xla_host:
            self.hold_until(max(called + host, self.free - LAUNCH_AHEAD_S))
        if isinstance(value, tuple):
            return tuple(Pending(v, self.free, self.wait_until) for v in value)
        return Pending(value, self.free, self.wait_until)


def sim_engine(settings, xla_host: bool = False):
    """The engine `qtts-jax serve` would build for `settings`, over one simulated H200 (`RealTimeRunner`) and the
    tiny-random model (which only prepares the requests: no model runs). A whole server, or a fleet replica
    (`fleet.app.build(engine_factory=...)`), serves over it on a CPU."""
    from qtts_jax.engine import Engine
    from qtts_jax.model import load_model

    config = settings.engine_config()
    return Engine(load_model("tiny-random"), config, runner=RealTimeRunner(config, xla_host=xla_host))
