"""A 2,000-character input as one stream: does the player run dry at the seams between its parts? Issue 20's
target is one stream with 0 underruns, on the H200 with the 1.7B and 0.6B models.

`--concurrency` clients each send the text (studies/corpora/long_text.txt), streamed as PCM over `--protocol`
(a streamed POST, or our WebSocket), again and again for `--requests` each; a player that plays from the first
byte with no buffer (studies/playback.py) counts the underruns and the stall time. Against --url, or a local
server per `--model`, one after another (the JSON is written after each): tiny-random by default (on a CPU the
engine is slower than real time: its underruns say nothing about a GPU), or the real shapes with random weights,
which rarely end a part by themselves, so each part is capped (`--max-frames`). Issue 20's H200 rows, in one call:

    python bench/long_text.py --model 1.7b 0.6b --concurrency 1 16 --requests 1 \
        --out bench/results/long-text-h200.json --log-dir runs/long-text-h200
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

from bench.capacity import count_errors  # noqa: E402
from qtts_jax.model import PRESETS  # noqa: E402
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
            "error_messages": count_errors(r.error for r in records if not r.ok),
            "underruns": sum(row["underruns"] for row in rows),
            "streams_with_underruns": sum(row["underruns"] > 0 for row in rows),
            "starvation_ms_max": max((row["starvation_ms"] for row in rows), default=None),
            "ttfa_ms_p95": percentile([row["ttfa_ms"] for row in rows], 95) if rows else None,
            "audio_s_mean": sum(row["audio_s"] for row in rows) / len(rows) if rows else None}


async def run(url: str, args, max_frames: int | None) -> dict:
    text = load_corpus("long_text")[0]
    options = {"voice": args.voice, "seed": 1, **({"max_frames": max_frames} if max_frames else {})}
    levels = [await level(url, text, protocol, n, args.requests, options)
              for protocol in args.protocol for n in args.concurrency]
    return {"url": url, "characters": len(text), "options": options, "levels": levels}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (instead of local ones)")
    ap.add_argument("--model", nargs="+", default=["tiny-random"],
                    help="local servers, one after another: a preset (tiny-random, or 0.6b / 1.7b: the real shapes, "
                         "random weights) or a checkpoint directory")
    ap.add_argument("--slots", type=int, help="local servers' slots (default: 2 on tiny-random, else 32)")
    ap.add_argument("--context", type=int, default=1024, help="local servers' context (the server's default)")
    ap.add_argument("--frames-per-step", type=int, help="local servers' most frames per engine step "
                                                        "(default: 1 on tiny-random, else the server's 4)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"],
                    help="local servers' dtype (default: float32 on tiny-random, else bfloat16)")
    ap.add_argument("--log-dir", type=Path, help="write each local server's log there")
    ap.add_argument("--protocol", nargs="+", choices=["http", "ws"], default=["http", "ws"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1], help="clients at once, one level each")
    ap.add_argument("--requests", type=int, default=3, help="requests per client and level")
    ap.add_argument("--voice", default="ryan")
    ap.add_argument("--max-frames", type=int, help="cap per part (default, for random weights: 12 on tiny-random, "
                                                   "60 = 4.8 s at the real shapes; none for a checkpoint)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/long-text-tiny-cpu.json"))
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.url:
        write(args.out, [asyncio.run(run(args.url, args, args.max_frames))])
        return
    runs = []
    for model in args.model:
        server = local_settings(model, args)
        log = None
        if args.log_dir:
            args.log_dir.mkdir(parents=True, exist_ok=True)
            log = args.log_dir / f"server-{Path(model).name}.log"
        with local_server(model, slots=server["slots"], context=server["context"],
                          frames_per_step=server["frames_per_step"], log_path=log, ready_timeout_s=900.0,
                          extra_args=("--dtype", server["dtype"])) as url:  # a cold 1.7B ladder takes minutes
            runs.append({"model": model, **server, **asyncio.run(run(url, args, server["max_frames"]))})
        write(args.out, runs)


def local_settings(model: str, args) -> dict:
    """A local server's settings: the flags given, else tiny-random's small CPU ones or the real shapes' GPU ones;
    a part cap for random weights (which rarely end a part), none for a checkpoint."""
    tiny = model.startswith("tiny-random")
    return {"slots": args.slots or (2 if tiny else 32), "context": args.context,
            "frames_per_step": args.frames_per_step or (1 if tiny else 4),
            "dtype": args.dtype or ("float32" if tiny else "bfloat16"),
            "max_frames": args.max_frames or (12 if tiny else 60 if model in PRESETS else None)}


def write(out: Path, runs: list[dict]) -> None:
    """One JSON of every run so far; each level's row also goes to stdout."""
    out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    for row in runs[-1]["levels"]:
        print(json.dumps({"model": runs[-1].get("model"), **row}), flush=True)


if __name__ == "__main__":
    main()
