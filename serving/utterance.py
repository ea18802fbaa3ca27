"""One admitted request on its way out, the same for HTTP and both WebSockets: admission, the engine streams of
its script's parts spoken as one stream, the client's playback tracking and the request's metrics."""

from __future__ import annotations

import time

import numpy as np

from serving.audio import word_timings
from serving.audio.encoders import SAMPLE_RATE
from serving.audio.prosody import ProsodyAudio
from serving.keys import ADMISSION, BRIDGE, METRICS, MODEL
from serving.sockets.live_input import LiveInput
from serving.text.script import Script


class Utterance:
    """A `Script`, admitted once (or refused with 429/503) and spoken part by part. The next part is submitted
    when the one before has finished generating: generation runs faster than real time, so the client still has
    that part's audio to play while the next one is prefilled. It is not admitted again (the request was
    admitted whole: admission counts its parts still to come until they are submitted) and goes ahead of
    requests waiting for a slot, and it keeps the request's voice, seed and settings (they are in its job).
    Pauses are silence; the playback track and the metrics see one stream."""

    def __init__(self, app, script: Script, rid: str, endpoint: str, started: float | None = None,
                 speed: float = 1.0, rate: int = SAMPLE_RATE, words: bool = False, live: LiveInput | None = None):
        self.app, self.script, self.rid, self.endpoint = app, script, rid, endpoint
        self.speed, self.rate = speed, rate  # of the audio the client gets: it plays 1/speed s per model second
        self.started = time.perf_counter() if started is None else started
        admission = app[ADMISSION]
        self.predicted_ttfa = admission.admit()  # raises 429/503
        self._jobs = iter(script.jobs)
        self.streams = [app[BRIDGE].submit(next(self._jobs))]
        app[METRICS].intake.observe(time.perf_counter() - self.started)
        if live is not None:  # a live utterance's script is its one job: the text still to come joins its stream
            live.attach(self.streams[0])
        # its parts still to come count as load from now on, so the next admission sees them (serving/admission.py)
        self.track = admission.open(rid, script.frames_cap, self.stream.stream.id,
                                tuple(job.frames_cap for job in script.jobs[1:]))
        self.frames = 0
        self.samples = 0  # model-rate samples after prosody, pauses included
        self.done = False
        self._first = True
        self.error: str | None = None
        self._words = [] if words else None  # estimates of the parts spoken, until taken

    @property
    def stream(self):
        """The part being generated (or the last one)."""
        return self.streams[-1]

    def cancel(self) -> None:
        """Stop the part in flight (within one engine step) and every part after it."""
        self.stream.cancel()

    async def chunks(self):
        """Yields non-empty PCM arrays; records playback headroom, late chunks and the TTFA breakdown."""
        for part in self.script.parts:
            if part.job is None:
                if samples := part.max_samples(self.speed):
                    yield self._out(np.zeros(samples, np.float32))
                continue
            stream, shape = self.stream, ProsodyAudio(part.prosody)
            start, frames = self.samples, 0
            async for chunk in stream:
                if chunk.final and chunk.error is None and (job := next(self._jobs, None)) is not None:
                    # prefilled while this part plays, ahead of requests still waiting: its listener is playing
                    self.streams.append(self.app[BRIDGE].submit(job, ahead=True))
                    self.track.next_part(self.stream.stream.id)
                self.error = self.error or chunk.error
                frames += chunk.frames
                self.frames += chunk.frames
                if len(chunk.pcm):
                    if self._first:
                        self._first = False
                        self.app[METRICS].observe_first_chunk(stream.timings)
                        self.app[ADMISSION].observe(stream.timings)
                    if len(pcm := shape.process(chunk.pcm)):
                        yield self._out(pcm)
            if self.error is not None:
                break
            if len(pcm := shape.finish()):
                yield self._out(pcm)
            if self._words is not None and not part.job.live:  # a live job's text grew after it was laid out
                self._words += word_timings.estimate(part.job, self.app[MODEL].tokenizer, frames,
                                                     self._seconds(start), self._seconds(self.samples - start))
        self.done = True
        self.app[METRICS].collect_steps()

    def _out(self, pcm: np.ndarray) -> np.ndarray:
        metrics = self.app[METRICS]
        headroom = self.track.on_audio(self._seconds(len(pcm)))
        if headroom is not None:
            metrics.headroom.observe(headroom)
            if headroom < 0:
                metrics.late_chunks.inc()
        self.samples += len(pcm)
        metrics.audio_seconds.inc(self._seconds(len(pcm)))
        return pcm

    def _seconds(self, samples: int) -> float:
        return samples / SAMPLE_RATE / self.speed

    def take_words(self) -> list[dict]:
        """Word timings estimated since the last call (serving/audio/word_timings.py); none unless asked for."""
        if self._words is None:
            return []
        out, self._words = self._words, []
        return out

    def close(self, outcome: str | None = None) -> None:
        if not self.done:
            self.cancel()
            outcome = outcome or "cancelled"
        elif outcome is None:
            outcome = "ok" if self.error is None else ("cancelled" if self.error == "cancelled" else "error")
        self.app[ADMISSION].close(self.track)
        metrics = self.app[METRICS]
        metrics.requests.labels(self.endpoint, outcome).inc()
        metrics.observe_request(self.endpoint, time.perf_counter() - self.started, self.script.chars,
                                self.audio_seconds)

    def timings(self) -> dict:
        first, last = self.streams[0].timings, self.stream.timings
        t = first.as_dict()  # each from the engine's submit; before it, the handler's own work (and its awaits)
        t["intake_ms"] = round((first.submitted - self.started) * 1000, 3)
        if last.finished is not None:  # the whole response, over every part
            t["total_ms"] = round((last.finished - first.submitted) * 1000, 3)
        t["parts"] = len(self.streams)
        t["predicted_ttfa_ms"] = round(self.predicted_ttfa * 1000, 3)
        t["late_chunks"] = self.track.late_chunks
        t["worst_headroom_ms"] = None if self.track.worst_headroom is None else round(
            self.track.worst_headroom * 1000, 3)
        return t

    @property
    def audio_seconds(self) -> float:
        """Seconds of audio the client plays so far (the model's, stretched by 1/speed)."""
        return self._seconds(self.samples)

    def summary(self) -> dict:
        return {"request_id": self.rid, "frames": self.frames, "audio_seconds": round(self.audio_seconds, 4),
                "sample_rate": self.rate, "timings": self.timings()}
