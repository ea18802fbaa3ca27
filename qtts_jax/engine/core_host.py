"""The core's side of the host-core link: an `Engine` driven by the host's message batches, its chunks and
snapshot sent back in batches.

It uses only the engine's public API (`submit`, `append_text`, `stats`, `warmup`, `start`, `stop`, ...). Chunks the
engine hands out (from its sender thread, final chunks from its loop thread) gather in an outbox; the first of a
batch wakes the flusher thread, which sends everything gathered once the hand-out's loop has ended as ONE `Batch`
with the snapshot taken after them: one batch per hand-out (the engine hands one codec call's audio out in one loop
of a few ms, its newcomers' first chunks in another), not one per chunk. The same code serves a core in its own process (`core_process.main`) and one on a thread
beside its host (`in_process`, for tests)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from functools import partial

import numpy as np

from qtts_jax.engine import compile_cache
from qtts_jax.engine.core import Engine
from qtts_jax.engine.host_model import HostModel
from qtts_jax.engine.links import Link, thread_links
from qtts_jax.engine.messages import (AppendText, Batch, Call, Cancel, ChunkOut, DeliveryLag, Hello, Reply, Stop,
                                      Submit)
from qtts_jax.engine.stream import Chunk, Stream, Timings

log = logging.getLogger(__name__)

# a hand-out has ended once no chunk came for this long (its loop emits one every few microseconds)...
_QUIET_S = 2e-4
# ... or, at most, this long after its first chunk
_HOLD_S = 2e-3
_IDLE_S = 0.01  # while nothing is handed out, how often the flusher looks for a changed snapshot (a stream that
# ended leaves the snapshot an iteration after its final chunk: a replica that admits only when idle must hear soon)


class CoreHost:
    """Runs `engine` for the host at the other end of `link` until a `Stop` (or the link closes)."""

    def __init__(self, engine: Engine, link: Link):
        self.engine, self.link = engine, link
        self._streams: dict[int, Stream] = {}  # host id -> the engine's stream, until its final chunk
        self._host_ids: dict[int, int] = {}  # engine stream id -> host id (the snapshot's names)
        self._lock = threading.Condition()
        self._chunks: list[tuple[int, Chunk]] = []
        self._replies: list[Reply] = []
        self._ended: list[int] = []  # engine ids whose final chunk went out (their names go once unlisted)
        self._closed = False
        self._sent = None  # `_gist` of the snapshot the host last got
        self._calls = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="qtts-core-call")
        self._flusher = threading.Thread(target=self._flush_loop, name="qtts-core-out", daemon=True)
        self._flusher.start()

    # ---- host -> core --------------------------------------------------------------------------------------

    def serve(self) -> None:
        """Apply the host's batches as they come until a `Stop` or the link's end; then stop the engine."""
        try:
            while True:
                try:
                    batch = self.link.recv()
                except (EOFError, OSError):
                    break
                if not self._apply(batch):
                    break
        finally:
            self.engine.stop()
            with self._lock:
                self._closed = True
                self._lock.notify()
            self._flusher.join()
            self.link.close()

    def _apply(self, batch: list) -> bool:
        for msg in batch:
            if isinstance(msg, Submit):
                stream = self.engine.submit(msg.job, partial(self._put, msg.id), msg.ahead)
                if self.engine.clock is time.perf_counter:  # the host's clock: when the host took it
                    stream.timings.submitted = msg.submitted
                self._host_ids[stream.id] = msg.id
                self._streams[msg.id] = stream
            elif isinstance(msg, AppendText):
                if (stream := self._streams.get(msg.id)) is not None and not stream.finished:
                    self.engine.append_text(stream, list(msg.ids), msg.complete)
            elif isinstance(msg, Cancel):
                if (stream := self._streams.get(msg.id)) is not None:
                    stream.cancel()
            elif isinstance(msg, DeliveryLag):
                self.engine.observe_delivery_lag(msg.seconds)
            elif isinstance(msg, Call):
                self._calls.submit(self._run_call, msg)
            elif isinstance(msg, Stop):
                return False
        return True

    def _run_call(self, msg: Call) -> None:
        try:
            reply = Reply(msg.call, CALLS[msg.name](self.engine, *msg.args))
        except Exception as exc:  # the host raises it where it waits
            reply = Reply(msg.call, error=exc)
        with self._lock:
            self._replies.append(reply)
            self._lock.notify()

    # ---- core -> host --------------------------------------------------------------------------------------

    def _put(self, host_id: int, chunk: Chunk) -> None:
        """The engine's threads: one chunk; the first of a batch wakes the flusher."""
        with self._lock:
            self._chunks.append((host_id, chunk))
            if len(self._chunks) == 1:
                self._lock.notify()

    def _flush_loop(self) -> None:
        while True:
            with self._lock:
                if not (self._chunks or self._replies or self._closed):
                    self._lock.wait(_IDLE_S)
                idle = not (self._chunks or self._replies or self._closed)
            # the engine's lock is never taken under this one (the engine may hand a chunk out holding its own)
            moved = idle and _gist(self.engine.stats()) != self._sent  # a warm-up stage, a stream gone
            if idle and not moved:
                continue
            with self._lock:
                # a hand-out's chunks come in one loop on one thread, which the GIL's switch interval cuts into
                # slices: the batch is sent once that loop has ended (no chunk for a moment; a while at most)
                until = time.perf_counter() + _HOLD_S
                while self._chunks and not self._closed and time.perf_counter() < until:
                    count = len(self._chunks)
                    self._lock.wait(_QUIET_S)
                    if len(self._chunks) == count:
                        break
                chunks, self._chunks = self._chunks, []
                replies, self._replies = self._replies, []
                closed = self._closed
            if chunks or replies or moved:
                try:
                    self.link.send(self._batch(chunks, replies))
                except (OSError, ValueError):  # the host is gone: nothing listens
                    return
            if closed:
                return

    def _batch(self, chunks: list[tuple[int, Chunk]], replies: list[Reply]) -> Batch:
        out, start = [], 0
        for host_id, c in chunks:
            s = self._streams.get(host_id)  # set as its `Submit` is applied, before the engine hands it anything
            t = s.timings if s is not None else Timings()
            out.append(ChunkOut(host_id, start, len(c.pcm), c.first_frame, c.frames, c.sent_at, c.final, c.error,
                                c.due, len(s.codes) if s is not None else 0,
                                (t.admitted, t.prefilled, t.first_frame, t.first_chunk, t.finished,
                                 t.compiled_before)))
            start += len(c.pcm)
            if c.final:
                self._streams.pop(host_id, None)
                if s is not None:
                    self._ended.append(s.id)
        pcm = np.concatenate([c.pcm for _, c in chunks]) if start else np.zeros(0, np.float32)
        stats = self._stats()
        self._sent = _gist(stats)
        return Batch(tuple(out), pcm, stats, self.engine.compiled_on_demand, tuple(replies))

    def _stats(self):
        """The engine's snapshot with its streams named by the host's ids; names of ended streams the snapshot no
        longer lists are dropped."""
        st, names = self.engine.stats(), self._host_ids
        named = dataclasses.replace(st, live_ids=tuple(names.get(i, 0) for i in st.live_ids),
                                    queued_ids=tuple(names.get(i, 0) for i in st.queued_ids))
        if self._ended:
            listed = set(st.live_ids) | set(st.queued_ids)
            for i in self._ended:
                if i not in listed:
                    names.pop(i, None)
            self._ended = [i for i in self._ended if i in listed]
        return named


