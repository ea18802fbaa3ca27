"""The model runner: the device state every slot shares, the compiled programs (one per ladder rung and size),
their compiling and calibration, and the primed codec states of ICL voices.

The loop (`core.Engine`) asks for a prefill, a first frame, a step or a codec call by slot indices and counts, and
gets typed outcomes back: device arrays it reads only when its decisions need them. It never holds a program or
the state, so the two meet at these calls alone (as vLLM's scheduler and model runner do). Every call donates
the state it runs on and the runner keeps the new one: nothing outside may keep a reference to it across calls.

Rows are slots gathered by index: an index past the last slot is a padding row (its writes are dropped), so a call
of any number of live rows takes the program of the next ladder rung up, padded."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import logging
import os
import pickle
import signal
import sys
import threading
import time
from collections import OrderedDict
from functools import partial
from typing import NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from qtts_jax.codec import streaming as codec_streaming
from qtts_jax.engine import compile_cache, compile_workers, programs
from qtts_jax.engine.config import EngineConfig
from qtts_jax.engine.job import Job
from qtts_jax.generate import pad_prompts
from qtts_jax.model import Model, model_shapes
from qtts_jax.request import Request

log = logging.getLogger(__name__)

APPEND_IDS = 8  # live text ids one append call writes (more take several calls)

# ("insert", bucket, requests) | ("step"|"codec", rung, frames) | ("append", 1, ids)
Key = tuple[str, int, int]


class StepOutcome(NamedTuple):
    """A step's codes: frames [n, rows, 16], and valid [n, rows] (false past a row's end or its limit)."""

    frames: jax.Array
    valid: jax.Array


class FirstOutcome(NamedTuple):
    """Newcomers' first frame: frames [1, rows, 16], valid [1, rows], and audio [rows, samples] of the rows that
    decoded it (the others' rows hold nothing to play)."""

    frames: jax.Array
    valid: jax.Array
    audio: jax.Array


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Seconds per call, timed on padding rows of an idle device, keyed as the loop's decisions look them up."""

    steps: dict  # (rung, frames) -> a step, plus a codec call of as many rows
    firsts: dict  # rung -> newcomers' first frame and its audio
    prefills: dict  # requests -> a prefill at the largest prompt bucket


@dataclasses.dataclass
class Scratch:
    """A state of the live one's shapes, for timing programs while the loop owns the live one (and its own
    buffers for the programs' per-call inputs and outcomes: see `Runner.inputs_held` and `Runner.run`)."""

    state: programs.EngineState
    codec_state: codec_streaming.StreamState
    held: dict = dataclasses.field(default_factory=dict)
    outcomes: dict = dataclasses.field(default_factory=dict)


@runtime_checkable
class DeviceRunner(Protocol):
    """What the loop (`core.Engine`) calls on its device half: `Runner` on an accelerator, or a simulated device
    (bench/sim_device.py) that answers from numpy at measured costs, so the same loop runs over either."""

    compiled_on_demand: int  # programs compiled when a call first needed them

    def prefill(self, bucket: int, items: list[tuple[int, Job]], size: int): ...

    def first(self, idx: np.ndarray, live: np.ndarray, fresh: np.ndarray, decode: np.ndarray) -> FirstOutcome: ...

    def step(self, idx: np.ndarray, limits: np.ndarray, frames: int) -> StepOutcome: ...

    def codec(self, idx: np.ndarray, fresh: np.ndarray, start: np.ndarray, count: np.ndarray, frames: int): ...

    def append_text(self, slot: int, start: int, ids: list[int], cap: int) -> None: ...

    def load_voice(self, slot: int, ref_codes: np.ndarray) -> None: ...

    def primed_state(self, ref_codes: np.ndarray): ...

    def compile(self, keys: list[Key]) -> None: ...

    def stored(self, keys: list[Key]) -> bool: ...

    def compile_elsewhere(self, keys: list[Key]): ...

    def warm_voices(self) -> None: ...

    def scratch(self): ...

    def calibrate(self, keys: list[Key], on=None, settled: bool = True) -> Calibration: ...


def _write_into(buffers, values):
    """`values` written over the whole of `buffers` (a tree of the same shapes): under donation, the same device
    addresses with the new values."""
    return jax.tree.map(lambda buf, value: jax.lax.dynamic_update_slice(buf, value, (0,) * buf.ndim), buffers, values)


# one for every runner: each shape of inputs compiles once per process
_refill = jax.jit(_write_into, donate_argnums=(0,))


@functools.partial(jax.jit, static_argnums=range(5))
def _fresh_states(cfg, dtype, config: EngineConfig, codec_cfg, codec_dtype):
    """One program makes every buffer of a fresh state, each its own (XLA never returns one buffer twice; the calls
    donate them). Made leaf by leaf, each shape was a program of its own to compile, or to load from the cache on a
    restart; made here, it is one program per engine shape, in a process."""
    return (programs.init_state(cfg, dtype, config),
            codec_streaming.init_state(codec_cfg, config.slots, codec_dtype))


def _zeros(shapes):
    """Zeroed device buffers of `shapes`' shapes, copied from the host: `jnp.zeros` compiles a program for each
    shape. Copied, not borrowed, so the device owns them and a call can donate them."""
    return jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), may_alias=False), shapes)


