"""Building blocks of the 12 Hz codec, shared by the full decoder (`decoder`), the streaming decoder
(`streaming`) and the encoder (`encoder`), so the three run the same numerics: small `nnx.Module`s that hold
the weights (convs as (k, in, out), linears as (in, out)), and functions of them over channels-last
activations [B, T, C]; ``history`` arguments are the streaming decoder's earlier inputs.

The codec's modules are built with zeros: their weights come from a checkpoint or from a seeded draw at
the released shapes (`codec.weights`), both through `checkpoint.load_module`, which builds them abstractly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from qtts_jax.codec.config import CodecDecoderConfig, CodecEncoderConfig
from qtts_jax.nn import Conv, apply_rope, rms_norm, zeros

CONV_DIMS = ("NWC", "WIO", "NWC")  # channels-last activations, kernels (k, in, out)
SNAKE_EPS = 1e-9
CONVNEXT_LN_EPS = 1e-6


class Linear(nnx.Module):
    """`x @ w + b`."""

    def __init__(self, cin: int, cout: int, dtype=jnp.float32):
        self.w, self.b = zeros((cin, cout), dtype), zeros((cout,), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.w[...] + self.b[...]


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, dtype=jnp.float32):
        self.scale, self.bias = zeros((dim,), dtype), zeros((dim,), dtype)


class Snake(nnx.Module):
    """SnakeBeta's log-space alpha and beta."""

    def __init__(self, dim: int, dtype=jnp.float32):
        self.alpha, self.beta = zeros((dim,), dtype), zeros((dim,), dtype)


class ConvNeXt(nnx.Module):
    def __init__(self, dim: int, dtype=jnp.float32):
        self.dwconv = Conv(7, 1, dim, dtype=dtype)
        self.norm = LayerNorm(dim, dtype)
        self.pwconv1, self.pwconv2 = Linear(dim, 4 * dim, dtype), Linear(4 * dim, dim, dtype)
        self.gamma = zeros((dim,), dtype)


class ResidualUnit(nnx.Module):
    def __init__(self, dim: int, dtype=jnp.float32):
        self.snake1, self.conv1 = Snake(dim, dtype), Conv(7, dim, dim, dtype=dtype)
        self.snake2, self.conv2 = Snake(dim, dtype), Conv(1, dim, dim, dtype=dtype)


class Attention(nnx.Module):
    """A bias-free GQA attention block's projections and its two LayerScale vectors (Mimi-style transformer
    layers of the decoder and the encoder alike, which add their own norms and MLP)."""

    def __init__(self, d: CodecDecoderConfig | CodecEncoderConfig, dtype=jnp.float32):
        h, q_dim, kv_dim = d.hidden_size, d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
        self.q, self.k, self.v = zeros((h, q_dim), dtype), zeros((h, kv_dim), dtype), zeros((h, kv_dim), dtype)
        self.o = zeros((q_dim, h), dtype)
        self.attn_scale, self.mlp_scale = zeros((h,), dtype), zeros((h,), dtype)


class Quantizer(nnx.Module):
    """The decoder's codebook tables [Q, V, D] (sums already divided by usage), and the 1x1 output projections
    [D, C] of its two RVQs (codebook 0, codebooks 1..)."""

    def __init__(self, d: CodecDecoderConfig, dtype=jnp.float32):
        self.codebooks = zeros((d.num_quantizers, d.codebook_size, d.rvq_dim), dtype)
        self.first_proj = zeros((d.rvq_dim, d.codebook_dim), dtype)
        self.rest_proj = zeros((d.rvq_dim, d.codebook_dim), dtype)


class TransformerLayer(Attention):
    """The decoder's pre-norm layer: RMSNorms and a SwiGLU MLP around `Attention`."""

    def __init__(self, d: CodecDecoderConfig, dtype=jnp.float32):
        super().__init__(d, dtype)
        h, f = d.hidden_size, d.intermediate_size
        self.gate, self.up, self.down = zeros((h, f), dtype), zeros((h, f), dtype), zeros((f, h), dtype)
        self.attn_norm, self.mlp_norm = zeros((h,), dtype), zeros((h,), dtype)


def dequantize(p: Quantizer, codes: jax.Array) -> jax.Array:
    """Codebook 0 and codebooks 1.. are two RVQs, each summed and then projected by its own 1x1 conv."""
    vectors = p.codebooks[...][jnp.arange(codes.shape[-1]), codes]  # [B, T, Q, D]
    return vectors[..., 0, :] @ p.first_proj[...] + vectors[..., 1:, :].sum(axis=-2) @ p.rest_proj[...]


def causal_conv(x: jax.Array, p: Conv, dilation: int = 1, groups: int = 1, history: int = 0) -> jax.Array:
    """Stride-1 Conv1d padded by (k-1)*dilation on the left only, so output t sees inputs <= t.

    The first ``history`` frames of x are earlier inputs (streaming): they stand in for that much of the
    zero padding and get no outputs of their own.
    """
    k = p.w.shape[0]
    y = lax.conv_general_dilated(
        x, p.w[...], (1,), [((k - 1) * dilation - history, 0)],
        rhs_dilation=(dilation,), dimension_numbers=CONV_DIMS, feature_group_count=groups,
    )
    return y + p.b[...]


