"""The engine's loop: it holds the streams and, each iteration, admits, plans, executes the plan on the device and
hands out the audio. Each of those is a module of its own (`admission`, `plan`, `iteration`, `decoding`, `handout`,
`bookkeeping`, `measurements`); this one holds the state they share and the public API the server and its process
boundary call. docs/architecture.md walks one iteration through them."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import threading
import time

import numpy as np

from qtts_jax.engine import measurements, preparation, trailing, warmup
from qtts_jax.engine.admission import admit
from qtts_jax.engine.config import EngineConfig
from qtts_jax.engine.handout import HandOut, send_audio
from qtts_jax.engine.iteration import execute, update
from qtts_jax.engine.job import Job
from qtts_jax.engine.plan import Sizes, schedule
from qtts_jax.engine.profile import IterationProfile, PartTimer
from qtts_jax.engine.runner import DeviceRunner, Runner
from qtts_jax.engine.stats import EngineStats, occupancy, sizes, snapshot
from qtts_jax.engine.stream import Chunk, Stream
from qtts_jax.model import Model
from qtts_jax.request import Request

log = logging.getLogger(__name__)


class Engine:
    """The host loop that admits, steps, decodes and hands out audio, over a `Runner` that owns the device."""

    def __init__(self, model: Model, config: EngineConfig = EngineConfig(), runner: DeviceRunner | None = None):
        """`runner`: the device half (by default a `Runner` of `model` and `config`), or a simulated device
        (bench/sim_device.py: the loop's host work and its scheduling are timed over one)."""
        self.model = model
        self.config = c = config
        if max(c.prompt_buckets) >= c.context:
            raise ValueError("the largest prompt bucket must leave room for frames in the context")
        self.runner = runner if runner is not None else Runner(model, config)
        # the sizes the loop may use: all of them, but while `warmup(background=True)` compiles only those compiled
        # and timed so far (`warmup.use`); the slots in use never exceed the largest rung
        self.sizes = Sizes(c.ladder, c.first_sizes, c.step_sizes, c.codec_sizes, c.prefill_sizes)
        self._ready: set = set()  # programs warmed up (compiled and timed), by runner key
        self._compiling = 0  # programs the background warm-up has still to compile and time
        self.slots: list[Stream | None] = [None] * c.slots
        self.queue: collections.deque[Stream] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._running = False
        self.audio_in_flight: HandOut | None = None  # the codec call in flight
        measurements.start(self)
        self.profile = IterationProfile()
        # hands audio out while the loop dispatches the step; its idle thread ends when the engine is collected
        self.sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="qtts-audio-out")
        self.iterations = 0
        self.clock = time.perf_counter  # see `set_clock`
        # called on the background warm-up's thread once its last stage is compiled and timed, before the stats say
        # nothing is left to compile (a server process freezes the garbage collector's view of its startup there)
        self.on_compiled = None
        self.compiling_ahead = None  # compile workers started before the engine (`warmup.compile_ahead`)
        self._stats: EngineStats = snapshot(self)

    # ---- public API -------------------------------------------------------------------------

    def prepare(self, request: Request, schedule: tuple[int, ...] | None = None, live: bool = False) -> Job:
        """The one validation of a request (`preparation.prepare`, which says what it checks); raises
        `RequestError` at once, before anything is queued; safe from any thread."""
        return preparation.prepare(self.model, self.config, request, schedule, live)

    def check_trailing(self, count: int) -> None:
        """Refuse `count` trailing text ids (`preparation.check_trailing`)."""
        preparation.check_trailing(self.config, count)

    def append_text(self, stream: Stream, ids: list[int], complete: bool = False) -> None:
        """Live text: `ids` join the trailing text of `stream` (a `live` job's, queued or playing), read one a frame
        after the ids it already has; `complete` ends the text. Safe from any thread (`trailing.append`)."""
        trailing.append(self, stream, ids, complete)

    def submit(self, job: Job, on_chunk, ahead: bool = False) -> Stream:
        """Queue a job from `prepare`; its chunks go to `on_chunk`, called on the engine thread. `ahead` queues
        it before every waiting request: the next part of a response whose listener is already playing."""
        stream = Stream(job, on_chunk)
        stream.timings.submitted = self.clock()
        stream.timings.compiled_before = self.runner.compiled_on_demand
        with self._wake:
            if ahead:
                self.queue.appendleft(stream)
            else:
                self.queue.append(stream)
            self._wake.notify()
        return stream

    def warmup(self, background: bool = False) -> None:
        """Compile and time every program the loop calls, or with `background` the least that serves and the rest
        on a thread of its own (`warmup.run`)."""
        warmup.run(self, background)

    def prepare_voice(self, ref_codes: np.ndarray) -> None:
        """Compute and cache the codec state after an ICL voice's reference codes (thread-safe; the server
        calls it when a voice is registered, so the first request with it does not pay for it)."""
        self.runner.primed_state(ref_codes)

    def set_clock(self, clock) -> None:
        """Time the loop's decisions and every stream timestamp by `clock` (tests simulate playback with it);
        iteration times measured by the old clock are dropped."""
        self.clock = clock
        self._forget_timings()

    def _forget_timings(self) -> None:
        measurements.forget(self)

    def observe_delivery_lag(self, seconds: float) -> None:
        """A batch of chunks was taken by its listeners (their event loop's coroutines) `seconds` after the engine
        handed it out: that lag is jitter the margin must cover (safe from any thread)."""
        self.jitter.add(seconds)

    @property
    def compiling(self) -> int:
        """Programs the background warm-up has still to compile and time: what `stats().compiling` says, without
        the snapshot's walk over every slot (the server asks at each stream's first chunk; safe from any thread)."""
        return self._compiling

    @property
    def compiled_on_demand(self) -> int:
        """Programs compiled when first run rather than by a warm-up, so far (safe from any thread): a request
        submitted before the latest (`Timings.compiled_before`) may have waited seconds on it."""
        return self.runner.compiled_on_demand

    def stats(self) -> EngineStats:
        """The latest published snapshot, with the queue, the streams in slots and the rungs in use as they are now
        (a burst is judged request by request, a stream that has ended no longer counts; safe from any thread)."""
        with self._lock:
            return dataclasses.replace(self._stats, **occupancy(self, self.clock()), **sizes(self))

    def run_once(self) -> bool:
        """One loop iteration (docs/architecture.md walks through it). False when there is nothing to do."""
        t0 = self.clock()
        # an iteration that compiled a program on demand (no warm-up) times the compile, not what the next one costs:
        # it goes into no estimate
        compiled = self.runner.compiled_on_demand
        parts = PartTimer()
        self._reap_cancelled()
        self._margin_s = self.jitter.margin()
        # the previous codec call's audio goes out from the sender thread as soon as the device has it, while this
        # thread admits and prefills the newcomers (in a burst that takes tens of ms of host time)
        previous, self.audio_in_flight = self.audio_in_flight, None
        ahead = previous.shape if previous is not None else None  # the codec call the device runs first
        handing = None if previous is None else self.sender.submit(send_audio, self.clock, previous.audio,
                                                                    previous.due)
        joined, prefill_calls, prefill_done = admit(self)
        trailing.feed(self)
        parts.mark("admit")
        live = [s for s in self.slots if s is not None and not s.lm_done]
        for s in live:
            if s.waiting_text:
                s.hold_playback(t0)
        live = [s for s in live if not s.waiting_text]
        if not live and handing is None and not any(s is not None and s.pending for s in self.slots):
            with self._lock:  # streams may have left (cancelled): admission must not see them for ever
                self._stats = snapshot(self)
            return False
        new = [s for s in live if not s.codes]  # at most max(first_sizes): see `admission.admit`
        playing = [s for s in live if s.codes]
        # newcomers join the playing streams' step right after their first frame: their next audio comes with it
        # (a live text stream as far as its text goes: `text_frames` counts the frames it has text for)
        allowed = [s.text_frames() for s in playing] + [None if (f := s.text_frames()) is None else f - 1 for s in new]
        plan = schedule(prefill_calls, np.array([h for s in playing if (h := s.buffered(t0)) is not None], float),
                        np.array([s.next_chunk_frames() for s in new], int), allowed, measurements.costs(self),
                        self.sizes, self.config, self._margin_s,
                        self._late.get(ahead, 0.0))
        result = execute(self, plan, playing + new, new, joined, prefill_done, handing, parts)
        self.audio_in_flight = update(self, plan, result, t0, ahead, compiled, parts)
        self.profile.add(parts, live=len(live), new=len(new), frames=plan.step.frames if plan.step else 0,
                          margin_ms=self._margin_s * 1e3, held=len(result.held))
        if self.runner.compiled_on_demand == compiled:
            measurements.iteration(self, self.clock() - t0, plan)
        self.iterations += 1
        with self._lock:
            self._stats = snapshot(self)
        return True

    def start(self) -> None:
        """Run the loop on its own thread until `stop`."""
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="qtts-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    @property
    def active(self) -> int:
        return sum(s is not None for s in self.slots)

    # ---- the streams' lifecycle on the engine thread ----------------------------------------

    def _loop(self) -> None:
        while self._running:
            try:
                busy = self.run_once()
            except Exception as exc:  # a device failure must not strand the callers
                log.exception("engine step failed")
                self.fail_all(f"engine failure: {exc}")
                busy = False
            if not busy:
                with self._wake:
                    if self._running and not self.queue:
                        self._wake.wait(timeout=0.05)

    def _finish(self, stream: Stream, error: str | None = None) -> None:
        if stream.slot is not None and self.slots[stream.slot] is stream:
            self.slots[stream.slot] = None
        stream.lm_done = True
        stream.emit(Chunk(np.zeros(0, np.float32), stream.decoded, 0, self.clock(), final=True, error=error,
                          due=math.inf))

    def _reap_cancelled(self) -> None:
        """Cancelled streams leave at once: a slot is free for the very next step."""
        for s in self.slots:
            if s is not None and s.cancelled:
                self._finish(s, error="cancelled")
        with self._lock:
            gone = [s for s in self.queue if s.cancelled]
            self.queue = collections.deque(s for s in self.queue if not s.cancelled)
        for s in gone:
            self._finish(s, error="cancelled")

    def fail_all(self, message: str) -> None:
        """End every stream, playing or queued, with the error `message` (what the loop does when a call fails)."""
        self.audio_in_flight = None
        self.sender.submit(lambda: None).result()  # what the sender still hands out goes before the final chunks
        for s in list(self.slots):
            if s is not None:
                self._finish(s, error=message)
        with self._lock:
            queued, self.queue = list(self.queue), collections.deque()
        for s in queued:
            self._finish(s, error=message)
