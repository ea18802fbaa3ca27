"""What a capacity report says, built from summary.json alone: the per-load table (pandas) and the verdict
and fleet text, so the words can never disagree with the numbers beside them."""

from __future__ import annotations

import math

import pandas as pd

from qtts_jax.engine.config import EngineConfig
from studies.capacity import capacity_text, unit
from studies.stats import CONFIDENCE

CI = f"{2 * CONFIDENCE - 1:.0%} CI"
MARK = {"pass": "", "fail": " ✗", "undecided": " ?"}


def _ms(x: float) -> str:
    """Milliseconds as shown; an unbounded side of an interval is ∞ or –∞ (too few streams to bound it)."""
    if x is None or math.isnan(x):
        return "n/a"
    return ("∞" if x > 0 else "–∞") if math.isinf(x) else f"{x:.0f}"


def _ci(point: float, bounds, verdict: str) -> str:
    return f"{_ms(point)} [{_ms(bounds[0])}, {_ms(bounds[1])}]{MARK[verdict]}"


def _pct(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.1%}"


def _underran(c: dict) -> str:
    """Streams that underran at zero buffer, of the valid ones, with the share's interval: `1/60 [0.1%, 7.7%]`."""
    lo, hi = c["underrun_share_ci"]
    return (f"{c['underrun_requests']}/{c['succeeded']} [{_pct(lo)}, {_pct(hi)}]"
            f"{MARK[c['contract_verdict']['underruns']]}")


def conditions_table(server: dict) -> pd.DataFrame:
    """One row per load: counts, TTFA and starvation p95 with their confidence intervals (the verdict is
    judged on those bounds: ✗ fails, ? undecided), throughput, the load's SLO verdict and, beside it, the
    streams that underran and the zero-underrun contract's verdict."""
    rows = []
    for c in server["conditions"]:
        v = c["verdict"]
        rows.append({
            "load": f"{c['load']:g}", "requests": c["requests"],
            "success": f"{c['success_rate']:.1%}{MARK[v['success']]}", "refused": c.get("refused", c["rejected_429"]),
            "admitted after a refusal": c.get("admitted_after_refusal", 0),
            "TTFA p50 ms": _ms(c["ttfa_p50_ms"]),
            f"TTFA p95 ms [{CI}]": _ci(c["ttfa_p95_ms"], c["ttfa_p95_ci_ms"], v["ttfa"]),
            f"starvation p95 ms [{CI}]": _ci(c["starvation_p95_ms"], c["starvation_p95_ci_ms"], v["starvation"]),
            "underruns per stream": f"{c['underruns_mean']:.2f}", "req/s": f"{c['throughput_rps']:.2f}",
            "audio s/s": f"{c['audio_s_per_s']:.2f}", "verdict": v["overall"],
            f"streams that underran [{CI}]": _underran(c), "zero-underrun": c["contract_verdict"]["overall"]})
    return pd.DataFrame(rows).set_index("load")


def refused_text(cond: dict) -> str:
    """The requests a load's server refused for good, with their status and its reason: `60 of 60 refused (429:
    predicted first audio in 653 ms exceeds the 300 ms target)`; empty when it refused none."""
    if not cond.get("refused"):
        return ""
    statuses = ", ".join(map(str, cond["refusal_statuses"]))
    why = f": {cond['refusal_reason']}" if cond.get("refusal_reason") else ""
    return f"{cond['refused']} of {cond['requests']} refused ({statuses}{why})"


def _late_text(cond: dict) -> str:
    """Requests admitted only after a refusal: their Retry-After wait is in their TTFA."""
    n = cond.get("admitted_after_refusal", 0)
    if not n:
        return ""
    return f"{n} of {cond['requests']} waited out a refusal's Retry-After first, and that wait is in their TTFA"


def _p95_why(cond: dict, name: str, verdict: str, target: float) -> str:
    """Why a p95 ("ttfa" or "starvation") is not a pass: above the target, unbounded, or undecided."""
    lo, hi = cond[f"{name}_p95_ci_ms"]
    label = "p95 TTFA" if name == "ttfa" else "p95 starvation"
    late = f" ({_late_text(cond)})" if name == "ttfa" and _late_text(cond) else ""
    if verdict == "fail":
        return f"{label} is above {target:g} ms (its {CI} starts at {_ms(lo)} ms){late}"
    if math.isinf(hi):
        return (f"{label} cannot be bounded from {cond['succeeded']} valid streams (59 are needed to bound a p95 "
                "from above)")
    return f"{label} is undecided: its {CI} [{_ms(lo)}, {_ms(hi)}] ms contains the {target:g} ms target"


