"""12 Hz speech-tokenizer decoder: codes [B, T, 16] -> 24 kHz audio [B, T * 1920], as pure functions.

Stages (the reference's ``Qwen3TTSTokenizerV2Decoder``): RVQ dequant -> causal conv -> sliding-window
transformer at 12.5 Hz -> 2x (transposed conv + ConvNeXt) -> SnakeBeta vocoder -> clamp to [-1, 1].
Activations are channels-last [B, T, C]. Every layer is causal, so output sample n depends only on
frames <= n // 1920; `chunked_decode` relies on this to pad chunks on the right.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qtts_jax.codec.config import RESIDUAL_DILATIONS, CodecConfig, CodecDecoderConfig
from qtts_jax.transformer import apply_rope, rms_norm

_DIMS = ("NWC", "WIO", "NWC")
SNAKE_EPS = 1e-9
CONVNEXT_LN_EPS = 1e-6


@functools.partial(jax.jit, static_argnums=1)
def decode(params: dict, cfg: CodecConfig, codes: jax.Array) -> jax.Array:
    """Full (single-pass) decode: int codes [B, T, Q] in [0, codebook_size) -> float32 audio [B, T * 1920]."""
    d = cfg.decoder
    if codes.shape[-1] != d.num_quantizers:
        raise ValueError(f"expected {d.num_quantizers} codebooks in the last axis, got shape {codes.shape}")
    x = _dequantize(params["quantizer"], codes)
    x = _causal_conv(x, params["pre_conv"])
    x = _transformer(params["transformer"], d, x)
    for stage, factor in zip(params["upsample"], d.upsampling_ratios):
        x = _causal_conv_transpose(x, stage["conv"], factor)
        x = _convnext(x, stage["convnext"])
    x = _vocoder(params["vocoder"], d, x)
    return jnp.clip(x[..., 0], -1.0, 1.0).astype(jnp.float32)


def chunked_decode(
    params: dict, cfg: CodecConfig, codes: jax.Array, chunk_size: int = 300, left_context: int = 25
) -> jax.Array:
    """The reference's ``decode()``: decode ``chunk_size`` frames at a time, each re-run with
    ``left_context`` earlier frames (positions restarting at 0) whose audio is then dropped.

    The attention window reaches further back than ``left_context``, so after the first chunk this
    differs from `decode`; copying it is what matches the reference. Every chunk is decoded as one
    window of a single static length (the last, and the context-free first, padded on the right:
    harmless, the decoder is causal), so `decode` compiles once.
    """
    codes = jnp.asarray(codes, jnp.int32)
    n_frames = codes.shape[1]
    if n_frames == 0:
        return jnp.zeros((codes.shape[0], 0), jnp.float32)
    window = min(n_frames, chunk_size + left_context)
    padded = jnp.pad(codes, ((0, 0), (0, window), (0, 0)))
    spf = cfg.decoder.samples_per_frame
    pieces = []
    for start in range(0, n_frames, chunk_size):
        context = left_context if start - left_context > 0 else start
        n_new = min(chunk_size, n_frames - start)
        audio = decode(params, cfg, padded[:, start - context : start - context + window])
        pieces.append(audio[:, context * spf : (context + n_new) * spf])
    return jnp.concatenate(pieces, axis=1)


def _dequantize(p: dict, codes: jax.Array) -> jax.Array:
    """Codebook 0 and codebooks 1.. are two RVQs, each summed and then projected by its own 1x1 conv."""
    vectors = p["codebooks"][jnp.arange(codes.shape[-1]), codes]  # [B, T, Q, D]
    return vectors[..., 0, :] @ p["first_proj"] + vectors[..., 1:, :].sum(axis=-2) @ p["rest_proj"]


def _causal_conv(x: jax.Array, p: dict, dilation: int = 1, groups: int = 1, history: int = 0) -> jax.Array:
    """Stride-1 Conv1d padded by (k-1)*dilation on the left only, so output t sees inputs <= t.

    The first ``history`` frames of x are earlier inputs (streaming): they stand in for that much of the
    zero padding and get no outputs of their own.
    """
    k = p["w"].shape[0]
    y = lax.conv_general_dilated(
        x, p["w"], (1,), [((k - 1) * dilation - history, 0)],
        rhs_dilation=(dilation,), dimension_numbers=_DIMS, feature_group_count=groups,
    )
    return y + p["b"]


def _causal_conv_transpose(x: jax.Array, p: dict, stride: int, history: int = 0) -> jax.Array:
    """ConvTranspose1d(k, stride) minus its last k - stride outputs: T steps in, T * stride out.

    Written as a convolution of the stride-dilated input with the flipped kernel; the full-transpose
    padding (k-1, k-1) with the right trim folded in is (k-1, stride-1). The first ``history`` frames of
    x are earlier inputs (streaming): they replace history * stride of the left padding, no outputs.
    """
    k = p["w"].shape[0]
    y = lax.conv_general_dilated(
        x, p["w"][::-1], (1,), [(k - 1 - history * stride, stride - 1)],
        lhs_dilation=(stride,), dimension_numbers=_DIMS,
    )
    return y + p["b"]


def _layer_norm(x: jax.Array, p: dict, eps: float) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def _linear(x: jax.Array, p: dict) -> jax.Array:
    return x @ p["w"] + p["b"]


def _rope_tables(d: CodecDecoderConfig, positions, xp=np) -> tuple:
    """cos/sin [..., head_dim] for integer positions, rotate-half layout, computed in fp32 like the reference.

    numpy (constants) for a full decode; ``xp=jnp`` for streaming, where positions are per-slot arrays.
    """
    exponents = np.arange(0, d.head_dim, 2, dtype=np.float32) / np.float32(d.head_dim)
    inv_freq = np.float32(1.0) / np.power(np.float32(d.rope_theta), exponents)
    angles = xp.asarray(positions).astype(np.float32)[..., None] * inv_freq
    angles = xp.concatenate([angles, angles], axis=-1)
    return xp.cos(angles), xp.sin(angles)


def _attention(x: jax.Array, p: dict, d: CodecDecoderConfig, cos, sin, mask, past=None):
    """Causal sliding-window GQA attention without QK-norm; softmax in fp32.

    ``past`` (keys, values) [B, S, kv_heads, head_dim] of earlier frames, keys already rotated, go before
    this chunk's (streaming; ``mask`` then spans S + T keys). Returns the output and the keys/values used.
    """
    b, t, _ = x.shape
    n_kv, group, hd = d.num_key_value_heads, d.num_attention_heads // d.num_key_value_heads, d.head_dim
    q = apply_rope((x @ p["q"]).reshape(b, t, d.num_attention_heads, hd), cos, sin)
    k = apply_rope((x @ p["k"]).reshape(b, t, n_kv, hd), cos, sin)
    v = (x @ p["v"]).reshape(b, t, n_kv, hd)
    if past is not None:
        k, v = jnp.concatenate([past[0], k], axis=1), jnp.concatenate([past[1], v], axis=1)
    q = q.reshape(b, t, n_kv, group, hd)  # attention head h uses kv head h // group
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k) * (hd**-0.5)
    scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, v).reshape(b, t, -1)
    return out @ p["o"], (k, v)


def _transformer_layer(x: jax.Array, p: dict, d: CodecDecoderConfig, cos, sin, mask, past=None):
    """Pre-norm block; both residual branches are scaled per channel (LayerScale). Returns the new
    hidden state and the attention's keys/values (see `_attention`)."""
    h = rms_norm(x, p["attn_norm"], d.rms_norm_eps)
    attended, kv = _attention(h, p, d, cos, sin, mask, past)
    x = x + p["attn_scale"] * attended
    h = rms_norm(x, p["mlp_norm"], d.rms_norm_eps)
    return x + p["mlp_scale"] * ((jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]), kv


