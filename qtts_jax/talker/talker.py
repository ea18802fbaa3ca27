"""The talker: text-side embedding, prompt prefill and one decode step, for ONE sequence.

The talker predicts codebook 0 of each 12.5 Hz frame; its `CodePredictor` (a submodule) the other 15.
`Talker` is a `flax.nnx.Module` holding every weight of both as `nnx.Param`s. The hot path never calls it
eagerly: it is split once at load (`nn.split`) into a static graph definition and its weights as a plain
pytree, and every jitted program merges the two back at trace time (`nn.merge`), so a call costs what a
call over a dict of arrays costs. Callers `jax.vmap` the single-sequence methods over a batch (each row
keeps its own cache and position).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qtts_jax.talker import sampling, transformer
from qtts_jax.talker.code_predictor import CodePredictor
from qtts_jax.config import ModelConfig
from qtts_jax.nn import dense, embedding, rows, zeros
from qtts_jax.talker.transformer import DecoderStack, KVCache


class TextProjection(nnx.Module):
    """Linear → SiLU → Linear (with biases) from the text embedding's width into the talker's."""

    def __init__(self, width: int, out: int, *, dtype, rngs: nnx.Rngs):
        self.w1, self.b1 = dense(rngs, (width, width), dtype), zeros((width,), dtype)
        self.w2, self.b2 = dense(rngs, (width, out), dtype), zeros((out,), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.silu(x @ self.w1[...] + self.b1[...]) @ self.w2[...] + self.b2[...]


class Talker(nnx.Module):
    """Text and codec embeddings, the talker's decoder stack and codec head, and the code predictor."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        h = cfg.talker.hidden_size
        self.text_embedding = embedding(rngs, (cfg.text_vocab_size, cfg.text_hidden_size), dtype)
        self.text_proj = TextProjection(cfg.text_hidden_size, h, dtype=dtype, rngs=rngs)
        self.codec_embedding = embedding(rngs, (cfg.talker.vocab_size, h), dtype)
        self.stack = DecoderStack(cfg.talker, dtype=dtype, rngs=rngs)
        self.codec_head = dense(rngs, (h, cfg.talker.vocab_size), dtype)
        self.predictor = CodePredictor(cfg, dtype=dtype, rngs=rngs)

    def embed_text(self, ids: jax.Array) -> jax.Array:
        """P(id): text embedding, then the projection into the talker's width."""
        return self.text_proj(rows(self.text_embedding[...], ids))

    def embed_codes(self, codes: jax.Array) -> jax.Array:
        """S(frame): the sum of a frame's 16 codebook embeddings (codes [..., 16]) in the talker's width."""
        first = rows(self.codec_embedding[...], codes[..., 0])
        tables = self.predictor.embedding[...]  # [groups - 1, V, H]: codebook g's id c is row g * V + c of them all
        at = jnp.arange(codes.shape[-1] - 1) * tables.shape[1] + codes[..., 1:]
        rest = rows(tables.reshape(-1, tables.shape[-1]), at)
        return first + rest.sum(axis=-2)

    def predict(self, hidden: jax.Array, code0: jax.Array, key: jax.Array, p, choose=sampling.choose):
        """Codes 1..15 of one sequence's frame and their logits (`CodePredictor.predict`), from the final-normed
        hidden state that chose `code0` and code0's embedding in this talker's codec table."""
        return self.predictor.predict(hidden, self.codec_embedding[...][code0], key, p, choose)

    def predict_rows(self, hidden, code0, keys, p, choose, layers):
        """`predict` for B rows at once through the fused layers `layers` (`CodePredictor.predict_rows`)."""
        return self.predictor.predict_rows(hidden, self.codec_embedding[...][code0], keys, p, choose, layers)

    def forward(self, x: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Teacher forcing over a whole sequence x [T, H] (left-padded; valid [T] marks real rows): float32 logits
        [T, 3072] of every position and the final-normed hidden states [T, H] (what training reads; the engine's
        `prefill` computes only the last position's logits and keeps the cache)."""
        h = self.stack.forward_causal(x, jnp.maximum(jnp.cumsum(valid) - 1, 0), valid)
        return (h @ self.codec_head[...]).astype(jnp.float32), h

    def prefill(self, x: jax.Array, valid: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, KVCache]:
        """Prompt embeddings x [T, H] (left-padded; valid [T] marks real rows) into a fresh cache.

        Returns logits of the last position (code0 of frame 0), its final-normed hidden state, the cache.
        RoPE positions count real rows only, as the reference's cumsum(mask) - 1 does.
        """
        positions = jnp.maximum(jnp.cumsum(valid) - 1, 0)
        key_valid = jnp.zeros(capacity, bool).at[: x.shape[0]].set(valid)
        cache = KVCache.zeros(self.stack.cfg, capacity, x.dtype)
        h, cache = self.stack.forward(x, positions, cache, jnp.int32(0), key_valid)
        return (h[-1] @ self.codec_head[...]).astype(jnp.float32), h[-1], cache

    def decode_rows(
        self,
        x: jax.Array,
        cache: KVCache,
        slots: jax.Array,
        rows: jax.Array,
        positions: jax.Array,
        key_valid: jax.Array,
        attention=transformer.gather_rows_attention,
        layers=None,
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        """One input vector per sequence, x [B, H], for B sequences in a shared slot-major cache: sequence b is
        slot `slots[b]`, written at cache row `rows[b]` with RoPE `positions[b]` (see `DecoderStack.forward_rows`;
        with `layers`, its fused form `forward_rows_fused`, which leaves `attention` unused)."""
        with jax.named_scope("talker"):  # names its kernels in profiles (bench/kernels.py)
            if layers is None:
                h, cache = self.stack.forward_rows(x, positions, cache, slots, rows, key_valid, attention)
            else:
                h, cache = self.stack.forward_rows_fused(x, positions, cache, slots, rows, key_valid, layers)
            return (h @ self.codec_head[...]).astype(jnp.float32), h, cache

