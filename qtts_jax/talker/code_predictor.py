"""The code predictor: codebooks 1..15 of a frame from the talker's hidden state and code0.

Fifteen dependent forwards through a small decoder with a fresh cache per frame: a 2-position
prefill [past_hidden, E(code0)] read out by head 0, then 14 single steps where code j is embedded
with table j-1 and read out by head j. Inputs pass through `proj` when the widths differ (1.7B).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qtts_jax.talker import sampling
from qtts_jax.config import ModelConfig
from qtts_jax.nn import dense, embedding, zeros
from qtts_jax.talker.transformer import DecoderStack, KVCache


class Projection(nnx.Module):
    """`x @ w + b`: the talker's width into the predictor's (1.7B only)."""

    def __init__(self, cin: int, cout: int, *, dtype, rngs: nnx.Rngs):
        self.w, self.b = dense(rngs, (cin, cout), dtype), zeros((cout,), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.w[...] + self.b[...]


class CodePredictor(nnx.Module):
    """The 15 codebook tables (in the TALKER's width; projected after lookup), the decoder stack, 15 heads."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, c = cfg.talker.hidden_size, cfg.predictor
        groups = cfg.num_code_groups - 1
        self.embedding = embedding(rngs, (groups, c.vocab_size, h), dtype)
        self.proj = Projection(h, c.hidden_size, dtype=dtype, rngs=rngs) if h != c.hidden_size else None
        # unrolled: its 5 layers run 15 times a frame, and a loop's every trip costs a launch from the host
        self.stack = DecoderStack(c, dtype=dtype, rngs=rngs, unrolled=True)
        # its 14 group steps as straight-line code rather than a loop: slower when measured
        # (docs/benchmarks-history.md); bench/compile.py sets it to measure it again
        self.unrolled_groups = False
        self.heads = dense(rngs, (groups, c.hidden_size, c.vocab_size), dtype)

    def _project(self, x: jax.Array) -> jax.Array:
        return x if self.proj is None else self.proj(x)

    def forward(self, past_hidden: jax.Array, code0_embedding: jax.Array, codes: jax.Array) -> jax.Array:
        """Teacher forcing: the float32 logits [groups, vocab] that `predict` reads out when its codes 1..groups-1
        are ``codes`` [groups - 1] (a frame's given codes 1..14): one pass over [past_hidden, E(code0), E_0(c1),
        ..., E_13(c14)], position j + 1 read out by head j."""
        groups = self.heads.shape[0]
        rest = self.embedding[...][jnp.arange(groups - 1), codes]
        x = self._project(jnp.concatenate([jnp.stack([past_hidden, code0_embedding]), rest]))
        h = self.stack.forward_causal(x, jnp.arange(groups + 1), jnp.ones(groups + 1, bool))
        return jnp.einsum("gh,ghv->gv", h[1:], self.heads[...]).astype(jnp.float32)

    def predict(
        self,
        past_hidden: jax.Array,
        code0_embedding: jax.Array,
        key: jax.Array,
        p: sampling.SamplingParams,
        choose=sampling.choose,
    ) -> tuple[jax.Array, jax.Array]:
        """Codes 1..15 (int32 [groups]) of one sequence's frame from the talker's hidden state and its code0's
        embedding (the talker's codec table), and the float32 logits [groups, vocab] they came from."""
        with jax.named_scope("code_predictor"):  # names its kernels in profiles (bench/kernels.py)
            return self._predict(past_hidden, code0_embedding, key, p, choose)

    def _predict(self, past_hidden, code0_embedding, key, p, choose):
        c = self.stack.cfg
        groups, vocab = self.heads.shape[0], self.heads.shape[-1]
        capacity = groups + 1
        gumbel = jax.vmap(lambda k: sampling.noise(k, vocab))(jax.random.split(key, groups))
        key_valid = jnp.ones(capacity, bool)
        x = self._project(jnp.stack([past_hidden, code0_embedding]))
        h, cache = self.stack.forward(x, jnp.arange(2), KVCache.zeros(c, capacity, x.dtype), jnp.int32(0), key_valid)
        heads, table = self.heads[...], self.embedding[...]
        logits0 = (h[-1] @ heads[0]).astype(jnp.float32)
        first = choose(logits0, gumbel[0], p)

        def step(carry, j):
            code, cache = carry
            x = self._project(table[j - 1, code])
            h, cache = self.stack.forward(x[None], (j + 1)[None], cache, j + 1, key_valid)
            logits = (h[0] @ heads[j]).astype(jnp.float32)
            nxt = choose(logits, gumbel[j], p)
            return (nxt, cache), (nxt, logits)

        _, (rest, rest_logits) = jax.lax.scan(step, (first, cache), jnp.arange(1, groups), unroll=self.unrolled_groups)
        return jnp.concatenate([first[None], rest]), jnp.concatenate([logits0[None], rest_logits])

    def predict_rows(self, past_hidden, code0_embedding, keys, p: sampling.SamplingParams, choose, layers):
        """`predict` for B rows at once, codes [B, groups], each row's arithmetic its own: the decoder stack runs as
        `forward_rows_fused` over `layers` on a cache of the rows' own, one position per call (the 2-position
        prefill as two calls: the same causal arithmetic). past_hidden, code0_embedding [B, H]; keys [B, 2]; `p`
        and `choose` per row, as `predict`'s."""
        with jax.named_scope("code_predictor"):
            c = self.stack.cfg
            groups, vocab = self.heads.shape[0], self.heads.shape[-1]
            b = past_hidden.shape[0]
            gumbel = jax.vmap(lambda k: jax.vmap(lambda k: sampling.noise(k, vocab))(jax.random.split(k, groups)))(keys)
            shape = (c.num_layers, b, c.num_kv_heads, groups + 1, c.head_dim)
            dtype = past_hidden.dtype
            slots, key_valid = jnp.arange(b), jnp.ones((b, groups + 1), bool)
            heads, table = self.heads[...], self.embedding[...]
            pick = jax.vmap(choose)

            def forward(x, at, cache):
                where = jnp.full(b, at, jnp.int32)
                return self.stack.forward_rows_fused(self._project(x), where, cache, slots, where, key_valid, layers)

            _, cache = forward(past_hidden, 0, KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)))
            h, cache = forward(code0_embedding, 1, cache)
            first = pick((h @ heads[0]).astype(jnp.float32), gumbel[:, 0], p)

            def step(carry, j):
                code, cache = carry
                h, cache = forward(table[j - 1][code], j + 1, cache)
                nxt = pick((h @ heads[j]).astype(jnp.float32), gumbel[:, j], p)
                return (nxt, cache), nxt

            _, rest = jax.lax.scan(step, (first, cache), jnp.arange(1, groups))
            return jnp.concatenate([first[:, None], rest.T], axis=1)
