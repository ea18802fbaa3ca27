"""Study toolkit arithmetic on hand-computed cases: playback, statistics, validation, SLOs and the zero-underrun
contract, fleet sizing."""

from __future__ import annotations

import asyncio
import time
import json
import math
import struct

import numpy as np
import pandas as pd
import pytest

from studies.cli import main as study_main
from studies.corpora import load_corpus
from studies.fleet import fleet_size
from studies.load import arrival_times, server_timing
from studies.playback import simulate
from studies.records import RequestRecord, read_jsonl, write_jsonl
from studies.slo import SLO, Contract, safe_capacity, zero_underrun_capacity
from studies.stats import first_underrun_at, percentile, percentile_bounds, share_bounds, summarize
from studies.validate import validate_stream

SR = 24_000
TENTH = SR // 10  # samples in 100 ms
HEADERS = {"X-Sample-Rate": "24000", "X-Channels": "1", "X-Sample-Format": "s16le"}


def test_zero_buffer_playback_counts_gaps_after_first_audio_not_before():
    # starts at 5.0 (TTFA is not starvation); 0.1 s plays, chunk 2 lands in time, chunk 3 is 0.1 s late
    p = simulate([(5.0, TENTH), (5.05, TENTH), (5.3, TENTH)], SR)
    assert p.start_s == 5.0
    assert p.starvation_s == pytest.approx(0.1)
    assert p.longest_stall_s == pytest.approx(0.1)
    assert p.underruns == 1
    assert p.audio_s == pytest.approx(0.3)
    assert p.first_stall_at_s == pytest.approx(0.2)  # it ran dry once its first 0.2 s had played


def test_startup_buffer_delays_start_and_absorbs_stalls():
    chunks = [(0.0, TENTH), (0.05, TENTH), (0.3, TENTH), (0.7, TENTH)]
    # 200 ms buffer: starts at 0.05 with 0.2 s queued -> dry at 0.25, chunk 3 at 0.3 (0.05 s stall),
    # plays to 0.4, chunk 4 at 0.7 (0.3 s stall)
    p = simulate(chunks, SR, buffer_ms=200)
    assert p.start_s == 0.05
    assert p.starvation_s == pytest.approx(0.35)
    assert p.longest_stall_s == pytest.approx(0.3)
    assert p.underruns == 2
    assert p.first_stall_at_s == pytest.approx(0.2)
    # a buffer longer than the whole stream starts at its last chunk and never starves
    assert simulate(chunks, SR, buffer_ms=5000) == simulate([(0.7, 4 * TENTH)], SR)


def test_zero_buffer_underrun_is_any_stall_however_short():
    # the zero-underrun contract counts every stall after the first audio: 1 microsecond late is an underrun,
    # exactly on time (the first 100 ms runs out at 0.1 s) is not
    assert simulate([(0.0, TENTH), (0.1 + 1e-6, TENTH)], SR).underruns == 1
    assert simulate([(0.0, TENTH), (0.1, TENTH)], SR).underruns == 0
    assert simulate([(0.0, TENTH), (0.1, TENTH)], SR).first_stall_at_s is None
    assert simulate([(0.0, 0), (0.3, TENTH), (0.4, TENTH)], SR).underruns == 0  # empty chunk: no audio yet


def test_playback_ignores_empty_chunks_and_rejects_nonsense():
    assert simulate([(0.0, 0), (0.2, TENTH)], SR).start_s == 0.2
    with pytest.raises(ValueError, match="no audio"):
        simulate([(0.0, 0)], SR)
    with pytest.raises(ValueError, match="must not decrease"):
        simulate([(1.0, TENTH), (0.5, TENTH)], SR)
    with pytest.raises(ValueError, match="buffer_ms"):
        simulate([(0.0, TENTH)], SR, buffer_ms=-1)


def s16(*values) -> bytes:
    return struct.pack(f"<{len(values)}h", *values)


