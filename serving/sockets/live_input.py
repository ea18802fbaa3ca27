"""One live utterance's text on its way into the engine, the same for both WebSockets (split_granularity "live"):
text appended while the utterance waits its turn or plays joins its one engine stream, whose audio starts as soon
as the text's first ids can no longer change (serving/sockets/live_text.py), before the client says the text is complete.

The utterance's job is made from the text that is stable when it is spoken (`start`); every id after those goes
to the stream with `Engine.append_text` once it exists, and the completion sends the rest and the tts_eos. Should
the text outgrow the engine's trailing text buffer (`max_trailing` ids), the utterance is completed with the text
that fit and `add` / `finish` return the rest, which the session speaks as the next utterance: nothing is lost,
and the seam falls where the last stable id ended (a word's end)."""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable

from serving.bridge import AsyncEngine, AsyncStream
from qtts_jax.engine import Engine, PromptTooLong
from serving.errors import bad, from_request_error
from serving.keys import BRIDGE, ENGINE
from serving.schemas import check_text
from serving.sockets.live_text import LiveText
from serving.text import ssml
from serving.text.sentences import split_units


async def take_text(session, text, options: dict, start: Callable[["LiveInput"], Awaitable[None]],
                    held_as: str) -> list[str]:
    """A text message's `text` checked (a string, its characters, the held text's cap of `max_input_chars`, which
    the error calls `held_as`) and taken, either protocol: onto the live utterance under `options`'
    `split_granularity` "live" (returns nothing), else onto `session.buffer`, whose complete units it returns (an
    SSML document is spoken whole, at the end)."""
    if not isinstance(text, str):
        raise bad("text", "must be a string", "invalid_type")
    check_text("text", text)
    held, cap = session.live.text.text if session.live is not None else session.buffer, session.settings.max_input_chars
    if len(held) + len(text) > cap:
        raise bad("text", f"the {held_as} would exceed {cap} characters", "too_long")
    if options.get("split_granularity") == "live" and not ssml.is_input(held + text, options):
        await append_live(session, text, start)
        return []
    text = session.buffer + text
    units, session.buffer = split_units(text, "none" if ssml.is_input(text, options) else
                                        options.get("split_granularity", "none"))
    return units


async def append_live(session, text: str | None, start: Callable[["LiveInput"], Awaitable[None]]) -> None:
    """`text` into a WebSocket session's open live utterance, `session.live` (one is opened if none is; either
    protocol): `start` queues the utterance once its first id is stable; text that outgrows the engine's trailing
    text buffer opens the next one."""
    while text is not None:
        if session.live is None:
            session.live = LiveInput(session.app[ENGINE], session.app[BRIDGE])
        live = session.live
        text = live.add(text)
        if live.ready and not live.started:
            await start(live)
        if text is not None:
            session.live = None


class LiveInput:
    def __init__(self, engine: Engine, bridge: AsyncEngine):
        self.engine, self.bridge = engine, bridge
        self.text = LiveText(engine.model.tokenizer)
        self.started = False  # `start` made the job: the session has queued the utterance
        self.sent = 0  # ids in the job's prompt or handed to the stream
        self.complete = False
        self.out: AsyncStream | None = None

    @property
    def ready(self) -> bool:
        """Its text has an id that can no longer change: enough to start the stream."""
        return bool(self.text.ids)

    def add(self, piece: str) -> str | None:
        """More text. Returns None, or the text that did not fit (the utterance is then complete without it)."""
        before = copy.copy(self.text)
        self.text.add(piece)
        return self._fit(before, piece, complete=False)

    def finish(self) -> str | None:
        """The text is complete. Returns None, or the text that did not fit (as `add`)."""
        before = copy.copy(self.text)
        self.text.finish()
        return self._fit(before, "", complete=True)

    def start(self) -> str:
        """The text the job is made from (its ids are in its prompt; more follow through `attach`)."""
        self.started, self.sent = True, len(self.text.ids)
        return self.text.stable

    def attach(self, out: AsyncStream) -> None:
        """The utterance's stream exists (its turn came): what arrived meanwhile goes to it, the rest as it comes."""
        self.out = out
        self._send()

    def _fit(self, before: LiveText, piece: str, complete: bool) -> str | None:
        try:
            self.engine.check_trailing(len(self.text.ids))  # the first id is in the prompt; the tts_eos to come
        except PromptTooLong as exc:
            if not before.ids:  # not even the first piece fits: nothing to complete, nothing to go on with
                raise from_request_error(exc) from None
            self.text = before  # complete with the ids that fit: the rest, from the end of the last, is left over
            complete, rest = True, before.rest() + piece
        else:
            rest = None
        self.complete = complete
        self._send()
        return rest

    def _send(self) -> None:
        if self.out is None or self.out.stream.complete_sent:
            return
        ids = self.text.ids[self.sent:]
        if ids or self.complete:
            self.bridge.append_text(self.out, ids, self.complete)
            self.sent += len(ids)
