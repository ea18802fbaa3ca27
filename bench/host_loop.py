"""The engine loop's host work per iteration, with the device taken out: the loop (`Engine.run_once`) runs over a
runner that answers every call at once from numpy and advances the engine's clock by what the call costs on the
H200 (the 0.6B shape's measured costs, scaled by rows and frames), so the loop decides as it would there while the
wall time measured is the loop's own Python: admission, planning, hand-out, bookkeeping and stats.

Closed loop: every slot holds a 60-frame request, a new one submitted as each ends, so every iteration also
admits and starts newcomers. Per slot count: real milliseconds per iteration (median and p90 over the measured
iterations, the first fifth skipped while the slots fill), the mean of each part `_IterationProfile` names, and the
sender thread's own time (its hand-out overlaps the step's dispatch on a device; here the loop waits for it). No accelerator: this is the host CPU's
share of an iteration, the part of it the device waits for. Writes JSON.

    python bench/host_loop.py --slots 64,256 --out bench/results/host-loop-cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qtts_jax.codec.config import SAMPLES_PER_FRAME  # noqa: E402
from qtts_jax.engine import Engine, EngineConfig  # noqa: E402
from qtts_jax.engine.runner import Calibration, FirstOutcome, StepOutcome  # noqa: E402
from qtts_jax.model import load_model  # noqa: E402
from qtts_jax.request import Request  # noqa: E402


class Clock:
    """The engine's clock: advanced by the simulated device, never by the host's own work."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class NumpyRunner:
    """The runner's calls answered from numpy at once, each advancing `clock` by its H200 cost (0.6B shape,
    bf16 codec: bench/results/nnx-ab-0.6b-256-h200.json and kernels-*.json), linear in rows between 16 and 256."""

    def __init__(self, config: EngineConfig, clock: Clock, seed: int = 0):
        self.config, self.clock = config, clock
        self.rng = np.random.default_rng(seed)

    @staticmethod
    def _linear(rows: int, at16: float, at256: float) -> float:
        return at16 + (at256 - at16) * max(rows - 16, 0) / 240

    def step_s(self, rows: int, frames: int) -> float:
        return frames * self._linear(rows, 0.0088, 0.0138)

    def codec_s(self, rows: int, frames: int) -> float:
        return self._linear(rows, 0.003, 0.0122) * (1 + 0.45 * (frames - 1) / 7) * frames ** 0.5

    def first_s(self, rows: int) -> float:
        return self._linear(rows, 0.012, 0.0155 * 4)

    def prefill(self, bucket, items, size):
        self.clock.now += 0.002 + 0.0003 * size
        return np.zeros(1)

    def first(self, idx, live, fresh, decode) -> FirstOutcome:
        self.clock.now += self.first_s(len(idx))
        frames = self.rng.integers(0, 2048, (1, len(idx), 16))
        return FirstOutcome(frames, np.asarray(live)[None], np.zeros((len(idx), SAMPLES_PER_FRAME), np.float32))

    def step(self, idx, limits, frames) -> StepOutcome:
        self.clock.now += self.step_s(len(idx), frames)
        valid = np.arange(frames)[:, None] < np.asarray(limits)[None]
        return StepOutcome(self.rng.integers(0, 2048, (frames, len(idx), 16)), valid)

    def codec(self, idx, fresh, start, count, frames):
        self.clock.now += self.codec_s(len(idx), frames)
        return np.zeros((len(idx), frames * SAMPLES_PER_FRAME), np.float32)

    def append_text(self, slot, start, ids, cap) -> None:
        pass

    def load_voice(self, slot, ref_codes) -> None:
        pass

    def calibrate(self, keys, on=None) -> Calibration:
        c = self.config
        return Calibration(
            steps={(a, n): self.step_s(a, n) + self.codec_s(a, min(n, max(c.schedule)))
                   for kind, a, n in keys if kind == "step"},
            firsts={a: self.first_s(a) for kind, a, _ in keys if kind == "first"},
            prefills={n: 0.002 + 0.0003 * n for kind, a, n in keys if kind == "insert"})


def measure(model, slots: int, iterations: int, frames: int) -> dict:
    config = EngineConfig(slots=slots, context=512, prompt_buckets=(64,), max_trailing=64)
    clock = Clock()
    runner = NumpyRunner(config, clock)
    engine = Engine(model, config, runner=runner)
    engine.set_clock(clock)
    keys = [(kind, a, b) for kind in ("step", "codec") for a in config.ladder
            for b in (config.step_sizes if kind == "step" else config.codec_sizes)]
    keys += [("first", a, 1) for a in config.first_sizes] + [("insert", 64, r) for r in config.prefill_sizes]
    engine._use(keys, runner.calibrate(keys), left=0)
    job = engine.prepare(Request("A request of the benchmark's length.", speaker="ryan", max_frames=frames))
    sink = []
    parts: list[dict[str, float]] = []  # per iteration, its parts' seconds
    add = engine._profile.add

    def record(timer, **counts):
        parts.append(dict(timer.seconds))
        add(timer, **counts)

    engine._profile.add = record
    sender = [0.0]  # the sender thread's own time (hand-out), which overlaps the step's dispatch on a device

    def timed(call):
        def wrapped(*args):
            t0 = time.perf_counter()
            try:
                return call(*args)
            finally:
                sender[0] += time.perf_counter() - t0
        return wrapped

    engine._send_audio, engine._send_first = timed(engine._send_audio), timed(engine._send_first)
    walls, live, sent = [], [], []
    for i in range(iterations):
        while engine.active + len(engine.queue) < slots:
            engine.submit(job, sink.append)
        t0 = time.perf_counter()
        engine.run_once()
        walls.append(time.perf_counter() - t0)
        live.append(engine.active)
        sent.append(sender[0])
        sender[0] = 0.0
        sink.clear()
    skip = iterations // 5  # the first iterations fill the slots
    walls, live, parts, sent = walls[skip:], live[skip:], parts[skip:], sent[skip:]
    n = len(walls)
    names = sorted({name for p in parts for name in p})
    return {
        "slots": slots, "iterations": n, "live_mean": round(statistics.mean(live), 1),
        "host_ms_per_iteration_median": round(statistics.median(walls) * 1e3, 3),
        "host_ms_per_iteration_p90": round(float(np.percentile(walls, 90)) * 1e3, 3),
        "sender_thread_ms_mean": round(statistics.mean(sent) * 1e3, 3),
        "parts_ms_mean": {k: round(sum(p.get(k, 0.0) for p in parts) / len(parts) * 1e3, 3) for k in names},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", default="64,256")
    p.add_argument("--iterations", type=int, default=400)
    p.add_argument("--frames", type=int, default=60, help="frames per request")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model = load_model("tiny-random")  # its tokenizer and configs; no program of it runs
    rows = [measure(model, int(s), args.iterations, args.frames) for s in args.slots.split(",")]
    out = {"command": " ".join(sys.argv), "cpu": platform.processor() or platform.machine(),
           "python": platform.python_version(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
