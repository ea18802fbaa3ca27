"""Streaming sample-rate conversion of the model's 24 kHz audio to the rate a client asks for.

soxr's `ResampleStream` keeps the filter's state between chunks, so a stream resampled chunk by chunk is the
same audio as the whole file resampled at once (no clicks at chunk edges), and its total length is exact."""

from __future__ import annotations

import numpy as np
import soxr

RATES = (8000, 16000, 22050, 24000, 44100, 48000)


class StreamResampler:
    """`process(pcm)` -> what is ready at `out_rate` (may be shorter than the input's share: the filter's
    delay), `finish()` -> the rest. The identity when the rates are equal."""

    def __init__(self, in_rate: int, out_rate: int):
        self.in_rate, self.out_rate = in_rate, out_rate
        self._stream = None if in_rate == out_rate else soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32",
                                                                            quality="HQ")

    def process(self, pcm: np.ndarray) -> np.ndarray:
        pcm = np.asarray(pcm, np.float32)
        return pcm if self._stream is None else self._stream.resample_chunk(pcm)

    def finish(self) -> np.ndarray:
        if self._stream is None:
            return np.zeros(0, np.float32)
        return self._stream.resample_chunk(np.zeros(0, np.float32), last=True)
