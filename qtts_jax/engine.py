"""Continuous-batching streaming engine: a playback-deadline loop over one compiled step per live-batch size.

A fixed number of slots holds the per-stream state (one donated pytree): the talker KV cache, slot-major
[layers, slots, kv heads, rows, head dim], and per-slot logits/hidden state, seen-code mask, done flag,
sampling settings, trailing text vectors, frame counter and cache offset. Cost follows the live load:
every program is compiled for a ladder of batch sizes, and each call takes only the live slots' rows
(gathered by index, padded to the next rung with rows whose writes are dropped), so a large engine with
few live streams steps as fast as a small one, and the cache is only touched where it is read and written.

One iteration of the loop (`run_once`):
1. every waiting request that has a free slot is prefilled, all of them in one call per prompt bucket, so a
   burst of N arrivals costs about one prefill;
2. the newcomers step their first frame and decode it in one small program of their own, queued first, so
   their first audio does not wait for the playing streams' step nor hold it to one frame;
3. the playing rows step `n` frames in one `lax.scan`: the most frames whose measured cost fits inside every
   playing stream's playback headroom (audio handed out minus audio a zero-buffer listener has played), short
   enough that a newcomer does not wait long for it unless only a longer step keeps up with playback;
4. while those run on the device, the host hands out the audio of the previous codec call, then the
   newcomers' first chunks;
5. each stream's new frames become audio in ONE codec call for all rows with a chunk due, each row with its
   own frame count: a chunk follows the stream's schedule (1, 2, 4, 8 ... frames) unless its headroom
   would not last another iteration, when it goes out at once.

The frame step is `generate.frame_step`, shared with `Model.generate`: codes chosen per row (`vmap`), one
batched talker call; nothing mixes rows, so a seeded request gives the same codes alone or beside others.
An ICL voice's audio continues its reference recording, as the reference decodes reference + new codes and
cuts the reference's share: the slot's codec state starts from the state after the reference codes
(computed once per voice and cached). Everything the loop calls is compiled by `warmup` (in parallel, and
timed: the costs drive step sizes and admission); nothing compiles in steady state.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import threading
import time
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qtts_jax import sampling, talker
from qtts_jax.codec import streaming as codec_streaming
from qtts_jax.codec.config import SAMPLES_PER_FRAME
from qtts_jax.generate import RowSettings, RowState, frame_step, pad_prompts
from qtts_jax.job import Job
from qtts_jax.model import Model
from qtts_jax.prompt import build_prompt, embed_prompt
from qtts_jax.request import Request, RequestError
from qtts_jax.stream import DEFAULT_SCHEDULE, FRAME_SECONDS, Chunk, Stream
from qtts_jax.transformer import KVCache, rows_layout

log = logging.getLogger(__name__)


def _geometric(low: int, high: int, factor: int = 4) -> tuple[int, ...]:
    """low, factor·low, factor²·low ... below high, then high itself."""
    sizes, n = [], max(1, low)
    while n < high:
        sizes.append(n)
        n *= factor
    return (*sizes, high)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    slots: int = 8
    context: int = 1024  # KV-cache rows per slot: prompt bucket + frames
    prompt_buckets: tuple[int, ...] = (32, 64, 128, 256)
    max_trailing: int = 256  # text tokens fed one per frame (streaming-text layout)
    frames_per_step: int = 4  # the most frames one step call runs (playback headroom permitting)
    schedule: tuple[int, ...] = DEFAULT_SCHEDULE  # frames per audio chunk: 1, 2, 4, 8, 8, ...
    frames_per_text_token: int = 8  # runaway guard: cap = base + this x text tokens
    frames_cap_base: int = 24
    # "pallas" (the kernel; 2-6.7x faster than the reference on the H200, bench/results/sampling-h200.json),
    # "jnp" (the reference), or "auto": the kernel on GPU, the reference elsewhere (no Triton on CPU).
    sampler: str = "auto"
    cached_voices: int = 64  # ICL voices whose primed codec state stays on the device (LRU)
    # Live-batch ladder of the step and the codec: `min_batch` times powers of 4 up to `slots`, or explicit
    # sizes. Each rung compiles the step and the codec at every size (minutes at 256 rows on the H200), and
    # a call's cost grows slowly with its rows (below 16 it is launch overhead), so rungs are far apart.
    batch_sizes: tuple[int, ...] | None = None
    min_batch: int = 16
    max_prefill: int = 32  # requests per prefill call; a prefill ladder of powers of 4 up to this
    # The longest a step may run: a request arriving during it waits that long before its own prefill.
    max_step_s: float = 0.1
    headroom_margin_s: float = 0.02  # playback headroom kept in hand beyond an iteration's predicted cost

    @property
    def codec_sizes(self) -> tuple[int, ...]:
        """Chunk sizes the codec is compiled for: the schedule's, plus powers of two to flush tails."""
        top = max(self.schedule)
        return tuple(sorted(set(self.schedule) | {1 << i for i in range(top.bit_length()) if 1 << i <= top}))

    @property
    def ladder(self) -> tuple[int, ...]:
        if self.batch_sizes is not None:
            return tuple(sorted(set(self.batch_sizes) | {self.slots}))
        sizes = set(_geometric(min(self.min_batch, self.slots), self.slots))
        if self.slots // 2 > self.min_batch:  # where calls are large, a rung halfway saves the most
            sizes.add(self.slots // 2)
        return tuple(sorted(sizes))

    @property
    def prefill_sizes(self) -> tuple[int, ...]:
        return _geometric(1, min(self.max_prefill, self.slots))

    @property
    def step_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({1, self.frames_per_step}))


