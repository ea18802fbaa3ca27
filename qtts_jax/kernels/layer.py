"""A decoder layer for one new token per row in four Pallas kernels, beside the jnp references they must equal.

XLA runs a layer for a decode step as a dozen or more kernels: the norm, the QKV product, the per-head norms, RoPE,
the cache write, the attention's pieces, the output product, the residual, the norm, the MLP's products and SwiGLU,
the residual. At a decode step's few rows each costs more to start than its arithmetic, and a frame runs 103 layers
(28 talker, 75 code predictor). Here a layer is five launches of four kernels, each a matrix product with what
surrounds it:

* `qkv_rope`: RMSNorm in the prologue; the q, k and v products; each head's RMSNorm and RoPE in the epilogue (a
  program owns one head, so the head's norm and its rotate-half are local to it).
* `attend`: each row's new key and value written into its slot of the shared cache and attended with the rows
  below it (one program per row and KV head; the new key from registers, the old ones from the cache).
* `project_residual`: the output (or down) product with the residual added in its epilogue.
* `norm_gate_up`: RMSNorm in the prologue, gate and up products, SwiGLU in the epilogue.

Every kernel takes a stack's weights whole, with the layer's index: a slice of the stacked weights passed to a
custom call is copied first, and the layer loop would copy a layer's weights every trip.

The references (`*_ref`) are the arithmetic of `transformer.DecoderLayer` and `gather_rows_attention`, in the
same order and dtypes, written over the same arguments. Tolerances: in fp32 the kernels equal the references to
rounding (tests: 1e-5 relative). In bf16 the kernels keep fp32 where the references round to bf16 between
operations (the product's output before the epilogue's arithmetic, the attention's scores and probabilities), so
outputs differ by a few bf16 steps (bench/layer_check.py holds each kernel to 3% of its output's largest
magnitude) and sampled codes can differ at near-ties, as between any two kernels.

Lowered through Pallas-Triton: blocks are powers of two, a product's rows at least 16, so rows are padded to a
multiple of the row block (`_rows_block`) and head_dim, hidden and MLP widths must be powers of two times 16.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from qtts_jax.nn import apply_rope, rms_norm
from qtts_jax.talker.transformer import gather_rows_attention

BLOCK_K = 64  # the reduction's chunk in every product
BLOCK_N = 64  # output columns per program of the products that are not per head
ATTEND_BLOCK = 16  # cache rows per step of the attention's online softmax
NUM_WARPS = 4


def _rows_block(rows: int) -> int:
    """Rows per program: 16 (Triton's smallest product) up to 64, dividing the padded row count."""
    return 16 if rows <= 16 else min(64, 1 << ((rows & -rows).bit_length() - 1)) if rows % 16 == 0 else 16


def _padded(x: jax.Array, block: int) -> jax.Array:
    extra = -x.shape[0] % block
    return x if extra == 0 else jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1))


def _whole(a) -> pl.BlockSpec:
    return pl.BlockSpec(a.shape, lambda *_: (0,) * len(a.shape))


def _params():
    return pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=2)


def _chunk(c, size: int):
    return pl.ds(pl.multiple_of(c * size, size), size)


