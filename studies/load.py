"""Load generation against a speech server's public API, closed or open loop, over HTTP or WebSocket.

Closed loop runs `concurrency` clients, each with one request at a time: the load is what they offer, not what is
in flight. A refused client behaves like a real one: it waits the Retry-After the server sent (plus jitter, so
refused clients do not return together) and sends the same request again. Open loop sends at a fixed or Poisson
rate whatever the server does, which is how real callers arrive and the only way to see queueing grow. Every
request becomes a `RequestRecord` with its chunk arrivals.

Protocols: `http` is `POST /v1/audio/speech` streaming raw PCM; `ws` opens one WebSocket per request on
`/v1/audio/speech/stream` (session.update, input_text.append, input_text.commit) and reads the binary PCM
messages up to `utterance.done`. Both fill the same record: a WebSocket error message becomes the HTTP
status the same refusal gets over HTTP (queue_full/overloaded -> 429, draining -> 503, ...), so SLO
tables read the same whichever protocol carried the audio.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import json
import os
import random
import time
import uuid

import aiohttp
import numpy as np

from studies.records import RequestRecord
from studies.validate import validate_stream

MODES = ("closed", "open-fixed", "open-poisson")
PROTOCOLS = ("http", "ws")
# Session fields the WebSocket accepts (serving/sockets/ws.py); HTTP-only options (response_format, ...) are refused.
WS_SESSION_FIELDS = ("voice", "language", "instructions", "seed", "temperature", "top_k", "top_p",
                     "repetition_penalty", "max_frames", "greedy", "chunk_schedule")
# WebSocket error codes -> the HTTP status the same refusal gets on the HTTP endpoint (others: 400).
WS_ERROR_STATUS = {"queue_full": 429, "overloaded": 429, "rate_limited": 429, "too_many_utterances": 429,
                   "not_ready": 503, "draining": 503, "cancelled": 503, "engine_error": 500, "internal_error": 500}


def condition_name(mode: str, load: float) -> str:
    return f"{mode}:{load:g}"


def key_headers() -> dict[str, str]:
    """The API key a server that checks keys wants (QTTS_API_KEY, the variable the server takes its own from)."""
    key = os.environ.get("QTTS_API_KEY", "")
    return {"Authorization": f"Bearer {key}"} if key and key != "none" else {}


async def wait_ready(url: str, timeout_s: float = 180.0, idle: bool = False) -> dict:
    """Polls GET /ready until 200 (and, with `idle`, no active or queued streams and nothing left compiling: a
    measurement starts on a server at its full size); returns its JSON."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(f"{url}/ready", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    body = await r.json(content_type=None)
                    last = f"HTTP {r.status} {body}"
                    if r.status == 200 and (not idle or not any(body.get(k, 0) for k in ("active", "queued", "compiling"))):
                        return body
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                last = repr(exc)
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} not ready{' and idle' if idle else ''} after {timeout_s:.0f} s (last: {last})")


async def speak(session: aiohttp.ClientSession, url: str, record: RequestRecord, options: dict, t0: float,
                timeout_s: float, audio: dict | None = None, protocol: str = "http") -> RequestRecord:
    """Sends one streamed PCM request over `protocol` and fills in `record` (times relative to `t0`,
    perf_counter clock); with `audio`, also keeps the PCM bytes as audio[request_id] (for golden checks;
    records stay small)."""
    if protocol == "ws":
        return await speak_ws(session, url, record, options, t0, timeout_s, audio)
    if protocol != "http":
        raise ValueError(f"protocol {protocol!r} is not one of {PROTOCOLS}")
    return await speak_http(session, url, record, options, t0, timeout_s, audio)


async def speak_http(session: aiohttp.ClientSession, url: str, record: RequestRecord, options: dict, t0: float,
                     timeout_s: float, audio: dict | None = None) -> RequestRecord:
    """`POST /v1/audio/speech` with `stream: true, response_format: pcm`."""
    record.protocol = "http"
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
            timing = server_timing(resp.headers.get("Server-Timing", ""))
            record.server_queue_ms, record.server_intake_ms = timing.get("queue"), timing.get("intake")
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


def server_timing(header: str) -> dict[str, float]:
    """The durations (ms) of a Server-Timing header, by name: `queue;dur=12.5, ttfa;dur=40` -> {"queue": 12.5, ...};
    entries without a readable duration are left out."""
    out = {}
    for entry in header.split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if key == "dur" and name:
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
    return out


def ws_url(url: str) -> str:
    """http://host:port -> ws://host:port/v1/audio/speech/stream (https -> wss)."""
    base = "ws" + url[4:] if url.startswith("http") else url
    return f"{base.rstrip('/')}/v1/audio/speech/stream"


def check_ws_options(options: dict) -> None:
    unknown = sorted(set(options) - set(WS_SESSION_FIELDS))
    if unknown:
        raise ValueError(f"options {unknown} cannot be sent over the WebSocket; its session takes {WS_SESSION_FIELDS}")


