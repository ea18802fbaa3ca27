"""`speed`: a pitch-preserving time-stretch (WSOLA) that runs chunk by chunk on a stream.

WSOLA (waveform-similarity overlap-add, Verhelst & Roelands 1993) cuts 30 ms Hann frames from the input every
`speed` × 15 ms and overlap-adds them every 15 ms; each frame's start may move by up to 10 ms to where it best
continues the previous frame's waveform (cross-correlation), so pitch periods line up and the voice keeps its
pitch. It needs only 40 ms of look-ahead, so it works on the engine's 80 ms chunks as they come, and numpy does
it in a small share of a core per stream (bench/timestretch.py measures it). Written here rather than taken from
a library: the maintained ones (Rubber Band through pedalboard or pyrubberband) stretch whole buffers, not a
stream, and the stream's total length must come out exact (`finish`)."""

from __future__ import annotations

import functools

import numpy as np

MIN_SPEED, MAX_SPEED = 0.25, 4.0


class TimeStretch:
    """`process(pcm)` -> the stretched audio that is final so far; `finish()` -> the rest, so that the whole
    output is exactly round(input samples / speed) long. Speed 1.0 passes the audio through unchanged."""

    def __init__(self, speed: float, sample_rate: int = 24000):
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}]")
        self.speed = float(speed)
        self.n = 2 * round(0.015 * sample_rate)  # frame: 30 ms
        self.hs = self.n // 2  # synthesis hop: 50% overlap, where periodic Hann windows sum to 1
        self.tol = round(0.010 * sample_rate)  # how far a frame may move to line up with the last one
        self.window, self._first_window = _windows(self.n)
        self._buf = np.zeros(0, np.float32)  # input from absolute sample `_base` on
        self._base = 0
        self._total_in = 0
        self._k = 0  # next frame
        self._prev = 0  # input position of the last frame placed
        self._acc = np.zeros(self.n, np.float32)  # output from sample k * hs on, frames overlap-added
        self._emitted = 0

    def process(self, pcm: np.ndarray) -> np.ndarray:
        pcm = np.asarray(pcm, np.float32)
        if self.speed == 1.0:
            return pcm
        self._buf = np.concatenate([self._buf, pcm])
        self._total_in += len(pcm)
        return self._run(final=False)

    def finish(self) -> np.ndarray:
        if self.speed == 1.0:
            return np.zeros(0, np.float32)
        return self._run(final=True)

    def _needs(self, k: int) -> int:
        """The input (absolute, exclusive end) that frame k reads."""
        a = round(k * self.hs * self.speed)
        return max(a + self.tol, self._prev + self.hs) + self.n if k else self.n

    def _run(self, final: bool) -> np.ndarray:
        target = round(self._total_in / self.speed)
        out = []
        while self._emitted < target:
            k = self._k
            if not final and (self._needs(k) > self._total_in or (k + 1) * self.hs > target):
                break  # wait for input; and never emit past what the input seen so far is worth
            need = self._needs(k) - self._base
            if need > len(self._buf):  # finishing: the input ends in silence
                self._buf = np.concatenate([self._buf, np.zeros(need - len(self._buf), np.float32)])
            if k == 0:
                pos, window = 0, self._first_window
            else:
                pos, window = self._best(k), self.window
            start = pos - self._base
            self._acc += self._buf[start:start + self.n] * window
            block = self._acc[: self.hs].copy()
            self._acc = np.concatenate([self._acc[self.hs:], np.zeros(self.hs, np.float32)])
            keep = min(len(block), target - self._emitted)
            out.append(block[:keep])
            self._emitted += keep
            self._prev, self._k = pos, k + 1
            drop = min(round((k + 1) * self.hs * self.speed) - self.tol, self._prev + self.hs) - self._base
            if drop > 0:
                self._buf, self._base = self._buf[drop:], self._base + drop
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def _best(self, k: int) -> int:
        """Frame k's start within the tolerance of its nominal place, where it best continues the last frame."""
        a = round(k * self.hs * self.speed)
        lo = max(a - self.tol, 0)
        hi = a + self.tol
        b = self._base
        template = self._buf[self._prev + self.hs - b: self._prev + self.hs - b + self.n]
        region = self._buf[lo - b: hi - b + self.n]
        size = 1 << int(np.ceil(np.log2(len(region) + self.n)))
        corr = np.fft.irfft(np.fft.rfft(region, size) * np.conj(np.fft.rfft(template, size)), size)
        return lo + int(np.argmax(corr[: hi - lo + 1]))


@functools.lru_cache(maxsize=4)
def _windows(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The periodic Hann window of an n-sample frame, and the first frame's (full level where the others fade
    in), read-only: every request builds a stretch, most at speed 1.0, and in a burst the event loop built these
    for each of them."""
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)).astype(np.float32)
    first = window.copy()
    first[: n // 2] = 1.0
    for w in (window, first):
        w.flags.writeable = False
    return window, first
