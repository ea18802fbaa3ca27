"""Fleet sizing: replicas (and dollars) for a target load, from one replica's safe capacity."""

from __future__ import annotations

import math

# no price is a fact of the software: a placeholder that every output using it names as such
DEFAULT_PRICE_PER_HOUR = 1.0


def fleet_size(safe_capacity: float, target: float, price_per_hour: float = 0.0) -> dict:
    """Replicas with 40% headroom (`ceil(target / safe × 1.4)`) and at 60% utilisation
    (`ceil(target / safe / 0.6)`), each with its hourly and monthly (730 h) cost."""
    if safe_capacity <= 0:
        raise ValueError(f"safe capacity must be > 0 (got {safe_capacity}); no load met the SLOs, so no fleet "
                         "size can be derived")
    if target < 0 or price_per_hour < 0:
        raise ValueError("target and price_per_hour must be >= 0")
    ratio = target / safe_capacity
    # round() first: 100 / 1 * 1.4 is 140.00000000000003 in floating point, which must stay 140
    headroom = math.ceil(round(ratio * 1.4, 9))
    utilisation = math.ceil(round(ratio / 0.6, 9))
    return {
        "safe_capacity": safe_capacity, "target": target, "price_per_hour": price_per_hour,
        "headroom_40": {"replicas": headroom, "per_hour": headroom * price_per_hour,
                        "per_month": headroom * price_per_hour * 730},
        "utilisation_60": {"replicas": utilisation, "per_hour": utilisation * price_per_hour,
                           "per_month": utilisation * price_per_hour * 730},
    }
