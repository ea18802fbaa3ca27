"""HTTP endpoints: speech (whole file, chunked audio, SSE), health/readiness, models, voices, OpenAPI, metrics.

Status and headers are decided before `prepare()`: a streamed response waits for its first chunk, so a
failure before any audio is still a proper JSON error and the headers can carry the first-audio timings.
After that, an engine error ends an SSE stream with an `error` event and aborts a raw audio stream
(the client sees a truncated transfer, never a silently short file).
"""

from __future__ import annotations

import base64
import json
import re
import time
import uuid

import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from serving.audio.encoders import CONTENT_TYPES, SAMPLE_FORMATS
from serving.audio.out import StreamOut, awhole
from serving.errors import ApiError
from serving.http_api import auth, voice_routes
from serving.keys import (ADMISSION, ALIASES, API_KEYS, ENGINE, METRICS, MODEL, REQUEST_ID, SERVED_NAMES, SETTINGS,
                          VOICES, WARMUP_ERROR)
from serving.schemas import (OPENAI_MODEL_ALIASES, SpeechParams, base64_chars, parse_speech, read_json,
                             speech_options, speech_schema)
from serving.text import script
from serving.utterance import Utterance

_RID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def request_id(request: web.Request) -> str:
    rid = request.headers.get("X-Request-Id", "")
    rid = rid if _RID.match(rid) else uuid.uuid4().hex
    request[REQUEST_ID] = rid
    return rid


def _server_timing(t: dict) -> str:
    names = (("intake", "intake_ms"), ("queue", "queue_ms"), ("prefill", "prefill_ms"),
             ("first_frame", "first_frame_ms"), ("ttfa", "first_chunk_ms"), ("total", "total_ms"))
    return ", ".join(f"{n};dur={t[k]}" for n, k in names if t.get(k) is not None)


def _audio_headers(p: SpeechParams, rid: str, u: Utterance) -> dict:
    t, fmt = u.timings(), p.response_format
    h = {"Content-Type": CONTENT_TYPES[fmt], "X-Request-Id": rid, "X-Sample-Rate": str(p.sample_rate),
         "X-Channels": "1", "Server-Timing": _server_timing(t), "Cache-Control": "no-store"}
    if fmt in SAMPLE_FORMATS:
        h["X-Sample-Format"] = SAMPLE_FORMATS[fmt]
    if t.get("first_chunk_ms") is not None:
        h["X-TTFA-Ms"] = str(t["first_chunk_ms"])
    return h


async def speech(request: web.Request) -> web.StreamResponse:
    app = request.app
    started = time.perf_counter()
    rid = request_id(request)
    settings, model = app[SETTINGS], app[MODEL]
    # a Base model's body may carry a base64 ref_audio as large as a registration's recording
    limit = settings.max_body_bytes + (base64_chars(settings.max_voice_upload_bytes) if VOICES in app else 0)
    opts = speech_options(await read_json(request, limit), model=model, max_input_chars=settings.max_input_chars,
                          max_ref_audio_bytes=settings.max_voice_upload_bytes)
    prompt = None
    if "ref_audio" in opts:
        ref_text = None if opts.get("x_vector_only_mode") else opts.get("ref_text")
        prompt = await voice_routes.inline_voice(app, opts["ref_audio"], ref_text)
    s = script.build({k: v for k, v in opts.items() if k not in ("ref_audio", "ref_text", "_dialect")},
                     engine=app[ENGINE], served_names=app[SERVED_NAMES], voices=app.get(VOICES), aliases=app[ALIASES],
                     prompt=prompt)
    p = parse_speech(opts)
    u = Utterance(app, s, rid, "/v1/audio/speech", started, speed=p.speed, rate=p.sample_rate,
                  words=p.word_timestamps and p.stream_format == "sse")
    try:
        if not p.stream:
            return await _whole(request, u, p)
        if p.stream_format == "sse":
            return await _sse(request, u, p)
        return await _chunked(request, u, p)
    finally:
        u.close()


def _engine_error(u: Utterance) -> ApiError:
    if u.error and u.error.startswith("engine failure"):
        return ApiError(500, "engine_error", u.error)
    return ApiError(503, "cancelled", f"the request ended before any audio: {u.error}", retry_after=1)


async def _whole(request, u: Utterance, p: SpeechParams) -> web.Response:
    parts = [pcm async for pcm in u.chunks()]
    if u.error is not None:
        raise _engine_error(u)
    audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    data = await awhole(p.response_format, audio, p.sample_rate, p.speed)
    headers = _audio_headers(p, u.rid, u)
    headers["X-Audio-Frames"] = str(u.frames)
    headers["X-Timings"] = json.dumps(u.timings(), separators=(",", ":"))
    if u.samples:  # real-time factor as the batched Rust server reports it: seconds taken per second of audio
        headers["X-RTF"] = f"{(time.perf_counter() - u.started) / u.audio_seconds:.4f}"
    for name, value in _usage(u).items():  # vLLM-Omni's usage headers
        headers[f"x-vllm-omni-{name.replace('_', '-')}"] = str(value)
    ctype = headers.pop("Content-Type")
    return web.Response(body=data, headers=headers, content_type=ctype.split(";")[0])


