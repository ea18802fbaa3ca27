"""Low-rank adapters (LoRA) on the attention and MLP projections of the talker's and code predictor's stacks.

Each adapted weight W [in, out] (stacked over layers) trains as W + A @ B, with A [in, r] random (N(0, 1/in)) and
B [r, out] zero, so training starts from the base model exactly; everything else stays frozen. The adapters and
their optimiser state are all a run keeps and checkpoints; the export merges them into W (`merge`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# the two `DecoderStack`s, by their path in `Talker`'s state (adapters and checkpoints key them by name)
STACKS = {"talker": ("stack",), "predictor": ("predictor", "stack")}
TARGETS = ("wqkv", "wo", "gate_up", "down")  # `DecoderLayer`'s projections (q, k, v fused; gate, up fused)


def init(state: dict, rank: int, seed: int = 0) -> dict:
    """{stack: {target: {"a", "b"}}} in fp32 for every adapted projection of the talker's Param ``state``."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), len(STACKS) * len(TARGETS)))
    adapters = {}
    for stack, path in STACKS.items():
        adapters[stack] = {}
        for target in TARGETS:
            layers, n_in, n_out = _node(state, path)["layers"][target].shape
            a = jax.random.normal(next(keys), (layers, n_in, rank), jnp.float32) * n_in**-0.5
            adapters[stack][target] = {"a": a, "b": jnp.zeros((layers, rank, n_out), jnp.float32)}
    return adapters


def merge(state: dict, adapters: dict) -> dict:
    """``state`` with every adapted projection replaced by W + A @ B (in W's dtype); the rest shared, not copied."""
    out = dict(state)
    for stack, by_target in adapters.items():
        *parents, last = STACKS[stack]
        node = out
        for key in parents:
            node[key] = dict(node[key])
            node = node[key]
        layers = dict(node[last]["layers"])
        for target, ab in by_target.items():
            w = layers[target]
            layers[target] = (w + jnp.einsum("lir,lro->lio", ab["a"], ab["b"])).astype(w.dtype)
        node[last] = {**node[last], "layers": layers}
    return out


def _node(state: dict, path: tuple[str, ...]) -> dict:
    for key in path:
        state = state[key]
    return state
