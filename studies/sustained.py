"""Sustained throughput with a correctness guard, and A/B of two server builds.

Clients replace each completed request at once; a fill period runs before timing, and the steady window
opens only once it has passed and every client's first (warm-up) item is done, so a slow warm-up never eats
the window; only requests that finish inside the window count, and the final drain is excluded. Outstanding and waiting streams
are time-weighted from the server's /ready samples; GPU use and peak memory come from nvidia-smi when
it is present (null fields when not). A pass is *valid* only if every response after each worker's
warm-up matches a golden recording of the same fixed-seed request, so a faster build that changes the
audio cannot win silently. A/B runs A, B, then B, A: two passes per build, the order reversed on the
second, to cancel drift.

Workloads (one *item* is what a client asks for and waits for):
- *plain*: one paragraph, one request; the recording is the streamed audio.
- *processed*: two turns sent as one SSML request (`ssml`): a 120 ms `break` between them and the second turn's
  rate, pitch and volume changed by `prosody`, all done by the server; the recording is then peak-normalised
  to -1 dBFS as a whole on the client (a stream cannot be normalised before its end; the golden check is on
  what a listener would get).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
import uuid
from pathlib import Path
from xml.sax.saxutils import escape

import aiohttp
import numpy as np

from studies.corpora import load_corpus
from studies.gpu import GpuSampler
from studies.load import key_headers, speak, wait_ready
from studies.records import RequestRecord, write_jsonl
from studies.stats import percentile
from studies.sweep import run_sync

WORKLOADS = ("plain", "processed")
PAUSE_MS = 120.0
PEAK = 10 ** (-1 / 20)  # -1 dBFS
TURN_SEPARATOR = " | "  # between the turns of one processed item in a corpus line
SECOND_TURN = '<prosody rate="110%" pitch="+1st" volume="-3dB">'  # processed: how the second turn is said


@dataclasses.dataclass(frozen=True)
class Golden:
    """The recording a response must reproduce, to within `tolerance` int16 steps per sample."""

    pcm: np.ndarray  # int32 copy of the int16 samples
    tolerance: int = 1


def workload_items(workload: str, corpus: str | None = None, limit: int = 0) -> list[tuple[str, ...]]:
    """The items of a workload, each a tuple of turns: studies/corpora/sustained_<workload>.txt by default;
    a processed line holds two turns separated by ' | '. `limit` > 0 keeps the first `limit` items."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r} is not one of {WORKLOADS}")
    lines = load_corpus(corpus or f"sustained_{workload}")
    items = [tuple(t.strip() for t in line.split(TURN_SEPARATOR)) if workload == "processed" else (line,)
             for line in lines]
    _check_items(workload, items)
    return items[:limit] if limit > 0 else items


def _as_items(workload: str, items) -> list[tuple[str, ...]]:
    out = [(i,) if isinstance(i, str) else tuple(i) for i in items]
    _check_items(workload, out)
    return out


def _check_items(workload: str, items: list[tuple[str, ...]]) -> None:
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r} is not one of {WORKLOADS}")
    if not items:
        raise ValueError("no items")
    for item in items:
        if not all(t.strip() for t in item):
            raise ValueError(f"empty turn in {item!r}")
        if workload == "plain" and len(item) != 1:
            raise ValueError(f"a plain item is one text, got {len(item)} turns: {item!r}")
        if workload == "processed" and len(item) < 2:
            raise ValueError(f"a processed item has two turns (separated by {TURN_SEPARATOR!r}), got {item!r}")


def document(turns: tuple[str, ...], pause_ms: float = PAUSE_MS) -> str:
    """A processed item as one SSML document: the turns with a `pause_ms` break between them, every turn after
    the first said with SECOND_TURN's prosody."""
    said = [escape(t) if n == 0 else f"{SECOND_TURN}{escape(t)}</prosody>" for n, t in enumerate(turns)]
    return "<speak>" + f'<break time="{pause_ms:g}ms"/>'.join(said) + "</speak>"


