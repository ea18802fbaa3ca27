"""Float audio as 16-bit PCM: one rounding rule for the files we write (through soundfile) and the wire."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf


def to_int16(audio: np.ndarray) -> np.ndarray:
    """float [-1, 1] -> little-endian int16 (the WAV and wire format), rounding to nearest (clipped first, so
    full scale never wraps)."""
    return np.round(np.clip(np.asarray(audio, np.float32), -1.0, 1.0) * 32767.0).astype("<i2")


def write_wav(path: str | Path, audio: np.ndarray, sample_rate: int) -> None:
    """Mono 16-bit PCM WAV of float audio in [-1, 1], rounded by `to_int16` (not by libsndfile), the rule
    the tests compare the reference's audio by."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, to_int16(audio), sample_rate, subtype="PCM_16", format="WAV")
