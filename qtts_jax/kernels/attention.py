"""Decode attention of B rows straight from the shared slot-major KV cache: a Pallas kernel and the jnp reference
it must equal, with one signature (`rows_attention(q, cache_k, cache_v, layer, slots, lengths, mask, scale)`).

The reference (`transformer.gather_rows_attention`) gathers each row's whole slot from the cache, every layer
and every frame, and attends over the full context under a mask: at 256 rows over a third of a frame step
(docs/benchmarks.md), though a stream has written only its prompt bucket and the frames so far. The kernel reads each row's keys and values where they
lie (its slot, its layer) and only the blocks below its length, with an online softmax (one program per row and
KV head; the head's group of query heads padded to the 16 rows a Triton dot needs).

Numerics: scores in fp32 from the same inputs, masked like the reference (finfo.min, so a fully masked padding
row stays finite), the softmax taken block by block: in fp32 it equals the reference to rounding (~1e-6); in
bf16 the reference rounds scores and probabilities to bf16 where the kernel keeps fp32, so sampled codes can
differ at near-ties (as between any two attention kernels).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BLOCK_K = 64  # cache rows per step of the online softmax
GROUP_ROWS = 16  # the smallest M of a Triton dot: a KV head's query heads are padded to it


def _kernel(layer_ref, slots_ref, lengths_ref, q_ref, k_ref, v_ref, mask_ref, out_ref, *, scale: float, block: int):
    b, h = pl.program_id(0), pl.program_id(1)
    layer, slot, length = layer_ref[0], slots_ref[b], lengths_ref[b]
    q = q_ref[...]  # [GROUP_ROWS, D]
    neg = jnp.finfo(jnp.float32).min

    def body(i, carry):
        m, l, acc = carry
        at = pl.multiple_of(i * block, block)
        k = k_ref[layer, slot, h, pl.ds(at, block), :]  # [block, D]
        v = v_ref[layer, slot, h, pl.ds(at, block), :]
        keep = mask_ref[pl.ds(b, 1), pl.ds(at, block)] != 0  # [1, block]
        s = pltriton.dot(q, k, trans_b=True).astype(jnp.float32) * scale
        s = jnp.where(keep, s, neg)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    d = q.shape[-1]
    init = (jnp.full((q.shape[0],), neg, jnp.float32), jnp.zeros((q.shape[0],), jnp.float32),
            jnp.zeros((q.shape[0], d), jnp.float32))
    _, l, acc = lax.fori_loop(0, pl.cdiv(length, block), body, init)
    out_ref[...] = (acc / l[:, None]).astype(out_ref.dtype)


@partial(jax.jit, static_argnames=("scale", "interpret"))
def rows_attention(q, cache_k, cache_v, layer, slots, lengths, mask, *, scale: float, interpret: bool = False):
    """q [B, H, D]; cache_k/v [layers, slots, KVH, C, D]; `layer` this layer's index; row b attends slot
    `slots[b]` (past the end: the last slot, a padding row) at the cache rows below `lengths[b]` where `mask[b]`
    [B, C] holds. Returns [B, H * D], as `transformer.gather_rows_attention`."""
    batch, heads, d = q.shape
    _, num_slots, kvh, capacity, _ = cache_k.shape
    group = heads // kvh
    block = math.gcd(capacity, BLOCK_K)  # a power of two that tiles the context (Triton blocks are powers of two)
    if group > GROUP_ROWS:
        raise ValueError(f"{group} query heads per KV head: the kernel pads a group to {GROUP_ROWS} at most")
    qg = jnp.pad(q.reshape(batch, kvh, group, d), ((0, 0), (0, 0), (0, GROUP_ROWS - group), (0, 0)))
    lengths = jnp.clip(lengths, 1, capacity).astype(jnp.int32)
    whole = pl.BlockSpec(cache_k.shape, lambda b, h: (0,) * cache_k.ndim)  # read where each row's slot lies
    out = pl.pallas_call(
        partial(_kernel, scale=scale, block=block),
        out_shape=jax.ShapeDtypeStruct((batch, kvh, GROUP_ROWS, d), q.dtype),
        grid=(batch, kvh),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h: (0,)),
            pl.BlockSpec((batch,), lambda b, h: (0,)),
            pl.BlockSpec((batch,), lambda b, h: (0,)),
            pl.BlockSpec((None, None, GROUP_ROWS, d), lambda b, h: (b, h, 0, 0)),
            whole,
            whole,
            pl.BlockSpec((batch, capacity), lambda b, h: (0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, GROUP_ROWS, d), lambda b, h: (b, h, 0, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), jnp.minimum(slots, num_slots - 1).astype(jnp.int32), lengths, qg,
      cache_k, cache_v, mask.astype(jnp.int32))
    return out[:, :, :group].reshape(batch, heads * d)