def normalise(pcm: bytes) -> tuple[np.ndarray, float]:
    """s16le PCM -> (the int16 recording peak-normalised to -1 dBFS as a whole, the gain applied). Silence stays
    silence (gain 1)."""
    audio = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
    peak = float(np.max(np.abs(audio))) if len(audio) else 0.0
    gain = PEAK / peak if peak > 0 else 1.0
    return np.round(np.clip(audio * gain, -1.0, 1.0) * 32767.0).astype("<i2"), gain


@dataclasses.dataclass
class Item:
    """One item as a client saw it: its requests, its recording (None if a request failed)."""

    records: list[RequestRecord]
    recording: bytes | None
    gain: float = 1.0

    @property
    def ok(self) -> bool:
        return self.recording is not None

    @property
    def send_s(self) -> float:
        return self.records[0].send_s

    @property
    def end_s(self) -> float:
        return self.records[-1].end_s


async def run_item(session: aiohttp.ClientSession, url: str, workload: str, k: int, turns: tuple[str, ...],
                   options: dict, t0: float, timeout_s: float, condition: str, load: float,
                   protocol: str = "http", pause_ms: float = PAUSE_MS) -> Item:
    """Requests the item (a processed one as its SSML document) and builds the recording."""
    audio: dict = {}
    text = turns[0] if workload == "plain" else document(turns, pause_ms)
    r = await speak(session, url, _new(k, text, condition, load), options, t0, timeout_s, audio, protocol=protocol)
    if not r.ok:
        return Item([r], None)
    if workload == "plain":
        return Item([r], audio[r.request_id])
    recording, gain = normalise(audio[r.request_id])
    return Item([r], recording.tobytes(), gain)


async def record_golden(url: str, items, options: dict, timeout_s: float, workload: str = "plain",
                        protocol: str = "http", pause_ms: float = PAUSE_MS, retries: int = 5) -> list[Golden]:
    """Each item's recording, requested alone, one at a time, once the server is idle. A processed recording may
    differ from its golden by the gain times the one-step rounding of a stream, twice for the gain's own wobble,
    plus one step of final rounding: tolerance ceil(2 × gain) + 1."""
    items = _as_items(workload, items)
    out = []
    await wait_ready(url, timeout_s, idle=True)
    async with aiohttp.ClientSession(headers=key_headers()) as s:
        for k, turns in enumerate(items):
            for attempt in range(retries + 1):  # a refusal (429/503) is retried: a golden needs the audio, not speed
                it = await run_item(s, url, workload, k, turns, options, time.perf_counter(), timeout_s, "golden",
                                    1, protocol, pause_ms)
                if it.ok or it.records[-1].status not in (429, 503) or attempt == retries:
                    break
                await asyncio.sleep(_retry_after(it.records[-1]))
            if not it.ok:
                last = it.records[-1]
                raise RuntimeError(f"golden recording of item {k} on {url} failed: {last.error or last.invalid}")
            tolerance = 1 if workload == "plain" else math.ceil(2 * it.gain) + 1
            out.append(Golden(np.frombuffer(it.recording, "<i2").astype(np.int32), tolerance))
    return out


def _new(k: int, text: str, condition: str, load: float) -> RequestRecord:
    return RequestRecord(request_id=f"sustained-{uuid.uuid4().hex[:12]}", condition=condition, mode="closed",
                         load=load, prompt=k, text=text, send_s=0.0)


def matches(got: bytes, golden, tolerance: int | None = None) -> bool:
    """Same length and every sample within `tolerance` int16 steps (default: the golden's own, 1 for a bare
    array: streaming vs batch rounding)."""
    if isinstance(golden, Golden):
        golden, tolerance = golden.pcm, golden.tolerance if tolerance is None else tolerance
    tolerance = 1 if tolerance is None else tolerance
    pcm = np.frombuffer(got, "<i2").astype(np.int32) if len(got) % 2 == 0 else None
    return pcm is not None and len(pcm) == len(golden) and bool(np.all(np.abs(pcm - golden) <= tolerance))


def _retry_after(record: RequestRecord) -> float:
    try:
        return max(0.05, float(record.retry_after))
    except (TypeError, ValueError):
        return 0.1