async def _first(u: Utterance):
    """The first PCM chunk (or None if the stream ended without audio), before any byte is sent."""
    it = u.chunks()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        first = None
    return it, first


def _usage(u: Utterance) -> dict:
    """Tokens as vLLM-Omni counts them: text in (characters here), codec frames out."""
    chars = u.script.chars
    return {"input_tokens": chars, "output_tokens": u.frames, "total_tokens": chars + u.frames}


async def _chunked(request, u: Utterance, p: SpeechParams) -> web.StreamResponse:
    it, first = await _first(u)
    if first is None and u.error is not None:
        raise _engine_error(u)
    headers = _audio_headers(p, u.rid, u)
    if p.response_format in ("pcm", "wav"):  # what the batched Rust server's streaming clients read
        headers["X-Audio-Format"] = f"pcm-s16le-{p.sample_rate}-mono"
    resp = web.StreamResponse(headers=headers)
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    enc = StreamOut(p.response_format, p.sample_rate, p.speed, u.script.max_samples(p.speed))
    if first is not None:
        await _write(resp, await enc.aencode(first))
        async for pcm in it:
            await _write(resp, await enc.aencode(pcm))
    if u.error is not None:  # mid-stream failure: abort so the client sees a truncated transfer
        if request.transport is not None:
            request.transport.close()
        return resp
    await _write(resp, await enc.afinish())
    await resp.write_eof()
    return resp


async def _write(resp, data: bytes) -> None:
    if data:
        await resp.write(data)


def _sse_event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _sse(request, u: Utterance, p: SpeechParams) -> web.StreamResponse:
    it, first = await _first(u)
    if first is None and u.error is not None:
        raise _engine_error(u)
    headers = _audio_headers(p, u.rid, u)
    headers["Content-Type"] = "text/event-stream"
    headers["X-Audio-Format"] = p.response_format
    resp = web.StreamResponse(headers=headers)
    await resp.prepare(request)
    enc = StreamOut(p.response_format, p.sample_rate, p.speed)

    async def delta(data: bytes):
        if data:
            await resp.write(_sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode(),
                                         "response_format": p.response_format}))
        if words := u.take_words():  # after the audio of the part they belong to
            await resp.write(_sse_event({"type": "speech.words", "words": words}))

    if first is not None:
        await delta(await enc.aencode(first))
        async for pcm in it:
            await delta(await enc.aencode(pcm))
    if u.error is not None:
        await resp.write(_sse_event({"type": "error", "error": {"code": "engine_error", "message": u.error}}))
    else:
        await delta(await enc.afinish())
        done = {"type": "speech.audio.done", "usage": _usage(u)}
        done.update(u.summary())
        await resp.write(_sse_event(done))
    await resp.write_eof()
    return resp


async def health(request):
    """Liveness, plus the load figures the batched Rust server's clients read (queue_depth, max_batch)."""
    stats = request.app[ENGINE].stats()
    return web.json_response({"status": "ok", "queue_depth": stats.queued, "max_batch": stats.slots,
                              "active": stats.live})


async def ready(request):
    """200 only at full capacity: warmed up and every rung of the configured slots compiled. Before that the server
    may already serve the rungs it has (503 "warming", with its progress), so a router or a probe never counts a
    replica that would refuse most of its share."""
    app = request.app
    admission = app[ADMISSION]
    if admission.accepting:
        stats = app[ENGINE].stats()  # the engine's published snapshot: its slots and queue are its thread's
        body = {"slots": stats.slots, "active": stats.live, "queued": stats.queued, "compiling": stats.compiling}
        if not stats.compiling:
            return web.json_response({"status": "ready", **body})
        return web.json_response({"status": "warming", "slots_configured": app[ENGINE].config.slots, **body},
                                 status=503, headers={"Retry-After": "5"})
    status = "draining" if admission.draining else ("failed" if app[WARMUP_ERROR] else
                                                "restarting" if not admission.core_up else "warming")
    body = {"status": status}
    if app[WARMUP_ERROR]:
        body["error"] = app[WARMUP_ERROR][0]
    return web.json_response(body, status=503, headers={"Retry-After": "5"})


def _model_card(app, model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "qtts-jax", "info": app[MODEL].info()}


async def models(request):
    app = request.app
    return web.json_response({"object": "list", "data": [_model_card(app, app[MODEL].info()["model"])]})


