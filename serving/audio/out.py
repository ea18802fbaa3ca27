"""The audio a client asked for, made from the model's 24 kHz float chunks as they come: `speed` (pitch-kept
time-stretch), then the output rate (streaming resampler), then the format's encoder. HTTP and both WebSocket
protocols use this one path, so a choice means the same everywhere.

The compressed formats cost milliseconds per second of audio (bench/audio_out.py on a 2-core CPU: MP3 2.3, Opus
7.5, AAC 8.6) and their encoders let go of the GIL: on the event loop, a few hundred streams of them would take the
loop whole and hold up every chunk behind them. Their work runs on a thread pool instead (`aencode`, `afinish`,
`awhole`), in parallel on the machine's cores and beside the engine thread; the cheap formats stay inline, where
a thread's hand-off would cost more than they do."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os

import numpy as np

from serving.audio.encoders import OPUS_RATES, SAMPLE_RATE, encode_whole, make_encoder
from serving.audio.g711 import TABLES as G711
from serving.audio.resample import RATES, StreamResampler
from serving.audio.timestretch import TimeStretch
from serving.errors import bad


def output_rate(fmt: str, rate: int | None) -> int:
    """The rate to send `fmt` at (the asked one, or the format's default); 400 naming `sample_rate` when the
    format cannot carry it."""
    if fmt in G711:
        if rate not in (None, 8000):
            raise bad("sample_rate", f"{fmt} is G.711 telephony audio, 8000 Hz only (got {rate})")
        return 8000
    rate = SAMPLE_RATE if rate is None else rate
    if rate not in RATES:
        raise bad("sample_rate", f"{rate} is not one of {list(RATES)}")
    if fmt == "opus" and rate not in OPUS_RATES:
        raise bad("sample_rate", f"Opus encodes at {list(OPUS_RATES)} Hz only; ask for one of those or another "
                                 f"format (got {rate})")
    return rate


class AudioOut:
    """24 kHz model audio -> `speed` and `rate`, chunk by chunk (`process`, then `finish` once)."""

    def __init__(self, rate: int = SAMPLE_RATE, speed: float = 1.0):
        self.rate, self.speed = rate, speed
        self._stretch = TimeStretch(speed, SAMPLE_RATE)
        self._resample = StreamResampler(SAMPLE_RATE, rate)

    def process(self, pcm: np.ndarray) -> np.ndarray:
        return self._resample.process(self._stretch.process(pcm))

    def finish(self) -> np.ndarray:
        return np.concatenate([self._resample.process(self._stretch.finish()), self._resample.finish()])

    def length(self, model_samples: int) -> int:
        """How many output samples `model_samples` of model audio become."""
        return round(round(model_samples / self.speed) * self.rate / SAMPLE_RATE)


# Formats whose encoders release the GIL (about twice the audio on two threads as on one: bench/audio_out.py's
# `parallel`); the rest go no faster on more threads, and cost less than handing them to one.
OFF_LOOP = frozenset({"mp3", "aac", "opus"})
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _encoders() -> concurrent.futures.ThreadPoolExecutor:
    """The process's encoding threads, one per core, made on first use."""
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="qtts-encode")
    return _pool


async def _off_loop(fmt: str, call, *args):
    """`call(*args)` on the encoding threads for a format in `OFF_LOOP`, inline for the rest."""
    if fmt not in OFF_LOOP:
        return call(*args)
    return await asyncio.get_running_loop().run_in_executor(_encoders(), call, *args)


class StreamOut:
    """`encode(pcm)` / `finish()` -> bytes of `fmt` at the asked speed and rate, as a stream; from a coroutine,
    `aencode` / `afinish`, which run a compressed format's work off the event loop (a stream's calls still run one
    after another, each awaited before the next)."""

    def __init__(self, fmt: str, rate: int = SAMPLE_RATE, speed: float = 1.0, max_model_samples: int | None = None):
        self.fmt = fmt
        self.audio = AudioOut(rate, speed)
        total = None if max_model_samples is None else self.audio.length(max_model_samples)
        self._enc = make_encoder(fmt, streaming=True, sample_rate=rate, total_samples=total)

    def encode(self, pcm: np.ndarray) -> bytes:
        return self._enc.encode(self.audio.process(pcm))

    def finish(self) -> bytes:
        return self._enc.encode(self.audio.finish()) + self._enc.finish()

    async def aencode(self, pcm: np.ndarray) -> bytes:
        return await _off_loop(self.fmt, self.encode, pcm)

    async def afinish(self) -> bytes:
        return await _off_loop(self.fmt, self.finish)


def whole(fmt: str, pcm: np.ndarray, rate: int = SAMPLE_RATE, speed: float = 1.0) -> bytes:
    """A complete file of model audio `pcm` at the asked speed and rate."""
    out = AudioOut(rate, speed)
    return encode_whole(fmt, np.concatenate([out.process(pcm), out.finish()]), rate)


async def awhole(fmt: str, pcm: np.ndarray, rate: int = SAMPLE_RATE, speed: float = 1.0) -> bytes:
    """`whole` from a coroutine: a compressed format's file is encoded off the event loop."""
    return await _off_loop(fmt, whole, fmt, pcm, rate, speed)