def _loads(xs) -> str:
    return ", ".join(f"{x:g}" for x in xs)


def verdict_text(server: dict, summary: dict) -> str:
    """Markdown: the safe capacity, where and why the sweep stopped counting, and what bounds the number."""
    mode, slo, safe = summary["mode"], summary["slo"], server["safe_capacity"]
    stop = server["stopped_at"]
    sure = f" (every SLO met with {CONFIDENCE:.0%} confidence at {safe:g} and every lower load)."
    lines = [f"**Safe capacity per replica ({server['label']}): "
             f"{capacity_text(safe, server['safe_capacity_status'], stop, mode)}**" + (sure if safe else ".")]
    if stop:
        cond = next(c for c in server["conditions"] if c["load"] == stop["load"])
        why = []
        for name, verdict in stop["slos"].items():
            if name == "success":
                refused = refused_text(cond)
                why.append((f"{refused}: " if refused else "")
                           + f"{cond['success_rate']:.1%} of streams succeeded (SLO ≥ {slo['min_success_rate']:.0%})")
                continue
            if not cond["succeeded"]:  # no audio to time: the refusals or failures above are the reason
                continue
            target = slo["ttfa_p95_ms"] if name == "ttfa" else slo["starvation_p95_ms"]
            why.append(_p95_why(cond, name, verdict, target))
        what = "fails" if stop["overall"] == "fail" else "is undecided"
        lines.append(f"Load {stop['load']:g} {what}: " + "; ".join(why) + "."
                     + (" More requests per load (`--requests`), or a quieter machine, would decide it."
                        if stop["overall"] == "undecided" else ""))
    if server["passes_above"]:
        lines.append(f"Load {_loads(server['passes_above'])} meets every SLO but a lower load does not; a replica "
                     "run there would pass through the failing load, so it is not counted.")
    if "highest load tried" in server["limited_by"]:
        lines.append(f"Every load tried passed, so this is a lower bound: the replica may carry more than "
                     f"{max(summary['loads']):g}; sweep higher loads to find its limit.")
    if "slot count" in server["limited_by"]:
        lines.append(f"The safe capacity is the server's {server['slots']} slot"
                     f"{'s' if server['slots'] != 1 else ''}: more clients wait for a slot, so a server "
                     "with more slots (if it keeps up) may carry more.")
    return "\n\n".join(lines)


def contract_text(server: dict, summary: dict) -> str:
    """Markdown: the zero-underrun capacity, how rare an underrun can still be there, and why the first load
    above it breaks the contract. Beside the SLO's verdict, never instead of it: the fleet is sized on that."""
    mode, target, zero = summary["mode"], summary["contract"]["ttfa_p95_ms"], server["zero_underrun_capacity"]
    stop = server["contract_stopped_at"]
    lines = [f"**Zero-underrun capacity per replica ({server['label']}): "
             f"{capacity_text(zero, server['zero_underrun_capacity_status'], stop, mode)}**"]
    if zero:
        top = next(c for c in server["conditions"] if c["load"] == zero)
        lines[0] += (f" (every request succeeded, no stream stalled after its first audio at a zero-buffer player and "
                     f"p95 TTFA ≤ {target:g} ms with {CONFIDENCE:.0%} confidence, at this load and every lower one; "
                     f"from 0 underruns in {top['succeeded']} streams at {zero:g}, with {CONFIDENCE:.0%} confidence at "
                     f"most {_pct(top['underrun_share_ci'][1])} of its streams underrun).")
    else:
        lines[0] += "."
    if stop:
        cond = next(c for c in server["conditions"] if c["load"] == stop["load"])
        why = [_contract_why(cond, name, verdict, target) for name, verdict in stop["slos"].items()
               if name == "success" or cond["succeeded"]]  # no audio to time: the failures are the reason
        what = "breaks" if stop["overall"] == "fail" else "is undecided on"
        lines.append(f"Load {stop['load']:g} {what} the zero-underrun contract: " + "; ".join(why) + ".")
    if summary["buffer_ms"]:
        lines.append(f"Underruns are counted at zero buffer, as the contract's player starts at the first byte; "
                     f"the table's starvation is at {summary['buffer_ms']:g} ms.")
    return "\n\n".join(lines)