def _transformer(p: dict, d: CodecDecoderConfig, x: jax.Array) -> jax.Array:
    """latent -> hidden, the layer stack as one scan, final RMSNorm, hidden -> latent."""
    t = x.shape[1]
    cos, sin = _rope_tables(d, np.arange(t))
    distance = np.arange(t)[:, None] - np.arange(t)[None, :]
    mask = (distance >= 0) & (distance < d.sliding_window)  # window counts the query itself

    def step(h, layer):
        return _transformer_layer(h, layer, d, cos, sin, mask)[0], None

    x, _ = lax.scan(step, _linear(x, p["input_proj"]), p["layers"])
    return _linear(rms_norm(x, p["norm"], d.rms_norm_eps), p["output_proj"])


def _convnext(x: jax.Array, p: dict, history: int = 0) -> jax.Array:
    """Causal depthwise k7 conv -> LayerNorm -> MLP with exact (erf) GELU -> gamma-scaled residual.
    The first ``history`` frames of x are earlier inputs, for the conv only (streaming)."""
    h = _causal_conv(x, p["dwconv"], groups=x.shape[-1], history=history)
    h = _layer_norm(h, p["norm"], CONVNEXT_LN_EPS)
    h = _linear(jax.nn.gelu(_linear(h, p["pwconv1"]), approximate=False), p["pwconv2"])
    return x[:, history:] + p["gamma"] * h


def _snake(x: jax.Array, p: dict) -> jax.Array:
    """SnakeBeta x + sin^2(alpha x) / beta, with alpha and beta stored as logs."""
    alpha, beta = jnp.exp(p["alpha"]), jnp.exp(p["beta"])
    return x + (1.0 / (beta + SNAKE_EPS)) * jnp.square(jnp.sin(x * alpha))


def _residual_unit(x: jax.Array, p: dict, dilation: int, history: int = 0) -> jax.Array:
    """The first ``history`` frames of x are earlier inputs, for the dilated conv only (streaming)."""
    h = _causal_conv(_snake(x, p["snake1"]), p["conv1"], dilation=dilation, history=history)
    return x[:, history:] + _causal_conv(_snake(h, p["snake2"]), p["conv2"])


def _vocoder(p: dict, d: CodecDecoderConfig, x: jax.Array) -> jax.Array:
    """Conv in, then per rate r: Snake -> transposed conv (k=2r, stride r, channels halved) -> 3 dilated
    residual units; then Snake -> conv to one channel. Blocks differ in width, so the loop is unrolled."""
    x = _causal_conv(x, p["conv_in"])
    for block, rate in zip(p["blocks"], d.upsample_rates):
        x = _causal_conv_transpose(_snake(x, block["snake"]), block["conv"], rate)
        for unit, dilation in zip(block["units"], RESIDUAL_DILATIONS):
            x = _residual_unit(x, unit, dilation)
    return _causal_conv(_snake(x, p["snake_out"]), p["conv_out"])
