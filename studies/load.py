"""Load generation against a speech server's public HTTP API (streamed raw PCM), closed or open loop.

Closed loop keeps `concurrency` requests in flight (each client sends its next request when one ends);
open loop sends at a fixed or Poisson rate whatever the server does, which is how real callers arrive
and the only way to see queueing grow. Every request becomes a `RequestRecord` with its chunk arrivals.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import aiohttp
import numpy as np

from studies.records import RequestRecord
from studies.validate import validate_stream

MODES = ("closed", "open-fixed", "open-poisson")


def condition_name(mode: str, load: float) -> str:
    return f"{mode}:{load:g}"


async def wait_ready(url: str, timeout_s: float = 180.0, idle: bool = False) -> dict:
    """Polls GET /ready until 200 (and, with `idle`, no active or queued streams); returns its JSON."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(f"{url}/ready", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    body = await r.json(content_type=None)
                    last = f"HTTP {r.status} {body}"
                    if r.status == 200 and (not idle or (body.get("active", 0) == 0 and body.get("queued", 0) == 0)):
                        return body
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                last = repr(exc)
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} not ready{' and idle' if idle else ''} after {timeout_s:.0f} s (last: {last})")


async def speak(session: aiohttp.ClientSession, url: str, record: RequestRecord, options: dict, t0: float,
                timeout_s: float, audio: dict | None = None) -> RequestRecord:
    """Sends one streamed PCM request and fills in `record` (times relative to `t0`, perf_counter clock);
    with `audio`, also keeps the PCM bytes as audio[request_id] (for golden checks; records stay small)."""
    body = {"input": record.text, "response_format": "pcm", "stream": True, **options}
    data = bytearray()
    carry = 0  # bytes of a sample split across transport chunks
    record.send_s = time.perf_counter() - t0
    try:
        async with session.post(f"{url}/v1/audio/speech", json=body, headers={"X-Request-Id": record.request_id},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            record.status = resp.status
            headers = dict(resp.headers)
            record.retry_after = resp.headers.get("Retry-After")
            if resp.headers.get("X-TTFA-Ms"):
                record.server_ttfa_ms = float(resp.headers["X-TTFA-Ms"])
            rate = resp.headers.get("X-Sample-Rate", "")
            record.sample_rate = int(rate) if rate.isdigit() else None
            width = 4 if resp.headers.get("X-Sample-Format") == "f32le" else 2
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            else:
                async for piece in resp.content.iter_any():
                    now = time.perf_counter() - t0
                    if record.first_byte_s is None:
                        record.first_byte_s = now
                    data += piece
                    samples, carry = divmod(carry + len(piece), width)
                    record.chunks.append((now, samples))
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        headers = {}
    record.end_s = time.perf_counter() - t0
    record.invalid = validate_stream(record.status, headers, bytes(data), record.error)
    if audio is not None:
        audio[record.request_id] = bytes(data)
    return record


def _record(mode, load, i, prompts, warmup) -> RequestRecord:
    k = i % len(prompts)
    return RequestRecord(request_id=f"study-{uuid.uuid4().hex[:12]}", condition=condition_name(mode, load),
                         mode=mode, load=load, prompt=k, text=prompts[k], send_s=0.0, warmup=i < warmup)


async def closed_loop(url: str, concurrency: int, requests: int, prompts: list[str], options: dict | None = None,
                      warmup: int = 0, timeout_s: float = 60.0) -> list[RequestRecord]:
    """`concurrency` clients, each sending its next request as soon as its last one ends, until
    `warmup + requests` have been sent; the first `warmup` are marked and left out of statistics."""
    _check(concurrency, requests, prompts, warmup)
    total, counter, out = warmup + requests, iter(range(warmup + requests)), []
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def client():
            for i in counter:  # a shared iterator: each index is taken by exactly one client
                out.append(await speak(s, url, _record("closed", concurrency, i, prompts, warmup),
                                       options or {}, t0, timeout_s))

        await asyncio.gather(*(client() for _ in range(min(concurrency, total))))
    return sorted(out, key=lambda r: r.send_s)


def arrival_times(rate: float, count: int, poisson: bool, seed: int = 0) -> np.ndarray:
    """Send offsets (s): evenly spaced at `rate`/s, or a Poisson process (exponential gaps) with that mean rate."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if not poisson:
        return np.arange(count) / rate
    gaps = np.random.default_rng(seed).exponential(1 / rate, count)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if count else gaps


async def open_loop(url: str, rate: float, requests: int, prompts: list[str], poisson: bool = False,
                    options: dict | None = None, warmup: int = 0, seed: int = 0,
                    timeout_s: float = 60.0) -> list[RequestRecord]:
    """Sends `warmup + requests` at `rate`/s (fixed gaps or Poisson) regardless of how many are in flight."""
    _check(1, requests, prompts, warmup)
    mode = "open-poisson" if poisson else "open-fixed"
    offsets = arrival_times(rate, warmup + requests, poisson, seed)
    t0 = time.perf_counter()
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for i, at in enumerate(offsets):
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(
                speak(s, url, _record(mode, rate, i, prompts, warmup), options or {}, t0, timeout_s)))
        out = await asyncio.gather(*tasks)
    return list(out)


def _check(concurrency, requests, prompts, warmup):
    if concurrency < 1 or requests < 1 or warmup < 0:
        raise ValueError(f"need concurrency >= 1, requests >= 1, warmup >= 0 (got {concurrency}, {requests}, {warmup})")
    if not prompts:
        raise ValueError("no prompts")


async def run_condition(url: str, mode: str, load: float, requests: int, prompts: list[str],
                        options: dict | None = None, warmup: int = 0, seed: int = 0,
                        timeout_s: float = 60.0) -> list[RequestRecord]:
    """One condition after the server has drained the previous one (so conditions do not overlap)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    await wait_ready(url, timeout_s=timeout_s, idle=True)
    if mode == "closed":
        if load != int(load):
            raise ValueError(f"closed-loop load is a whole number of requests in flight, got {load}")
        return await closed_loop(url, int(load), requests, prompts, options, warmup, timeout_s)
    return await open_loop(url, load, requests, prompts, mode == "open-poisson", options, warmup, seed, timeout_s)
