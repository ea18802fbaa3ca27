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
from qtts_jax.codec.layers import (
    causal_conv,
    causal_conv_transpose,
    convnext,
    dequantize,
    linear,
    residual_unit,
    rope_tables,
    snake,
    transformer_layer,
)
from qtts_jax.transformer import rms_norm


@functools.partial(jax.jit, static_argnums=1)
def decode(params: dict, cfg: CodecConfig, codes: jax.Array) -> jax.Array:
    """Full (single-pass) decode: int codes [B, T, Q] in [0, codebook_size) -> float32 audio [B, T * 1920]."""
    d = cfg.decoder
    if codes.shape[-1] != d.num_quantizers:
        raise ValueError(f"expected {d.num_quantizers} codebooks in the last axis, got shape {codes.shape}")
    x = dequantize(params["quantizer"], codes)
    x = causal_conv(x, params["pre_conv"])
    x = _transformer(params["transformer"], d, x)
    for stage, factor in zip(params["upsample"], d.upsampling_ratios):
        x = causal_conv_transpose(x, stage["conv"], factor)
        x = convnext(x, stage["convnext"])
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


def _transformer(p: dict, d: CodecDecoderConfig, x: jax.Array) -> jax.Array:
    """latent -> hidden, the layer stack as one scan, final RMSNorm, hidden -> latent."""
    t = x.shape[1]
    cos, sin = rope_tables(d, np.arange(t))
    distance = np.arange(t)[:, None] - np.arange(t)[None, :]
    mask = (distance >= 0) & (distance < d.sliding_window)  # window counts the query itself

    def step(h, layer):
        return transformer_layer(h, layer, d, cos, sin, mask)[0], None

    x, _ = lax.scan(step, linear(x, p["input_proj"]), p["layers"])
    return linear(rms_norm(x, p["norm"], d.rms_norm_eps), p["output_proj"])


def _vocoder(p: dict, d: CodecDecoderConfig, x: jax.Array) -> jax.Array:
    """Conv in, then per rate r: Snake -> transposed conv (k=2r, stride r, channels halved) -> 3 dilated
    residual units; then Snake -> conv to one channel. Blocks differ in width, so the loop is unrolled."""
    x = causal_conv(x, p["conv_in"])
    for block, rate in zip(p["blocks"], d.upsample_rates):
        x = causal_conv_transpose(snake(x, block["snake"]), block["conv"], rate)
        for unit, dilation in zip(block["units"], RESIDUAL_DILATIONS):
            x = residual_unit(x, unit, dilation)
    return causal_conv(snake(x, p["snake_out"]), p["conv_out"])
