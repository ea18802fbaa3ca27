"""Admission from the engine's published costs: refuse only what would really miss.

The engine publishes a stats snapshot after every iteration (`qtts_jax.engine.EngineStats`): live streams,
the queue, each stream's frames left, and the measured cost of an iteration per live-batch rung and step
size, and of a prefill per batch of requests. A request is refused (429 + Retry-After) only if

- its first audio is predicted later than the TTFA target: the rest of the iteration in progress, then the
  wait for a free slot (each stream ahead frees its slot after its frames left), then one prefill of
  everything waiting and the newcomers' first-frame program; or
- one more stream would let the engine fall behind playback: while requests keep arriving, every iteration
  prefills a newcomer and runs its first-frame program before the step of n frames that the newcomer joins, so
  for some step size short enough for the newcomer's one frame of audio that iteration must take less than the
  n x 80 ms of audio it gives each stream, or every playing stream would drain (by more than the `starvation_s`
  a stream may lose over the frames it has left: 0 by default, the zero-underrun contract); or a playing stream
  is already further behind than that; or the requests already waiting, prefilled together once, would take
  longer than the playing streams' headroom (plus `starvation_s`). Every such deadline counts the engine's
  measured delay between an iteration's end and its audio going out.

A long input is spoken as several parts (serving/utterance.py), each submitted ahead of the waiting requests as
the one before finishes generating: its slot stays busy and its listener keeps playing until the last part. The
engine sees only the part in flight, so every frame count above is the snapshot's with each open request's parts
still to come (their frame caps) added to the snapshot's entry of its part in flight (found by its stream id),
until they are submitted.

Below both limits nothing is refused; an idle engine always admits (its costs are measured at start-up).
Each open stream is also tracked here as the client hears it (headroom when each chunk leaves), for metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import math
import time

from qtts_jax.engine.costs import newcomer_budget
from qtts_jax.engine.measurements import ema
from qtts_jax.engine.stream import FRAME_SECONDS
from serving.errors import ApiError


@dataclasses.dataclass(frozen=True)
class AdmissionConfig:
    ttfa_target_s: float = 0.3
    starvation_s: float = 0.0  # underrun an admitted stream may suffer: none, by default
    max_queue: int | None = None  # waiting requests beyond the slots; None: as many as slots
    warming_retry_after_s: int = 5
    draining_retry_after_s: int = 30


class StreamTrack:
    """Server-side playback model of one open stream."""

    _ids = itertools.count(1)

    def __init__(self, request_id: str, cap_frames: int, part: int, to_come: tuple[int, ...] = ()):
        self.key = next(self._ids)
        self.request_id = request_id
        self.cap_frames = cap_frames
        self.part = part  # the engine stream id of its part in flight (`Stream.id`)
        self.to_come = list(to_come)  # frame caps of its parts not yet submitted, in order (admission counts them)
        self.submitted = time.perf_counter()
        self.playback_start: float | None = None
        self.audio_sent = 0.0
        self.late_chunks = 0
        self.worst_headroom: float | None = None

    def next_part(self, part: int) -> None:
        """Its next part went to the engine: from now on the engine's snapshot counts its frames."""
        self.part = part
        self.to_come.pop(0)

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


