"""Studies against a real `qtts-jax serve` (tiny-random) on loopback: load, records, SLOs, the notebook."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import os

import pytest

from studies.load import arrival_times, run_condition
from studies.records import read_jsonl
from studies.report import run_notebook
from studies.scrape import MetricsSampler
from studies.server import local_server
from studies.slo import SLO, Contract, safe_capacity, zero_underrun_capacity
from studies.sweep import sweep

PROMPTS = ["Hi, how can I help?", "Your order has shipped.", "One moment please."]
OPTIONS = {"voice": "ryan", "seed": 0, "max_frames": 12, "chunk_schedule": [1, 2, 4]}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """One small server for the module: 2 slots, a wait queue of 2, one prompt bucket size pair. tiny-random on a
    busy CPU (other test processes beside it) may be slower than real time: no real-time limit here, else a study
    records 429s that are no part of what these tests check (test_admission tests the limit); the queue still
    refuses what does not fit."""
    with local_server(slots=2, context=256, log_path=tmp_path_factory.mktemp("serve") / "serve.log",
                      extra_args=("--ttfa-target-ms", "5000"), admission={"starvation_s": 1e9}) as u:
        yield u


def test_closed_sweep_writes_valid_timed_records_and_a_consistent_summary(url, tmp_path):
    result = sweep(url, "closed", [2, 1], requests=4, prompts=PROMPTS, out_dir=tmp_path, options=OPTIONS,
                   warmup=1)
    records = read_jsonl(tmp_path / "records.jsonl")
    assert [c["load"] for c in result["conditions"]] == [1, 2]  # swept in increasing order
    assert len(records) == 2 * (4 + 1) and sum(r.warmup for r in records) == 2
    for r in records:
        assert r.ok, r.invalid
        assert r.status == 200 and r.sample_rate == 24_000
        assert r.send_s < r.first_byte_s == r.chunks[0][0] <= r.chunks[-1][0] <= r.end_s
        assert sum(n for _, n in r.chunks) == 12 * 1920  # 12 frames of 80 ms at 24 kHz
        assert r.server_ttfa_ms is not None and r.server_ttfa_ms <= 1000 * r.ttfa_s + 5
        assert r.server_queue_ms is not None and 0 <= r.server_queue_ms <= r.server_ttfa_ms
        assert r.server_intake_ms is not None and 0 <= r.server_intake_ms <= 1000 * r.ttfa_s - r.server_ttfa_ms
    for c in result["conditions"]:
        assert c["requests"] == 4 and c["success_rate"] == 1.0
        assert 0 < c["ttfa_p50_ms"] <= c["ttfa_p95_ms"] and c["throughput_rps"] > 0
        assert 0 <= c["underrun_requests"] <= c["succeeded"] and c["contract_verdict"] == Contract().judge(c)
    assert result["safe_capacity"] == safe_capacity(result["conditions"], SLO())
    assert result["zero_underrun_capacity"] == zero_underrun_capacity(result["conditions"], Contract())
    assert json.loads((tmp_path / "summary.json").read_text())["safe_capacity"] == result["safe_capacity"]
    # the server's /metrics, scraped while each load ran, on the records' clock
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples == json.loads(json.dumps(result["samples"])) and {s["load"] for s in samples} == {1, 2}
    for load in (1, 2):
        mine = [s for s in samples if s["load"] == load]
        sent = [r for r in records if r.load == load]
        assert len(mine) >= 2 and all(s["error"] is None and s["server"] == url for s in mine)
        assert 0 <= mine[0]["t_s"] <= min(r.end_s for r in sent) and mine[-1]["t_s"] >= max(r.end_s for r in sent)
        assert all(0 <= s["metrics"]["qtts_active_streams"] <= 2 and s["metrics"]["qtts_queue_depth"] is not None
                   and 0 <= s["client"]["streams_in_flight"] <= load for s in mine)
        # the TTFA histogram counts every request once it has had its first audio: all of them by the last scrape
        assert dict(mine[-1]["ttfa_buckets"])["+Inf"] >= 5 * load
    no_metrics = MetricsSampler(f"{url}/nothing", gpu=False).sample(0.0, {"load": 1})
    assert no_metrics["error"].startswith("HTTP 404") and set(no_metrics["metrics"].values()) == {None}


def test_open_loop_sends_on_schedule(url):
    records = asyncio.run(run_condition(url, "open-poisson", 4.0, 4, PROMPTS, OPTIONS, seed=3))
    sent = sorted(r.send_s for r in records)
    expected = arrival_times(4.0, 4, poisson=True, seed=3)
    assert all(abs((s - sent[0]) - e) < 0.1 for s, e in zip(sent, expected))
    assert {r.condition for r in records} == {"open-poisson:4"}
    assert all(r.ok or r.invalid == "HTTP 429" for r in records) and any(r.ok for r in records)


def test_websocket_closed_loop_records_match_the_http_ones(url):
    ws = asyncio.run(run_condition(url, "closed", 2, 3, PROMPTS, OPTIONS, warmup=1, protocol="ws"))
    http = asyncio.run(run_condition(url, "closed", 2, 3, PROMPTS, OPTIONS, warmup=1))
    assert len(ws) == 4 and sum(r.warmup for r in ws) == 1 and {r.condition for r in ws} == {"closed:2"}
    for r in ws:
        assert r.protocol == "ws" and r.ok, (r.invalid, r.error)
        assert r.status == 200 and r.sample_rate == 24_000 and r.error is None
        assert r.send_s < r.first_byte_s == r.chunks[0][0] <= r.chunks[-1][0] <= r.end_s
        assert sum(n for _, n in r.chunks) == 12 * 1920 and len(r.chunks) > 1  # streamed, not one blob
        assert r.server_ttfa_ms is not None and r.server_ttfa_ms <= 1000 * r.ttfa_s + 5
        assert r.server_queue_ms is not None and 0 <= r.server_queue_ms <= r.server_ttfa_ms
        assert r.server_intake_ms is not None and 0 <= r.server_intake_ms <= 1000 * r.ttfa_s - r.server_ttfa_ms
    assert [dataclasses.asdict(r).keys() for r in ws] == [dataclasses.asdict(r).keys() for r in http]
    assert {r.protocol for r in http} == {"http"}


def test_websocket_refusals_and_bad_sessions_are_failures(url):
    flood = asyncio.run(run_condition(url, "open-fixed", 120.0, 12, PROMPTS, OPTIONS, protocol="ws"))
    refused = [r for r in flood if r.status == 429]
    assert refused and any(r.ok for r in flood)  # 2 slots + 2 waiting places cannot take 12 at once
    assert all(r.invalid == "HTTP 429" and r.retry_after and not r.chunks for r in refused)
    (bad,) = asyncio.run(run_condition(url, "closed", 1, 1, PROMPTS, {**OPTIONS, "voice": "nobody"}, protocol="ws"))
    assert bad.status == 400 and bad.invalid == "HTTP 400" and "voice" in bad.error and bad.end_s >= bad.send_s


def test_capacity_cli_sweeps_over_the_websocket(url, tmp_path, capsys):
    from studies.cli import main as study_main

    """Measured where the server runs (--no-report: no papermill needed there), then rendered from the run's files."""
    assert study_main(["capacity", "--url", url, "--protocol", "ws", "--loads", "1", "--requests", "2",
                       "--warmup", "0", "--max-frames", "6", "--runs-dir", str(tmp_path), "--no-report"]) == 0
    (run,) = tmp_path.iterdir()
    assert json.loads((run / "summary.json").read_text())["protocol"] == "ws"
    assert {r.protocol for r in read_jsonl(run / "records.jsonl")} == {"ws"}
    assert not (run / "report.html").exists()
    out = capsys.readouterr().out
    assert "Zero-underrun capacity per replica" in out
    # 2 requests cannot bound a p95 from above: undecided, never a silent 0; the last line names the server
    assert out.rstrip().splitlines()[-1].startswith(f"{url}: safe capacity undecided (load 1 is undecided), ")
    assert out.rstrip().endswith(f"report: not rendered: python -m studies report {run}")
    assert study_main(["report", str(run)]) == 0
    assert "loop over ws" in (run / "report.html").read_text()
    assert capsys.readouterr().out.strip() == f"report: {run / 'report.html'}"
    assert study_main(["report", str(tmp_path / "nothing")]) == 2


