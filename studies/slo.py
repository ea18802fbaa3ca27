"""SLOs and safe capacity: the largest tested load at which a replica still meets every SLO."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class SLO:
    min_success_rate: float = 0.99
    ttfa_p95_ms: float = 300.0
    starvation_p95_ms: float = 100.0

    def __post_init__(self):
        if not 0 < self.min_success_rate <= 1:
            raise ValueError(f"min_success_rate must be in (0, 1], got {self.min_success_rate}")
        if self.ttfa_p95_ms <= 0 or self.starvation_p95_ms < 0:
            raise ValueError("ttfa_p95_ms must be > 0 and starvation_p95_ms >= 0")

    def check(self, summary: dict) -> dict:
        """Pass/fail per SLO for one condition summary; a NaN percentile (no valid stream) fails."""
        ttfa, starv = summary["ttfa_p95_ms"], summary["starvation_p95_ms"]
        checks = {
            "success": summary["success_rate"] >= self.min_success_rate,
            "ttfa": not math.isnan(ttfa) and ttfa <= self.ttfa_p95_ms,
            "starvation": not math.isnan(starv) and starv <= self.starvation_p95_ms,
        }
        return {**checks, "safe": all(checks.values())}


def safe_capacity(summaries: list[dict], slo: SLO = SLO()) -> float:
    """Largest load such that it and every lower tested load are safe (a lucky pass above a failure does not
    count); 0 when even the lowest load fails. All summaries must share one mode, so loads are comparable."""
    if not summaries:
        raise ValueError("no conditions to judge")
    modes = {s["mode"] for s in summaries}
    if len(modes) != 1:
        raise ValueError(f"safe capacity needs one load mode, got {sorted(modes)}")
    safe = 0.0
    for s in sorted(summaries, key=lambda s: s["load"]):
        if not slo.check(s)["safe"]:
            break
        safe = s["load"]
    return safe
