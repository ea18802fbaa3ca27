"""bench/capacity.py's Markdown table, from hand-made results: the SLO's verdict and, beside it, the streams
that underran and the zero-underrun contract's verdict and capacity; and its reading of the server's
garbage-collector passes from what the server exports."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from studies.slo import SLO, Contract, safe_capacity, zero_underrun_capacity
from studies.stats import share_bounds

spec = importlib.util.spec_from_file_location("bench_capacity", Path(__file__).parents[1] / "bench" / "capacity.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def cond(load, underran=0, ttfa_ci=(40, 60)):
    c = {"condition": f"closed:{load}", "mode": "closed", "load": load, "requests": 60, "succeeded": 60,
         "success_rate": 1.0, "rejected_429": 0, "ttfa_p50_ms": 40.0, "ttfa_p95_ms": 50.0, "ttfa_p95_ci_ms": ttfa_ci,
         "starvation_p95_ms": 0.0, "starvation_p95_ci_ms": (0, 10), "underruns_mean": underran / 60,
         "underrun_requests": underran, "underrun_share": underran / 60,
         "underrun_share_ci": share_bounds(underran, 60), "throughput_rps": 1.0, "audio_s_per_s": 2.0}
    c["slo"], c["contract_verdict"] = SLO().check(c), Contract().judge(c)
    return c


def test_table_has_the_contract_beside_the_slo():
    conditions = [cond(1), cond(16, underran=3), cond(64, ttfa_ci=(80, 120))]
    closed = {"safe_capacity": safe_capacity(conditions), "conditions": conditions,
              "zero_underrun_capacity": zero_underrun_capacity(conditions)}
    text = bench.table({"batched": {"slots": 256, "startup_s": 9.5, "closed": closed}})
    header, rule, one, sixteen, sixty_four = text.splitlines()[:5]
    assert header.endswith("| safe | streams that underran | zero-underrun |") and rule.count("|") == 11
    assert one.endswith("| yes | 0/60 (0%) | yes |")
    assert sixteen.endswith("| yes | 3/60 (5%) | no (underruns) |")  # safe under the SLO, not under the contract
    assert sixty_four.endswith("| yes | 0/60 (0%) | no (ttfa) |")  # p95 TTFA undecided at the contract's 100 ms
    assert "batched closed: safe capacity 64, zero-underrun capacity 1" in text
    assert "batched: ready 9.5 s after start" in text


def test_the_bench_counts_the_long_collector_passes_and_what_they_freed():
    from prometheus_client import CollectorRegistry, generate_latest

    from serving.monitoring import collector

    clock = iter([0.0, 0.004, 1.0, 1.03, 2.0, 2.08, 3.0, 3.001])
    pauses = collector.Pauses(clock=lambda: next(clock))
    registry = CollectorRegistry()
    registry.register(collector.PauseCollector(pauses))  # not in gc.callbacks: only the calls below reach it

    def passes(*generations):
        for g, freed in generations:
            pauses("start", {"generation": g})
            pauses("stop", {"generation": g, "collected": freed})
        return bench.gc_passes(generate_latest(registry).decode())

    before = passes((0, 5))  # 4 ms
    after = passes((2, 700), (2, 90_000), (1, 3))  # 30 ms, 80 ms; 1 ms
    assert bench.gc_passes_since(after, before) == {
        "0": {"passes": 0, "over_20ms": 0, "over_50ms": 0, "collected": 0},
        "1": {"passes": 1, "over_20ms": 0, "over_50ms": 0, "collected": 3},
        "2": {"passes": 2, "over_20ms": 2, "over_50ms": 1, "collected": 90_700}}


def test_the_bench_reads_the_servers_intake_per_condition():
    text = ("# HELP qtts_request_intake_seconds An HTTP speech request's handler starting ...\n"
            'qtts_request_intake_seconds_bucket{le="0.001"} 3.0\nqtts_request_intake_seconds_count 4.0\n'
            "qtts_request_intake_seconds_sum 0.0016\nqtts_request_intake_seconds_created 1.7e+09\n")
    assert bench.intake(text) == {"count": 4.0, "sum": 0.0016}
    assert bench.intake_since({"count": 14.0, "sum": 0.0066}, bench.intake(text)) == {"seconds": 0.005,
                                                                                       "mean_ms": 0.5}
    assert bench.intake_since(bench.intake(text), bench.intake(text)) == {"seconds": 0.0, "mean_ms": None}


def test_the_bench_reads_late_chunks_by_where_they_were_late():
    text = ("# HELP qtts_late_chunks_total Chunks handed out after their playback deadline\n"
            "qtts_late_chunks_total 7.0\nqtts_late_chunks_created 1.7e+09\nqtts_engine_late_chunks 2.0\n")
    assert bench.late_chunks(text) == {"server": 7.0, "engine": 2.0}


def test_a_closed_loop_splits_into_its_first_wave_and_the_rest(tmp_path):
    """The requests sent within half a second of the first are the burst; each part's percentiles are its own, and
    a measure a record lacks (an older server sends no queue) is left out rather than counted as zero."""
    import json

    rows = [{"send_s": 10.0 + 0.001 * i, "first_byte_s": 10.2 + 0.001 * i + 0.01 * i, "server_ttfa_ms": 50.0 + i,
             "server_queue_ms": 5.0 * i, "server_intake_ms": 0.5 * i} for i in range(20)]
    rows += [{"send_s": 12.0 + 0.1 * i, "first_byte_s": 12.05 + 0.1 * i, "server_ttfa_ms": 20.0,
              "server_queue_ms": None} for i in range(10)]
    rows += [{"send_s": 9.0, "first_byte_s": 9.1, "warmup": True}, {"send_s": 10.0, "first_byte_s": None}]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    waves = bench.waves(path)
    first, rest = waves["first wave"], waves["the rest"]
    assert (first["requests"], rest["requests"]) == (20, 10)
    assert (first["send_span_ms"], rest["send_span_ms"]) == (19.0, 900.0)
    assert first["client_ttfa_ms"][2] == 390.0 and first["server_ttfa_ms"] == [59.5, 68.0, 69.0]
    assert first["server_queue_ms"] == [47.5, 90.2, 95.0] and rest["server_queue_ms"] is None
    assert first["server_intake_ms"] == [4.8, 9.0, 9.5] and rest["server_intake_ms"] is None
    assert rest["client_ttfa_ms"] == [50.0, 50.0, 50.0]
