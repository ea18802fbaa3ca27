"""The code predictor: codebooks 1..15 of a frame from the talker's hidden state and code0.

Fifteen dependent forwards through a small decoder with a fresh cache per frame: a 2-position
prefill [past_hidden, E(code0)] read out by head 0, then 14 single steps where code j is embedded
with table j-1 and read out by head j. Inputs pass through `cp_proj` when the widths differ (1.7B).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qtts_jax import sampling, transformer
from qtts_jax.config import ModelConfig
from qtts_jax.transformer import KVCache


def _project(params: dict, x: jax.Array) -> jax.Array:
    if "cp_proj" not in params:
        return x
    return x @ params["cp_proj"]["w"] + params["cp_proj"]["b"]


def predict(
    params: dict,
    cfg: ModelConfig,
    past_hidden: jax.Array,
    code0: jax.Array,
    key: jax.Array,
    p: sampling.SamplingParams,
    choose=sampling.choose,
) -> tuple[jax.Array, jax.Array]:
    """Codes 1..15 (int32 [groups]) of one sequence's frame, and the float32 logits [groups, vocab] they came from."""
    c = cfg.predictor
    groups = cfg.num_code_groups - 1
    capacity = groups + 1
    gumbel = jax.vmap(lambda k: sampling.noise(k, c.vocab_size))(jax.random.split(key, groups))
    stack = params["predictor"]
    key_valid = jnp.ones(capacity, bool)
    x = _project(params, jnp.stack([past_hidden, params["codec_embedding"][code0]]))
    h, cache = transformer.forward(
        stack, c, x, jnp.arange(2), KVCache.zeros(c, capacity, x.dtype), jnp.int32(0), key_valid
    )
    logits0 = (h[-1] @ params["cp_heads"][0]).astype(jnp.float32)
    first = choose(logits0, gumbel[0], p)

    def step(carry, j):
        code, cache = carry
        x = _project(params, params["cp_embedding"][j - 1, code])
        h, cache = transformer.forward(stack, c, x[None], (j + 1)[None], cache, j + 1, key_valid)
        logits = (h[0] @ params["cp_heads"][j]).astype(jnp.float32)
        nxt = choose(logits, gumbel[j], p)
        return (nxt, cache), (nxt, logits)

    _, (rest, rest_logits) = jax.lax.scan(step, (first, cache), jnp.arange(1, groups))
    return jnp.concatenate([first[None], rest]), jnp.concatenate([logits0[None], rest_logits])
