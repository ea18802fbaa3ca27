"""WebSocket for agents: `GET /v1/audio/speech/stream`, in two protocols told apart by the client's first
message: vLLM-Omni's (`session.config`, `input.text`, ...: serving/sockets/omni_ws.py) or ours, below. Ours greets with
`session.created` once the client's first message shows it is ours, or after 0.25 s of silence (a client may
wait for the greeting before it speaks); a client whose first message comes later than that and is vLLM-Omni's
is still served as one, after that stray greeting. Where the server checks keys, the socket's comes before the
upgrade: `Authorization: Bearer KEY`, or from a browser the subprotocol `qtts-key.KEY` (serving/http_api/auth.py).

Client -> server (JSON text messages):
  {"type": "session.update", "session": {voice, language, instructions, seed, temperature, top_k, top_p,
                                         repetition_penalty, max_frames, greedy, chunk_schedule,
                                         speed, sample_rate, response_format (pcm | ulaw | alaw),
                                         split_granularity (none | sentence | clause | live),
                                         input_format (auto | text | ssml), word_timestamps}}
  {"type": "input_text.append", "text": "..."}     add text to the buffer; with split_granularity, each
                                                   complete sentence (clause) is committed as it arrives
                                                   (an SSML document waits for the commit); with "live",
                                                   the text is one utterance that starts at its first
                                                   word and that later text joins as it plays
  {"type": "input_text.commit"}  (alias "flush")   speak the buffered text as one utterance (live: the
                                                   utterance's text is complete)
  {"type": "cancel"}                               stop the utterance in flight (within one engine step),
                                                   drop queued ones and the text buffer
  {"type": "close"}                                finish queued utterances, then close (1000)
Server -> client:
  {"type": "session.created"|"session.updated", "session": {...}, "sample_rate": 24000,
   "format": "pcm_s16le"|"g711_ulaw"|"g711_alaw"}
  {"type": "utterance.queued"|"utterance.started", "utterance_id": n, "request_id": ...}
  binary messages: the utterance in flight, raw mono at the session's rate (PCM s16le, or G.711 bytes)
  {"type": "utterance.words", "utterance_id": n, "words": [{"word", "start", "end"}]}  with word_timestamps,
                                                   after each part's audio: estimates, seconds from the
                                                   utterance's start (serving/audio/word_timings.py)
  {"type": "utterance.done", "utterance_id": n, "cancelled": bool, "frames", "audio_seconds", "timings"}
  {"type": "error", "error": {"code", "message", "param"}, "utterance_id"?}  (the socket stays open,
  except for flooding: too many messages per second closes it with 1008)

Utterances of one socket play in order, one at a time, each admitted (serving/admission.py) when it starts; a long
one is spoken in parts, as one stream (serving/utterance.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

from aiohttp import WSMsgType, hdrs, web

from serving.audio.encoders import SAMPLE_RATE
from serving.audio.out import StreamOut, output_rate
from serving.errors import ApiError, bad
from serving.http_api import auth
from serving.keys import ADMISSION, ALIASES, ENGINE, SERVED_NAMES, SETTINGS, SOCKETS, VOICES
from serving.schemas import Field, base64_chars, parse_options, speech_fields
from serving.sockets import omni_ws
from serving.sockets.live_input import LiveInput, take_text
from serving.text import script
from serving.text.script import Script
from serving.text.sentences import GRANULARITIES
from serving.utterance import Utterance

log = logging.getLogger(__name__)

SESSION_FIELDS = ("voice", "language", "instructions", "seed", "temperature", "top_k", "top_p",
                  "repetition_penalty", "max_frames", "greedy", "chunk_schedule", "speed", "sample_rate",
                  "input_format", "word_timestamps")
RAW_FORMATS = {"pcm": "pcm_s16le", "ulaw": "g711_ulaw", "alaw": "g711_alaw"}  # what a binary message carries
GREETING_WAIT_S = 0.25  # how long a silent client waits for session.created (a vLLM-Omni client speaks first)


class Session:
    def __init__(self, request: web.Request, ws: web.WebSocketResponse):
        self.app = request.app
        self.ws = ws
        self.settings = self.app[SETTINGS]
        all_fields = speech_fields(self.settings.max_input_chars)
        self.fields = {k: all_fields[k] for k in SESSION_FIELDS}
        self.fields["response_format"] = Field("string", "Audio in the binary messages", enum=tuple(RAW_FORMATS))
        self.fields["split_granularity"] = Field("string", "Commit each sentence or clause as it completes, or "
                                                 "(live) speak the text as it comes, in one utterance",
                                                 enum=GRANULARITIES, default="none")
        self.options: dict = {}
        self.buffer = ""
        self.live: LiveInput | None = None  # the open live utterance's text (split_granularity "live")
        self.pending: asyncio.Queue = asyncio.Queue()
        self.current: Utterance | None = None
        self.next_id = 1
        self.closing = False
        self.generation = 0  # bumped by cancel: queued utterances of an older generation are dropped
        self.closer: asyncio.Future | None = None  # the socket's close, should the runner die
        self.runner = asyncio.create_task(self._run())
        self.runner.add_done_callback(self._runner_done)

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

    def describe(self, kind: str) -> dict:
        fmt = self.options.get("response_format", "pcm")
        return {"type": kind, "session": self.options, "format": RAW_FORMATS[fmt],
                "sample_rate": output_rate(fmt, self.options.get("sample_rate"))}

    def _script(self, text: str, live: bool = False) -> Script:
        """The session's options and `text`, prepared by the engine (400 naming the field if it cannot be)."""
        return script.build({**self.options, "input": text}, engine=self.app[ENGINE], live=live,
                            served_names=self.app[SERVED_NAMES], voices=self.app.get(VOICES),
                            aliases=self.app[ALIASES])

    async def handle(self, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "session.update":
            if self.live is not None:
                raise bad("type", "session.update cannot be applied while a live utterance's text is open; send "
                                  "input_text.commit first", "utterance_in_progress")
            session = msg.get("session", {})
            if set(msg) - {"type", "session"}:
                raise bad(sorted(set(msg) - {"type", "session"})[0], "unknown field", "unknown_field")
            opts = {**self.options, **parse_options(session, self.fields, required=False)}
            output_rate(opts.get("response_format", "pcm"), opts.get("sample_rate"))  # G.711 is 8 kHz only
            saved, self.options = self.options, opts
            try:
                self._script(script.CHECK)  # model-level checks (voice, language, instructions) now, not later
            except ApiError:
                self.options = saved
                raise
            await self.send(self.describe("session.updated"))
        elif kind == "input_text.append":
            for unit in await take_text(self, msg.get("text"), self.options, self._start_live, "text buffer"):
                await self._commit(unit)
        elif kind in ("input_text.commit", "flush") and self.live is not None:
            await self._complete_live()
        elif kind in ("input_text.commit", "flush"):
            text, self.buffer = self.buffer, ""
            await self._commit(text)
        elif kind == "cancel":
            self.generation += 1
            self.buffer, self.live = "", None
            if self.current is not None:
                self.current.cancel()
        elif kind == "close":
            if self.live is not None:  # its text is all there will be
                await self._complete_live()
            self.closing = True
            await self.pending.put(None)
        else:
            raise bad("type", f"unknown message type {kind!r}; expected session.update, input_text.append, "
                              "input_text.commit, flush, cancel or close", "unknown_type")

    async def _start_live(self, live: LiveInput) -> None:
        """Queue the open live utterance once its first id is stable (`live_input.append_live`)."""
        try:
            await self._commit(live.start(), live)
        except ApiError:
            self.live = None  # refused: the text after this starts another
            raise

    async def _complete_live(self) -> None:
        """The open live utterance's text is complete (commit, close): one whose first id never became stable
        (a single word) is spoken as a buffered utterance."""
        live, self.live = self.live, None
        if not live.started:
            await self._commit(live.text.text)
        elif (rest := live.finish()) is not None:  # what did not fit: the next utterance
            await self._commit(rest)

    async def _commit(self, text: str, live: LiveInput | None = None) -> None:
        """Queue `text` as an utterance; a text the engine cannot take is refused now, not when its turn comes.
        `live`: `text` is a live utterance's so far, the rest joins it."""
        if not text.strip():
            raise bad("text", "nothing to speak: append text before commit", "empty")
        if "voice" not in self.options:
            raise bad("voice", "is required: send session.update with a voice first", "missing_field")
        if self.pending.qsize() >= self.settings.ws_max_pending_utterances:
            raise ApiError(429, "too_many_utterances",
                           f"at most {self.settings.ws_max_pending_utterances} utterances may wait", "text")
        speech = self._script(text, live=live is not None)
        uid = self.next_id
        self.next_id += 1
        await self.pending.put((uid, self.generation, speech, dict(self.options), live))
        await self.send({"type": "utterance.queued", "utterance_id": uid})

    async def _run(self) -> None:
        while True:
            item = await self.pending.get()
            if item is None:
                await self.ws.close(code=1000, message=b"bye")
                return
            uid, gen, speech, options, live = item
            if gen != self.generation:
                await self.send({"type": "utterance.done", "utterance_id": uid, "cancelled": True, "frames": 0})
                continue
            try:
                await self._speak(uid, gen, speech, options, live)
            except ApiError as err:
                if live is not None and live is self.live:  # refused (admission): later text starts another
                    self.live = None
                await self.error(err, uid)
            except ConnectionError:  # the client is gone: nothing is left to tell it
                return
            except Exception:  # one bad utterance must not silence the socket: report it, go on with the next
                log.exception("websocket utterance %d failed", uid)
                await self.error(ApiError(500, "internal_error", "the utterance failed; the server logged why"), uid)

    async def _speak(self, uid: int, gen: int, speech: Script, options: dict, live: LiveInput | None) -> None:
        rid = f"{uuid.uuid4().hex}"
        fmt, speed = options.get("response_format", "pcm"), options.get("speed", 1.0)
        rate = output_rate(fmt, options.get("sample_rate"))
        u = Utterance(self.app, speech, rid, "/v1/audio/speech/stream", speed=speed, rate=rate,
                      words=options.get("word_timestamps", False), live=live)
        out = StreamOut(fmt, rate, speed)
        self.current = u
        try:
            await self.send({"type": "utterance.started", "utterance_id": uid, "request_id": rid})
            async for pcm in u.chunks():
                data = await out.aencode(pcm)
                if data and gen == self.generation and not self.ws.closed:
                    await self.ws.send_bytes(data)
                await self._words(uid, u)
            data = await out.afinish() if u.error is None else b""
            if data and gen == self.generation and not self.ws.closed:
                await self.ws.send_bytes(data)
            await self._words(uid, u)
            done = {"type": "utterance.done", "utterance_id": uid,
                    "cancelled": u.error == "cancelled" or gen != self.generation}
            done.update(u.summary())
            if u.error and u.error != "cancelled":
                await self.error(ApiError(500, "engine_error", u.error), uid)
            await self.send(done)
        finally:
            u.close()
            self.current = None

    async def _words(self, uid: int, u: Utterance) -> None:
        if words := u.take_words():  # after the audio of the part they belong to
            await self.send({"type": "utterance.words", "utterance_id": uid, "words": words})

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
            self.current.cancel()
        self.runner.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.runner


class _Bucket:
    """Messages a second a socket may send (a token bucket): a flood closes the socket with 1008."""

    def __init__(self, rate: float):
        self.rate, self.tokens, self.last = rate, rate, time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def _json(msg) -> dict | None:
    """A text message's JSON object, or None."""
    if msg.type != WSMsgType.TEXT:
        return None
    try:
        data = json.loads(msg.data)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


async def speech_socket(request: web.Request) -> web.WebSocketResponse:
    app = request.app
    admission = app[ADMISSION]
    if not admission.accepting:
        admission.admit()  # raises the 503 with Retry-After before the upgrade
    settings = app[SETTINGS]
    # a Base model's vLLM-Omni session.config may carry a base64 ref_audio as large as a registration's recording
    limit = settings.ws_max_message_bytes + (base64_chars(settings.max_voice_upload_bytes) if VOICES in app else 0)
    # a browser's key rides in a subprotocol, and its handshake fails unless one of its offers is answered
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=limit,
                               protocols=auth.subprotocols(request.headers.getall(hdrs.SEC_WEBSOCKET_PROTOCOL, [])))
    await ws.prepare(request)
    app[SOCKETS].add(ws)
    first = asyncio.ensure_future(ws.receive())  # awaited below whatever happens, or cancelled in `finally`
    session = None
    try:
        await asyncio.wait({first}, timeout=GREETING_WAIT_S)
        omni = first.done() and (_json(first.result()) or {}).get("type") in omni_ws.TYPES
        session = omni_ws.OmniSession(request, ws) if omni else Session(request, ws)
        bucket, decided = _Bucket(settings.ws_max_messages_per_s), omni
        if not omni:
            await session.send({"type": "session.created", "session": {}, "sample_rate": SAMPLE_RATE,
                                "format": "pcm_s16le"})
        msg = await first
        while True:
            if msg.type == WSMsgType.BINARY:
                await session.error(bad("message", "binary messages are not accepted; send JSON text",
                                        "invalid_type"))
                msg = await ws.receive()
                continue
            if msg.type != WSMsgType.TEXT:
                break
            if not bucket.take():
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
                if not decided and data.get("type") in omni_ws.TYPES:  # a vLLM-Omni client slower than the greeting
                    await session.shutdown()
                    session = omni_ws.OmniSession(request, ws)
                decided = True
                await session.handle(data)
            except ApiError as err:
                await session.error(err)
            except Exception:  # a bug, not the client's fault: log it, say so, keep the socket
                log.exception("websocket message failed")
                await session.error(ApiError(500, "internal_error", "the message failed; the server logged why"))
            if session.closing:
                break
            msg = await ws.receive()
        if session.closing:  # let queued utterances finish; the runner closes the socket
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await session.runner
    finally:
        first.cancel()  # a no-op once it has its message; the pending receive if the client left before
        if session is not None:
            await session.shutdown()
    return ws


def setup(app: web.Application) -> None:
    app.router.add_get("/v1/audio/speech/stream", speech_socket)
