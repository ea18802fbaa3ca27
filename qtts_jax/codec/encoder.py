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
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qtts_jax.codec.config import CodecConfig, CodecEncoderConfig
from qtts_jax.codec.layers import CONV_DIMS, attention, layer_norm, rope_tables


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
    return np.asarray(codes[: -(-n // cfg.encoder.frame_size)])


def encode_latents(params: dict, cfg: CodecConfig, wav: np.ndarray, bucket_frames: int | None = 16) -> EncoderActivations:
    """The continuous activations `encode` quantizes (for parity tests), cut to the clip's length."""
    n, seanet, transformer, latent, _ = _run(params, cfg, wav, bucket_frames)
    e = cfg.encoder
    steps, frames = -(-n // e.hop_length), -(-n // e.frame_size)
    return EncoderActivations(np.asarray(seanet[:steps]), np.asarray(transformer[:steps]), np.asarray(latent[:frames]))


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
    latent (each [steps, hidden]), and codes [frames, Q]."""
    e = cfg.encoder
    seanet, steps = _seanet(params["seanet"], e, wav[None, :, None], n)
    hidden = _transformer(params["transformer"], e, seanet)
    latent = _conv(hidden, params["downsample"], "replicate", stride=2, valid=steps)
    return seanet[0], hidden[0], latent[0], _quantize(params["quantizer"], e, latent[0])


def _fill_tail(x: jax.Array, valid: jax.Array, pad_mode: str) -> jax.Array:
    """Steps >= ``valid`` become what Mimi would pad there: zeros, or a copy of the last valid step."""
    fill = 0.0 if pad_mode == "constant" else lax.dynamic_slice_in_dim(x, valid - 1, 1, axis=1)
    return jnp.where((jnp.arange(x.shape[1]) < valid)[None, :, None], x, fill)


def _conv(x: jax.Array, p: dict, pad_mode: str, stride: int = 1, dilation: int = 1, valid=None) -> jax.Array:
    """``MimiConv1d`` (causal): left padding k_eff - stride, right padding up to a whole number of strides,
    so T steps give ceil(T / stride). A strided conv first fills the steps past ``valid`` (see module doc);
    a stride-1 conv has no right padding and needs no fill."""
    k_eff = (p["w"].shape[0] - 1) * dilation + 1
    length = x.shape[1]
    if stride > 1:
        x = _fill_tail(x, valid, pad_mode)
    pads = ((0, 0), (k_eff - stride, -length % stride), (0, 0))
    x = jnp.pad(x, pads, mode="constant" if pad_mode == "constant" else "edge")
    y = lax.conv_general_dilated(x, p["w"], (stride,), "VALID", rhs_dilation=(dilation,), dimension_numbers=CONV_DIMS)
    return y + p["b"] if "b" in p else y


def _seanet(p: dict, e: CodecEncoderConfig, x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Conv in; per stride r (the ratios reversed): residual blocks (ELU -> conv k3 dilated, channels
    halved -> ELU -> conv k1 back, plus identity), then ELU -> conv k=2r stride r, channels doubled;
    ELU -> conv out to hidden. Returns the output and its number of valid steps."""
    mode = e.pad_mode
    x = _conv(x, p["conv_in"], mode)
    valid = n
    for stage, ratio in zip(p["stages"], reversed(e.upsampling_ratios)):
        for j, block in enumerate(stage["blocks"]):
            h = _conv(jax.nn.elu(x), block["conv1"], mode, dilation=e.dilation_growth_rate**j)
            x = x + _conv(jax.nn.elu(h), block["conv2"], mode)
        x = _conv(jax.nn.elu(x), stage["down"], mode, stride=ratio, valid=valid)
        valid = -(-valid // ratio)
    return _conv(jax.nn.elu(x), p["conv_out"], mode), valid


def _transformer(p: dict, e: CodecEncoderConfig, x: jax.Array) -> jax.Array:
    """Pre-LayerNorm layers with LayerScale'd residuals and no final norm. Attention is plain causal over
    all past steps: the reference never applies the config's sliding window (see `CodecEncoderConfig`)."""
    t = x.shape[1]
    cos, sin = rope_tables(e, np.arange(t))
    mask = np.tril(np.ones((t, t), bool))

    def layer(h, lp):
        attended, _ = attention(layer_norm(h, lp["attn_norm"], e.norm_eps), lp, e, cos, sin, mask)
        h = h + lp["attn_scale"] * attended
        m = layer_norm(h, lp["mlp_norm"], e.norm_eps)
        return h + lp["mlp_scale"] * (jax.nn.gelu(m @ lp["fc1"], approximate=False) @ lp["fc2"]), None

    return lax.scan(layer, x, p["layers"])[0]


def _quantize(p: dict, e: CodecEncoderConfig, latent: jax.Array) -> jax.Array:
    """Split RVQ: the semantic and the acoustic RVQ each quantize the *same* latent (through their own
    projection); only within each RVQ does a codebook see the previous codebooks' residual."""
    n_sem = e.num_semantic_quantizers
    semantic = _rvq(latent @ p["semantic_proj"], p["codebooks"][:n_sem])
    acoustic = _rvq(latent @ p["acoustic_proj"], p["codebooks"][n_sem:])
    return jnp.concatenate([semantic, acoustic], axis=1)


def _rvq(x: jax.Array, codebooks: jax.Array) -> jax.Array:
    """x [T, D] -> codes [T, Q]: per codebook the nearest codeword by squared euclidean distance (|x|^2
    dropped: constant per row), then its subtraction from the residual."""

    def step(residual, book):
        distance = jnp.sum(book * book, axis=-1) - 2.0 * residual @ book.T
        code = jnp.argmin(distance, axis=-1).astype(jnp.int32)
        return residual - book[code], code

    return lax.scan(step, x, codebooks)[1].T