def causal_conv_transpose(x: jax.Array, p: Conv, stride: int, history: int = 0) -> jax.Array:
    """ConvTranspose1d(k, stride) minus its last k - stride outputs: T steps in, T * stride out.

    Written as a convolution of the stride-dilated input with the flipped kernel; the full-transpose
    padding (k-1, k-1) with the right trim folded in is (k-1, stride-1). The first ``history`` frames of
    x are earlier inputs (streaming): they replace history * stride of the left padding, no outputs.
    """
    k = p.w.shape[0]
    y = lax.conv_general_dilated(
        x, p.w[...][::-1], (1,), [(k - 1 - history * stride, stride - 1)],
        lhs_dilation=(stride,), dimension_numbers=CONV_DIMS,
    )
    return y + p.b[...]


def layer_norm(x: jax.Array, p: LayerNorm, eps: float) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * p.scale[...] + p.bias[...]


def rope_tables(d: CodecDecoderConfig | CodecEncoderConfig, positions, xp=np) -> tuple:
    """cos/sin [..., head_dim] for integer positions, rotate-half layout, computed in fp32 like the reference.

    numpy (constants) for a full decode; ``xp=jnp`` for streaming, where positions are per-slot arrays.
    """
    exponents = np.arange(0, d.head_dim, 2, dtype=np.float32) / np.float32(d.head_dim)
    inv_freq = np.float32(1.0) / np.power(np.float32(d.rope_theta), exponents)
    angles = xp.asarray(positions).astype(np.float32)[..., None] * inv_freq
    angles = xp.concatenate([angles, angles], axis=-1)
    return xp.cos(angles), xp.sin(angles)


def attention(x: jax.Array, p: Attention, d: CodecDecoderConfig | CodecEncoderConfig, cos, sin, mask, past=None):
    """GQA attention without QK-norm under ``mask`` (the decoder's sliding window, the encoder's plain causal
    mask); softmax in fp32.

    ``past`` (keys, values) [B, S, kv_heads, head_dim] of earlier frames, keys already rotated, go before
    this chunk's (streaming; ``mask`` then spans S + T keys). Returns the output and the keys/values used.
    """
    b, t, _ = x.shape
    n_kv, group, hd = d.num_key_value_heads, d.num_attention_heads // d.num_key_value_heads, d.head_dim
    q = apply_rope((x @ p.q[...]).reshape(b, t, d.num_attention_heads, hd), cos, sin)
    k = apply_rope((x @ p.k[...]).reshape(b, t, n_kv, hd), cos, sin)
    v = (x @ p.v[...]).reshape(b, t, n_kv, hd)
    if past is not None:
        k, v = jnp.concatenate([past[0], k], axis=1), jnp.concatenate([past[1], v], axis=1)
    q = q.reshape(b, t, n_kv, group, hd)  # attention head h uses kv head h // group
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k) * (hd**-0.5)
    scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, v).reshape(b, t, -1)
    return out @ p.o[...], (k, v)


def transformer_layer(x: jax.Array, p: TransformerLayer, d: CodecDecoderConfig, cos, sin, mask, past=None):
    """Pre-norm block; both residual branches are scaled per channel (LayerScale). Returns the new
    hidden state and the attention's keys/values (see `attention`)."""
    h = rms_norm(x, p.attn_norm[...], d.rms_norm_eps)
    attended, kv = attention(h, p, d, cos, sin, mask, past)
    x = x + p.attn_scale[...] * attended
    h = rms_norm(x, p.mlp_norm[...], d.rms_norm_eps)
    return x + p.mlp_scale[...] * ((jax.nn.silu(h @ p.gate[...]) * (h @ p.up[...])) @ p.down[...]), kv


def convnext(x: jax.Array, p: ConvNeXt, history: int = 0) -> jax.Array:
    """Causal depthwise k7 conv -> LayerNorm -> MLP with exact (erf) GELU -> gamma-scaled residual.
    The first ``history`` frames of x are earlier inputs, for the conv only (streaming)."""
    h = causal_conv(x, p.dwconv, groups=x.shape[-1], history=history)
    h = layer_norm(h, p.norm, CONVNEXT_LN_EPS)
    h = p.pwconv2(jax.nn.gelu(p.pwconv1(h), approximate=False))
    return x[:, history:] + p.gamma[...] * h


def snake(x: jax.Array, p: Snake) -> jax.Array:
    """SnakeBeta x + sin^2(alpha x) / beta, with alpha and beta stored as logs."""
    alpha, beta = jnp.exp(p.alpha[...]), jnp.exp(p.beta[...])
    return x + (1.0 / (beta + SNAKE_EPS)) * jnp.square(jnp.sin(x * alpha))


def residual_unit(x: jax.Array, p: ResidualUnit, dilation: int, history: int = 0) -> jax.Array:
    """The first ``history`` frames of x are earlier inputs, for the dilated conv only (streaming)."""
    h = causal_conv(snake(x, p.snake1), p.conv1, dilation=dilation, history=history)
    return x[:, history:] + causal_conv(snake(h, p.snake2), p.conv2)
