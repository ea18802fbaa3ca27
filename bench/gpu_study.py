"""The capacity study where the server runs, from one cold start: process start to full capacity (optionally
under a Poisson load that reaches the server from its first second), the study's closed and Poisson sweeps
(`studies capacity --no-report`: records, /metrics samples and summary.json, which `make report RUN=...` renders on
any machine), then a restart from the compilation cache the first start wrote. One JSON beside the runs.

    python bench/gpu_study.py --model 0.6b --slots 256 --closed 8,64,256,512 --rates 60,120,180,360 \\
        --poisson-requests 2000 --out runs/gpu-study-0.6b
    python bench/gpu_study.py --model 1.7b --slots 256 --cold-rps 10 --rates 30,60,120 --out runs/gpu-study-1.7b

CPU smoke run:

    python bench/gpu_study.py --model tiny-random --dtype float32 --slots 2 --context 1024 --closed 1,2 --rates 1 \\
        --closed-requests 4 --poisson-requests 4 --max-frames 12 --cold-rps 1 --out runs/gpu-study-smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from studies.cli import main as study_main  # noqa: E402
from studies.load import arrival_times, key_headers, speak, wait_ready  # noqa: E402
from studies.records import RequestRecord, write_jsonl  # noqa: E402
from studies.server import free_port, local_server  # noqa: E402

AFTER_READY_S = 30.0  # how long the cold load goes on once the server is at full capacity
READY_TIMEOUT_S = 900.0


async def cold_load(url: str, rate: float, t0: float, options: dict) -> tuple[list[RequestRecord], float]:
    """Poisson `rate` requests/s from `t0` (the server's process start) until `AFTER_READY_S` after it is at full
    capacity (`/ready` 200: every rung compiled); the records, and when it got there (seconds from `t0`)."""
    ready_at = []
    ready = asyncio.create_task(wait_ready(url, READY_TIMEOUT_S))
    ready.add_done_callback(lambda _: ready_at.append(time.perf_counter() - t0))
    offsets = arrival_times(rate, int(rate * (READY_TIMEOUT_S + AFTER_READY_S)), poisson=True)
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=key_headers()) as s:
        for i, at in enumerate(offsets):
            if ready_at and at > ready_at[0] + AFTER_READY_S:
                break
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            record = RequestRecord(f"cold-{i}", f"cold:{rate:g}", "open-poisson", rate, 0,
                                   "Hello there, how can I help you today?", time.perf_counter() - t0)
            tasks.append(asyncio.create_task(speak(s, url, record, options, t0, 60.0)))
        records = list(await asyncio.gather(*tasks))
    await ready  # its error, if it never got there
    return records, ready_at[0]


def served(records: list[RequestRecord], ready_at: float) -> dict:
    """What a cold server did for the requests sent after it was ready (a 429 is not served), and before."""
    after = [r for r in records if r.send_s >= ready_at]
    ok = [r for r in after if r.ok]
    return {"sent": len(records), "sent_after_ready": len(after), "served_after_ready": len(ok),
            "stalled_after_ready": sum(1 for r in ok if r.derived()["underruns"]),
            "served_before_ready": sum(1 for r in records if r.send_s < ready_at and r.ok)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="0.6b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--slots", default="256")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--engine", default='{"codec_dtype": "bfloat16"}', help="EngineConfig fields as JSON")
    p.add_argument("--closed", default="8,64,256,512", help="closed loop: clients ('' to skip)")
    p.add_argument("--rates", default="60,120,180,360", help="Poisson: requests/s ('' to skip)")
    p.add_argument("--closed-requests", type=int, default=60)
    p.add_argument("--poisson-requests", type=int, default=2000)
    p.add_argument("--max-frames", type=int, default=60)
    p.add_argument("--cold-rps", type=float, default=0.0, help="a Poisson load from process start (0: none)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join(sys.argv), "model": args.model, "slots": args.slots}

    def save():
        (out / "gpu-study.json").write_text(json.dumps(result, indent=1))

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = dict(model=args.model, slots=args.slots, context=args.context, frames_per_step=4,
                  engine=json.loads(args.engine), port=port,
                  extra_args=("--dtype", args.dtype, "--compile-cache", str(out / "xla")))
    loaded = []

    def load_from_start():
        options = {"voice": "ryan", "seed": 0, "max_frames": args.max_frames}
        loaded.extend(asyncio.run(cold_load(url, args.cold_rps, t0, options)))

    loader = threading.Thread(target=load_from_start) if args.cold_rps else None
    t0 = time.perf_counter()
    if loader:
        loader.start()
    with local_server(log_path=out / "server-cold.log", **server):  # ready, and idle: nothing in flight
        result["cold_ready_s"] = round(time.perf_counter() - t0, 1)
        if loader:  # it was ready before the load let it be idle
            loader.join()
            records, ready_at = loaded
            write_jsonl(out / "cold-load.jsonl", records)
            result["cold_ready_s"] = round(ready_at, 1)
            result["cold_load"] = {"rate": args.cold_rps, **served(records, ready_at)}
        save()
        study = ["capacity", "--url", url, "--max-frames", str(args.max_frames), "--chunk-schedule", "--no-report",
                 "--runs-dir", str(out / "runs")]
        for mode, loads, requests in (("closed", args.closed, args.closed_requests),
                                      ("open-poisson", args.rates, args.poisson_requests)):
            if loads:
                result[f"study_{mode}_rc"] = study_main([*study, "--mode", mode, "--loads", *loads.split(","),
                                                         "--requests", str(requests)])
                save()
    t1 = time.perf_counter()
    with local_server(log_path=out / "server-restart.log", **server):
        result["restart_ready_s"] = round(time.perf_counter() - t1, 1)
    save()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
