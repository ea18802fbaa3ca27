"""What to scale on, measured: of the signals a study sampled while its load ramped (`studies.scrape`), the one
that best tells the last load that still meets the SLO (or the zero-underrun contract) from the first that breaks
it, and the threshold to set on it.

A signal's value at a load is the median of its samples there; its spread is their standard deviation. Its
separation is the step from the last passing load to the first failing one, in the direction that means trouble,
over the two loads' pooled spread: a signal that moves by much more than it wanders within a load crosses its
threshold reliably before the breach. The threshold is the last passing load's upper quartile (lower, for a
signal that falls with load): a replica sits below it most of the time at its last safe load. The choice is
"undecided" when the data cannot tell: no load passes, none fails above it, or no signal separates the two loads
by more than its spread.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

MIN_SEPARATION = 1.0  # a step smaller than the signal's own spread within a load does not tell the loads apart


@dataclasses.dataclass(frozen=True)
class Signal:
    name: str
    label: str  # what it measures, with its unit, for the report
    rises: bool  # True: a larger value means more load (scale out above the threshold); False: below it
    source: str  # "server" (/metrics: an autoscaler can read it), "client" (the study's clients) or "gpu"


# in order of preference when two separate equally: what a replica publishes first, what only a study sees last
SIGNALS = (
    Signal("streams_open", "streams open in the server (queued, generating or sending)", True, "server"),
    Signal("active_streams", "streams generating (holding a slot)", True, "server"),
    Signal("capacity_streams", "streams the replica could start now", False, "server"),
    Signal("queue_depth", "requests waiting for a slot", True, "server"),
    Signal("queue_oldest_wait_s", "oldest queued request's wait (s)", True, "server"),
    Signal("min_headroom_s", "smallest audio lead of a playing stream (s)", False, "server"),
    Signal("iteration_s", "engine iteration time, recent average (s)", True, "server"),
    Signal("engine_late_chunks_per_s", "chunks the engine made after their listener ran dry (per s)", True, "server"),
    Signal("late_chunks_per_s", "chunks sent after their playback deadline (per s)", True, "server"),
    Signal("ttfa_p95_s", "p95 time to first audio over each scrape interval (s)", True, "server"),
    Signal("streams_playing", "streams still playing at the client (generating or not)", True, "client"),
    Signal("streams_in_flight", "requests in flight at the client (incl. waiting out a refusal)", True, "client"),
    Signal("gpu_util_pct", "GPU utilisation on the study's machine (%)", True, "gpu"),
)
GAUGES = {"streams_open": "qtts_streams_open", "active_streams": "qtts_active_streams",
          "capacity_streams": "qtts_capacity_streams", "queue_depth": "qtts_queue_depth",
          "queue_oldest_wait_s": "qtts_queue_oldest_wait_seconds", "min_headroom_s": "qtts_min_headroom_seconds",
          "iteration_s": "qtts_iteration_seconds_recent"}
RATES = {"engine_late_chunks_per_s": "qtts_engine_late_chunks", "late_chunks_per_s": "qtts_late_chunks_total"}
# signals Ray Serve's autoscaler can aim at: its one per-replica metric is ongoing requests, and a replica's ongoing
# requests are its open streams (a slot's stream, or one waiting for a slot)
ONGOING = ("streams_open", "active_streams")


def _p95(buckets: list[tuple[float, float]]) -> float | None:
    """The p95 of a histogram's cumulative (upper bound, count) buckets, interpolated within its bucket as
    Prometheus's histogram_quantile does; None without observations."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank, lower, below = 0.95 * total, 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower  # beyond the last finite bound: that bound is all that is known
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return None


def values(samples: list[dict]) -> dict[str, dict[float, list[float]]]:
    """Per signal, per load, its values: a gauge's at each good scrape, a counter's rate and the TTFA p95 over each
    interval between two good scrapes of the same load, the client's counts and GPU use at each sample."""
    out = {s.name: {} for s in SIGNALS}

    def add(name, load, v):
        if v is not None and math.isfinite(v):
            out[name].setdefault(load, []).append(float(v))

    by_load: dict[float, list[dict]] = {}
    for s in samples:
        by_load.setdefault(s["load"], []).append(s)
    for load, group in by_load.items():
        group.sort(key=lambda s: s["t_s"])
        good = [s for s in group if s.get("error") is None]
        for s in good:
            for name, metric in GAUGES.items():
                add(name, load, s["metrics"].get(metric))
        for a, b in zip(good, good[1:]):
            dt = b["t_s"] - a["t_s"]
            for name, metric in RATES.items():
                if dt > 0 and a["metrics"].get(metric) is not None and b["metrics"].get(metric) is not None:
                    add(name, load, (b["metrics"][metric] - a["metrics"][metric]) / dt)
            before = dict(a["ttfa_buckets"])
            add("ttfa_p95_s", load, _p95([(float(le), n - before.get(le, 0.0)) for le, n in b["ttfa_buckets"]]))
        for s in group:
            for name, v in (s.get("client") or {}).items():
                add(name, load, v)
            add("gpu_util_pct", load, s.get("gpu_util_pct"))
    return out


