"""What to scale on, from hand-made /metrics samples: the analysis (studies.scaling) picks the signal that separates
the last passing load from the first failing one, says "undecided" when the data cannot tell, the report and the
fleet take its threshold; the scrape parses Prometheus text and turns a missing /metrics into a reason."""

from __future__ import annotations

import json
import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fleet.app import safe_capacity_from
from studies.scaling import SIGNALS, boundary, choices, choose, values
from studies.scrape import SCALARS, MetricsSampler, parse
from studies.verdict import scaling_table, scaling_text


def cond(load, slo="pass", contract="pass"):
    return {"load": load, "mode": "closed", "verdict": {"overall": slo}, "contract_verdict": {"overall": contract}}


def sample(load, t, error=None, buckets=(), client=None, gpu=None, **metrics):
    m = dict.fromkeys(SCALARS)
    m.update({f"qtts_{k}": v for k, v in metrics.items()})
    return {"server": "s", "condition": f"closed:{load}", "load": load, "t_s": t, "metrics": m,
            "ttfa_buckets": [list(b) for b in buckets], "error": error, "client": client or {},
            "gpu_util_pct": gpu, "gpu_error": None if gpu is not None else "nvidia-smi not found"}


def ramp():
    """Loads 1, 2 pass, 4 fails. Open streams wander within a load and overlap between 2 and 4; the queue is empty
    at 2 and holds 2-3 at 4; generating streams sit at the 2 slots from load 2 on: only the queue tells."""
    out = []
    for load, opens, queue, active in ((1, [1, 0, 1, 1], [0, 0, 0, 0], [1, 0, 1, 1]),
                                       (2, [1, 3, 2, 2], [0, 0, 0, 0], [2, 2, 2, 2]),
                                       (4, [2, 4, 3, 3], [2, 3, 2, 3], [2, 2, 2, 2])):
        out += [sample(load, 10 * load + i, streams_open=o, queue_depth=q, active_streams=a, capacity_streams=2 - a)
                for i, (o, q, a) in enumerate(zip(opens, queue, active))]
    return out


def test_the_signal_that_separates_the_last_passing_load_from_the_first_failing_one_is_chosen_with_its_threshold():
    choice = choose([cond(1), cond(2), cond(4, "fail")], ramp())
    assert (choice["status"], choice["signal"], choice["last_pass_load"], choice["first_fail_load"]) == (
        "chosen", "queue_depth", 2, 4)
    assert choice["threshold"] == 0 and choice["scale_out_when"] == "above"
    assert choice["separation"] == pytest.approx(2.5 / math.sqrt(0.125))  # medians 0 -> 2.5, variances 0 and 0.25
    assert choice["fleet_safe_capacity"] is None  # Ray Serve cannot aim at a queue
    rows = {r["signal"]: r for r in choice["rows"]}
    # open streams: medians 2 -> 3, standard deviations sqrt(0.5) both: a step of 1 over a spread of 0.707
    assert rows["streams_open"]["pass_value"] == 2 and rows["streams_open"]["fail_value"] == 3
    assert rows["streams_open"]["separation"] == pytest.approx(1 / math.sqrt(0.5))
    assert rows["streams_open"]["threshold"] == pytest.approx(2.25)  # load 2's upper quartile of 1, 2, 2, 3
    assert rows["streams_open"]["fail_beyond_share"] == 0.75  # 4, 3, 3 of 2, 4, 3, 3
    assert rows["active_streams"]["separation"] == 0  # pinned at the slots: no warning at all
    assert rows["capacity_streams"]["scale_out_when"] == "below"
    assert rows["gpu_util_pct"]["pass_value"] is None and rows["gpu_util_pct"]["samples"] == [0, 0]
    table = scaling_table(choice)
    assert table.loc["queue_depth", "threshold"] == "> 0" and table.loc["queue_depth", "separation"] == "7.07"
    assert table.loc["streams_open", "at load 2 (passes)"] == "2" and len(table) == len(SIGNALS)


def test_open_streams_chosen_are_the_number_the_fleet_autoscales_on(tmp_path):
    samples = [sample(2, i, streams_open=v) for i, v in enumerate([5, 6, 6, 7])]
    samples += [sample(4, 10 + i, streams_open=v) for i, v in enumerate([11, 12, 12, 13])]
    conditions = [cond(2), cond(4, "fail")]
    choice = choose(conditions, samples)
    assert (choice["signal"], choice["threshold"], choice["fleet_safe_capacity"]) == ("streams_open", 6.25, 6.25)
    server = {"label": "gpu", "scale_signal": choices(conditions, samples)}
    text = scaling_text(server)
    assert "Scale on `streams_open` (gpu, the SLO)**: scale out when it is above 6.25" in text
    assert "--safe-capacity 6.25" in text
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"mode": "open-poisson", "safe_capacity": 2.0, "scale_signal": server["scale_signal"]}))
    assert safe_capacity_from(str(path))[0] == 6.25