def _contract_why(cond: dict, name: str, verdict: str, target: float) -> str:
    """Why a load misses one criterion of the contract: a failed request, a stream that stalled, or its TTFA."""
    if name == "success":
        refused = refused_text(cond)
        return ((f"{refused}: " if refused else "")
                + f"{cond['success_rate']:.1%} of requests succeeded (the contract needs every one, a 429 included)")
    if name == "underruns":
        lo, hi = cond["underrun_share_ci"]
        at = cond.get("first_underrun_at")  # summaries written before it lack it
        where = (f"; first within 0.25 s of their audio: {at['under_0.25s']}, within 1 s: {at['0.25_to_1s']}, "
                 f"later: {at['over_1s']}") if at else ""
        return (f"{cond['underrun_requests']} of {cond['succeeded']} streams stalled after their first audio "
                f"(share {_pct(cond['underrun_share'])}, {CI} [{_pct(lo)}, {_pct(hi)}]{where})")
    return _p95_why(cond, name, verdict, target)


def fleet_text(server: dict, summary: dict) -> str:
    """Markdown: replicas and cost for the target load under both sizing rules, or why there is no fleet."""
    fleet, mode = server["fleet"], summary["mode"]
    if fleet is None:
        if server["safe_capacity_status"] == "undecided":
            return (f"**{server['label']}: no fleet size**: the lowest load is undecided, so a replica's capacity "
                    "is unknown, not zero. More requests per load or a quieter machine would decide it.")
        return (f"**{server['label']}: no fleet size**: no load met every SLO with confidence, so a replica's "
                "capacity is unknown. Try lower loads, more requests per load, a start-up buffer or a smaller "
                "first chunk.")
    target = summary["target_load"]
    rules = (("40% headroom: ceil(target / safe × 1.4)", "headroom_40"),
             ("60% utilisation: ceil(target / safe / 0.6)", "utilisation_60"))
    rows = "".join(f"| {name} | {fleet[key]['replicas']} | {fleet[key]['per_hour']:.2f} "
                   f"| {fleet[key]['per_month']:.0f} |\n" for name, key in rules)
    return (f"**{server['label']}**: target {target:g} {unit(mode, target)} at {server['safe_capacity']:g} per "
            f"replica, ${summary['price_per_hour']:g}/h per replica"
            + (" (the placeholder default: pass `--price-per-hour` for your accelerator's price)"
               if summary.get("price_is_default") else "") + ":\n\n"
            "| policy | replicas | $/hour | $/month |\n|---|---|---|---|\n" + rows)


def batching_text(summary: dict) -> str:
    """Markdown: whether batching paid, where a study compared a batched server with a serialised one it started
    (`make study`): the audio each made per second at load 1 and with every slot busy, and why. Empty otherwise."""
    about = (summary.get("provenance") or {}).get("servers") or {}
    serialised = {label for label, s in about.items() if (s.get("config") or {}).get("serialised")}
    serial = next((s for s in summary["servers"] if s["label"] in serialised), None)
    batched = next((s for s in summary["servers"] if s["label"] not in serialised and (s.get("slots") or 0) > 1), None)
    if serial is None or batched is None or summary["mode"] != "closed":
        return ""
    made = {name: {c["load"]: c["audio_s_per_s"] for c in s["conditions"]} for name, s in
            (("batched", batched), ("serial", serial))}
    slots, both = batched["slots"], sorted(set(made["batched"]) & set(made["serial"]))
    full = max((load for load in both if load <= slots), default=None)
    if full is None:
        return ""
    lines = [f"**Batching on this machine.** At load {both[0]:g} the serialised server made "
             f"{made['serial'][both[0]]:.2f} s of audio per second, the batched one {made['batched'][both[0]]:.2f}."]
    ladder = EngineConfig(slots=slots).ladder
    if ladder[0] > both[0]:
        lines.append(f"The batched server's step is compiled for {ladder[0]} rows only (its ladder of batch sizes "
                     f"starts at {EngineConfig.min_batch} rows or its slots: on a GPU fewer rows cost no less), so "
                     f"{both[0]:g} stream{'s pay' if both[0] != 1 else ' pays'} for {ladder[0] - both[0]:g} empty "
                     f"row{'s' if ladder[0] - both[0] != 1 else ''}.")
    gain = made["batched"][full] / made["serial"][full]
    machine = (summary.get("provenance") or {}).get("machine") or {}
    where = f"{machine.get('cpu_count', '?')} CPU cores" + (" and no GPU" if not machine.get("gpus") else "")
    lines.append(f"At load {full:g}, with {'every slot' if full == slots else f'{full:g} of its {slots} slots'} "
                 f"busy, the batched server made {made['batched'][full]:.2f} against {made['serial'][full]:.2f}: ")
    if gain >= 1.1:
        lines[-1] += f"batching pays, {gain:.2f}× the audio per second."
    else:
        lines[-1] += (f"batching does not pay ({gain:.2f}×). On {where} a step's cost grows with its rows, since the "
                      "same cores do every row's arithmetic: a step of two rows costs about two steps of one. On a "
                      f"GPU a step of fewer than {EngineConfig.min_batch} rows costs about one row's (launch "
                      "overhead: why the ladder starts there), and batching pays.")
    return " ".join(lines)


