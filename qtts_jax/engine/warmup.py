"""Warm-up: every program the loop calls compiled and timed before it serves, or in stages while it serves.

It changes only what the loop may use (the sizes compiled and timed, and the cost tables they seed), under the
engine's lock, as the loop reads them there (`engine` below: a `core.Engine`; this module imports nothing of the
loop's)."""

from __future__ import annotations

import logging
import threading
import time

import jax.numpy as jnp

from qtts_jax.engine.config import EngineConfig
from qtts_jax.engine.plan import Sizes
from qtts_jax.engine.runner import Calibration, Key, Runner, stages
from qtts_jax.model import model_shapes
from qtts_jax.engine.stats import snapshot

log = logging.getLogger(__name__)


def run(engine, background: bool = False) -> None:
    """Compile every program the loop calls (in parallel: XLA compiles off the GIL), then time each once on the
    idle engine: those costs seed the step-size choice and admission until live ones replace them.

    With `background`, return once the least that serves is compiled and timed (`runner.stages`): the engine then
    serves as many streams as the smallest rung holds, one frame a step, while a thread compiles the rest stage by
    stage, each stage's sizes (and the slots in use) joining the loop's as soon as they are compiled and timed on
    a scratch state; a cold server is ready after a handful of its programs. When the compilation cache holds
    every program whole, all of them load at once instead: the engine serves at full size within seconds."""
    t0 = time.perf_counter()
    every = stages(engine.config)
    background = background and not engine.runner.stored([key for stage in every for key in stage])
    now, later = (every[:1], every[1:]) if background else (every, [])
    workers = engine.compiling_ahead or engine.runner.compile_elsewhere([key for stage in later for key in stage])
    keys = [key for stage in now for key in stage]
    if workers is not None:
        workers.wait(keys, engine.runner.stored)
    engine.runner.compile(keys)
    if engine.model.cfg.model_type == "base":
        engine.runner.warm_voices()
    log.info("compiled %d engine programs in %.1f s", len(keys), time.perf_counter() - t0)
    # timed beside the later stages' compiles, the first stage's costs serve until the last stage's settled ones
    use(engine, keys, engine.runner.calibrate(keys, settled=not later), left=sum(map(len, later)))
    log.info("step costs (rows, frames) -> ms: %s", {k: round(v * 1e3, 1) for k, v in engine.step_costs.items()})
    if later:
        threading.Thread(target=rest, args=(engine, keys, later, t0, workers), name="qtts-warmup",
                         daemon=True).start()
    elif workers is not None:
        workers.stop()


def wait(engine, timeout: float) -> bool:
    """Wait until a background warm-up has nothing left to compile (or failed); False if `timeout` passed first."""
    with engine._wake:
        return engine._wake.wait_for(lambda: engine._compiling == 0, timeout)


def compile_ahead(source: str, dtype: str, config: EngineConfig):
    """Start the compile workers on every program of an engine of `config`, the first stage's first, from the
    model's shapes alone, before the model itself is loaded (`engine.compiling_ahead`): their compiles then overlap
    the loading, and the engine only loads what they store. Compiled in the engine beside the workers, the first
    stage took several times as long as alone. None where the runner would start none (`Runner.compile_elsewhere`)."""
    runner = Runner(model_shapes(source, jnp.dtype(dtype)), config, shapes_only=True)
    return runner.compile_elsewhere([key for stage in stages(config) for key in stage])


def rest(engine, first: list[Key], later: list[list[Key]], t0: float, workers=None) -> None:
    """The background half of `run`: stage after stage compiled (by `workers`, when the runner started them, and
    loaded from the compilation cache as they land), timed on a scratch state of its own (the loop owns the live
    one) and added to what the loop may use. Once the last stage is made nothing compiles any more, and every
    program is timed again: the settled timings the loop starts from, and the next start reads."""
    try:
        scratch = engine.runner.scratch()
        for i, keys in enumerate(later):
            t1 = time.perf_counter()
            if workers is not None:
                workers.wait(keys, engine.runner.stored)
            engine.runner.compile(keys)
            t2 = time.perf_counter()
            last = i == len(later) - 1
            every = [key for stage in (first, *later) for key in stage] if last else keys
            timed = engine.runner.calibrate(every, on=scratch, settled=last)
            log.info("warm-up stage %d of %d: %d programs made in %.1f s, timed in %.1f s", i + 2, len(later) + 1,
                     len(keys), t2 - t1, time.perf_counter() - t2)
            if last:
                del scratch
                if engine.on_compiled is not None:
                    engine.on_compiled()
            use(engine, keys, timed, left=sum(map(len, later[i + 1:])), settle=last)
        log.info("every rung compiled and timed after %.1f s (slots=%d)", time.perf_counter() - t0,
                 engine.config.slots)
    except Exception:  # what was compiled so far keeps serving
        log.exception("background warm-up failed; serving with rungs %s", engine.sizes.ladder)
        with engine._wake:
            engine._compiling = 0
            engine._wake.notify_all()
    finally:
        if workers is not None:
            workers.stop()


def use(engine, keys: list[Key], timed: Calibration, left: int, settle: bool = False) -> None:
    """Let the loop use the compiled and timed programs `keys` (`left`: programs still to come), their idle costs
    seeding what it has not measured live. `settle` (the background warm-up's last stage, `timed` every program
    with nothing compiling): what the loop measured so far shared the machine with XLA, so it goes back to these
    timings, in the same update that says nothing is left to compile."""
    e, c = engine, engine.config
    ready = e._ready | set(keys)
    with e._lock:
        e.idle_step_costs.update(timed.steps)
        for costs, new in ((e.step_costs, timed.steps), (e.first_costs, timed.firsts),
                           (e.prefill_costs, timed.prefills)):  # live measurements stay, until settled ones come
            costs.update({k: v for k, v in new.items() if settle or k not in costs})
        e._ready = ready
        e.sizes = Sizes(
            ladder=tuple(b for b in c.ladder if {("step", b, 1), ("codec", b, 1)} <= ready),
            first=tuple(b for b in c.first_sizes if {("step", b, 1), ("codec", b, 1)} <= ready),
            step=tuple(n for n in c.step_sizes if ("step", c.ladder[0], n) in ready),
            codec=tuple(n for n in c.codec_sizes if ("codec", c.ladder[0], n) in ready),
            prefill=tuple(r for r in c.prefill_sizes if all(("insert", b, r) in ready for b in c.prompt_buckets)))
        if settle:
            e._forget_timings()
        e._compiling = left
        e._stats = snapshot(e)
        e._wake.notify_all()  # the loop, and whoever waits for the warm-up (`wait`)
