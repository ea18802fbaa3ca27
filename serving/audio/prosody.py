"""SSML prosody on the model's audio, chunk by chunk: `rate` through the time-stretch, `pitch` as a pitch shift,
`volume` as a gain.

A pitch shift by p is a time-stretch to p times the length (pitch kept) followed by a resampling that plays it
p times faster: the length comes back and every frequency is multiplied by p. Both stages stream, so one
stretch of speed rate/p and one resampler do rate and pitch together, and the length is exactly
input / rate (to the resampler's rounding)."""

from __future__ import annotations

import dataclasses

import numpy as np

from serving.audio.encoders import SAMPLE_RATE
from serving.audio.resample import StreamResampler
from serving.audio.timestretch import TimeStretch

RATE_RANGE = (0.5, 2.0)  # rate / pitch stays within the time-stretch's range (0.25-4) for any pair
PITCH_RANGE = (0.5, 2.0)
GAIN_DB_RANGE = (-40.0, 20.0)


@dataclasses.dataclass(frozen=True)
class Prosody:
    rate: float = 1.0  # speaking rate: 1.5 takes 1/1.5 of the time
    pitch: float = 1.0  # frequency factor
    gain_db: float | None = 0.0  # None: silent

    @property
    def plain(self) -> bool:
        return self == Prosody()

    def length(self, samples: int) -> int:
        """How many samples `samples` of model audio become."""
        return round(samples / self.rate)


class ProsodyAudio:
    """`process(pcm)` -> what is ready; `finish()` -> the rest. The identity for plain prosody."""

    def __init__(self, prosody: Prosody):
        self.prosody = prosody
        self._stretch = TimeStretch(prosody.rate / prosody.pitch, SAMPLE_RATE)
        self._resample = StreamResampler(SAMPLE_RATE * prosody.pitch, SAMPLE_RATE)
        self._gain = 0.0 if prosody.gain_db is None else 10 ** (prosody.gain_db / 20)

    def process(self, pcm: np.ndarray) -> np.ndarray:
        return self._scale(self._resample.process(self._stretch.process(pcm)))

    def finish(self) -> np.ndarray:
        tail = np.concatenate([self._resample.process(self._stretch.finish()), self._resample.finish()])
        return self._scale(tail)

    def _scale(self, pcm: np.ndarray) -> np.ndarray:
        return pcm if self._gain == 1.0 else (pcm * np.float32(self._gain)).astype(np.float32)
