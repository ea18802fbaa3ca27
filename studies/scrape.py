"""The server's own signals while a load runs: its `/metrics` scraped every half second, and beside each scrape what
the client saw at that instant (its streams in flight and still playing), so a study can say which signal warns
before the SLO breaks (`studies.scaling`).

The scrape runs on a thread of its own with a blocking client: the load's event loop times every chunk and must
not wait for a scrape or its parse. A server without `/metrics`, a refused key or a failed scrape gives a sample
with null values and the reason, never an error. GPU use comes from `nvidia-smi` on the study's machine, so it
describes the server's GPU only when the server runs there (as `studies.gpu` says).
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from studies.gpu import QUERY, nvidia_smi, parse_sample
from studies.load import key_headers
from studies.playback import simulate
from studies.records import RequestRecord

INTERVAL_S = 0.5
# the gauges and counters a sample keeps, as /metrics names them (serving/monitoring/metrics.py)
SCALARS = ("qtts_active_streams", "qtts_streams_open", "qtts_queue_depth", "qtts_queue_oldest_wait_seconds",
           "qtts_capacity_streams", "qtts_min_headroom_seconds", "qtts_iteration_seconds_recent",
           "qtts_engine_late_chunks", "qtts_late_chunks_total", "qtts_slot_occupancy")
TTFA = "qtts_ttfa_seconds"  # a histogram: its cumulative buckets are kept, so any window's p95 can be read


def parse(text: str) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Prometheus text -> (the `SCALARS` it has, by name; the TTFA histogram's cumulative buckets as (le, count)).
    Raises ValueError on text that is not Prometheus's."""
    scalars, buckets = {}, []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in SCALARS and not s.labels:
                scalars[s.name] = float(s.value)
            elif s.name == f"{TTFA}_bucket":
                buckets.append((s.labels["le"], float(s.value)))
    return scalars, buckets


def gpu_util() -> tuple[float | None, str | None]:
    """(mean utilisation % of this machine's GPUs, None) or (None, why not)."""
    exe = nvidia_smi()
    if exe is None:
        return None, "nvidia-smi not found"
    try:
        out = subprocess.run([exe, *QUERY], capture_output=True, text=True, timeout=5, check=True).stdout
        rows = parse_sample(out)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return None, f"nvidia-smi: {exc}"[:200]
    return sum(u for u, _ in rows) / len(rows), None


class MetricsSampler:
    """Scrapes `url`/metrics every `interval_s` while `running(...)` is open: once at its start, then each interval,
    then once at its end, so even a short load has two samples. `take()` hands over the samples and forgets them."""

    def __init__(self, url: str, interval_s: float = INTERVAL_S, gpu: bool = True, timeout_s: float = 2.0):
        self.url, self.interval_s, self.gpu, self.timeout_s = url.rstrip("/"), interval_s, gpu, timeout_s
        self.samples: list[dict] = []

    def sample(self, t0: float, tag: dict) -> dict:
        """One scrape: times on the load's clock (seconds since `t0`, a perf_counter reading), as its records' are."""
        t = time.perf_counter() - t0
        out = {**tag, "t_s": t, "metrics": dict.fromkeys(SCALARS), "ttfa_buckets": [], "error": None}
        try:
            req = urllib.request.Request(f"{self.url}/metrics", headers=key_headers())
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                scalars, out["ttfa_buckets"] = parse(resp.read().decode("utf-8", errors="replace"))
            out["metrics"].update(scalars)
            if not scalars:
                out["error"] = "no qtts_ metrics in /metrics"
        except urllib.error.HTTPError as exc:
            out["error"] = f"HTTP {exc.code}: {exc.reason}"
        except (OSError, ValueError) as exc:  # URLError, a timeout, a reset, text that is not Prometheus's
            out["error"] = f"{type(exc).__name__}: {exc}"[:200]
        out["gpu_util_pct"], out["gpu_error"] = gpu_util() if self.gpu else (None, "disabled")
        return out

    @contextlib.contextmanager
    def running(self, t0: float, **tag):
        """Samples on a thread until the block ends; `tag` (server, condition, load) goes into every sample."""
        stop = threading.Event()

        def loop():
            while True:
                self.samples.append(self.sample(t0, tag))
                if stop.wait(self.interval_s):
                    break

        thread = threading.Thread(target=loop, name="metrics-sampler", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            self.samples.append(self.sample(t0, tag))

    def take(self) -> list[dict]:
        samples, self.samples = self.samples, []
        return samples


def with_client_view(samples: list[dict], records: list[RequestRecord]) -> list[dict]:
    """Each sample with `client`: the load's streams in flight at the client then (sent, not yet ended: waiting,
    refused and waiting to retry, or receiving) and still playing there (first audio arrived, its zero-buffer
    player not yet done: the server no longer sees a stream whose last bytes it has sent)."""
    spans = [(r.first_byte_s, p.start_s + p.audio_s + p.starvation_s)
             for r in records if r.ok for p in [simulate(r.chunks, r.sample_rate)]]
    return [{**s, "client": {
        "streams_in_flight": sum(r.send_s <= s["t_s"] < (r.end_s or r.send_s) for r in records),
        "streams_playing": sum(a <= s["t_s"] < b for a, b in spans)}} for s in samples]
