"""The speech server on loopback with `tiny-random`: one compiled engine for the module, a fresh app per test."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import gc
import io
import json
import struct
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import pytest_asyncio

from qtts_jax.io.audio import to_int16
from qtts_jax.engine import Engine
from qtts_jax.request import Request
from serving.app import ADMISSION, ENGINE, METRICS, Settings, create_app, drain
from serving.keys import WARMUP_TASK
from serving.schemas import ApiError
from studies.load import server_timing
from support import (ADMIN_KEY, CAPPED_KEY, SCRAPE_KEY, SMALL, SPEAK_KEY, ChildOutput, app_client, assert_same_audio,
                     bearer, hostile_credentials, pcm, wait_ready, wait_warm)

# test_clients' and test_hardening's (2 slots; its programs come from the compilation cache). The chunk schedule and
# multi-frame steps are test_engine's; with a server in front, test_server_voices'.
CONFIG = SMALL
# a generous TTFA target: functional tests must not flake on a slow CI machine (admission has its own tests)
# tiny-random on a CPU may be slower than real time: no real-time limit here (test_admission tests it)
SETTINGS = Settings(slots=CONFIG.slots, context=CONFIG.context, ttfa_target_ms=2000, admission={"starvation_s": 1e9})


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def serve_process():
    """A `qtts-jax serve` subprocess with a small engine (one slot, one step size): the explore notebook's own
    server's configuration (test_studies_server), so that one start loads what the other compiled."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from studies.server import server_command

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "QTTS_DRAIN_TIMEOUT_S": "20"}
    proc = subprocess.Popen(server_command("--model", "tiny-random", "--port", str(port), "--slots", "1", "--context",
                                           "256", engine={"frames_per_step": 1}), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield proc, f"http://127.0.0.1:{port}", ChildOutput(proc)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def engine(model):
    e = Engine(model, CONFIG)
    e.warmup()
    return e


@pytest.fixture(scope="module")
def offline(model):
    """Offline `Model.generate` int16 audio for a request, cached."""
    cache = {}

    def get(text, voice="ryan", seed=0, max_frames=None):
        key = (text, voice, seed, max_frames)
        if key not in cache:
            (res,) = model.generate(Request(text, speaker=voice, seed=seed, max_frames=max_frames))
            cache[key] = (to_int16(res.audio).astype(np.int32), res.frames)
        return cache[key]

    return get


@pytest_asyncio.fixture
async def make_client(aiohttp_client, engine):
    async def make(settings=SETTINGS, ready=True):
        return await app_client(aiohttp_client, settings, engine, ready)

    return make


@pytest_asyncio.fixture
async def client(make_client):
    return await make_client()


async def wait_idle(app, timeout=5.0):
    """Seconds until the server has no stream open and its engine none live or queued (each waited for as an event)."""
    t0 = time.monotonic()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await app[ADMISSION].wait_idle()
    idle = await asyncio.to_thread(app[ENGINE].wait_stats, lambda st: not st.live and not st.queued,
                                   t0 + timeout - time.monotonic())
    if idle and not app[ADMISSION].streams:
        return time.monotonic() - t0
    raise AssertionError(f"slot not freed: active={app[ENGINE].active} open={len(app[ADMISSION].streams)}")


SPEECH = dict(model="tiny-random", voice="ryan")


async def test_health_models_voices_openapi(client):
    r = await client.get("/health")
    assert r.status == 200 and (await r.json())["status"] == "ok"
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "tiny-random"
    voices = (await (await client.get("/v1/audio/voices")).json())["voices"]
    assert {"ryan", "vivian"} <= {v["id"] for v in voices}
    doc = await (await client.get("/openapi.json")).json()
    props = doc["paths"]["/v1/audio/speech"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"input", "voice", "response_format", "speed", "stream_format", "seed", "max_frames"} <= set(
        props["properties"])


async def test_streamed_pcm_and_wav_equal_offline_generate(client, offline):
    text, seed = "Streaming equals offline.", 7
    expected, frames = offline(text, seed=seed, max_frames=12)
    r = await client.post("/v1/audio/speech", json={**SPEECH, "input": text, "seed": seed, "max_frames": 12,
                                                    "response_format": "pcm", "stream": True})
    assert r.status == 200, await r.text()
    assert r.headers["Content-Type"] == "audio/pcm" and r.headers["X-Sample-Rate"] == "24000"
    assert r.headers["Transfer-Encoding"] == "chunked"
    assert len(r.headers["X-Request-Id"]) > 0 and "ttfa;dur=" in r.headers["Server-Timing"]
    timing = server_timing(r.headers["Server-Timing"])  # as the study client reads it
    assert 0 <= timing["intake"] and 0 <= timing["queue"] <= timing["ttfa"]
    sizes, data = [], b""
    async for part in r.content.iter_any():
        sizes.append(len(part))
        data += part
    assert_same_audio(pcm(data), expected)

    r = await client.post("/v1/audio/speech", json={**SPEECH, "input": text, "seed": seed, "max_frames": 12,
                                                    "response_format": "wav", "stream": True},
                          headers={"X-Request-Id": "my-id-1"})
    assert r.headers["X-Request-Id"] == "my-id-1"
    data = await r.read()
    riff, size, wave, _, _, fmt, ch, rate, _, _, bits, tag, dsize = struct.unpack("<4sI4s4sIHHIIHH4sI", data[:44])
    assert (riff, wave, tag, fmt, ch, rate, bits) == (b"RIFF", b"WAVE", b"data", 1, 1, 24000, 16)
    assert size == dsize == 0xFFFFFFFF  # streaming header: length unknown
    assert_same_audio(pcm(data[44:]), expected)


async def test_a_body_without_voice_speaks_the_default_voice(client, offline):
    """`voice` is optional on CustomVoice, as in vLLM-Omni's API: a body without one gets alloy's speaker."""
    from serving.voice.aliases import DEFAULT

    expected, _ = offline("No voice given.", voice=DEFAULT["alloy"], seed=3, max_frames=8)
    r = await client.post("/v1/audio/speech", json={"input": "No voice given.", "seed": 3, "max_frames": 8,
                                                    "response_format": "pcm", "stream": False})
    assert r.status == 200, await r.text()
    assert_same_audio(pcm(await r.read()), expected)


async def test_whole_file_wav_and_sse(client, offline):
    import soundfile as sf

    text = "Whole file please."
    expected, frames = offline(text, voice="vivian", seed=3, max_frames=16)
    body = {**SPEECH, "voice": "vivian", "input": text, "seed": 3, "max_frames": 16, "response_format": "wav"}
    r = await client.post("/v1/audio/speech", json={**body, "stream": False})
    assert r.status == 200 and r.headers["Content-Type"] == "audio/wav"
    data = await r.read()
    assert int(r.headers["Content-Length"]) == len(data)
    timings = json.loads(r.headers["X-Timings"])
    assert timings["first_chunk_ms"] > 0 and timings["total_ms"] >= timings["first_chunk_ms"]
    audio, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == 24000
    assert_same_audio(audio.astype(np.int32), expected)

    r = await client.post("/v1/audio/speech", json={**body, "response_format": "pcm", "stream_format": "sse"})
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in (await r.text()).split("\n") if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done"
    assert events[-1]["frames"] == frames and events[-1]["usage"]["output_tokens"] == frames
    assert events[-1]["timings"]["first_chunk_ms"] is not None
    assert_same_audio(pcm(b"".join(base64.b64decode(e["audio"]) for e in deltas)), expected)


@pytest.mark.parametrize("fmt", ["flac", "mp3", "opus"])
async def test_compressed_formats_stream_and_decode(client, offline, fmt):
    import av

    expected, frames = offline("Compressed.", seed=1, max_frames=10)
    r = await client.post("/v1/audio/speech", json={**SPEECH, "input": "Compressed.", "seed": 1, "max_frames": 10,
                                                    "response_format": fmt, "stream": True})
    assert r.status == 200
    data = await r.read()
    decoded = np.concatenate([f.to_ndarray().reshape(-1) for f in av.open(io.BytesIO(data)).decode(audio=0)])
    if fmt == "flac":  # lossless
        assert_same_audio(decoded.astype(np.int32), expected)
    else:  # lossy: about the right length (codec delay/padding, opus decodes at 48 kHz)
        rate = 48000 if fmt == "opus" else 24000
        assert abs(len(decoded) / rate - frames * 0.08) < 0.2


async def test_parallel_streams_each_equal_solo(client, offline):
    reqs = [("First parallel voice.", "ryan", 11), ("Second one, different.", "eric", 12)]

    async def one(text, voice, seed):
        r = await client.post("/v1/audio/speech", json={**SPEECH, "voice": voice, "input": text, "seed": seed,
                                                        "max_frames": 15, "response_format": "pcm", "stream": True})
        assert r.status == 200, await r.text()
        return pcm(await r.read())

    got = await asyncio.gather(*(one(*q) for q in reqs))
    for (text, voice, seed), audio in zip(reqs, got):
        assert_same_audio(audio, offline(text, voice, seed, 15)[0])


async def test_burst_beyond_capacity_gets_429_with_retry_after_and_no_5xx(client):
    async def one(i):
        r = await client.post("/v1/audio/speech", json={**SPEECH, "input": f"Burst number {i}.", "seed": i,
                                                        "max_frames": 60, "response_format": "pcm", "stream": True})
        return r.status, dict(r.headers), await r.read()

    results = await asyncio.gather(*(one(i) for i in range(10)))
    statuses = [s for s, _, _ in results]
    assert all(s in (200, 429) for s in statuses), statuses
    assert statuses.count(429) >= 4 and statuses.count(200) >= 2
    for status, headers, body in results:
        if status == 429:
            assert int(headers["Retry-After"]) >= 1
            err = json.loads(body)["error"]
            assert err["code"] in ("overloaded", "queue_full") and err["retry_after"] >= 1
        else:
            assert len(body) > 0 and len(body) % 3840 == 0
    await wait_idle(client.app)


async def test_disconnect_cancels_and_frees_the_slot(client):
    app = client.app
    r = await client.post("/v1/audio/speech", json={**SPEECH, "input": "Talk for a long while please.",
                                                    "max_frames": 200, "response_format": "pcm", "stream": True})
    assert r.status == 200
    await r.content.readany()
    assert app[ENGINE].active == 1
    r.close()  # the client goes away mid-stream
    freed_after = await wait_idle(app)
    assert freed_after < 2.0
    metrics = await (await client.get("/metrics")).text()
    assert 'qtts_requests_total{endpoint="/v1/audio/speech",outcome="cancelled"} 1.0' in metrics
    r = await client.post("/v1/audio/speech", json={**SPEECH, "input": "Still here.", "max_frames": 3,
                                                    "response_format": "pcm"})
    assert r.status == 200


async def test_metrics_present(client):
    r = await client.post("/v1/audio/speech", json={**SPEECH, "input": "Measure me.", "max_frames": 20,
                                                    "response_format": "pcm", "stream": True})
    await r.read()
    await (await client.post("/v1/audio/speech", json={"input": 5})).read()
    # gauges read the engine's published snapshot: the finished stream leaves it at the end of the iteration
    # that sent its last bytes, so the client may ask before then
    assert await asyncio.to_thread(client.app[ENGINE].wait_stats, lambda st: not st.live, 5), \
        "the finished stream still counts as active after 5 s"
    text = await (await client.get("/metrics")).text()
    for name in ("qtts_ttfa_seconds_bucket", 'qtts_ttfa_part_seconds_count{part="queue"}',
                 'qtts_ttfa_part_seconds_count{part="prefill"}', 'qtts_ttfa_part_seconds_count{part="codec"}',
                 "qtts_buffer_headroom_seconds_bucket", "qtts_late_chunks_total", "qtts_engine_late_chunks ",
                 "qtts_active_streams 0.0",
                 "qtts_queue_depth 0.0", "qtts_queue_oldest_wait_seconds", "qtts_slot_occupancy",
                 "qtts_step_seconds_count", "qtts_min_headroom_seconds", "qtts_ready 1.0",
                 f"qtts_capacity_streams {float(CONFIG.slots)}", "qtts_compiling_programs 0.0",
                 'qtts_requests_total{endpoint="/v1/audio/speech",outcome="ok"}',
                 'qtts_requests_total{endpoint="/v1/audio/speech",outcome="bad_request"} 1.0'):
        assert name in text, name
    count = float(text.split("qtts_step_seconds_count ")[1].split("\n")[0])
    assert count > 0
    # the one request the engine took was taken in: its intake is timed (the refused one never reached it)
    assert float(text.split("qtts_request_intake_seconds_count ")[1].split("\n")[0]) == 1.0
    assert float(text.split("qtts_request_intake_seconds_sum ")[1].split("\n")[0]) > 0
    before = _gc_passes(text, 2)
    gc.collect()  # a full pass in the server's process, timed like any other
    assert _gc_passes(await (await client.get("/metrics")).text(), 2) >= before + 1


def _gc_passes(metrics: str, generation: int) -> float:
    return float(metrics.split(f'qtts_gc_pause_seconds_count{{generation="{generation}"}} ')[1].split("\n")[0])


def test_collector_pauses_are_counted_by_generation_and_length():
    from serving.monitoring import collector

    clock = iter([0.0, 0.0004, 1.0, 1.03, 2.0, 2.7])
    p = collector.Pauses(clock=lambda: next(clock))
    for generation in (0, 2, 2):
        p("start", {"generation": generation})
        p("stop", {"generation": generation})
    assert p.counts[0][0] == 1 and sum(p.counts[0]) == 1  # 0.4 ms: the first bucket (<= 1 ms)
    assert p.counts[2][collector.BUCKETS.index(0.05)] == 1 and p.counts[2][-1] == 1  # 30 ms; 700 ms: past 0.5 s
    assert p.seconds[2] == pytest.approx(0.73)


BAD = [
    (b"{not json", "body"),
    (b"[1, 2]", "body"),
    (b"", "body"),
    ({"voice": "ryan"}, "input"),
    ({"input": "   ", "voice": "ryan"}, "input"),
    ({"input": "x" * 4097, "voice": "ryan"}, "input"),
    ({"input": 5, "voice": "ryan"}, "input"),
    ({"input": "hi", "voice": "nobody"}, "voice"),
    ({"input": "hi", "voice": {"name": "ryan"}}, "voice"),
    ({"input": "hi", "voice": "ryan", "response_format": "aiff"}, "response_format"),
    ({"input": "hi", "text": "hi", "voice": "ryan"}, "text"),
    ({"input": "hi", "voice": "ryan", "ref_audio": "UklGRg=="}, "ref_audio"),  # cloning needs a Base model
    ({"input": "hi", "voice": "ryan", "speed": 0.2}, "speed"),
    ({"input": "hi", "voice": "ryan", "speed": 9}, "speed"),
    ({"input": "hi", "voice": "ryan", "language": "klingon"}, "language"),
    ({"input": "hi", "voice": "ryan", "temperature": 0}, "temperature"),
    ({"input": "hi", "voice": "ryan", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "voice": "ryan", "temperature": True}, "temperature"),
    (b'{"input": "hi", "voice": "ryan", "temperature": NaN}', "temperature"),
    ({"input": "hi", "voice": "ryan", "top_p": 1.5}, "top_p"),
    ({"input": "hi", "voice": "ryan", "top_k": -1}, "top_k"),
    ({"input": "hi", "voice": "ryan", "top_k": 2.5}, "top_k"),
    ({"input": "hi", "voice": "ryan", "repetition_penalty": 0}, "repetition_penalty"),
    ({"input": "hi", "voice": "ryan", "seed": -1}, "seed"),
    ({"input": "hi", "voice": "ryan", "seed": 2**40}, "seed"),
    ({"input": "hi", "voice": "ryan", "max_frames": 0}, "max_frames"),
    ({"input": "hi", "voice": "ryan", "stream": "yes"}, "stream"),
    ({"input": "hi", "voice": "ryan", "stream_format": "ws"}, "stream_format"),
    ({"input": "hi", "voice": "ryan", "model": "gpt-5"}, "model"),
    ({"input": "hi", "voice": "ryan", "instructions": 5}, "instructions"),
    ({"input": "hi", "voice": "ryan", "chunk_schedule": [3]}, "chunk_schedule"),
    ({"input": "hi", "voice": "ryan", "chunk_schedule": "1,2"}, "chunk_schedule"),
    ({"input": "hi", "voice": "ryan", "frobnicate": 1}, "frobnicate"),
]


async def test_bad_inputs_get_400_naming_the_field(client):
    for body, field in BAD:
        kwargs = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {
            "json": body}
        r = await client.post("/v1/audio/speech", **kwargs)
        assert r.status == 400, (body, r.status, await r.text())
        err = (await r.json())["error"]
        assert err["param"] == field, (body, err)
        assert field in err["message"] and err["code"]
    r = await client.post("/v1/audio/speech", data=b"{" + b" " * 300_000 + b"}",
                          headers={"Content-Type": "application/json"})
    assert r.status == 413 and (await r.json())["error"]["param"] == "body"
    r = await client.get("/v1/audio/nothing")
    assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
    assert client.app[ENGINE].active == 0 and not client.app[ENGINE].stats().queued


async def test_ready_503_until_warm_and_requests_refused(make_client, engine, monkeypatch):
    gate = threading.Event()
    real = engine.warmup
    monkeypatch.setattr(engine, "warmup", lambda **kw: (gate.wait(30), real(**kw)))
    client = await make_client(ready=False)
    try:
        assert (await client.get("/health")).status == 200
        r = await client.get("/ready")
        assert r.status == 503 and (await r.json())["status"] == "warming"
        r = await client.post("/v1/audio/speech", json={**SPEECH, "input": "Too early."})
        assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
        assert (await r.json())["error"]["code"] == "not_ready"
    finally:
        gate.set()
    await wait_ready(client)


async def test_ready_only_at_full_capacity_while_it_serves_the_rungs_it_has(aiohttp_client, model, offline,
                                                                         monkeypatch):
    """A GPU server serves its smallest rung while the larger ones compile in the background: /ready stays 503
    ("warming", with the slots it serves now and the programs left) until every rung is compiled, so a probe or a
    router never counts it at full capacity too early; requests meanwhile are served."""
    fresh = Engine(model, dataclasses.replace(CONFIG, batch_sizes=(1,)))
    gate, real_warmup, real_compile = threading.Event(), fresh.warmup, fresh.runner.compile
    monkeypatch.setattr(fresh, "warmup", lambda background=False: real_warmup(background=True))
    monkeypatch.setattr(fresh.runner, "compile", lambda keys: (
        gate.wait(60) if threading.current_thread().name == "qtts-warmup" else None, real_compile(keys))[1])
    client = await app_client(aiohttp_client, SETTINGS, fresh, ready=False)
    try:
        # /ready tells what is left to compile once the warm-up task has it serving: both waited for as events
        deadline = time.monotonic() + 30
        async with asyncio.timeout(30):
            await asyncio.shield(client.app[WARMUP_TASK])
        await asyncio.to_thread(client.app[ENGINE].wait_stats, lambda st: st.compiling, deadline - time.monotonic())
        r = await client.get("/ready")
        body = await r.json()
        assert r.status == 503 and body["status"] == "warming" and "Retry-After" in r.headers
        assert body["slots"] == 1 < body["slots_configured"] == CONFIG.slots and body["compiling"] > 0
        speech = {**SPEECH, "input": "Served while warming.", "response_format": "pcm"}
        served = await client.post("/v1/audio/speech", json={**speech, "max_frames": 6})
        assert served.status == 200, await served.text()
        assert_same_audio(pcm(await served.read()), offline("Served while warming.", max_frames=6)[0])
    finally:
        gate.set()
    await wait_ready(client)
    body = await (await client.get("/ready")).json()
    assert (body["status"], body["slots"], body["compiling"]) == ("ready", CONFIG.slots, 0)


async def test_a_server_started_without_warmup_leaves_compiles_out_of_its_estimates(aiohttp_client, model, offline,
                                                                                   monkeypatch):
    """`Settings.warmup` off (a quick start): each program compiles when a request first needs it, which takes seconds on
    a real model. Admission has no cost timed before the first request (an untimed cost counts as none), and what
    waited on a compile (the calibration request's first audio, the iterations that compiled) goes into no
    estimate: else it predicts seconds of first audio for every request after it and refuses them."""
    # rungs of one and two rows (the calibration runs one); the programs load from the session's compilation cache...
    fresh = Engine(model, dataclasses.replace(CONFIG, batch_sizes=(1,)))
    lower = fresh.runner.lower

    def compiling_for_a_second(kind, a, b):  # ...so each takes a second more, as a real model's compile does
        lowered = lower(kind, a, b)
        return SimpleNamespace(compile=lambda: (time.sleep(1.0), lowered.compile())[1])

    monkeypatch.setattr(fresh.runner, "lower", compiling_for_a_second)
    assert not (fresh.step_costs or fresh.prefill_costs or fresh.first_costs)
    client = await app_client(aiohttp_client, dataclasses.replace(SETTINGS, warmup=False), fresh)
    text = "No warm-up first."
    speech = {**SPEECH, "input": text, "response_format": "pcm"}
    (expected, _), (longer, _) = offline(text, max_frames=6), offline(text, max_frames=30)
    playing = await client.post("/v1/audio/speech", json={**speech, "max_frames": 30, "stream": True})
    assert playing.status == 200, await playing.text()
    head = await playing.content.readany()
    # a request joins a playing stream: the engine judges what it may admit by a step of two rows, not timed yet
    joining = await client.post("/v1/audio/speech", json={**speech, "max_frames": 6})
    assert joining.status == 200, await joining.text()
    assert_same_audio(pcm(await joining.read()), expected)
    assert_same_audio(pcm(head + await playing.read()), longer)
    for _ in range(2):  # a burst after those compiles, and one after that
        rs = await asyncio.gather(*(client.post("/v1/audio/speech", json={**speech, "max_frames": 6})
                                    for _ in range(CONFIG.slots)))
        for r in rs:
            assert r.status == 200, await r.text()
            assert_same_audio(pcm(await r.read()), expected)
    assert fresh.compiled_on_demand >= 4  # the calls above compiled what a warm-up would have (a second each)
    st = fresh.stats()
    assert max(st.step_costs.values()) < 0.5 and st.iteration_s < 0.5  # no compile's second in them


async def test_drain_refuses_new_work_and_lets_streams_finish(client, offline):
    app = client.app
    expected, _ = offline("Finish me during drain.", seed=2, max_frames=30)
    r = await client.post("/v1/audio/speech", json={**SPEECH, "input": "Finish me during drain.", "seed": 2,
                                                    "max_frames": 30, "response_format": "pcm", "stream": True})
    first = await r.content.readany()
    drained = asyncio.create_task(drain(app, timeout_s=20))  # it stops admitting before the server's next request
    ready = await client.get("/ready")
    assert ready.status == 503 and (await ready.json())["status"] == "draining"
    refused = await client.post("/v1/audio/speech", json={**SPEECH, "input": "New work."})
    assert refused.status == 503 and (await refused.json())["error"]["code"] == "draining"
    assert "Retry-After" in refused.headers
    rest = await r.read()
    assert_same_audio(pcm(first + rest), expected)
    assert await drained is True


async def ws_events(ws, until, timeout=20.0):
    """Collect (events, pcm bytes) until an event satisfies `until`."""
    events, audio = [], b""
    while True:
        msg = await ws.receive(timeout=timeout)
        if msg.type.name == "BINARY":
            audio += msg.data
        elif msg.type.name == "TEXT":
            ev = json.loads(msg.data)
            events.append(ev)
            if until(ev):
                return events, audio
        else:
            return events, audio


async def test_websocket_append_commit_cancel_errors(client, offline):
    app = client.app
    expected, frames = offline("Hello there, agent.", seed=5, max_frames=12)
    ws = await client.ws_connect("/v1/audio/speech/stream")
    hello = await ws.receive_json()
    assert hello["type"] == "session.created" and hello["sample_rate"] == 24000
    # bad inputs are error events naming the field; the socket stays usable
    for msg, field in ((b"not json", "message"), ({"type": "dance"}, "type"),
                       ({"type": "session.update", "session": {"temperature": -1}}, "temperature"),
                       ({"type": "session.update", "session": {"voice": "nobody"}}, "voice"),
                       ({"type": "input_text.commit"}, "text"),
                       ({"type": "input_text.append", "text": 7}, "text")):
        await (ws.send_str(msg.decode()) if isinstance(msg, bytes) else ws.send_json(msg))
        ev = await ws.receive_json()
        assert ev["type"] == "error" and ev["error"]["param"] == field, (msg, ev)
    await ws.send_json({"type": "input_text.append", "text": "no voice yet"})
    await ws.send_json({"type": "input_text.commit"})
    ev = await ws.receive_json()
    assert ev["type"] == "error" and ev["error"]["param"] == "voice"

    await ws.send_json({"type": "session.update", "session": {"voice": "ryan", "seed": 5, "max_frames": 12}})
    assert (await ws.receive_json())["type"] == "session.updated"
    for part in ("Hello there, ", "agent."):
        await ws.send_json({"type": "input_text.append", "text": part})
    await ws.send_json({"type": "input_text.commit"})
    events, audio = await ws_events(ws, lambda e: e["type"] == "utterance.done")
    assert [e["type"] for e in events] == ["utterance.queued", "utterance.started", "utterance.done"]
    done = events[-1]
    assert done["cancelled"] is False and done["frames"] == frames and done["timings"]["first_chunk_ms"] > 0
    assert_same_audio(pcm(audio), expected)

    # second utterance on the same socket, cancelled after its first audio: stops and frees the slot
    await ws.send_json({"type": "session.update", "session": {"max_frames": 200}})
    await ws.receive_json()
    await ws.send_json({"type": "input_text.append", "text": "A long utterance to interrupt."})
    await ws.send_json({"type": "flush"})
    events, audio = await ws_events(ws, lambda e: e["type"] == "utterance.started")
    while not audio:
        msg = await ws.receive(timeout=10)
        audio += msg.data if msg.type.name == "BINARY" else b""
    await ws.send_json({"type": "cancel"})
    events, _ = await ws_events(ws, lambda e: e["type"] == "utterance.done")
    assert events[-1]["cancelled"] is True and events[-1]["frames"] < 200
    await wait_idle(app)

    await ws.send_json({"type": "close"})
    msg = await ws.receive(timeout=5)
    assert msg.type.name in ("CLOSE", "CLOSED") and ws.closed


async def test_websocket_flood_closes_with_policy_violation(make_client):
    client = await make_client(Settings(slots=CONFIG.slots, context=CONFIG.context, ws_max_messages_per_s=5))
    ws = await client.ws_connect("/v1/audio/speech/stream")
    await ws.receive_json()
    for _ in range(20):
        await ws.send_json({"type": "input_text.append", "text": "a"})
    events, _ = await ws_events(ws, lambda e: e["type"] == "error" and e["error"]["code"] == "rate_limited")
    msg = await ws.receive(timeout=5)
    assert msg.type.name == "CLOSE" and msg.data == 1008


async def test_a_request_is_resolved_once_from_validation_to_the_engine(client, monkeypatch):
    """An HTTP request and a WebSocket utterance each resolve their `Request` exactly once: validation, admission
    and the engine all use the `Job` that `Engine.prepare` made from it."""
    real, resolved = Request.resolved, []
    monkeypatch.setattr(Request, "resolved", lambda self, *a: resolved.append(self.text) or real(self, *a))
    r = await client.post("/v1/audio/speech", json={**SPEECH, "input": "Once over HTTP.", "max_frames": 2,
                                                    "response_format": "pcm"})
    assert r.status == 200 and await r.read()
    assert resolved == ["Once over HTTP."]
    ws = await client.ws_connect("/v1/audio/speech/stream")
    await ws.receive_json()
    await ws.send_json({"type": "session.update", "session": {"voice": "ryan", "max_frames": 2}})
    assert (await ws.receive_json())["type"] == "session.updated"
    resolved.clear()  # the session's options were checked with a placeholder text
    await ws.send_json({"type": "input_text.append", "text": "Once over the socket."})
    await ws.send_json({"type": "input_text.commit"})
    events, audio = await ws_events(ws, lambda e: e["type"] == "utterance.done")
    assert audio and not events[-1]["cancelled"]
    assert resolved == ["Once over the socket."]
    await ws.close()


@pytest_asyncio.fixture
async def keyed(make_client, keys_file):
    return await make_client(dataclasses.replace(SETTINGS, api_key="@" + keys_file))


def assert_refused(r, status: int, code: str, body: dict) -> None:
    """A refusal in OpenAI's error shape; a 401 says how to authenticate (RFC 9110)."""
    assert (r.status, body["error"]["code"], body["error"]["type"], body["error"]["param"]) == (
        status, code, "invalid_request_error", None), body
    assert r.headers.get("WWW-Authenticate", "").startswith("Bearer") == (status == 401)


async def test_keys_guard_the_api_voice_changes_and_metrics_before_any_work(keyed, monkeypatch):
    """No key or a wrong one is a 401 on every /v1 route and /metrics, and reaches no engine; a speak key speaks
    but may not change voices or scrape; the page, /health, /ready and /openapi.json stay open."""
    prepared = []
    real = keyed.app[ENGINE].prepare
    monkeypatch.setattr(keyed.app[ENGINE], "prepare", lambda req, *a: prepared.append(req) or real(req, *a))
    for path in ("/health", "/ready", "/", "/docs", "/openapi.json"):
        assert (await keyed.get(path)).status == 200, path
    speech = {**SPEECH, "input": "Keys.", "max_frames": 2, "response_format": "pcm"}
    for headers in ({}, bearer("wrong-key-of-the-tests"), {"Authorization": f"Basic {SPEAK_KEY}"},
                    {"Authorization": SPEAK_KEY}, bearer(SPEAK_KEY[:-1]), bearer(SPEAK_KEY + "x")):
        for method, path in (("POST", "/v1/audio/speech"), ("GET", "/v1/models"), ("GET", "/v1/audio/voices"),
                             ("POST", "/v1/audio/voices"), ("DELETE", "/v1/audio/voices/x"), ("GET", "/metrics"),
                             ("GET", "/v1/no/such/route")):
            r = await keyed.request(method, path, json=speech, headers=headers)
            assert_refused(r, 401, "invalid_api_key", await r.json())
    assert prepared == []
    r = await keyed.post("/v1/audio/speech", json=speech, headers=bearer(SPEAK_KEY))
    assert r.status == 200 and len(await r.read()) == 2 * 1920 * 2 and len(prepared) == 1
    assert (await keyed.get("/v1/models", headers=bearer(SPEAK_KEY))).status == 200
    for method, path in (("POST", "/v1/audio/voices"), ("DELETE", "/v1/audio/voices/x"), ("GET", "/metrics")):
        r = await keyed.request(method, path, json={"name": "x", "audio": "AAAA"}, headers=bearer(SPEAK_KEY))
        assert_refused(r, 403, "insufficient_role", await r.json())
    # an admin key gets past the key check to the route's own answer (a CustomVoice model registers no voice)
    r = await keyed.post("/v1/audio/voices", json={"name": "x", "audio": "AAAA"}, headers=bearer(ADMIN_KEY))
    assert r.status == 400 and (await r.json())["error"]["param"] == "model"
    assert (await keyed.get("/v1/models", headers=bearer(SCRAPE_KEY))).status == 403  # a scraper's key scrapes only
    for key in (ADMIN_KEY, SCRAPE_KEY):
        r = await keyed.get("/metrics", headers=bearer(key))
        assert r.status == 200 and 'outcome="unauthorized"' in await r.text()
    doc = await (await keyed.get("/openapi.json")).json()
    assert doc["paths"]["/v1/audio/speech"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"] and "401" in doc["paths"]["/metrics"]["get"]["responses"]
    assert len(prepared) == 1


async def test_websocket_takes_its_key_as_a_header_or_a_browsers_subprotocol(keyed):
    """No key: the upgrade is refused with a 401. A key as Authorization: Bearer, or as the subprotocol
    qtts-key.KEY, which the server answers (`qtts` when offered beside it) so a browser's handshake completes."""
    from aiohttp import WSServerHandshakeError

    for kw in ({}, {"protocols": ("qtts",)}, {"protocols": ("qtts-key.wrong-key-of-the-tests",)},
               {"protocols": (f"qtts-key.{SPEAK_KEY}",), "headers": bearer(SPEAK_KEY)}):  # two keys: which one?
        with pytest.raises(WSServerHandshakeError) as err:
            await keyed.ws_connect("/v1/audio/speech/stream", **kw)
        assert err.value.status == 401, kw
    for kw, answer in (({"headers": bearer(SPEAK_KEY)}, None), ({"protocols": ("qtts", f"qtts-key.{SPEAK_KEY}")}, "qtts"),
                       ({"protocols": (f"qtts-key.{SPEAK_KEY}",)}, f"qtts-key.{SPEAK_KEY}")):
        ws = await keyed.ws_connect("/v1/audio/speech/stream", **kw)
        assert ws.protocol == answer and (await ws.receive_json())["type"] == "session.created"
        await ws.close()


async def test_credentials_are_ignored_where_keys_are_off(client):
    """A server without keys (on loopback) serves whatever credentials come: the hostile ones test_hardening sends
    to a server with keys, but for those aiohttp's client will not send (a NUL) or no request may have (a header
    longer than 16 KiB: test_hardening's server refuses it)."""
    from multidict import CIMultiDict

    for lines in hostile_credentials(SPEAK_KEY):
        if any(len(value) > 16384 or b"\x00" in value for _, value in lines):
            continue
        headers = CIMultiDict((name.decode(), value.decode("latin-1")) for name, value in lines)
        r = await client.get("/v1/models", headers=headers)
        assert r.status == 200 and "WWW-Authenticate" not in r.headers, (lines, r.status)


async def test_a_keys_stream_cap_refuses_one_more_with_429_and_retry_after(keyed):
    """A key capped at one stream: while its WebSocket session is open, its speech request is a 429 (other keys
    are not held back), and once the session closes it speaks again."""
    speech = {**SPEECH, "input": "Capped.", "max_frames": 1, "response_format": "pcm"}
    ws = await keyed.ws_connect("/v1/audio/speech/stream", headers=bearer(CAPPED_KEY))
    await ws.receive_json()
    r = await keyed.post("/v1/audio/speech", json=speech, headers=bearer(CAPPED_KEY))
    body = await r.json()
    assert (r.status, body["error"]["code"], body["error"]["type"]) == (429, "too_many_streams", "rate_limit_error")
    assert r.headers["Retry-After"] == "1"
    assert (await keyed.post("/v1/audio/speech", json=speech, headers=bearer(SPEAK_KEY))).status == 200
    await ws.close()
    # the key's count drops when the server's handler returns, a moment after the close handshake: no event says when
    for _ in range(100):
        r = await keyed.post("/v1/audio/speech", json=speech, headers=bearer(CAPPED_KEY))
        if r.status != 429:
            break
        await asyncio.sleep(0.02)
    assert r.status == 200


@pytest.fixture
def live_server(engine):
    """The app on a real loopback socket, served from its own thread and event loop (for sync clients)."""
    from aiohttp import web

    started, stop, info = threading.Event(), None, {}

    def serve():
        nonlocal stop
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        app = create_app(SETTINGS, engine=engine)
        runner = web.AppRunner(app, handler_cancellation=True)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        info["port"] = runner.addresses[0][1]
        info["app"], info["loop"] = app, loop
        stop = asyncio.Event()
        started.set()
        loop.run_until_complete(stop.wait())
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(30)
    import urllib.request

    wait_warm(info["app"], info["loop"])
    assert urllib.request.urlopen(f"http://127.0.0.1:{info['port']}/ready", timeout=5).status == 200
    yield info
    info["loop"].call_soon_threadsafe(stop.set)
    thread.join(30)


def test_fuzzed_bodies_never_get_5xx(live_server):
    """Hypothesis-generated bodies (valid and not) against the live server: always 2xx/4xx, errors as JSON."""
    import http.client

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from serving.audio.encoders import FORMATS

    port = live_server["port"]
    junk = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=4)
    valid_fields = {
        "response_format": st.sampled_from(FORMATS),
        "speed": st.sampled_from([1.0, 1, 0.5, 2.0]),
        "sample_rate": st.sampled_from([8000, 16000, 22050, 24000, 44100, 48000]),
        "non_streaming_mode": st.booleans(),
        "stream": st.booleans(),
        "stream_format": st.sampled_from(["audio", "sse"]),
        "language": st.sampled_from(["auto", "english", "Chinese"]),
        "seed": st.integers(0, 2**32 - 1),
        "temperature": st.floats(0.1, 2),
        "top_k": st.integers(0, 100),
        "top_p": st.floats(0.05, 1),
        "repetition_penalty": st.floats(0.5, 2),
        "instructions": st.text(max_size=20),
        "chunk_schedule": st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=4),
        "greedy": st.booleans(),
        "model": st.sampled_from(["tiny-random", "tts-1"]),
    }
    valid = st.fixed_dictionaries(
        {"input": st.text(min_size=1, max_size=24).filter(str.strip),
         "voice": st.sampled_from(["ryan", "Eric", {"id": "vivian"}]), "max_frames": st.integers(1, 4)},
        optional=valid_fields)
    keys = sorted(valid_fields) + ["input", "voice", "max_frames", "extra", ""]

    def mutate(pair):
        body, change = pair
        if change is not None:
            key, value = change
            body = {**body, key: value}
        return body

    bodies = st.tuples(valid, st.none() | st.tuples(st.sampled_from(keys), junk)).map(mutate) | junk

    @settings(max_examples=120, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(body=bodies, raw=st.none() | st.binary(max_size=40))
    def check(body, raw):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            data = raw if raw is not None else json.dumps(body).encode()
            conn.request("POST", "/v1/audio/speech", body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            payload = resp.read()
        finally:
            conn.close()
        assert resp.status < 500, (body, resp.status, payload[:300])
        if resp.status >= 400:
            err = json.loads(payload)["error"]
            assert err["code"] and err["message"]
            if resp.status == 400:
                assert err["param"], err

    check()
    metrics = live_server["app"][METRICS].registry
    outcomes = {o: metrics.get_sample_value("qtts_requests_total", {"endpoint": "/v1/audio/speech", "outcome": o})
                for o in ("ok", "bad_request")}
    assert all(v and v > 0 for v in outcomes.values()), outcomes  # both valid and invalid bodies were exercised


def test_serve_cli_sigterm_drains_and_exits_0(serve_process):
    """A real `qtts-jax serve` process: ready, then SIGTERM mid-stream -> /ready 503, the stream finishes, exit 0."""
    import signal
    import urllib.error
    import urllib.request

    proc, base, output = serve_process
    assert output.wait_for("ready after", 120), "server not ready: " + output.text(0)[-2000:]
    # ready, and done compiling (the stream is to last, not the compile): a CPU server compiles all before it is ready
    with urllib.request.urlopen(base + "/ready", timeout=5) as r:
        assert r.status == 200 and json.loads(r.read())["compiling"] == 0
    # once warm, the process froze startup's objects out of the collector's passes (which stall the engine loop)
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        (frozen,) = [line.split()[1] for line in r.read().decode().splitlines()
                     if line.startswith("qtts_gc_frozen_objects ")]
    assert float(frozen) > 0
    body = json.dumps({"input": "Drain me.", "voice": "ryan", "max_frames": 60, "response_format": "pcm",
                       "stream": True}).encode()
    resp = urllib.request.urlopen(urllib.request.Request(base + "/v1/audio/speech", data=body,
                                                         headers={"Content-Type": "application/json"}))
    first = resp.read1(3840)
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while True:  # /ready stays 200 until the server's event loop has taken the signal, then says why it is not
        try:
            urllib.request.urlopen(base + "/ready", timeout=5)
        except urllib.error.HTTPError as err:
            answer = (err.code, json.loads(err.read())["status"])
            break
        assert time.monotonic() < deadline, "still ready 10 s after SIGTERM"
    assert answer == (503, "draining")
    rest = resp.read()
    assert len(first + rest) == 60 * 3840  # the in-flight stream finished in full
    assert proc.wait(timeout=30) == 0


# every coroutine test runs on pytest-asyncio (strict mode); sync tests stay unmarked
for _name, _obj in list(globals().items()):
    if _name.startswith("test_") and asyncio.iscoroutinefunction(_obj):
        globals()[_name] = pytest.mark.asyncio(_obj)
