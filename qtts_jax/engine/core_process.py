"""The engine core in a process of its own, one per device: the model on the device, the engine loop, voice priming
and the voice encoders, reached over a `multiprocessing` pipe (`core_host` on this side of it, `core_client` on the
host's).

The host shares no interpreter with the loop: its event loop, its garbage collector and its GIL never delay an
iteration. The process is started with `spawn` (never `fork`: a forked JAX runtime is unusable), and the host
never initialises the device: the core loads the model, resolves the dtype and sizes the slots on its own backend,
and sends the host its `Hello`."""

from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing
import os
import pickle
import sys

from qtts_jax.engine.config import EngineConfig
from qtts_jax.engine.messages import Hello

log = logging.getLogger(__name__)

# The core's threads (the loop, its sender, the link's reader and flusher) hand the GIL among themselves; each waits
# out at most this when another holds it (as the serving process measured: docs/benchmarks.md, "The switch interval")
_SWITCH_INTERVAL_S = 1e-4


@dataclasses.dataclass(frozen=True)
class CoreSpec:
    """What a core process builds: the model (a checkpoint directory or preset) in `dtype` ("auto": the core's
    backend's fast one, `model.weights_dtype`), an engine of `config` with `slots` ("auto": as many as fit the
    device, `sizing.resolve_slots`), and the persistent compilation cache (`compile_cache.enable`'s `where`)."""

    model: str
    dtype: str
    config: EngineConfig
    slots: int | str
    compile_cache: str = "off"


def spawn(spec: CoreSpec):
    """Start a core process and wait for its `Hello`. Returns (process, the host's end of its pipe, hello); raises
    what stopped the core from starting (`SlotsDoNotFit`, a missing file), or EOFError if it died first."""
    ctx = multiprocessing.get_context("spawn")
    host_end, core_end = ctx.Pipe()
    proc = ctx.Process(target=main, args=(core_end, spec), name="qtts-core", daemon=True)
    proc.start()
    core_end.close()
    try:
        hello = host_end.recv()
    except (EOFError, OSError):
        proc.join(5)
        raise EOFError(f"the engine core process exited during start-up (exit code {proc.exitcode})") from None
    if hello.error is not None:
        proc.join(5)
        host_end.close()
        raise hello.error
    return proc, host_end, hello


def main(conn, spec: CoreSpec) -> None:
    """The core process: load, size, say hello, then serve the host's batches until it stops or goes away."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    import jax.numpy as jnp

    from qtts_jax.engine import compile_cache, sizing, warmup
    from qtts_jax.engine.core import Engine
    from qtts_jax.engine.core_host import CoreHost, backend
    from qtts_jax.engine.host_model import HostModel
    from qtts_jax.model import load_model, weights_dtype

    ahead = None
    try:
        compile_cache.enable(spec.compile_cache)
        dtype = weights_dtype(spec.dtype)
        if isinstance(spec.slots, int):  # "auto" slots are known only once the model is on the device
            ahead = warmup.compile_ahead(spec.model, dtype, dataclasses.replace(spec.config, slots=spec.slots))
        model = load_model(spec.model, dtype=jnp.dtype(dtype))
        slots, fit = sizing.resolve_slots(model, dataclasses.replace(spec.config, slots=1), spec.slots)
        log.info("slots: %d (%s)", slots, fit.describe())
        engine = Engine(model, dataclasses.replace(spec.config, slots=slots))
    except Exception as exc:
        if ahead is not None:
            ahead.stop()
        conn.send(Hello(error=_sendable(exc)))
        conn.close()
        return
    engine.compiling_ahead = ahead
    # what start-up made stays out of the collector's passes, which would hold the GIL and the loop; again once the
    # background warm-up has compiled the larger rungs
    engine.on_compiled = gc.freeze
    conn.send(Hello(HostModel.of(model), engine.config, backend(), engine.stats()))
    CoreHost(engine, conn).serve()
    logging.shutdown()
    os._exit(0)  # a background warm-up's compiles run on threads nothing can stop: do not wait for them


def _sendable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