def boundary(conditions: list[dict], key: str) -> tuple[float | None, float | None, str | None]:
    """(the last load that passes `key` ("verdict" or "contract_verdict") with every load below it, the first load
    above it that fails, why there is no such pair or None). Undecided loads between the two are skipped."""
    ordered = sorted(conditions, key=lambda c: c["load"])
    if len(ordered) < 2:
        return None, None, "only one load was measured"
    last = None
    for c in ordered:
        if c[key]["overall"] != "pass":
            break
        last = c["load"]
    if last is None:
        return None, None, f"no load passes (load {ordered[0]['load']:g} is {ordered[0][key]['overall']})"
    fail = next((c["load"] for c in ordered if c["load"] > last and c[key]["overall"] == "fail"), None)
    if fail is None:
        return last, None, f"no load fails above load {last:g}"
    return last, fail, None


def row(signal: Signal, at_pass: list[float], at_fail: list[float]) -> dict:
    """One signal at the last passing and the first failing load: medians, separation, threshold and the share of the
    failing load's values beyond it (how reliably the threshold is crossed there)."""
    out = {"signal": signal.name, "label": signal.label, "source": signal.source,
           "scale_out_when": "above" if signal.rises else "below", "samples": [len(at_pass), len(at_fail)],
           "pass_value": None, "fail_value": None, "separation": None, "threshold": None, "fail_beyond_share": None}
    if not at_pass or not at_fail:
        return out
    p, f = np.asarray(at_pass), np.asarray(at_fail)
    sign = 1.0 if signal.rises else -1.0
    step = sign * (float(np.median(f)) - float(np.median(p)))
    spread = math.sqrt((p.var() + f.var()) / 2)
    threshold = float(np.percentile(p, 75 if signal.rises else 25))
    return {**out, "pass_value": float(np.median(p)), "fail_value": float(np.median(f)),
            "separation": step / spread if spread > 0 else (math.inf if step > 0 else 0.0 if step == 0 else -math.inf),
            "threshold": threshold, "fail_beyond_share": float(np.mean(sign * (f - threshold) > 0))}


def choose(conditions: list[dict], samples: list[dict], key: str = "verdict") -> dict:
    """The signal to scale on for one server's sweep, judged on `key` ("verdict": the SLO, or "contract_verdict":
    the zero-underrun contract): `status` "chosen" or "undecided" (with `reason`), the chosen `signal`, its
    `threshold` and direction, one row per signal, and `fleet_safe_capacity`, the number for `qtts-jax cluster
    --safe-capacity` when the signal is one Ray Serve's autoscaler counts (`ONGOING`), else None."""
    last, fail, why = boundary(conditions, key)
    per_load = values(samples)
    rows = [row(s, per_load[s.name].get(last, []), per_load[s.name].get(fail, [])) for s in SIGNALS]
    out = {"judged_on": "slo" if key == "verdict" else "contract", "last_pass_load": last, "first_fail_load": fail,
           "rows": rows, "status": "undecided", "reason": why, "signal": None, "threshold": None,
           "scale_out_when": None, "separation": None, "fleet_safe_capacity": None}
    if why is None and not any(r["separation"] is not None for r in rows):
        errors = sorted({s["error"] for s in samples if s.get("error")})
        out["reason"] = "no signal was sampled at both loads" + (f" ({'; '.join(errors[:2])})" if errors else "")
    elif why is None:
        # the most separated; among equals (two that never overlap, say), the first in SIGNALS' order
        best = max((r for r in rows if r["separation"] is not None), key=lambda r: r["separation"])
        if best["separation"] < MIN_SEPARATION:
            out["reason"] = (f"no signal separates load {last:g} from load {fail:g} by more than its spread "
                             f"(best: {best['signal']}, {best['separation']:.2f})")
        else:
            out.update(status="chosen", reason=None, signal=best["signal"], threshold=best["threshold"],
                       scale_out_when=best["scale_out_when"], separation=best["separation"],
                       fleet_safe_capacity=best["threshold"] if best["signal"] in ONGOING else None)
    return out


def choices(conditions: list[dict], samples: list[dict]) -> dict:
    """The choice on the SLO and on the zero-underrun contract, for summary.json."""
    return {"slo": choose(conditions, samples, "verdict"), "contract": choose(conditions, samples, "contract_verdict")}
