"""First-chunk size × client start-up buffer: the published study's next step after batching starved.

A smaller first chunk lowers TTFA but leaves less audio to cover the next step; a start-up buffer trades
start delay for fewer stalls. One load condition per first-chunk size is measured; every buffer is then
simulated on the same recorded arrivals, so buffers are compared on identical traffic.
"""

from __future__ import annotations

import json
from pathlib import Path

from studies.load import run_condition
from studies.records import write_jsonl
from studies.stats import summarize
from studies.sweep import run_sync

CODEC_CHUNKS = (1, 2, 4, 8)  # frames per chunk the engine's codec is compiled for by default


def schedule_for(first: int) -> list[int]:
    """`first` frames, then doubling up to 8: [1, 2, 4, 8], [2, 4, 8], [4, 8], [8]."""
    if first not in CODEC_CHUNKS:
        raise ValueError(f"first chunk must be one of {CODEC_CHUNKS} frames, got {first}")
    return [n for n in CODEC_CHUNKS if n >= first]


def chunk_buffer_grid(url: str, first_chunks: list[int], buffers_ms: list[float], load: float, requests: int,
                      prompts: list[str], out_dir: str | Path, options: dict | None = None, mode: str = "closed",
                      warmup: int = 0) -> list[dict]:
    """One summary per (first chunk, buffer), with `first_chunk` and `start_p95_ms` (TTFA plus buffer wait);
    writes records.jsonl and summary.json under out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "records.jsonl").unlink(missing_ok=True)
    rows = []
    for first in first_chunks:
        opts = {**(options or {}), "chunk_schedule": schedule_for(first)}
        records = run_sync(run_condition(url, mode, load, requests, prompts, opts, warmup))
        write_jsonl(out / "records.jsonl", records, append=True)
        rows += [{**summarize(records, b), "first_chunk": first} for b in buffers_ms]
    (out / "summary.json").write_text(json.dumps({"url": url, "mode": mode, "load": load, "grid": rows},
                                                 indent=2, default=float))
    return rows