def rung(sizes: tuple[int, ...], n: int) -> int:
    """The smallest size in the ascending ladder `sizes` that holds n."""
    return sizes[min(bisect.bisect_left(sizes, n), len(sizes) - 1)]


class EngineState(NamedTuple):
    rows: RowState  # each leaf [slots, ...]
    cache: KVCache  # [layers, slots, kv_heads, context, head_dim] each
    settings: RowSettings  # each leaf [slots, ...]
    k: jax.Array  # [slots] frames produced so far
    row0: jax.Array  # [slots] cache row of frame 0 (= the slot's prompt bucket)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """What the engine publishes after every iteration (under its lock) for admission and metrics, so
    nothing outside the engine thread reads its slots or queue."""

    slots: int
    live: int  # streams holding a slot
    queued: int  # requests waiting for one
    oldest_wait_s: float  # how long the first of them has waited
    frames_left: tuple[int, ...]  # per stream in a slot: frames it may still produce (0 once its LM is done)
    queued_frames: tuple[int, ...]  # per waiting request: its frame cap
    ladder: tuple[int, ...]
    prefill_sizes: tuple[int, ...]
    step_sizes: tuple[int, ...]  # frames a step call may run
    headroom_margin_s: float  # headroom the loop keeps in hand beyond an iteration's predicted cost
    step_costs: dict  # (rung, frames) -> seconds of one iteration stepping that many frames (step + codec)
    prefill_costs: dict  # requests per call -> seconds (largest prompt bucket)
    first_costs: dict  # rung -> seconds of newcomers' first frame and its audio
    iteration_s: float  # recent iteration time (EMA)
    min_headroom_s: float | None  # least playback headroom among playing streams
    iterations: int
    recent_frame_s: tuple[float, ...]  # seconds per frame of recent step calls (for histograms)

    def step_cost(self, live: int, frames: int) -> float:
        return self.step_costs[(rung(self.ladder, max(live, 1)), frames)]

    def first_cost(self, newcomers: int) -> float:
        return self.first_costs[rung(self.ladder, max(newcomers, 1))]

    def prefill_cost(self, requests: int) -> float:
        """Prefilling `requests` together: full calls of the largest size, then one for the rest."""
        top = self.prefill_sizes[-1]
        full, rest = divmod(max(requests, 1), top)
        return full * self.prefill_costs[top] + (self.prefill_costs[rung(self.prefill_sizes, rest)] if rest else 0.0)


class PromptTooLong(RequestError):
    """The request cannot fit this engine's cache (a clean refusal, not a crash)."""


def _take(tree, idx):
    """Rows `idx` of every leaf (indices past the end read the last row: padding, never written back)."""
    return jax.tree.map(lambda a: jnp.take(a, idx, axis=0, mode="clip"), tree)


def _put(tree, idx, value):
    """Write rows `idx` of every leaf, dropping padding rows (indices past the end); in place under donation."""
    return jax.tree.map(lambda a, v: a.at[idx].set(v.astype(a.dtype), mode="drop"), tree, value)


def _set_slot(tree, slot, value):
    """Write one slot's values into the batched tree (in place under donation)."""
    return jax.tree.map(lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), slot, 0), tree, value)


