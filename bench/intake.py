"""What the server's event loop spends on each request of a burst before the engine has it (Server-Timing's
`intake`: the handler's start to the engine's submit), and in which of the handler's parts. Every request of a
burst waits for the handlers of those before it, one after another on the one event loop, so a closed loop's
first wave pays this per request times its place in the burst.

`--requests` streamed speech requests are sent at once to an in-process server on tiny-random whose engine loop
is stopped after its warm-up and four whole requests: each request is admitted and submitted, then waits in the engine's queue (which
grows through the burst as a real burst's does), and is dropped once all have been submitted. Timed around the
handler's parts: the request's options, its script (the engine's `prepare`: tokenizing and laying out the
prompt), admission (the engine's stats snapshot, the load and the prediction) and the submit; and the garbage
collector's passes meanwhile (startup's objects frozen first, as a serving process does). CPU only.

    python bench/intake.py --requests 256 --out bench/results/intake-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench import report  # noqa: E402

TEXT = "Hi, how can I help you today? I am here to help."


def timed(owner, name: str, label: str, spent: collections.Counter) -> None:
    """Replace `owner.name` by a wrapper that adds each call's seconds to `spent[label]`."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


async def measure(requests: int) -> dict:
    import aiohttp
    from aiohttp.test_utils import TestClient, TestServer

    from bench.capacity import intake, intake_since
    from qtts_jax.engine import Engine, EngineConfig
    from qtts_jax.model import load_model
    from serving import bridge
    from serving.app import create_app
    from serving.http_api import routes
    from serving.monitoring.collector import freeze_startup, pauses
    from serving.admission import Admission
    from serving.settings import Settings

    config = EngineConfig(slots=2, context=128, prompt_buckets=(64,), max_trailing=32, frames_per_step=1, schedule=(1,))
    engine = Engine(load_model("tiny-random"), config)
    app = create_app(Settings(slots=2, context=128, ttfa_target_ms=1e9,
                              admission={"starvation_s": 1e9, "max_queue": 10 * requests}),
                     engine=engine)
    client = TestClient(TestServer(app), connector=aiohttp.TCPConnector(limit=0))  # every request at once
    await client.start_server()
    try:
        while (await client.get("/ready")).status != 200:
            await asyncio.sleep(0.1)
        body = {"model": "tts-1", "input": TEXT, "voice": "ryan", "response_format": "pcm", "stream": True}
        for _ in range(4):  # the handlers' first calls (lazy tables, caches) are left out
            await (await client.post("/v1/audio/speech", json={**body, "max_frames": 2})).read()
        engine.stop()  # requests now wait in its queue: intake alone is measured
        freeze_startup()  # as a serving process does once warm (serving/monitoring/collector.py)
        gc_before = sum(pauses().seconds)
        spent: collections.Counter = collections.Counter()
        for owner, name, label in ((routes, "speech_options", "options"), (routes.script, "build", "script"),
                                   (Engine, "prepare", "script: engine prepare"), (Admission, "admit", "admission"),
                                   (Engine, "stats", "admission: engine stats"), (Admission, "load", "admission: load"),
                                   (Admission, "predict", "admission: predict"), (bridge.AsyncEngine, "submit", "submit")):
            timed(owner, name, label, spent)
        before = intake(await (await client.get("/metrics")).text())
        sent = [asyncio.create_task(client.post("/v1/audio/speech", json=body)) for _ in range(requests)]
        while engine.stats().queued < requests:
            await asyncio.sleep(0.01)
        now = intake(await (await client.get("/metrics")).text())
        gc_s = sum(pauses().seconds) - gc_before
        for task in sent:
            task.cancel()
        await asyncio.gather(*sent, return_exceptions=True)
    finally:
        await client.close()
    return {"requests": requests, "intake": intake_since(now, before), "gc_pauses_ms": round(1e3 * gc_s, 1),
            "parts_us_per_request": {k: round(1e6 * v / requests, 1) for k, v in sorted(spent.items())}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256, help="requests in the burst")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result = asyncio.run(measure(args.requests))
    report.write(args.out, "per request of a burst, the server's intake (handler start -> engine submit) and its "
                           "parts, on tiny-random with the engine loop stopped", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
