"""The engine's scheduling alone, on a simulated clock: Poisson arrivals through the server's admission into the
engine loop, over `sim_device.RealTimeRunner` on a simulated `Clock` (one device running the calls in order at what
each costs on the H200, 0.6B shape, times `--scale`), with a listener per stream who plays from the first byte and
counts every stall after it (the zero-underrun contract of the capacity study). The host's own work takes no
time here (or `--host-ms` per iteration, and `--chunk-us` of the server's event loop per chunk handed out: see
`EventLoop`), so what this measures is the loop's decisions: how many frames a step
runs while newcomers keep joining, how late first audio comes, whether any stream runs dry. It is deterministic
for a seed and runs in seconds on a CPU, so policies are compared side by side (`--variants`, fields of
`EngineConfig` over the server's defaults) before a GPU measures them.

    python bench/schedule_sim.py --rates 60,80,100,120 --variants "now=;..." --out bench/results/schedule-sim.json
"""

from __future__ import annotations

import argparse
import ast
import bisect
import concurrent.futures
import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sim_device import Clock, RealTimeRunner  # noqa: E402
from qtts_jax.codec.config import SAMPLE_RATE  # noqa: E402
from qtts_jax.engine import Engine, EngineConfig  # noqa: E402
from qtts_jax.model import load_model  # noqa: E402
from qtts_jax.request import Request  # noqa: E402
from serving.errors import ApiError  # noqa: E402
from serving.admission import Admission  # noqa: E402
from serving.settings import Settings  # noqa: E402
from studies.playback import simulate  # noqa: E402


REFUSAL_ROUND_TRIP_S = 0.002  # a closed-loop client's next request after a 429: one local HTTP round trip


class Inline:
    """The engine's sender thread, run inline: on one simulated clock the hand-outs must happen in a fixed order
    (they wait for the device as the thread would, so the device's timeline is the same)."""

    def submit(self, fn, *args):
        done = concurrent.futures.Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # the loop reads it from .result(), as from the thread
            done.set_exception(exc)
        return done


class EventLoop:
    """The server's event loop between the hand-out and the listeners (`--chunk-us`): it takes a batch of chunks
    handed out together one after another, soonest due first as serving/bridge.py orders them, spending `chunk_s`
    on each (encoding it, writing it to its socket) after whatever it was still doing, so a batch's last listener
    hears its chunk that much after the hand-out; each batch's lag reaches the engine's margin as the bridge
    reports it. The interpreter it shares with the engine's thread is left out."""

    def __init__(self, engine: Engine, chunk_s: float, take):
        self.engine, self.chunk_s, self.take = engine, chunk_s, take
        self.busy_until = -math.inf
        self.batch: list = []  # (chunk, listener) handed out since the last flush

    def put(self, chunk, listener) -> None:
        self.batch.append((chunk, listener))

    def flush(self) -> None:
        """Take what the last iteration handed out: each hand-out (its chunks share a `sent_at`) as one batch."""
        handed, self.batch = sorted(self.batch, key=lambda item: (item[0].sent_at, item[0].due)), []
        for since, batch in itertools.groupby(handed, key=lambda item: item[0].sent_at):
            at = max(self.busy_until, since)  # sorted stably: a request's own chunks keep their order
            for chunk, listener in batch:
                at += self.chunk_s
                self.take(listener, chunk, at)
            self.busy_until = at
            self.engine.observe_delivery_lag(at - since)


@dataclasses.dataclass
class Listener:
    arrived: float
    chunks: list = dataclasses.field(default_factory=list)  # (heard at, samples)
    error: str | None = None
    stream: object = None  # its engine stream


