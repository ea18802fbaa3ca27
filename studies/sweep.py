"""A capacity sweep: one condition per load, records appended to one JSONL, a summary per condition."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from pathlib import Path

from studies.load import measured_requests, run_condition
from studies.progress import bar
from studies.records import write_jsonl
from studies.scrape import MetricsSampler, with_client_view
from studies.slo import SLO, Contract, safe_capacity, zero_underrun_capacity
from studies.stats import summarize


def sweep(url: str, mode: str, loads: list[float], requests: int, prompts: list[str], out_dir: str | Path,
          options: dict | None = None, warmup: int = 0, buffer_ms: float = 0.0, slo: SLO = SLO(),
          seed: int = 0, timeout_s: float = 60.0, protocol: str = "http", server: str = "",
          contract: Contract = Contract(), sampler: MetricsSampler | None = None) -> dict:
    """Runs the loads in increasing order and writes `records.jsonl`, `samples.jsonl` and `summary.json` under
    `out_dir`. Every load runs, even past the first unsafe one, so the report shows the whole curve. Records carry
    `server` (default: the URL); a progress bar counts requests on a terminal. Each load is judged on the SLO
    and, beside it, on the zero-underrun contract (`contract_verdict`, `zero_underrun_capacity`). While each load
    runs, `sampler` (default: one on `url`) scrapes the server's /metrics (`studies.scrape`)."""
    if not loads:
        raise ValueError("no loads to sweep")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records_path = out / "records.jsonl"
    samples_path = out / "samples.jsonl"
    records_path.unlink(missing_ok=True)
    sampler = sampler or MetricsSampler(url)
    summaries, samples = [], []
    total = sum(warmup + measured_requests(mode, load, requests) for load in loads)
    with bar(total, f"sweeping {server or url}", "req") as progress:
        for load in sorted(loads):
            records = run_sync(run_condition(url, mode, load, requests, prompts, options, warmup, seed, timeout_s,
                                             protocol, on_done=progress.update, sampler=sampler))
            for r in records:
                r.server = server or url
            write_jsonl(records_path, records, append=True, buffer_ms=buffer_ms)
            samples += [{**s, "server": server or url} for s in with_client_view(sampler.take(), records)]
            s = summarize(records, buffer_ms)
            s["slo"], s["verdict"] = slo.check(s), slo.judge(s)
            s["contract_verdict"] = contract.judge(s)
            summaries.append(s)
    result = {"url": url, "mode": mode, "protocol": protocol, "requests_per_condition": requests, "warmup": warmup,
              "options": options or {}, "slo": vars(slo), "conditions": summaries,
              "safe_capacity": safe_capacity(summaries, slo), "contract": vars(contract),
              "zero_underrun_capacity": zero_underrun_capacity(summaries, contract)}
    (out / "summary.json").write_text(json.dumps(result, indent=2, default=float))
    samples_path.write_text("".join(json.dumps(s) + "\n" for s in samples), encoding="utf-8")
    result["samples"] = samples
    return result


def run_sync(coro):
    """Runs a coroutine to completion on its own thread, so sweeps work inside Jupyter's running event loop too."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