def _gist(stats) -> tuple:
    """What the host must hear of without a hand-out: the programs left to compile, the slots served, the streams."""
    return stats.compiling, stats.slots, stats.live, stats.queued


def _warmup(engine: Engine, background: bool) -> None:
    engine.warmup(background=background)


def _start(engine: Engine) -> None:
    engine.start()


def _prime_voice(engine: Engine, ref_codes) -> None:
    engine.prepare_voice(ref_codes)


def _clone_voice(engine: Engine, audio, ref_text, xvector_only, trailing_silence_s):
    return engine.model.clone_voice(audio, ref_text, xvector_only, trailing_silence_s)


def _warm_voices(engine: Engine, max_seconds: float, trailing_silence_s: float) -> None:
    engine.model.voice_encoders.warmup(max_seconds, trailing_silence_s)


def _compile_summary(engine: Engine) -> str:
    return compile_cache.summary()


# what a `Call` may ask for, by name
CALLS = {"warmup": _warmup, "start": _start, "prime_voice": _prime_voice, "clone_voice": _clone_voice,
         "warm_voices": _warm_voices, "compile_summary": _compile_summary}

_threads = itertools.count(1)


def in_process(engine: Engine):
    """A core on a thread of this process over `engine`: `(link, hello)` for a `core_client.CoreClient`, the same
    messages as a core process's, unpickled (the test suite's mode: no process to spawn)."""
    host_end, core_end = thread_links()
    host = CoreHost(engine, core_end)
    threading.Thread(target=host.serve, name=f"qtts-core-{next(_threads)}", daemon=True).start()
    return host_end, Hello(HostModel.of(engine.model), engine.config, backend(), engine.stats())


def backend() -> str:
    """The device backend of this process (the core's: the host never asks its own)."""
    import jax

    return jax.default_backend()