def test_overload_rejections_count_as_failures(url, tmp_path):
    # 12 requests in 0.1 s at a server with 2 slots and 2 waiting places: some must be refused with 429
    result = sweep(url, "open-fixed", [120.0], requests=12, prompts=PROMPTS, out_dir=tmp_path, options=OPTIONS)
    (c,) = result["conditions"]
    assert c["rejected_429"] > 0
    assert c["success_rate"] == pytest.approx((12 - c["rejected_429"]) / 12)
    assert "HTTP 429" in c["errors"] and not c["slo"]["success"]
    assert result["safe_capacity"] == 0
    refused = [r for r in read_jsonl(tmp_path / "records.jsonl") if r.status == 429]
    assert all(r.retry_after and not r.chunks for r in refused)


def test_capacity_notebook_executes_and_renders_a_report(url, tmp_path):
    report = run_notebook("capacity_study", {
        "server_url": url, "loads": [1, 2], "requests_per_condition": 3, "warmup": 0, "max_frames": 12,
        "target_load": 10, "price_per_hour": 2.0, "ttfa_p95_ms": 1.0, "label": "first", "compare_url": url,
        "compare_label": "second"}, tmp_path)
    html = report.read_text()
    assert "<title>Capacity study: " + tmp_path.name + "</title>" in html
    assert html.count('src="data:image/png;base64') == 2  # curves and TTFA CDFs inline, not only as PNG files
    for name in ("first", "second"):  # swept side by side, each judged and sized
        assert f"Safe capacity per replica ({name}): none (load 1 fails)" in html
        assert f"<strong>{name}: no fleet size</strong>" in html
        # beside the SLO's; 3 streams decide the contract only if one stalled, so either reading, never a bare 0
        assert re.search(rf"Zero-underrun capacity per replica \({name}\): (none \(load 1 fails|undecided \(load 1 "
                         r"is undecided)\)", html)
    assert "streams that underran [90% CI]</th>" in html and "zero-underrun</th>" in html
    # 3 streams bound a p95 only from below: a 1 ms TTFA target is failed with confidence
    assert "Load 1 fails: p95 TTFA is above 1 ms" in html and "<table" in html  # pandas tables, not Markdown
    assert "tags=" not in html and "from studies" not in html  # no code
    nb = json.loads((tmp_path / "capacity_study.ipynb").read_text())
    assert not [o for c in nb["cells"] for o in c.get("outputs", []) if o["output_type"] == "execute_result"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["label"] for s in summary["servers"]] == ["first", "second"]
    assert summary["contract"] == {"ttfa_p95_ms": 100.0} and summary["zero_underrun_capacity"] == 0
    assert summary["provenance"]["servers"]["first"]["slots"] == 2
    assert summary["provenance"]["machine_load"]["study_cpu_s"] > 0  # the study measured its own CPU time
    assert all(s["machine_load"]["wall_s"] > 0 for s in summary["servers"])
    assert "machine load during the run" in html and summary["price_per_hour"] == 2.0
    assert summary["provenance"]["servers"]["first"]["model"]["model"] == "tiny-random"
    records = read_jsonl(tmp_path / "records.jsonl")
    assert [sum(r.server == n for r in records) for n in ("first", "second")] == [6, 6]
    assert all(json.loads(line)["ttfa_ms"] > 0 for line in (tmp_path / "records.jsonl").read_text().splitlines())
    for name in ("capacity_study.ipynb", "curves.png", "ttfa_cdf.png"):
        assert (tmp_path / name).stat().st_size > 0
    # what to scale on: load 1 already fails the 1 ms target, so the data cannot tell, and the report says so
    assert summary["scale_signal"] == summary["servers"][0]["scale_signal"]
    assert summary["scale_signal"]["slo"]["status"] == "undecided"
    assert "What to scale on (first, the SLO): undecided</strong>: no load passes (load 1 is fail)" in html
    assert "<th>separation</th>" in html and "streams_open</th>" in html
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert {s["server"] for s in samples} == {"first", "second"} and all(s["error"] is None for s in samples)