class Engine:
    """Device state plus the host loop that admits, steps, decodes and hands out audio."""

    def __init__(self, model: Model, config: EngineConfig = EngineConfig()):
        self.model = model
        self.config = config
        cfg, c = model.cfg, config
        if max(c.prompt_buckets) >= c.context:
            raise ValueError("the largest prompt bucket must leave room for frames in the context")
        codec_cfg = model.codec_cfg
        self._jit_insert = jax.jit(partial(_insert, cfg=cfg), donate_argnums=(1,))
        self._jit_step = jax.jit(partial(_step, cfg=cfg, choose=_chooser(c.sampler)), donate_argnums=(1,),
                                 static_argnames="n")
        self._jit_codec = jax.jit(partial(_codec, cfg=codec_cfg), donate_argnums=(1,))
        self._jit_first = jax.jit(partial(_first, cfg=cfg, codec_cfg=codec_cfg, choose=_chooser(c.sampler)),
                                  donate_argnums=(2, 3))
        self._codec_one = jax.jit(
            lambda p, st, codes: codec_streaming.decode_step(p, codec_cfg, st, codes, jnp.full(1, codes.shape[1]))[1],
            donate_argnums=(1,),
        )
        self._codec_load = jax.jit(  # a one-slot state into slot `slot` of the batched one
            lambda st, one, slot: _set_slot(st, slot, jax.tree.map(lambda v: v[0], one)), donate_argnums=(0,))
        # ("insert", bucket, requests) | ("step"|"codec", rung, frames) | ("first", rung, 1) -> compiled
        self._programs: dict = {}
        self._primed: collections.OrderedDict[bytes, codec_streaming.StreamState] = collections.OrderedDict()
        self._primed_lock = threading.Lock()
        self.state = init_state(model, c)
        self.codec_state = codec_streaming.init_state(model.codec_cfg, c.slots)
        self.slots: list[Stream | None] = [None] * c.slots
        self.queue: collections.deque[Stream] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._running = False
        self._audio = None  # (device audio, [(stream, frames)]) of the codec call in flight
        self.step_costs: dict = {}  # (rung, frames) -> seconds per iteration, measured
        self.prefill_costs: dict = {}  # requests -> seconds, measured
        self.first_costs: dict = {}  # rung -> seconds of newcomers' first frame and its audio, measured
        self._iteration_s = 0.0
        self._recent_frame_s: collections.deque[float] = collections.deque(maxlen=64)
        self._profile = _IterationProfile()
        self.iterations = 0
        self.clock = time.perf_counter  # see `set_clock`
        self._stats: EngineStats = self._snapshot()

    # ---- public API -------------------------------------------------------------------------

    def prepare(self, request: Request, schedule: tuple[int, ...] | None = None) -> Job:
        """The one validation of a request: resolve it, lay out and bucket its prompt, fix its frame cap and its
        chunk schedule (the engine's by default). Raises `RequestError` (incl. `PromptTooLong`) at once, before
        anything is queued; safe from any thread (it reads only the model and the config)."""
        model, c = self.model, self.config
        schedule = tuple(schedule or c.schedule)
        if any(n not in c.codec_sizes for n in schedule):  # the codec is compiled for these chunk sizes only
            raise RequestError("chunk_schedule", f"each entry must be one of {list(c.codec_sizes)}")
        req = request.resolved(model.cfg, model.defaults)
        prompt = build_prompt(model.cfg, model.tokenizer, req)
        bucket = next((b for b in c.prompt_buckets if b >= len(prompt)), None)
        if bucket is None:
            raise PromptTooLong("text", f"prompt of {len(prompt)} tokens exceeds the largest bucket {max(c.prompt_buckets)}")
        if len(prompt.trailing) > c.max_trailing:
            raise PromptTooLong("text", f"{len(prompt.trailing)} streaming text tokens exceed {c.max_trailing}")
        cap = min(req.max_frames, prompt.frame_cap(c.frames_cap_base, c.frames_per_text_token), c.context - bucket)
        return Job(request=req, prompt=prompt, bucket=bucket, frames_cap=cap, schedule=schedule)

    def submit(self, job: Job, on_chunk) -> Stream:
        """Queue a job from `prepare`; its chunks go to `on_chunk`, called on the engine thread."""
        stream = Stream(job, on_chunk)
        stream.timings.submitted = self.clock()
        with self._wake:
            self.queue.append(stream)
            self._wake.notify()
        return stream

    def warmup(self) -> None:
        """Compile every program the loop calls (in parallel: XLA compiles off the GIL), then time each once
        on the idle engine: those costs seed the step-size choice and admission until live ones replace them."""
        c, cfg = self.config, self.model.cfg
        t0 = time.perf_counter()
        keys = [("insert", bucket, r) for bucket in c.prompt_buckets for r in c.prefill_sizes]
        keys += [("step", b, n) for b in c.ladder for n in c.step_sizes]
        keys += [("first", b, 1) for b in c.ladder]
        keys += [("codec", b, n) for b in c.ladder for n in c.codec_sizes]
        lowered = [self._lower(*key) for key in keys]  # tracing holds the GIL; compiling does not

        def compile_one(low):
            t = time.perf_counter()
            return low.compile(), time.perf_counter() - t

        report = []
        with concurrent.futures.ThreadPoolExecutor(min(len(keys), os.cpu_count() or 1)) as pool:
            for key, (exe, seconds) in zip(keys, pool.map(compile_one, lowered)):
                self._programs[key] = exe
                temp = getattr(exe.memory_analysis(), "temp_size_in_bytes", 0)
                report.append((seconds, "/".join(map(str, key)), temp / 2**30))
        log.info("slowest compiles (s, program, temp GiB): %s",
                 [(round(t, 1), k, round(m, 2)) for t, k, m in sorted(report, reverse=True)[:8]])
        if cfg.model_type == "base":  # ICL voices: one-slot priming at every chunk size, and loading
            primed = self._prime(np.zeros((sum(c.codec_sizes), cfg.num_code_groups), np.int32))
            self.codec_state = self._codec_load(self.codec_state, primed, np.int32(0))
        log.info("compiled %d engine programs in %.1f s", len(keys), time.perf_counter() - t0)
        self._calibrate()
        with self._lock:
            self._stats = self._snapshot()

    def prepare_voice(self, ref_codes: np.ndarray) -> None:
        """Compute and cache the codec state after an ICL voice's reference codes (thread-safe; the server
        calls it when a voice is registered, so the first request with it does not pay for it)."""
        self._primed_state(ref_codes)

    def set_clock(self, clock) -> None:
        """Time the loop's decisions and every stream timestamp by `clock` (tests simulate playback with it);
        iteration times measured by the old clock are dropped."""
        self.clock = clock
        self._iteration_s = 0.0

    def stats(self) -> EngineStats:
        """The latest published snapshot, with the queue as it is now: requests submitted since the last
        iteration count at once, so a burst is judged request by request (safe from any thread)."""
        with self._lock:
            queued = list(self.queue)
            return dataclasses.replace(
                self._stats, queued=len(queued), queued_frames=tuple(s.frames_cap for s in queued),
                oldest_wait_s=self.clock() - queued[0].timings.submitted if queued else 0.0)

    def run_once(self) -> bool:
        """One loop iteration (see the module docstring). False when there is nothing to do."""
        t0 = self.clock()
        parts = _PartTimer()
        self._reap_cancelled()
        joined, prefill_done = self._admit()
        parts.mark("admit")
        live = [i for i, s in enumerate(self.slots) if s is not None and not s.lm_done]
        if not live and self._audio is None and not any(s is not None and s.pending for s in self.slots):
            with self._lock:  # streams may have left (cancelled): admission must not see them for ever
                self._stats = self._snapshot()
            return False
        new = [i for i in live if not self.slots[i].codes]
        playing = [i for i in live if self.slots[i].codes]
        first = self._dispatch_first(new) if new else None
        extra = (self.prefill_costs.get(rung(self.config.prefill_sizes, len(joined)), 0.0) if joined else 0.0) + (
            self.first_costs.get(rung(self.config.ladder, len(new)), 0.0) if new else 0.0)
        out, n = None, 0
        if playing:
            n = self._frames_for(playing, len(new), extra, t0)
            b = rung(self.config.ladder, len(playing))
            self.state, out = self._program("step", b, n)(self.model.params, self.state, *self._rows(playing, b))
        parts.mark("dispatch")
        self._hand_out_audio()  # the programs above run on the device meanwhile
        parts.mark("hand_out")
        if prefill_done is not None:
            np.asarray(prefill_done)
            now = self.clock()
            for s in joined:
                s.timings.prefilled = now
        if first is not None:
            self._take_first(new, *first)
            parts.mark("first")
        if out is not None:
            frames, valid = np.asarray(out[0]), np.asarray(out[1])  # the one host sync per step call
            parts.mark("device_wait")
            now = self.clock()
            self._recent_frame_s.append((now - t0) / n)
            self._record(playing, frames, valid, now)
        parts.mark("bookkeeping")
        self._decode_audio(self.clock())
        parts.mark("codec_dispatch")
        self._profile.add(parts, live=len(live), new=len(new), frames=n)
        elapsed = self.clock() - t0
        self._iteration_s = elapsed if not self.iterations else 0.8 * self._iteration_s + 0.2 * elapsed
        if out is not None:  # what a step iteration really takes, host work included, newcomers' share not
            key = (rung(self.config.ladder, len(playing)), n)
            cost = max(elapsed - extra, 0.0)
            self.step_costs[key] = 0.8 * self.step_costs.get(key, cost) + 0.2 * cost
        self.iterations += 1
        with self._lock:
            self._stats = self._snapshot()
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

    def _snapshot(self) -> EngineStats:
        c, now = self.config, self.clock()
        in_slots = [s for s in self.slots if s is not None]
        queued = list(self.queue)
        headrooms = [h for s in in_slots if (h := s.buffered(now)) is not None and not s.lm_done]
        return EngineStats(
            slots=c.slots, live=len(in_slots), queued=len(queued),
            oldest_wait_s=now - queued[0].timings.submitted if queued else 0.0,
            frames_left=tuple(0 if s.lm_done else max(s.frames_cap - len(s.codes), 0) for s in in_slots),
            queued_frames=tuple(s.frames_cap for s in queued),
            ladder=c.ladder, prefill_sizes=c.prefill_sizes, step_sizes=c.step_sizes,
            headroom_margin_s=c.headroom_margin_s,
            step_costs=dict(self.step_costs), prefill_costs=dict(self.prefill_costs), first_costs=dict(self.first_costs),
            iteration_s=self._iteration_s, min_headroom_s=min(headrooms) if headrooms else None,
            iterations=self.iterations, recent_frame_s=tuple(self._recent_frame_s),
        )

    def _frames_for(self, playing: list[int], newcomers: int, extra_s: float, now: float) -> int:
        """Frames the playing streams step this iteration (newcomers' prefill and first frame, `extra_s`, run
        before it): one while any of them has no audio yet, else the most whose iteration fits inside every
        one's headroom, and within `max_step_s` (a newcomer waits for the step in progress) unless only a
        longer step keeps up with playback. Newcomers' one frame of audio must also last until their second
        frame, at the end of the next iteration (taken to cost as much, with a one-frame step)."""
        c = self.config
        streams = [self.slots[i] for i in playing]
        if any(s.timings.first_chunk is None for s in streams):
            return 1
        budget = min(s.buffered(now) for s in streams) - c.headroom_margin_s - extra_s
        if newcomers:
            nxt = self.step_costs.get((rung(c.ladder, len(playing) + newcomers), 1), 0.0)
            budget = min(budget, FRAME_SECONDS - c.headroom_margin_s - extra_s - nxt)
        b = rung(c.ladder, len(playing))
        cost = {n: self.step_costs.get((b, n), 0.0) for n in c.step_sizes}
        fits = [n for n in c.step_sizes if cost[n] <= budget]
        brief = [n for n in fits if cost[n] <= c.max_step_s and cost[n] + extra_s <= n * FRAME_SECONDS]
        return max(brief or fits, default=1)

    def _rows(self, slots: list[int], b: int) -> tuple[np.ndarray, np.ndarray]:
        """Slot indices of a call of `b` rows (padding aimed past the last slot) and which rows are live."""
        idx = np.full(b, self.config.slots, np.int32)
        idx[: len(slots)] = slots
        mask = np.zeros(b, bool)
        mask[: len(slots)] = True
        return idx, mask

    def _dispatch_first(self, new: list[int]):
        """Queue newcomers' first frame and its audio (one program) ahead of the playing streams' step."""
        b = rung(self.config.ladder, len(new))
        idx, mask = self._rows(new, b)
        fresh, decode = np.zeros(b, bool), np.zeros(b, bool)
        for j, slot in enumerate(new):
            s = self.slots[slot]
            fresh[j], decode[j] = s.fresh_codec, s.next_chunk_frames() == 1
        self.state, self.codec_state, out = self._program("first", b, 1)(
            self.model.params, self.model.codec_params, self.state, self.codec_state, idx, mask, fresh, decode)
        return out, decode

    def _take_first(self, new: list[int], out, decode: np.ndarray) -> None:
        """Record newcomers' first frames and hand out the audio of those decoded with them."""
        frames, valid, audio = (np.asarray(x) for x in out)
        now = self.clock()
        self._record(new, frames, valid, now)
        for j, slot in enumerate(new):
            s = self.slots[slot]
            if not (decode[j] and valid[0, j]) or s.finished:
                continue
            s.fresh_codec = False
            s.pending -= 1
            s.decoded += 1
            s.emit(Chunk(pcm=audio[j, :SAMPLES_PER_FRAME], first_frame=0, frames=1, sent_at=now))
            if s.lm_done and s.pending == 0:
                self._finish(s)

    def _record(self, slots: list[int], frames: np.ndarray, valid: np.ndarray, now: float) -> None:
        """New frames [n, B, 16] (valid [n, B]) of the streams in `slots`: a stream whose frames stop early, or
        that reached its cap, is done with its LM (and finishes here if nothing of it is left to decode)."""
        n = frames.shape[0]
        for j, slot in enumerate(slots):
            stream = self.slots[slot]
            good = valid[:, j]
            count = int(good.sum()) if good.all() else int(np.argmin(good))
            if count:
                stream.codes.extend(frames[:count, j])
                stream.pending += count
                if stream.timings.first_frame is None:
                    stream.timings.first_frame = now
            if count < n or len(stream.codes) >= stream.frames_cap:
                stream.lm_done = True
                if stream.pending == 0 and stream.inflight == 0:  # ended with nothing left to decode
                    self._finish(stream)

    def _admit(self) -> tuple[list[Stream], jax.Array | None]:
        """Give every waiting request that fits a free slot and prefill them together: one call per prompt
        bucket (up to `max_prefill` requests each). Returns the admitted streams and a small output of the
        last prefill to wait on (the state itself goes on to the step, donated)."""
        c = self.config
        joined = []
        with self._lock:
            free = [i for i, s in enumerate(self.slots) if s is None]
            while free and self.queue:
                stream = self.queue.popleft()
                if stream.cancelled:
                    self._finish(stream, error="cancelled")
                    continue
                stream.slot = free.pop(0)
                joined.append(stream)
        if not joined:
            return [], None
        now = self.clock()
        groups = collections.defaultdict(list)
        for stream in joined:
            self.slots[stream.slot] = stream
            stream.timings.admitted = now
            groups[stream.job.bucket].append(stream)
            voice = stream.job.request.voice
            if voice is not None and voice.ref_codes is not None:
                self.codec_state = self._codec_load(self.codec_state, self._primed_state(voice.ref_codes),
                                                    np.int32(stream.slot))
                stream.fresh_codec = False
        done = None
        for bucket, streams in groups.items():
            for at in range(0, len(streams), c.max_prefill):
                part = streams[at : at + c.max_prefill]
                r = rung(c.prefill_sizes, len(part))
                args = self._insert_args([(s.slot, s.job) for s in part], r)
                self.state, done = self._program("insert", bucket, r)(self.model.params, self.state, *args)
        return joined, done

    def _insert_args(self, items: list[tuple[int, Job]], size: int) -> tuple:
        """Stacked prefill inputs for `items` (slot, job), padded to `size` rows aimed past the last slot."""
        cfg, c = self.model.cfg, self.config
        bucket = items[0][1].bucket
        slots = np.full(size, c.slots, np.int32)
        # padding rows: a one-row blank prompt, so that they attend to something
        prompts = [job.prompt for _, job in items] + [_blank_prompt(cfg, 1)] * (size - len(items))
        text, codec, frames, speaker_row, speaker, valid = pad_prompts(prompts, bucket, cfg)
        trailing = np.full((size, c.max_trailing + 1), cfg.text.tts_pad, np.int32)
        knobs = np.ones((size, 5), np.float32)
        ints = np.zeros((size, 7), np.uint32)
        for i, (slot, job) in enumerate(items):
            req, p = job.request, job.prompt
            slots[i] = slot
            trailing[i, : len(p.trailing)] = p.trailing
            knobs[i] = [req.temperature, req.top_p, req.repetition_penalty, req.subtalker_temperature,
                        req.subtalker_top_p]
            ints[i] = np.array([req.seed & 0xFFFFFFFF, req.top_k, req.subtalker_top_k, job.frames_cap, len(p),
                                int(req.greedy), int(req.subtalker_greedy)], np.int64).astype(np.uint32)
        return (slots, text, codec, frames, speaker_row, speaker, valid, trailing, knobs, ints)

    def _dummy_inserts(self, bucket: int, size: int) -> tuple:
        """Prefill inputs of `size` padding rows (every write dropped): for compiling and timing."""
        job = Job(request=_WARMUP, prompt=_blank_prompt(self.model.cfg, bucket), bucket=bucket, frames_cap=1,
                  schedule=self.config.schedule)
        return self._insert_args([(self.config.slots, job)], size)

    def _lower(self, kind: str, a: int, b: int):
        """The program `kind` for one ladder rung, lowered on padding inputs (the shapes the loop passes)."""
        c, cfg = self.config, self.model.cfg
        if kind == "insert":
            return self._jit_insert.lower(self.model.params, self.state, *self._dummy_inserts(a, b))
        idx, zeros = np.full(a, c.slots, np.int32), np.zeros(a, bool)
        if kind == "first":
            return self._jit_first.lower(self.model.params, self.model.codec_params, self.state, self.codec_state,
                                         idx, zeros, zeros, zeros)
        if kind == "step":
            return self._jit_step.lower(self.model.params, self.state, idx, zeros, n=b)
        codes = np.zeros((a, b, cfg.num_code_groups), np.int32)
        return self._jit_codec.lower(self.model.codec_params, self.codec_state, idx, zeros, codes,
                                     np.zeros(a, np.int32))

    def _program(self, kind: str, a: int, b: int):
        """A compiled program; `warmup` compiles them all, and an engine used without it compiles on demand."""
        exe = self._programs.get((kind, a, b))
        if exe is None:
            exe = self._programs[kind, a, b] = self._lower(kind, a, b).compile()
        return exe

    def _calibrate(self) -> None:
        """Time every step and prefill program once, on padding rows (writes dropped, state unchanged), as
        the first cost estimates: a step's iteration cost is the step plus a codec call of as many rows."""
        c, cfg = self.config, self.model.cfg

        def timed(fn) -> float:
            jax.block_until_ready(fn())  # the first call of an executable pays its one-off set-up
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            return time.perf_counter() - t0

        def step(b, n):
            self.state, out = self._program("step", b, n)(self.model.params, self.state, np.full(b, c.slots, np.int32),
                                                np.zeros(b, bool))
            return out

        def codec(b, n):
            idx, zeros = np.full(b, c.slots, np.int32), np.zeros(b, bool)
            codes = np.zeros((b, n, cfg.num_code_groups), np.int32)
            audio, self.codec_state = self._program("codec", b, n)(self.model.codec_params, self.codec_state, idx, zeros,
                                                         codes, np.full(b, n, np.int32))
            return audio

        def first(b):
            idx, zeros = np.full(b, c.slots, np.int32), np.zeros(b, bool)
            self.state, self.codec_state, out = self._program("first", b, 1)(
                self.model.params, self.model.codec_params, self.state, self.codec_state, idx, zeros, zeros, zeros)
            return out

        def insert(r):
            bucket = max(c.prompt_buckets)
            self.state, done = self._program("insert", bucket, r)(self.model.params, self.state, *self._dummy_inserts(bucket, r))
            return done

        for b in c.ladder:
            for n in c.step_sizes:
                chunk = min(max(c.schedule), max(n, 1))
                chunk = min(s for s in c.codec_sizes if s >= chunk)
                self.step_costs[b, n] = timed(partial(step, b, n)) + timed(partial(codec, b, chunk))
        for b in c.ladder:
            self.first_costs[b] = timed(partial(first, b))
        for r in c.prefill_sizes:
            self.prefill_costs[r] = timed(partial(insert, r))
        log.info("step costs (rows, frames) -> ms: %s", {k: round(v * 1e3, 1) for k, v in self.step_costs.items()})

    def _primed_state(self, ref_codes: np.ndarray) -> codec_streaming.StreamState:
        """One slot's codec state after decoding ``ref_codes``, from a small LRU cache keyed by the codes."""
        codes = np.ascontiguousarray(ref_codes, np.int32)
        key = hashlib.sha1(codes.tobytes() + str(codes.shape).encode()).digest()
        with self._primed_lock:
            if key in self._primed:
                self._primed.move_to_end(key)
                return self._primed[key]
        state = self._prime(codes)
        with self._primed_lock:
            self._primed[key] = state
            while len(self._primed) > self.config.cached_voices:
                self._primed.popitem(last=False)
        return state

    def _prime(self, codes: np.ndarray) -> codec_streaming.StreamState:
        """Decode ``codes`` [T, 16] through a fresh one-slot state, in chunks of the compiled sizes."""
        state = codec_streaming.init_state(self.model.codec_cfg, 1)
        start, sizes = 0, sorted(self.config.codec_sizes, reverse=True)
        while start < len(codes):
            n = next(n for n in sizes if n <= len(codes) - start)
            state = self._codec_one(self.model.codec_params, state, codes[None, start : start + n])
            start += n
        return state

    def _decode_audio(self, now: float) -> None:
        """Hand every stream's due frames to ONE codec call, each row with its own frame count: a chunk is due
        when the schedule's next size is ready, when the stream's LM is done, or when its headroom would not
        last another iteration."""
        c = self.config
        horizon = self._iteration_s + c.headroom_margin_s
        due = []
        for s in self.slots:
            if s is None or s.pending == 0:
                continue
            want = s.next_chunk_frames()
            low = (h := s.buffered(now)) is not None and h < horizon
            if s.pending >= want or s.lm_done or low:
                due.append((s, min(s.pending, want if s.pending >= want else max(c.codec_sizes))))
        if not due:
            return
        b = rung(c.ladder, len(due))
        n = rung(c.codec_sizes, max(f for _, f in due))
        idx = np.full(b, c.slots, np.int32)
        fresh = np.zeros(b, bool)
        count = np.zeros(b, np.int32)
        codes = np.zeros((b, n, self.model.cfg.num_code_groups), np.int32)
        for j, (s, f) in enumerate(due):
            idx[j], fresh[j], count[j] = s.slot, s.fresh_codec, f
            codes[j, :f] = np.stack(s.codes[s.decoded : s.decoded + f])
            s.fresh_codec = False
            s.decoded += f
            s.pending -= f
            s.inflight = f
        audio, self.codec_state = self._program("codec", b, n)(self.model.codec_params, self.codec_state, idx, fresh, codes,
                                                     count)
        self._audio = (audio, due)

    def _hand_out_audio(self) -> None:
        """Chunks of the codec call in flight, to their streams; streams with nothing left finish."""
        if self._audio is None:
            return
        audio, due = self._audio
        self._audio = None
        audio = np.asarray(audio)
        now = self.clock()
        for j, (s, f) in enumerate(due):
            s.inflight = 0
            if s.finished:  # cancelled while its audio was in the codec
                continue
            s.emit(Chunk(pcm=audio[j, : f * SAMPLES_PER_FRAME], first_frame=s.decoded - f, frames=f, sent_at=now))
            if s.lm_done and s.pending == 0:
                self._finish(s)

    def _finish(self, stream: Stream, error: str | None = None) -> None:
        if stream.slot is not None and self.slots[stream.slot] is stream:
            self.slots[stream.slot] = None
        stream.lm_done = True
        stream.emit(Chunk(np.zeros(0, np.float32), stream.decoded, 0, self.clock(), final=True, error=error))

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
        for s in list(self.slots):
            if s is not None:
                self._finish(s, error=message)
        with self._lock:
            queued, self.queue = list(self.queue), collections.deque()
        for s in queued:
            self._finish(s, error=message)


