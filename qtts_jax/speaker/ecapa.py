"""ECAPA-TDNN speaker encoder forward pass (channels last) and the audio -> x-vector entry point.

Every conv of the reference is ``Conv1d(padding="same", padding_mode="reflect")``: reflect padding of
dilation*(k-1) frames split floor/ceil, so the sequence must be longer than the widest one-sided pad.
There is no batch norm. The reference pools over every frame of the utterance with no padding; here the
audio is padded to a length bucket (one compilation serves every length in it) and the true frame count
T is traced: convs reflect at frame T, and every reduction over time (SE means, pooling statistics, the
attention softmax) sees only the first T frames, so the result is the reference's up to float rounding.
Frames past T carry finite, meaningless values that nothing reads.

`SpeakerEncoder` is the `nnx.Module` of its weights; the jitted forward takes its state as a plain pytree
(`nn.split`) and rebuilds the module at trace time from the config's graph definition (`graph`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qtts_jax import nn
from qtts_jax.nn import Conv
from qtts_jax.speaker.config import SpeakerEncoderConfig
from qtts_jax.speaker.mel import HOP, N_FFT, PAD, log_mel, num_frames, reflect_pad

STATS_EPS = 1e-12  # AttentiveStatisticsPooling clamps the variance to this before the square root
BUCKET_FRAMES = 64  # the smallest length bucket, in hops; each next bucket doubles it


class SqueezeExcite(nnx.Module):
    def __init__(self, channels: int, hidden: int, dtype=jnp.float32):
        self.conv1, self.conv2 = Conv(1, channels, hidden, dtype=dtype), Conv(1, hidden, channels, dtype=dtype)


class SERes2NetBlock(nnx.Module):
    """TDNN, the Res2Net's scale-1 sub-convs (stacked on a leading axis), TDNN, squeeze-excitation."""

    def __init__(self, cfg: SpeakerEncoderConfig, cin: int, channels: int, kernel: int, dtype=jnp.float32):
        sub = channels // cfg.enc_res2net_scale
        self.tdnn1 = Conv(1, cin, channels, dtype=dtype)
        self.res2net = nn.stacked(cfg.enc_res2net_scale - 1, lambda: Conv(kernel, sub, sub, dtype=dtype))
        self.tdnn2 = Conv(1, channels, channels, dtype=dtype)
        self.se = SqueezeExcite(channels, cfg.enc_se_channels, dtype)


class AttentivePool(nnx.Module):
    def __init__(self, cfg: SpeakerEncoderConfig, dtype=jnp.float32):
        channels = cfg.enc_channels[-1]
        self.tdnn = Conv(1, 3 * channels, cfg.enc_attention_channels, dtype=dtype)
        self.conv = Conv(1, cfg.enc_attention_channels, channels, dtype=dtype)


class SpeakerEncoder(nnx.Module):
    """ECAPA-TDNN: input TDNN, SE-Res2Net blocks, multi-layer feature aggregation, attentive statistics pooling,
    and the final 1x1 conv to the x-vector."""

    def __init__(self, cfg: SpeakerEncoderConfig, dtype=jnp.float32):
        ch, ks = cfg.enc_channels, cfg.enc_kernel_sizes
        self.tdnn = Conv(ks[0], cfg.mel_dim, ch[0], dtype=dtype)
        self.blocks = nnx.List([SERes2NetBlock(cfg, ch[j - 1], ch[j], ks[j], dtype)
                                for j in range(1, cfg.num_blocks + 1)])
        self.mfa = Conv(ks[-1], ch[-1], ch[-1], dtype=dtype)
        self.asp = AttentivePool(cfg, dtype)
        self.fc = Conv(1, 2 * ch[-1], cfg.enc_dim, dtype=dtype)


def conv(p: Conv, x: jnp.ndarray, frames=None, dilation: int = 1) -> jnp.ndarray:
    """[T, Cin] -> [T, Cout] with reflect 'same' padding at the ends of the first ``frames`` rows (default
    all; may be traced)."""
    return _conv(p.w[...], p.b[...], x, frames, dilation)


