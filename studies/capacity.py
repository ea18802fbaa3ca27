"""A capacity study of one or more servers, swept the same way: per server its conditions, confident safe
capacity, what limits that verdict and its fleet; one summary.json with provenance and one records.jsonl.
The CLI measures with this and the capacity_study notebook draws the summary; run alone, the notebook
measures with it too."""

from __future__ import annotations

import json
import re
from pathlib import Path

from studies import provenance
from studies.fleet import DEFAULT_PRICE_PER_HOUR, fleet_size
from studies.scaling import choices
from studies.slo import SLO, Contract, safe_capacity, zero_underrun_capacity
from studies.sweep import sweep


def unit(mode: str, load: float | None = None) -> str:
    """The load's unit, singular for a load of exactly 1 client. A closed loop's load is its clients, each offering
    one stream at a time: what is offered, not what is in flight (a refused client is waiting, not playing)."""
    if mode != "closed":
        return "requests/s"
    return "client" if load == 1 else "clients"


def assess(conditions: list[dict], slo: SLO, slots: int | None, contract: Contract = Contract()) -> dict:
    """The verdict behind a safe capacity: the first load that is not safe and why ("fail" or "undecided",
    per SLO), loads that pass above it (not counted), and what bounds the number: every load tried passed
    (`highest load tried`) or, in closed loop, the capacity is the slot count (`slot count`): a load above it
    waits for slots. Beside it the zero-underrun capacity and the first load that breaks the contract."""
    safe = safe_capacity(conditions, slo)
    ordered = sorted(conditions, key=lambda c: c["load"])
    stop = _first_short(ordered, "verdict")
    contract_stop = _first_short(ordered, "contract_verdict")
    limited_by = []
    if stop is None:
        limited_by.append("highest load tried")
    if ordered[0]["mode"] == "closed" and slots and safe == slots:
        limited_by.append("slot count")
    zero = zero_underrun_capacity(conditions, contract)
    return {
        "safe_capacity": safe, "safe_capacity_status": status(safe, stop), "limited_by": limited_by,
        "stopped_at": stop,
        "passes_above": [c["load"] for c in ordered if stop and c["load"] > stop["load"]
                         and c["verdict"]["overall"] == "pass"],
        "zero_underrun_capacity": zero, "zero_underrun_capacity_status": status(zero, contract_stop),
        "contract_stopped_at": contract_stop,
    }


def status(capacity: float, stop: dict | None) -> str:
    """How to read a capacity: "at least" (every load tried passed, or the next one is undecided: the replica may
    carry more), "exactly" (the next load fails), "undecided" (the lowest load is undecided: no number can be
    given) or "none" (the lowest load fails). A 0 alone would read as a measured zero, which an undecided
    lowest load is not."""
    if stop is None:
        return "at least"
    if stop["overall"] == "undecided":
        return "at least" if capacity else "undecided"
    return "exactly" if capacity else "none"


def capacity_text(capacity: float, capacity_status: str, stop: dict | None, mode: str) -> str:
    """A capacity as a planner should read it: "at least 2 clients", "1 client (load 2 fails)", "undecided (load 1 is undecided)", "none (load 1 fails)"."""
    at = f"load {stop['load']:g} {'fails' if stop['overall'] == 'fail' else 'is undecided'}" if stop else ""
    if capacity_status == "undecided":
        return f"undecided ({at})"
    if capacity_status == "none":
        return f"none ({at})"
    number = f"{capacity:g} {unit(mode, capacity)}"
    if capacity_status == "exactly":
        return f"{number} ({at})"
    return f"at least {number}" + (f" ({at})" if stop else " (every load tried passed)")


def _first_short(ordered: list[dict], key: str) -> dict | None:
    """The lowest load whose `key` verdict is not an overall pass, with the criteria it missed; None if none."""
    stop = next((c for c in ordered if c[key]["overall"] != "pass"), None)
    return None if stop is None else {
        "load": stop["load"], "overall": stop[key]["overall"],
        "slos": {k: v for k, v in stop[key].items() if k != "overall" and v != "pass"}}


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", label).strip("-")[:60] or "server"


def study(servers: dict[str, str], out_dir: str | Path, mode: str, loads: list[float], requests: int,
          prompts: list[str], options: dict, warmup: int = 2, buffer_ms: float = 0.0, slo: SLO = SLO(),
          protocol: str = "http", target_load: float = 100.0, price_per_hour: float | None = None,
          configs: dict[str, dict] | None = None, contract: Contract = Contract()) -> dict:
    """Sweeps each server (label -> URL) in turn into out_dir/servers/<label>/ and writes out_dir/summary.json
    (provenance, settings, per server: conditions, assessment, fleet, the signal to scale on), out_dir/records.jsonl
    (every request of every server, labelled) and out_dir/samples.jsonl (their /metrics while each load ran).
    `configs`: how local servers were started, for provenance. The fleet is sized on the SLO's safe capacity; the
    zero-underrun contract is reported beside it. Without a `price_per_hour` the fleet is priced at the placeholder
    default and the summary says so."""
    price_is_default = price_per_hour is None
    price_per_hour = DEFAULT_PRICE_PER_HOUR if price_is_default else price_per_hour
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    about = {label: provenance.server(url, (configs or {}).get(label)) for label, url in servers.items()}
    dirs = {label: out / "servers" / f"{i}-{slug(label)}" for i, label in enumerate(servers, 1)}
    results, whole = [], provenance.MachineLoad()
    for label, url in servers.items():
        meter = provenance.MachineLoad()
        r = sweep(url, mode, loads, requests, prompts, dirs[label], options=options,
                  warmup=warmup, buffer_ms=buffer_ms, slo=slo, protocol=protocol, server=label, contract=contract)
        a = assess(r["conditions"], slo, about[label].get("slots"), contract)
        results.append({"label": label, "url": url, "slots": about[label].get("slots"), **a,
                        "fleet": fleet_size(a["safe_capacity"], target_load, price_per_hour)
                        if a["safe_capacity"] > 0 else None,
                        "scale_signal": choices(r["conditions"], r["samples"]),
                        "machine_load": meter.result(), "conditions": r["conditions"]})
    for name in ("records.jsonl", "samples.jsonl"):
        with open(out / name, "w", encoding="utf-8") as f:
            for label in servers:
                f.write((dirs[label] / name).read_text(encoding="utf-8"))
    summary = {"provenance": provenance.provenance(out.name, about, whole.result()), "mode": mode, "protocol": protocol,
               "unit": unit(mode), "loads": sorted(loads), "requests_per_condition": requests, "warmup": warmup,
               "buffer_ms": buffer_ms, "options": options, "slo": vars(slo), "target_load": target_load,
               "price_per_hour": price_per_hour, "price_is_default": price_is_default, "servers": results, "safe_capacity": results[0]["safe_capacity"],
               "safe_capacity_status": results[0]["safe_capacity_status"],
               "contract": vars(contract), "zero_underrun_capacity": results[0]["zero_underrun_capacity"],
               "scale_signal": results[0]["scale_signal"]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    return summary
