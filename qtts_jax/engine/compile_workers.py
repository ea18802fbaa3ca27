"""The engine's programs compiled in processes of their own, side by side, into the compilation cache's program
store, from which the engine loads them whole (`Runner.compile`).

One process traces and lowers its programs one at a time under its GIL, and its compiles share one XLA client; a
worker builds only the model's shapes (`model.model_shapes`: no weights, nothing on the device) and compiles its
share of the programs, in the order they were asked for, so the earlier warm-up stages land first
(`runner.compile_share`). A worker is started as a plain subprocess (the engine core is a daemon process, which
`multiprocessing` lets have no children) and dies with the thread that started it (Linux's parent-death signal):
the core's main thread, or the thread the warm-up is called on, both of which outlive the warm-up."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import time

from qtts_jax.engine.config import EngineConfig

log = logging.getLogger(__name__)

_POLL_S = 0.05
_WORKER = "from qtts_jax.engine.runner import compile_share; compile_share()"  # the worker's side: the runner's


@dataclasses.dataclass(frozen=True)
class Share:
    """One worker's programs: the model (a checkpoint directory or preset, `load_model`'s) in `dtype`, the engine of
    `config`, the compilation cache directory, and the programs' keys in the order to compile them."""

    model: str
    dtype: str
    config: EngineConfig
    cache: str
    keys: tuple


def count(programs: int) -> int:
    """Workers for `programs` on this machine: a core each of those this process may run on, leaving one to the
    engine (each worker's compiles also use XLA's own threads), at most 8 and at most one per program."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return max(1, min(programs, 8, cores - 1))


class Workers:
    """Worker processes compiling `keys` between them, dealt out in turn (the i-th key to worker i mod n)."""

    def __init__(self, model: str, dtype: str, config: EngineConfig, cache: str, keys: list, workers: int):
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # the engine holds the device's memory
        self.procs = []
        for i in range(workers):
            share = Share(model, dtype, config, cache, tuple(keys[i::workers]))
            proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, env=env)
            proc.stdin.write(pickle.dumps(share))
            proc.stdin.close()
            self.procs.append((proc, share.keys))
        log.info("compiling %d programs in %d worker processes", len(keys), workers)

    def wait(self, keys: list, stored) -> None:
        """Return once `stored([key])` holds for each of `keys` that a worker was given (`Runner.stored`), or its
        worker has exited (failed or not: the engine then compiles what is missing itself)."""
        mine = [(proc, key) for proc, given in self.procs for key in given if key in keys]
        while any(proc.poll() is None and not stored([key]) for proc, key in mine):
            time.sleep(_POLL_S)

    def stop(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
