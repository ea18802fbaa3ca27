"""Continuous-batching streaming engine: every live stream advances in one compiled step.

A fixed number of slots (compiled once). All per-slot state is one donated pytree: the talker KV
cache, logits/hidden state, seen-code mask, done flag, sampling settings and trailing text vectors,
frame counter and cache offset. `insert` prefills one request (prompt padded to a power-of-two
bucket) into a free slot; `step` runs `n` frames for every slot in one `lax.scan` (the frame step is
`generate.frame_step`, written for one stream and `vmap`-ed over slots, so each slot keeps its own
position and cache and a seeded request gives the same codes alone or beside others). Frames are read
back once per step call; each stream's frames go through the batched streaming codec decoder in
chunks of 1, 2, 4, 8 … frames, so its first audio leaves after one frame.

An ICL voice's audio continues its reference recording, as the reference decodes reference + new codes
and cuts the reference's share: the slot's codec state starts from the state after the reference codes
(computed once per voice and cached), so only the new frames are decoded and sent.

Everything the loop calls is compiled by `warmup`; nothing compiles in steady state.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import threading
import time
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qtts_jax import sampling, talker
from qtts_jax.codec import streaming as codec_streaming
from qtts_jax.generate import RowSettings, RowState, frame_step
from qtts_jax.model import Model
from qtts_jax.prompt import build_prompt, embed_prompt
from qtts_jax.request import Request, RequestError
from qtts_jax.stream import DEFAULT_SCHEDULE, Chunk, Stream
from qtts_jax.transformer import KVCache

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    slots: int = 8
    context: int = 1024  # KV-cache rows per slot: prompt bucket + frames
    prompt_buckets: tuple[int, ...] = (32, 64, 128, 256)
    max_trailing: int = 256  # text tokens fed one per frame (streaming-text layout)
    frames_per_step: int = 4  # frames per step call once every live stream has its first frame
    schedule: tuple[int, ...] = DEFAULT_SCHEDULE  # frames per audio chunk: 1, 2, 4, 8, 8, ...
    frames_per_text_token: int = 8  # runaway guard: cap = base + this x text tokens
    frames_cap_base: int = 24
    # "pallas" (the kernel; 2-6.7x faster than the reference on the H200, bench/results/sampling-h200.json),
    # "jnp" (the reference), or "auto": the kernel on GPU, the reference elsewhere (no Triton on CPU).
    sampler: str = "auto"
    cached_voices: int = 64  # ICL voices whose primed codec state stays on the device (LRU)

    @property
    def codec_sizes(self) -> tuple[int, ...]:
        """Chunk sizes the codec is compiled for: the schedule's, plus powers of two to flush tails."""
        top = max(self.schedule)
        return tuple(sorted(set(self.schedule) | {1 << i for i in range(top.bit_length()) if 1 << i <= top}))


class EngineState(NamedTuple):
    rows: RowState  # each leaf [slots, ...]
    settings: RowSettings  # each leaf [slots, ...]
    k: jax.Array  # [slots] frames produced so far
    row0: jax.Array  # [slots] cache row of frame 0 (= the slot's prompt bucket)


