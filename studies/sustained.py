"""Sustained throughput with a correctness guard, and A/B of two server builds.

Clients replace each completed request at once; a fill period runs before timing; only requests that
finish inside the steady window count, and the final drain is excluded. Outstanding and waiting streams
are time-weighted from the server's /ready samples. A pass is *valid* only if every response after each
worker's warm-up matches a golden recording of the same fixed-seed request (to one int16 step), so a
faster build that changes the audio cannot win silently. A/B runs A, B, then B, A to cancel drift.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import aiohttp
import numpy as np

from studies.load import speak
from studies.records import RequestRecord
from studies.stats import percentile
from studies.sweep import run_sync


async def record_golden(url: str, prompts: list[str], options: dict, timeout_s: float) -> list[np.ndarray]:
    """Each prompt's audio, requested alone, one at a time."""
    out = []
    async with aiohttp.ClientSession() as s:
        for k, text in enumerate(prompts):
            audio: dict = {}
            r = await speak(s, url, _new(k, text, "golden", 1), options, time.perf_counter(), timeout_s, audio)
            if not r.ok:
                raise RuntimeError(f"golden recording of prompt {k} failed: {r.invalid}")
            out.append(np.frombuffer(audio[r.request_id], "<i2").astype(np.int32))
    return out


def _new(k: int, text: str, condition: str, load: float) -> RequestRecord:
    return RequestRecord(request_id=f"sustained-{uuid.uuid4().hex[:12]}", condition=condition, mode="closed",
                         load=load, prompt=k, text=text, send_s=0.0)


def matches(got: bytes, golden: np.ndarray) -> bool:
    """Same length and every sample within one int16 step (streaming vs batch rounding)."""
    pcm = np.frombuffer(got, "<i2").astype(np.int32) if len(got) % 2 == 0 else None
    return pcm is not None and len(pcm) == len(golden) and bool(np.all(np.abs(pcm - golden) <= 1))


def time_weighted_mean(samples: list[tuple[float, float]], end: float) -> float:
    """Mean of a step function sampled as (time, value), each value holding until the next sample or `end`."""
    if not samples:
        return float("nan")
    times = [t for t, _ in samples] + [end]
    spans = np.diff(times)
    return float(np.dot(spans, [v for _, v in samples]) / spans.sum()) if spans.sum() > 0 else float(samples[-1][1])


async def sustained_pass(url: str, concurrency: int, prompts: list[str], options: dict, golden: list[np.ndarray],
                         fill_s: float, window_s: float, timeout_s: float = 120.0) -> dict:
    """One pass: `concurrency` clients for fill_s + window_s; numbers from requests finishing in the window."""
    t0 = time.perf_counter()
    start, stop = fill_s, fill_s + window_s
    done: list[RequestRecord] = []
    mismatches = 0
    active: list[tuple[float, float]] = []
    queued: list[tuple[float, float]] = []

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker(w: int):
            nonlocal mismatches
            n = 0
            while time.perf_counter() - t0 < stop:
                k = (w + n) % len(prompts)
                audio: dict = {}
                r = await speak(s, url, _new(k, prompts[k], "sustained", concurrency), options, t0, timeout_s, audio)
                if n > 0 and r.ok and not matches(audio[r.request_id], golden[k]):  # the first is the warm-up
                    mismatches += 1
                r.warmup = n == 0
                done.append(r)
                n += 1

        async def sampler():
            while (now := time.perf_counter() - t0) < stop:
                if now >= start:
                    async with s.get(f"{url}/ready") as resp:
                        body = await resp.json(content_type=None)
                    active.append((now, body.get("active", 0)))
                    queued.append((now, body.get("queued", 0)))
                await asyncio.sleep(0.05)

        await asyncio.gather(sampler(), *(worker(w) for w in range(concurrency)))
    window = [r for r in done if start <= r.end_s <= stop]  # finished inside the steady window
    measured = [r for r in window if not r.warmup]
    latency_ms = [1000 * (r.end_s - r.send_s) for r in measured if r.ok]
    failed = sum(not r.ok for r in done)
    return {
        "url": url, "concurrency": concurrency, "window_s": window_s, "completed": len(window),
        "req_per_s": len(window) / window_s, "failed": failed, "golden_mismatches": mismatches,
        "valid": failed == 0 and mismatches == 0 and bool(measured),
        "latency_p50_ms": percentile(latency_ms, 50), "latency_p95_ms": percentile(latency_ms, 95),
        "mean_outstanding": time_weighted_mean(active, stop), "mean_waiting": time_weighted_mean(queued, stop),
    }


def sustained_ab(url_a: str, url_b: str, prompts: list[str], options: dict, concurrency: int = 4,
                 fill_s: float = 10.0, window_s: float = 90.0, timeout_s: float = 120.0) -> list[dict]:
    """Passes A, B, B, A, all checked against goldens recorded alone on A (the reference build) with the
    fixed seed in `options`; each result carries `build` ("A"/"B") and `order` (1-4)."""
    if "seed" not in options:
        raise ValueError("sustained runs need a fixed 'seed' in options, or responses cannot match a golden")
    if concurrency < 1 or window_s <= 0 or fill_s < 0:
        raise ValueError("need concurrency >= 1, window_s > 0, fill_s >= 0")
    golden = run_sync(record_golden(url_a, prompts, options, timeout_s))
    results = []
    for order, (build, url) in enumerate((("A", url_a), ("B", url_b), ("B", url_b), ("A", url_a)), 1):
        r = run_sync(sustained_pass(url, concurrency, prompts, options, golden, fill_s, window_s, timeout_s))
        results.append({"build": build, "order": order, **r})
    return results
