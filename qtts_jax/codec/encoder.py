"""12 Hz speech-tokenizer encoder (HF ``MimiModel.encode`` as the reference calls it): 24 kHz audio -> codes.

Stages: SEANet causal conv encoder (ELU) to 25 Hz -> causal transformer (LayerNorm, LayerScale, exact
GELU) -> stride-2 conv to 12.5 Hz -> split RVQ, nearest codeword per codebook. The reference then keeps
the first ``encoder_valid_num_quantizers`` codebooks and ceil(n / 1920) frames.

Every stage is causal, so audio is padded on the right to a length bucket (one compilation per bucket,
not per length). What is not causal is Mimi's "extra padding": a strided conv pads its input on the right
up to a whole number of strides, with zeros (SEANet) or the last value (downsample), which reaches the
last output frame. Each strided conv therefore overwrites every step past the true input length with
that padding value before convolving, so a padded run computes exactly what an unpadded one does.
Activations are channels-last [1, T, C].

`CodecEncoder` is the `nnx.Module` of its weights; the jitted forward takes its state as a plain pytree
(`nn.split`) and rebuilds the module at trace time from the config's graph definition (`graph`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from qtts_jax import nn
from qtts_jax.codec.config import CodecConfig, CodecEncoderConfig
from qtts_jax.codec.layers import CONV_DIMS, Attention, LayerNorm, attention, layer_norm, rope_tables
from qtts_jax.nn import Conv, zeros


class ResidualBlock(nnx.Module):
    """ELU -> dilated conv (channels divided by ``compress``) -> ELU -> 1x1 conv back, plus the input."""

    def __init__(self, e: CodecEncoderConfig, width: int, dtype=jnp.float32):
        hidden = width // e.compress
        self.conv1 = Conv(e.residual_kernel_size, width, hidden, dtype=dtype)
        self.conv2 = Conv(1, hidden, width, dtype=dtype)


class SEANetStage(nnx.Module):
    """The residual blocks at one width, then the strided conv (k = 2r) that doubles the channels."""

    def __init__(self, e: CodecEncoderConfig, width: int, ratio: int, dtype=jnp.float32):
        self.blocks = nnx.List([ResidualBlock(e, width, dtype) for _ in range(e.num_residual_layers)])
        self.down = Conv(2 * ratio, width, 2 * width, dtype=dtype)


class SEANet(nnx.Module):
    def __init__(self, e: CodecEncoderConfig, dtype=jnp.float32):
        self.conv_in = Conv(e.kernel_size, 1, e.num_filters, dtype=dtype)
        widths = [e.num_filters << s for s in range(len(e.upsampling_ratios))]
        self.stages = nnx.List([SEANetStage(e, w, r, dtype) for w, r in zip(widths, reversed(e.upsampling_ratios))])
        self.conv_out = Conv(e.last_kernel_size, e.num_filters << len(e.upsampling_ratios), e.hidden_size,
                             dtype=dtype)


class EncoderLayer(Attention):
    """Pre-LayerNorm layer: `Attention` and a GELU MLP (fc1, fc2), both residuals LayerScale'd."""

    def __init__(self, e: CodecEncoderConfig, dtype=jnp.float32):
        super().__init__(e, dtype)
        h = e.hidden_size
        self.fc1, self.fc2 = zeros((h, e.intermediate_size), dtype), zeros((e.intermediate_size, h), dtype)
        self.attn_norm, self.mlp_norm = LayerNorm(h, dtype), LayerNorm(h, dtype)


class EncoderTransformer(nnx.Module):
    def __init__(self, e: CodecEncoderConfig, dtype=jnp.float32):
        self.layers = nn.stacked(e.num_hidden_layers, lambda: EncoderLayer(e, dtype))


class EncoderQuantizer(nnx.Module):
    """The split RVQ: the semantic and the acoustic input projections [H, D] (the identity where Mimi has none)
    and every codebook table [Q, V, D] (sums divided by usage), semantic first."""

    def __init__(self, cfg: CodecConfig, dtype=jnp.float32):
        e = cfg.encoder
        self.semantic_proj = zeros((e.hidden_size, e.codebook_dim), dtype)
        self.acoustic_proj = zeros((e.hidden_size, e.codebook_dim), dtype)
        self.codebooks = zeros((cfg.encoder_valid_num_quantizers, e.codebook_size, e.codebook_dim), dtype)


