"""16-bit PCM WAV writing with the standard library (no audio package needed to synthesize)."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np


def to_int16(audio: np.ndarray) -> np.ndarray:
    """float [-1, 1] -> int16, rounding to nearest (clipped first, so full scale never wraps)."""
    return np.round(np.clip(audio, -1.0, 1.0) * 32767.0).astype(np.int16)


def write_wav(path: str | Path, audio: np.ndarray, sample_rate: int) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(to_int16(audio).tobytes())