def machine_text(summary: dict) -> str:
    """Markdown warning when other processes were busy on the machine during the measurement, naming the
    servers whose sweeps it overlapped; empty when the machine was quiet or its load unknown."""
    load = summary["provenance"].get("machine_load") or {}
    if not load.get("busy"):
        return ""
    busy = [s["label"] for s in summary["servers"] if (s.get("machine_load") or {}).get("busy")]
    avg = load.get("load_avg_end") or [math.nan]
    return (f"**Warning: the machine was busy.** While this study measured, other processes used "
            f"{load['other_cpu_s']:g} CPU-seconds in {load['wall_s']:g} s (on average {load['other_cores']:g} of its "
            f"{load['cpu_count']} CPUs; a quiet machine uses under {load['busy_cores']:g}), load average "
            f"{avg[0]:.2f} at the end"
            + (f"; busy during the sweep of {' and '.join(map(repr, busy))}" if busy else "")
            + ". They compete with the servers and clients measured, so these verdicts may be worse than the "
            "servers' own: run again on a quiet machine before relying on them.")


def last_line(summary: dict, report) -> str:
    """The CLI's last line: each server's verdict by name, then where the report is."""
    mode = summary["mode"]
    def both(s: dict) -> str:
        safe = capacity_text(s["safe_capacity"], s["safe_capacity_status"], s["stopped_at"], mode)
        zero = capacity_text(s["zero_underrun_capacity"], s["zero_underrun_capacity_status"],
                             s["contract_stopped_at"], mode)
        return f"{s['label']}: safe capacity {safe}, zero-underrun capacity {zero}"

    verdicts = [both(s) for s in summary["servers"]]
    busy = " (busy machine: see the warning)" if (summary["provenance"].get("machine_load") or {}).get("busy") else ""
    return "; ".join(verdicts) + f"{busy}; report: {report}"


def provenance_table(summary: dict) -> pd.DataFrame:
    """The provenance block flattened to one (what, value) row each, for the report."""
    p = summary["provenance"]
    rows = [("run id", p["run_id"]), ("created (UTC)", p["created_utc"]),
            ("commit", f"{p['commit']}{' (with uncommitted changes)' if p['dirty'] else ''}")]
    for label, s in p["servers"].items():
        model = s.get("model") or {}
        rows += [(f"{label}: URL", s["url"]), (f"{label}: model", f"{model.get('model')} ({model.get('kind')}, "
                                                                  f"{model.get('size')}, noise: {model.get('noise')})"),
                 (f"{label}: model fingerprint", f"{s['model_fingerprint']} (of {s['fingerprint_of']})"
                  if s.get("model_fingerprint") else s.get("error")),
                 (f"{label}: slots", s.get("slots")),
                 (f"{label}: server config", ", ".join(f"{k}={v}" for k, v in (s.get("config") or {}).items())
                  or "not started by this study")]
    m = p["machine"]
    rows += [("machine", f"{m['cpu']}, {m['cpu_count']} CPUs, {m['memory_gib']} GiB; {m['platform']}"),
             ("GPUs", "; ".join(m["gpus"]) or "none"),
             ("machine load during the run", _load_row(p.get("machine_load"))),
             ("packages", ", ".join(f"{k} {v}" for k, v in p["packages"].items() if v))]
    return pd.DataFrame(rows, columns=["what", "value"]).set_index("what")


