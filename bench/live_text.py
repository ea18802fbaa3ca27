"""Text streamed word by word into vLLM-Omni's WebSocket protocol, as an LLM would: when does audio start, and
how long after the last word does it end? Issue 19 item 5 asks for these beside the buffered mode, in the
three modes of split_granularity:

- `none`: everything buffered until `input.done` (vLLM-Omni's default);
- `sentence`: each sentence started as soon as its end arrives;
- `live`: one utterance started at the first word, the later words joining its engine stream as it plays
  (serving/sockets/live_input.py).

Per trial (the streaming-text prompt layout, non_streaming_mode false, the one live text extends): words
sent every --interval-ms, then `input.done`; recorded per mode (median over --trials):
first audio after the first word, last word to the last audio byte, and last word to the end of playback for
a client that plays from the first byte at zero buffer. Against --url, or a local tiny-random server (on a CPU
the engine is slower than real time: the numbers show the protocol's waits, not a GPU's speed).

    python bench/live_text.py --out bench/results/live-text-tiny-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.text.sentences import split_units  # noqa: E402
from studies.server import local_server  # noqa: E402

TEXT = ("Thanks for calling. Your table for four is booked at seven tonight. "
        "We will text you a reminder an hour before. Is there anything else I can help with?")


async def trial(url: str, mode: str, interval_s: float, max_new_tokens: int) -> dict:
    words = TEXT.split(" ")
    rate = 24000
    async with aiohttp.ClientSession() as http, http.ws_connect(url.replace("http", "ws", 1)
                                                                  + "/v1/audio/speech/stream") as ws:
        await ws.send_json({"type": "session.config", "voice": "ryan", "response_format": "pcm",
                            "stream_audio": True, "split_granularity": mode, "max_new_tokens": max_new_tokens,
                            "sample_rate": rate, "non_streaming_mode": False,  # text fed beside the codes
                            "seed": 1})  # tiny-random runs to its cap with it in both modes (seed 0 ends early)
        t0 = time.perf_counter()
        sent = {}

        async def feed():
            for i, word in enumerate(words):
                await ws.send_json({"type": "input.text", "text": word + (" " if i < len(words) - 1 else "")})
                sent.setdefault("first", time.perf_counter())
                sent["last"] = time.perf_counter()
                await asyncio.sleep(interval_s)
            await ws.send_json({"type": "input.done"})

        feeder = asyncio.create_task(feed())
        chunks, errors = [], []
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                chunks.append((time.perf_counter(), len(msg.data) // 2))
                continue
            event = json.loads(msg.data)
            if event["type"] == "error":
                errors.append(event["message"])
            if event["type"] == "session.done":
                break
        await feeder
        with contextlib.suppress(Exception):
            await ws.send_json({"type": "session.close"})
    play_end = 0.0  # a zero-buffer player: each chunk plays from its arrival or the previous chunk's end
    for at, samples in chunks:
        play_end = max(play_end, at) + samples / rate
    return {"first_audio_after_first_word_s": chunks[0][0] - sent["first"] if chunks else None,
            "last_word_to_last_byte_s": chunks[-1][0] - sent["last"] if chunks else None,
            "last_word_to_playback_end_s": play_end - sent["last"] if chunks else None,
            "audio_s": sum(s for _, s in chunks) / rate, "send_s": sent["last"] - t0, "errors": errors}


async def measure(url: str, trials: int, interval_s: float, frames: int) -> list[dict]:
    """`frames` per sentence; the one request of the buffered and live modes gets as many as all sentences
    together, so every mode makes the same audio from a model that runs to its cap (tiny-random does)."""
    sentences = len(split_units(TEXT + " ", "sentence")[0])
    rows = []
    for mode in ("none", "sentence", "live"):
        cap = frames * (1 if mode == "sentence" else sentences) + 1  # max_new_tokens: frames + the end token
        runs = [await trial(url, mode, interval_s, cap) for _ in range(trials)]
        keys = ("first_audio_after_first_word_s", "last_word_to_last_byte_s", "last_word_to_playback_end_s",
                "audio_s", "send_s")
        row = {"split_granularity": mode, "trials": trials,
               **{k: round(statistics.median(r[k] for r in runs), 3) for k in keys},
               "errors": sorted({e for r in runs for e in r["errors"]})}
        rows.append(row)
        print(json.dumps(row))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a running server (default: a local tiny-random one)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--interval-ms", type=float, default=10.0)
    ap.add_argument("--frames", type=int, default=12, help="frames of audio per sentence (12 ≈ 1 s)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/live-text-tiny-cpu.json"))
    args = ap.parse_args(argv)
    interval = args.interval_ms / 1000

    def run(url):
        return asyncio.run(measure(url, args.trials, interval, args.frames))

    if args.url:
        rows, where = run(args.url), args.url
    else:
        with local_server("tiny-random", slots=4, context=512) as url:  # the whole text fits one prompt
            rows, where = run(url), "local tiny-random, 4 slots, context 512, CPU"
    result = {"bench": "live_text", "server": where, "words": len(TEXT.split(" ")), "interval_ms": args.interval_ms,
              "frames_per_sentence": args.frames, "text": TEXT, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