class _PartTimer:
    """Wall time of each part of one iteration (always the real clock: tests may simulate the loop's)."""

    def __init__(self):
        self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def mark(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self.last
        self.last = now


class _IterationProfile:
    """Where busy iterations spend their time, logged as means every `every_s` (the evidence for tuning the
    loop: host work that does not overlap the device shows up outside `device_wait`)."""

    def __init__(self, every_s: float = 2.0):
        self.every_s = every_s
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.since, self.iterations, self.sums = now, 0, collections.Counter()

    def add(self, parts: _PartTimer, **counts: int) -> None:
        self.iterations += 1
        self.sums.update(parts.seconds)
        self.sums.update({k: float(v) for k, v in counts.items()})
        now = time.perf_counter()
        if now - self.since >= self.every_s:
            mean = {k: round(v / self.iterations * (1 if k in counts else 1e3), 2) for k, v in self.sums.items()}
            log.info("iterations: %d in %.1f s; mean per iteration (ms, or count): %s", self.iterations,
                     now - self.since, mean)
            self._reset(now)


_WARMUP = Request(
    "warmup", greedy=True, subtalker_greedy=True, temperature=1.0, top_p=1.0, repetition_penalty=1.0,
    subtalker_temperature=1.0, subtalker_top_p=1.0, top_k=0, subtalker_top_k=0, max_frames=1, seed=0,
)


def _blank_prompt(cfg, length: int):
    from qtts_jax.prompt import Prompt

    return Prompt(
        text=np.full(length, cfg.text.tts_pad, np.int32), codec=np.full(length, -1, np.int32),
        frames=np.full((length, cfg.num_code_groups), -1, np.int32), speaker_row=-1, speaker=None,
        trailing=np.zeros(0, np.int32),
    )


def init_state(model: Model, c: EngineConfig) -> EngineState:
    """Every slot empty and done; shapes fixed for the engine's life."""
    cfg, b = model.cfg, c.slots
    dtype = model.params["codec_embedding"].dtype
    t = cfg.talker
    shape = (t.num_layers, b, t.num_kv_heads, c.context, t.head_dim)
    cache = KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    vocab, h = cfg.talker.vocab_size, cfg.talker.hidden_size
    rows = RowState(
        key_valid=jnp.zeros((b, c.context), bool), logits=jnp.zeros((b, vocab), jnp.float32),
        hidden=jnp.zeros((b, h), dtype), seen=jnp.zeros((b, vocab), bool), done=jnp.ones(b, bool),
    )
    def params():  # distinct buffers for each field: donated leaves must not alias
        return sampling.SamplingParams(
            jnp.ones(b, bool), jnp.ones(b, jnp.float32), jnp.zeros(b, jnp.int32), jnp.ones(b, jnp.float32)
        )

    settings = RowSettings(
        key=jnp.zeros((b, 2), jnp.uint32), talker=params(), predictor=params(), penalty=jnp.ones(b, jnp.float32),
        max_frames=jnp.zeros(b, jnp.int32), position0=jnp.zeros(b, jnp.int32),
        trailing=jnp.zeros((b, c.max_trailing + 1, h), dtype),
    )
    return EngineState(rows, cache, settings, jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.int32))


