"""Continuous-batching streaming engine: a playback-deadline loop over one compiled step per live-batch size.

The loop holds the streams and executes a typed plan per iteration (`plan.schedule`, composing `scheduler`'s pure
functions over the cost model `costs`); the device work is the `runner`'s: a fixed number of slots of per-stream
state on the device (the talker KV cache, per-slot sampling state, trailing text, frame counters and the codes ring
the codec reads), and the programs compiled for a ladder of batch sizes. Each call takes only the live slots' rows (gathered by index, padded to the next rung with rows
whose writes are dropped), so a large engine with few live streams steps as fast as a small one. The loop and the
runner meet at the runner's calls and their typed outcomes (`StepOutcome`, `FirstOutcome`, `Calibration`).

One iteration of the loop (`run_once`): admission and the plan (`plan.admissions`, `plan.prefills`, `plan.schedule`),
the runner's calls (`_execute`), then the codec call (`plan.codec_call`) and the bookkeeping of what came back
(`_update`):
1. waiting requests that have a free slot are prefilled, all of them in one call per prompt bucket, so a
   burst of N arrivals costs about one prefill; as many as the playing streams' headroom pays for (their
   prefill and first frame run before the playing streams' next frame), the rest waiting an iteration;
2. the newcomers step their first frame and decode it in one small program of their own, queued first, so
   their first audio does not wait for the playing streams' step (with `hold_first` on, unless their next audio
   could not follow that one frame before it has played, the measured margin spared: `scheduler.first_chunk_alone`;
   then the first frame goes out with the step's frames, a longer first chunk one step later);
3. the playing rows, and the newcomers right after their first frame, step `n` frames in one `lax.scan`: the
   most frames whose measured cost leaves every stream's playback headroom (audio handed out minus audio a
   zero-buffer listener has played) above the margin, a newcomer's one frame of audio included (counted from
   when it really goes out: behind the previous iteration's codec call on the device, later than the
   newcomers' own programs alone would put it; measured), short enough that a request arriving meanwhile does
   not wait long unless only a longer step keeps up;
4. the previous codec call's audio is handed out from a thread of its own from the iteration's start, while the
   engine thread admits and prefills the newcomers (in a burst tens of ms of host work, which that audio once
   waited for: its streams' listeners ran dry) and dispatches the step (its call holds the host while the device
   runs its loop trips); the newcomers' first chunks go out from that thread too, as soon as their program is
   done, not after the step's dispatch returns (measured on the 1.7B shape: that dispatch holds the engine thread
   30-40 ms at 40 requests/s, which every first audio waited for); how long into an iteration the hand-out
   comes is measured and counted in every deadline above;
5. each stream's new frames become audio in ONE codec call for all rows with a chunk due, each row with its
   own frame count: until a stream has built its lead (`lead_s` of audio in hand) every frame goes out in the
   iteration that made it; past it, chunks follow its schedule (1, 2, 4, 8 ... frames). The call is queued
   right behind the step, before the host reads the step's outputs: it reads the frames from the codes ring
   where the step writes them (counting on the step's frames; a stream that ended early decodes only those it
   made), so the device goes from step to codec without waiting for the host, and no codes cross to the host
   and back.
Live text (`prepare(live=True)`, `append_text`): ids appended to a playing stream go to its trailing text on the
device at the start of an iteration; a stream that has read every id it has skips the steps until more come (each
step row has its own frame limit), so its codes are those of its whole text at once.
The margin is measured, not guessed: iterations that overran their prediction, audio handed out later than usual
after them, and chunks their listeners' event loop took late (`observe_delivery_lag`) feed `scheduler.Jitter`.

The frame step is `generate.frame_step`, shared with `Model.generate`: codes chosen per row (`vmap`), one
batched talker call; nothing mixes rows, so a seeded request gives the same codes alone or beside others.
An ICL voice's audio continues its reference recording, as the reference decodes reference + new codes and
cuts the reference's share: the slot's codec state starts from the state after the reference codes
(computed once per voice and cached). Everything the loop calls is compiled by `warmup` (in parallel, and
timed by `Runner.calibrate`: the costs drive step sizes and admission); nothing compiles in steady state. A
server's warm-up returns once the smallest rung can serve and compiles the larger rungs in the background, the
slots in use growing with them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import threading
import time

import jax
import numpy as np

from qtts_jax.engine import preparation, warmup
from qtts_jax.engine.bookkeeping import record, settle_audio, take_first
from qtts_jax.engine.config import EngineConfig
from qtts_jax.engine.costs import Costs
from qtts_jax.engine.handout import HandOut, send_audio, send_first, stamp_prefilled
from qtts_jax.engine.iteration import IterationResult
from qtts_jax.engine.job import Job
from qtts_jax.engine.profile import IterationProfile, PartTimer
from qtts_jax.engine.runner import DeviceRunner, Runner
from qtts_jax.engine.plan import IterationPlan, PrefillCall, Sizes, admissions, codec_call, prefills, schedule
from qtts_jax.engine.scheduler import Jitter
from qtts_jax.engine.stats import EngineStats, occupancy, sizes, snapshot
from qtts_jax.engine.stream import Chunk, Stream
from qtts_jax.model import Model
from qtts_jax.request import Request, RequestError

log = logging.getLogger(__name__)


class Engine:
    """The host loop that admits, steps, decodes and hands out audio, over a `Runner` that owns the device."""

    def __init__(self, model: Model, config: EngineConfig = EngineConfig(), runner: DeviceRunner | None = None):
        """`runner`: the device half (by default a `Runner` of `model` and `config`), or a simulated device
        (bench/sim_device.py: the loop's host work and its scheduling are timed over one)."""
        self.model = model
        self.config = config
        c = config
        if max(c.prompt_buckets) >= c.context:
            raise ValueError("the largest prompt bucket must leave room for frames in the context")
        self.runner = runner if runner is not None else Runner(model, config)
        # the sizes the loop may use: all of them, but while `warmup(background=True)` compiles only those compiled
        # and timed so far (`warmup.use`); the slots in use never exceed the largest rung
        self._ladder, self._first_sizes, self._step_sizes = c.ladder, c.first_sizes, c.step_sizes
        self._codec_sizes, self._prefill_sizes = c.codec_sizes, c.prefill_sizes
        self._ready: set = set()  # programs warmed up (compiled and timed), by runner key
        self._compiling = 0  # programs the background warm-up has still to compile and time
        self.slots: list[Stream | None] = [None] * c.slots
        self.queue: collections.deque[Stream] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._running = False
        self._audio: HandOut | None = None  # the codec call in flight
        self.step_costs: dict = {}  # (rung, frames) -> seconds per iteration, measured
        self._idle_step_costs: dict = {}  # the same, as `warmup` timed them on the idle engine
        self.prefill_costs: dict = {}  # requests -> seconds, measured
        self.first_costs: dict = {}  # rung -> seconds of newcomers' first frame and its audio, measured
        self._iteration_s = 0.0
        self._delivery_s = 0.0  # iteration start -> the previous iteration's audio handed out, measured (EMA)
        # the same by the shape (rows, frames) of the codec call that made the audio: a wider call takes longer
        self._delivery: dict[tuple[int, int], float] = {}
        self._recent_frame_s: collections.deque[float] = collections.deque(maxlen=64)
        # newcomers' first chunks: seconds after the iteration's start + their prefill and first frame (measured),
        # by the shape of the codec call that ran ahead of them on the device (what they wait for)
        self._first_late: dict[tuple[int, int], collections.deque[float]] = {}
        # the least of each shape's recent samples, what the planner counts on: counting on it never lets a
        # newcomer's next audio come after its first has played (behind calls of one shape it varies little)
        self._late: dict[tuple[int, int], float] = {}
        self._profile = IterationProfile()
        # hands audio out while the loop dispatches the step; its idle thread ends when the engine is collected
        self._sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="qtts-audio-out")
        self.jitter = Jitter(c.min_margin_s)  # lateness beyond plan
        self._margin_s = c.min_margin_s  # this iteration's margin, read once from `jitter`
        self.late_chunks = 0  # chunks handed out after their stream's listener ran dry
        self.iterations = 0
        self.clock = time.perf_counter  # see `set_clock`
        # called on the background warm-up's thread once its last stage is compiled and timed, before the stats say
        # nothing is left to compile (a server process freezes the garbage collector's view of its startup there)
        self.on_compiled = None
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
        """Live text: `ids` join the trailing text of `stream` (a `live` job's, queued or playing), read one a
        frame after the ids it already has; `complete` ends the text (its tts_eos follows the ids). Safe from any
        thread: the engine thread moves them to the device before its next step.

        A live stream that has read every id it has waits (its rows skip the steps, the listener hears a pause)
        until more text or the completion comes: it then makes exactly the frames it would have made given the
        whole text at once (a seeded request too), as the model never sees text missing that it would have
        read. Raises `RequestError` for a stream that is not live or already complete, and `PromptTooLong`
        (nothing appended) when the text outgrows `max_trailing`."""
        with self._wake:
            if stream.complete_sent or not stream.job.live:
                raise RequestError("text", "this stream's text is complete: nothing can be appended")
            ids = [int(i) for i in ids] + ([self.model.cfg.text.tts_eos] if complete else [])
            self.check_trailing(stream.trailing_total + len(ids) + (not complete))
            stream.unsent += ids
            stream.trailing_total += len(ids)
            stream.complete_sent = complete
            self._wake.notify()

    def _feed_text(self) -> None:
        """Appended live text to the device, for the streams in slots (queued ones keep theirs until admitted)."""
        fed = []
        with self._lock:
            for s in self.slots:
                if s is not None and s.unsent:
                    fed.append((s, s.unsent, s.complete_sent))
                    s.unsent = []
        for s, ids, complete in fed:
            if s.finished:
                continue
            s.cap = preparation.frames_cap(self.config, s.job, s.text_known + len(ids))
            self.runner.append_text(s.slot, s.text_known, ids, s.cap)
            s.text_known += len(ids)
            s.text_complete = complete

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
        """Drop the measured iteration time, delivery delays and jitter: the next iterations measure them anew."""
        self._iteration_s = 0.0
        self._delivery_s = 0.0
        self._delivery.clear()
        self._first_late.clear()
        self._late.clear()
        self.jitter = Jitter(self.config.min_margin_s)

    def observe_delivery_lag(self, seconds: float) -> None:
        """A batch of chunks was taken by its listeners (their event loop's coroutines) `seconds` after the engine
        handed it out: that lag is jitter the margin must cover (safe from any thread)."""
        self.jitter.add(seconds)

    @property
    def compiling(self) -> int:
        """Programs the background warm-up has still to compile and time: what `stats().compiling` says, without
        the snapshot's walk over every slot (the server asks at each stream's first chunk; safe from any
        thread)."""
        return self._compiling

    @property
    def compiled_on_demand(self) -> int:
        """Programs compiled when first run rather than by a warm-up, so far (safe from any thread): a request
        submitted before the latest (`Timings.compiled_before`) may have waited seconds on it."""
        return self.runner.compiled_on_demand

    def stats(self) -> EngineStats:
        """The latest published snapshot, with the queue, the streams in slots and the rungs in use as they are
        now: requests submitted since the last iteration count at once, so a burst is judged request by request,
        and a stream that has ended (its final chunk may reach its client before the iteration publishes) no
        longer counts; the frames left are read with the streams in slots, so the two always agree (safe from any
        thread)."""
        with self._lock:
            return dataclasses.replace(self._stats, **occupancy(self, self.clock()), **sizes(self))

    def run_once(self) -> bool:
        """One loop iteration (see the module docstring). False when there is nothing to do."""
        t0 = self.clock()
        # an iteration that compiled a program on demand (no warm-up) times the compile, not what the next one costs:
        # it goes into no estimate
        compiled = self.runner.compiled_on_demand
        parts = PartTimer()
        self._reap_cancelled()
        self._margin_s = self.jitter.margin()
        # the previous codec call's audio goes out from the sender thread as soon as the device has it, while this
        # thread admits and prefills the newcomers (in a burst that takes tens of ms of host time)
        previous, self._audio = self._audio, None
        ahead = previous.shape if previous is not None else None  # the codec call the device runs first
        handing = None if previous is None else self._sender.submit(send_audio, self.clock, previous.audio,
                                                                    previous.due)
        joined, prefill_calls, prefill_done = self._admit()
        self._feed_text()
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
        new = [s for s in live if not s.codes]  # at most max(first_sizes): see _admit
        playing = [s for s in live if s.codes]
        # newcomers join the playing streams' step right after their first frame: their next audio comes with it
        # (a live text stream as far as its text goes: `text_frames` counts the frames it has text for)
        candidates = playing + new
        allowed = [s.text_frames() for s in playing] + [None if (f := s.text_frames()) is None else f - 1 for s in new]
        plan = schedule(prefill_calls, np.array([h for s in playing if (h := s.buffered(t0)) is not None], float),
                        np.array([s.next_chunk_frames() for s in new], int), allowed, self._costs(),
                        Sizes(self._ladder, self._first_sizes, self._step_sizes), self.config, self._margin_s,
                        self._late.get(ahead, 0.0))
        result = self._execute(plan, candidates, new, joined, prefill_done, handing, parts)
        self._audio = self._update(plan, result, t0, ahead, compiled, parts)
        step = plan.step
        self._profile.add(parts, live=len(live), new=len(new), frames=step.frames if step else 0,
                          margin_ms=self._margin_s * 1e3)
        elapsed = self.clock() - t0
        if self.runner.compiled_on_demand == compiled:
            self._iteration_s = _ema(self._iteration_s or None, elapsed)
            if step is not None:  # what a step iteration really takes, host work included, newcomers' share not
                self.jitter.add(elapsed - step.predicted_s)
                cost = max(elapsed - plan.extra_s, 0.0)
                key = (plan.step_rung, step.frames)
                self.step_costs[key] = _ema(self.step_costs.get(key), cost)
        self.iterations += 1
        with self._lock:
            self._stats = snapshot(self)
        return True

    def _execute(self, plan: IterationPlan, candidates: list[Stream], new: list[Stream], joined: list[Stream],
                 prefill_done, handing, parts: PartTimer) -> IterationResult:
        """Dispatch the plan's device calls after its prefills (`_admit` dispatched those, so the device starts
        while the host plans): the newcomers' first-frame program, then the step. Between the two, the sender
        thread is given the newcomers' prefill stamp and first chunks, so they go out as the device finishes them
        while this thread is held by the step's dispatch. The codec call is not here: which frames it decodes
        depends on the newcomers' first frames, read back in `_update`."""
        first = self._dispatch_first(new, plan) if new else None
        stamping = None if prefill_done is None else self._sender.submit(stamp_prefilled, self.clock, joined,
                                                                          prefill_done)
        sending = self._sender.submit(send_first, self.clock, new, *first) if first is not None else None
        parts.mark("dispatch")
        stepping = [candidates[j] for j in plan.step_rows]
        limits, out = np.array(plan.limits, np.int32), None
        if plan.step is not None:
            idx, _ = self._rows(stepping, plan.step_rung)
            out = self.runner.step(idx, np.pad(limits, (0, plan.step_rung - len(stepping))), plan.step.frames)
        parts.mark("dispatch")
        return IterationResult(new, stepping, limits, out, handing, stamping, sending)

    def _update(self, plan: IterationPlan, result: IterationResult, t0: float, ahead: tuple[int, int] | None,
                compiled: int, parts: PartTimer) -> HandOut | None:
        """Take back what `_execute` left in flight: the previous hand-out's bookkeeping, the newcomers' first
        frames, then the codec call queued right behind the step (counting on the frames the step makes: it reads
        them where the step writes them), and last the step's outputs, the one host sync per step. Returns that
        codec call: the sender hands its audio out at the next iteration's start."""
        if result.prefilled is not None:
            result.prefilled.result()
        if result.handed is not None:
            self._settle_handout(t0, ahead, *result.handed.result())
            parts.mark("hand_out")
        if result.first is not None:
            first = result.first.result()
            if ahead is not None and self.runner.compiled_on_demand == compiled:
                # what the planner counts on when a codec call runs ahead of the newcomers
                samples = self._first_late.setdefault(ahead, collections.deque(maxlen=64))
                samples.append(max(first[2] - t0 - plan.extra_s, 0.0))
                self._late[ahead] = min(samples)
            take_first(result.new, *first, self._finish)
            parts.mark("first")
        step = plan.step
        coming = {} if step is None else {s: int(f) for s, f in zip(result.stepping, result.limits) if not s.lm_done}
        handout = self._decode_audio(self.clock(), coming, None if step is None else step.frames)
        parts.mark("codec_dispatch")
        if result.step is not None:
            frames, valid = np.asarray(result.step.frames), np.asarray(result.step.valid)
            parts.mark("device_wait")
            now = self.clock()
            self._recent_frame_s.append((now - t0) / step.frames)
            record(result.stepping, frames, valid, now, self._finish, result.limits)
            if handout is not None:
                settle_audio(handout)
        parts.mark("bookkeeping")
        return handout

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

    # ---- host-side helpers ------------------------------------------------------------------

    def _loop(self) -> None:
        while self._running:
            try:
                busy = self.run_once()
            except Exception as exc:  # a device failure must not strand the callers
                log.exception("engine step failed")
                self._fail_all(f"engine failure: {exc}")
                busy = False
            if not busy:
                with self._wake:
                    if self._running and not self.queue:
                        self._wake.wait(timeout=0.05)

    def _costs(self) -> Costs:
        """The cost model over what the loop has measured so far (its own tables, not copies)."""
        return Costs(self.step_costs, self.prefill_costs, self.first_costs, self._ladder, self._delivery_s,
                     self._delivery, self._codec_sizes)

    def _rows(self, streams: list[Stream], b: int) -> tuple[np.ndarray, np.ndarray]:
        """Slot indices of a call of `b` rows (padding aimed past the last slot) and which rows are live."""
        idx = np.full(b, self.config.slots, np.int32)
        idx[: len(streams)] = [s.slot for s in streams]
        mask = np.zeros(b, bool)
        mask[: len(streams)] = True
        return idx, mask

    def _dispatch_first(self, new: list[Stream], plan: IterationPlan):
        """Queue newcomers' first frame and its audio (one program) ahead of the step. Returns its outputs and
        which newcomers decode their frame in it (`plan.decode_first`); the others' first frame is decoded with
        the step's frames."""
        idx, mask = self._rows(new, plan.first_rung)
        fresh, decode = np.zeros(plan.first_rung, bool), np.zeros(plan.first_rung, bool)
        fresh[: len(new)], decode[: len(new)] = [s.fresh_codec for s in new], plan.decode_first
        return self.runner.first(idx, mask, fresh, decode), decode[: len(new)]

    def _admit(self) -> tuple[list[Stream], tuple[PrefillCall, ...], jax.Array | None]:
        """Give waiting requests free slots and prefill them together (`plan.prefills`: the cheapest calls per prompt
        bucket); as many as one first-frame program takes and the playing streams' headroom pays for
        (`plan.admissions`), the rest wait. Returns the admitted streams, their prefill calls and a small output of
        the last one to wait on (the state itself goes on to the step, donated)."""
        joined = []
        with self._lock:
            free = [i for i, s in enumerate(self.slots) if s is None]
            free = free[: max(self._ladder) - (len(self.slots) - len(free))]  # the rungs compiled so far
            now = self.clock()
            heads = [h for s in self.slots if s is not None and not s.waiting_text and (h := s.buffered(now)) is not None]
            limit = admissions(min(len(free), len(self.queue), max(self._first_sizes)), min(heads, default=None),
                               sum(s is not None and not s.lm_done for s in self.slots), self._costs(),
                               self._margin_s)
            while free and self.queue and len(joined) < limit:
                stream = self.queue.popleft()
                if stream.cancelled:
                    self._finish(stream, error="cancelled")
                    continue
                stream.slot = free.pop(0)
                joined.append(stream)
        if not joined:
            return [], (), None
        now = self.clock()
        for stream in joined:
            self.slots[stream.slot] = stream
            stream.timings.admitted = now
            voice = stream.job.request.voice
            if voice is not None and voice.ref_codes is not None:
                self.runner.load_voice(stream.slot, voice.ref_codes)
                stream.fresh_codec = False
        calls = prefills([s.job.bucket for s in joined], self._costs(), self._prefill_sizes)
        done = None
        for call in calls:
            done = self.runner.prefill(call.bucket, [(joined[j].slot, joined[j].job) for j in call.rows], call.size)
        return joined, calls, done

    def _decode_audio(self, now: float, coming: dict[Stream, int], step: int | None) -> HandOut | None:
        """Hand every stream's due frames (`plan.codec_call`: below its lead, all it has; past it, its
        schedule's next size) to ONE codec call, each row with its own frame count. `coming` are the streams
        whose frames are being made by the step queued ahead of this call, and how many: they count as made (a
        stream that ends early makes fewer; `_settle_audio` corrects the counts once the step is read). While a
        stream below its lead waits on it, the call is no wider than the codec chunk that the cost of a step of
        `step` frames counts (the calibration's), so it ends when the step planner said."""
        c = self.config
        waiting = [s for s in self.slots if s is not None and s.pending + coming.get(s, 0) > 0]
        if not waiting:
            return None
        call = codec_call(
            pending=np.array([s.pending + coming.get(s, 0) for s in waiting]),
            want=np.array([s.next_chunk_frames() for s in waiting]),
            lm_done=np.array([s.lm_done or s.waiting_text for s in waiting]),  # none coming soon: all out
            # a listener that ran dry waiting for live text gets what there is at once, as one below its lead
            headroom=np.array([0.0 if s.resumes else np.nan if (h := s.buffered(now)) is None else h
                               for s in waiting]),
            lead_s=c.lead_s, horizon_s=self._iteration_s + self._delivery_s + self._margin_s,
            ladder=self._ladder, codec_sizes=self._codec_sizes, step=step)
        if call is None:
            return None
        due = [(waiting[j], f) for j, f in zip(call.rows, call.counts)]
        b, n = call.rung, call.frames
        idx = np.full(b, c.slots, np.int32)
        fresh = np.zeros(b, bool)
        start, count = np.zeros(b, np.int32), np.zeros(b, np.int32)
        for j, (s, f) in enumerate(due):
            idx[j], fresh[j], start[j], count[j] = s.slot, s.fresh_codec, s.decoded, f
            s.fresh_codec = False
            s.decoded += f
            s.pending -= f
            s.inflight = f
        return HandOut(self.runner.codec(idx, fresh, start, count, n), due, (b, n))

    def _settle_handout(self, t0: float, shape: tuple[int, int], due: list, now: float, late: int) -> None:
        """After `handout.send_audio`: streams with nothing left finish; how long after the iteration's start `t0` the
        audio of a codec call of `shape` went out is the delivery delay the step planner adds to an iteration
        whose codec call has that shape (its variation goes to the jitter)."""
        seconds = now - t0
        if (known := self._delivery.get(shape)) is not None:  # the first measurement sets it; later ones vary
            self.jitter.add(seconds - known)
        self._delivery[shape] = _ema(known, seconds)
        self._delivery_s = _ema(self._delivery_s or None, seconds)
        self.late_chunks += late
        for s, _ in due:
            s.inflight = 0
            if not s.finished and s.lm_done and s.pending == 0:
                self._finish(s)

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

    def _fail_all(self, message: str) -> None:
        self._audio = None
        self._sender.submit(lambda: None).result()  # what the sender still hands out goes before the final chunks
        for s in list(self.slots):
            if s is not None:
                self._finish(s, error=message)
        with self._lock:
            queued, self.queue = list(self.queue), collections.deque()
        for s in queued:
            self._finish(s, error=message)


def _ema(old: float | None, new: float) -> float:
    """The loop's running averages of what it measures: `new` alone when nothing was measured before."""
    return new if old is None else 0.8 * old + 0.2 * new