def _inverse_rms(x_ref, rows, width: int, eps: float, bk: int):
    """1 / RMS of rows `rows` of x_ref [B, width], in fp32, [BM, 1], over chunks of `bk`."""
    def body(c, ss):
        x = x_ref[rows, _chunk(c, bk)].astype(jnp.float32)
        return ss + jnp.sum(x * x, axis=1, keepdims=True)

    ss = lax.fori_loop(0, width // bk, body, jnp.zeros((rows.size, 1), jnp.float32))
    return lax.rsqrt(ss / width + eps)


def _normed_products(x_ref, norm_ref, w_ref, layer, rows, eps: float, cols_a, cols_b, width_a: int):
    """RMSNorm(x) @ w[layer][:, cols_a] and @ w[layer][:, cols_b], the two products as their output dtype (kept
    in fp32 registers) and in the reference's order: x normalised in fp32, cast, scaled by the norm's weight."""
    width, dtype = x_ref.shape[1], x_ref.dtype
    bk = min(BLOCK_K, width)
    inv = _inverse_rms(x_ref, rows, width, eps, bk)

    def body(c, acc):
        a, b = acc
        at = _chunk(c, bk)
        x = norm_ref[layer, at][None, :] * (x_ref[rows, at].astype(jnp.float32) * inv).astype(dtype)
        return (a + pltriton.dot(x, w_ref[layer, at, cols_a]).astype(jnp.float32),
                b + pltriton.dot(x, w_ref[layer, at, cols_b]).astype(jnp.float32))

    zeros = jnp.zeros((rows.size, width_a), jnp.float32)
    a, b = lax.fori_loop(0, width // bk, body, (zeros, zeros))
    return a.astype(dtype).astype(jnp.float32), b.astype(dtype).astype(jnp.float32)


# --- norm, q/k/v products, per-head norm and RoPE -------------------------------------------------------------------

def _qkv_kernel(layer_ref, x_ref, ln_ref, w_ref, qn_ref, kn_ref, cos_ref, sin_ref, out_ref, *, heads: int,
                kv_heads: int, eps: float, block_m: int):
    i, head = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    rows = _chunk(i, block_m)
    d = qn_ref.shape[1]
    half, dtype = d // 2, x_ref.dtype
    # the head's two halves as two products, so rotate-half needs no slicing of registers
    lo, hi = _normed_products(x_ref, ln_ref, w_ref, layer, rows, eps, pl.ds(head * d, half),
                              pl.ds(head * d + half, half), half)
    # q and k heads: the head's RMSNorm, then rotate-half RoPE; v heads pass through
    is_q, is_qk = head < heads, head < heads + kv_heads
    norm_lo = jnp.where(is_q, qn_ref[layer, pl.ds(0, half)], kn_ref[layer, pl.ds(0, half)])
    norm_hi = jnp.where(is_q, qn_ref[layer, pl.ds(half, half)], kn_ref[layer, pl.ds(half, half)])
    inv_head = lax.rsqrt((jnp.sum(lo * lo, axis=1, keepdims=True) + jnp.sum(hi * hi, axis=1, keepdims=True)) / d
                         + eps)
    n_lo = (norm_lo[None, :] * (lo * inv_head).astype(dtype)).astype(jnp.float32)
    n_hi = (norm_hi[None, :] * (hi * inv_head).astype(dtype)).astype(jnp.float32)
    cos_lo, sin_lo = cos_ref[rows, pl.ds(0, half)].astype(jnp.float32), sin_ref[rows, pl.ds(0, half)].astype(
        jnp.float32)
    cos_hi, sin_hi = cos_ref[rows, pl.ds(half, half)].astype(jnp.float32), sin_ref[rows, pl.ds(half, half)].astype(
        jnp.float32)
    out_ref[rows, head, pl.ds(0, half)] = jnp.where(is_qk, n_lo * cos_lo - n_hi * sin_lo, lo).astype(dtype)
    out_ref[rows, head, pl.ds(half, half)] = jnp.where(is_qk, n_hi * cos_hi + n_lo * sin_hi, hi).astype(dtype)


@partial(jax.jit, static_argnames=("heads", "kv_heads", "eps", "interpret"))
def qkv_rope(x, ln, wqkv, q_norm, k_norm, cos, sin, layer, *, heads: int, kv_heads: int, eps: float,
             interpret: bool = False):
    """x [B, width]; the stack's ln [L, width], wqkv [L, width, (heads + 2 kv_heads) * D], q_norm / k_norm [L, D];
    cos / sin [B, D] each row's RoPE; `layer` the layer. Returns q, k and v heads side by side, [B, heads +
    2 kv_heads, D]: q and k normed per head and rotated, v as the product gives it."""
    rows, width = x.shape
    d = q_norm.shape[1]
    total = heads + 2 * kv_heads
    block_m = _rows_block(rows)
    xp, cosp, sinp = (_padded(a, block_m) for a in (x, cos, sin))
    layer = jnp.reshape(layer, (1,)).astype(jnp.int32)
    out = pl.pallas_call(
        partial(_qkv_kernel, heads=heads, kv_heads=kv_heads, eps=eps, block_m=block_m),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], total, d), x.dtype),
        grid=(xp.shape[0] // block_m, total),
        in_specs=[_whole(a) for a in (layer, xp, ln, wqkv, q_norm, k_norm, cosp, sinp)],
        out_specs=_whole(jax.ShapeDtypeStruct((xp.shape[0], total, d), x.dtype)),
        compiler_params=_params(),
        interpret=interpret,
    )(layer, xp, ln, wqkv, q_norm, k_norm, cosp, sinp)
    return out[:rows]


