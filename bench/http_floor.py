"""The first-audio floor a burst meets before any engine work: the capacity study's closed-loop client against a
server that answers each streamed speech request at once (one PCM frame as soon as its handler runs, then one
every 80 ms, 60 frames as the study's requests have), listening as `qtts-jax serve` does
(`serving.http_api.connections.LimitedAppRunner`, its backlog). What the client measures here is what HTTP handling and the
client itself cost. The server stamps when each handler starts (`time.perf_counter`, one clock for every process of a
Linux machine), which splits that time into the part before the handler (the client sending, the server accepting
and parsing) and the part after it.

    python bench/http_floor.py --loads 256 --out bench/results/http-floor-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.capacity import closed_waves  # noqa: E402

FRAME_BYTES = 1920 * 2


def serve(port: int, stamps_path: str, frames: int) -> None:
    """The child: answer every speech request at once; write the handlers' start times on SIGTERM."""
    from aiohttp import web

    from serving.http_api.connections import LimitedAppRunner

    stamps: dict[str, float] = {}

    async def speech(request: web.Request) -> web.StreamResponse:
        stamps[request.headers.get("X-Request-Id", "")] = time.perf_counter()
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "audio/pcm", "X-Sample-Rate": "24000",
                                           "X-Sample-Format": "s16le", "X-Channels": "1"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        start = time.perf_counter()
        for i in range(frames):
            await asyncio.sleep(max(0.0, start + 0.08 * i - time.perf_counter()))
            await resp.write(bytes(FRAME_BYTES))
        await resp.write_eof()
        return resp

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/audio/speech", speech)
        runner = LimitedAppRunner(app, header_timeout_s=10.0, idle_timeout_s=60.0, max_connections=1024)
        await runner.setup()
        await runner.site("127.0.0.1", port).start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        Path(stamps_path).write_text(json.dumps(stamps))
        await runner.cleanup()

    asyncio.run(main())


async def measure(load: int, out_dir: Path, frames: int = 60) -> dict:
    """Two waves of `load` requests (after 8 to warm up), each answered with `frames` frames of 80 ms."""
    from studies.load import closed_loop
    from studies.server import free_port

    port, stamps_path = free_port(), out_dir / f"stamps-{load}.json"
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), str(stamps_path), str(frames)])
    try:
        for _ in range(200):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        t0 = time.perf_counter()  # the records' zero, so that the handlers' stamps subtract exactly
        records = await closed_loop(f"http://127.0.0.1:{port}", load, 2 * load, ["Hello there."], warmup=8, t0=t0)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    stamps = json.loads(stamps_path.read_text())
    rows = [{"send_s": r.send_s, "ttfa_s": r.ttfa_s, "to_handler_s": stamps[r.request_id] - t0 - r.send_s}
            for r in records if not r.warmup and r.ok and r.request_id in stamps]
    result = {"load": load, "requests": len(rows), "failed": sum(not r.ok for r in records)}
    result.update(closed_waves(rows, {"client_ttfa_ms": lambda r: 1e3 * r["ttfa_s"],
                                      "send_to_handler_ms": lambda r: 1e3 * r["to_handler_s"],
                                      "handler_to_first_byte_ms": lambda r: 1e3 * (r["ttfa_s"] - r["to_handler_s"])}))
    return result


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loads", default="256", help="closed loop: requests in flight, comma-separated")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    work = out.parent / (out.stem + "-work")
    work.mkdir(parents=True, exist_ok=True)
    results = [asyncio.run(measure(int(x), work)) for x in args.loads.split(",")]
    report = {"what": "the first-audio floor of HTTP handling and the study's client: a server that answers at once",
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "cpus": os.cpu_count(),
              "conditions": results}
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