class Admission:
    """The server's admission: whether the engine takes one more request now (`admit`, else a 429 or 503), and the
    open streams it took, tracked as their clients hear them. What the loop runs is decided by the engine's
    scheduler (`qtts_jax.engine.scheduler`)."""

    def __init__(self, engine, config: AdmissionConfig = AdmissionConfig()):
        self.engine = engine
        self.config = config
        self.ready = False
        self.draining = False
        self.core_up = True  # False while the engine core is down (it died and is restarting)
        self.streams: dict[int, StreamTrack] = {}
        self._idle = asyncio.Event()  # set while no stream is open (`wait_idle`)
        self._idle.set()
        self._service = None  # EMA seconds: admitted -> first chunk, as observed

    @property
    def accepting(self) -> bool:
        return self.ready and self.core_up and not self.draining

    def observe(self, timings) -> None:
        """A stream's first chunk left: its admission-to-first-chunk time corrects the predicted one (not while the
        engine compiles its larger rungs in the background: XLA then slows everything, and a burst judged by that
        later would be refused whole; nor when the engine compiled a program on demand after it was submitted, as
        one started without a warm-up does for its first requests: it may have waited seconds on that)."""
        t = timings
        if self.engine.compiling or self.engine.compiled_on_demand != t.compiled_before:
            return
        if t.admitted is not None and t.first_chunk is not None:
            self._service = ema(self._service, t.first_chunk - t.admitted)

    def min_headroom(self) -> float:
        now = time.perf_counter()
        vals = [b for s in self.streams.values() if (b := s.buffered(now)) is not None]
        return min(vals) if vals else 0.0

    # ---- admission --------------------------------------------------------------------------

    def load(self, st) -> tuple[list[int], list[int]]:
        """(frames left per stream in a slot, frame caps per waiting request) from the snapshot, with every open
        request's parts still to come added to the snapshot's entry of its part in flight (it keeps the slot),
        or, once that part has finished generating (no frames left, or gone), as a request waiting ahead of the
        others (it is about to be submitted so)."""
        left, waiting, ahead = list(st.frames_left), list(st.queued_frames), []
        in_slot = {i: j for j, i in enumerate(st.live_ids)}
        queued = {i: j for j, i in enumerate(st.queued_ids)}
        for track in self.streams.values():
            if not (later := sum(track.to_come)):
                continue
            if (j := queued.get(track.part)) is not None:
                waiting[j] += later
            elif (j := in_slot.get(track.part)) is not None and left[j]:
                left[j] += later
            else:
                ahead.append(later)
        return left, ahead + waiting

    def predict(self, st, left: list[int], waiting: list[int]) -> tuple[float, float, float, float]:
        """(seconds until a slot is free, predicted TTFA, seconds per frame of the playing streams while
        requests keep arriving one per iteration, with this one added; seconds of the one iteration that takes
        everything waiting and this one) for a request arriving now, from the engine snapshot and its `load`."""
        batch = min(len(left) + len(waiting) + 1, st.slots)
        costs = st.costs
        burst = costs.newcomers(len(waiting) + 1, len(waiting) + 1)
        # steady state: each iteration takes a newcomer before the step it joins, whose audio goes out only after
        # the next iteration's admission and dispatch (the engine's delivery_s); its first audio went out
        # first_late_s after its prefill and first frame, so its listener plays from then
        outlasts = newcomer_budget(FRAME_SECONDS, st.first_late_s, st.headroom_margin_s)
        frame_s = costs.frame_s_with_arrivals(batch, st.step_sizes, outlasts)
        if st.slots - len(left) > len(waiting):  # a slot is still free once those ahead of it have theirs
            start = 0.0
        else:  # those ahead of it take slots first (per request of a burst this was most of its admission's time)
            free_at = [0.0] * (st.slots - len(left)) + [n * frame_s for n in left]
            heapq.heapify(free_at)
            for cap in waiting:
                heapq.heappush(free_at, heapq.heappop(free_at) + cap * frame_s)
            start = free_at[0]
        service = max(burst, self._service or 0.0)
        return start, st.iteration_s + start + service, frame_s, burst

    def admit(self) -> float:
        """Predicted TTFA in seconds, or raises ApiError 503/429 with a Retry-After."""
        c = self.config
        if not self.ready:
            raise ApiError(503, "not_ready", "the server is warming up", retry_after=c.warming_retry_after_s)
        if not self.core_up:
            raise ApiError(503, "not_ready", "the engine is restarting", retry_after=c.warming_retry_after_s)
        if self.draining:
            raise ApiError(503, "draining", "the server is shutting down", retry_after=c.draining_retry_after_s)
        st = self.engine.stats()
        max_queue = st.slots if c.max_queue is None else c.max_queue
        left, waiting = self.load(st)
        start, ttfa, frame_s, burst = self.predict(st, left, waiting)
        if st.queued >= max_queue:
            raise ApiError(429, "queue_full", f"{st.queued} requests are already waiting",
                           retry_after=self._retry(start))
        if not left and not waiting:
            return ttfa  # idle: nothing to protect, and this is the best service there is
        # each frame eats its overrun out of every stream's headroom, once per frame a stream has left
        overrun = frame_s - (FRAME_SECONDS - _KEEP_AHEAD_S)
        if overrun > 0 and overrun * max(left + waiting) > c.starvation_s:
            raise ApiError(429, "overloaded", f"another stream would slow the engine to {frame_s * 1000:.0f} ms "
                           f"per frame, longer than the {FRAME_SECONDS * 1000:.0f} ms of audio it makes: playing "
                           "streams would run dry", retry_after=self._retry(start + frame_s))
        if st.min_headroom_s is not None and st.min_headroom_s < -c.starvation_s:
            raise ApiError(429, "overloaded", "a playing stream is already behind its listener",
                           retry_after=self._retry(-st.min_headroom_s))
        # a burst is paid once, out of every playing stream's headroom
        if st.min_headroom_s is not None and burst + st.delivery_s > st.min_headroom_s + c.starvation_s:
            raise ApiError(429, "overloaded", f"prefilling the {len(waiting) + 1} waiting requests ({burst * 1000:.0f} "
                           "ms) would let playing streams run dry", retry_after=self._retry(burst))
        if ttfa > c.ttfa_target_s:
            raise ApiError(429, "overloaded", f"predicted first audio in {ttfa * 1000:.0f} ms exceeds the "
                           f"{c.ttfa_target_s * 1000:.0f} ms target", retry_after=self._retry(start))
        return ttfa

    @staticmethod
    def _retry(wait_s: float) -> int:
        return max(1, math.ceil(wait_s))

    def open(self, request_id: str, cap_frames: int, part: int, to_come: tuple[int, ...] = ()) -> StreamTrack:
        """Track a request just admitted and submitted: `part` its first part's engine stream id, `to_come` the frame
        caps of the parts after it (counted as load from now on: see `load`)."""
        track = StreamTrack(request_id, cap_frames, part, to_come)
        self.streams[track.key] = track
        self._idle.clear()
        return track

    def close(self, track: StreamTrack) -> None:
        self.streams.pop(track.key, None)
        if not self.streams:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Until no stream is open (a drain waits for this; so do tests, for a server to settle)."""
        await self._idle.wait()


_KEEP_AHEAD_S = 0.008  # an iteration must beat its audio by this much (host jitter, a scrape, a GC pause)