def time_weighted_mean(samples: list[tuple[float, float]], end: float) -> float:
    """Mean of a step function sampled as (time, value), each value holding until the next sample or `end`."""
    if not samples:
        return float("nan")
    times = [t for t, _ in samples] + [end]
    spans = np.diff(times)
    return float(np.dot(spans, [v for _, v in samples]) / spans.sum()) if spans.sum() > 0 else float(samples[-1][1])


async def sustained_pass(url: str, concurrency: int, items, options: dict, golden: list, fill_s: float,
                         window_s: float, timeout_s: float = 120.0, workload: str = "plain", protocol: str = "http",
                         pause_ms: float = PAUSE_MS, gpu: bool = True, gpu_ids: str | None = None,
                         condition: str = "sustained", records_out: list | None = None) -> dict:
    """One pass: `concurrency` clients for fill_s (at least until each one's warm-up item is done) + window_s;
    numbers from items finishing in the window.
    `items` are texts (plain) or tuples of turns; `golden` one Golden (or int array) per item. Every request's
    record is appended to `records_out` when given (warm-ups marked)."""
    items = _as_items(workload, items)
    if len(golden) != len(items):
        raise ValueError(f"{len(golden)} golden recordings for {len(items)} items")
    await wait_ready(url, timeout_s, idle=True)  # the previous pass has drained
    t0 = time.perf_counter()
    start, stop = fill_s, math.inf  # the window's bounds, fixed when it opens (see the module docstring)
    opened = asyncio.Event()
    warming = concurrency
    done: list[Item] = []
    mismatches = 0
    active: list[tuple[float, float]] = []
    queued: list[tuple[float, float]] = []
    sampler_gpu = GpuSampler(enabled=gpu, gpu_ids=gpu_ids)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=key_headers()) as s:
        async def worker(w: int):
            nonlocal mismatches, warming, start, stop
            n = 0
            while time.perf_counter() - t0 < stop:
                k = (w + n) % len(items)
                it = await run_item(s, url, workload, k, items[k], options, t0, timeout_s, condition, concurrency,
                                    protocol, pause_ms)
                if n > 0 and it.ok and not matches(it.recording, golden[k]):  # the first is the warm-up
                    mismatches += 1
                for r in it.records:
                    r.warmup = n == 0
                done.append(it)
                n += 1
                if n == 1:
                    warming -= 1
                    if not warming:  # every client is warm: time from here (or from the fill's end)
                        start = max(fill_s, time.perf_counter() - t0)
                        stop = start + window_s
                        opened.set()
                if not it.ok:  # a refused or broken item fails the pass; back off as told, not in a hot loop
                    await asyncio.sleep(min(_retry_after(it.records[-1]), max(0.0, stop - (time.perf_counter() - t0))))

        async def sampler():
            await opened.wait()
            await asyncio.sleep(max(0.0, start - (time.perf_counter() - t0)))
            async with sampler_gpu:
                while (now := time.perf_counter() - t0) < stop:
                    try:
                        async with s.get(f"{url}/ready", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                            body = await resp.json(content_type=None)
                        active.append((now, body.get("active", 0)))
                        queued.append((now, body.get("queued", 0)))
                    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                        pass  # a missed sample; the previous value holds
                    await asyncio.sleep(0.05)

        await asyncio.gather(sampler(), *(worker(w) for w in range(concurrency)))
    if records_out is not None:
        records_out.extend(sorted((r for it in done for r in it.records), key=lambda r: r.send_s))
    window = [it for it in done if start <= it.end_s <= stop and it.ok]  # completed inside the steady window
    measured = [it for it in window if not it.records[0].warmup]
    latency_ms = [1000 * (it.end_s - it.send_s) for it in measured]
    failed = sum(not it.ok for it in done)
    return {
        "url": url, "workload": workload, "protocol": protocol, "concurrency": concurrency, "window_s": window_s,
        "completed": len(window), "req_per_s": len(window) / window_s, "failed": failed,
        "golden_mismatches": mismatches, "valid": failed == 0 and mismatches == 0 and bool(measured),
        "latency_p50_ms": percentile(latency_ms, 50), "latency_p95_ms": percentile(latency_ms, 95),
        "mean_outstanding": time_weighted_mean(active, stop), "mean_waiting": time_weighted_mean(queued, stop),
        "errors": sorted({r.invalid for it in done for r in it.records if r.invalid}),
        **sampler_gpu.result(),
    }


def sustained_ab(url_a: str, url_b: str, items, options: dict, concurrency: int = 4, fill_s: float = 10.0,
                 window_s: float = 90.0, timeout_s: float = 120.0, workload: str = "plain", protocol: str = "http",
                 pause_ms: float = PAUSE_MS, gpu: bool = True, gpu_ids: str | None = None,
                 records_out: list | None = None) -> list[dict]:
    """Passes A, B, B, A, all checked against goldens recorded alone on A (the reference build) with the
    fixed seed in `options`; each result carries `build` ("A"/"B") and `order` (1-4)."""
    if "seed" not in options:
        raise ValueError("sustained runs need a fixed 'seed' in options, or responses cannot match a golden")
    if concurrency < 1 or window_s <= 0 or fill_s < 0:
        raise ValueError("need concurrency >= 1, window_s > 0, fill_s >= 0")
    items = _as_items(workload, items)
    golden = run_sync(record_golden(url_a, items, options, timeout_s, workload, protocol, pause_ms))
    results = []
    for order, (build, url) in enumerate((("A", url_a), ("B", url_b), ("B", url_b), ("A", url_a)), 1):
        r = run_sync(sustained_pass(url, concurrency, items, options, golden, fill_s, window_s, timeout_s, workload,
                                    protocol, pause_ms, gpu, gpu_ids, f"{workload}:{order}{build}", records_out))
        results.append({"build": build, "order": order, **r})
    return results


def compare_builds(passes: list[dict]) -> dict:
    """Per build: mean req/s and p95 latency over its passes, valid only if every pass was; B over A."""
    out = {}
    for build in ("A", "B"):
        ps = [p for p in passes if p["build"] == build]
        out[build] = {"req_per_s": float(np.mean([p["req_per_s"] for p in ps])),
                      "latency_p95_ms": float(np.mean([p["latency_p95_ms"] for p in ps])),
                      "valid": all(p["valid"] for p in ps)}
    a = out["A"]["req_per_s"]
    out["b_over_a"] = out["B"]["req_per_s"] / a if a > 0 else math.nan
    return out


def measure(out: Path, url_a: str, url_b: str, label_a: str, label_b: str, workloads, corpora: dict,
            items_per_workload: int, voice: str, seed: int, max_frames: int | None, concurrency: int, fill_s: float,
            window_s: float, protocol: str = "http", pause_ms: float = PAUSE_MS, gpu: bool = True,
            gpu_ids: str | None = None) -> dict:
    """The whole A/B, each workload's passes and their comparison, written to `out` as records.jsonl and
    summary.json (what the report draws), and returned. Every request asks for `voice` with `seed`, capped at
    `max_frames` (None: the model's own end). It runs where the servers are; the report is drawn from those files on
    any machine."""
    options = {"voice": voice, "seed": seed, **({"max_frames": max_frames} if max_frames else {})}
    records, results = [], {}
    for workload in workloads:
        items = workload_items(workload, corpora.get(workload), items_per_workload)
        passes = sustained_ab(url_a, url_b, items, options, concurrency, fill_s, window_s, workload=workload,
                              protocol=protocol, pause_ms=pause_ms, gpu=gpu, gpu_ids=gpu_ids, records_out=records)
        results[workload] = {"items": len(items), "passes": passes, "comparison": compare_builds(passes)}
    write_jsonl(out / "records.jsonl", records)
    summary = {"kind": "sustained", "url_a": url_a, "url_b": url_b, "label_a": label_a, "label_b": label_b,
               "protocol": protocol, "options": options, "concurrency": concurrency, "fill_s": fill_s,
               "window_s": window_s, "pause_ms": pause_ms, "workloads": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    return summary