async def speak_ws(session: aiohttp.ClientSession, url: str, record: RequestRecord, options: dict, t0: float,
                   timeout_s: float, audio: dict | None = None) -> RequestRecord:
    """One utterance on a fresh WebSocket: connect, session.update + append + commit sent at once, then PCM
    messages until `utterance.done` (or an error). `send_s` is taken before the connect, as HTTP's is before
    its request, so the handshake counts towards time to first audio."""
    check_ws_options(options)
    record.protocol = "ws"
    data = bytearray()
    headers: dict = {}
    record.send_s = time.perf_counter() - t0
    try:
        async with asyncio.timeout(timeout_s):
            async with session.ws_connect(ws_url(url), headers={"X-Request-Id": record.request_id}) as ws:
                await ws.send_str(json.dumps({"type": "session.update", "session": options}))
                await ws.send_str(json.dumps({"type": "input_text.append", "text": record.text}))
                await ws.send_str(json.dumps({"type": "input_text.commit"}))
                async for msg in ws:
                    now = time.perf_counter() - t0
                    if msg.type == aiohttp.WSMsgType.BINARY:
                        if record.first_byte_s is None:
                            record.first_byte_s = now
                        data += msg.data
                        record.chunks.append((now, len(msg.data) // 2))  # s16le: whole samples per message
                        continue
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        break
                    event = json.loads(msg.data)
                    kind = event.get("type")
                    if kind in ("session.created", "session.updated"):
                        rate = event.get("sample_rate")
                        headers = {"X-Sample-Rate": str(rate), "X-Channels": "1",
                                   "X-Sample-Format": "s16le" if event.get("format") == "pcm_s16le"
                                   else str(event.get("format"))}
                        record.sample_rate = int(rate) if isinstance(rate, int) else None
                    elif kind == "error":
                        err = event.get("error") or {}
                        record.status = WS_ERROR_STATUS.get(err.get("code"), 400)
                        record.error = f"WS {err.get('code')}: {err.get('message')}"[:300]
                        if err.get("retry_after") is not None:
                            record.retry_after = str(err["retry_after"])
                        record.end_s = now
                        break
                    elif kind == "utterance.done":
                        record.end_s = now
                        if event.get("cancelled"):
                            record.status, record.error = 503, "WS utterance cancelled by the server"
                        else:
                            record.status = 200
                        timings = event.get("timings") or {}
                        record.server_ttfa_ms, record.server_queue_ms, record.server_intake_ms = (
                            None if (v := timings.get(k)) is None else float(v)
                            for k in ("first_chunk_ms", "queue_ms", "intake_ms"))
                        break
                if record.status is None:
                    record.error = f"socket closed before utterance.done (close code {ws.close_code})"
    except aiohttp.WSServerHandshakeError as exc:  # refused before the upgrade (e.g. 503 while draining)
        record.status = exc.status
        record.error = f"HTTP {exc.status}: {exc.message}"[:300]
        record.retry_after = (exc.headers or {}).get("Retry-After")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    if record.end_s is None:
        record.end_s = time.perf_counter() - t0
    record.invalid = validate_stream(record.status, headers, bytes(data), record.error)
    if audio is not None:
        audio[record.request_id] = bytes(data)
    return record


# Sends of one request a closed-loop client makes before it gives up on a server that keeps refusing it
SENDS = 3
JITTER = 0.5  # a refused client waits Retry-After times 1 to 1 + JITTER


def refusal_wait(record: RequestRecord) -> float | None:
    """Seconds a refused request was told to wait (Retry-After of a 429 or 503); None if it was not refused so."""
    if record.status not in (429, 503) or record.retry_after is None:
        return None
    try:
        return max(float(record.retry_after), 0.0)
    except ValueError:
        return None


def refusal_message(error: str | None) -> str | None:
    """The server's words from a refusal's error text: the JSON `error.message` over HTTP, the text after the code
    over the WebSocket."""
    if not error:
        return None
    head, _, rest = error.partition(": ")
    if head.startswith("HTTP"):
        try:
            return str(json.loads(rest)["error"]["message"])
        except (ValueError, KeyError, TypeError):
            return rest or head
    return rest or head


async def speak_until_admitted(session: aiohttp.ClientSession, url: str, record: RequestRecord, options: dict,
                               t0: float, timeout_s: float, protocol: str, rng: random.Random,
                               sends: int = SENDS) -> RequestRecord:
    """`speak` a copy of `record`, sent again after each refusal that carries a Retry-After, up to `sends` times.
    Returns the last send's record, but with the first's `send_s`: the listener waited all along, so the wait
    counts in its time to first audio. `refusals` counts the refused sends, `refusal` says why the first was."""
    first_send, refusals, why = None, 0, None
    while True:
        sent = await speak(session, url, copy.deepcopy(record), options, t0, timeout_s, protocol=protocol)
        first_send = sent.send_s if first_send is None else first_send
        wait = refusal_wait(sent)
        if wait is not None:
            refusals += 1
            why = why or refusal_message(sent.error)
        if wait is None or refusals >= sends:
            break
        await asyncio.sleep(wait * (1 + JITTER * rng.random()))
    sent.send_s, sent.refusals, sent.refusal = first_send, refusals, why
    return sent


def _record(mode, load, i, prompts, warmup) -> RequestRecord:
    k = i % len(prompts)
    return RequestRecord(request_id=f"study-{uuid.uuid4().hex[:12]}", condition=condition_name(mode, load),
                         mode=mode, load=load, prompt=k, text=prompts[k], send_s=0.0, warmup=i < warmup)


async def closed_loop(url: str, concurrency: int, requests: int, prompts: list[str], options: dict | None = None,
                      warmup: int = 0, timeout_s: float = 60.0, protocol: str = "http",
                      on_done=None, t0: float | None = None, seed: int = 0) -> list[RequestRecord]:
    """`concurrency` clients, each sending its next request as soon as its last one ends, until
    `warmup + requests` have been sent; the first `warmup` are marked and left out of statistics. A refused request
    is sent again after its Retry-After (`speak_until_admitted`; `seed` seeds the jitter). Times count from
    `t0` (a `time.perf_counter` reading; by default the call's start): a caller that matches the records against
    stamps taken elsewhere on the same clock passes its own zero."""
    _check(concurrency, requests, prompts, warmup, protocol, options)
    total, counter, out = warmup + requests, iter(range(warmup + requests)), []
    t0 = time.perf_counter() if t0 is None else t0
    rng = random.Random(seed)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=key_headers()) as s:
        async def client():
            for i in counter:  # a shared iterator: each index is taken by exactly one client
                out.append(await speak_until_admitted(s, url, _record("closed", concurrency, i, prompts, warmup),
                                                      options or {}, t0, timeout_s, protocol, rng))
                if on_done:
                    on_done()

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
                    timeout_s: float = 60.0, protocol: str = "http", on_done=None,
                    t0: float | None = None) -> list[RequestRecord]:
    """Sends `warmup + requests` at `rate`/s (fixed gaps or Poisson) regardless of how many are in flight. Times
    count from `t0` (a `time.perf_counter` reading; by default the call's start), as `closed_loop`'s do."""
    _check(1, requests, prompts, warmup, protocol, options)
    mode = "open-poisson" if poisson else "open-fixed"
    offsets = arrival_times(rate, warmup + requests, poisson, seed)
    t0 = time.perf_counter() if t0 is None else t0
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=key_headers()) as s:
        for i, at in enumerate(offsets):
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(
                speak(s, url, _record(mode, rate, i, prompts, warmup), options or {}, t0, timeout_s,
                      protocol=protocol)))
            if on_done:
                tasks[-1].add_done_callback(lambda _: on_done())
        out = await asyncio.gather(*tasks)
    return list(out)


