"""Per-condition statistics: success rate, TTFA and starvation percentiles with confidence bounds, the share of
streams that underran with its binomial bounds, throughput."""

from __future__ import annotations

import collections
import math
import re

import numpy as np

from studies.playback import simulate
from studies.records import RequestRecord


def percentile(values, q: float) -> float:
    """Linear-interpolated percentile (numpy's default); NaN for no values, so a missing p95 never passes."""
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else math.nan


CONFIDENCE = 0.95  # of each one-sided bound on a percentile or a share; together they make a 90% interval


def _binom_cdfs(n: int, p: float, top: int | None = None) -> np.ndarray:
    """P(Bin(n, p) <= k) for k = 0 .. top (default n). Terms are summed in log space: at the request counts of a
    minute of Poisson arrivals (thousands) n choose k overflows a float, and p**k underflows it."""
    top = n if top is None else min(top, n)
    if p <= 0.0 or p >= 1.0:
        return np.where(np.arange(top + 1) >= (n if p >= 1.0 else 0), 1.0, 0.0)
    i = np.arange(top + 1)
    log_n = math.lgamma(n + 1)
    logs = np.array([log_n - math.lgamma(j + 1) - math.lgamma(n - j + 1) for j in i]) + i * math.log(p) \
        + (n - i) * math.log1p(-p)
    m = logs.max()
    return np.minimum(np.exp(m) * np.cumsum(np.exp(logs - m)), 1.0)


def _binom_cdf(k: int, n: int, p: float) -> float:
    return 0.0 if k < 0 else float(_binom_cdfs(n, p, k)[-1])


def percentile_bounds(values, q: float = 95, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Distribution-free bounds on the q-th percentile from order statistics: the true percentile is at least
    `lower` and at most `upper`, each with probability >= `confidence` whatever the distribution. With too few
    values a bound cannot be had: lower is -inf, upper +inf (95% upper bound on p95 needs 59 values)."""
    xs = sorted(v for v in values if v is not None)
    n, p = len(xs), q / 100
    if n == 0:
        return -math.inf, math.inf
    # the k-th smallest (1-based) is above the percentile unless k or more values fall below it: P(Bin(n, p) < k)
    below = _binom_cdfs(n, p)  # below[k - 1] = P(Bin(n, p) <= k - 1)
    upper = next((xs[k - 1] for k in range(1, n + 1) if below[k - 1] >= confidence), math.inf)
    lower = next((xs[k - 1] for k in range(n, 0, -1) if 1 - below[k - 1] >= confidence), -math.inf)
    return float(lower), float(upper)


def share_bounds(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Clopper-Pearson (exact binomial) bounds on a share seen in k of n: the true share is at least `lower` and at
    most `upper`, each with probability >= `confidence`. Exact, not Wilson's approximation, because the contract is
    judged at k = 0, where the upper bound is 1 - (1 - confidence)^(1/n), about 3/n at 95% (the rule of three).
    NaN for n = 0: no stream, no share."""
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return math.nan, math.nan
    alpha = 1 - confidence
    # lower: P(Bin(n, p) >= k) = alpha; upper: P(Bin(n, p) <= k) = alpha; both sides rise with p
    lower = 0.0 if k == 0 else _root(lambda p: 1 - _binom_cdf(k - 1, n, p) - alpha)
    upper = 1.0 if k == n else _root(lambda p: alpha - _binom_cdf(k, n, p))
    return lower, upper


def _root(f) -> float:
    """Where an increasing f crosses 0 in [0, 1], by bisection to 2^-50."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


# where in a stream (seconds of its audio played) its first underrun came: its first chunks, before a lead could
# build, or once under way (a pause of the server, or a lead that did not hold)
STALL_AGES = ((0.25, "under_0.25s"), (1.0, "0.25_to_1s"), (math.inf, "over_1s"))


def first_underrun_at(ages: list[float | None]) -> dict[str, int]:
    """Streams that underran, by how much of their audio had played when they first ran dry (`STALL_AGES`)."""
    out = dict.fromkeys((name for _, name in STALL_AGES), 0)
    for age in ages:
        if age is not None:
            out[next(name for bound, name in STALL_AGES if age < bound)] += 1
    return out


def refusals(measured: list[RequestRecord]) -> dict:
    """How the server refused a condition's requests: `refused`, requests it never admitted (their last send
    refused too) and `refusal_statuses`, their statuses; `admitted_after_refusal`, requests it admitted after
    refusing an earlier send (their wait counts in their TTFA); `refusal_reason`, the most common reason it gave
    (numbers aside), as it said it the first time."""
    refused = [r for r in measured if r.status in (429, 503)]
    reasons = [r.refusal for r in measured if r.refusal]
    shapes = collections.Counter(map(_shape, reasons))
    common = shapes.most_common(1)[0][0] if shapes else None
    return {"refused": len(refused), "refusal_statuses": sorted({r.status for r in refused}),
            "admitted_after_refusal": sum(r.ok and r.refusals > 0 for r in measured),
            "refusal_reason": next((why for why in reasons if _shape(why) == common), None)}


def _shape(reason: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "#", reason)


def summarize(records: list[RequestRecord], buffer_ms: float = 0.0) -> dict:
    """One condition's numbers. Warm-up records are ignored; starvation is over valid streams only, at `buffer_ms`.
    `underrun_requests` counts valid streams with any stall after their first audio at zero buffer, whatever
    `buffer_ms`: the zero-underrun contract's client plays from the first byte."""
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
    dry = [simulate(r.chunks, r.sample_rate) for r in ok] if buffer_ms else plays
    underran = sum(p.underruns > 0 for p in dry)
    wall = max((r.end_s or r.send_s) for r in measured) - min(r.send_s for r in measured)
    audio = sum(p.audio_s for p in plays)
    first = measured[0]
    return {
        "condition": first.condition, "mode": first.mode, "load": first.load, "buffer_ms": buffer_ms,
        "requests": len(measured), "succeeded": len(ok), "success_rate": len(ok) / len(measured),
        "rejected_429": sum(r.status == 429 for r in measured), **refusals(measured),
        "ttfa_p50_ms": percentile(ttfa_ms, 50), "ttfa_p95_ms": percentile(ttfa_ms, 95),
        "ttfa_p95_ci_ms": percentile_bounds(ttfa_ms), "ttfa_p99_ms": percentile(ttfa_ms, 99),
        "start_p95_ms": percentile(start_ms, 95),
        "starvation_p50_ms": percentile(starv_ms, 50), "starvation_p95_ms": percentile(starv_ms, 95),
        "starvation_p95_ci_ms": percentile_bounds(starv_ms),
        "starvation_max_ms": max(starv_ms, default=math.nan),
        "longest_stall_p95_ms": percentile([1000 * p.longest_stall_s for p in plays], 95),
        "underruns_mean": float(np.mean([p.underruns for p in plays])) if plays else math.nan,
        "underrun_requests": underran, "underrun_share": underran / len(ok) if ok else math.nan,
        "underrun_share_ci": share_bounds(underran, len(ok)),
        "first_underrun_at": first_underrun_at([p.first_stall_at_s for p in dry]),
        "wall_s": wall, "throughput_rps": len(ok) / wall if wall > 0 else math.nan,
        "audio_s_per_s": audio / wall if wall > 0 else math.nan,
        "errors": sorted({r.invalid for r in measured if r.invalid}),
    }
