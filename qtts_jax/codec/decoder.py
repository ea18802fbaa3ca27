"""12 Hz speech-tokenizer decoder: codes [B, T, 16] -> 24 kHz audio [B, T * 1920].

Stages (the reference's ``Qwen3TTSTokenizerV2Decoder``): RVQ dequant -> causal conv -> sliding-window
transformer at 12.5 Hz -> 2x (transposed conv + ConvNeXt) -> SnakeBeta vocoder -> clamp to [-1, 1].
Activations are channels-last [B, T, C]. Every layer is causal, so output sample n depends only on
frames <= n // 1920; `chunked_decode` relies on this to pad chunks on the right.

`CodecDecoder` is the `nnx.Module` of its weights, which the streaming decoder (`streaming`) shares. The
decode functions take its state as a plain pytree (`nn.split`) and rebuild the module at trace time from the
graph definition, which depends on the config alone (`graph`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qtts_jax.codec.config import RESIDUAL_DILATIONS, CodecConfig, CodecDecoderConfig
from qtts_jax import nn
from qtts_jax.codec.layers import (
    ConvNeXt,
    Linear,
    Quantizer,
    ResidualUnit,
    Snake,
    TransformerLayer,
    causal_conv,
    causal_conv_transpose,
    convnext,
    dequantize,
    residual_unit,
    rope_tables,
    snake,
    transformer_layer,
)
from qtts_jax.nn import Conv, rms_norm, zeros


class CodecTransformer(nnx.Module):
    """latent -> hidden projection, the sliding-window layers (stacked on a leading axis), final RMSNorm, and
    hidden -> latent."""

    def __init__(self, d: CodecDecoderConfig, dtype=jnp.float32):
        self.input_proj = Linear(d.latent_dim, d.hidden_size, dtype)
        self.layers = nn.stacked(d.num_hidden_layers, lambda: TransformerLayer(d, dtype))
        self.norm = zeros((d.hidden_size,), dtype)
        self.output_proj = Linear(d.hidden_size, d.latent_dim, dtype)


class UpsampleStage(nnx.Module):
    """A transposed conv with kernel == stride (so it needs no streaming state), then a ConvNeXt block."""

    def __init__(self, factor: int, dim: int, dtype=jnp.float32):
        self.conv = Conv(factor, dim, dim, dtype=dtype)
        self.convnext = ConvNeXt(dim, dtype)


class VocoderBlock(nnx.Module):
    """Snake -> transposed conv (k = 2r, stride r, channels halved) -> the residual units."""

    def __init__(self, rate: int, cin: int, cout: int, dtype=jnp.float32):
        self.snake = Snake(cin, dtype)
        self.conv = Conv(2 * rate, cin, cout, dtype=dtype)
        self.units = nnx.List([ResidualUnit(cout, dtype) for _ in RESIDUAL_DILATIONS])


class Vocoder(nnx.Module):
    def __init__(self, d: CodecDecoderConfig, dtype=jnp.float32):
        self.conv_in = Conv(7, d.latent_dim, d.decoder_dim, dtype=dtype)
        self.blocks = nnx.List([VocoderBlock(rate, d.decoder_dim >> b, d.decoder_dim >> (b + 1), dtype)
                                for b, rate in enumerate(d.upsample_rates)])
        out = d.decoder_dim >> len(d.upsample_rates)
        self.snake_out = Snake(out, dtype)
        self.conv_out = Conv(7, out, 1, dtype=dtype)


class CodecDecoder(nnx.Module):
    """The speech tokenizer's decoder weights: RVQ tables, pre-conv, transformer, upsampling, vocoder."""

    def __init__(self, cfg: CodecConfig, dtype=jnp.float32):
        d = cfg.decoder
        self.quantizer = Quantizer(d, dtype)
        self.pre_conv = Conv(3, d.codebook_dim, d.latent_dim, dtype=dtype)
        self.transformer = CodecTransformer(d, dtype)
        self.upsample = nnx.List([UpsampleStage(f, d.latent_dim, dtype) for f in d.upsampling_ratios])
        self.vocoder = Vocoder(d, dtype)


@functools.partial(jax.jit, static_argnums=1)
def decode(params: dict, cfg: CodecConfig, codes: jax.Array) -> jax.Array:
    """Full (single-pass) decode: int codes [B, T, Q] in [0, codebook_size) -> float32 audio [B, T * 1920].
    ``params``: a `CodecDecoder`'s state (`nn.split`)."""
    d = cfg.decoder
    if codes.shape[-1] != d.num_quantizers:
        raise ValueError(f"expected {d.num_quantizers} codebooks in the last axis, got shape {codes.shape}")
    m: CodecDecoder = nn.merge(nn.graph_of(CodecDecoder, cfg), params)
    x = dequantize(m.quantizer, codes)
    x = causal_conv(x, m.pre_conv)
    x = _transformer(m.transformer, d, x)
    for stage, factor in zip(m.upsample, d.upsampling_ratios):
        x = causal_conv_transpose(x, stage.conv, factor)
        x = convnext(x, stage.convnext)
    x = _vocoder(m.vocoder, d, x)
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


def _transformer(p: CodecTransformer, d: CodecDecoderConfig, x: jax.Array) -> jax.Array:
    """latent -> hidden, the layer stack as one scan, final RMSNorm, hidden -> latent."""
    t = x.shape[1]
    cos, sin = rope_tables(d, np.arange(t))
    distance = np.arange(t)[:, None] - np.arange(t)[None, :]
    mask = (distance >= 0) & (distance < d.sliding_window)  # window counts the query itself

    def step(layer, h):
        return transformer_layer(h, layer, d, cos, sin, mask)[0], None

    x, _ = nn.scan(p.layers, step, p.input_proj(x))
    return p.output_proj(rms_norm(x, p.norm[...], d.rms_norm_eps))


def _vocoder(p: Vocoder, d: CodecDecoderConfig, x: jax.Array) -> jax.Array:
    """Conv in, then per rate r: Snake -> transposed conv (k=2r, stride r, channels halved) -> 3 dilated
    residual units; then Snake -> conv to one channel. Blocks differ in width, so the loop is unrolled."""
    x = causal_conv(x, p.conv_in)
    for block, rate in zip(p.blocks, d.upsample_rates):
        x = causal_conv_transpose(snake(x, block.snake), block.conv, rate)
        for unit, dilation in zip(block.units, RESIDUAL_DILATIONS):
            x = residual_unit(x, unit, dilation)
    return causal_conv(snake(x, p.snake_out), p.conv_out)
