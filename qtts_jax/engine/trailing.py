"""Live text on the engine's side: ids appended to a playing (or queued) stream, held on it until the engine thread
moves them to the stream's trailing text on the device before its next step (`engine` below: a `core.Engine`; this
module imports nothing of the loop's).

A live stream that has read every id it has waits (its rows skip the steps, the listener hears a pause) until more
text or the completion comes: it then makes exactly the frames it would have made given the whole text at once (a
seeded request too), as the model never sees text missing that it would have read."""

from __future__ import annotations

from qtts_jax.engine import preparation
from qtts_jax.engine.stream import Stream
from qtts_jax.request import RequestError


def append(engine, stream: Stream, ids: list[int], complete: bool) -> None:
    """Queue `ids` (and with `complete` the text's end, tts_eos) on `stream` under the engine's lock and wake it.
    Raises `RequestError` for a stream that is not live or already complete, and `PromptTooLong` (nothing
    appended) when the text outgrows `max_trailing`."""
    with engine._wake:
        if stream.complete_sent or not stream.job.live:
            raise RequestError("text", "this stream's text is complete: nothing can be appended")
        ids = [int(i) for i in ids] + ([engine.model.cfg.text.tts_eos] if complete else [])
        preparation.check_trailing(engine.config, stream.trailing_total + len(ids) + (not complete))
        stream.unsent += ids
        stream.trailing_total += len(ids)
        stream.complete_sent = complete
        engine._wake.notify()


def feed(engine) -> None:
    """Appended text to the device, for the streams in slots (queued ones keep theirs until admitted)."""
    with engine._lock:
        fed = [(s, s.unsent, s.complete_sent) for s in engine.slots if s is not None and s.unsent]
        for s, _, _ in fed:
            s.unsent = []
    for s, ids, complete in fed:
        if s.finished:
            continue
        s.cap = preparation.frames_cap(engine.config, s.job, s.text_known + len(ids))
        engine.runner.append_text(s.slot, s.text_known, ids, s.cap)
        s.text_known += len(ids)
        s.text_complete = complete