def test_local_server_that_dies_reports_it():
    with pytest.raises(RuntimeError, match="exited with code"):
        with local_server(model="/nonexistent/checkpoint", ready_timeout_s=60):
            pass


def test_chunk_buffer_notebook_measures_each_first_chunk_once_and_simulates_each_buffer(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)  # a relative run directory lands where the caller stands
    run_notebook("chunk_buffer_sweep", {"server_url": url, "first_chunks": [1, 4], "buffers_ms": [0, 400],
                                        "requests_per_condition": 2, "warmup": 0, "max_frames": 12}, tmp_path.name)
    grid = json.loads((tmp_path / "summary.json").read_text())["grid"]
    assert [(r["first_chunk"], r["buffer_ms"]) for r in grid] == [(1, 0), (1, 400), (4, 0), (4, 400)]
    assert len(read_jsonl(tmp_path / "records.jsonl")) == 4  # buffers are simulated, not re-requested
    for zero, buffered in (grid[0:2], grid[2:4]):
        assert buffered["start_p95_ms"] >= zero["start_p95_ms"]  # waiting for 400 ms of audio starts later
        assert buffered["starvation_p95_ms"] <= zero["starvation_p95_ms"]  # ... and never stalls more
    assert (tmp_path / "chunk_buffer.png").stat().st_size > 0
    assert (tmp_path / "report.html").read_text().count('src="data:image/png;base64') == 1  # the heatmaps, inline


