"""One synthesis through the server's whole-file WAV endpoint, with the server's timing breakdown, for
listening to and looking at a model before loading it."""

from __future__ import annotations

import dataclasses
import io
import json
import time
import urllib.error
import urllib.request
import wave

import numpy as np

from studies.load import key_headers


@dataclasses.dataclass(frozen=True)
class Synthesis:
    audio: np.ndarray  # float32 in [-1, 1]
    sample_rate: int
    timings: dict  # server X-Timings: ms since submission of queue, prefill, first frame/chunk, total
    wall_ms: float  # client-side request time


def synthesize(url: str, text: str, voice: str = "ryan", timeout_s: float = 120.0, **options) -> Synthesis:
    """POSTs a non-streamed WAV request; raises RuntimeError with the server's error message on failure."""
    body = json.dumps({"input": text, "voice": voice, "response_format": "wav", "stream": False, **options}).encode()
    req = urllib.request.Request(f"{url}/v1/audio/speech", body, {"Content-Type": "application/json", **key_headers()})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            data, timings = resp.read(), json.loads(resp.headers.get("X-Timings", "{}"))
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:300]}") from None
    wall = 1000 * (time.perf_counter() - t0)
    with wave.open(io.BytesIO(data)) as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise RuntimeError(f"expected 16-bit mono WAV, got {8 * w.getsampwidth()}-bit × {w.getnchannels()}")
        audio = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768.0
        return Synthesis(audio, w.getframerate(), timings, wall)
