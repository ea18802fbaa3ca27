"""aiohttp app factory: the engine's life in a cleanup_ctx, the routes, JSON errors, drain.

The engine compiles and warms up in a background task, so `/health` answers at once and `/ready` turns
200 only after warmup and one calibration request (which seeds admission's step-time estimate).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import time
import weakref
from functools import partial
from pathlib import Path

from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from qtts_jax.engine import compile_cache, sizing
from serving.bridge import AsyncEngine
from qtts_jax.engine import Engine
from qtts_jax.engine.core_client import CoreClient
from qtts_jax.engine.core_process import CoreSpec
from qtts_jax.request import Request
from serving.errors import ApiError
from serving.http_api import auth, page, routes
from serving.http_api.connections import LimitedAppRunner
from serving.keys import (ADMISSION, ALIASES, API_KEYS, BRIDGE, ENGINE, METRICS, MODEL, REQUEST_ID, SERVED_NAMES,
                          SETTINGS, SOCKETS, VOICE_WARMUP, VOICES, WARMUP_ERROR, WARMUP_TASK)
from serving.monitoring.collector import freeze_startup
from serving.monitoring.metrics import Metrics
from serving.admission import Admission
from serving.schemas import served_names
from serving.settings import Settings
from serving.sockets import ws
from serving.voice import aliases
from serving.voice.store import VoiceStore

log = logging.getLogger("serving")
# Python's thread switch interval in a serving process (5 ms by default): the engine thread, back from a device call,
# waits up to this for the GIL while the event loop takes a burst; 0.1 ms measured best (docs/serving.md, the GIL)
SWITCH_INTERVAL_S = 1e-4


def json_error(err: ApiError, request_id: str | None = None) -> web.Response:
    headers = err.headers()
    if request_id:
        headers["X-Request-Id"] = request_id
    return web.json_response(err.body(), status=err.status, headers=headers)


def _outcome(status: int) -> str:
    return {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "bad_method", 409: "conflict", 413: "too_large", 429: "rejected",
            503: "unavailable"}.get(status, "error" if status >= 500 else "client_error")


@web.middleware
async def error_middleware(request: web.Request, handler):
    resource = request.match_info.route.resource  # None: no endpoint has this path (404) or method (405)
    endpoint = resource.canonical if resource else None
    metrics = request.app[METRICS]

    def count(status: int, outcome: str) -> None:
        if endpoint is None:  # not an endpoint: counted apart, so `endpoint` stays a bounded set of routes
            metrics.unrouted.labels(str(status)).inc()
        else:
            metrics.requests.labels(endpoint, outcome).inc()
    try:
        return await handler(request)
    except ApiError as err:
        count(err.status, _outcome(err.status))
        return json_error(err, request.get(REQUEST_ID))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        field = "body" if exc.status == 413 else None
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(exc.status, "http_error")
        msg = exc.reason if exc.status != 413 else f"request body too large: {exc.text}"
        count(exc.status, _outcome(exc.status))
        return json_error(ApiError(exc.status, code, msg, field), request.get(REQUEST_ID))
    except (RequestPayloadError, HttpProcessingError) as exc:
        # the body itself is malformed (Content-Encoding, chunking, a multipart part's headers): the client's fault
        reason = getattr(exc, "message", None) or str(exc).strip().splitlines()[-1].strip()
        count(400, "bad_request")
        resp = json_error(ApiError(400, "invalid_body", f"body: could not be read ({reason[:200]})", "body"),
                          request.get(REQUEST_ID))
        request.content.feed_eof()  # the rest is unreadable: do not drain it, close the connection instead
        resp.force_close()
        return resp
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error in %s", endpoint)
        count(500, "error")
        return json_error(ApiError(500, "internal_error", "internal server error"), request.get(REQUEST_ID))


@web.middleware
async def key_middleware(request: web.Request, handler):
    """The request's API key, checked before its handler reads a byte of it (serving/http_api/auth.py); a speech request
    or WebSocket session counts against its key's stream cap while it runs."""
    keyring, headers = request.app[API_KEYS], request.headers
    protocols = headers.getall(hdrs.SEC_WEBSOCKET_PROTOCOL, []) if request.path == auth.SOCKET else []
    key = keyring.check(request.method, request.path, headers.getall(hdrs.AUTHORIZATION, []), protocols)
    if (request.method, request.path) not in auth.STREAMS:
        return await handler(request)
    with keyring.stream(key):
        return await handler(request)