def test_explore_notebook_runs_as_shipped_on_its_own_server(tmp_path):
    import soundfile

    run_notebook("explore_model", {"max_frames": 6}, tmp_path)  # no server_url: it starts and stops its own
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["audio_s"] == pytest.approx(6 * 0.08)
    t = summary["timings"]
    assert 0 <= t["queue_ms"] <= t["prefill_ms"] <= t["first_frame_ms"] <= t["first_chunk_ms"] <= t["total_ms"]
    audio, rate = soundfile.read(tmp_path / "speech.wav")
    assert rate == 24_000 and len(audio) == 6 * 1920
    html = (tmp_path / "report.html").read_text()
    assert "<audio" in html and html.count('src="data:image/png;base64') == 2
    assert (tmp_path / "spectrogram.png").stat().st_size > 0 and (tmp_path / "timings.png").stat().st_size > 0


def test_explore_reports_the_servers_error(url):
    from studies.explore import synthesize

    with pytest.raises(RuntimeError, match="HTTP 400: .*voice"):
        synthesize(url, "hello", voice="nobody")


def test_sustained_cli_runs_both_workloads_abba_with_golden_checks_and_no_gpu(url, tmp_path, monkeypatch, capsys):
    """Measured where the servers run (--no-report: no papermill needed there), then drawn from the run's files."""
    from studies.cli import main as study_main
    from studies.sustained import document

    # nvidia-smi absent (as on CI): the GPU fields are null and the run goes on
    monkeypatch.setenv("PATH", os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                                               if not os.path.exists(os.path.join(d, "nvidia-smi"))))
    (tmp_path / "plain.txt").write_text("Your order has shipped.\nOne moment please.\n")
    (tmp_path / "processed.txt").write_text("Hi there. | How can I help?\nSure. | One moment.\n")
    rc = study_main(["sustained", "--url", url, "--compare-url", url, "--label-b", "same server",
                     "--plain-corpus", str(tmp_path / "plain.txt"),
                     "--processed-corpus", str(tmp_path / "processed.txt"),
                     "--concurrency", "2", "--fill-s", "0.3", "--window-s", "2.0", "--max-frames", "6",
                     "--runs-dir", str(tmp_path / "runs"), "--no-report"])
    out = capsys.readouterr().out
    assert rc == 0, out
    (run,) = (tmp_path / "runs").iterdir()
    assert not (run / "report.html").exists() and f"python -m studies report {run}" in out
    summary = json.loads((run / "summary.json").read_text())
    assert list(summary["workloads"]) == ["plain", "processed"] and summary["pause_ms"] == 120
    for workload, res in summary["workloads"].items():
        passes = res["passes"]
        assert [(p["order"], p["build"]) for p in passes] == [(1, "A"), (2, "B"), (3, "B"), (4, "A")]
        for p in passes:
            assert p["workload"] == workload and p["valid"] and p["completed"] > 0 and p["failed"] == 0
            assert p["golden_mismatches"] == 0 and 0 < p["mean_outstanding"] <= 2
            assert p["latency_p50_ms"] <= p["latency_p95_ms"]
            assert p["gpu_util_mean_pct"] is None and p["gpu_mem_peak_mib"] is None
            assert p["gpu_error"] == "nvidia-smi not found"
        assert res["comparison"]["A"]["valid"] and res["comparison"]["B"]["valid"]
        assert f"{workload}: B/A throughput" in out
    records = read_jsonl(run / "records.jsonl")
    processed = [r for r in records if r.condition.startswith("processed:") and not r.warmup]
    assert processed and {r.text for r in processed} >= {document(("Hi there.", "How can I help?"))}  # SSML, one request
    assert all(r.ok for r in records)
    assert study_main(["report", str(run)]) == 0
    html = (run / "report.html").read_text()
    assert "same server" in html and "Workload <em>processed</em>" in html and "from studies" not in html
    assert (run / "sustained.png").stat().st_size > 0 and html.count('src="data:image/png;base64') == 1


def test_sustained_pass_flags_responses_that_differ_from_the_golden(url):
    import numpy as np

    from studies.sustained import sustained_pass
    from studies.sweep import run_sync

    wrong = [np.zeros(10, np.int32)] * 2
    p = run_sync(sustained_pass(url, 1, PROMPTS[:2], {**OPTIONS, "max_frames": 6}, wrong, fill_s=0, window_s=1.5))
    assert p["golden_mismatches"] > 0 and not p["valid"]
