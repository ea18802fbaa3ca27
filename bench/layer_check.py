"""The fused layer kernels checked on the GPU against the jnp path, whenever a kernel changes: each kernel's largest
error against its reference at the model's real shapes (talker and code predictor, several row counts), and the
codes of seeded streams made by two small engines, one with `layers=jnp` and one with `layers=pallas`. Run in fp32
(matrix products at full precision, where equal codes are the claim) and in bf16 (where the stated tolerance is the
claim and codes may part at near-ties). Writes JSON.

    python bench/layer_check.py --model 0.6b --dtype float32 --out runs/layer-check-fp32.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# bf16: a few bf16 steps of the output's scale (the kernels keep fp32 where the references round); fp32: rounding
TOLERANCE = {"bfloat16": 3e-2, "float32": 1e-4}


def kernel_errors(cfg, dtype, rows: int, seed: int) -> dict:
    """kernel name -> its largest error against the reference, relative to the reference's largest magnitude, for
    one layer of a stack of config `cfg` at `rows` rows, on random inputs."""
    import jax
    import jax.numpy as jnp

    from qtts_jax.kernels import layer as layer_kernels
    from qtts_jax.talker.transformer import rope_tables

    layer = layer_kernels.kernels(interpret=jax.default_backend() == "cpu")  # a CPU runs the checks' own check
    reference = layer_kernels.REFERENCES

    rng = np.random.default_rng(seed)
    layers, width, d, capacity = 2, cfg.hidden_size, cfg.head_dim, 256
    heads = dict(heads=cfg.num_heads, kv_heads=cfg.num_kv_heads)

    def normal(shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, dtype)

    def error(got, want):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))

    i = jnp.int32(1)
    x = normal((rows, width))
    ln, wqkv = 1 + normal((layers, width), 0.1), normal((layers, width, (cfg.num_heads + 2 * cfg.num_kv_heads) * d),
                                                        width**-0.5)
    norms = (1 + normal((layers, d), 0.1), 1 + normal((layers, d), 0.1))
    cos, sin = rope_tables(jnp.asarray(rng.integers(0, 400, rows)), d, cfg.rope_theta, dtype)
    args = (x, ln, wqkv, *norms, cos, sin, i)
    qkv = reference.qkv_rope(*args, eps=cfg.rms_norm_eps, **heads)
    out = {"qkv_rope": error(layer.qkv_rope(*args, eps=cfg.rms_norm_eps, **heads), qkv)}
    slots = rows + 1
    cache = [normal((layers, slots, cfg.num_kv_heads, capacity, d)) for _ in range(2)]
    idx, where = jnp.arange(rows, dtype=jnp.int32), jnp.asarray(rng.integers(0, capacity, rows), jnp.int32)
    mask = jnp.ones((rows, capacity), bool)
    got = layer.attend(qkv, *cache, i, idx, where, mask, scale=d**-0.5, **heads)
    want = reference.attend(qkv, *cache, i, idx, where, mask, scale=d**-0.5, **heads)
    out["attend"] = error(got[0], want[0])
    out["attend_cache"] = max(error(got[1], want[1]), error(got[2], want[2]))
    wo = normal((layers, cfg.num_heads * d, width), (cfg.num_heads * d) ** -0.5)
    out["project_residual"] = error(layer.project_residual(want[0], wo, i, x),
                                    reference.project_residual(want[0], wo, i, x))
    gate_up = normal((layers, width, 2 * cfg.intermediate_size), width**-0.5)
    out["norm_gate_up"] = error(layer.norm_gate_up(x, ln, gate_up, i, eps=cfg.rms_norm_eps),
                                reference.norm_gate_up(x, ln, gate_up, i, eps=cfg.rms_norm_eps))
    return out


def main() -> None:
    from bench.compile import engine_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    engine_args(p)
    p.add_argument("--rows", default="1,16,256")
    p.add_argument("--streams", type=int, default=4, help="seeded streams whose codes both paths make (0: none)")
    p.add_argument("--frames", type=int, default=24)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    if args.dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")  # XLA's and Triton's products alike
    from bench.compile import model_for, seeded_codes

    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    model = model_for(args)
    result = {"model": args.model, "dtype": args.dtype, "device": str(jax.devices()[0]), "command": " ".join(sys.argv),
              "tolerance": TOLERANCE[args.dtype], "kernels": {}}
    for name, cfg in (("talker", model.cfg.talker), ("predictor", model.cfg.predictor)):
        for rows in map(int, args.rows.split(",")):
            result["kernels"][f"{name}:{rows}"] = errors = kernel_errors(cfg, dtype, rows, seed=rows)
            print(name, rows, errors, flush=True)
    worst = max(e for errors in result["kernels"].values() for e in errors.values())
    result["worst_error"], result["within_tolerance"] = worst, worst <= TOLERANCE[args.dtype]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if not args.streams:
        return
    jnp_codes = seeded_codes(args, model, args.streams, args.frames, layers="jnp")
    fused_codes = seeded_codes(args, model, args.streams, args.frames, layers="pallas")
    result["streams"] = [{"frames": len(a), "equal": bool(a.shape == b.shape and (a == b).all()),
                          "first_differing_frame": next((k for k, (x, y) in enumerate(zip(a, b)) if (x != y).any()),
                                                        None)} for a, b in zip(jnp_codes, fused_codes)]
    print("worst kernel error", worst, "codes", result["streams"], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
