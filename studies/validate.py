"""Stream validation: a response counts as a success only if its audio is real, decodable 24 kHz audio.

A server that answers 200 with an empty, truncated, non-finite or wrongly-sampled stream has failed the
listener, so the study must count it as a failure rather than trust the status code.
"""

from __future__ import annotations

import numpy as np

from qtts_jax.codec.config import SAMPLE_RATE

SAMPLE_FORMATS = {"s16le": np.dtype("<i2"), "f32le": np.dtype("<f4")}


def decode_pcm(data: bytes, sample_format: str = "s16le") -> np.ndarray:
    """Raw PCM bytes -> float32 samples in [-1, 1] (s16le) or as sent (f32le)."""
    if sample_format not in SAMPLE_FORMATS:
        raise ValueError(f"sample format {sample_format!r} is not one of {sorted(SAMPLE_FORMATS)}")
    dtype = SAMPLE_FORMATS[sample_format]
    if len(data) % dtype.itemsize:
        raise ValueError(f"{len(data)} bytes is not a whole number of {sample_format} samples")
    samples = np.frombuffer(data, dtype)
    return samples.astype(np.float32) / 32768.0 if dtype.kind == "i" else samples.astype(np.float32)


def validate_stream(status: int | None, headers: dict, data: bytes, error: str | None = None) -> str | None:
    """None if the streamed response is valid audio, else the reason it is not (status None: no response).
    Header names are matched in any case, as HTTP defines them (an ASGI server such as the fleet's front sends them
    in lower case)."""
    headers = {k.lower(): v for k, v in headers.items()}
    if status and status != 200:
        return f"HTTP {status}"
    if error or not status:
        return f"transfer failed: {error or 'no response'}"
    rate = headers.get("x-sample-rate")
    if rate is None or not str(rate).isdigit() or int(rate) != SAMPLE_RATE:
        return f"sample rate {rate!r}, expected {SAMPLE_RATE}"
    if headers.get("x-channels", "1") != "1":
        return f"{headers.get('x-channels')} channels, expected mono"
    fmt = headers.get("x-sample-format", "s16le")
    if not data:
        return "empty stream"
    try:
        samples = decode_pcm(data, fmt)
    except ValueError as exc:
        return f"malformed: {exc}"
    if not np.all(np.isfinite(samples)):
        return "non-finite samples"
    return None
