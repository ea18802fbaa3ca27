"""Reference audio for voice cloning: any common file or base64 string in, checked mono 24 kHz float32 out.

Decoding goes through PyAV (WAV, FLAC, MP3, OGG/Opus/Vorbis, M4A …), channels are averaged as the
reference wrapper does, and other rates are resampled with soxr at the quality librosa's default
(`soxr_hq`) uses, so a 16 kHz recording gives the same samples the reference would compute. Recordings
that would make a bad voice (too short, too long, silent, hard-clipped, non-finite) are refused with a
`RequestError` on the field ``audio`` instead of being cloned into something unusable.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
from pathlib import Path

import numpy as np

from qtts_jax.codec.config import SAMPLE_RATE
from qtts_jax.request import RequestError

FIELD = "audio"


@dataclasses.dataclass(frozen=True)
class AudioLimits:
    min_seconds: float = 1.0
    max_seconds: float = 30.0
    silence_rms: float = 1e-3  # -60 dBFS: nothing of a voice to clone below this
    full_scale: float = 0.999  # a sample this close to ±1 counts as clipped
    max_clipped_fraction: float = 0.01  # more than 1% clipped samples: distorted beyond repair


@dataclasses.dataclass(frozen=True)
class ReferenceAudio:
    samples: np.ndarray  # float32 mono at 24 kHz
    source_rate: int
    channels: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / SAMPLE_RATE


def load_reference_audio(source: bytes | str | Path, limits: AudioLimits = AudioLimits()) -> ReferenceAudio:
    """A file path, raw file bytes, or a base64 string (optionally a ``data:audio/...;base64,`` URL)."""
    if isinstance(source, Path):
        data = _read_file(source)
    elif isinstance(source, str):
        data = _from_text(source)
    else:
        data = bytes(source)
    samples, rate = decode_audio(data, max_seconds=limits.max_seconds)
    return prepare_reference(samples, rate, limits)


def prepare_reference(samples: np.ndarray, sample_rate: int, limits: AudioLimits = AudioLimits()) -> ReferenceAudio:
    """Samples [n] or [n, channels] at any rate -> checked mono 24 kHz."""
    x = np.asarray(samples, np.float32)
    if x.ndim not in (1, 2) or x.size == 0:
        raise RequestError(FIELD, "contains no audio samples")
    if not 1000 <= int(sample_rate) <= 384000:
        raise RequestError(FIELD, f"sample rate {sample_rate} Hz is not a plausible audio rate")
    channels = 1 if x.ndim == 1 else x.shape[1]
    if not np.all(np.isfinite(x)):
        raise RequestError(FIELD, "contains NaN or infinite samples")
    seconds = x.shape[0] / sample_rate
    if seconds < limits.min_seconds:
        raise RequestError(FIELD, f"is {seconds:.2f} s long; a voice needs at least {limits.min_seconds:g} s")
    if seconds > limits.max_seconds:
        raise RequestError(FIELD, f"is {seconds:.2f} s long; at most {limits.max_seconds:g} s is accepted "
                                  "(trim it to a few clean sentences)")
    clipped = float(np.mean(np.abs(x) >= limits.full_scale))
    if clipped > limits.max_clipped_fraction:
        raise RequestError(FIELD, f"is clipped: {clipped:.1%} of samples are at full scale (at most "
                                  f"{limits.max_clipped_fraction:.0%} allowed); record at a lower level")
    mono = x if x.ndim == 1 else x.mean(axis=1, dtype=np.float32)
    if sample_rate != SAMPLE_RATE:
        import soxr

        mono = soxr.resample(mono, sample_rate, SAMPLE_RATE, quality="HQ").astype(np.float32)
    rms = float(np.sqrt(np.mean(np.square(mono, dtype=np.float64))))
    if rms < limits.silence_rms:
        raise RequestError(FIELD, f"is silent (RMS {20 * np.log10(max(rms, 1e-12)):.0f} dBFS); "
                                  "record the speaker louder")
    return ReferenceAudio(samples=np.ascontiguousarray(mono), source_rate=int(sample_rate), channels=channels)


def decode_audio(data: bytes, max_seconds: float = 30.0) -> tuple[np.ndarray, int]:
    """File bytes -> (float32 samples [n, channels], rate). Stops early on audio far past ``max_seconds``."""
    import av

    if not data:
        raise RequestError(FIELD, "is empty")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise RequestError(FIELD, "has no audio stream")
            stream = container.streams.audio[0]
            rate = stream.codec_context.sample_rate or stream.rate
            channels = stream.codec_context.channels or 1
            # Packed float32 at the source rate and layout: the decoder's own format may be int or planar.
            convert = av.AudioResampler(format="flt", layout=stream.codec_context.layout, rate=rate)
            parts, total, limit = [], 0, int((max_seconds + 1) * rate)
            for frame in container.decode(stream):
                for out in convert.resample(frame):
                    part = out.to_ndarray().reshape(-1, channels)
                    parts.append(part)
                    total += len(part)
                if total > limit:
                    break
            for out in convert.resample(None):
                parts.append(out.to_ndarray().reshape(-1, channels))
    except RequestError:
        raise
    except (av.FFmpegError, ValueError, IndexError, EOFError) as exc:
        raise RequestError(FIELD, f"could not be decoded as audio (WAV, FLAC, MP3, OGG …): {exc}") from None
    if not parts or not rate:
        raise RequestError(FIELD, "contains no audio samples")
    return np.concatenate(parts).astype(np.float32, copy=False), int(rate)


def decode_base64_audio(s: str) -> bytes:
    """Base64 or a ``data:audio/...;base64,`` URL -> file bytes. Never opens a file: this is all a server
    may accept as text from a client (a path is for the CLI and the Python API only)."""
    if s.startswith("data:"):
        s = s.split(",", 1)[-1]
    try:
        return base64.b64decode("".join(s.split()), validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(FIELD, "is not valid base64 (plain, or in a data: URL)") from None


def _from_text(s: str) -> bytes:
    """A data URL, an existing file's path, or base64 (the alphabet includes '/', so try the path first)."""
    if s.startswith("data:"):
        return decode_base64_audio(s)
    if _is_file(s):
        return _read_file(Path(s))
    if len(s) < 256 and not s.rstrip("=").isalnum():
        raise RequestError(FIELD, f"file {s} does not exist")
    try:
        return decode_base64_audio(s)
    except RequestError:
        raise RequestError(FIELD, "is neither an existing file nor valid base64") from None


def _is_file(s: str) -> bool:
    try:
        return Path(s).is_file()
    except (OSError, ValueError):  # too long for a path, or NUL bytes
        return False


def _read_file(path: Path) -> bytes:
    if not path.is_file():
        raise RequestError(FIELD, f"file {path} does not exist")
    return path.read_bytes()
