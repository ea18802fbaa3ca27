"""A 2,000-character input as one stream: does the player run dry at the seams between its parts? Issue 20's
target is one stream with 0 underruns, on the H200 with the 1.7B and 0.6B models.

`--concurrency` clients each send the text (studies/corpora/long_text.txt), streamed as PCM over `--protocol`
(a streamed POST, or our WebSocket), again and again for `--requests` each; a player that plays from the first
byte with no buffer (studies/playback.py) counts the underruns and the stall time. Against --url, or a local
tiny-random server (on a CPU the engine is slower than real time: its underruns say nothing about a GPU).

    python bench/long_text.py --url http://gpu-box:8000 --concurrency 1 8 32 --out bench/results/long-text-h200-1.7b.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from studies.corpora import load_corpus  # noqa: E402
from studies.load import speak  # noqa: E402
from studies.records import RequestRecord  # noqa: E402
from studies.server import local_server  # noqa: E402
from studies.stats import percentile  # noqa: E402


async def level(url: str, text: str, protocol: str, concurrency: int, requests: int, options: dict) -> dict:
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def client():
            for _ in range(requests):
                r = RequestRecord(request_id=uuid.uuid4().hex, condition=f"closed:{concurrency}", mode="closed",
                                  load=concurrency, prompt=0, text=text, send_s=0.0)
                records.append(await speak(s, url, r, options, t0, 600.0, protocol=protocol))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    rows = [r.derived() for r in records if r.ok]
    return {"protocol": protocol, "concurrency": concurrency, "requests": len(records), "ok": len(rows),
            "errors": sorted({r.invalid for r in records if not r.ok}),
            "underruns": sum(row["underruns"] for row in rows),
            "streams_with_underruns": sum(row["underruns"] > 0 for row in rows),
            "starvation_ms_max": max((row["starvation_ms"] for row in rows), default=None),
            "ttfa_ms_p95": percentile([row["ttfa_ms"] for row in rows], 95) if rows else None,
            "audio_s_mean": sum(row["audio_s"] for row in rows) / len(rows) if rows else None}


async def run(url: str, args) -> dict:
    text = load_corpus("long_text")[0]
    options = {"voice": args.voice, "seed": 1, **({"max_frames": args.max_frames} if args.max_frames else {})}
    levels = [await level(url, text, protocol, n, args.requests, options)
              for protocol in args.protocol for n in args.concurrency]
    return {"url": url, "characters": len(text), "options": options, "levels": levels}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a running server (default: a local tiny-random one)")
    ap.add_argument("--protocol", nargs="+", choices=["http", "ws"], default=["http", "ws"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1], help="clients at once, one level each")
    ap.add_argument("--requests", type=int, default=3, help="requests per client and level")
    ap.add_argument("--voice", default="ryan")
    ap.add_argument("--max-frames", type=int, help="cap per part (a real model ends by itself; tiny-random needs one)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/long-text-tiny-cpu.json"))
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(local_server("tiny-random", slots=2, context=1024))
        if not args.url and not args.max_frames:
            args.max_frames = 12
        result = asyncio.run(run(url, args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for row in result["levels"]:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