def test_validation_accepts_audio_and_names_every_failure():
    assert validate_stream(200, HEADERS, s16(0, 100, -100)) is None
    # header names in lower case, as an ASGI server (the fleet's front) sends them, are the same headers
    assert validate_stream(200, {k.lower(): v for k, v in HEADERS.items()}, s16(0, 100, -100)) is None
    assert "channels" in validate_stream(200, {"x-sample-rate": "24000", "x-channels": "2"}, s16(1, 1))
    assert validate_stream(200, HEADERS, b"") == "empty stream"
    assert "malformed" in validate_stream(200, HEADERS, s16(1, 2) + b"\x01")
    assert "sample rate" in validate_stream(200, {**HEADERS, "X-Sample-Rate": "16000"}, s16(1))
    assert "sample rate" in validate_stream(200, {"X-Channels": "1"}, s16(1))
    assert "channels" in validate_stream(200, {**HEADERS, "X-Channels": "2"}, s16(1, 1))
    f32 = {**HEADERS, "X-Sample-Format": "f32le"}
    assert validate_stream(200, f32, np.array([0.0, 0.5], "<f4").tobytes()) is None
    assert validate_stream(200, f32, np.array([0.0, np.nan], "<f4").tobytes()) == "non-finite samples"
    assert validate_stream(200, f32, np.array([np.inf], "<f4").tobytes()) == "non-finite samples"
    assert "sample format 'u8'" in validate_stream(200, {**HEADERS, "X-Sample-Format": "u8"}, b"\x00\x00")
    assert validate_stream(429, HEADERS, b"", error="HTTP 429: overloaded") == "HTTP 429"
    assert validate_stream(None, {}, b"", error="ClientConnectorError: refused") == \
        "transfer failed: ClientConnectorError: refused"
    assert validate_stream(200, HEADERS, s16(1, 2), error="ClientPayloadError: truncated") == \
        "transfer failed: ClientPayloadError: truncated"


def record(i, send, first, chunks, invalid=None, warmup=False, condition="closed:2", load=2):
    return RequestRecord(request_id=f"r{i}", condition=condition, mode="closed", load=load, prompt=i, text="x",
                         send_s=send, first_byte_s=first, end_s=chunks[-1][0] if chunks else first or send,
                         chunks=chunks, status=200 if invalid is None else 500, invalid=invalid,
                         sample_rate=SR, warmup=warmup)


def test_percentile_and_summary_by_hand():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10, 20], 95) == pytest.approx(19.5)
    assert math.isnan(percentile([], 95))
    recs = [
        record(0, 0.0, 0.1, [(0.1, TENTH), (0.2, TENTH)]),  # ttfa 100 ms, no stall
        record(1, 0.0, 0.2, [(0.2, TENTH), (0.5, TENTH)]),  # ttfa 200 ms, 200 ms stall
        record(2, 1.0, None, [], invalid="HTTP 500"),  # fails
        record(3, 0.0, 0.05, [(0.05, TENTH)], warmup=True),  # ignored
    ]
    s = summarize(recs)
    assert (s["requests"], s["succeeded"]) == (3, 2)
    assert s["success_rate"] == pytest.approx(2 / 3)
    assert s["ttfa_p50_ms"] == pytest.approx(150)
    assert s["ttfa_p95_ms"] == pytest.approx(195)
    assert s["starvation_p95_ms"] == pytest.approx(190)
    assert s["starvation_max_ms"] == pytest.approx(200)
    assert s["ttfa_p95_ci_ms"] == (100, math.inf)  # two streams bound a p95 from below only
    assert s["wall_s"] == pytest.approx(1.0)  # first send 0.0 .. last end 1.0
    assert s["throughput_rps"] == pytest.approx(2.0)
    assert s["audio_s_per_s"] == pytest.approx(0.4)  # two valid streams of 0.2 s in 1 s
    assert s["errors"] == ["HTTP 500"]
    assert (s["underrun_requests"], s["underrun_share"]) == (1, 0.5)  # request 1 stalled; of 2 valid streams
    assert s["underrun_share_ci"] == share_bounds(1, 2)
    assert s["first_underrun_at"] == {"under_0.25s": 1, "0.25_to_1s": 0, "over_1s": 0}  # dry after its first 0.1 s
    assert first_underrun_at([None, 0.0, 0.25, 0.9, 1.0, 30.0]) == {"under_0.25s": 1, "0.25_to_1s": 2, "over_1s": 2}
    # a 200 ms start-up buffer removes request 1's stall; the contract's zero-buffer player still counts it
    buffered = summarize(recs, buffer_ms=200)
    assert buffered["starvation_max_ms"] == pytest.approx(0) and buffered["underruns_mean"] == 0
    assert buffered["underrun_requests"] == 1
    with pytest.raises(ValueError, match="mix conditions"):
        summarize(recs[:2] + [record(9, 0, 0.1, [(0.1, 1)], condition="closed:4", load=4)])
    with pytest.raises(ValueError, match="no measured"):
        summarize(recs[3:])


