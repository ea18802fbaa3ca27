"""Low-rank adapters (LoRA) on the attention and MLP projections of the talker's and code predictor's stacks.

Each adapted weight W [in, out] (stacked over layers) trains as W + A @ B, with A [in, r] random (N(0, 1/in)) and
B [r, out] zero, so training starts from the base model exactly; everything else stays frozen. The adapters and
their optimiser state are all a run keeps and checkpoints; the export merges them into W (`merge`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

STACKS = ("talker", "predictor")
TARGETS = ("wq", "wk", "wv", "wo", "gate", "up", "down")


def init(params: dict, rank: int, seed: int = 0) -> dict:
    """{stack: {target: {"a", "b"}}} in fp32 for every adapted projection of ``params``."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), len(STACKS) * len(TARGETS)))
    adapters = {}
    for stack in STACKS:
        adapters[stack] = {}
        for target in TARGETS:
            layers, n_in, n_out = params[stack]["layers"][target].shape
            a = jax.random.normal(next(keys), (layers, n_in, rank), jnp.float32) * n_in**-0.5
            adapters[stack][target] = {"a": a, "b": jnp.zeros((layers, rank, n_out), jnp.float32)}
    return adapters


def merge(params: dict, adapters: dict) -> dict:
    """``params`` with every adapted projection replaced by W + A @ B (in W's dtype)."""
    out = dict(params)
    for stack, by_target in adapters.items():
        layers = dict(params[stack]["layers"])
        for target, ab in by_target.items():
            w = layers[target]
            layers[target] = (w + jnp.einsum("lir,lro->lio", ab["a"], ab["b"])).astype(w.dtype)
        out[stack] = {**params[stack], "layers": layers}
    return out
