"""The engine loop's host work per iteration, with the device taken out: the loop (`Engine.run_once`) runs over
`sim_device.NumpyRunner`, which answers every call at once and advances the engine's clock by what the call costs
on the H200, so the loop decides as it would there while the wall time measured is the loop's own Python:
admission, planning, hand-out, bookkeeping and stats.

Closed loop: every slot holds a 60-frame request, a new one submitted as each ends, so every iteration also
admits and starts newcomers. Per slot count: real milliseconds per iteration (median and p90 over the measured
iterations, the first fifth skipped while the slots fill), the mean of each part `IterationProfile` names, and the
sender thread's own time (its hand-out overlaps the step's dispatch on a device; here the loop waits for it). No
accelerator: this is the host CPU's share of an iteration, the part of it the device waits for. Writes JSON.

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

from bench.sim_device import Clock, NumpyRunner  # noqa: E402
from qtts_jax.engine import Engine, EngineConfig, core, handout, iteration  # noqa: E402
from qtts_jax.model import load_model  # noqa: E402
from qtts_jax.request import Request  # noqa: E402


def measure(model, slots: int, iterations: int, frames: int) -> dict:
    config = EngineConfig(slots=slots, context=512, prompt_buckets=(64,), max_trailing=64)
    clock = Clock()
    runner = NumpyRunner(config, clock)
    engine = Engine(model, config, runner=runner)
    engine.set_clock(clock)
    engine.warmup()
    job = engine.prepare(Request("A request of the benchmark's length.", speaker="ryan", max_frames=frames))
    sink = []
    parts: list[dict[str, float]] = []  # per iteration, its parts' seconds
    add = engine.profile.add

    def record(timer, **counts):
        parts.append(dict(timer.seconds))
        add(timer, **counts)

    engine.profile.add = record
    sender = [0.0]  # the sender thread's own time (hand-out), which overlaps the step's dispatch on a device

    def timed(call):
        def wrapped(*args):
            t0 = time.perf_counter()
            try:
                return call(*args)
            finally:
                sender[0] += time.perf_counter() - t0
        return wrapped

    # the loop calls these by core's and iteration's names; wrapping handout's own, each run times them once
    core.send_audio, iteration.send_first = timed(handout.send_audio), timed(handout.send_first)
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