def cond(load, success=1.0, ttfa=100.0, starv=0.0, mode="closed", ttfa_ci=None, starv_ci=None, underran=0):
    """A condition summary as `summarize` writes it; the confidence bounds default to the point value."""
    c = {"mode": mode, "load": load, "success_rate": success, "ttfa_p95_ms": ttfa, "starvation_p95_ms": starv,
         "ttfa_p95_ci_ms": ttfa_ci or (ttfa, ttfa), "starvation_p95_ci_ms": starv_ci or (starv, starv),
         "underrun_requests": underran}
    c["verdict"] = SLO().judge(c)
    return c


def test_p95_bounds_are_order_statistics_with_binomial_coverage():
    # 60 values: the 95% upper bound on p95 is the largest (1 - 0.95**60 = 0.954 >= 0.95), the lower the 54th
    assert percentile_bounds(range(1, 61)) == (54.0, 60.0)
    assert percentile_bounds(range(1, 101)) == (91.0, 99.0)  # more values: the bounds move inside the extremes
    assert percentile_bounds(range(1, 13))[1] == math.inf  # 12 values cannot bound a p95 from above ...
    assert percentile_bounds(range(1, 13))[0] == 10.0  # ... but can from below
    assert percentile_bounds([]) == (-math.inf, math.inf)
    # a minute of arrivals at 80 rps: n choose k overflows a float (the study crashed here on the GPU); the bounds
    # sit where the normal approximation of Bin(n, 0.95) puts them, np ± 1.645 sd (+1 for 1-based ranks)
    n = 4800
    lower, upper = percentile_bounds(range(n))
    sd = math.sqrt(n * 0.95 * 0.05)
    assert abs(upper - (n * 0.95 + 1.645 * sd)) <= 2 and abs(lower - (n * 0.95 - 1.645 * sd)) <= 2
    assert share_bounds(0, n)[1] == pytest.approx(1 - 0.05 ** (1 / n), rel=1e-6)  # exact at k = 0
    # coverage: on exponential samples the true p95 lies under the upper bound in at least 95% of draws
    rng = np.random.default_rng(0)
    true = -math.log(0.05)
    covered = [percentile_bounds(rng.exponential(size=80)) for _ in range(400)]
    assert sum(hi >= true for _, hi in covered) / 400 >= 0.95
    assert sum(lo <= true for lo, _ in covered) / 400 >= 0.93  # sampling noise of 400 draws around >= 0.95


def test_share_bounds_are_clopper_pearson_by_hand():
    n = 60
    # 0 of n: P(Bin(n, p) <= 0) = (1 - p)^n = 0.05 gives the upper bound, about 3/n (the rule of three)
    lo, hi = share_bounds(0, n)
    assert lo == 0 and hi == pytest.approx(1 - 0.05 ** (1 / n), rel=1e-9)
    assert hi == pytest.approx(3 / n, rel=0.03)
    # 1 of n: the lower bound solves P(Bin >= 1) = 1 - (1 - p)^n = 0.05; the upper (1 - p)^n + n p (1 - p)^(n-1) = 0.05
    lo, hi = share_bounds(1, n)
    assert lo == pytest.approx(1 - 0.95 ** (1 / n), rel=1e-9)
    assert (1 - hi) ** n + n * hi * (1 - hi) ** (n - 1) == pytest.approx(0.05, abs=1e-9)
    assert hi == pytest.approx(0.0766, abs=1e-4)  # the tabled exact bound for 1 of 60 (beta quantile 0.95; 2, 59)
    # all n of n mirror 0 of n, and every k mirrors n - k
    assert share_bounds(n, n) == (pytest.approx(0.05 ** (1 / n), rel=1e-9), 1.0)
    lo, hi = share_bounds(7, n)
    assert (1 - hi, 1 - lo) == pytest.approx(share_bounds(n - 7, n), abs=1e-9)
    assert all(math.isnan(x) for x in share_bounds(0, 0))  # no valid stream, no share
    with pytest.raises(ValueError):
        share_bounds(3, 2)


def test_slo_judges_each_criterion_on_its_confidence_bounds():
    slo = SLO()
    assert slo.check(cond(1)) == {"success": True, "ttfa": True, "starvation": True, "safe": True}
    assert slo.check(cond(1, success=0.98))["success"] is False
    assert slo.judge(cond(1, ttfa=300.1))["ttfa"] == "fail"
    assert slo.judge(cond(1, starv=101))["starvation"] == "fail"
    # a p95 under the target whose upper bound is over it is undecided, not a pass: one slow request is not a verdict
    undecided = cond(1, ttfa=200, ttfa_ci=(150, 420))
    assert slo.judge(undecided) == {"success": "pass", "ttfa": "undecided", "starvation": "pass",
                                    "overall": "undecided"}
    assert slo.check(undecided)["safe"] is False
    assert slo.judge(cond(1, ttfa=200, ttfa_ci=(150, math.inf)))["ttfa"] == "undecided"  # too few streams
    assert slo.judge(cond(1, ttfa=math.nan, ttfa_ci=(-math.inf, math.inf)))["overall"] == "undecided"
    assert slo.judge(cond(1, success=0.5, ttfa=200, ttfa_ci=(150, 420)))["overall"] == "fail"  # a fail decides
    with pytest.raises(ValueError):
        SLO(min_success_rate=1.5)