def test_a_falling_signal_gets_the_lower_quartile_and_scales_out_below_it():
    samples = [sample(1, i, min_headroom_seconds=v) for i, v in enumerate([1.0, 1.2, 0.9, 1.1])]
    samples += [sample(2, 10 + i, min_headroom_seconds=v) for i, v in enumerate([0.1, -0.1, 0.0, 0.05])]
    choice = choose([cond(1), cond(2, "fail")], samples)
    assert (choice["signal"], choice["scale_out_when"]) == ("min_headroom_s", "below")
    assert choice["threshold"] == pytest.approx(0.975) and choice["separation"] > 5


def test_rates_and_the_ttfa_p95_come_from_the_differences_between_scrapes_of_one_load():
    b0 = [("0.1", 0), ("0.3", 0), ("+Inf", 0)]
    b1 = [("0.1", 10), ("0.3", 20), ("+Inf", 20)]  # 10 under 0.1 s, 10 between: p95 = 0.1 + 0.2 * 9 / 10
    samples = [sample(1, 0.0, engine_late_chunks=3, late_chunks_total=0, buckets=b0),
               sample(1, 0.5, engine_late_chunks=5, late_chunks_total=1, buckets=b1),
               sample(1, 1.0, error="HTTP 404: Not Found"),  # a failed scrape is no value, not a zero
               sample(2, 9.0, client={"streams_playing": 3, "streams_in_flight": 2}, gpu=40.0)]
    v = values(samples)
    assert v["engine_late_chunks_per_s"] == {1: [4.0]} and v["late_chunks_per_s"] == {1: [2.0]}
    assert v["ttfa_p95_s"][1] == [pytest.approx(0.28)]
    assert v["streams_playing"] == {2: [3.0]} and v["streams_in_flight"] == {2: [2.0]}
    assert v["gpu_util_pct"] == {2: [40.0]}


@pytest.mark.parametrize("conditions, reason", [
    ([cond(1)], "only one load"),
    ([cond(1), cond(2)], "no load fails above load 2"),
    ([cond(1, "fail"), cond(2, "fail")], "no load passes"),
    ([cond(1), cond(2, "undecided")], "no load fails above load 1"),
])
def test_undecided_when_the_loads_cannot_tell(conditions, reason):
    choice = choose(conditions, ramp())
    assert choice["status"] == "undecided" and reason in choice["reason"] and choice["signal"] is None


def test_undecided_when_no_signal_steps_beyond_its_spread_or_nothing_was_sampled():
    samples = [sample(1, i, streams_open=v) for i, v in enumerate([1, 5, 2, 6])]
    samples += [sample(2, 10 + i, streams_open=v) for i, v in enumerate([2, 6, 3, 5])]
    choice = choose([cond(1), cond(2, "fail")], samples)
    assert choice["status"] == "undecided" and "by more than its spread" in choice["reason"]
    dead = [sample(load, 0, error="HTTP 404: Not Found") for load in (1, 2)]
    choice = choose([cond(1), cond(2, "fail")], dead)
    assert choice["status"] == "undecided" and "HTTP 404" in choice["reason"]
    assert "undecided**: " in scaling_text({"label": "x", "scale_signal": choices([cond(1), cond(2, "fail")], dead)})


def test_the_contract_is_judged_on_its_own_boundary():
    conditions = [cond(1), cond(2, contract="fail"), cond(4, "fail", "fail")]
    assert boundary(conditions, "verdict")[:2] == (2, 4)
    assert boundary(conditions, "contract_verdict")[:2] == (1, 2)
    both = choices(conditions, ramp())
    assert both["slo"]["signal"] == "queue_depth"
    assert both["contract"]["signal"] == "active_streams"  # 1 -> 2 generating: the contract breaks as the slots fill


def test_the_fleet_falls_back_to_a_closed_loop_safe_capacity_and_refuses_without_one(tmp_path):
    path = tmp_path / "summary.json"
    scale = choices([cond(1), cond(2), cond(4, "fail")], ramp())  # queue depth: Ray Serve cannot scale on it
    path.write_text(json.dumps({"mode": "closed", "safe_capacity": 2, "scale_signal": scale}))
    safe, why = safe_capacity_from(str(path))
    assert safe == 2 and "queue_depth" in why and "cannot scale on" in why
    path.write_text(json.dumps({"mode": "open-poisson", "safe_capacity": 2, "scale_signal": scale}))
    with pytest.raises(ValueError, match="no closed-loop safe capacity"):
        safe_capacity_from(str(path))


def test_scrape_parses_the_servers_metrics_and_a_failed_scrape_is_a_reason():
    r = CollectorRegistry()
    Gauge("qtts_queue_depth", "q", registry=r).set(3)
    Gauge("qtts_other", "not kept", registry=r).set(1)
    Counter("qtts_late_chunks", "c", registry=r).inc(2)
    Histogram("qtts_ttfa_seconds", "t", buckets=(0.1, 0.3), registry=r).observe(0.2)
    scalars, buckets = parse(generate_latest(r).decode())
    assert scalars == {"qtts_queue_depth": 3.0, "qtts_late_chunks_total": 2.0}
    assert buckets == [("0.1", 0.0), ("0.3", 1.0), ("+Inf", 1.0)]
    s = MetricsSampler("http://127.0.0.1:9", gpu=False, timeout_s=1).sample(0.0, {"load": 1})
    assert s["error"] and s["metrics"]["qtts_queue_depth"] is None and s["gpu_error"] == "disabled"
