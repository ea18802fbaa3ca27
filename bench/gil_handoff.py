"""What a device call costs a thread that shares the GIL with a busy one, per Python switch interval.

A thread calls one engine program back to back (each call waited on) while the main thread spins in Python, as
the event loop does while it takes a burst of requests. The call lets go of the GIL inside and takes it back
several times; each taking-back waits until the spinning thread is made to let go, at most one switch interval.
Per program: its host time alone (the call's return, before the device is waited on), then per switch interval
its host time beside the spinning thread and the longest pause the spinner saw. `serving.app.serve_alone` sets
it to `SWITCH_INTERVAL_S`, which this measured. Writes JSON.

    python bench/gil_handoff.py --model 0.6b --programs step:16:1,step:256:4 --out runs/gil-handoff.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from bench.compile import engine_args, engine_for  # noqa: E402


def spin(seconds: float) -> dict:
    """Python-bound work for `seconds`: how often it ran and the longest pause between two of its iterations."""
    gaps, end = [], time.perf_counter() + seconds
    last = time.perf_counter()
    while (now := time.perf_counter()) < end:
        gaps.append(now - last)
        last = now
    return {"iterations": len(gaps), "longest_pause_ms": round(max(gaps) * 1e3, 3)}


def host_ms(call) -> float:
    """One call's host time (its return, before the device is waited on), then waited on."""
    t0 = time.perf_counter()
    out = call()
    elapsed = time.perf_counter() - t0
    jax.block_until_ready(out)
    return elapsed * 1e3


def measure(engine, key: tuple, intervals: list[float], seconds: float) -> dict:
    runner = engine.runner
    runner.program(*key)
    call = lambda: runner.idle_call(key)  # noqa: E731
    host_ms(call)
    row = {"alone_host_ms": round(statistics.median(host_ms(call) for _ in range(10)), 3)}
    default = sys.getswitchinterval()
    for ms in intervals:
        sys.setswitchinterval(ms / 1e3)
        stop, hosts = threading.Event(), []

        def caller():
            while not stop.is_set():
                hosts.append(host_ms(call))

        thread = threading.Thread(target=caller)
        thread.start()
        spun = spin(seconds)
        stop.set()
        thread.join()
        row[f"switch_{ms:g}ms"] = {"calls": len(hosts), "host_ms_median": round(statistics.median(hosts), 3), **spun}
        print(key, ms, row[f"switch_{ms:g}ms"], file=sys.stderr, flush=True)
    sys.setswitchinterval(default)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_args(p)
    p.add_argument("--programs", default="step:16:1,step:256:4")
    p.add_argument("--intervals-ms", default="5,1,0.5,0.2", help="switch intervals to try (Python's default: 5)")
    p.add_argument("--seconds", type=float, default=2.0, help="per program and interval")
    p.add_argument("--out")
    args = p.parse_args()
    engine = engine_for(args)
    intervals = [float(v) for v in args.intervals_ms.split(",")]
    result = {"model": args.model, "slots": args.slots, "device": str(jax.devices()[0].device_kind),
              "spinning_alone": spin(1.0), "programs": {}}
    for spec in args.programs.split(","):
        kind, a, b = spec.split(":")
        result["programs"][spec] = measure(engine, (kind, int(a), int(b)), intervals, args.seconds)
    print(json.dumps(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