def create_app(settings: Settings = Settings(), model=None, engine: Engine | CoreClient | None = None) -> web.Application:
    """The server. Without `engine` or `model`, its engine core runs in a process of its own (`serve`), which loads
    `settings.model` and sizes the slots there: this process never touches the device. Pass an already built (and
    possibly warmed) `engine`, or a loaded `model`, to run the core on a thread here instead (tests; an `Engine` may
    be shared between apps). Raises ValueError when the API keys are missing or malformed (serving/http_api/auth.py), before
    loading anything, and SlotsDoNotFit (before any state is allocated) when the asked-for count does not fit."""
    keyring = auth.keyring(settings)
    if engine is None and model is None:
        engine = CoreClient.spawn(CoreSpec(settings.model, settings.dtype,
                                           dataclasses.replace(settings, slots=1).engine_config(), settings.slots,
                                           settings.compile_cache))
        settings = dataclasses.replace(settings, slots=engine.config.slots)
    elif engine is None:
        slots, fit = sizing.resolve_slots(model, dataclasses.replace(settings, slots=1).engine_config(), settings.slots)
        log.info("slots: %d (%s)", slots, fit.describe())
        settings = dataclasses.replace(settings, slots=slots)
        engine = Engine(model, settings.engine_config())
    if not isinstance(engine, CoreClient):
        engine = CoreClient.in_process(engine)
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[error_middleware, key_middleware],
                          handler_args={"max_field_size": 16384})
    app[SETTINGS] = settings
    app[API_KEYS] = keyring
    app[MODEL] = engine.model
    app[SERVED_NAMES] = served_names(engine.model)
    cfg = engine.model.cfg
    app[ALIASES] = aliases.table(settings.voice_aliases, cfg.model_type, cfg.speakers)  # ValueError if wrong
    app[ENGINE] = engine
    app[BRIDGE] = AsyncEngine(engine)
    app[ADMISSION] = Admission(engine, settings.admission_config())
    engine.on_up = partial(_core_up, app[ADMISSION])
    app[METRICS] = Metrics(engine, app[ADMISSION], model=engine.model.name, info=_build_info(settings, engine))
    app[SOCKETS] = weakref.WeakSet()
    app[WARMUP_ERROR] = []
    app[VOICE_WARMUP] = []
    encoders = engine.model.voice_encoders
    if encoders is not None:
        store = VoiceStore(Path(settings.voices_dir), encoders.fingerprint(), settings.max_voices)
        store.load()
        app[VOICES] = store
    app.cleanup_ctx.append(_engine_ctx)
    app.on_shutdown.append(_close_sockets)
    routes.setup(app)
    ws.setup(app)
    page.setup(app)  # the page at / and the API docs at /docs
    return app


def _core_up(admission: Admission, up: bool) -> None:
    """The engine core died (False: `/ready` 503, admission refuses) or is back after its restart (True)."""
    admission.core_up = up


def _build_info(settings: Settings, engine: CoreClient) -> dict[str, str]:
    """The build and configuration a scrape should see beside the numbers (the `qtts_build` info metric)."""
    from importlib import metadata

    import jax
    import jax.numpy as jnp

    try:
        version = metadata.version("qtts-jax")
    except metadata.PackageNotFoundError:
        version = "unknown"
    cfg = engine.config
    return {"version": version, "jax": jax.__version__, "backend": engine.backend, "model": engine.model.name,
            "model_type": engine.model.cfg.model_type, "dtype": jnp.dtype(engine.model.dtype).name,
            "slots": str(cfg.slots),
            "context": str(cfg.context), "frames_per_step": str(cfg.frames_per_step),
            "ttfa_target_ms": f"{settings.ttfa_target_ms:g}",
            "starvation_ms": f"{settings.admission_config().starvation_s * 1000:g}"}


async def _engine_ctx(app: web.Application):
    app[WARMUP_TASK] = asyncio.create_task(_warm_up(app))
    yield
    app[ADMISSION].draining = True
    task = app[WARMUP_TASK]
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    await app[BRIDGE].stop()


async def _warm_up(app: web.Application) -> None:
    """Compile + warm, start the loop, run one short calibration request, then report ready."""
    engine, settings, admission = app[ENGINE], app[SETTINGS], app[ADMISSION]
    t0 = time.perf_counter()
    try:
        await app[BRIDGE].start(warmup=settings.warmup)
        cfg = engine.model.cfg
        speaker = sorted(cfg.speakers)[0] if cfg.model_type == "custom_voice" else None
        stored = app[VOICES].voices() if VOICES in app else []
        voice = stored[0].prompt if stored else None  # a Base model calibrates once it has a voice
        if cfg.model_type != "base" or voice is not None:
            req = Request("Warm up.", speaker=speaker, voice=voice, max_frames=4, greedy=True, subtalker_greedy=True)
            stream = app[BRIDGE].submit(engine.prepare(req))
            async for _ in stream:
                pass
            admission.observe(stream.timings)
        cache = await asyncio.get_running_loop().run_in_executor(None, engine.compile_summary)  # the core's
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # keep /health up and say why /ready stays 503
        log.exception("warmup failed")
        app[WARMUP_ERROR].append(str(exc))
        return
    admission.ready = True
    st = engine.stats()
    log.info("ready after %.1f s (slots=%d; %s)%s", time.perf_counter() - t0, engine.config.slots,
             cache, f"; {st.compiling} programs of the larger rungs still compiling, serving "
             f"{st.slots} streams until they are" if st.compiling else "")
    if VOICES in app and settings.warm_voice_encoders:  # in the background: serving starts now
        app[VOICE_WARMUP].append(asyncio.get_running_loop().run_in_executor(None, _warm_voices, app))


