"""One admitted request on its way out, the same for HTTP and the WebSocket: admission, the engine stream,
the client's playback tracking and the request's metrics."""

from __future__ import annotations

import time

from qtts_jax.job import Job
from serving.audio_encoders import SAMPLE_RATE
from serving.keys import BRIDGE, METRICS, SCHEDULER


class Utterance:
    """A prepared `Job`, admitted (or refused with 429/503) and submitted as it is made."""

    def __init__(self, app, job: Job, rid: str, endpoint: str, started: float | None = None, speed: float = 1.0,
                 rate: int = SAMPLE_RATE):
        self.app, self.job, self.rid, self.endpoint = app, job, rid, endpoint
        self.speed, self.rate = speed, rate  # of the audio the client gets: it plays 1/speed s per model second
        self.started = time.perf_counter() if started is None else started
        sched = app[SCHEDULER]
        self.predicted_ttfa = sched.admit()  # raises 429/503
        self.stream = app[BRIDGE].submit(job)
        self.track = sched.open(rid, job.frames_cap)
        self.frames = 0
        self.samples = 0
        self.first = True
        self.done = False
        self.error: str | None = None

    async def chunks(self):
        """Yields non-empty PCM arrays; records playback headroom, late chunks and the TTFA breakdown."""
        metrics, sched = self.app[METRICS], self.app[SCHEDULER]
        async for chunk in self.stream:
            if chunk.final:
                self.done = True
                self.error = chunk.error
            if len(chunk.pcm):
                if self.first:
                    self.first = False
                    metrics.observe_first_chunk(self.stream.timings)
                    sched.observe(self.stream.timings)
                headroom = self.track.on_audio(len(chunk.pcm) / SAMPLE_RATE / self.speed)
                if headroom is not None:
                    metrics.headroom.observe(headroom)
                    if headroom < 0:
                        metrics.late_chunks.inc()
                self.frames += chunk.frames
                self.samples += len(chunk.pcm)
                metrics.audio_seconds.inc(len(chunk.pcm) / SAMPLE_RATE / self.speed)
                yield chunk.pcm
        metrics.collect_steps()

    def close(self, outcome: str | None = None) -> None:
        if not self.done:
            self.stream.cancel()
            outcome = outcome or "cancelled"
        elif outcome is None:
            outcome = "ok" if self.error is None else ("cancelled" if self.error == "cancelled" else "error")
        self.app[SCHEDULER].close(self.track)
        metrics = self.app[METRICS]
        metrics.requests.labels(self.endpoint, outcome).inc()
        metrics.observe_request(self.endpoint, time.perf_counter() - self.started, len(self.job.request.text),
                                self.audio_seconds)

    def timings(self) -> dict:
        t = self.stream.timings.as_dict()
        t["predicted_ttfa_ms"] = round(self.predicted_ttfa * 1000, 3)
        t["late_chunks"] = self.track.late_chunks
        t["worst_headroom_ms"] = None if self.track.worst_headroom is None else round(
            self.track.worst_headroom * 1000, 3)
        return t

    @property
    def audio_seconds(self) -> float:
        """Seconds of audio the client plays so far (the model's, stretched by 1/speed)."""
        return self.samples / SAMPLE_RATE / self.speed

    def summary(self) -> dict:
        return {"request_id": self.rid, "frames": self.frames, "audio_seconds": round(self.audio_seconds, 4),
                "sample_rate": self.rate, "timings": self.timings()}
