"""WebSocket for agents: `GET /v1/audio/speech/stream`.

Client -> server (JSON text messages):
  {"type": "session.update", "session": {voice, language, instructions, seed, temperature, top_k, top_p,
                                         repetition_penalty, max_frames, greedy, chunk_schedule}}
  {"type": "input_text.append", "text": "..."}     add text to the buffer
  {"type": "input_text.commit"}  (alias "flush")   speak the buffered text as one utterance
  {"type": "cancel"}                               stop the utterance in flight (within one engine step),
                                                   drop queued ones and the text buffer
  {"type": "close"}                                finish queued utterances, then close (1000)
Server -> client:
  {"type": "session.created"|"session.updated", "session": {...}, "sample_rate": 24000, "format": "pcm_s16le"}
  {"type": "utterance.queued"|"utterance.started", "utterance_id": n, "request_id": ...}
  binary messages: raw PCM s16le mono 24 kHz of the utterance in flight
  {"type": "utterance.done", "utterance_id": n, "cancelled": bool, "frames", "audio_seconds", "timings"}
  {"type": "error", "error": {"code", "message", "param"}, "utterance_id"?}  (the socket stays open,
  except for flooding: too many messages per second closes it with 1008)

Utterances of one socket play in order, one at a time, each admitted by the scheduler when it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

from aiohttp import WSMsgType, web

from qtts_jax.audio import to_int16
from qtts_jax.job import Job
from serving.audio_encoders import SAMPLE_RATE
from serving.errors import ApiError, bad
from serving.keys import ALIASES, ENGINE, SCHEDULER, SERVED_NAMES, SETTINGS, SOCKETS, VOICES
from serving.schemas import build_job, check_text, parse_options, speech_fields
from serving.utterance import Utterance

log = logging.getLogger(__name__)

SESSION_FIELDS = ("voice", "language", "instructions", "seed", "temperature", "top_k", "top_p",
                  "repetition_penalty", "max_frames", "greedy", "chunk_schedule")


class Session:
    def __init__(self, request: web.Request, ws: web.WebSocketResponse):
        self.app = request.app
        self.ws = ws
        self.settings = self.app[SETTINGS]
        all_fields = speech_fields(self.settings.max_input_chars)
        self.fields = {k: all_fields[k] for k in SESSION_FIELDS}
        self.options: dict = {}
        self.buffer = ""
        self.pending: asyncio.Queue = asyncio.Queue()
        self.current: Utterance | None = None
        self.current_id: int | None = None
        self.next_id = 1
        self.closing = False
        self.generation = 0  # bumped by cancel: queued utterances of an older generation are dropped
        self.closer: asyncio.Future | None = None  # the socket's close, should the runner die
        self.runner = asyncio.create_task(self._run())
        self.runner.add_done_callback(self._runner_done)
        self._tokens = self.settings.ws_max_messages_per_s
        self._last = time.monotonic()

    async def send(self, obj: dict) -> None:
        if not self.ws.closed:
            await self.ws.send_str(json.dumps(obj, separators=(",", ":")))

    async def error(self, err: ApiError, utterance_id: int | None = None) -> None:
        payload = {"type": "error", "error": {"code": err.code, "message": err.message, "param": err.field}}
        if err.retry_after is not None:
            payload["error"]["retry_after"] = err.retry_after
        if utterance_id is not None:
            payload["utterance_id"] = utterance_id
        await self.send(payload)

    def _rate_ok(self) -> bool:
        now = time.monotonic()
        rate = self.settings.ws_max_messages_per_s
        self._tokens = min(rate, self._tokens + (now - self._last) * rate)
        self._last = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def _job(self, text: str) -> Job:
        """The session's options and `text`, prepared by the engine (400 naming the field if it cannot be)."""
        return build_job({**self.options, "input": text}, engine=self.app[ENGINE],
                         served_names=self.app[SERVED_NAMES], voices=self.app.get(VOICES),
                         aliases=self.app[ALIASES])

    async def handle(self, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "session.update":
            session = msg.get("session", {})
            if set(msg) - {"type", "session"}:
                raise bad(sorted(set(msg) - {"type", "session"})[0], "unknown field", "unknown_field")
            opts = {**self.options, **parse_options(session, self.fields, required=False)}
            saved, self.options = self.options, opts
            try:
                self._job("check")  # model-level checks (voice, language, instructions) now, not later
            except ApiError:
                self.options = saved
                raise
            await self.send({"type": "session.updated", "session": self.options, "sample_rate": SAMPLE_RATE,
                             "format": "pcm_s16le"})
        elif kind == "input_text.append":
            text = msg.get("text")
            if not isinstance(text, str):
                raise bad("text", "must be a string", "invalid_type")
            check_text("text", text)
            if len(self.buffer) + len(text) > self.settings.max_input_chars:
                raise bad("text", f"the text buffer would exceed {self.settings.max_input_chars} characters",
                          "too_long")
            self.buffer += text
        elif kind in ("input_text.commit", "flush"):
            text, self.buffer = self.buffer, ""
            if not text.strip():
                raise bad("text", "nothing to speak: append text before commit", "empty")
            if "voice" not in self.options:
                raise bad("voice", "is required: send session.update with a voice first", "missing_field")
            if self.pending.qsize() >= self.settings.ws_max_pending_utterances:
                raise ApiError(429, "too_many_utterances",
                               f"at most {self.settings.ws_max_pending_utterances} utterances may wait", "text")
            job = self._job(text)  # a text the engine cannot take is refused now, not when its turn comes
            uid = self.next_id
            self.next_id += 1
            await self.pending.put((uid, self.generation, job))
            await self.send({"type": "utterance.queued", "utterance_id": uid})
        elif kind == "cancel":
            self.generation += 1
            self.buffer = ""
            if self.current is not None:
                self.current.stream.cancel()
        elif kind == "close":
            self.closing = True
            await self.pending.put(None)
        else:
            raise bad("type", f"unknown message type {kind!r}; expected session.update, input_text.append, "
                              "input_text.commit, flush, cancel or close", "unknown_type")

    async def _run(self) -> None:
        while True:
            item = await self.pending.get()
            if item is None:
                await self.ws.close(code=1000, message=b"bye")
                return
            uid, gen, job = item
            if gen != self.generation:
                await self.send({"type": "utterance.done", "utterance_id": uid, "cancelled": True, "frames": 0})
                continue
            try:
                await self._speak(uid, gen, job)
            except ApiError as err:
                await self.error(err, uid)
            except ConnectionError:  # the client is gone: nothing is left to tell it
                return
            except Exception:  # one bad utterance must not silence the socket: report it, go on with the next
                log.exception("websocket utterance %d failed", uid)
                await self.error(ApiError(500, "internal_error", "the utterance failed; the server logged why"), uid)

    async def _speak(self, uid: int, gen: int, job: Job) -> None:
        rid = f"{uuid.uuid4().hex}"
        u = Utterance(self.app, job, rid, "/v1/audio/speech/stream")
        self.current, self.current_id = u, uid
        try:
            await self.send({"type": "utterance.started", "utterance_id": uid, "request_id": rid})
            async for pcm in u.chunks():
                if gen == self.generation and not self.ws.closed:
                    await self.ws.send_bytes(to_int16(pcm).tobytes())
            done = {"type": "utterance.done", "utterance_id": uid,
                    "cancelled": u.error == "cancelled" or gen != self.generation}
            done.update(u.summary())
            if u.error and u.error != "cancelled":
                await self.error(ApiError(500, "engine_error", u.error), uid)
            await self.send(done)
        finally:
            u.close()
            self.current = None

    def _runner_done(self, task: asyncio.Task) -> None:
        """The session's utterances run in this task: if it dies, say so in the log and end the session
        (1011) rather than leave a socket whose commits are never answered."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("websocket session task died; closing the socket", exc_info=task.exception())
        if not self.ws.closed:
            self.closer = asyncio.ensure_future(self.ws.close(code=1011, message=b"internal error"))

    async def shutdown(self) -> None:
        self.generation += 1
        if self.current is not None:
            self.current.stream.cancel()
        self.runner.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.runner


async def speech_socket(request: web.Request) -> web.WebSocketResponse:
    app = request.app
    sched = app[SCHEDULER]
    if not sched.accepting:
        sched.admit()  # raises the 503 with Retry-After before the upgrade
    settings = app[SETTINGS]
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=settings.ws_max_message_bytes)
    await ws.prepare(request)
    app[SOCKETS].add(ws)
    session = Session(request, ws)
    await session.send({"type": "session.created", "session": {}, "sample_rate": SAMPLE_RATE,
                        "format": "pcm_s16le"})
    try:
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                await session.error(bad("message", "binary messages are not accepted; send JSON text",
                                        "invalid_type"))
                continue
            if msg.type != WSMsgType.TEXT:
                break
            if not session._rate_ok():
                await session.error(ApiError(429, "rate_limited", "too many messages per second", "message"))
                await ws.close(code=1008, message=b"too many messages")
                break
            try:
                try:
                    data = json.loads(msg.data)
                except (ValueError, RecursionError):
                    raise bad("message", "is not valid JSON", "invalid_json") from None
                if not isinstance(data, dict):
                    raise bad("message", "must be a JSON object", "invalid_json")
                await session.handle(data)
            except ApiError as err:
                await session.error(err)
            except Exception:  # a bug, not the client's fault: log it, say so, keep the socket
                log.exception("websocket message failed")
                await session.error(ApiError(500, "internal_error", "the message failed; the server logged why"))
            if session.closing:
                break
        if session.closing:  # let queued utterances finish; the runner closes the socket
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await session.runner
    finally:
        await session.shutdown()
    return ws


def setup(app: web.Application) -> None:
    app.router.add_get("/v1/audio/speech/stream", speech_socket)