def run_rate(model, config: EngineConfig, rate: float, seconds: float, frames: int, scale: float, host_s: float,
             seed: int, closed: int = 0, jitter_s: float = 0.0, xla_host: bool = False, chunk_s: float = 0.0,
             warmup: bool = True) -> dict:
    """One condition: Poisson arrivals at `rate` for `seconds`, or with `closed` N, N clients that each send their
    next request as soon as their last one ends (its final chunk, or a refusal: the study's closed-loop client
    does not wait out a Retry-After), 2N requests in all, all N at once at the start. `chunk_s`: the event loop's
    time a chunk (`EventLoop`); 0, each listener hears its chunk when the engine hands it out. `warmup` False: the
    engine starts with nothing timed (a server's `Settings.warmup` off) and times its calls as they first run."""
    clock = Clock()
    runner = RealTimeRunner(config, seed, clock=clock, scale=scale, jitter_s=jitter_s, xla_host=xla_host)
    engine = Engine(model, config, runner=runner)
    engine.set_clock(clock)
    engine.sender = Inline()
    if warmup:
        engine.warmup()
    admission = Admission(engine, Settings().admission_config())
    admission.ready = True
    job = engine.prepare(Request("A request of the study's length.", speaker="ryan", max_frames=frames))
    if closed:
        arrivals = [clock.now] * closed  # grows as clients send their next requests
    else:
        rng = np.random.default_rng(seed)
        arrivals = clock.now + np.cumsum(rng.exponential(1 / rate, int(rate * seconds * 1.5) + 1))
        arrivals = list(arrivals[arrivals < clock.now + seconds])

    def next_request(at: float):
        if len(arrivals) < 2 * closed:  # in order, never before what the loop has taken
            bisect.insort(arrivals, max(at, arrivals[i - 1] if i else at), lo=i)
    listeners, refused, step_frames = [], 0, []
    step = runner.step

    def counted(idx, limits, n):
        step_frames.append(n)
        return step(idx, limits, n)

    runner.step = counted

    def take(listener: Listener, chunk, at: float) -> None:
        if len(chunk.pcm):
            listener.chunks.append((at, len(chunk.pcm)))
        if chunk.final:
            listener.error = chunk.error
            next_request(at)

    loop = EventLoop(engine, chunk_s, take) if chunk_s else None

    def hear(listener: Listener):
        def on_chunk(chunk):
            if loop is None:
                take(listener, chunk, chunk.sent_at)
            else:
                loop.put(chunk, listener)
        return on_chunk

    start, i = clock.now, 0
    while i < len(arrivals) or engine.active or engine.queue:
        while i < len(arrivals) and arrivals[i] <= clock.now:
            try:
                admission.admit()
            except ApiError:
                refused += 1
                next_request(clock.now + REFUSAL_ROUND_TRIP_S)
            else:
                listener = Listener(float(arrivals[i]))
                listeners.append(listener)
                listener.stream = engine.submit(job, hear(listener))
                listener.stream.timings.submitted = listener.arrived  # it came during the iteration, not at its end
            i += 1
        clock.now += host_s
        busy = engine.run_once()
        if loop is not None:
            loop.flush()
        if not busy and i < len(arrivals):
            clock.now = max(clock.now, float(arrivals[i]))
    wall = clock.now - start
    ttfa = np.array([lst.chunks[0][0] - lst.arrived for lst in listeners if lst.chunks]) * 1e3
    plays = [simulate(sorted(lst.chunks), SAMPLE_RATE) for lst in listeners if lst.chunks]
    underran = [p for p in plays if p.underruns]
    waited = np.array([lst.stream.timings.admitted - lst.arrived for lst in listeners if lst.chunks]) * 1e3
    return {
        "rate": rate, "closed": closed, "requests": len(arrivals), "refused": refused, "served": len(plays),
        "errors": sum(lst.error is not None for lst in listeners),
        "success_rate": round(len(plays) / max(len(arrivals), 1), 4),
        "underrun_requests": len(underran),
        "longest_stall_ms": round(max((p.longest_stall_s for p in plays), default=0.0) * 1e3, 1),
        "first_underrun_under_0.25s": sum(p.first_stall_at_s < 0.25 for p in underran),
        "ttfa_p50_ms": round(float(np.percentile(ttfa, 50)), 1) if len(ttfa) else None,
        "ttfa_p95_ms": round(float(np.percentile(ttfa, 95)), 1) if len(ttfa) else None,
        "admitted_p50_p95_ms": [round(float(np.percentile(waited, q)), 1) for q in (50, 95)] if len(waited) else None,
        "frames_per_step": round(float(np.mean(step_frames)), 2) if step_frames else None,
        "throughput_rps": round(len(plays) / wall, 2),
        "chunks_per_request": round(sum(len(lst.chunks) for lst in listeners) / max(len(listeners), 1), 1),
        "margin_ms_at_end": round(engine.stats().headroom_margin_s * 1e3, 1),
    }


def parse_variants(text: str) -> dict[str, dict]:
    """"name=field:value,field:value;name2=..." -> {name: EngineConfig overrides} (values read as Python literals)."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    out = {}
    for item in filter(None, (x.strip() for x in text.split(";"))):
        name, _, spec = item.partition("=")
        overrides = {}
        for pair in filter(None, spec.split(",")):
            key, _, value = pair.partition(":")
            if key not in fields:
                raise SystemExit(f"--variants: {key!r} is not a field of EngineConfig")
            overrides[key] = ast.literal_eval(value)
        out[name] = overrides
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="60,80,100,120")
    p.add_argument("--loads", default="", help="closed loop: requests in flight (each a condition of 2N requests)")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds of arrivals per rate")
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--frames", type=int, default=60, help="frames per request")
    p.add_argument("--scale", type=float, default=1.0, help="every device cost times this (1: the H200, 0.6B)")
    p.add_argument("--host-ms", type=float, default=0.0, help="host time per loop iteration")
    p.add_argument("--jitter-ms", type=float, default=0.0,
                   help="mean of an exponential extra delay of every device call (the calls' variation)")
    p.add_argument("--xla-host", action="store_true",
                   help="each device call holds the engine's thread for XLA's host work in it, as on the H200")
    p.add_argument("--chunk-us", type=float, default=0.0,
                   help="the server's event loop's time per chunk, each batch's chunks taken in turn (0: none)")
    p.add_argument("--variants", default="now=", help="name=field:value,...;... (EngineConfig fields)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args()
    model = load_model("tiny-random")  # its tokenizer and configs; no program of it runs
    results = {}
    for name, overrides in parse_variants(args.variants).items():
        config = dataclasses.replace(Settings(slots=args.slots, context=512).engine_config(), **overrides)
        rows = []
        conditions = [(float(r), 0) for r in args.rates.split(",") if r] + [
            (0.0, int(n)) for n in args.loads.split(",") if n]
        for rate, closed in conditions:
            rows.append(run_rate(model, config, rate, args.seconds, args.frames, args.scale, args.host_ms / 1e3,
                                 args.seed, closed, args.jitter_ms / 1e3, args.xla_host, args.chunk_us / 1e6))
            print(json.dumps({"variant": name, **rows[-1]}), flush=True)
        results[name] = {"overrides": overrides, "rows": rows}
    if args.out:
        out = {"command": " ".join(sys.argv), "what": __doc__.split("\n\n")[0], "variants": results}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