def _insert(params, state: EngineState, slots, text, codec, frames, speaker_row, speaker, valid, trailing, knobs,
            ints, *, cfg):
    """Prefill R prompts of one bucket (the bucket is their length) into `slots` [R] together, resetting those
    slots' state; rows aimed past the last slot are padding and change nothing. Returns the state and a small
    array to wait on (the state is donated to the next step)."""
    bucket = text.shape[1]
    x = jax.vmap(partial(embed_prompt, params))(text, codec, frames, speaker_row, speaker)
    logits, hidden, cache = jax.vmap(lambda x, v: talker.prefill(params, cfg, x, v, bucket))(x, valid)
    cache = rows_layout(cache)
    big = KVCache(state.cache.k.at[:, slots, :, :bucket].set(cache.k, mode="drop"),
                  state.cache.v.at[:, slots, :, :bucket].set(cache.v, mode="drop"))
    context = big.k.shape[3]
    key_valid = jnp.zeros((text.shape[0], context), bool).at[:, :bucket].set(valid)
    rows = _put(state.rows, slots, RowState(key_valid, logits, hidden, jnp.zeros_like(logits, bool),
                                            jnp.zeros(text.shape[0], bool)))

    def row_settings(knobs, ints, trailing):
        temperature, top_p, penalty, sub_temperature, sub_top_p = (knobs[i] for i in range(5))
        seed, top_k, sub_top_k, max_frames, prompt_len, greedy, sub_greedy = (ints[i] for i in range(7))
        return RowSettings(
            key=jax.random.PRNGKey(seed),
            talker=sampling.SamplingParams(greedy != 0, temperature, top_k.astype(jnp.int32), top_p),
            predictor=sampling.SamplingParams(sub_greedy != 0, sub_temperature, sub_top_k.astype(jnp.int32),
                                              sub_top_p),
            penalty=penalty, max_frames=max_frames.astype(jnp.int32), position0=prompt_len.astype(jnp.int32),
            trailing=talker.embed_text(params, trailing),
        )

    settings = _put(state.settings, slots, jax.vmap(row_settings)(knobs, ints, trailing))
    k = state.k.at[slots].set(0, mode="drop")
    row0 = state.row0.at[slots].set(bucket, mode="drop")
    return EngineState(rows, big, settings, k, row0), logits[:, 0]


