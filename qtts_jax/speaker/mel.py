"""Log-mel front end of the speaker encoder, as the reference's ``mel_spectrogram`` computes it.

The reference (``extract_speaker_embedding``) hard-codes these parameters rather than reading the config:
reflect-pad (n_fft - hop) / 2 on both sides, STFT without centring and a periodic Hann window,
magnitude sqrt(re² + im² + 1e-9), a Slaney-normalised Slaney-scale mel filterbank (librosa's default),
then log(max(x, 1e-5)).

The audio may sit at the start of a longer buffer (a length bucket, so one compilation serves many
lengths): the true sample count is a traced value and the end padding reflects at it, so every frame of
the true audio equals the one the reference computes from the audio alone.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from qtts_jax.codec.config import SAMPLE_RATE

N_FFT = 1024
HOP = 256
N_MELS = 128
FMIN = 0.0
FMAX = 12000.0
MAGNITUDE_EPS = 1e-9  # added to re² + im² before the square root
LOG_FLOOR = 1e-5  # clamp before the log
PAD = (N_FFT - HOP) // 2


def num_frames(num_samples):
    """Frames the STFT yields for ``num_samples`` samples (after the reflect padding); int or traced int."""
    return (num_samples + 2 * PAD - N_FFT) // HOP + 1


def reflect_pad(x: jnp.ndarray, left: int, right: int, length) -> jnp.ndarray:
    """Rows [0, length) of ``x`` [L, ...] reflect-padded as torch's ``mode="reflect"`` does (edge row not
    repeated) by ``left`` rows before and ``right`` after, in a buffer of L + left + right rows.

    ``length`` may be traced (a gather, not a slice): rows past length + left + right are clamped copies,
    finite and meaningless. Needs length > max(left, right), as torch does.
    """
    i = jnp.abs(jnp.arange(x.shape[0] + left + right) - left)
    last = length - 1
    return jnp.take(x, last - jnp.abs(last - i), axis=0, mode="clip")


def log_mel(wav: jnp.ndarray, length) -> jnp.ndarray:
    """Mono audio ``wav[:length]`` (float32, 24 kHz, length > PAD) in a buffer ``wav`` [L]
    -> log-mel [num_frames(L), 128], channels last.

    The first ``num_frames(length)`` frames are the log-mel of ``wav[:length]``; the rest are meaningless.
    """
    y = reflect_pad(wav, PAD, PAD, length)
    t = num_frames(wav.shape[0])
    # n_fft is a whole number of hops, so frames are hop-sized blocks side by side: no gather needed.
    per_frame = N_FFT // HOP
    blocks = y[: (t + per_frame - 1) * HOP].reshape(-1, HOP)
    frames = jnp.concatenate([blocks[i : i + t] for i in range(per_frame)], axis=1)
    spec = jnp.fft.rfft(frames * jnp.asarray(_hann(N_FFT)), axis=-1)
    magnitude = jnp.sqrt(jnp.real(spec) ** 2 + jnp.imag(spec) ** 2 + MAGNITUDE_EPS)
    mel = magnitude @ jnp.asarray(_basis().T)
    return jnp.log(jnp.maximum(mel, LOG_FLOOR))


@functools.cache
def _basis() -> np.ndarray:
    return mel_filterbank(SAMPLE_RATE, N_FFT, N_MELS, FMIN, FMAX)


def _hann(n: int) -> np.ndarray:
    """Periodic Hann (torch.hann_window's default), computed in float64."""
    return (0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)).astype(np.float32)


def mel_filterbank(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """[n_mels, 1 + n_fft // 2] float32: what librosa.filters.mel(htk=False, norm="slaney") returns.

    Triangles between consecutive Slaney-mel-spaced edge frequencies, each scaled by 2 / its width in Hz
    (equal area). Computed in float64 with librosa's intermediate rounding of the triangles to float32,
    so the result is bit-identical to librosa's rather than one ulp off in places.
    """
    edges = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    bins = np.linspace(0.0, sr / 2, 1 + n_fft // 2)
    rising = (bins - edges[:-2, None]) / np.diff(edges)[:-1, None]
    falling = (edges[2:, None] - bins) / np.diff(edges)[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)
    return (weights * (2.0 / (edges[2:] - edges[:-2]))[:, None]).astype(np.float32)


# Slaney's Auditory Toolbox mel scale: linear (200/3 Hz per mel) below 1 kHz, logarithmic above.
_F_SP = 200.0 / 3
_LOG_HZ = 1000.0
_LOG_MEL = _LOG_HZ / _F_SP
_LOG_STEP = np.log(6.4) / 27.0


def _hz_to_mel(hz):
    hz = np.asarray(hz, dtype=np.float64)
    return np.where(hz >= _LOG_HZ, _LOG_MEL + np.log(np.maximum(hz, _LOG_HZ) / _LOG_HZ) / _LOG_STEP, hz / _F_SP)


def _mel_to_hz(mel):
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel >= _LOG_MEL, _LOG_HZ * np.exp(_LOG_STEP * (mel - _LOG_MEL)), _F_SP * mel)
