"""XLA flags the model's programs compile and run best under, and the share of the device a training process
takes, set before JAX starts a backend (XLA reads both once). What the user already set is left as it is.

`--xla_gpu_enable_triton_gemm=false`: the matrix products go to cuBLAS instead of Triton kernels that XLA
autotunes one by one. This halves compiling the engine's step and prefill programs and runs them as fast or
faster (docs/benchmarks.md)."""

from __future__ import annotations

import os

TUNED = ("--xla_gpu_enable_triton_gemm=false",)
# A CPU engine given one core (a fleet's CPU replica reserves one CPU in Ray): XLA's Eigen thread pool would
# otherwise spread every product over all the machine's cores, against the engine's own threads and the other
# replicas. On 2 cores a tiny-random engine of 2 slots then steps in 24 ms instead of 42, using half the CPU.
ONE_CORE = ("--xla_cpu_multi_thread_eigen=false",)


def merged(flags: str, extra: tuple[str, ...]) -> str:
    """`flags` (an XLA_FLAGS value) with each of `extra` that it does not already name."""
    given = flags.split()
    names = {f.split("=", 1)[0] for f in given}
    return " ".join(given + [f for f in extra if f.split("=", 1)[0] not in names])


def apply() -> None:
    os.environ["XLA_FLAGS"] = merged(os.environ.get("XLA_FLAGS", ""), TUNED)


# A training process owns its GPU. JAX's allocator otherwise stops at 75% of it, and the 1.7B Base step at batch
# 32 ran out of memory there where torch's allocator, which has no such cap, ran the official step.
TRAINING_MEMORY_FRACTION = "0.95"


def claim_device_memory() -> None:
    """Let JAX's allocator use `TRAINING_MEMORY_FRACTION` of the device, unless the user set a fraction; takes
    effect where no backend has started yet."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", TRAINING_MEMORY_FRACTION)