def _chooser(name: str):
    """The per-row token chooser the frame step uses."""
    if name == "auto":
        name = "pallas" if jax.default_backend() == "gpu" else "jnp"
    if name == "jnp":
        return sampling.choose
    if name == "pallas":
        from qtts_jax.kernels.sampling import choose_row

        return partial(choose_row, interpret=jax.default_backend() == "cpu")
    raise ValueError(f"unknown sampler {name!r} (jnp or pallas)")


def _step(params, state: EngineState, idx, live, *, cfg, choose, n: int):
    """`n` frames for the rows of slots `idx` [B] (padding rows aimed past the last slot, `live` false) in one
    scan. Only those rows are read and written. Returns frames [n, B, 16] and valid [n, B]."""
    rows = _take(state.rows, idx)
    rows = rows._replace(done=rows.done | ~live)
    settings, k0, row0 = _take(state.settings, idx), _take(state.k, idx), _take(state.row0, idx)

    def body(carry, _):
        rows, cache, k = carry
        new_rows, cache, frame = frame_step(params, cfg, rows, cache, idx, settings, k, row0 + k, choose)
        k = jnp.where(rows.done, k, k + 1)
        return (new_rows, cache, k), (frame, ~new_rows.done)

    (rows, cache, k), out = jax.lax.scan(body, (rows, state.cache, k0), None, length=n)
    return state._replace(rows=_put(state.rows, idx, rows), cache=cache, k=_put(state.k, idx, k)), out


