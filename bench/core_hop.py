"""The hop between the server's process and an engine core in a process of its own (`qtts_jax.engine.core_process`):
what one message batch costs each way over the link `serve` uses (a `multiprocessing` pipe, pickled), beside the
same batches between two threads of one process (the in-process core's queues, nothing pickled).

- out (core -> host): one `Batch` of `--chunks` chunks of one frame (1920 float32 samples each, their PCM in one
  array, as `CoreHost` sends them) with an engine snapshot of that many streams; timed from just before the core
  side's `send` to just after the host side's `recv` returns, on the shared monotonic clock (`time.perf_counter`).
- in (host -> core): one `Submit` of a prepared tiny-random job, timed from the host's `send` to the core's `recv`.
- the alternative not taken (yet): the same batch's PCM written into a `multiprocessing.shared_memory` block by the
  core and copied out by the host, only the rest of the batch through the pipe.

CPU only; spawns one process.

    python bench/core_hop.py --out bench/results/core-hop-cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import pickle
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench import report  # noqa: E402
from qtts_jax.codec.config import SAMPLES_PER_FRAME  # noqa: E402
from qtts_jax.engine.links import thread_links  # noqa: E402
from qtts_jax.engine.messages import Batch, ChunkOut, Submit  # noqa: E402
from qtts_jax.engine.stats import EngineStats  # noqa: E402


def batch_of(chunks: int) -> Batch:
    """A hand-out of `chunks` one-frame chunks, with a snapshot of as many streams (realistic cost tables)."""
    out = tuple(ChunkOut(i, i * SAMPLES_PER_FRAME, SAMPLES_PER_FRAME, 7, 1, 0.0, False, None, 1.0, 8,
                         (1.0, 1.0, 1.0, 1.0, None, 0)) for i in range(chunks))
    ladder = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    stats = EngineStats(slots=256, live=chunks, queued=0, oldest_wait_s=0.0, frames_left=(100,) * chunks,
                        queued_frames=(), ladder=ladder, step_sizes=(1, 2, 4, 8),
                        headroom_margin_s=0.01, step_costs={(b, n): 0.01 * n for b in ladder for n in (1, 2, 4, 8)},
                        prefill_costs={n: 0.005 * n for n in range(1, 17)}, first_costs={b: 0.01 for b in ladder},
                        iteration_s=0.05, min_headroom_s=0.5, iterations=1000, recent_frame_s=(0.01,) * 64,
                        live_ids=tuple(range(chunks)))
    pcm = np.random.default_rng(0).standard_normal(chunks * SAMPLES_PER_FRAME).astype(np.float32)
    return Batch(out, pcm, stats, 0)


def core_side(conn, chunks: int, reps: int) -> None:
    """The child: answer each Submit with when it arrived; then send `reps` batches, each stamped as it leaves."""
    batch = batch_of(chunks)
    while True:
        msg = conn.recv()
        if msg == "batches":
            break
        conn.send(time.perf_counter())
    for _ in range(reps):
        conn.recv()  # the host is ready for the next: one batch in flight at a time
        conn.send((time.perf_counter(), batch))


def core_side_shm(conn, name: str, chunks: int, reps: int) -> None:
    """The child, the shared-memory way: the PCM into the block, the batch without it through the pipe."""
    from multiprocessing import shared_memory

    block = shared_memory.SharedMemory(name=name)  # the host owns (and unlinks) it; a spawned child shares its tracker
    batch = batch_of(chunks)
    pcm, rest = batch.pcm, dataclasses.replace(batch, pcm=np.zeros(0, np.float32))
    ring = np.ndarray(pcm.shape, np.float32, buffer=block.buf)
    for _ in range(reps):
        conn.recv()
        sent = time.perf_counter()
        ring[:] = pcm
        conn.send((sent, rest))
    del ring
    block.close()


def measure_shm(chunks: int, reps: int) -> dict:
    from multiprocessing import shared_memory

    samples = chunks * SAMPLES_PER_FRAME
    block = shared_memory.SharedMemory(create=True, size=samples * 4)
    ring = np.ndarray((samples,), np.float32, buffer=block.buf)
    ctx = multiprocessing.get_context("spawn")
    host, core = ctx.Pipe()
    proc = ctx.Process(target=core_side_shm, args=(core, block.name, chunks, reps), daemon=True)
    proc.start()
    outs = []
    for _ in range(reps):
        host.send("next")
        sent, batch = host.recv()
        pcm = ring.copy()
        outs.append(time.perf_counter() - sent)
        assert len(batch.chunks) == chunks and len(pcm) == samples
    proc.join()
    del ring
    block.close()
    block.unlink()
    return {"out_batch": _ms(outs[reps // 10:])}


def _ms(samples: list[float]) -> dict:
    a = np.array(samples) * 1e3
    return {"p50_ms": round(float(np.percentile(a, 50)), 4), "p95_ms": round(float(np.percentile(a, 95)), 4),
            "mean_ms": round(float(a.mean()), 4), "n": len(a)}


def measure(host, chunks: int, reps: int, submit: Submit) -> dict:
    """`host`: the host's end; the core side runs `core_side` at the other. The first tenth of each direction's
    repetitions warm up (the child's imports, the first allocations) and are not counted."""
    ins = []
    for _ in range(reps):
        t0 = time.perf_counter()
        host.send([submit])
        ins.append(host.recv() - t0)
    host.send("batches")
    outs = []
    for _ in range(reps):
        host.send("next")
        sent, batch = host.recv()
        outs.append(time.perf_counter() - sent)
        assert len(batch.chunks) == chunks
    skip = reps // 10
    return {"in_submit": _ms(ins[skip:]), "out_batch": _ms(outs[skip:])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=256)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from qtts_jax.engine import EngineConfig, preparation
    from qtts_jax.model import load_model
    from qtts_jax.request import Request

    model = load_model("tiny-random")
    job = preparation.prepare(model, EngineConfig(slots=1, context=256),
                              Request("A request of an ordinary length, as a voice agent sends one.", speaker="ryan"))
    submit = Submit(1, job, False, 0.0)

    ctx = multiprocessing.get_context("spawn")
    host, core = ctx.Pipe()
    proc = ctx.Process(target=core_side, args=(core, args.chunks, args.reps), daemon=True)
    proc.start()
    pipe = measure(host, args.chunks, args.reps, submit)
    proc.join()

    a, b = thread_links()
    threading.Thread(target=core_side, args=(b, args.chunks, args.reps), daemon=True).start()
    threads = measure(a, args.chunks, args.reps, submit)

    result = {"pipe_spawned_process": pipe, "queues_between_threads": threads,
              "shared_memory_pcm_spawned_process": measure_shm(args.chunks, args.reps),
              "batch_bytes_pickled": len(pickle.dumps(batch_of(args.chunks), protocol=pickle.HIGHEST_PROTOCOL)),
              "submit_bytes_pickled": len(pickle.dumps(submit, protocol=pickle.HIGHEST_PROTOCOL))}
    report.write(args.out, f"one message batch each way between the server's process and an engine core: a batch "
                           f"of {args.chunks} one-frame chunks ({SAMPLES_PER_FRAME} float32 samples each) with the "
                           "stats snapshot, core -> host; one prepared request, host -> core", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