class PromptTooLong(RequestError):
    """The request cannot fit this engine's cache (a clean refusal, not a crash)."""


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
        self._insert = jax.jit(partial(_insert, cfg=cfg), donate_argnums=(1,))
        self._step = jax.jit(partial(_step, cfg=cfg, choose=_chooser(c.sampler)), donate_argnums=(1,), static_argnames="n")
        codec_cfg = model.codec_cfg
        self._codec = jax.jit(
            lambda p, st, codes, active: codec_streaming.decode_step(p, codec_cfg, st, codes, active),
            donate_argnums=(1,),
        )
        self._codec_reset = jax.jit(codec_streaming.reset_slots, donate_argnums=(0,))
        self._codec_one = jax.jit(
            lambda p, st, codes: codec_streaming.decode_step(p, codec_cfg, st, codes, jnp.ones(1, bool))[1],
            donate_argnums=(1,),
        )
        self._codec_load = jax.jit(  # a one-slot state into slot `slot` of the batched one
            lambda st, one, slot: _set_slot(st, slot, jax.tree.map(lambda v: v[0], one)), donate_argnums=(0,))
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
        self.steps = 0
        self.step_seconds: collections.deque[float] = collections.deque(maxlen=512)

    # ---- public API -------------------------------------------------------------------------

    def submit(self, request: Request, on_chunk, schedule=None) -> Stream:
        """Validate and queue a request; raises `RequestError` (incl. `PromptTooLong`) at once."""
        stream = Stream(request, on_chunk, schedule or self.config.schedule)
        stream.prepared = self._prepare(request)  # raises before anything is queued
        with self._wake:
            self.queue.append(stream)
            self._wake.notify()
        return stream

    def warmup(self) -> None:
        """Compile every prompt bucket, both step sizes and every codec chunk size, then reset."""
        for bucket in self.config.prompt_buckets:
            self.state = self._insert(self.model.params, self.state, *self._dummy_insert(bucket))
        for n in sorted({1, self.config.frames_per_step}):
            self.state, out = self._step(self.model.params, self.state, np.zeros(self.config.slots, bool), n=n)
        mask = np.zeros(self.config.slots, bool)
        self.codec_state = self._codec_reset(self.codec_state, mask)
        for n in self.config.codec_sizes:
            codes = np.zeros((self.config.slots, n, self.model.cfg.num_code_groups), np.int32)
            audio, self.codec_state = self._codec(self.model.codec_params, self.codec_state, codes, mask)
        if self.model.cfg.model_type == "base":  # ICL voices: one-slot priming at every chunk size, and loading
            primed = self._prime(np.zeros((sum(self.config.codec_sizes), self.model.cfg.num_code_groups), np.int32))
            self.codec_state = self._codec_load(self.codec_state, primed, np.int32(0))
            self.codec_state = self._codec_reset(self.codec_state, np.ones(self.config.slots, bool))
        jax.block_until_ready((out, audio, self.codec_state))

    def check(self, request: Request) -> None:
        """Raise the `RequestError` (incl. `PromptTooLong`) that `submit` would, without queueing anything."""
        self._prepare(request)

    def prepare_voice(self, ref_codes: np.ndarray) -> None:
        """Compute and cache the codec state after an ICL voice's reference codes (thread-safe; the server
        calls it when a voice is registered, so the first request with it does not pay for it)."""
        self._primed_state(ref_codes)

    def run_once(self) -> bool:
        """One loop iteration: cancels, admissions, one step, codec chunks. False when idle."""
        self._reap_cancelled()
        self._admit()
        live = [s is not None and not s.lm_done for s in self.slots]
        if not any(live):
            return False
        n = self.config.frames_per_step
        if any(s is not None and s.timings.first_frame is None for s in self.slots):
            n = 1
        t0 = time.perf_counter()
        self.state, (frames, valid) = self._step(self.model.params, self.state, np.asarray(live), n=n)
        frames, valid = np.asarray(frames), np.asarray(valid)  # the one host sync per step call
        now = time.perf_counter()
        self.step_seconds.append((now - t0) / n)
        self.steps += 1
        for slot, stream in enumerate(self.slots):
            if stream is None or not live[slot]:
                continue
            good = valid[:, slot]
            count = int(good.sum()) if good.all() else int(np.argmin(good))
            if count:
                stream.codes.extend(frames[:count, slot])
                stream.pending += count
                if stream.timings.first_frame is None:
                    stream.timings.first_frame = now
            if count < n or len(stream.codes) >= stream.frames_cap:
                stream.lm_done = True
        self._decode_audio()
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

    def _prepare(self, request: Request) -> dict:
        """Resolve, lay out and bucket the prompt now, so a request that cannot fit is refused at once."""
        model, c = self.model, self.config
        req = request.resolved(model.cfg, model.defaults)
        prompt = build_prompt(model.cfg, model.tokenizer, req)
        bucket = next((b for b in c.prompt_buckets if b >= len(prompt)), None)
        if bucket is None:
            raise PromptTooLong("text", f"prompt of {len(prompt)} tokens exceeds the largest bucket {max(c.prompt_buckets)}")
        if len(prompt.trailing) > c.max_trailing:
            raise PromptTooLong("text", f"{len(prompt.trailing)} streaming text tokens exceed {c.max_trailing}")
        cap = min(req.max_frames, prompt.frame_cap(c.frames_cap_base, c.frames_per_text_token), c.context - bucket)
        return {"request": req, "prompt": prompt, "bucket": bucket, "cap": cap}

    def _admit(self) -> None:
        while True:
            with self._lock:
                free = next((i for i, s in enumerate(self.slots) if s is None), None)
                if free is None or not self.queue:
                    return
                stream = self.queue.popleft()
            if stream.cancelled:
                self._finish(stream, error="cancelled")
                continue
            stream.slot = free
            stream.frames_cap = stream.prepared["cap"]
            self.slots[free] = stream
            stream.timings.admitted = time.perf_counter()
            self.state = self._insert(self.model.params, self.state, *self._insert_args(free, stream.prepared))
            voice = stream.prepared["request"].voice
            if voice is not None and voice.ref_codes is not None:
                self.codec_state = self._codec_load(self.codec_state, self._primed_state(voice.ref_codes),
                                                    np.int32(free))
            else:
                mask = np.zeros(self.config.slots, bool)
                mask[free] = True
                self.codec_state = self._codec_reset(self.codec_state, mask)
            jax.block_until_ready(self.state.k)
            stream.timings.prefilled = time.perf_counter()

    def _insert_args(self, slot: int, prepared: dict) -> tuple:
        cfg, c = self.model.cfg, self.config
        req, p, bucket = prepared["request"], prepared["prompt"], prepared["bucket"]
        pad = bucket - len(p)
        text = np.concatenate([np.full(pad, -1, np.int32), p.text])
        codec = np.concatenate([np.full(pad, -1, np.int32), p.codec])
        frames = np.concatenate([np.full((pad, cfg.num_code_groups), -1, np.int32), p.frames])
        valid = np.arange(bucket) >= pad
        speaker = np.zeros(cfg.talker.hidden_size, np.float32) if p.speaker is None else p.speaker
        speaker_row = np.int32(p.speaker_row + pad if p.speaker is not None else -1)
        trailing = np.full(c.max_trailing + 1, cfg.text.tts_pad, np.int32)
        trailing[: len(p.trailing)] = p.trailing
        knobs = np.array(
            [req.temperature, req.top_p, req.repetition_penalty, req.subtalker_temperature, req.subtalker_top_p],
            np.float32,
        )
        ints = np.array(
            [req.seed & 0xFFFFFFFF, req.top_k, req.subtalker_top_k, prepared["cap"], len(p), int(req.greedy),
             int(req.subtalker_greedy)],
            np.int64,
        ).astype(np.uint32)
        return (np.int32(slot), text, codec, frames, speaker_row, speaker, valid, trailing, knobs, ints)

    def _dummy_insert(self, bucket: int) -> tuple:
        cfg = self.model.cfg
        prepared = {
            "request": Request(
                "warmup", greedy=True, subtalker_greedy=True, temperature=1.0, top_p=1.0, repetition_penalty=1.0,
                subtalker_temperature=1.0, subtalker_top_p=1.0, top_k=0, subtalker_top_k=0, max_frames=1,
            ),
            "prompt": _blank_prompt(cfg, bucket),
            "bucket": bucket,
            "cap": 1,
        }
        return self._insert_args(0, prepared)

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

    def _decode_audio(self) -> None:
        """Turn pending frames into PCM chunks, batching every slot that needs the same chunk size."""
        while True:
            groups: dict[int, list[int]] = collections.defaultdict(list)
            for slot, s in enumerate(self.slots):
                if s is None or s.pending == 0:
                    continue
                want = s.next_chunk_frames()
                if s.pending >= want:
                    groups[want].append(slot)
                elif s.lm_done:
                    groups[max(n for n in self.config.codec_sizes if n <= s.pending)].append(slot)
            if not groups:
                break
            for n, slots in sorted(groups.items()):
                self._codec_call(n, slots)
        for slot, s in enumerate(self.slots):
            if s is not None and s.lm_done and s.pending == 0:
                self._finish(s)

    def _codec_call(self, n: int, slots: list[int]) -> None:
        cfg = self.model.cfg
        codes = np.zeros((self.config.slots, n, cfg.num_code_groups), np.int32)
        mask = np.zeros(self.config.slots, bool)
        for slot in slots:
            s = self.slots[slot]
            codes[slot] = np.stack(s.codes[s.decoded : s.decoded + n])
            mask[slot] = True
        audio, self.codec_state = self._codec(self.model.codec_params, self.codec_state, codes, mask)
        audio = np.asarray(audio)
        now = time.perf_counter()
        for slot in slots:
            s = self.slots[slot]
            s.emit(Chunk(pcm=audio[slot], first_frame=s.decoded, frames=n, sent_at=now))
            s.decoded += n
            s.pending -= n

    def _finish(self, stream: Stream, error: str | None = None) -> None:
        if stream.slot is not None and self.slots[stream.slot] is stream:
            self.slots[stream.slot] = None
        stream.lm_done = True
        stream.emit(Chunk(np.zeros(0, np.float32), stream.decoded, 0, time.perf_counter(), final=True, error=error))

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
        for s in list(self.slots):
            if s is not None:
                self._finish(s, error=message)
        with self._lock:
            queued, self.queue = list(self.queue), collections.deque()
        for s in queued:
            self._finish(s, error=message)


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
    one = KVCache.zeros(cfg.talker, c.context, dtype)
    cache = KVCache(jnp.zeros((b, *one.k.shape), dtype), jnp.zeros((b, *one.v.shape), dtype))
    vocab, h = cfg.talker.vocab_size, cfg.talker.hidden_size
    rows = RowState(
        cache=cache, key_valid=jnp.zeros((b, c.context), bool), logits=jnp.zeros((b, vocab), jnp.float32),
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
    return EngineState(rows, settings, jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.int32))