def qkv_rope_ref(x, ln, wqkv, q_norm, k_norm, cos, sin, layer, *, heads: int, kv_heads: int, eps: float,
                 interpret: bool = False):
    """`qkv_rope` as `DecoderLayer` computes it."""
    del interpret
    n, d = x.shape[0], q_norm.shape[1]
    a = rms_norm(x, ln[layer], eps)
    q, k, v = jnp.split(a @ wqkv[layer], [heads * d, (heads + kv_heads) * d], axis=-1)
    q = apply_rope(rms_norm(q.reshape(n, heads, d), q_norm[layer], eps), cos, sin)
    k = apply_rope(rms_norm(k.reshape(n, kv_heads, d), k_norm[layer], eps), cos, sin)
    return jnp.concatenate([q, k, v.reshape(n, kv_heads, d)], axis=1)


# --- the cache write and the attention --------------------------------------------------------------------------

def _attend_kernel(layer_ref, slots_ref, rows_ref, real_ref, qkv_ref, mask_ref, k_in, v_in, out_ref, k_ref, v_ref, *,
                   heads: int, kv_heads: int, scale: float):
    del k_in, v_in  # aliased to k_ref / v_ref: the cache is read and written there
    b, h = pl.program_id(0), pl.program_id(1)
    layer, slot, row = layer_ref[0], slots_ref[b], rows_ref[b]
    group = heads // kv_heads
    q = qkv_ref[b, pl.ds(h * group, group), :].astype(jnp.float32)  # [G, D]
    k_new = qkv_ref[b, heads + h, :]
    v_new = qkv_ref[b, heads + kv_heads + h, :]

    @pl.when(real_ref[b] != 0)
    def _():
        k_ref[layer, slot, h, pl.ds(row, 1), :] = k_new[None, :]
        v_ref[layer, slot, h, pl.ds(row, 1), :] = v_new[None, :]

    # the new key first (from registers), then the older cache rows block by block (online softmax)
    m = jnp.sum(q * k_new.astype(jnp.float32)[None, :], axis=1) * scale  # [G]
    init = (m, jnp.ones_like(m), jnp.broadcast_to(v_new.astype(jnp.float32)[None, :], q.shape))
    neg = jnp.finfo(jnp.float32).min

    def body(c, carry):
        m, l, acc = carry
        at = pl.multiple_of(c * ATTEND_BLOCK, ATTEND_BLOCK)
        keys = k_ref[layer, slot, h, pl.ds(at, ATTEND_BLOCK), :].astype(jnp.float32)  # [blk, D]
        values = v_ref[layer, slot, h, pl.ds(at, ATTEND_BLOCK), :].astype(jnp.float32)
        index = at + lax.broadcasted_iota(jnp.int32, (1, ATTEND_BLOCK), 1)
        keep = (mask_ref[pl.ds(b, 1), pl.ds(at, ATTEND_BLOCK)] != 0) & (index < row)  # [1, blk]
        s = jnp.sum(q[:, None, :] * keys[None, :, :], axis=2) * scale  # [G, blk]
        s = jnp.where(keep, s, neg)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(keep, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + jnp.sum(p[:, :, None] * values[None, :, :], axis=1)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    _, l, acc = lax.fori_loop(0, pl.cdiv(row, ATTEND_BLOCK), body, init)
    out_ref[b, h, :, :] = (acc / l[:, None]).astype(out_ref.dtype)


@partial(jax.jit, static_argnames=("heads", "kv_heads", "scale", "interpret"))
def attend(qkv, cache_k, cache_v, layer, slots, rows, mask, *, heads: int, kv_heads: int, scale: float,
           interpret: bool = False):
    """qkv [B, heads + 2 kv_heads, D] (`qkv_rope`'s); cache_k / v [layers, slots, kv_heads, C, D]. Row b writes its
    new key and value at (`layer`, `slots[b]`, head, `rows[b]`) and attends them with the cache rows below
    `rows[b]` where `mask[b]` [B, C] holds. A slot past the cache's end marks a padding row: it writes nothing.
    Returns the attention [B, heads * D] and the cache (updated in place)."""
    batch, _, d = qkv.shape
    num_slots, capacity = cache_k.shape[1], cache_k.shape[3]
    if capacity % ATTEND_BLOCK:
        raise ValueError(f"a cache of {capacity} rows: the attention reads blocks of {ATTEND_BLOCK}")
    group = heads // kv_heads
    real = (slots < num_slots).astype(jnp.int32)
    args = (jnp.reshape(layer, (1,)).astype(jnp.int32), jnp.minimum(slots, num_slots - 1).astype(jnp.int32),
            rows.astype(jnp.int32), real, qkv, mask.astype(jnp.int32), cache_k, cache_v)
    out, cache_k, cache_v = pl.pallas_call(
        partial(_attend_kernel, heads=heads, kv_heads=kv_heads, scale=scale),
        out_shape=(jax.ShapeDtypeStruct((batch, kv_heads, group, d), qkv.dtype),
                   jax.ShapeDtypeStruct(cache_k.shape, cache_k.dtype),
                   jax.ShapeDtypeStruct(cache_v.shape, cache_v.dtype)),
        grid=(batch, kv_heads),
        in_specs=[_whole(a) for a in args],
        out_specs=(_whole(jax.ShapeDtypeStruct((batch, kv_heads, group, d), qkv.dtype)), _whole(cache_k),
                   _whole(cache_v)),
        input_output_aliases={6: 1, 7: 2},
        compiler_params=_params(),
        interpret=interpret,
    )(*args)
    return out.reshape(batch, heads * d), cache_k, cache_v


def attend_ref(qkv, cache_k, cache_v, layer, slots, rows, mask, *, heads: int, kv_heads: int, scale: float,
               interpret: bool = False):
    """`attend` as `DecoderStack.forward_rows` computes it: the write, then `gather_rows_attention` under `mask`
    and the causal bound."""
    del interpret
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    cache_k = cache_k.at[layer, slots, :, rows].set(k.astype(cache_k.dtype), mode="drop")
    cache_v = cache_v.at[layer, slots, :, rows].set(v.astype(cache_v.dtype), mode="drop")
    causal = mask & (jnp.arange(mask.shape[1])[None, :] <= rows[:, None])
    causal = causal.at[jnp.arange(rows.shape[0]), rows].set(True)
    return gather_rows_attention(q, cache_k, cache_v, layer, slots, rows + 1, causal, scale=scale), cache_k, cache_v


# --- a product with the residual added ----------------------------------------------------------------------------

class Tiling(NamedTuple):
    """A product's blocks and Triton's launch settings (`project_residual`'s; bench/layer_tiles.py sweeps them)."""

    block_m: int | None = None  # rows per program; None: `_rows_block`
    block_n: int = BLOCK_N
    block_k: int = BLOCK_K
    num_warps: int = NUM_WARPS
    num_stages: int = 2


def _project_kernel(layer_ref, a_ref, w_ref, r_ref, out_ref, *, block_m: int, bn: int, bk: int):
    i, j = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    rows, cols = _chunk(i, block_m), _chunk(j, bn)

    def body(c, acc):
        at = _chunk(c, bk)
        return acc + pltriton.dot(a_ref[rows, at], w_ref[layer, at, cols]).astype(jnp.float32)

    acc = lax.fori_loop(0, a_ref.shape[1] // bk, body, jnp.zeros((block_m, bn), jnp.float32))
    out = acc.astype(out_ref.dtype).astype(jnp.float32) + r_ref[rows, cols].astype(jnp.float32)
    out_ref[rows, cols] = out.astype(out_ref.dtype)


@partial(jax.jit, static_argnames=("tiling", "interpret"))
def project_residual(a, w, layer, residual, *, tiling: Tiling = Tiling(), interpret: bool = False):
    """residual + a @ w[layer]: a [B, K], the stack's w [L, K, N], residual [B, N]."""
    rows, n = residual.shape
    block_m = tiling.block_m or _rows_block(rows)
    bn, bk = min(tiling.block_n, n), min(tiling.block_k, a.shape[1])
    ap, rp = _padded(a, block_m), _padded(residual, block_m)
    layer = jnp.reshape(layer, (1,)).astype(jnp.int32)
    out = pl.pallas_call(
        partial(_project_kernel, block_m=block_m, bn=bn, bk=bk),
        out_shape=jax.ShapeDtypeStruct(rp.shape, residual.dtype),
        grid=(rp.shape[0] // block_m, n // bn),
        in_specs=[_whole(x) for x in (layer, ap, w, rp)],
        out_specs=_whole(rp),
        compiler_params=pltriton.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
    )(layer, ap, w, rp)
    return out[:rows]


def project_residual_ref(a, w, layer, residual, *, interpret: bool = False):
    del interpret
    return residual + a @ w[layer]


# --- norm, gate and up products, SwiGLU ---------------------------------------------------------------------------

def _gate_up_kernel(layer_ref, x_ref, ln_ref, w_ref, out_ref, *, eps: float, block_m: int):
    i, j = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    dtype, f = x_ref.dtype, out_ref.shape[1]
    bn = min(BLOCK_N, f)
    rows, gate_cols = _chunk(i, block_m), _chunk(j, bn)
    gate, up = _normed_products(x_ref, ln_ref, w_ref, layer, rows, eps, gate_cols, pl.ds(f + j * bn, bn), bn)
    silu = (gate / (1.0 + jnp.exp(-gate))).astype(dtype).astype(jnp.float32)
    out_ref[rows, gate_cols] = (silu * up).astype(dtype)


@partial(jax.jit, static_argnames=("eps", "interpret"))
def norm_gate_up(x, ln, gate_up, layer, *, eps: float, interpret: bool = False):
    """silu(gate) * up of RMSNorm(x): x [B, width], the stack's ln [L, width] and gate_up [L, width, 2F] (gate's
    columns, then up's). Returns [B, F]."""
    rows = x.shape[0]
    f = gate_up.shape[2] // 2
    block_m = _rows_block(rows)
    xp = _padded(x, block_m)
    layer = jnp.reshape(layer, (1,)).astype(jnp.int32)
    out_shape = jax.ShapeDtypeStruct((xp.shape[0], f), x.dtype)
    out = pl.pallas_call(
        partial(_gate_up_kernel, eps=eps, block_m=block_m),
        out_shape=out_shape,
        grid=(xp.shape[0] // block_m, f // min(BLOCK_N, f)),
        in_specs=[_whole(a) for a in (layer, xp, ln, gate_up)],
        out_specs=_whole(out_shape),
        compiler_params=_params(),
        interpret=interpret,
    )(layer, xp, ln, gate_up)
    return out[:rows]


def norm_gate_up_ref(x, ln, gate_up, layer, *, eps: float, interpret: bool = False):
    del interpret
    gate, up = jnp.split(rms_norm(x, ln[layer], eps) @ gate_up[layer], 2, axis=-1)
    return jax.nn.silu(gate) * up


class LayerKernels(NamedTuple):
    """The four calls `DecoderStack.forward_rows_fused` runs a layer as."""

    qkv_rope: Callable
    attend: Callable
    project_residual: Callable
    norm_gate_up: Callable
    rows_multiple: int  # rows the caller pads to once, so that no call pads its own


REFERENCES = LayerKernels(qkv_rope_ref, attend_ref, project_residual_ref, norm_gate_up_ref, 1)


def kernels(*, interpret: bool = False) -> LayerKernels:
    """The Pallas kernels (`interpret`: run by the HLO interpreter, for tests on a CPU)."""
    return LayerKernels(*(partial(f, interpret=interpret) for f in (qkv_rope, attend, project_residual,
                                                                      norm_gate_up)), _rows_block(1))
