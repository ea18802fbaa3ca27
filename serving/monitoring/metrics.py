"""Prometheus metrics (prometheus-client), one registry per app so several apps can live in one process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from serving.monitoring.collector import PauseCollector

_LAT = (0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
_HEAD = (-1.0, -0.5, -0.2, -0.1, -0.05, 0.0, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_STEP = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64)
_INTAKE = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
_E2E = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
_CHARS = (10, 25, 50, 100, 200, 400, 800, 1600, 3200, 6400)
_AUDIO = (0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self, engine, admission, model: str = "unknown", info: dict[str, str] | None = None):
        r = self.registry = CollectorRegistry()
        self.model = model
        # per synthesis request, by model (what vLLM/TGI dashboards chart): end to end, input size, output size
        self.request_duration = Histogram("qtts_request_duration_seconds",
                                          "Speech request end to end: body read to last byte or cancel",
                                          ["model", "endpoint"], buckets=_E2E, registry=r)
        self.input_chars = Histogram("qtts_request_input_chars", "Characters of input text per speech request",
                                     ["model"], buckets=_CHARS, registry=r)
        self.output_audio = Histogram("qtts_request_audio_seconds", "Seconds of audio sent per speech request",
                                      ["model"], buckets=_AUDIO, registry=r)
        self.unrouted = Counter("qtts_unrouted_requests", "Requests for a path or method no endpoint serves",
                                ["status"], registry=r)
        Info("qtts_build", "Build and configuration of this server", registry=r).info(
            {"model": model, **(info or {})})
        self.requests = Counter("qtts_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=r)
        # the event loop takes a burst's requests one after another: each waits for the intake of those before it
        self.intake = Histogram("qtts_request_intake_seconds", "An HTTP speech request's handler starting (a "
                                "WebSocket utterance's admission) to its first part submitted to the engine",
                                buckets=_INTAKE, registry=r)
        self.ttfa = Histogram("qtts_ttfa_seconds", "Submit to first audio chunk handed to the client", buckets=_LAT,
                              registry=r)
        self.ttfa_part = Histogram("qtts_ttfa_part_seconds", "TTFA parts: queue, prefill, first_frame, codec",
                                   ["part"], buckets=_LAT, registry=r)
        self.late_chunks = Counter("qtts_late_chunks", "Chunks handed out after their playback deadline", registry=r)
        self.headroom = Histogram("qtts_buffer_headroom_seconds",
                                  "Audio buffered ahead of the listener when each chunk leaves (negative: late)",
                                  buckets=_HEAD, registry=r)
        self.audio_seconds = Counter("qtts_audio_seconds", "Seconds of audio sent", registry=r)
        self.step = Histogram("qtts_step_seconds", "Engine step time per frame (all live streams at once)", buckets=_STEP,
                              registry=r)
        stats = engine.stats  # the engine's published snapshot: nothing here reads its internals
        Gauge("qtts_active_streams", "Streams holding a slot", registry=r).set_function(lambda: stats().live)
        Gauge("qtts_slots", "Slots compiled into the engine", registry=r).set_function(lambda: stats().slots)
        Gauge("qtts_slot_occupancy", "Fraction of slots in use", registry=r).set_function(
            lambda: stats().live / stats().slots)
        Gauge("qtts_queue_depth", "Requests waiting for a slot", registry=r).set_function(lambda: stats().queued)
        Gauge("qtts_queue_oldest_wait_seconds", "Wait of the oldest queued request", registry=r).set_function(
            lambda: stats().oldest_wait_s)
        Gauge("qtts_streams_open", "Client streams open in the server (incl. queued)", registry=r).set_function(
            lambda: len(admission.streams))
        Gauge("qtts_min_headroom_seconds", "Smallest buffer headroom among playing streams", registry=r).set_function(
            admission.min_headroom)
        Gauge("qtts_iteration_seconds_recent", "Engine loop iteration time, recent average (EMA)",
              registry=r).set_function(lambda: stats().iteration_s)
        # beside qtts_late_chunks (late at the event loop): a stall the engine already handed out late is its plan's
        Gauge("qtts_engine_late_chunks", "Chunks the engine handed out after their listener ran dry (since start)",
              registry=r).set_function(lambda: stats().late_chunks)
        Gauge("qtts_ready", "1 when accepting work", registry=r).set_function(lambda: float(admission.accepting))
        # what a router or an autoscaler reads of this replica's room now (a warming replica's rungs grow)
        Gauge("qtts_capacity_streams", "Streams this replica could start now: the slots its compiled rungs hold, "
              "less those in use and waiting", registry=r).set_function(
            lambda: float(max(0, stats().slots - stats().live - stats().queued)))
        Gauge("qtts_compiling_programs", "Engine programs still to compile before full capacity",
              registry=r).set_function(lambda: stats().compiling)
        r.register(PauseCollector())
        self._iterations_seen = 0
        self._stats = stats

    def collect_steps(self) -> None:
        """Move new engine step samples into the histogram (called at scrape and per chunk)."""
        st = self._stats()
        new = min(st.iterations - self._iterations_seen, len(st.recent_frame_s))
        for s in st.recent_frame_s[len(st.recent_frame_s) - new:] if new > 0 else ():
            self.step.observe(s)
        self._iterations_seen = st.iterations

    def observe_request(self, endpoint: str, seconds: float, chars: int, audio_s: float) -> None:
        self.request_duration.labels(self.model, endpoint).observe(seconds)
        self.input_chars.labels(self.model).observe(chars)
        self.output_audio.labels(self.model).observe(audio_s)

    def observe_first_chunk(self, timings) -> None:
        t = timings
        if t.first_chunk is None:
            return
        self.ttfa.observe(t.first_chunk - t.submitted)
        parts = (("queue", t.submitted, t.admitted), ("prefill", t.admitted, t.prefilled),
                 ("first_frame", t.prefilled, t.first_frame), ("codec", t.first_frame, t.first_chunk))
        for name, a, b in parts:
            if a is not None and b is not None:
                self.ttfa_part.labels(name).observe(max(b - a, 0.0))
