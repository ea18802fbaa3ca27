"""The talker: text-side embedding, prompt prefill and one decode step, for ONE sequence.

The talker predicts codebook 0 of each 12.5 Hz frame. These are plain functions over the param
pytree; callers `jax.vmap` them over a batch (each row keeps its own cache and position) and `jit`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qtts_jax import transformer
from qtts_jax.config import ModelConfig
from qtts_jax.transformer import KVCache


def embed_text(params: dict, ids: jax.Array) -> jax.Array:
    """P(id): text embedding, then Linear → SiLU → Linear (with biases) into the talker's width."""
    p = params["text_proj"]
    x = params["text_embedding"][ids]
    return jax.nn.silu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def embed_codes(params: dict, codes: jax.Array) -> jax.Array:
    """S(frame): the sum of a frame's 16 codebook embeddings (codes [..., 16]) in the talker's width."""
    first = params["codec_embedding"][codes[..., 0]]
    groups = jnp.arange(codes.shape[-1] - 1)
    rest = params["cp_embedding"][groups, codes[..., 1:]]
    return first + rest.sum(axis=-2)


def prefill(
    params: dict, cfg: ModelConfig, x: jax.Array, valid: jax.Array, capacity: int
) -> tuple[jax.Array, jax.Array, KVCache]:
    """Prompt embeddings x [T, H] (left-padded; valid [T] marks real rows) into a fresh cache.

    Returns logits of the last position (code0 of frame 0), its final-normed hidden state, the cache.
    RoPE positions count real rows only, as the reference's cumsum(mask) - 1 does.
    """
    positions = jnp.maximum(jnp.cumsum(valid) - 1, 0)
    key_valid = jnp.zeros(capacity, bool).at[: x.shape[0]].set(valid)
    cache = KVCache.zeros(cfg.talker, capacity, x.dtype)
    h, cache = transformer.forward(params["talker"], cfg.talker, x, positions, cache, jnp.int32(0), key_valid)
    return (h[-1] @ params["codec_head"]).astype(jnp.float32), h[-1], cache


def decode_rows(
    params: dict,
    cfg: ModelConfig,
    x: jax.Array,
    cache: KVCache,
    slots: jax.Array,
    rows: jax.Array,
    positions: jax.Array,
    key_valid: jax.Array,
    attention=transformer.gather_rows_attention,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """One input vector per sequence, x [B, H], for B sequences in a shared slot-major cache: sequence b is
    slot `slots[b]`, written at cache row `rows[b]` with RoPE `positions[b]` (see `transformer.forward_rows`)."""
    h, cache = transformer.forward_rows(params["talker"], cfg.talker, x, positions, cache, slots, rows, key_valid,
                                        attention)
    return (h @ params["codec_head"]).astype(jnp.float32), h, cache