class HeldInputs(NamedTuple):
    """A program's per-call inputs on the device (`buffers`) and the host values last written into them."""

    buffers: tuple
    values: tuple


TIMING_CALLS = 3  # a program's timing is the least of this many calls

# where a program's outcome (what the loop reads) is in its output; the rest is the state it carries on
_OUTCOME_AT = {"step": 1, "codec": 0}


def _writing_into(program, kind: str):
    """`program` with its outcome written into the buffers `into` (donated, so the outcome takes their addresses):
    see `Runner.run`. The buffers must be the outcome's shapes (`programs.outcome_shapes`)."""

    def wrapped(*args, into, **kwargs):
        out = list(program(*args, **kwargs))
        at = _OUTCOME_AT[kind]
        if jax.tree.map(lambda a: (a.shape, a.dtype), into) != jax.tree.map(lambda a: (a.shape, a.dtype), out[at]):
            raise ValueError(f"{kind}: outcome buffers {into} do not fit the program's outcome {out[at]}")
        out[at] = _write_into(into, out[at])
        return tuple(out)

    return wrapped


def stages(c: EngineConfig) -> list[list[Key]]:
    """Every program of an engine of config `c`, in the order a background warm-up makes them usable: first the
    least that serves (a prefill of one request per prompt bucket, and the smallest rung's one-frame step and
    one-frame codec call, which newcomers' first frames run too), then that rung's other step and codec sizes and
    the other prefill sizes, then each
    larger rung whole."""
    least = ([("insert", bucket, c.prefill_sizes[0]) for bucket in c.prompt_buckets]
             + [("step", c.ladder[0], 1), ("codec", c.ladder[0], 1), ("append", 1, APPEND_IDS)])
    prefills = [("insert", bucket, r) for bucket in c.prompt_buckets for r in c.prefill_sizes]
    rest = [key for key in prefills + _rung_keys(c, c.ladder[0]) if key not in least]
    return [least, rest] + [_rung_keys(c, b) for b in c.ladder[1:]]


def _rung_keys(c: EngineConfig, b: int) -> list[Key]:
    """The programs of one ladder rung: its step and codec sizes."""
    return [("step", b, n) for n in c.step_sizes] + [("codec", b, n) for n in c.codec_sizes]


