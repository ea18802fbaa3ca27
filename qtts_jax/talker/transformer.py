"""The Qwen3 decoder stack shared by the talker and the code predictor, for ONE sequence.

Both are the same block (RMSNorm → GQA attention with per-head q/k RMSNorm and RoPE → RMSNorm →
SwiGLU), so one module serves both: `DecoderStack`, whose `DecoderLayer` is created once under `nnx.vmap`
so that every weight is stacked on a leading layer axis, and run in one `lax.scan`. `forward` works on a
single sequence with its own KV cache; batching is `jax.vmap` over it, which lets every sequence keep its
own position and cache (the engine relies on this).

The talker's config declares interleaved multimodal RoPE, but its three position streams are always
equal for speech, which makes it exactly ordinary 1-D RoPE (rotate-half layout).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from qtts_jax.config import DecoderConfig
from qtts_jax import nn
from qtts_jax.nn import apply_rope, dense, ones, rms_norm


class KVCache(NamedTuple):
    """Keys and values of one sequence: [layers, capacity, kv_heads, head_dim] each."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, cfg: DecoderConfig, capacity: int, dtype) -> "KVCache":
        shape = (cfg.num_layers, capacity, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def rope_tables(positions: jax.Array, head_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """cos/sin [T, head_dim] computed in fp32 and cast to the activation dtype, as the reference does."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def _attention(q, k, v, mask, scale):
    """q [T,H,D], k/v [S,KVH,D], mask [T,S] bool -> [T,H*D]. Softmax in fp32 with HF's finite mask value."""
    t, h, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(t, kvh, h // kvh, d)
    scores = jnp.einsum("tkgd,skd->kgts", qg, k).astype(jnp.float32) * scale
    scores = jnp.where(mask[None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("kgts,skd->tkgd", probs, v)
    return out.reshape(t, h * d)


def _row_attention(q, k, v, mask, scale):
    """`_attention` for one query per row, batched over rows: q [B,H,D], k/v [B,KVH,S,D], mask [B,S] -> [B,H*D]."""
    b, h, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(b, kvh, h // kvh, d)
    scores = jnp.einsum("bkgd,bksd->bkgs", qg, k).astype(jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgs,bksd->bkgd", probs, v).reshape(b, h * d)


def gather_rows_attention(q, cache_k, cache_v, layer, slots, lengths, mask, *, scale: float):
    """Attention of one query per row against its slot of a shared cache [layers, slots, KVH, S, D]: the whole
    slot gathered (indices past the end read the last slot: padding rows), then `_row_attention` under `mask`
    [B, S]. The reference of `kernels.attention.rows_attention`, which reads only the rows below `lengths`."""
    del lengths  # the mask already ends each row at its length
    keys, values = cache_k.at[layer, slots].get(mode="clip"), cache_v.at[layer, slots].get(mode="clip")
    return _row_attention(q, keys, values, mask, scale)


def rows_layout(cache: KVCache) -> KVCache:
    """Per-sequence caches of B sequences, [B, layers, S, KVH, D], in the shared layout that `forward_rows`
    reads: [layers, B, KVH, S, D]. Each head's rows are contiguous, so a row's keys are one matrix for the
    attention (the [.., S, KVH, D] layout costs a transpose per layer, which made it several times slower)."""
    return KVCache(*(jnp.transpose(a, (1, 0, 3, 2, 4)) for a in cache))


class DecoderLayer(nnx.Module):
    """One block's weights, matrices as (in, out) for `x @ w`, and its arithmetic around the attention.

    The q, k and v projections are one matrix (`wqkv`, their columns side by side) and so are the MLP's gate and up
    (`gate_up`): a layer runs two matrix products where the checkpoint has five. At a decode step's few rows each
    product is a kernel launch that costs more than its arithmetic, and a frame runs 103 layers (28 talker, 75 code
    predictor); the columns of a fused product equal the separate products'."""

    def __init__(self, cfg: DecoderConfig, *, dtype, rngs: nnx.Rngs):
        h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        # drawn per projection, as separate layers would be (`dense` scales by the fan-in, the same for all three)
        self.wqkv = nnx.Param(jnp.concatenate([dense(rngs, (h, n), dtype)[...] for n in (q, kv, kv)], axis=1))
        self.wo = dense(rngs, (q, h), dtype)
        self.q_norm, self.k_norm = ones((d,), dtype), ones((d,), dtype)
        self.ln1, self.ln2 = ones((h,), dtype), ones((h,), dtype)
        self.gate_up = nnx.Param(jnp.concatenate([dense(rngs, (h, f), dtype)[...] for _ in range(2)], axis=1))
        self.down = dense(rngs, (f, h), dtype)

    def __call__(self, cfg: DecoderConfig, h, cos, sin, cache, i, attend):
        """Norms, projections, RoPE and the MLP around `attend(q, k, v, cache, i)` (see `DecoderStack.layers_scan`)."""
        n, eps, d = h.shape[0], cfg.rms_norm_eps, cfg.head_dim
        a = rms_norm(h, self.ln1[...], eps)
        q, k, v = jnp.split(a @ self.wqkv[...], [cfg.num_heads * d, (cfg.num_heads + cfg.num_kv_heads) * d], axis=-1)
        q = apply_rope(rms_norm(q.reshape(n, cfg.num_heads, d), self.q_norm[...], eps), cos, sin)
        k = apply_rope(rms_norm(k.reshape(n, cfg.num_kv_heads, d), self.k_norm[...], eps), cos, sin)
        out, cache = attend(q, k, v.reshape(n, cfg.num_kv_heads, d), cache, i)
        h = h + out @ self.wo[...]
        m = rms_norm(h, self.ln2[...], eps)
        gate, up = jnp.split(m @ self.gate_up[...], 2, axis=-1)
        h = h + (jax.nn.silu(gate) * up) @ self.down[...]
        return h, cache


class DecoderStack(nnx.Module):
    """`cfg.num_layers` decoder layers, every weight stacked on a leading layer axis, and the final RMSNorm."""

    def __init__(self, cfg: DecoderConfig, *, dtype, rngs: nnx.Rngs, unrolled: bool = False):
        self.cfg = cfg
        self.unrolled = unrolled  # the layers as straight-line code rather than a loop (see `layers_scan`)
        self.layers = nn.stacked(cfg.num_layers, lambda rngs: DecoderLayer(cfg, dtype=dtype, rngs=rngs), rngs)
        self.norm = ones((cfg.hidden_size,), dtype)

    def forward(
        self, x: jax.Array, positions: jax.Array, cache: KVCache, start: jax.Array, key_valid: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """Run T new tokens of one sequence through the stack.

        x [T, hidden]; positions [T] RoPE positions; the new keys/values are written to cache rows
        [start, start+T); token t attends cache row j iff key_valid[j] and j <= start+t.
        Returns the final-normed hidden states [T, hidden] and the updated cache.
        """
        cfg = self.cfg
        t = x.shape[0]
        capacity = cache.k.shape[1]
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        rows = start + jnp.arange(t)
        mask = key_valid[None, :] & (jnp.arange(capacity)[None, :] <= rows[:, None])
        scale = cfg.head_dim**-0.5

        def attend(q, k, v, cache, i):
            # The whole cache rides in the carry and is updated in place at (layer i, row start), so a
            # step never copies it (threading per-layer slices through xs/ys would).
            at = (i, start, 0, 0)
            cache = KVCache(
                jax.lax.dynamic_update_slice(cache.k, k[None].astype(cache.k.dtype), at),
                jax.lax.dynamic_update_slice(cache.v, v[None].astype(cache.v.dtype), at),
            )
            return _attention(q, cache.k[i], cache.v[i], mask, scale), cache

        return self.layers_scan(x, cos, sin, cache, attend)

    def forward_causal(self, x: jax.Array, positions: jax.Array, key_valid: jax.Array) -> jax.Array:
        """`forward` of a whole sequence from an empty cache of its own length, without the cache: token t attends
        rows j <= t with key_valid[j], the keys and values of its own layer pass. The same arithmetic, for teacher
        forcing (training): a cache carried through the layer scan would make its gradient a full-size buffer
        added into at every layer of the backward pass. x [T, hidden] -> final-normed hidden states [T, hidden]."""
        cfg, t = self.cfg, x.shape[0]
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        mask = key_valid[None, :] & (jnp.arange(t)[None, :] <= jnp.arange(t)[:, None])
        scale = cfg.head_dim**-0.5

        def attend(q, k, v, cache, i):
            return _attention(q, k, v, mask, scale), cache

        return self.layers_scan(x, cos, sin, (), attend)[0]

    def layers_scan(self, x, cos, sin, cache: KVCache, attend) -> tuple[jax.Array, KVCache]:
        """The layer stack in one scan (`nn.scan`); `attend(q, k, v, cache, i)` writes layer i's new keys/values
        and returns the attention output [N, heads*D] (one sequence's own cache, or rows of a shared one) and the
        cache. On a GPU every trip of a loop is launched from the host, so a small stack run many times a frame
        (the code predictor's) is `unrolled`."""

        def layer(layer, carry, i):
            h, cache = carry
            return layer(self.cfg, h, cos, sin, cache, i, attend), None

        (h, cache), _ = nn.scan(self.layers, layer, (x, cache), jnp.arange(self.cfg.num_layers), unroll=self.unrolled)
        return rms_norm(h, self.norm[...], self.cfg.rms_norm_eps), cache

    def forward_rows(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        slots: jax.Array,
        rows: jax.Array,
        key_valid: jax.Array,
        attention=gather_rows_attention,
    ) -> tuple[jax.Array, KVCache]:
        """One new token for each of B sequences that live in a shared, slot-major cache.

        x [B, hidden]; positions [B] RoPE positions; cache k/v [layers, slots, kv_heads, capacity, head_dim];
        sequence b is slot `slots[b]` and writes its key/value at row `rows[b]`; key_valid [B, capacity].
        A slot index past the cache's end marks a padding row: its writes are dropped. `attention` reads each row's
        keys and values (`gather_rows_attention`, or the kernel `kernels.attention.rows_attention` of the same
        signature).

        Each row's arithmetic is `forward`'s for T = 1 (the same projections, norms and softmax, per row), so
        rows stay independent. Written batched rather than `vmap`-ed so that the cache is touched only where it
        is read (the rows' keys/values) and written (one row per sequence and layer): the whole cache stays in
        its one layout in the loop carry, with no per-call copy or transpose of it.
        """
        cfg = self.cfg
        capacity = cache.k.shape[3]
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, x.dtype)  # [B, D]: row b's own position
        mask = key_valid & (jnp.arange(capacity)[None, :] <= rows[:, None])  # [B, S]
        scale = cfg.head_dim**-0.5

        def attend(q, k, v, cache, i):
            cache = KVCache(
                cache.k.at[i, slots, :, rows].set(k.astype(cache.k.dtype), mode="drop"),
                cache.v.at[i, slots, :, rows].set(v.astype(cache.v.dtype), mode="drop"),
            )
            return attention(q, cache.k, cache.v, i, slots, rows + 1, mask, scale=scale), cache

        return self.layers_scan(x, cos, sin, cache, attend)

    def forward_rows_fused(self, x, positions, cache: KVCache, slots, rows, key_valid, layers) -> tuple[jax.Array,
                                                                                                       KVCache]:
        """`forward_rows` with each layer as four calls of `layers` (`kernels.layer.LayerKernels`: the Pallas
        kernels, or their references): each call reads the stack's weights whole with the layer's index, so no
        layer's weights are sliced out and copied. The same arguments and results; `key_valid` must hold at each
        row's `rows[b]` (the new token always attends itself)."""
        cfg, w = self.cfg, self.layers
        # rows padded once to the kernels' multiple (padding rows aimed past the last slot write nothing), not by
        # every call
        b, extra = x.shape[0], -x.shape[0] % layers.rows_multiple
        x, positions, rows, key_valid = (jnp.pad(a, ((0, extra),) + ((0, 0),) * (a.ndim - 1))
                                         for a in (x, positions, rows, key_valid))
        slots = jnp.pad(slots, (0, extra), constant_values=cache.k.shape[1])
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        heads = dict(heads=cfg.num_heads, kv_heads=cfg.num_kv_heads)
        eps = cfg.rms_norm_eps

        def layer(i, carry):
            h, k, v = carry
            qkv = layers.qkv_rope(h, w.ln1[...], w.wqkv[...], w.q_norm[...], w.k_norm[...], cos, sin, i, eps=eps,
                                  **heads)
            out, k, v = layers.attend(qkv, k, v, i, slots, rows, key_valid, scale=cfg.head_dim**-0.5, **heads)
            h = layers.project_residual(out, w.wo[...], i, h)
            h = layers.project_residual(layers.norm_gate_up(h, w.ln2[...], w.gate_up[...], i, eps=eps), w.down[...],
                                        i, h)
            return h, k, v

        carry = (x, cache.k, cache.v)
        if self.unrolled:
            for i in range(cfg.num_layers):
                carry = layer(jnp.int32(i), carry)
        else:
            carry = jax.lax.fori_loop(0, cfg.num_layers, layer, carry)
        h, k, v = carry
        return rms_norm(h[:b], self.norm[...], eps), KVCache(k, v)
