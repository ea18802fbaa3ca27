"""The host's side of the host-core link: the engine as the server calls it, whether its core runs in a process of its
own (`CoreClient.spawn`, one per device) or on a thread here (`CoreClient.in_process`, the tests').

Text work stays on the host: `prepare` (request checks, prompt layout: `preparation`, host work only) and the
trailing-text checks read the model's host half (`host_model.HostModel`) and the engine's config. Everything else
crosses as messages (`messages`): requests queue up and a sender thread sends whatever queued since its last send as
one batch; a reader thread takes the core's batches, mirrors each stream's timings and hands its chunks to the
stream's callback (the asyncio bridge puts a whole batch into its event loop in one callback), and keeps the core's
latest snapshot.

`stats()` is that snapshot as it is now on this side: jobs submitted since count as queued at once (a burst is
judged request by request), streams whose final chunk came no longer count. A core process that dies ends its
streams with an error chunk and its calls with an error, `up` turns False, and the client starts a new one, warms it
as the last was (the compilation cache makes it fast), primes the voices it had primed, and is `up` again."""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import itertools
import logging
import math
import multiprocessing.util  # noqa: F401  (registers its exit handler, which ends daemonic processes, before ours)
import threading
import time
from typing import Callable

import numpy as np

from qtts_jax.engine import core_host, core_process, preparation
from qtts_jax.engine.job import Job
from qtts_jax.engine.messages import AppendText, Batch, Call, Cancel, DeliveryLag, Hello, Stop, Submit
from qtts_jax.engine.stats import EngineStats
from qtts_jax.engine.stream import Chunk, Timings
from qtts_jax.request import Request, RequestError

log = logging.getLogger(__name__)

_LOST = "engine failure: the engine core process exited"
_exiting = threading.Event()  # this interpreter is exiting: its core processes end with it, none restarts
atexit.register(_exiting.set)


def _ended(chunk: Chunk) -> None:
    """A stream's callback once its final chunk is out (the handle no longer holds its caller's)."""


class CoreStream:
    """The host's handle of one submitted job: its chunks reach `on_chunk` on the client's reader thread; its
    timings mirror the core's stream; `cancel()` is safe from any thread."""

    def __init__(self, client: "CoreClient", id: int, job: Job, on_chunk: Callable[[Chunk], None]):
        self.id, self.job, self.on_chunk = id, job, on_chunk
        self._client = client
        self.timings = Timings(submitted=time.perf_counter())
        self.frames = 0  # frames the core has made for it so far
        self.finished = False
        self.cancelled = False
        self.trailing_total = len(job.prompt.trailing)  # live text: ids sent, the completion's tts_eos included
        self.complete_sent = not job.live

    def cancel(self) -> None:
        if not self.cancelled and not self.finished:
            self.cancelled = True
            self._client._send(Cancel(self.id))

    def _emit(self, chunk: Chunk) -> None:
        self.timings.chunk_times.append(chunk.sent_at)
        on_chunk = self.on_chunk
        if chunk.final:
            self.finished = True
            self.on_chunk = _ended  # no reference cycle through the caller's callback (see `Stream.emit`)
        on_chunk(chunk)


