"""What gradient accumulation costs a training step beside its forward and backward pass: the optimiser's work per
step at N fp32 parameters, for the trainer's two programs (`optimizer.add` on the steps that only add their gradients
up, `optimizer.update` on every k-th) against `optax.MultiSteps` (one program that runs the update on every step and
keeps one result in k), each jitted with its state donated as the trainer does. Runs on whatever device JAX has.
Writes JSON.

    python bench/accumulate.py --params 64e6 --out runs/accumulate-cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=64e6, help="fp32 parameters, in 8 leaves")
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import optax

    from qtts_jax.finetune import optimizer

    k, n = args.accumulate, int(args.params) // 8
    params = {f"w{i}": jnp.ones((n,), jnp.float32) for i in range(8)}
    grads = jax.tree.map(lambda a: a * 1e-3, params)
    tx = optimizer.make(1e-5)
    multi = optax.MultiSteps(tx, every_k_schedule=k)

    def multisteps(p, s):
        updates, s = multi.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    def timed(step, p, s) -> float:
        """ms per call, after one call that compiles."""
        p, s = step(p, s)
        jax.block_until_ready((p, s))
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            p, s = step(p, s)
        jax.block_until_ready((p, s))
        return round((time.perf_counter() - t0) / args.repeats * 1e3, 2)

    fresh = lambda: jax.tree.map(jnp.copy, params)  # noqa: E731
    add = jax.jit(optimizer.add, donate_argnums=0)
    update = jax.jit(lambda p, s: optimizer.update(tx, optimizer.add(s["acc"], grads), s, p, k), donate_argnums=(0, 1))
    ms = {
        "multisteps_per_step": timed(jax.jit(multisteps, donate_argnums=(0, 1)), fresh(), multi.init(params)),
        "add": timed(lambda p, s: (p, add(s, grads)), fresh(), jax.tree.map(jnp.zeros_like, params)),
        "update": timed(update, fresh(), optimizer.init(tx, params, k)),
    }
    ms["trainer_per_step"] = round(((k - 1) * ms["add"] + ms["update"]) / k, 2)
    result = {"device": str(jax.devices()[0]), "params": 8 * n, "accumulate": k, "ms": ms,
              "command": " ".join(sys.argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
