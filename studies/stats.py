"""Per-condition statistics: success rate, TTFA and starvation percentiles, throughput."""

from __future__ import annotations

import math

import numpy as np

from studies.playback import simulate
from studies.records import RequestRecord


def percentile(values, q: float) -> float:
    """Linear-interpolated percentile (numpy's default); NaN for no values, so a missing p95 never passes."""
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else math.nan


def summarize(records: list[RequestRecord], buffer_ms: float = 0.0) -> dict:
    """One condition's numbers. Warm-up records are ignored; starvation is over valid streams only."""
    measured = [r for r in records if not r.warmup]
    if not measured:
        raise ValueError("no measured (non-warm-up) records to summarize")
    conditions = {r.condition for r in measured}
    if len(conditions) != 1:
        raise ValueError(f"records mix conditions {sorted(conditions)}; summarize one at a time")
    ok = [r for r in measured if r.ok]
    plays = [simulate(r.chunks, r.sample_rate, buffer_ms) for r in ok]
    ttfa_ms = [1000 * r.ttfa_s for r in ok]
    start_ms = [1000 * (p.start_s - r.send_s) for r, p in zip(ok, plays)]
    starv_ms = [1000 * p.starvation_s for p in plays]
    wall = max((r.end_s or r.send_s) for r in measured) - min(r.send_s for r in measured)
    audio = sum(p.audio_s for p in plays)
    first = measured[0]
    return {
        "condition": first.condition, "mode": first.mode, "load": first.load, "buffer_ms": buffer_ms,
        "requests": len(measured), "succeeded": len(ok), "success_rate": len(ok) / len(measured),
        "rejected_429": sum(r.status == 429 for r in measured),
        "ttfa_p50_ms": percentile(ttfa_ms, 50), "ttfa_p95_ms": percentile(ttfa_ms, 95),
        "ttfa_p99_ms": percentile(ttfa_ms, 99), "start_p95_ms": percentile(start_ms, 95),
        "starvation_p50_ms": percentile(starv_ms, 50), "starvation_p95_ms": percentile(starv_ms, 95),
        "starvation_max_ms": max(starv_ms, default=math.nan),
        "longest_stall_p95_ms": percentile([1000 * p.longest_stall_s for p in plays], 95),
        "underruns_mean": float(np.mean([p.underruns for p in plays])) if plays else math.nan,
        "wall_s": wall, "throughput_rps": len(ok) / wall if wall > 0 else math.nan,
        "audio_s_per_s": audio / wall if wall > 0 else math.nan,
        "errors": sorted({r.invalid for r in measured if r.invalid}),
    }
