"""SLOs and safe capacity: the largest tested load at which a replica meets every SLO with confidence; beside
them the field's zero-underrun contract and its own capacity."""

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
        return {**verdicts, "overall": _overall(verdicts)}

    def check(self, summary: dict) -> dict:
        """True per SLO that is met with confidence (see `judge`), and "safe" when all are."""
        v = self.judge(summary)
        return {"success": v["success"] == "pass", "ttfa": v["ttfa"] == "pass",
                "starvation": v["starvation"] == "pass", "safe": v["overall"] == "pass"}


@dataclasses.dataclass(frozen=True)
class Contract:
    """The field's zero-underrun contract, judged beside the SLO, never instead of it: its client plays from the
    first byte with no buffer and rejects a run with any stall after the first audio or any failed request."""

    ttfa_p95_ms: float = 100.0

    def __post_init__(self):
        if self.ttfa_p95_ms <= 0:
            raise ValueError(f"ttfa_p95_ms must be > 0, got {self.ttfa_p95_ms}")

    def judge(self, summary: dict) -> dict:
        """Per criterion "pass", "fail" or "undecided", and "overall". Success (every measured request, a 429
        included, as `success_rate` counts them) and underruns (no valid stream with a stall) are counts: one
        miss fails. The TTFA p95 is judged on its confidence bounds, as the SLO's is."""
        verdicts = {"success": "pass" if summary["success_rate"] == 1 else "fail",
                    "underruns": "pass" if summary["underrun_requests"] == 0 else "fail",
                    "ttfa": _bounded(summary["ttfa_p95_ci_ms"], self.ttfa_p95_ms)}
        return {**verdicts, "overall": _overall(verdicts)}


def _overall(verdicts: dict) -> str:
    """One fail decides; otherwise one undecided leaves the whole undecided."""
    values = set(verdicts.values())
    return "fail" if "fail" in values else "undecided" if "undecided" in values else "pass"


def _bounded(bounds, target: float) -> str:
    lower, upper = bounds
    if upper <= target:  # NaN bounds (no valid stream) compare False both ways: undecided
        return "pass"
    return "fail" if lower > target else "undecided"


def safe_capacity(summaries: list[dict], slo: SLO = SLO()) -> float:
    """Largest load such that it and every lower tested load are safe (a lucky pass above a failure does not
    count); 0 when even the lowest load fails. All summaries must share one mode, so loads are comparable."""
    return _capacity(summaries, lambda s: slo.check(s)["safe"])


def zero_underrun_capacity(summaries: list[dict], contract: Contract = Contract()) -> float:
    """`safe_capacity` under the zero-underrun contract: the largest load that, with every lower tested load,
    passes it; a pass above a failure does not count."""
    return _capacity(summaries, lambda s: contract.judge(s)["overall"] == "pass")


def _capacity(summaries: list[dict], passes) -> float:
    if not summaries:
        raise ValueError("no conditions to judge")
    modes = {s["mode"] for s in summaries}
    if len(modes) != 1:
        raise ValueError(f"safe capacity needs one load mode, got {sorted(modes)}")
    safe = 0.0
    for s in sorted(summaries, key=lambda s: s["load"]):
        if not passes(s):
            break
        safe = s["load"]
    return safe
