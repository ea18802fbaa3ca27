"""SLOs and safe capacity: the largest tested load at which a replica meets every SLO with confidence."""

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

    def judge(self, summary: dict) -> dict:
        """Per SLO "pass", "fail" or "undecided", and "overall". A p95 passes only if its upper confidence bound
        meets the target and fails only if its lower bound misses it, so a verdict is not decided by one slow
        request; between the two (or without valid streams) it is undecided. The success rate is a count."""
        verdicts = {"success": "pass" if summary["success_rate"] >= self.min_success_rate else "fail",
                    "ttfa": _bounded(summary["ttfa_p95_ci_ms"], self.ttfa_p95_ms),
                    "starvation": _bounded(summary["starvation_p95_ci_ms"], self.starvation_p95_ms)}
        values = set(verdicts.values())
        overall = "fail" if "fail" in values else "undecided" if "undecided" in values else "pass"
        return {**verdicts, "overall": overall}

    def check(self, summary: dict) -> dict:
        """True per SLO that is met with confidence (see `judge`), and "safe" when all are."""
        v = self.judge(summary)
        return {"success": v["success"] == "pass", "ttfa": v["ttfa"] == "pass",
                "starvation": v["starvation"] == "pass", "safe": v["overall"] == "pass"}


def _bounded(bounds, target: float) -> str:
    lower, upper = bounds
    if upper <= target:  # NaN bounds (no valid stream) compare False both ways: undecided
        return "pass"
    return "fail" if lower > target else "undecided"


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