class Runner:
    """The device half of the engine: its state, its programs and the calls the loop makes."""

    def __init__(self, model: Model, config: EngineConfig, shapes_only: bool = False):
        """`shapes_only`: `model` may be `model.model_shapes`' and nothing goes on the device; the runner can only
        compile (a compile worker's, `compile_workers`)."""
        self.model, self.config = model, config
        cfg, codec_cfg = model.cfg, model.codec_cfg
        choose, attention = programs.chooser(config.sampler), programs.attender(config.attention)
        layers = programs.layer_kernels(config.layers)
        self._jit_insert = jax.jit(partial(programs.insert, graph=model.graph, cfg=cfg), donate_argnums=(1,))
        self._jit_step = jax.jit(_writing_into(partial(programs.step, graph=model.graph, cfg=cfg, choose=choose,
                                                       attention=attention, layers=layers,
                                                       seeded_ends=config.seeded_ends), "step"),
                                 donate_argnums=(1,), donate_argnames="into", static_argnames="n")
        self._jit_codec = jax.jit(_writing_into(partial(programs.codec, cfg=codec_cfg), "codec"),
                                  donate_argnums=(1,), donate_argnames="into", static_argnames="n")
        self._codec_one = jax.jit(
            lambda p, st, codes: codec_streaming.decode_step(p, codec_cfg, st, codes, jnp.full(1, codes.shape[1]))[1],
            donate_argnums=(1,),
        )
        self._jit_append = jax.jit(partial(programs.append_text, graph=model.graph), donate_argnums=(1,))
        self._codec_load = jax.jit(  # a one-slot state into slot `slot` of the batched one
            lambda st, one, slot: programs.set_slot(st, slot, jax.tree.map(lambda v: v[0], one)), donate_argnums=(0,))
        self.programs: dict[Key, jax.stages.Compiled] = {}
        self.compiled_on_demand = 0  # programs `program` had to compile (none after a warm-up): the engine's timings
        # leave out what waited on one
        self.held: dict[Key, HeldInputs] = {}  # each program's per-call inputs on the device (`inputs_held`)
        self.outcomes: dict[Key, tuple | jax.Array] = {}  # each program's last outcome, its next one's buffers (`run`)
        self.primed_voices: OrderedDict[bytes, codec_streaming.StreamState] = OrderedDict()
        self.primed_lock = threading.Lock()
        codec_dtype = jnp.dtype(config.codec_dtype)

        def cast(codec_params):
            return jax.tree.map(lambda a: a.astype(codec_dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                                codec_params)

        # what programs are lowered on: the states' shapes on the default device, never their buffers (the calls
        # donate those)
        on = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        self._specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on),
                                   jax.eval_shape(self.fresh_states))
        if shapes_only:
            self.codec_params = jax.eval_shape(cast, model.codec_params)
        else:
            self.codec_params = cast(model.codec_params)
            self.state, self.codec_state = self.fresh_states()

    # ---- the loop's calls -------------------------------------------------------------------

    def prefill(self, bucket: int, items: list[tuple[int, Job]], size: int) -> jax.Array:
        """Prefill `items` (slot, job) of one prompt bucket into their slots, in a call of `size` rows. Returns a
        small output to wait on: the state itself goes on to the next call, donated."""
        return self.run(("insert", bucket, size), (self.model.params, self.state, *self._insert_args(items, size)))

    def first(self, idx: np.ndarray, live: np.ndarray, fresh: np.ndarray, decode: np.ndarray) -> FirstOutcome:
        """The first frame of the slots `idx` (the rows where `live`), and its audio where `decode` (`fresh`:
        their codec state starts at zero): the rung's one-frame step and one-frame codec call, queued together, so
        a first frame costs no programs of its own to compile."""
        return self._first(self, idx, live, fresh, decode)

    def _first(self, target, idx, live, fresh, decode) -> FirstOutcome:
        # Outcome buffers of their own (role "first"): the playing streams' step and codec call of the same rung,
        # queued behind these, must not write where this outcome is still to be read. A newcomer's first frame is
        # its frame 0; a frame not made (the row ended, or padding) is -1 in the ring, so the codec skips it.
        b, zeros = len(idx), np.zeros(len(idx), np.int32)
        frames, valid = self.run(("step", b, 1), (self.model.params, target.state, idx, live.astype(np.int32)),
                                 target, role="first")
        audio = self.run(("codec", b, 1), (self.codec_params, target.codec_state, target.state.codes, idx, fresh,
                                           zeros, decode.astype(np.int32)), target, role="first")
        return FirstOutcome(frames, valid, audio)

    def step(self, idx: np.ndarray, limits: np.ndarray, frames: int) -> StepOutcome:
        """`frames` frames for the slots `idx`, row j making at most `limits[j]` (padding rows 0)."""
        return StepOutcome(*self.run(("step", len(idx), frames), (self.model.params, self.state, idx, limits)))

    def codec(self, idx: np.ndarray, fresh: np.ndarray, start: np.ndarray, count: np.ndarray, frames: int) -> jax.Array:
        """Audio [rows, samples] of frames start[j] .. start[j] + count[j] - 1 of slot idx[j], read where the step
        writes them (so this call may be queued behind the step that makes them), in a call of up to `frames`."""
        return self.run(("codec", len(idx), frames),
                        (self.codec_params, self.codec_state, self.state.codes, idx, fresh, start, count))

    def append_text(self, slot: int, start: int, ids: list[int], cap: int) -> None:
        """Live text: `ids` written at `start` of slot `slot`'s trailing text, its frame cap raised to `cap`."""
        for at in range(0, len(ids), APPEND_IDS):
            part = ids[at : at + APPEND_IDS]
            padded = np.zeros(APPEND_IDS, np.int32)
            padded[: len(part)] = part
            self.run(("append", 1, APPEND_IDS), (self.model.params, self.state, np.int32(slot), np.int32(start + at),
                                                 padded, np.int32(len(part)), np.int32(cap)))

    def load_voice(self, slot: int, ref_codes: np.ndarray) -> None:
        """Slot `slot`'s codec state set to the state after an ICL voice's reference codes."""
        self.codec_state = self._codec_load(self.codec_state, self.primed_state(ref_codes), np.int32(slot))

    # ---- programs ---------------------------------------------------------------------------

    def compile(self, keys: list[Key]) -> None:
        """Compile `keys` at once (tracing holds the GIL; compiling does not) into the program table. Those the
        compilation cache holds whole are loaded instead, untraced, and those compiled are kept there."""
        store = self.store
        stored = self._pool(store.load, keys) if store is not None else [None] * len(keys)
        todo = [key for key, exe in zip(keys, stored) if exe is None]
        self.programs.update({key: exe for key, exe in zip(keys, stored) if exe is not None})
        lowered = [self.lower(*key) for key in todo]

        def compile_one(low):
            t = time.perf_counter()
            exe, fresh = (low.compile(), False) if store is None else store.compile(low)
            return exe, fresh, time.perf_counter() - t

        report = []
        for key, (exe, fresh, seconds) in zip(todo, self._pool(compile_one, lowered)):
            self.programs[key] = exe
            if fresh:
                store.save(key, exe)
            temp = getattr(exe.memory_analysis(), "temp_size_in_bytes", 0)
            report.append((seconds, "/".join(map(str, key)), temp / 2**30))
        if report:
            log.info("slowest compiles (s, program, temp GiB): %s",
                     [(round(t, 1), k, round(m, 2)) for t, k, m in sorted(report, reverse=True)[:8]])

    def compile_elsewhere(self, keys: list[Key]) -> compile_workers.Workers | None:
        """Start worker processes compiling those of `keys` not stored yet into the compilation cache (see
        `EngineConfig.compile_workers`); `compile` then loads what they made. None where none were started: the
        cache is off, the model was not loaded from a source another process can read, or no workers are wanted."""
        store, wanted = self.store, self.config.compile_workers
        todo = [key for key in keys if store is not None and not store.has(key)]
        if wanted is None:
            wanted = compile_workers.count(len(todo)) if jax.default_backend() == "gpu" else 0
        if not todo or not wanted or self.model.source is None:
            return None
        return compile_workers.Workers(self.model.source, str(self.model.dtype), self.config,
                                       str(compile_cache.directory()), todo, min(wanted, len(todo)))

    def stored(self, keys: list[Key]) -> bool:
        """Whether the compilation cache holds every program of `keys` whole (loading them takes seconds)."""
        store = self.store
        return store is not None and all(store.has(key) for key in keys)

    @staticmethod
    def _pool(fn, items: list) -> list:
        """`fn` over `items` on as many threads as there are cores (XLA compiles and loads off the GIL)."""
        if not items:
            return []
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(items), os.cpu_count() or 1))) as pool:
            return list(pool.map(fn, items))

    @functools.cached_property
    def store(self) -> compile_cache.ProgramStore | None:
        """Where the compilation cache keeps this runner's programs whole: keyed by the model's configuration,
        graph and weight shapes, the engine's configuration and the state's shapes (None when the cache is off).
        Looked up when first used: the cache may be turned on after the runner is built."""
        m = self.model
        shapes = jax.tree.map(lambda a: (a.shape, str(a.dtype)), (m.params, self.codec_params))
        return compile_cache.program_store((m.cfg, m.codec_cfg, m.graph, self.config, shapes, self._specs))

    def warm_voices(self) -> None:
        """Base models: compile what an ICL voice's first use runs (priming at every chunk size, and loading)."""
        primed = self.prime(np.zeros((sum(self.config.codec_sizes), self.model.cfg.num_code_groups), np.int32))
        self.codec_state = self._codec_load(self.codec_state, primed, np.int32(0))

    def lower(self, kind: str, a: int, b: int):
        """The program `kind` for one ladder rung, lowered on padding inputs (the shapes the loop passes)."""
        jit = {"insert": self._jit_insert, "step": self._jit_step, "codec": self._jit_codec,
               "append": self._jit_append}[kind]
        static = {"n": b} if kind in ("step", "codec") else {}
        if kind in _OUTCOME_AT:
            static["into"] = self._outcome_shapes(kind, a, b)
        return jit.lower(*self.padding_call(kind, a, b, *self._specs), **static)

    def _outcome_shapes(self, kind: str, a: int, b: int):
        return programs.outcome_shapes(kind, a, b, self.model.cfg.num_code_groups)

    def program(self, kind: str, a: int, b: int):
        """A compiled program; `compile` makes them ahead, and one not made yet is made on demand (loaded from the
        compilation cache, or compiled)."""
        if (kind, a, b) not in self.programs:
            self.compile([(kind, a, b)])
            self.compiled_on_demand += 1
        return self.programs[kind, a, b]

    # ---- calibration ------------------------------------------------------------------------

    def fresh_states(self) -> tuple[programs.EngineState, codec_streaming.StreamState]:
        """Every slot empty: the engine's state and the codec's, on the device."""
        m, c = self.model, self.config
        return _fresh_states(m.cfg, jnp.dtype(m.dtype), c, m.codec_cfg, jnp.dtype(c.codec_dtype))

    def scratch(self) -> Scratch:
        return Scratch(*self.fresh_states())

    def idle_call(self, key: Key, on: Scratch | None = None):
        """One call of the program `key` on padding rows (every write dropped, so the state keeps its values), on
        the live state or `on`; returns its output."""
        target = on if on is not None else self
        return self.run(key, self.padding_call(*key, target.state, target.codec_state), target)

    def run(self, key: Key, args: tuple, target: Runner | Scratch | None = None, role: str = ""):
        """Program `key` on `args`, whose state it donates: `target` (this runner, or a `Scratch`) keeps the new
        state, and the rest of the program's output is returned (an append's is its state).

        A step's, first frame's or codec call's outcome is written into the buffers of the same program's last
        outcome (donated), so it has the same device addresses every call: XLA records a program's CUDA graph again
        whenever a buffer it writes has moved, as for the inputs (`inputs_held`). So an outcome is readable until
        the next call of the same program, which the loop makes only after it has read it; a call with another
        `role` keeps its inputs and outcome in buffers of its own."""
        target = self if target is None else target
        kind, exe, place = key[0], self.program(*key), (role, *key) if role else key
        args = self.inputs_held(place, args, target.held)
        if kind in _OUTCOME_AT:
            into = target.outcomes.pop(place, None)
            if into is None:
                into = _zeros(self._outcome_shapes(*key))
            out = exe(*args, into=into)
        else:
            out = exe(*args)
        if kind in ("insert", "step"):
            target.state, out = out
        elif kind == "codec":
            out, target.codec_state = out
        else:
            target.state = out
        if kind in _OUTCOME_AT:
            target.outcomes[place] = out
        return out

    def inputs_held(self, place: tuple, args: tuple, held: dict[tuple, HeldInputs]) -> tuple:
        """`args` with its host arrays (rows, limits, prompts: what changes from call to call) written into device
        buffers that program `place` (a role and a key) keeps from call to call (`held[place]`). XLA records each
        CUDA graph of a program against the addresses of the buffers it reads and records it again whenever one has moved, which inputs
        copied to the device afresh for every call always have (a one-stream step about 10% slower:
        docs/benchmarks.md). Writing them costs a copy and a program of its own, so a call whose values equal the
        last ones writes nothing."""
        where = [i for i, a in enumerate(args) if isinstance(a, (np.ndarray, np.generic))]
        if not where:
            return args
        new = tuple(args[i] for i in where)
        last = held.get(place)
        if last is not None and all(np.array_equal(a, b) for a, b in zip(new, last.values)):
            buffers = last.buffers  # the values are there already (a stable batch's steps): no copy, no program
        else:  # the first call's buffers are the device's own (a CPU's device_put may borrow numpy's memory instead)
            into = last.buffers if last is not None else _zeros(new)
            buffers = _refill(into, new)
            held[place] = HeldInputs(buffers, tuple(np.array(a) for a in new))
        args = list(args)
        for i, a in zip(where, buffers):
            args[i] = a
        return tuple(args)

    def padding_call(self, kind: str, a: int, b: int, state, codec_state) -> tuple:
        """The arguments of program `kind` for `a` padding rows (aimed past the last slot: every write dropped) and
        size `b`, on `state` and `codec_state`: arrays to call it on, or their shapes to lower it."""
        idx, zeros, ints = np.full(a, self.config.slots, np.int32), np.zeros(a, bool), np.zeros(a, np.int32)
        params, codec_params = self.model.params, self.codec_params
        if kind == "insert":
            return (params, state, *self._dummy_inserts(a, b))
        if kind == "step":
            return (params, state, idx, ints)
        if kind == "codec":
            return (codec_params, codec_state, state.codes, idx, zeros, ints, np.full(a, b, np.int32))
        scalar = np.int32(0)
        return (params, state, np.int32(self.config.slots), scalar, np.zeros(b, np.int32), scalar, scalar)

    def calibrate(self, keys: list[Key], on: Scratch | None = None, settled: bool = True) -> Calibration:
        """Run every compiled program of `keys` once (`idle_call`: its first call loads its kernels), then time some
        of them, each the least of `TIMING_CALLS` calls, unless the compilation cache kept their settled timings: a
        step's iteration cost is the step plus a codec call of as many rows at the chunk it would feed, a first
        frame is timed on every rung of `first_sizes` whose one-frame step and codec call are compiled, prefill is
        timed at the largest bucket. An executable's first call pays a one-off set-up (loading its kernels; the
        codec's convolution plans): run here, not in the loop's first live call of it, where a fresh server's
        first iterations under load would pay it.

        `settled`: nothing compiles beside these timings, so the cache keeps them for the next start. Timed beside
        compile workers, whose autotuning runs on the same device, a step reads several times its cost; such
        timings serve only until the warm-up's settled ones replace them."""
        c, target, store = self.config, on if on is not None else self, self.store
        kept = store.load_timings() if store is not None else {}
        for key in keys:
            jax.block_until_ready(self.idle_call(key, on))

        def timed(key, call) -> float:  # kept from a settled start on this kind of device, or timed now
            if key not in kept:
                seconds = []
                for _ in range(TIMING_CALLS):  # the least: a live loop's iterations interleave with these calls
                    t0 = time.perf_counter()
                    jax.block_until_ready((call(), target.state, target.codec_state))
                    seconds.append(time.perf_counter() - t0)
                kept[key] = min(seconds)
            return kept[key]

        steps, firsts, prefills = {}, {}, {}
        for kind, a, n in keys:
            if kind == "insert" and a == max(c.prompt_buckets):
                prefills[n] = timed((kind, a, n), partial(self.idle_call, (kind, a, n), on))
            elif kind == "step":
                codec_sizes = [s for s in c.codec_sizes if ("codec", a, s) in self.programs]
                chunk = min(s for s in codec_sizes if s >= min(max(c.schedule), n, max(codec_sizes)))
                steps[a, n] = (timed((kind, a, n), partial(self.idle_call, (kind, a, n), on))
                               + timed(("codec", a, chunk), partial(self.idle_call, ("codec", a, chunk), on)))
        for a in c.first_sizes:
            if ("step", a, 1) in keys and ("codec", a, 1) in self.programs:
                padding, none = np.full(a, c.slots, np.int32), np.zeros(a, bool)
                first = partial(self._first, target, padding, none, none, none)
                jax.block_until_ready(first())  # the first call makes the role's own buffers
                firsts[a] = timed(("first", a, 1), first)
        if store is not None and settled:
            store.save_timings(kept)
        return Calibration(steps, firsts, prefills)

    # ---- inputs -----------------------------------------------------------------------------

    def _insert_args(self, items: list[tuple[int, Job]], size: int) -> tuple:
        """Stacked prefill inputs for `items` (slot, job), padded to `size` rows aimed past the last slot."""
        cfg, c = self.model.cfg, self.config
        bucket = items[0][1].bucket
        slots = np.full(size, c.slots, np.int32)
        # padding rows: a one-row blank prompt, so that they attend to something
        prompts = [job.prompt for _, job in items] + [programs.blank_prompt(cfg, 1)] * (size - len(items))
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
        job = Job(request=_WARMUP, prompt=programs.blank_prompt(self.model.cfg, bucket), bucket=bucket, frames_cap=1,
                  schedule=self.config.schedule)
        return self._insert_args([(self.config.slots, job)], size)

    # ---- ICL voices -------------------------------------------------------------------------

    def primed_state(self, ref_codes: np.ndarray) -> codec_streaming.StreamState:
        """One slot's codec state after decoding ``ref_codes``, from a small LRU cache keyed by the codes
        (thread-safe: the server primes a voice when it is registered)."""
        codes = np.ascontiguousarray(ref_codes, np.int32)
        key = hashlib.sha1(codes.tobytes() + str(codes.shape).encode()).digest()
        with self.primed_lock:
            if key in self.primed_voices:
                self.primed_voices.move_to_end(key)
                return self.primed_voices[key]
        state = self.prime(codes)
        with self.primed_lock:
            self.primed_voices[key] = state
            while len(self.primed_voices) > self.config.cached_voices:
                self.primed_voices.popitem(last=False)
        return state

    def prime(self, codes: np.ndarray) -> codec_streaming.StreamState:
        """Decode ``codes`` [T, 16] through a fresh one-slot state, in chunks of the compiled sizes."""
        state = codec_streaming.init_state(self.model.codec_cfg, 1, self.codec_state.keys.dtype)
        start, sizes = 0, sorted(self.config.codec_sizes, reverse=True)
        while start < len(codes):
            n = next(n for n in sizes if n <= len(codes) - start)
            state = self._codec_one(self.codec_params, state, codes[None, start : start + n])
            start += n
        return state


def compile_share() -> None:
    """A compile worker's process (`compile_workers.Workers`): its `Share` read from stdin, each of its programs
    compiled into the compilation cache's store by a runner of the model's shapes alone, then exit."""
    if sys.platform.startswith("linux"):  # die with the engine that started this, even if it is killed
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    os.nice(10)  # the engine's own first stage and its model loading go first where the cores are short
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[compile]: %(message)s")
    share: compile_workers.Share = pickle.loads(sys.stdin.buffer.read())
    compile_cache.enable(share.cache)
    runner = Runner(model_shapes(share.model, jnp.dtype(share.dtype)), share.config, shapes_only=True)
    for key in share.keys:
        runner.compile([key])


_WARMUP = Request(
    "warmup", greedy=True, subtalker_greedy=True, temperature=1.0, top_p=1.0, repetition_penalty=1.0,
    subtalker_temperature=1.0, subtalker_top_p=1.0, top_k=0, subtalker_top_k=0, max_frames=1, seed=0,
)