def _warm_voices(app: web.Application) -> None:
    """Compile the encoders for every recording length bucket (so registering never waits for XLA), then
    prepare the codec state of stored ICL voices (so their first request does not stall the engine)."""
    engine, settings = app[ENGINE], app[SETTINGS]
    engine.model.voice_encoders.warmup(settings.voice_max_seconds, settings.voice_trailing_silence_ms / 1000)
    icl = [v.prompt.ref_codes for v in app[VOICES].voices() if v.prompt.ref_codes is not None]
    for codes in icl[: engine.config.cached_voices]:
        engine.prepare_voice(codes)
    log.info("voice encoders compiled; %d stored ICL voices prepared", min(len(icl), engine.config.cached_voices))


async def _close_sockets(app: web.Application) -> None:
    for sock in list(app[SOCKETS]):
        await sock.close(code=1001, message=b"server shutdown")


async def drain(app: web.Application, timeout_s: float | None = None) -> bool:
    """Stop admitting (ready -> 503), wait for open streams to finish up to the deadline. True if all did."""
    admission = app[ADMISSION]
    admission.draining = True
    timeout_s = app[SETTINGS].drain_timeout_s if timeout_s is None else timeout_s
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(admission.wait_idle(), timeout_s)
    return not admission.streams


def serve_alone(app: web.Application) -> None:
    """For a process that serves `app` alone (`run`, a fleet replica; not the tests, which host app after app).
    Call before the app starts.

    - The garbage collector: startup's objects leave its passes once the warm-up lets it serve, and again once
      the engine's background warm-up has compiled the larger rungs (`Engine.on_compiled`).
    - The GIL: Python's switch interval becomes `SWITCH_INTERVAL_S`."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app[ENGINE].on_compiled = freeze_startup

    async def on_startup(app: web.Application) -> None:  # after `_engine_ctx` has started the warm-up
        app[WARMUP_TASK].add_done_callback(lambda _: app[WARMUP_ERROR] or freeze_startup())

    app.on_startup.append(on_startup)


def run(settings: Settings, engine: Engine | None = None) -> int:
    """Serve until SIGTERM/SIGINT; then drain (no new work, in-flight streams finish) and exit 0.
    Exits 2 without listening when the slots do not fit, and 1 when the warm-up fails (rather than
    answering 503 for ever). `engine`: one already built (bench/host_serving.py serves one over a simulated
    device), else `create_app` builds it from `settings`."""
    import signal

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cache = compile_cache.enable(settings.compile_cache)
    log.info("XLA compilation cache: %s", cache or "off")

    async def main() -> int:
        app = None
        try:
            app = create_app(settings, engine=engine)
            serve_alone(app)
        except (sizing.SlotsDoNotFit, ValueError) as exc:  # ValueError: the keys, the voice aliases, a setting
            log.error("not starting: %s", exc)
            if app is not None:  # its core started: stop it
                await app[BRIDGE].stop()
            return 2
        runner = LimitedAppRunner(app, header_timeout_s=settings.header_timeout_s,
                                  idle_timeout_s=settings.idle_timeout_s, max_connections=settings.max_connections,
                                  handler_cancellation=True, shutdown_timeout=5.0)
        await runner.setup()
        site = runner.site(settings.host, settings.port)
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        app[WARMUP_TASK].add_done_callback(lambda _: app[WARMUP_ERROR] and stop.set())
        # once a signal drains it: a supervisor may stop it as soon as it reads this line
        log.info("listening on http://%s:%d (model %s)", settings.host, settings.port, settings.model)
        await stop.wait()
        if app[WARMUP_ERROR]:
            log.error("warm-up failed, exiting: %s", app[WARMUP_ERROR][0])
            await runner.cleanup()
            return 1
        log.info("draining (up to %.0f s)", settings.drain_timeout_s)
        finished = await drain(app)
        log.info("drain %s; shutting down", "complete" if finished else "timed out")
        compiling = _compiling(app)
        await runner.cleanup()
        if compiling:
            _exit_under_compiles(cache)
        return 0

    return asyncio.run(main())


def _compiling(app: web.Application) -> bool:
    """Whether XLA is compiling for the app: its warm-up (foreground or background) or the voice encoders'."""
    return (not app[WARMUP_TASK].done() or app[ENGINE].compiling > 0
            or any(not f.done() for f in app[VOICE_WARMUP]))


def _exit_under_compiles(cache: Path | None) -> None:
    """Exit 0 at once, the logs flushed. XLA's compiles run on threads nothing can stop: a normal exit waited out the
    whole warm-up (minutes on a cold GPU), and an interpreter finalised under the background warm-up's compiles
    crashed (a segmentation fault on a GPU). What was compiled is in the compilation cache `cache`, if one is on."""
    log.info("exiting before the warm-up's compiles finish%s",
             f" (what was compiled is in the compilation cache {cache})" if cache else "")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