def _conv(w: jnp.ndarray, b: jnp.ndarray, x: jnp.ndarray, frames, dilation: int) -> jnp.ndarray:
    k = w.shape[0]
    total = dilation * (k - 1)
    if total:
        x = reflect_pad(x, total // 2, total - total // 2, x.shape[0] if frames is None else frames)
    y = jax.lax.conv_general_dilated(
        x[None], w, window_strides=(1,), padding="VALID", rhs_dilation=(dilation,),
        dimension_numbers=("NWC", "WIO", "NWC"),
    )[0]
    return y + b


def tdnn(p: Conv, x: jnp.ndarray, frames=None, dilation: int = 1) -> jnp.ndarray:
    return jax.nn.relu(conv(p, x, frames, dilation))


def _valid(x: jnp.ndarray, frames) -> jnp.ndarray:
    """[T, 1] bool: which rows of ``x`` are the utterance's."""
    return (jnp.arange(x.shape[0]) < frames)[:, None]


def se_res2net(p: SERes2NetBlock, x: jnp.ndarray, frames, scale: int, dilation: int) -> jnp.ndarray:
    """TDNN -> Res2Net (chunk i>0 convolved after adding the previous chunk's output) -> TDNN -> SE, plus x."""
    h = tdnn(p.tdnn1, x)
    chunks = jnp.split(h, scale, axis=-1)
    outs = [chunks[0]]
    for i in range(1, scale):
        x_i = chunks[i] if i == 1 else chunks[i] + outs[-1]
        outs.append(jax.nn.relu(_conv(p.res2net.w[i - 1], p.res2net.b[i - 1], x_i, frames, dilation)))
    h = tdnn(p.tdnn2, jnp.concatenate(outs, axis=-1))
    gate = jnp.sum(jnp.where(_valid(h, frames), h, 0), axis=0, keepdims=True) / jnp.asarray(frames, h.dtype)
    gate = jax.nn.sigmoid(conv(p.se.conv2, jax.nn.relu(conv(p.se.conv1, gate))))
    return h * gate + x


def _weighted_stats(x: jnp.ndarray, w: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Per-channel mean and std over time under weights ``w`` [T, C or 1] that sum to 1 (variance clamped)."""
    mean = jnp.sum(w * x, axis=0)
    var = jnp.sum(w * (x - mean) ** 2, axis=0)
    return mean, jnp.sqrt(jnp.maximum(var, STATS_EPS))


def attentive_stats_pool(p: AttentivePool, x: jnp.ndarray, frames) -> jnp.ndarray:
    """[T, C] -> [2C]: attention-weighted mean and std over the first ``frames`` rows, the attention also
    seeing their global mean and std.

    As the reference does: the global statistics weigh each frame mask / total (1/T, 0 past the utterance),
    and the attention scores of frames past it are -inf before the softmax.
    """
    valid = _valid(x, frames)
    mean, std = _weighted_stats(x, jnp.where(valid, 1 / jnp.asarray(frames, x.dtype), 0))
    context = jnp.concatenate([x, jnp.broadcast_to(mean, x.shape), jnp.broadcast_to(std, x.shape)], axis=-1)
    scores = conv(p.conv, jnp.tanh(tdnn(p.tdnn, context)))
    mean, std = _weighted_stats(x, jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=0))
    return jnp.concatenate([mean, std])


def encode(params: dict, cfg: SpeakerEncoderConfig, mel: jnp.ndarray, frames) -> jnp.ndarray:
    """Log-mel [T_max, mel_dim] whose first ``frames`` rows (may be traced) are the utterance -> x-vector [enc_dim].
    ``params``: a `SpeakerEncoder`'s state (`nn.split`)."""
    m: SpeakerEncoder = nn.merge(nn.graph_of(SpeakerEncoder, cfg), params)
    h = tdnn(m.tdnn, mel, frames, cfg.enc_dilations[0])
    outs = []
    for i, block in enumerate(m.blocks):
        h = se_res2net(block, h, frames, cfg.enc_res2net_scale, cfg.enc_dilations[i + 1])
        outs.append(h)
    h = tdnn(m.mfa, jnp.concatenate(outs, axis=-1), frames, cfg.enc_dilations[-1])
    pooled = attentive_stats_pool(m.asp, h, frames)
    return conv(m.fc, pooled[None])[0]


@functools.partial(jax.jit, static_argnames="cfg")
def _embed(params: dict, cfg: SpeakerEncoderConfig, wav: jnp.ndarray, length: jnp.ndarray) -> jnp.ndarray:
    """Audio ``wav[:length]`` in a bucket-sized buffer -> x-vector; ``length`` is traced (no recompile)."""
    # The reference casts the fp32 mel to the model dtype before the encoder.
    mel = log_mel(wav, length).astype(params["fc"]["w"].dtype)
    return encode(params, cfg, mel, num_frames(length)).astype(jnp.float32)


def bucket_samples(num_samples: int) -> int:
    """Length the audio is zero-padded to before the compiled encoder: the smallest BUCKET_FRAMES * 2^k hops
    that hold it. One compilation per bucket: 1-30 s at 24 kHz takes 6 (32768 ... 1048576 samples); above
    the smallest bucket the encoder runs on less than twice the audio's frames."""
    frames = BUCKET_FRAMES
    while frames * HOP < num_samples:
        frames *= 2
    return frames * HOP


def min_samples(cfg: SpeakerEncoderConfig) -> int:
    """Shortest audio the reference accepts: reflect padding needs more frames than its widest pad."""
    widest = max(d * (k - 1) - d * (k - 1) // 2 for k, d in zip(cfg.enc_kernel_sizes, cfg.enc_dilations))
    return max(PAD + 1, widest * HOP + N_FFT - 2 * PAD)  # the STFT's reflect pad needs N > PAD too


def speaker_embedding(params: dict, cfg: SpeakerEncoderConfig, wav: np.ndarray) -> np.ndarray:
    """Mono 24 kHz float audio [N] -> x-vector [enc_dim] float32 (compiled once per ``bucket_samples(N)``).

    What the reference's ``extract_speaker_embedding(audio, sr=24000)`` returns; resample other rates first.
    """
    wav = np.asarray(wav, dtype=np.float32)
    if wav.ndim != 1:
        raise ValueError(f"expected mono audio [N], got shape {wav.shape}")
    if wav.shape[0] < min_samples(cfg):
        raise ValueError(f"audio of {wav.shape[0]} samples is too short: the encoder needs at least "
                         f"{min_samples(cfg)} ({min_samples(cfg) / cfg.sample_rate * 1000:.0f} ms)")
    n = wav.shape[0]
    padded = np.zeros(bucket_samples(n), np.float32)
    padded[:n] = wav
    return np.asarray(_embed(params, cfg, jnp.asarray(padded), np.int32(n)))
