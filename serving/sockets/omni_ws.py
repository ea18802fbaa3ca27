"""vLLM-Omni's WebSocket protocol on our path `/v1/audio/speech/stream`, so its clients work unchanged
(serving/sockets/ws.py tells the two protocols apart by the first message).

Client -> server (JSON text):
  {"type": "session.config", <any speech field but input/stream/stream_format>, "stream_audio": bool,
   "split_granularity": "none"|"sentence"|"clause"|"live"}   sticky until the next session.config (refused
                                                      while text is buffered); ref_audio must be a base64 data URL
  {"type": "input.text", "text": "..."}              text to add to the utterance
  {"type": "input.done"}                             speak what is buffered; the socket stays open
  {"type": "session.close"}                          finish what is queued, then close (1000)
Server -> client, per utterance (one `input.done`) and per sentence in it:
  {"type": "audio.start", "utterance_index", "sentence_index", "sentence_text", "format", "sample_rate", "channels"}
  binary messages: the audio (one whole file, or chunks as they are made with stream_audio true)
  {"type": "audio.words", "utterance_index", "sentence_index", "words": [{"word", "start", "end"}]}
                                                     with word_timestamps: estimated, seconds from the sentence's
                                                     start (serving/audio/word_timings.py)
  {"type": "audio.done", "utterance_index", "sentence_index", "total_bytes", "error": bool}
  {"type": "session.done", "utterance_index", "total_sentences"}
  {"type": "error", "message", "code", "param"}      the socket stays open

With split_granularity "sentence" (or "clause"), each sentence (clause) is started as soon as its end arrives,
before `input.done`: audio for the text already received begins while the client is still sending the rest.
With "live", the utterance is one sentence whose audio starts at its first word and that the later text joins
while it plays (serving/sockets/live_input.py; `sentence_text` is the text it started with); `input.done` completes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid

import numpy as np
from aiohttp import web

from serving.audio.out import StreamOut, awhole, output_rate
from serving.errors import ApiError, bad
from serving.http_api import voice_routes
from serving.keys import ALIASES, ENGINE, MODEL, SERVED_NAMES, SETTINGS, VOICES
from serving.schemas import Field, parse_options, speech_fields, speech_options, task_type
from serving.sockets.live_input import LiveInput, take_text
from serving.text import script
from serving.text.script import Script
from serving.text.sentences import GRANULARITIES
from serving.utterance import Utterance

log = logging.getLogger(__name__)

TYPES = ("session.config", "input.text", "input.done", "session.close")


def config_fields(settings) -> dict[str, Field]:
    fields = {k: f for k, f in speech_fields(settings.max_input_chars, settings.max_voice_upload_bytes).items()
              if k not in ("input", "text", "voice_id", "stream", "stream_format")}
    fields["stream_audio"] = Field("boolean", "Send audio chunks as they are made instead of one file per sentence")
    fields["split_granularity"] = Field("string", "Start audio at each sentence or clause end, before input.done, "
                                        "or (live) at the first word, the rest joining it", enum=GRANULARITIES,
                                        default="none")
    return fields


class OmniSession:
    def __init__(self, request: web.Request, ws: web.WebSocketResponse):
        self.app, self.ws = request.app, ws
        self.settings = self.app[SETTINGS]
        self.fields = config_fields(self.settings)
        self.config: dict | None = None
        self.prompt = None  # the config's cloned ref_audio voice
        self.buffer = ""
        self.live: LiveInput | None = None  # the open live sentence's text (split_granularity "live")
        self.utterance = 0  # index of the utterance being received
        self.sentences = 0  # units of it queued so far
        self.queue: asyncio.Queue = asyncio.Queue()
        self.current: Utterance | None = None
        self.closing = False
        self.runner = asyncio.create_task(self._run())

    async def send(self, obj: dict) -> None:
        if not self.ws.closed:
            await self.ws.send_str(json.dumps(obj, separators=(",", ":")))

    async def error(self, err: ApiError, **extra) -> None:
        await self.send({"type": "error", "message": err.message, "code": err.code, "param": err.field, **extra})

    async def handle(self, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "session.config":
            await self._configure({k: v for k, v in msg.items() if k != "type"})
        elif kind not in TYPES:
            raise bad("type", f"unknown message type {kind!r}; expected one of {list(TYPES)}", "unknown_type")
        elif kind == "session.close":
            self.closing = True
            await self.queue.put(None)
        elif self.config is None:
            raise bad("type", f"send session.config before {kind}", "missing_config")
        elif kind == "input.text":
            if set(msg) - {"type", "text"}:
                raise bad(sorted(set(msg) - {"type", "text"})[0], "unknown field; input.text has only text",
                          "unknown_field")
            for unit in await take_text(self, msg.get("text"), self.config,
                                        lambda live: self._queue_unit(live.text.stable, live), "utterance"):
                await self._queue_unit(unit)
        else:  # input.done
            text, self.buffer = self.buffer, ""
            if self.live is not None:
                live, self.live = self.live, None
                text = live.text.text if not live.started else (live.finish() or "")  # unstarted: one word
            await self._queue_unit(text)
            await self.queue.put(("done", self.utterance, self.sentences))
            self.utterance, self.sentences = self.utterance + 1, 0

    async def _queue_unit(self, text: str, live: LiveInput | None = None) -> None:
        if text.strip():
            if live is not None:
                live.started = True  # its job is made when its turn comes (`LiveInput.start`)
            await self.queue.put(("unit", self.utterance, self.sentences, text, self.config, self.prompt, live))
            self.sentences += 1

    async def _configure(self, body: dict) -> None:
        if self.buffer.strip() or self.live is not None:
            raise bad("type", "session.config cannot be applied while text is buffered; send input.done first",
                      "utterance_in_progress")
        opts = parse_options(body, self.fields, required=False)
        # the same checks and defaults as a vLLM-Omni REST body (marked by a field only it sends)
        checked = speech_options({**{k: v for k, v in body.items() if k not in ("stream_audio", "split_granularity")},
                                  "input": "check", "task_type": body.get("task_type", task_type(self.app[MODEL]))},
                                 model=self.app[MODEL], max_input_chars=self.settings.max_input_chars,
                                 max_ref_audio_bytes=self.settings.max_voice_upload_bytes)
        opts = {**opts, **{k: v for k, v in checked.items() if k not in ("input", "_dialect")}}
        opts.setdefault("response_format", "wav")
        opts["sample_rate"] = output_rate(opts["response_format"], opts.get("sample_rate"))
        prompt = None
        if "ref_audio" in opts:
            ref_text = None if opts.get("x_vector_only_mode") else opts.get("ref_text")
            prompt = await voice_routes.inline_voice(self.app, opts["ref_audio"], ref_text)
        self._script(script.CHECK, opts, prompt)  # model-level refusals now, not at the first input.done
        self.config, self.prompt = opts, prompt

    def _script(self, text: str, opts: dict, prompt, live: bool = False) -> Script:
        return script.build({**{k: v for k, v in opts.items() if k not in ("ref_audio", "ref_text")}, "input": text},
                            engine=self.app[ENGINE], live=live, served_names=self.app[SERVED_NAMES],
                            voices=self.app.get(VOICES), aliases=self.app[ALIASES], prompt=prompt)

    async def _run(self) -> None:
        while True:
            item = await self.queue.get()
            if item is None:
                await self.ws.close(code=1000, message=b"bye")
                return
            try:
                if item[0] == "done":
                    _, utterance, total = item
                    await self.send({"type": "session.done", "utterance_index": utterance, "total_sentences": total})
                else:
                    await self._speak(*item[1:])
            except ConnectionError:
                return
            except Exception:  # one bad sentence must not silence the socket: report it, go on with the next
                log.exception("vLLM-Omni websocket sentence failed")
                await self.error(ApiError(500, "internal_error", "the sentence failed; the server logged why"))

    async def _speak(self, utterance: int, sentence: int, text: str, config: dict, prompt,
                     live: LiveInput | None) -> None:
        fmt, rate, speed = config["response_format"], config["sample_rate"], config.get("speed", 1.0)
        where = {"utterance_index": utterance, "sentence_index": sentence}
        if live is not None:  # the text stable by now: the more its prompt holds, the less waits for appending
            text = live.start()
        await self.send({"type": "audio.start", **where, "sentence_text": text, "format": fmt, "sample_rate": rate,
                         "channels": 1})
        sent, failed = 0, False
        try:
            speech = self._script(text, config, prompt, live=live is not None)
            u = Utterance(self.app, speech, uuid.uuid4().hex, "/v1/audio/speech/stream", speed=speed, rate=rate,
                          words=config.get("word_timestamps", False), live=live)
        except ApiError as err:
            if live is not None and live is self.live:  # refused: the text after this starts another sentence
                self.live = None
            await self.error(err, **where)
            await self.send({"type": "audio.done", **where, "total_bytes": 0, "error": True})
            return
        self.current = u
        try:
            if config.get("stream_audio"):
                out = StreamOut(fmt, rate, speed, None if live else speech.max_samples(speed))
                async for pcm in u.chunks():
                    sent += await self._send_bytes(await out.aencode(pcm))
                    await self._words(u, where)
                if u.error is None:
                    sent += await self._send_bytes(await out.afinish())
            else:
                parts = [pcm async for pcm in u.chunks()]
                if u.error is None:
                    audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
                    sent += await self._send_bytes(await awhole(fmt, audio, rate, speed))
            await self._words(u, where)
            if u.error is not None:
                failed = True
                await self.error(ApiError(500, "engine_error", f"generation failed: {u.error}"), **where,
                                 partial_audio=sent > 0)
            await self.send({"type": "audio.done", **where, "total_bytes": sent, "error": failed})
        finally:
            u.close()
            self.current = None

    async def _words(self, u: Utterance, where: dict) -> None:
        if words := u.take_words():
            await self.send({"type": "audio.words", **where, "words": words})

    async def _send_bytes(self, data: bytes) -> int:
        if data and not self.ws.closed:
            await self.ws.send_bytes(data)
        return len(data)

    async def shutdown(self) -> None:
        if self.current is not None:
            self.current.cancel()
        self.runner.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.runner