def _first(params, codec_params, state: EngineState, codec_state, idx, live, fresh, decode, *, cfg, codec_cfg, choose):
    """Newcomers' first frame and its audio in one program, so their first chunk is ready before the longer
    step of the playing streams that is queued behind it. Row j decodes its frame where `decode[j]` (its
    schedule starts with a one-frame chunk) and the frame is valid; `fresh[j]` starts its codec state at zero."""
    state, (frames, valid) = _step(params, state, idx, live, cfg=cfg, choose=choose, n=1)
    count = (decode & valid[0]).astype(jnp.int32)
    audio, codec_state = _codec(codec_params, codec_state, idx, fresh, jnp.moveaxis(frames, 0, 1), count,
                                cfg=codec_cfg)
    return state, codec_state, (frames, valid, audio)


def _codec(params, state: codec_streaming.StreamState, idx, fresh, codes, count, *, cfg):
    """One streaming-codec call for the slots `idx` [B]: row j decodes its first `count[j]` frames of
    `codes[j]`, from a zero state where `fresh[j]` (a new stream). Only those slots' state is touched."""
    rows = _take(state, idx)
    rows = jax.tree.map(lambda a: jnp.where(fresh.reshape((-1,) + (1,) * (a.ndim - 1)), jnp.zeros_like(a), a), rows)
    audio, rows = codec_streaming.decode_step(params, cfg, rows, codes, count)
    return audio, _put(state, idx, rows)