class CoreClient:
    """The engine's face on the host; `connect()` starts a core: `(link, hello, process or None)`."""

    def __init__(self, connect: Callable, restart: bool = False):
        self._connect, self._restart = connect, restart
        self._lock = threading.Condition()
        self._published = threading.Condition()  # notified whenever the snapshot changes (`wait_stats`)
        self._streams: dict[int, CoreStream] = {}  # until their final chunk
        self._unseen: dict[int, tuple[CoreStream, bool]] = {}  # submitted (ahead?), not yet in a core snapshot
        self._ended: set[int] = set()  # final chunk in, maybe still in the latest snapshot
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._outbox: list = []
        self._ids = itertools.count(1)
        self._primed: dict[bytes, np.ndarray] = {}  # voices primed, to prime again in a new core
        self._warm: bool | None = None  # the warm-up's `background`, to warm a new core the same way
        self._started = False
        self._stopping = False
        self._hop = 0.0  # the latest batch's hand-out (in a core process) to its arrival here
        self.on_compiled = None  # called once a background warm-up has nothing left to compile
        self.on_up = None  # called with `up` whenever it changes after the start (the core died, or is back)
        self.up = self._linked = False  # ready for requests; a core at the link's other end
        self._attach(*connect())
        threading.Thread(target=self._send_loop, name="qtts-core-in", daemon=True).start()

    @classmethod
    def in_process(cls, engine) -> "CoreClient":
        """Over `engine` (a `core.Engine`), its core on a thread of this process."""
        return cls(lambda: (*core_host.in_process(engine), None))

    @classmethod
    def spawn(cls, spec) -> "CoreClient":
        """A core process of `spec` (`core_process.CoreSpec`), restarted whenever it dies."""
        return cls(lambda: (lambda proc, link, hello: (link, hello, proc))(*core_process.spawn(spec)), restart=True)

    def _attach(self, link, hello: Hello, process) -> None:
        self._link, self.process = link, process
        self.model, self.config, self.backend = hello.model, hello.config, hello.backend
        self.model.clone = self._clone
        if self.model.voice_encoders is not None:
            self.model.voice_encoders.warm = self._warm_voices
        self._stats, self._compiled_on_demand = hello.stats, 0
        threading.Thread(target=self._read_loop, args=(link,), name="qtts-core-out", daemon=True).start()
        self.up = self._linked = True

    # ---- host work ------------------------------------------------------------------------------------------

    def prepare(self, request: Request, schedule: tuple[int, ...] | None = None, live: bool = False) -> Job:
        """`Engine.prepare`, here: host work only (`preparation.prepare`)."""
        return preparation.prepare(self.model, self.config, request, schedule, live)

    def check_trailing(self, count: int) -> None:
        preparation.check_trailing(self.config, count)

    # ---- requests to the core -------------------------------------------------------------------------------

    def submit(self, job: Job, on_chunk, ahead: bool = False) -> CoreStream:
        """`Engine.submit`: `on_chunk` gets its chunks on the client's reader thread; a core that is down ends it at
        once with an error chunk."""
        stream = CoreStream(self, next(self._ids), job, on_chunk)
        with self._lock:
            up = self.up
            if up:
                stream.timings.compiled_before = self._compiled_on_demand
                self._streams[stream.id] = stream
                self._unseen[stream.id] = (stream, ahead)
                self._queue(Submit(stream.id, job, ahead, stream.timings.submitted))
        if not up:
            stream._emit(_final(f"{_LOST}; it is restarting"))
        return stream

    def append_text(self, stream: CoreStream, ids: list[int], complete: bool = False) -> None:
        """`Engine.append_text`, checked here (the same refusals, raised here) and applied by the core."""
        if stream.complete_sent or not stream.job.live:
            raise RequestError("text", "this stream's text is complete: nothing can be appended")
        ids = [int(i) for i in ids]
        count = len(ids) + complete  # the completion brings its tts_eos
        self.check_trailing(stream.trailing_total + count + (not complete))
        stream.trailing_total += count
        stream.complete_sent = complete
        self._send(AppendText(stream.id, tuple(ids), complete))

    def observe_delivery_lag(self, seconds: float) -> None:
        """`Engine.observe_delivery_lag`, the hop from a core process included: `seconds` counts from when this side
        took a batch, its listeners' clock from when the core handed it out."""
        self._send(DeliveryLag(seconds + self._hop))

    def warmup(self, background: bool = False) -> None:
        """`Engine.warmup` in the core (waits for it)."""
        self._warm = background
        self._call("warmup", background)

    def start(self) -> None:
        self._started = True
        self._call("start")

    def prepare_voice(self, ref_codes: np.ndarray) -> None:
        """`Engine.prepare_voice` in the core (waits for it); a new core primes it again."""
        codes = np.asarray(ref_codes)
        self._call("prime_voice", codes)
        with self._lock:  # registrations prime from the server's executor threads
            self._primed[codes.tobytes()] = codes
            while len(self._primed) > self.config.cached_voices:
                self._primed.pop(next(iter(self._primed)))

    def compile_summary(self) -> str:
        """What the core's compilation cache did so far (`compile_cache.summary`, in the core's process)."""
        return self._call("compile_summary")

    def _clone(self, audio, ref_text, xvector_only, trailing_silence_s):
        return self._call("clone_voice", audio, ref_text, xvector_only, trailing_silence_s)

    def _warm_voices(self, max_seconds: float, trailing_silence_s: float) -> None:
        self._call("warm_voices", max_seconds, trailing_silence_s)

    def stop(self) -> None:
        """Stop the core (a process core exits); streams still open end with an error chunk."""
        with self._lock:
            self._stopping = True
            self._queue(Stop())
        if self.process is not None:
            self.process.join(30)
            if self.process.is_alive():
                self.process.kill()
        else:
            with self._lock:
                self._lock.wait_for(lambda: not self.up, timeout=30)

    # ---- what the core publishes ----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The core's latest snapshot, with what this side knows since: submitted jobs it does not list yet are
        queued (an `ahead` one first), streams whose final chunk came are gone."""
        with self._lock:
            st, ended = self._stats, self._ended
            ahead = [(s.id, s.job.frames_cap, s.timings.submitted) for s, a in self._unseen.values() if a]
            behind = [(s.id, s.job.frames_cap, s.timings.submitted) for s, a in self._unseen.values() if not a]
        live = [(i, f) for i, f in zip(st.live_ids, st.frames_left) if i not in ended]
        queued = ahead[::-1] + [(i, f, None) for i, f in zip(st.queued_ids, st.queued_frames) if i not in ended]
        queued += behind
        oldest = st.oldest_wait_s
        if not st.queued and queued:
            oldest = time.perf_counter() - min(t for _, _, t in queued)
        return dataclasses.replace(st, live=len(live), frames_left=tuple(f for _, f in live),
                                   live_ids=tuple(i for i, _ in live), queued=len(queued),
                                   queued_frames=tuple(f for _, f, _ in queued),
                                   queued_ids=tuple(i for i, _, _ in queued), oldest_wait_s=oldest)

    def wait_stats(self, done: Callable[[EngineStats], bool], timeout: float) -> bool:
        """Wait until `done(self.stats())` holds, checked whenever the core's snapshot changes; False if `timeout`
        passed first. For callers that wait for the engine to settle (tests), instead of polling it."""
        with self._published:
            return self._published.wait_for(lambda: done(self.stats()), timeout)

    def _snapshot_changed(self) -> None:
        with self._published:
            self._published.notify_all()

    @property
    def compiling(self) -> int:
        return self._stats.compiling

    @property
    def compiled_on_demand(self) -> int:
        return self._compiled_on_demand

    @property
    def active(self) -> int:
        return self.stats().live

    # ---- the link ---------------------------------------------------------------------------------------------

    def _send(self, msg) -> None:
        with self._lock:
            self._queue(msg)

    def _queue(self, msg) -> None:
        """(under the lock) the first message since the last send wakes the sender"""
        self._outbox.append(msg)
        if len(self._outbox) == 1:
            self._lock.notify_all()

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._outbox and self._linked)
                batch, self._outbox, link = self._outbox, [], self._link
            try:
                link.send(batch)
            except (OSError, ValueError):  # the core is gone: its reader restarts it and ends the streams
                pass
            if any(isinstance(m, Stop) for m in batch):
                return

    def _call(self, name: str, *args, force: bool = False):
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not (self.up or force):
                raise RuntimeError(f"{_LOST}; it is restarting")
            call = next(self._ids)
            self._calls[call] = future
            self._queue(Call(call, name, args))
        return future.result()

    def _read_loop(self, link) -> None:
        while True:
            try:
                batch = link.recv()
            except (EOFError, OSError):
                self._lost(link)
                return
            self._receive(batch)

    def _receive(self, batch: Batch) -> None:
        st = batch.stats
        if self.process is not None and batch.chunks:  # a core process's clock is this one's (a thread's may not be)
            self._hop = max(time.perf_counter() - min(c.sent_at for c in batch.chunks), 0.0)
        with self._lock:
            was_compiling = self._stats.compiling
            self._stats, self._compiled_on_demand = st, batch.compiled_on_demand
            for i in (*st.live_ids, *st.queued_ids):
                self._unseen.pop(i, None)
            streams = [self._streams.get(c.id) for c in batch.chunks]
            for c in batch.chunks:
                if c.final:
                    self._streams.pop(c.id, None)
                    self._unseen.pop(c.id, None)
                    self._ended.add(c.id)
            self._ended = {i for i in self._ended if i in st.live_ids or i in st.queued_ids}
            calls = [(self._calls.pop(r.call, None), r) for r in batch.replies]
        for s, c in zip(streams, batch.chunks):
            if s is None or s.finished:
                continue
            s.frames = c.made
            t = s.timings
            t.admitted, t.prefilled, t.first_frame, t.first_chunk, t.finished, t.compiled_before = c.timings
            s._emit(Chunk(batch.pcm[c.start: c.start + c.samples], c.first_frame, c.frames, c.sent_at, c.final,
                          c.error, c.due))
        for future, r in calls:
            if future is not None:
                future.set_exception(r.error) if r.error is not None else future.set_result(r.value)
        self._snapshot_changed()
        if was_compiling and not st.compiling and self.on_compiled is not None:
            self.on_compiled()

    def _lost(self, link) -> None:
        """The core's end closed: a stop, or a core that died. Its open streams end with an error chunk, its calls
        with an error; a core process that died is started again."""
        with self._lock:
            if link is not self._link:
                return
            self.up = self._linked = False
            self._stats = dataclasses.replace(self._stats, live=0, frames_left=(), live_ids=(), queued=0,
                                              queued_frames=(), queued_ids=(), oldest_wait_s=0.0)
            streams, self._streams = list(self._streams.values()), {}
            self._unseen, self._ended = {}, set()
            calls, self._calls = list(self._calls.values()), {}
            self._outbox = [m for m in self._outbox if isinstance(m, Stop)]
            stopping = self._stopping or _exiting.is_set()
            self._lock.notify_all()
        self._snapshot_changed()
        message = "engine stopped" if stopping else _LOST
        if not stopping:
            log.error("%s; %d streams ended", _LOST, len(streams))
        if not stopping and self.on_up is not None:
            self.on_up(False)
        for s in streams:
            if not s.finished:
                s._emit(_final(message))
        for future in calls:
            future.set_exception(RuntimeError(message))
        if self._restart and not stopping:
            threading.Thread(target=self._reconnect, name="qtts-core-restart", daemon=True).start()

    def _reconnect(self) -> None:
        """A new core, warmed and started as the last one was, its voices primed; then `up` again."""
        delay = 1.0
        while not self._stopping:
            try:
                link, hello, process = self._connect()
                break
            except Exception:
                log.exception("the engine core did not start; trying again in %.0f s", delay)
                threading.Event().wait(delay)  # nothing to wait on but time: a start that fails again soon
                delay = min(delay * 2, 30.0)
        else:
            return
        t0 = time.perf_counter()
        with self._lock:
            self._link, self.process, self._linked = link, process, True
            self._stats, self._compiled_on_demand = hello.stats, 0
            self._lock.notify_all()
        self._snapshot_changed()
        threading.Thread(target=self._read_loop, args=(link,), name="qtts-core-out", daemon=True).start()
        try:
            if self._warm is not None:
                self._call("warmup", self._warm, force=True)
            if self._started:
                self._call("start", force=True)
            with self._lock:
                primed = list(self._primed.values())
            for codes in primed:
                self._call("prime_voice", codes, force=True)
        except Exception:
            log.exception("the new engine core failed to warm up")
            return
        with self._lock:
            self.up = True
            self._lock.notify_all()
        if self.on_up is not None:
            self.on_up(True)
        log.info("engine core restarted in %.1f s", time.perf_counter() - t0)


def _final(error: str) -> Chunk:
    return Chunk(np.zeros(0, np.float32), 0, 0, time.perf_counter(), final=True, error=error, due=math.inf)
