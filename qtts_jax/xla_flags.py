"""XLA flags the model's programs compile and run best under, set before JAX starts a backend (XLA reads
`XLA_FLAGS` once). A flag the user already set in `XLA_FLAGS` is left as it is.

`--xla_gpu_enable_triton_gemm=false`: the matrix products go to cuBLAS instead of Triton kernels that XLA
autotunes one by one. On the H200 this halves compiling the engine's step, first-frame and prefill programs and
runs them as fast or faster (bench/results/compile-flags-0.6b-256-h200.json)."""

from __future__ import annotations

import os

TUNED = ("--xla_gpu_enable_triton_gemm=false",)


def apply() -> None:
    flags = os.environ.get("XLA_FLAGS", "").split()
    names = {f.split("=", 1)[0] for f in flags}
    flags += [f for f in TUNED if f.split("=", 1)[0] not in names]
    os.environ["XLA_FLAGS"] = " ".join(flags)
