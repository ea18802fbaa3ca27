"""One request's life in the engine: its handle, timestamps, and the chunk schedule of its audio.

The engine thread writes into a `Stream`; whoever submitted it reads chunks through `on_chunk` (the
asyncio bridge forwards them into an event loop). Timestamps use `time.perf_counter()` so the server
and the studies can break first-audio latency into queue / prefill / first frame / codec.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
from typing import Callable

import numpy as np

from qtts_jax.codec.config import SAMPLE_RATE, SAMPLES_PER_FRAME
from qtts_jax.engine.job import Job

_ids = itertools.count(1)

# Frames per audio chunk, in order; the last size repeats. One frame first, so audio leaves early.
DEFAULT_SCHEDULE = (1, 2, 4, 8)
FRAME_SECONDS = SAMPLES_PER_FRAME / SAMPLE_RATE  # audio per codec frame


@dataclasses.dataclass
class Chunk:
    """PCM of one decoded chunk; `final` marks the last one of the stream (it may be empty)."""

    pcm: np.ndarray  # float32 [samples] at 24 kHz
    first_frame: int
    frames: int
    sent_at: float
    final: bool = False
    error: str | None = None
    # when its listener runs dry without it, on the engine's clock: -inf where the listener is waiting for it
    # already (nothing plays yet: a first chunk, a listener waiting to resume), +inf for the final chunk (no audio)
    due: float = -math.inf


@dataclasses.dataclass
class Timings:
    submitted: float = 0.0
    admitted: float | None = None  # given a slot (prefill dispatched)
    prefilled: float | None = None  # prefill finished on the device
    first_frame: float | None = None  # first complete frame read back
    first_chunk: float | None = None  # first PCM handed out
    finished: float | None = None
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    compiled_before: int = 0  # the engine's programs compiled on demand when it was submitted (see `Engine.submit`)

    def as_dict(self) -> dict:
        def ms(t):
            return None if t is None else round((t - self.submitted) * 1000, 3)

        return {
            "queue_ms": ms(self.admitted),
            "prefill_ms": ms(self.prefilled),
            "first_frame_ms": ms(self.first_frame),
            "first_chunk_ms": ms(self.first_chunk),
            "total_ms": ms(self.finished),
        }


def _ended(chunk: Chunk) -> None:
    """A stream's callback once its final chunk is out: nothing listens any more."""


class Stream:
    """Handle of one submitted request. `cancel()` is safe from any thread."""

    def __init__(self, job: Job, on_chunk: Callable[[Chunk], None]):
        self.id = next(_ids)
        self.job = job  # the request as prepared: resolved, its prompt, bucket, frame cap and chunk schedule
        self.on_chunk = on_chunk
        self.timings = Timings(submitted=time.perf_counter())
        self.slot: int | None = None
        self.codes: list[np.ndarray] = []  # every frame, for callers that want the codes
        self.pending = 0  # frames generated but not yet handed to the codec
        self.decoded = 0  # frames handed to the codec
        self.inflight = 0  # frames in the codec call whose audio is not yet out
        self.fresh_codec = True  # its slot's codec state must start from zero at its first codec call
        self.chunks_sent = 0
        self.lm_done = False
        self.finished = False
        self._cancel = threading.Event()
        self.cap = job.frames_cap  # grows as live text is appended
        # live text: trailing ids on the device (frame k reads the k-th), ids appended but not yet there, and
        # whether the text is complete (its tts_eos appended); the engine thread moves `unsent` to the device
        self.text_known = len(job.prompt.trailing)
        self.text_complete = not job.live
        self.trailing_total = self.text_known  # on the device or in `unsent`
        self.unsent: list[int] = []
        self.complete_sent = self.text_complete  # the completion is in `unsent` or on the device
        self.play_shift = 0.0  # listener time lost waiting for live text: its playback resumed that much later
        self.resumes = False  # its listener ran dry waiting for live text: playback restarts with the next chunk

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def frames_cap(self) -> int:
        return self.cap

    @property
    def waiting_text(self) -> bool:
        """A live stream that has read every text id it has (the frame that reads the next one needs it)."""
        return not self.text_complete and not self.lm_done and len(self.codes) >= self.text_known

    def text_frames(self) -> int | None:
        """Frames it may make before it needs text it does not have (None: no limit)."""
        return None if self.text_complete else self.text_known - len(self.codes)

    def hold_playback(self, now: float) -> None:
        """Waiting for text: a listener that has run dry resumes when audio comes again, not on the old timeline
        (until then it has no headroom to keep: nothing of it is late)."""
        if (b := self.buffered(now)) is not None and b <= 0:
            self.resumes = True

    def next_chunk_frames(self) -> int:
        """Frames the next chunk should hold, per the schedule."""
        schedule = self.job.schedule
        return schedule[min(self.chunks_sent, len(schedule) - 1)]

    def buffered(self, now: float) -> float | None:
        """Audio a zero-buffer listener still has queued at `now` if playback began with the first chunk
        (None before it, and while it waits to resume): the headroom before this stream runs dry. Audio in the
        codec counts: it leaves within the codec call."""
        if self.timings.first_chunk is None or self.resumes:
            return None
        return self.timings.first_chunk + self.play_shift + self.decoded * FRAME_SECONDS - now

    def emit(self, chunk: Chunk) -> None:
        now = chunk.sent_at
        if self.timings.first_chunk is None and len(chunk.pcm):
            self.timings.first_chunk = now
        elif self.resumes and len(chunk.pcm):  # the audio before this chunk ended now
            self.resumes = False
            self.play_shift = now - self.timings.first_chunk - (self.decoded - chunk.frames) * FRAME_SECONDS
        self.timings.chunk_times.append(now)
        self.chunks_sent += 1
        on_chunk = self.on_chunk
        if chunk.final:
            self.finished = True
            self.timings.finished = now
            # nothing follows the final chunk. A callback that holds its caller's handle of this stream (the asyncio
            # bridge's does) made each request a reference cycle, which only the collector's full passes freed:
            # passes that hold the GIL, and with it the engine loop, 20-50 ms under load
            self.on_chunk = _ended
        on_chunk(chunk)