def _load_row(load: dict | None) -> str:
    if not load or load.get("other_cpu_s") is None:
        return "not measured (no /proc on this machine)"
    avg = " → ".join(", ".join(f"{x:.2f}" for x in a) for a in (load["load_avg_start"], load["load_avg_end"]) if a)
    return (f"other processes {load['other_cpu_s']:g} CPU-s in {load['wall_s']:g} s ({load['other_cores']:g} "
            f"CPUs on average: {'busy' if load['busy'] else 'quiet'}); the study's own {load['study_cpu_s']:g} "
            f"CPU-s; load average (1, 5, 15 min) {avg}")


def _num(x) -> str:
    return "n/a" if x is None else ("∞" if x == math.inf else "–∞" if x == -math.inf else f"{x:.3g}")


def scaling_table(choice: dict) -> pd.DataFrame:
    """One row per signal sampled from /metrics (and the client's own counts): its median at the last passing and
    the first failing load, their separation in within-load spreads, the threshold and how often the failing load
    was beyond it."""
    last, fail = choice["last_pass_load"], choice["first_fail_load"]
    at = {"pass": f"at load {_num(last)} (passes)", "fail": f"at load {_num(fail)} (fails)"}
    rows = [{"signal": r["signal"], "what": r["label"], "from": r["source"], at["pass"]: _num(r["pass_value"]),
             at["fail"]: _num(r["fail_value"]), "separation": _num(r["separation"]),
             "threshold": ("> " if r["scale_out_when"] == "above" else "< ") + _num(r["threshold"])
             if r["threshold"] is not None else "n/a",
             "beyond it at the failing load": _pct(r["fail_beyond_share"]) if r["fail_beyond_share"] is not None
             else "n/a"} for r in choice["rows"]]
    return pd.DataFrame(rows).set_index("signal")


def scaling_text(server: dict) -> str:
    """Markdown: the signal to scale on and its threshold, judged on the SLO and on the zero-underrun contract, and
    what the fleet's autoscaler takes from it; or why the data cannot tell."""
    lines = []
    for choice in (server["scale_signal"]["slo"], server["scale_signal"]["contract"]):
        on = "the SLO" if choice["judged_on"] == "slo" else "the zero-underrun contract"
        if choice["status"] != "chosen":
            lines.append(f"**What to scale on ({server['label']}, {on}): undecided**: {choice['reason']}.")
            continue
        r = next(r for r in choice["rows"] if r["signal"] == choice["signal"])
        lines.append(f"**Scale on `{r['signal']}` ({server['label']}, {on})**: scale out when it is "
                     f"{r['scale_out_when']} {_num(r['threshold'])}. It reads {_num(r['pass_value'])} at load {choice['last_pass_load']:g}, "
                     f"the last that meets {on}, and {_num(r['fail_value'])} at load {choice['first_fail_load']:g}, "
                     f"the first that breaks it: {_num(r['separation'])} times its spread within a load; "
                     f"{_pct(r['fail_beyond_share'])} of load {choice['first_fail_load']:g}'s samples were beyond it.")
    slo = server["scale_signal"]["slo"]
    if slo["fleet_safe_capacity"] is not None:
        lines.append(f"Ray Serve's autoscaler counts open streams per replica, so the fleet takes this threshold: "
                     f"`qtts-jax cluster --scale-from summary.json` (= `--safe-capacity "
                     f"{_num(slo['fleet_safe_capacity'])}`, `FLEET_SAFE_CAPACITY` in deploy/rayservice.yaml).")
    else:
        lines.append("Ray Serve's autoscaler counts only open streams per replica, and this choice is not that: "
                     "`qtts-jax cluster --scale-from summary.json` falls back to the closed-loop safe capacity; "
                     "alert on the chosen signal (docs/fleet.md).")
    return "\n\n".join(lines)