def _check(concurrency, requests, prompts, warmup, protocol="http", options=None):
    if concurrency < 1 or requests < 1 or warmup < 0:
        raise ValueError(f"need concurrency >= 1, requests >= 1, warmup >= 0 (got {concurrency}, {requests}, {warmup})")
    if not prompts:
        raise ValueError("no prompts")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol {protocol!r} is not one of {PROTOCOLS}")
    if protocol == "ws":
        check_ws_options(options or {})


def measured_requests(mode: str, load: float, requests: int) -> int:
    """The requests a condition measures: `requests`, and in a closed loop at least one for each client. With fewer,
    fewer clients than the load ever send, and the verdict would name a load that was never in flight."""
    return max(requests, int(load)) if mode == "closed" else requests


async def run_condition(url: str, mode: str, load: float, requests: int, prompts: list[str],
                        options: dict | None = None, warmup: int = 0, seed: int = 0,
                        timeout_s: float = 60.0, protocol: str = "http", on_done=None,
                        sampler=None) -> list[RequestRecord]:
    """One condition after the server has drained the previous one (so conditions do not overlap); `on_done()`
    is called as each request ends (a progress bar). A `sampler` (`studies.scrape.MetricsSampler`) scrapes the
    server while the load runs, on the records' clock. A closed loop measures `measured_requests`."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    _check(1, requests, prompts, warmup, protocol, options)
    if mode == "closed" and load != int(load):
        raise ValueError(f"closed-loop load is a whole number of clients, got {load}")
    await wait_ready(url, timeout_s=timeout_s, idle=True)
    with collector_paused(), contextlib.ExitStack() as scraping:
        t0 = time.perf_counter()  # after the collector's pass: an open loop's schedule counts from here
        if sampler:
            scraping.enter_context(sampler.running(t0, condition=condition_name(mode, load), load=load))
        if mode == "closed":
            return await closed_loop(url, int(load), measured_requests(mode, load, requests), prompts, options,
                                     warmup, timeout_s, protocol, on_done, t0, seed)
        return await open_loop(url, load, requests, prompts, mode == "open-poisson", options, warmup, seed,
                               timeout_s, protocol, on_done, t0)


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while a condition is measured (on again after): a full pass over the
    records a condition piles up held this client for 60-110 ms, late in a 1,200-request run, and a chunk read
    that late counts as the server's stall (bench/host_serving.py at 60 rps)."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