def test_safe_capacity_is_the_last_load_before_the_first_failure():
    assert safe_capacity([cond(4), cond(1), cond(2), cond(8, ttfa=900)]) == 4
    assert safe_capacity([cond(1), cond(2, starv=500), cond(4)]) == 1  # a lucky pass at 4 does not count
    assert safe_capacity([cond(1), cond(2, ttfa_ci=(90, 400)), cond(4)]) == 1  # nor one above an undecided load
    assert safe_capacity([cond(1, success=0.5), cond(2)]) == 0
    assert safe_capacity([cond(0.5, mode="open-poisson"), cond(1, mode="open-poisson")]) == 1
    with pytest.raises(ValueError, match="one load mode"):
        safe_capacity([cond(1), cond(2, mode="open-fixed")])
    with pytest.raises(ValueError):
        safe_capacity([])


def test_contract_counts_every_failure_and_underrun_and_judges_ttfa_on_its_bounds():
    contract = Contract()
    assert contract.judge(cond(1, ttfa=90)) == {"success": "pass", "underruns": "pass", "ttfa": "pass",
                                                "overall": "pass"}
    # one refused request in 120 (a 429 is not a success): the SLO's 99% passes, the contract fails
    assert SLO().check(cond(1, success=119 / 120, ttfa=90))["safe"]
    assert contract.judge(cond(1, success=119 / 120, ttfa=90))["success"] == "fail"
    assert contract.judge(cond(1, ttfa=90, underran=1))["underruns"] == "fail"
    assert contract.judge(cond(1, ttfa=150))["ttfa"] == "fail"  # SLO-safe at 300 ms, not at the contract's 100
    assert Contract(ttfa_p95_ms=200).judge(cond(1, ttfa=150))["overall"] == "pass"
    assert contract.judge(cond(1, ttfa=90, ttfa_ci=(80, 120)))["overall"] == "undecided"
    with pytest.raises(ValueError):
        Contract(ttfa_p95_ms=0)


def test_zero_underrun_capacity_stops_at_the_first_load_that_breaks_the_contract():
    ok = {"ttfa": 90.0}
    assert zero_underrun_capacity([cond(4, **ok), cond(1, **ok), cond(2, **ok)]) == 4
    loads = [cond(1, **ok), cond(2, underran=1, **ok), cond(4, **ok)]
    assert zero_underrun_capacity(loads) == 1 and safe_capacity(loads) == 4  # a pass at 4 does not count
    assert zero_underrun_capacity([cond(1, **ok), cond(2, ttfa=90, ttfa_ci=(80, 120)), cond(4, **ok)]) == 1
    assert zero_underrun_capacity([cond(1, underran=2, **ok), cond(2, **ok)]) == 0
    with pytest.raises(ValueError, match="one load mode"):
        zero_underrun_capacity([cond(1), cond(2, mode="open-fixed")])


def test_sweep_summary_with_one_stalled_stream_fails_the_contract_but_passes_the_slo(tmp_path, monkeypatch):
    from studies import sweep as sweep_module

    async def fake_condition(url, mode, load, requests, *args, **kwargs):
        """60 streams of 200 ms at 50 ms TTFA; at load 2 one stream's second chunk is 50 ms late."""
        late = {0: 0.05} if load == 2 else {}
        return [record(i, 0.0, 0.05, [(0.05, TENTH), (0.15 + late.get(i, 0), TENTH)], condition=f"closed:{load:g}",
                       load=load) for i in range(requests)]

    monkeypatch.setattr(sweep_module, "run_condition", fake_condition)
    result = sweep_module.sweep("http://x", "closed", [1, 2, 4], 60, ["x"], tmp_path)
    one, two, four = result["conditions"]
    assert all(c["verdict"]["overall"] == "pass" for c in (one, two, four))  # 50 ms of starvation in one stream
    assert (two["underrun_requests"], two["underrun_share"]) == (1, pytest.approx(1 / 60))
    assert two["contract_verdict"] == {"success": "pass", "underruns": "fail", "ttfa": "pass", "overall": "fail"}
    assert one["contract_verdict"]["overall"] == four["contract_verdict"]["overall"] == "pass"
    assert (result["safe_capacity"], result["zero_underrun_capacity"]) == (4, 1)
    assert result["contract"] == {"ttfa_p95_ms": 100.0}
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert (on_disk["safe_capacity"], on_disk["zero_underrun_capacity"]) == (4, 1)
    assert on_disk["conditions"][1]["underrun_share_ci"] == list(share_bounds(1, 60))


