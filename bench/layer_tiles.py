"""Can a Triton product match cuBLAS at a decode step's shapes? `kernels.layer.project_residual` (residual + a @ w)
under several tilings beside XLA's own product (cuBLAS) of the same shapes, each called `--repeats` times in one
compiled loop (each call's output is the next one's residual, so none is skipped), device time per call from the
wall time of the loop. The evidence for how the fused layers' products should be tiled, or left to cuBLAS. JSON.

    python bench/layer_tiles.py --rows 256 --shapes 3072x1024,2048x1024 --out runs/layer-tiles.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (block_m, block_n, block_k, num_warps, num_stages); block_m 0: the kernel's own choice
TILINGS = "0/64/64/4/2,0/32/64/4/3,32/64/64/4/3,64/128/64/8/3,16/64/128/4/4,32/32/128/4/4,64/64/32/4/4"


def per_call_us(fn, args, repeats: int) -> float:
    """Microseconds per call of `fn(*args)` -> same shape as args[-1], chained `repeats` times in one program."""
    import jax

    from bench.sampling import time_us

    def chained(*a):
        head, residual = a[:-1], a[-1]
        return jax.lax.fori_loop(0, repeats, lambda _, r: fn(*head, r), residual)

    return time_us(jax.jit(chained), args, warmup=1, runs=5, inner=repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="256")
    p.add_argument("--shapes", default="3072x1024,2048x1024", help="K x N of the products (0.6B: down, output)")
    p.add_argument("--tilings", default=TILINGS, help="block_m/block_n/block_k/warps/stages, comma-separated")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from qtts_jax.kernels.layer import Tiling, project_residual

    interpret = jax.default_backend() == "cpu"
    result = {"device": str(jax.devices()[0]), "command": " ".join(sys.argv), "runs": []}
    key = jax.random.PRNGKey(0)
    for rows in map(int, args.rows.split(",")):
        for shape in args.shapes.split(","):
            k, n = map(int, shape.split("x"))
            a = jax.random.normal(key, (rows, k), jnp.bfloat16)
            w = (jax.random.normal(key, (2, k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
            r = jnp.zeros((rows, n), jnp.bfloat16)
            layer = jnp.int32(1)
            flop = 2 * rows * k * n
            row = {"rows": rows, "k": k, "n": n}
            xla = per_call_us(lambda a, w, layer, r: r + a @ w[layer], (a, w, layer, r), args.repeats)
            row["xla_us"] = round(xla, 2)
            row["xla_tflops"] = round(flop / xla / 1e6, 1)
            row["triton"] = []
            for spec in args.tilings.split(","):
                bm, bn, bk, warps, stages = map(int, spec.split("/"))
                tiling = Tiling(bm or None, bn, bk, warps, stages)
                try:
                    us = per_call_us(lambda a, w, layer, r: project_residual(a, w, layer, r, tiling=tiling,
                                                                             interpret=interpret),
                                     (a, w, layer, r), args.repeats)
                    row["triton"].append({"tiling": spec, "us": round(us, 2), "tflops": round(flop / us / 1e6, 1)})
                except Exception as exc:  # a tiling Triton cannot compile is a result too
                    row["triton"].append({"tiling": spec, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            print(json.dumps(row), flush=True)
            result["runs"].append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
