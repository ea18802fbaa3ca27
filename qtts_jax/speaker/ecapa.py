"""ECAPA-TDNN speaker encoder forward pass (channels last) and the audio -> x-vector entry point.

Every conv of the reference is ``Conv1d(padding="same", padding_mode="reflect")``: reflect padding of
dilation*(k-1) frames split floor/ceil, so the sequence must be longer than the widest one-sided pad.
There is no batch norm. Pooling sees every frame of the utterance: no padding or masking.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from qtts_jax.speaker.config import SpeakerEncoderConfig
from qtts_jax.speaker.mel import HOP, N_FFT, PAD, log_mel

STATS_EPS = 1e-12  # AttentiveStatisticsPooling clamps the variance to this before the square root


def conv(p: dict, x: jnp.ndarray, dilation: int = 1) -> jnp.ndarray:
    """[T, Cin] -> [T, Cout] with reflect 'same' padding; ``p["w"]`` is (k, Cin, Cout)."""
    k = p["w"].shape[0]
    total = dilation * (k - 1)
    if total:
        x = jnp.pad(x, ((total // 2, total - total // 2), (0, 0)), mode="reflect")
    y = jax.lax.conv_general_dilated(
        x[None], p["w"], window_strides=(1,), padding="VALID", rhs_dilation=(dilation,),
        dimension_numbers=("NWC", "WIO", "NWC"),
    )[0]
    return y + p["b"]


def tdnn(p: dict, x: jnp.ndarray, dilation: int = 1) -> jnp.ndarray:
    return jax.nn.relu(conv(p, x, dilation))


def se_res2net(p: dict, x: jnp.ndarray, scale: int, dilation: int) -> jnp.ndarray:
    """TDNN -> Res2Net (chunk i>0 convolved after adding the previous chunk's output) -> TDNN -> SE, plus x."""
    h = tdnn(p["tdnn1"], x)
    chunks = jnp.split(h, scale, axis=-1)
    outs = [chunks[0]]
    for i in range(1, scale):
        sub = jax.tree.map(lambda a: a[i - 1], p["res2net"])
        outs.append(tdnn(sub, chunks[i] if i == 1 else chunks[i] + outs[-1], dilation))
    h = tdnn(p["tdnn2"], jnp.concatenate(outs, axis=-1))
    gate = jnp.mean(h, axis=0, keepdims=True)
    gate = jax.nn.sigmoid(conv(p["se"]["conv2"], jax.nn.relu(conv(p["se"]["conv1"], gate))))
    return h * gate + x


def _weighted_stats(x: jnp.ndarray, w: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Per-channel mean and std over time under weights ``w`` [T, C] that sum to 1 (variance clamped)."""
    mean = jnp.sum(w * x, axis=0)
    var = jnp.sum(w * (x - mean) ** 2, axis=0)
    return mean, jnp.sqrt(jnp.maximum(var, STATS_EPS))


def attentive_stats_pool(p: dict, x: jnp.ndarray) -> jnp.ndarray:
    """[T, C] -> [2C]: attention-weighted mean and std, the attention also seeing the global mean and std.

    The global statistics use uniform weights 1/T, as the reference does (its mask / total).
    """
    t = x.shape[0]
    mean, std = _weighted_stats(x, jnp.full_like(x, 1.0 / t))
    context = jnp.concatenate([x, jnp.broadcast_to(mean, x.shape), jnp.broadcast_to(std, x.shape)], axis=-1)
    scores = conv(p["conv"], jnp.tanh(tdnn(p["tdnn"], context)))
    mean, std = _weighted_stats(x, jax.nn.softmax(scores, axis=0))
    return jnp.concatenate([mean, std])


def encode(params: dict, cfg: SpeakerEncoderConfig, mel: jnp.ndarray) -> jnp.ndarray:
    """Log-mel [T, mel_dim] -> x-vector [enc_dim]."""
    h = tdnn(params["tdnn"], mel, cfg.enc_dilations[0])
    outs = []
    for i, block in enumerate(params["blocks"]):
        h = se_res2net(block, h, cfg.enc_res2net_scale, cfg.enc_dilations[i + 1])
        outs.append(h)
    h = tdnn(params["mfa"], jnp.concatenate(outs, axis=-1), cfg.enc_dilations[-1])
    pooled = attentive_stats_pool(params["asp"], h)
    return conv(params["fc"], pooled[None])[0]


@functools.partial(jax.jit, static_argnames="cfg")
def _embed(params: dict, cfg: SpeakerEncoderConfig, wav: jnp.ndarray) -> jnp.ndarray:
    # The reference casts the fp32 mel to the model dtype before the encoder.
    mel = log_mel(wav).astype(params["fc"]["w"].dtype)
    return encode(params, cfg, mel).astype(jnp.float32)


def min_samples(cfg: SpeakerEncoderConfig) -> int:
    """Shortest audio the reference accepts: reflect padding needs more frames than its widest pad."""
    widest = max(d * (k - 1) - d * (k - 1) // 2 for k, d in zip(cfg.enc_kernel_sizes, cfg.enc_dilations))
    return max(PAD + 1, widest * HOP + N_FFT - 2 * PAD)  # the STFT's reflect pad needs N > PAD too


def speaker_embedding(params: dict, cfg: SpeakerEncoderConfig, wav: np.ndarray) -> np.ndarray:
    """Mono 24 kHz float audio [N] -> x-vector [enc_dim] float32 (compiled once per length N).

    What the reference's ``extract_speaker_embedding(audio, sr=24000)`` returns; resample other rates first.
    """
    wav = np.asarray(wav, dtype=np.float32)
    if wav.ndim != 1:
        raise ValueError(f"expected mono audio [N], got shape {wav.shape}")
    if wav.shape[0] < min_samples(cfg):
        raise ValueError(f"audio of {wav.shape[0]} samples is too short: the encoder needs at least "
                         f"{min_samples(cfg)} ({min_samples(cfg) / cfg.sample_rate * 1000:.0f} ms)")
    return np.asarray(_embed(params, cfg, jnp.asarray(wav)))