def test_fleet_sizing_matches_the_issue_and_prices_it():
    f = fleet_size(1, 100, price_per_hour=2.0)
    assert f["headroom_40"]["replicas"] == 140
    assert f["utilisation_60"]["replicas"] == 167
    assert f["headroom_40"]["per_hour"] == 280.0
    assert f["utilisation_60"]["per_month"] == 167 * 2.0 * 730
    assert fleet_size(3, 10)["headroom_40"]["replicas"] == 5  # 4.67 -> 5
    assert fleet_size(3, 10)["utilisation_60"]["replicas"] == 6  # 5.56 -> 6
    with pytest.raises(ValueError, match="no load met the SLOs"):
        fleet_size(0, 100)
    with pytest.raises(ValueError):
        fleet_size(1, -1)


def test_fleet_cli(capsys):
    assert study_main(["fleet", "--safe-capacity", "1", "--target", "100", "--price-per-hour", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "40% headroom: 140 replicas, $210.00/h" in out
    assert "60% utilisation: 167 replicas, $250.50/h" in out
    assert study_main(["fleet", "--safe-capacity", "0", "--target", "5"]) == 2
    assert "no load met the SLOs" in capsys.readouterr().err


def test_capacity_cli_refuses_two_comparisons_before_starting_anything(capsys):
    assert study_main(["capacity", "--compare-url", "http://127.0.0.1:9", "--compare-serialised"]) == 2
    assert "not both" in capsys.readouterr().err


def test_records_round_trip_with_derived_numbers_and_bad_lines_are_located(tmp_path):
    recs = [record(0, 0.0, 0.1, [(0.1, TENTH), (0.3, TENTH)]), record(1, 1.0, None, [], invalid="HTTP 429")]
    write_jsonl(tmp_path / "r.jsonl", recs)
    assert read_jsonl(tmp_path / "r.jsonl") == recs
    df = pd.read_json(tmp_path / "r.jsonl", lines=True)  # what a planner does with a run
    ok, refused = df.iloc[0], df.iloc[1]
    assert ok["ttfa_ms"] == pytest.approx(100) and ok["audio_s"] == pytest.approx(0.2)
    assert ok["starvation_ms"] == pytest.approx(100) and ok["underruns"] == 1 and ok["buffer_ms"] == 0
    assert refused["invalid"] == "HTTP 429" and pd.isna(refused["ttfa_ms"]) and pd.isna(refused["starvation_ms"])
    write_jsonl(tmp_path / "b.jsonl", recs[:1], buffer_ms=200)  # derived for the study's player
    assert pd.read_json(tmp_path / "b.jsonl", lines=True)["starvation_ms"][0] == 0
    (tmp_path / "bad.jsonl").write_text('{"request_id": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_jsonl(tmp_path / "bad.jsonl")


def test_arrivals_fixed_and_poisson():
    assert arrival_times(4, 3, poisson=False).tolist() == [0.0, 0.25, 0.5]
    a = arrival_times(2.0, 4000, poisson=True, seed=1)
    assert a[0] == 0 and np.all(np.diff(a) >= 0)
    assert 4000 / a[-1] == pytest.approx(2.0, rel=0.05)
    assert np.array_equal(a, arrival_times(2.0, 4000, poisson=True, seed=1))
    with pytest.raises(ValueError, match="rate"):
        arrival_times(0, 3, poisson=True)


def test_voice_agent_corpus_has_twenty_prompts_and_unknown_names_are_refused():
    prompts = load_corpus("voice_agent")
    assert len(prompts) == 20 and all(prompts)
    with pytest.raises(ValueError, match="voice_agent"):
        load_corpus("nope")


def test_first_chunk_schedules_use_compiled_codec_sizes():
    from studies.chunk_buffer import schedule_for

    assert schedule_for(1) == [1, 2, 4, 8] and schedule_for(4) == [4, 8]
    with pytest.raises(ValueError, match="first chunk"):
        schedule_for(3)


def test_unknown_notebook_is_refused_with_the_known_ones(tmp_path):
    from studies.report import run_notebook

    with pytest.raises(ValueError, match="capacity_study"):
        run_notebook("nope", {}, tmp_path)


def test_time_weighted_mean_and_golden_match_by_hand():
    from studies.sustained import matches, time_weighted_mean

    # 2 for 1 s, then 4 for 3 s -> (2 + 12) / 4
    assert time_weighted_mean([(0.0, 2), (1.0, 4)], end=4.0) == pytest.approx(3.5)
    assert math.isnan(time_weighted_mean([], end=1.0))
    golden = np.array([0, 100, -100], np.int32)
    assert matches(s16(1, 99, -100), golden)  # one int16 step of rounding is allowed
    assert not matches(s16(2, 100, -100), golden)
    assert not matches(s16(0, 100), golden)
    assert not matches(s16(0, 100, -100) + b"\x00", golden)


def test_sustained_ab_needs_a_fixed_seed_before_any_traffic():
    from studies.sustained import sustained_ab

    with pytest.raises(ValueError, match="seed"):
        sustained_ab("http://127.0.0.1:9", "http://127.0.0.1:9", ["hi"], {"voice": "ryan"})


def test_sustained_cli_refuses_bad_arguments_before_starting_anything(capsys, tmp_path):
    assert study_main(["sustained", "--compare-url", "http://127.0.0.1:9", "--compare-serialised",
                       "--runs-dir", str(tmp_path)]) == 2
    assert "not both" in capsys.readouterr().err
    assert study_main(["sustained", "--url", "http://127.0.0.1:9", "--window-s", "0",
                       "--runs-dir", str(tmp_path)]) == 2
    assert not list(tmp_path.iterdir())  # no run directory, no server


def test_processed_item_is_one_ssml_document_and_its_recording_is_normalised_whole():
    from serving.text.ssml import Pause, Speech, parse
    from studies.sustained import PEAK, document, normalise

    pieces = parse(document(("Hi & welcome.", "How can I help?"), pause_ms=120))
    assert [type(p) for p in pieces] == [Speech, Pause, Speech] and pieces[1].seconds == 0.12
    assert pieces[0].text == "Hi & welcome." and pieces[2].prosody.rate == 1.1 and pieces[2].prosody.gain_db == -3
    rec, gain = normalise(s16(16384, -8192, 4096))
    assert gain == pytest.approx(PEAK / 0.5)  # the loudest sample of the whole recording reaches -1 dBFS
    assert rec[0] == round(0.5 * gain * 32767) and abs(rec).max() == round(PEAK * 32767)
    assert rec[-1] == round(0.125 * gain * 32767)  # quieter samples keep their level relative to the loudest
    silent, g = normalise(s16(0, 0))
    assert g == 1.0 and not silent.any()


def test_workload_items_and_golden_tolerance():
    from studies.sustained import Golden, matches, workload_items

    plain, processed = workload_items("plain"), workload_items("processed")
    assert plain and all(len(i) == 1 for i in plain)
    assert processed and all(len(i) == 2 and all(t.strip() for t in i) for i in processed)
    assert len(workload_items("processed", limit=2)) == 2
    with pytest.raises(ValueError, match="workload"):
        workload_items("shouty")
    with pytest.raises(ValueError, match="two turns"):
        workload_items("processed", "voice_agent")  # lines without ' | ' are not two turns
    golden = Golden(np.array([0, 100, -100], np.int32), tolerance=3)
    assert matches(s16(3, 97, -100), golden) and not matches(s16(4, 100, -100), golden)
    assert not matches(s16(3, 97, -100), golden.pcm)  # a bare array allows one step


def _fake_nvidia_smi(tmp_path, body: str):
    exe = tmp_path / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(0o755)
    return str(exe)


def test_gpu_sampler_absent_failing_and_present(tmp_path, monkeypatch):
    from studies.gpu import GpuSampler, parse_sample

    async def sample(sampler, samples=1):
        """The sampler's result once it has answered: `samples` samples or a failure (at once if it runs nothing)."""
        answered, sample_once = asyncio.Event(), sampler.sample_once

        async def sampled():
            await sample_once()
            answered.set()

        sampler.sample_once = sampled
        async with sampler, asyncio.timeout(60):  # a loaded machine starts the fake slowly
            while sampler.exe and sampler.error is None and len(sampler.samples) < samples:
                answered.clear()
                await answered.wait()
        return sampler.result()

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi anywhere: null fields, no crash
    absent = asyncio.run(sample(GpuSampler()))
    assert absent == {"gpu_util_mean_pct": None, "gpu_mem_peak_mib": None, "gpu_samples": 0,
                      "gpu_error": "nvidia-smi not found"}
    assert asyncio.run(sample(GpuSampler(enabled=False)))["gpu_error"] == "disabled"
    broken = asyncio.run(sample(GpuSampler(exe=_fake_nvidia_smi(tmp_path, "echo 'No devices' >&2; exit 9"))))
    assert broken["gpu_util_mean_pct"] is None and "exit 9: No devices" in broken["gpu_error"]
    two_gpus = _fake_nvidia_smi(tmp_path, "printf '30, 1000\\n50, 2000\\n'")
    present = asyncio.run(sample(GpuSampler(exe=two_gpus, interval_s=0.05), samples=2))
    assert present["gpu_util_mean_pct"] == 40 and present["gpu_mem_peak_mib"] == 3000  # mean of GPUs, summed memory
    assert present["gpu_samples"] >= 2 and present["gpu_error"] is None
    assert parse_sample("7, 512\n") == [(7.0, 512.0)]
    with pytest.raises(ValueError):
        parse_sample("[N/A], 512")


def test_websocket_load_refuses_options_its_session_cannot_carry():
    from studies.load import run_condition, ws_url

    assert ws_url("http://h:8000") == "ws://h:8000/v1/audio/speech/stream"
    assert ws_url("https://h/") == "wss://h/v1/audio/speech/stream"
    with pytest.raises(ValueError, match="response_format"):  # refused before any traffic (port 9 is closed)
        asyncio.run(run_condition("http://127.0.0.1:9", "closed", 1, 1, ["hi"], {"response_format": "wav"},
                                  protocol="ws"))
    with pytest.raises(ValueError, match="protocol"):
        asyncio.run(run_condition("http://127.0.0.1:9", "closed", 1, 1, ["hi"], {}, protocol="grpc"))


@pytest.mark.asyncio
async def test_sustained_window_opens_only_after_every_clients_warm_up(aiohttp_server):
    """Warm-up items slower than the fill and the window together (a cold server, a busy machine) leave the
    window whole: it opens once every client's first item is done, so the pass measures the steady items
    (before, the window had closed before any measured item ended and the pass was invalid)."""
    from aiohttp import web

    from studies.sustained import sustained_pass

    pcm = (np.arange(2400) % 50 - 25).astype("<i2")
    arrived = []

    async def speech(request):
        arrived.append((await request.json())["input"])
        await asyncio.sleep(1.0 if len(arrived) <= 2 else 0.05)  # each of the two clients' first request is slow
        resp = web.StreamResponse(headers={"X-Sample-Rate": "24000", "X-Channels": "1", "X-Sample-Format": "s16le"})
        await resp.prepare(request)
        await resp.write(pcm.tobytes())
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/audio/speech", speech)

    async def ready(request):
        return web.json_response({"active": 0, "queued": 0})

    app.router.add_get("/ready", ready)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    records = []
    p = await sustained_pass(url, 2, ["one", "two"], {}, [pcm.astype(np.int32)] * 2, fill_s=0.2, window_s=0.6,
                             gpu=False, records_out=records)
    assert p["valid"] and p["failed"] == 0 and p["golden_mismatches"] == 0
    assert p["completed"] >= 4 and p["latency_p95_ms"] < 500  # the fast steady items, no warm-up among them
    warmups = [r for r in records if r.warmup]
    assert len(warmups) == 2 and all(r.end_s >= 1.0 for r in warmups)


@pytest.mark.asyncio
async def test_closed_loop_times_count_from_the_zero_its_caller_gives(aiohttp_server):
    """bench/http_floor.py subtracts server stamps from its own clock reading: the records must count from that same
    reading, however long the caller waits before the loop starts (a 2-core machine under load waited ms)."""
    import time

    from aiohttp import web

    from studies.load import closed_loop

    pcm = np.zeros(1920, "<i2").tobytes()

    async def speech(request):
        resp = web.StreamResponse(headers={"X-Sample-Rate": "24000", "X-Channels": "1", "X-Sample-Format": "s16le"})
        await resp.prepare(request)
        await resp.write(pcm)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/audio/speech", speech)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    before = time.perf_counter()
    own = await closed_loop(url, 2, 2, ["one"])
    given = await closed_loop(url, 2, 2, ["one"], t0=before)
    assert all(0 <= r.send_s < 1.0 for r in own)
    assert all(r.send_s >= own[-1].end_s for r in given)  # both of its sends came after the first loop ended


@pytest.mark.asyncio
async def test_a_refused_client_waits_its_retry_after_and_sends_again_and_the_summary_names_the_refusals(
        aiohttp_server):
    """A closed-loop client is a client: refused, it waits the Retry-After (and some jitter) and sends the same
    request again, its wait counted in its TTFA; the summary tells refusals from other failures, with the reason."""
    from aiohttp import web

    from studies.load import SENDS, closed_loop

    sends = {}
    message = "predicted first audio in {} ms exceeds the 300 ms target"

    async def speech(request):
        text = (await request.json())["input"]
        sends.setdefault(text, []).append(time.perf_counter())
        if text == "never" or len(sends[text]) == 1:
            error = {"error": {"message": message.format(600 + len(sends[text])), "code": "overloaded"}}
            return web.json_response(error, status=429, headers={"Retry-After": "0.2"})
        resp = web.StreamResponse(headers={"X-Sample-Rate": "24000", "X-Channels": "1", "X-Sample-Format": "s16le"})
        await resp.prepare(request)
        await resp.write(np.zeros(1920, "<i2").tobytes())
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/audio/speech", speech)
    server = await aiohttp_server(app)
    late, never = await closed_loop(str(server.make_url("")).rstrip("/"), 2, 2, ["late", "never"])
    assert len(sends["late"]) == 2 and len(sends["never"]) == SENDS
    gaps = np.diff(sends["never"])
    assert all(0.2 <= g < 0.2 * 1.5 + 0.1 for g in gaps)  # the Retry-After, and up to half again
    assert late.ok and late.refusals == 1 and late.ttfa_s >= 0.2  # the listener waited through the refusal
    assert not never.ok and never.status == 429 and never.refusals == SENDS
    assert late.refusal == message.format(601)
    c = summarize([late, never])
    assert (c["refused"], c["refusal_statuses"], c["admitted_after_refusal"]) == (1, [429], 1)
    assert c["refusal_reason"] == message.format(601)  # the most common reason, numbers aside, as first said


def test_a_condition_is_measured_with_the_clients_garbage_collector_off_and_it_is_back_on_after(monkeypatch):
    """A full collection pass held the client for 60-110 ms late in a long run: chunks read that late would count
    as the server's stalls, so no pass may run while a condition is measured."""
    import gc

    from studies import load

    seen = []

    async def idle(*args, **kwargs):
        return {}

    async def loop(*args, **kwargs):
        seen.append(gc.isenabled())
        return []

    monkeypatch.setattr(load, "wait_ready", idle)
    monkeypatch.setattr(load, "closed_loop", loop)
    monkeypatch.setattr(load, "open_loop", loop)
    assert gc.isenabled()
    for mode in ("closed", "open-poisson"):
        asyncio.run(load.run_condition("http://unused", mode, 2, 4, ["Hi."]))
    assert seen == [False, False] and gc.isenabled()


def test_server_timing_reads_each_named_duration_and_skips_what_it_cannot_read():
    header = "queue;dur=12.5, prefill;desc=\"x\";dur=30, ttfa;dur=soon, ;dur=4, first_frame"
    assert server_timing(header) == {"queue": 12.5, "prefill": 30.0}
    assert server_timing("") == {}


def test_an_empty_chunk_schedule_leaves_the_servers_own():
    """`--chunk-schedule` given no sizes sends none, so a GPU server streams (and is measured) at its own
    schedule; sizes given are sent as they are."""
    from studies.cli import build_parser, request_options

    parse = build_parser().parse_args
    assert "chunk_schedule" not in request_options(parse(["capacity", "--chunk-schedule"]))
    assert request_options(parse(["capacity", "--chunk-schedule", "1", "4"]))["chunk_schedule"] == [1, 4]
    assert request_options(parse(["capacity"]))["chunk_schedule"] == [1, 2, 4]


def test_a_closed_loop_measures_at_least_one_request_for_each_client(monkeypatch):
    """With fewer requests than clients, fewer clients than the load would ever send: a closed loop of 256 given
    60 requests had 62 in flight, and its verdict named 256. It measures one request a client at least."""
    from studies import load

    asked = []

    async def idle(*args, **kwargs):
        return {}

    async def loop(url, concurrency, requests, *args, **kwargs):
        asked.append((concurrency, requests))
        return []

    monkeypatch.setattr(load, "wait_ready", idle)
    monkeypatch.setattr(load, "closed_loop", loop)
    for clients in (8, 256):
        asyncio.run(load.run_condition("http://unused", "closed", clients, 60, ["Hi."]))
    assert asked == [(8, 60), (256, 256)]
    assert load.measured_requests("open-poisson", 256.0, 60) == 60