def _insert(params, state: EngineState, slot, text, codec, frames, speaker_row, speaker, valid, trailing, knobs, ints,
            *, cfg):
    """Prefill one prompt (its bucket length is its shape) into `slot`, resetting that slot's state."""
    bucket = text.shape[0]
    x = embed_prompt(params, text, codec, frames, speaker_row, speaker)
    logits, hidden, cache = talker.prefill(params, cfg, x, valid, bucket)
    at = (slot, 0, 0, 0, 0)
    big = state.rows.cache
    big = KVCache(jax.lax.dynamic_update_slice(big.k, cache.k[None], at),
                  jax.lax.dynamic_update_slice(big.v, cache.v[None], at))
    context = big.k.shape[2]
    key_valid = jnp.zeros(context, bool).at[:bucket].set(valid)
    rows = state.rows._replace(cache=big)
    rows = rows._replace(**_set_slot(
        dict(key_valid=rows.key_valid, logits=rows.logits, hidden=rows.hidden, seen=rows.seen, done=rows.done),
        slot,
        dict(key_valid=key_valid, logits=logits, hidden=hidden, seen=jnp.zeros_like(logits, bool),
             done=jnp.bool_(False)),
    ))
    temperature, top_p, penalty, sub_temperature, sub_top_p = (knobs[i] for i in range(5))
    seed, top_k, sub_top_k, max_frames, prompt_len, greedy, sub_greedy = (ints[i] for i in range(7))
    one = RowSettings(
        key=jax.random.PRNGKey(seed),
        talker=sampling.SamplingParams(greedy != 0, temperature, top_k.astype(jnp.int32), top_p),
        predictor=sampling.SamplingParams(sub_greedy != 0, sub_temperature, sub_top_k.astype(jnp.int32), sub_top_p),
        penalty=penalty, max_frames=max_frames.astype(jnp.int32), position0=prompt_len.astype(jnp.int32),
        trailing=talker.embed_text(params, trailing),
    )
    settings = _set_slot(state.settings, slot, one)
    k = state.k.at[slot].set(0)
    row0 = state.row0.at[slot].set(bucket)
    return EngineState(rows, settings, k, row0)


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


def _step(params, state: EngineState, live, *, cfg, choose, n: int):
    """`n` frames for every slot in one scan. Returns frames [n, slots, 16] and valid [n, slots]."""
    step = jax.vmap(partial(frame_step, params, cfg, choose=choose))

    def body(st: EngineState, _):
        rows = st.rows._replace(done=st.rows.done | ~live)
        new_rows, frame = step(rows, st.settings, st.k, st.row0 + st.k)
        k = jnp.where(rows.done, st.k, st.k + 1)
        return EngineState(new_rows, st.settings, k, st.row0), (frame, ~new_rows.done)

    return jax.lax.scan(body, state, None, length=n)
