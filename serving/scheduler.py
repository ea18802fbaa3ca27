"""Playback-aware admission: admit a request only if its first audio is predicted within the TTFA target
and no admitted stream is predicted to run dry by more than the starvation budget.

The prediction uses what the engine measures: its recent step time per frame (every slot advances in one
batched step, so a frame costs the same for one stream or all), the prefill and first-chunk service times
of recent requests, and the slots' occupancy (frames each live stream may still produce, up to its cap).
When no slot is free the request's start is when the earliest slot frees, simulated through the queue
ahead of it (each queued request holds a slot for its prefill + frame cap).

Each open stream has a playback deadline: playback starts when its first chunk leaves (zero-buffer
player), and the deadline of a chunk is playback start + audio already sent. Headroom = deadline - now
when a chunk leaves; negative headroom is a late chunk. Admission refuses work whose prefill stall would
push a playing stream's headroom below -starvation.

Ordering: the engine advances every admitted stream in every step (one batched call), so admitted
streams never wait for each other; waiting requests are taken in arrival order, which is deadline order
because every new request's deadline is its arrival + the TTFA target.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import statistics
import time

from serving.schemas import ApiError

FRAME_SECONDS = 1920 / 24000  # audio per codec frame (80 ms)


@dataclasses.dataclass(frozen=True)
class AdmissionConfig:
    ttfa_target_s: float = 0.3
    starvation_s: float = 0.1
    max_queue: int | None = None  # waiting requests beyond the slots; None: as many as slots
    frame_seconds_prior: float = 0.02  # step time per frame before any is measured
    warming_retry_after_s: int = 5
    draining_retry_after_s: int = 30


class StreamTrack:
    """Server-side playback model of one open stream."""

    _ids = itertools.count(1)

    def __init__(self, request_id: str, cap_frames: int):
        self.key = next(self._ids)
        self.request_id = request_id
        self.cap_frames = cap_frames
        self.submitted = time.perf_counter()
        self.playback_start: float | None = None
        self.audio_sent = 0.0
        self.late_chunks = 0
        self.worst_headroom: float | None = None

    def on_audio(self, seconds: float, now: float | None = None) -> float | None:
        """Record `seconds` of audio leaving now; returns the headroom it left with (None for the first)."""
        if seconds <= 0:
            return None
        now = time.perf_counter() if now is None else now
        headroom = None
        if self.playback_start is None:
            self.playback_start = now
        else:
            headroom = self.playback_start + self.audio_sent - now
            if headroom < 0:
                self.late_chunks += 1
            self.worst_headroom = headroom if self.worst_headroom is None else min(self.worst_headroom, headroom)
        self.audio_sent += seconds
        return headroom

    def buffered(self, now: float) -> float | None:
        """Audio the listener still has queued now (None before playback starts)."""
        if self.playback_start is None:
            return None
        return self.playback_start + self.audio_sent - now


class Scheduler:
    def __init__(self, engine, config: AdmissionConfig = AdmissionConfig()):
        self.engine = engine
        self.config = config
        self.ready = False
        self.draining = False
        self.streams: dict[int, StreamTrack] = {}
        self._prefill = None  # EMA seconds: admitted -> prefilled
        self._service = None  # EMA seconds: admitted -> first chunk

    # ---- measurements -----------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        return self.ready and not self.draining

    def frame_seconds(self) -> float:
        recent = list(self.engine.step_seconds)[-64:]
        return statistics.median(recent) if recent else self.config.frame_seconds_prior

    def prefill_seconds(self) -> float:
        return self._prefill if self._prefill is not None else 2 * self.frame_seconds()

    def service_seconds(self) -> float:
        """Admission to first chunk: prefill + first frame + first codec call."""
        return self._service if self._service is not None else self.prefill_seconds() + 2 * self.frame_seconds()

    def observe(self, timings) -> None:
        t = timings
        if t.admitted is not None and t.prefilled is not None:
            self._prefill = _ema(self._prefill, t.prefilled - t.admitted)
        if t.admitted is not None and t.first_chunk is not None:
            self._service = _ema(self._service, t.first_chunk - t.admitted)

    def min_headroom(self) -> float:
        now = time.perf_counter()
        vals = [b for s in self.streams.values() if (b := s.buffered(now)) is not None]
        return min(vals) if vals else 0.0

    # ---- admission --------------------------------------------------------------------------

    def predict_start(self) -> float:
        """Seconds until a request submitted now gets a slot."""
        e, tf = self.engine, self.frame_seconds()
        free_at = []
        for s in list(e.slots):
            if s is None:
                free_at.append(0.0)
            else:
                left = 0 if s.lm_done else max(s.frames_cap - len(s.codes), 0)
                free_at.append(left * tf)
        heapq.heapify(free_at)
        for q in list(e.queue):
            start = heapq.heappop(free_at)
            heapq.heappush(free_at, start + self.prefill_seconds() + q.prepared["cap"] * tf)
        return free_at[0]

    def admit(self) -> float:
        """Predicted TTFA in seconds, or raises ApiError 503/429 with a Retry-After."""
        c = self.config
        if not self.ready:
            raise ApiError(503, "not_ready", "the server is warming up", retry_after=c.warming_retry_after_s)
        if self.draining:
            raise ApiError(503, "draining", "the server is shutting down", retry_after=c.draining_retry_after_s)
        e = self.engine
        max_queue = e.config.slots if c.max_queue is None else c.max_queue
        if len(e.queue) >= max_queue:
            raise ApiError(429, "queue_full", f"{len(e.queue)} requests are already waiting",
                           retry_after=self._retry(self.predict_start()))
        tf = self.frame_seconds()
        start = self.predict_start()
        step_in_flight = e.config.frames_per_step * tf
        ttfa = start + step_in_flight + self.service_seconds()
        if not any(s is not None for s in e.slots) and not e.queue:
            # Idle: nothing to protect, and this is the best service there is. Refusing on step times
            # measured at a larger batch would keep them stale, and the server would refuse forever.
            return ttfa
        if tf >= FRAME_SECONDS:
            raise ApiError(429, "overloaded", "the engine is slower than real time now",
                           retry_after=self._retry(self.predict_start()))
        if ttfa > c.ttfa_target_s:
            raise ApiError(429, "overloaded", f"predicted first audio in {ttfa * 1000:.0f} ms exceeds the "
                           f"{c.ttfa_target_s * 1000:.0f} ms target", retry_after=self._retry(start))
        # the new request's prefill stalls every playing stream for about one prefill
        now = time.perf_counter()
        stall = self.prefill_seconds() + tf
        for s in self.streams.values():
            b = s.buffered(now)
            if b is not None and s.audio_sent < s.cap_frames * FRAME_SECONDS and b - stall < -c.starvation_s:
                raise ApiError(429, "overloaded", "admitting now would starve a playing stream",
                               retry_after=self._retry(stall))
        return ttfa

    @staticmethod
    def _retry(wait_s: float) -> int:
        return max(1, math.ceil(wait_s))

    def open(self, request_id: str, cap_frames: int) -> StreamTrack:
        track = StreamTrack(request_id, cap_frames)
        self.streams[track.key] = track
        return track

    def close(self, track: StreamTrack) -> None:
        self.streams.pop(track.key, None)


def _ema(old, new, alpha=0.2):
    return new if old is None else (1 - alpha) * old + alpha * new