class CodecEncoder(nnx.Module):
    """The speech tokenizer's encoder weights: SEANet, transformer, downsampling conv, split RVQ."""

    def __init__(self, cfg: CodecConfig, dtype=jnp.float32):
        e = cfg.encoder
        if e is None:
            raise ValueError("this speech tokenizer config has no encoder_config")
        self.seanet = SEANet(e, dtype)
        self.transformer = EncoderTransformer(e, dtype)
        self.downsample = Conv(e.downsample_kernel, e.hidden_size, e.hidden_size, bias=False, dtype=dtype)
        self.quantizer = EncoderQuantizer(cfg, dtype)


class EncoderActivations(NamedTuple):
    """Continuous activations of one clip: SEANet and transformer outputs [ceil(n / hop), hidden] at 25 Hz,
    and the pre-quantization latent [ceil(n / frame_size), hidden] at 12.5 Hz."""

    seanet: np.ndarray
    transformer: np.ndarray
    latent: np.ndarray


def encode(params: dict, cfg: CodecConfig, wav: np.ndarray, bucket_frames: int | None = 16) -> np.ndarray:
    """1-D float 24 kHz mono audio -> int32 codes [ceil(n / 1920), encoder_valid_num_quantizers].

    The audio is zero-padded to a power-of-two number of frames, at least ``bucket_frames`` (None: not
    padded, one compilation per length); the result is the same either way. Six compilations cover
    every clip up to 40 s, and the padding costs little: the encoder is cheap next to a compilation.
    """
    n, _, _, _, codes = _run(params, cfg, wav, bucket_frames)
    return np.asarray(codes)[: -(-n // cfg.encoder.frame_size)]  # cut on the host: no program per length


def encode_latents(params: dict, cfg: CodecConfig, wav: np.ndarray, bucket_frames: int | None = 16) -> EncoderActivations:
    """The continuous activations `encode` quantizes (for parity tests), cut to the clip's length."""
    n, seanet, transformer, latent, _ = _run(params, cfg, wav, bucket_frames)
    e = cfg.encoder
    steps, frames = -(-n // e.hop_length), -(-n // e.frame_size)
    return EncoderActivations(np.asarray(seanet)[:steps], np.asarray(transformer)[:steps], np.asarray(latent)[:frames])


def _run(params: dict, cfg: CodecConfig, wav: np.ndarray, bucket_frames: int | None):
    if cfg.encoder is None:
        raise ValueError("this speech tokenizer config has no encoder_config")
    wav = np.asarray(wav, np.float32)
    if wav.ndim != 1 or wav.size == 0:
        raise ValueError(f"expected non-empty 1-D mono audio, got shape {wav.shape}")
    n = wav.size
    if bucket_frames is not None:
        frames = max(bucket_frames, -(-n // cfg.encoder.frame_size))
        wav = np.pad(wav, (0, (1 << (frames - 1).bit_length()) * cfg.encoder.frame_size - n))
    return (n, *_forward(params, cfg, jnp.asarray(wav), jnp.int32(n)))


@functools.partial(jax.jit, static_argnums=1)
def _forward(params: dict, cfg: CodecConfig, wav: jax.Array, n: jax.Array):
    """``wav`` [L] holds ``n`` real samples then padding. Returns SEANet output, transformer output and
    latent (each [steps, hidden]), and codes [frames, Q]. ``params``: a `CodecEncoder`'s state (`nn.split`)."""
    e = cfg.encoder
    m: CodecEncoder = nn.merge(nn.graph_of(CodecEncoder, cfg), params)
    seanet, steps = _seanet(m.seanet, e, wav[None, :, None], n)
    hidden = _transformer(m.transformer, e, seanet)
    latent = _conv(hidden, m.downsample, "replicate", stride=2, valid=steps)
    return seanet[0], hidden[0], latent[0], _quantize(m.quantizer, e, latent[0])


def _fill_tail(x: jax.Array, valid: jax.Array, pad_mode: str) -> jax.Array:
    """Steps >= ``valid`` become what Mimi would pad there: zeros, or a copy of the last valid step."""
    fill = 0.0 if pad_mode == "constant" else lax.dynamic_slice_in_dim(x, valid - 1, 1, axis=1)
    return jnp.where((jnp.arange(x.shape[1]) < valid)[None, :, None], x, fill)


def _conv(x: jax.Array, p: Conv, pad_mode: str, stride: int = 1, dilation: int = 1, valid=None) -> jax.Array:
    """``MimiConv1d`` (causal): left padding k_eff - stride, right padding up to a whole number of strides,
    so T steps give ceil(T / stride). A strided conv first fills the steps past ``valid`` (see module doc);
    a stride-1 conv has no right padding and needs no fill."""
    k_eff = (p.w.shape[0] - 1) * dilation + 1
    length = x.shape[1]
    if stride > 1:
        x = _fill_tail(x, valid, pad_mode)
    pads = ((0, 0), (k_eff - stride, -length % stride), (0, 0))
    x = jnp.pad(x, pads, mode="constant" if pad_mode == "constant" else "edge")
    y = lax.conv_general_dilated(x, p.w[...], (stride,), "VALID", rhs_dilation=(dilation,),
                                 dimension_numbers=CONV_DIMS)
    return y if p.b is None else y + p.b[...]


def _seanet(p: SEANet, e: CodecEncoderConfig, x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Conv in; per stride r (the ratios reversed): residual blocks (ELU -> conv k3 dilated, channels
    halved -> ELU -> conv k1 back, plus identity), then ELU -> conv k=2r stride r, channels doubled;
    ELU -> conv out to hidden. Returns the output and its number of valid steps."""
    mode = e.pad_mode
    x = _conv(x, p.conv_in, mode)
    valid = n
    for stage, ratio in zip(p.stages, reversed(e.upsampling_ratios)):
        for j, block in enumerate(stage.blocks):
            h = _conv(jax.nn.elu(x), block.conv1, mode, dilation=e.dilation_growth_rate**j)
            x = x + _conv(jax.nn.elu(h), block.conv2, mode)
        x = _conv(jax.nn.elu(x), stage.down, mode, stride=ratio, valid=valid)
        valid = -(-valid // ratio)
    return _conv(jax.nn.elu(x), p.conv_out, mode), valid


def _transformer(p: EncoderTransformer, e: CodecEncoderConfig, x: jax.Array) -> jax.Array:
    """Pre-LayerNorm layers with LayerScale'd residuals and no final norm. Attention is plain causal over
    all past steps: the reference never applies the config's sliding window (see `CodecEncoderConfig`)."""
    t = x.shape[1]
    cos, sin = rope_tables(e, np.arange(t))
    mask = np.tril(np.ones((t, t), bool))

    def layer(lp: EncoderLayer, h):
        attended, _ = attention(layer_norm(h, lp.attn_norm, e.norm_eps), lp, e, cos, sin, mask)
        h = h + lp.attn_scale[...] * attended
        m = layer_norm(h, lp.mlp_norm, e.norm_eps)
        return h + lp.mlp_scale[...] * (jax.nn.gelu(m @ lp.fc1[...], approximate=False) @ lp.fc2[...]), None

    return nn.scan(p.layers, layer, x)[0]


def _quantize(p: EncoderQuantizer, e: CodecEncoderConfig, latent: jax.Array) -> jax.Array:
    """Split RVQ: the semantic and the acoustic RVQ each quantize the *same* latent (through their own
    projection); only within each RVQ does a codebook see the previous codebooks' residual."""
    n_sem = e.num_semantic_quantizers
    semantic = _rvq(latent @ p.semantic_proj[...], p.codebooks[:n_sem])
    acoustic = _rvq(latent @ p.acoustic_proj[...], p.codebooks[n_sem:])
    return jnp.concatenate([semantic, acoustic], axis=1)


def _rvq(x: jax.Array, codebooks: jax.Array) -> jax.Array:
    """x [T, D] -> codes [T, Q]: per codebook the nearest codeword by squared euclidean distance (|x|^2
    dropped: constant per row), then its subtraction from the residual."""

    def step(residual, book):
        distance = jnp.sum(book * book, axis=-1) - 2.0 * residual @ book.T
        code = jnp.argmin(distance, axis=-1).astype(jnp.int32)
        return residual - book[code], code

    return lax.scan(step, x, codebooks)[1].T