async def model(request):
    """One model by id: the served one, or an OpenAI model name that requests may use for it."""
    app, model_id = request.app, request.match_info["model_id"]
    if model_id not in app[SERVED_NAMES] + OPENAI_MODEL_ALIASES:
        raise ApiError(404, "model_not_found", f"model {model_id!r} is not served here; this server serves "
                                               f"{app[SERVED_NAMES][0]!r}", "model")
    return web.json_response(_model_card(app, model_id))


async def voices(request):
    app = request.app
    store, table = app.get(VOICES), app[ALIASES]
    aliases = [{"id": name, "voice": target, "available": store is None or target in store}
               for name, target in sorted(table.items())]
    if store is not None:
        return web.json_response({"voices": store.describe(), "aliases": aliases})
    info = app[MODEL].info()
    return web.json_response({"voices": [
        {"id": s, "name": s, "languages": info["languages"], "model": info["model"]} for s in info["speakers"]],
        "aliases": aliases})


async def metrics(request):
    return web.Response(body=exposition(request.app), headers={"Content-Type": CONTENT_TYPE_LATEST})


def exposition(app) -> bytes:
    """The app's Prometheus metrics as text (what /metrics answers; a fleet replica hands it to the front)."""
    m = app[METRICS]
    m.collect_steps()
    return generate_latest(m.registry)


async def openapi(request):
    return web.json_response(openapi_document(request.app))


def openapi_document(app) -> dict:
    settings = app[SETTINGS]
    err = {"description": "JSON error naming the field", "content": {"application/json": {"schema": {
        "type": "object", "properties": {"error": {"type": "object", "properties": {
            "message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": "string"},
            "param": {"type": "string", "nullable": True}}}}}}}}
    audio = {ct: {"schema": {"type": "string", "format": "binary"}} for ct in sorted(set(CONTENT_TYPES.values()))}
    audio["text/event-stream"] = {"schema": {"type": "string"}}
    simple = {"200": {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}}
    doc = {
        "openapi": "3.0.3",
        "info": {"title": "qtts-jax speech server", "version": "0.1.0"},
        "paths": {
            "/v1/audio/speech": {"post": {
                "operationId": "createSpeech",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": speech_schema(settings.max_input_chars, settings.max_voice_upload_bytes)}}},
                "responses": {"200": {"description": "Audio (whole file, chunked stream or SSE)", "content": audio},
                              "400": err, "413": err, "429": err, "503": err}}},
            "/health": {"get": {"operationId": "health", "responses": simple}},
            "/ready": {"get": {"operationId": "ready", "responses": {**simple, "503": err}}},
            "/v1/models": {"get": {"operationId": "listModels", "responses": simple}},
            "/v1/models/{model_id}": {
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "get": {"operationId": "getModel", "responses": {**simple, "404": err}}},
            "/v1/audio/voices": {
                "get": {"operationId": "listVoices", "responses": simple},
                "post": {"operationId": "registerVoice", "requestBody": {"required": True, "content": {
                    "multipart/form-data": {"schema": voice_routes.FORM_SCHEMA},
                    "application/json": {"schema": voice_routes.FORM_SCHEMA}}},
                    "responses": {"201": simple["200"], "400": err, "409": err, "413": err}}},
            "/v1/audio/voices/{name}": {
                "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
                "get": {"operationId": "getVoice", "responses": {**simple, "404": err}},
                "delete": {"operationId": "deleteVoice", "responses": {**simple, "404": err}}},
            "/metrics": {"get": {"operationId": "metrics", "responses": {"200": {
                "description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        },
    }
    keyring = app[API_KEYS]
    if keyring.on:  # the operations that need a key say so, with the answers a key's absence or role gets
        doc["components"] = {"securitySchemes": {"bearer": {
            "type": "http", "scheme": "bearer", "description": "An API key: Authorization: Bearer KEY (a "
            f"browser's WebSocket: the subprotocol {auth.KEY_PROTOCOL}KEY)"}}}
        for path, item in doc["paths"].items():
            for method, op in item.items():
                if method != "parameters" and auth.needs(method.upper(), path, keyring.public_metrics):
                    op["security"] = [{"bearer": []}]
                    op["responses"].update({"401": err, "403": err})
    return doc


def setup(app: web.Application) -> None:
    r = app.router
    r.add_post("/v1/audio/speech", speech)
    r.add_get("/health", health)
    r.add_get("/ready", ready)
    r.add_get("/v1/models", models)
    r.add_get("/v1/models/{model_id:.+}", model)  # Hugging Face ids have a slash
    r.add_get("/v1/audio/voices", voices)
    voice_routes.setup(app)
    r.add_get("/openapi.json", openapi)
    r.add_get("/metrics", metrics)
