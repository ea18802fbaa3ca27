"""Capacity of one server in one command: closed loop (N in flight) and Poisson open loop (R requests/s), with
the time the server took to be ready (and, with --restart, to be ready again from its compilation cache),
optionally beside a serialised server; one JSON and one Markdown table.

Same method and library as `qtts-jax study capacity` (SLOs, zero-buffer starvation, safe capacity, fleet, and
beside them the zero-underrun contract and its capacity),
with JSON instead of the HTML report: the GPU machine has no papermill/nbconvert. Random weights force
frame counts via ``max_frames``. Defaults are the issue-11 settings: 0.6B shape, bf16, context 512, 48 frames
(3.84 s) per request, voice-agent corpus, max(60, 2 x load) measured requests per condition.

    python bench/capacity.py --model 0.6b --slots 256 --loads 1,16,64,128,256 --rates 10,20,40,60,80 \
        --no-serialised --restart --out runs/capacity-0.6b-256

The first start compiles into a fresh cache under --out (unless --compile-cache says otherwise), so
`startup_s` is a cold start and `restart_s` one from the cache. CPU smoke run:

    python bench/capacity.py --model tiny-random --dtype float32 --slots 2 --context 256 --frames-per-step 1 \
        --loads 1,2 --rates 2 --requests 4 --max-frames 12 --no-serialised --restart --out runs/capacity-smoke
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
import time
import urllib.request
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from studies.corpora import load_corpus  # noqa: E402
from studies.fleet import fleet_size  # noqa: E402
from studies.load import wait_ready  # noqa: E402
from studies.server import local_server  # noqa: E402
from studies.slo import SLO, Contract, safe_capacity, zero_underrun_capacity  # noqa: E402
from studies.stats import percentile  # noqa: E402
from studies.sweep import run_sync, sweep  # noqa: E402

READY_LINE = re.compile(r"ready after ([\d.]+) s \(slots=(\d+); (.*)\)")
FULL_LINE = re.compile(r"every rung compiled and timed after ([\d.]+) s")
SIZING_LINE = re.compile(r"slots: \d+ \((.*)\)")
GC_BUCKET = re.compile(r'qtts_gc_pause_seconds_bucket\{generation="(\d)",le="([^"]+)"\} (\S+)')
GC_FREED = re.compile(r'qtts_gc_collected_objects_total\{generation="(\d)"\} (\S+)')
LATE_NAMES = {"qtts_engine_late_chunks": "engine", "qtts_late_chunks_total": "server"}
LATE = re.compile(rf"^({'|'.join(LATE_NAMES)}) (\S+)$", re.M)
INTAKE = re.compile(r"^qtts_request_intake_seconds_(sum|count) (\S+)$", re.M)
PROFILE_LINE = re.compile(r"iterations: \d+ in [\d.]+ s; mean per iteration \(ms, or count\): (\{.*\})")
COLUMNS = ("success_rate", "rejected_429", "ttfa_p50_ms", "ttfa_p95_ms", "starvation_p95_ms", "underruns_mean",
           "underrun_requests", "underrun_share", "first_underrun_at", "throughput_rps", "audio_s_per_s")


def numbers(text: str) -> list[float]:
    """Comma-separated loads, e.g. "1,16,64"; an empty string is none (that mode is skipped)."""
    return [float(x) for x in text.split(",") if x.strip()]


def start(args, out: Path, name: str, serialised: bool, policy: tuple[str, ...] = ()):
    """A local server with this run's settings (and a policy's extra flags); its log goes to
    out/server-<name>.log."""
    extra = ("--dtype", args.dtype, "--compile-cache", args.compile_cache or str(out / "xla"), *policy)
    return local_server(args.model, slots=args.slots, context=args.context, frames_per_step=args.frames_per_step,
                        serialised=serialised, log_path=out / f"server-{name}.log",
                        ready_timeout_s=args.ready_timeout_s, extra_args=extra,
                        engine={"seeded_ends": True} if args.seeded_ends else None)


def server_log(path: Path) -> dict:
    """The server's own log lines: how its slots were sized, and at "ready after" its warm-up seconds, slots
    and what came from the compilation cache, then when its background warm-up had every rung (seconds from the
    start of its warm-up; None with a single rung)."""
    text = path.read_text()
    sizing, ready, full = SIZING_LINE.search(text), READY_LINE.search(text), FULL_LINE.search(text)
    return {"sizing": sizing and sizing[1], "warmup_s": ready and float(ready[1]), "slots": ready and int(ready[2]),
            "compile_cache": ready and ready[3], "every_rung_s": float(full[1]) if full else None}


def refusals(records_path: Path) -> dict[str, int]:
    """Why requests failed, counted by message (`count_errors`), so a run says which admission rule (or error) cost
    its success rate."""
    return count_errors(json.loads(line).get("error") for line in records_path.read_text().splitlines())


BURST_S = 0.5  # a closed loop's first wave: the requests sent this soon after its first one


def closed_waves(rows: list, measures: dict) -> dict[str, dict]:
    """A closed loop's measured requests (`rows`, each with its `send_s`) split into its first wave, sent together at
    the start (a burst of new connections), and the rest, sent as earlier ones ended: per part the requests, the
    span of their sends and, for each of `measures` (name -> a row's value in ms, None where it has none),
    p50 / p95 / max."""
    if not rows:
        return {}
    start = min(r["send_s"] for r in rows)
    out = {}
    for part, first in (("first wave", True), ("the rest", False)):
        chosen = [r for r in rows if (r["send_s"] - start < BURST_S) == first]
        if not chosen:  # short requests: the second wave was sent within the first's BURST_S
            continue
        sends = [r["send_s"] for r in chosen]
        out[part] = {"requests": len(chosen), "send_span_ms": round(1e3 * (max(sends) - min(sends)), 1)}
        for name, value in measures.items():
            values = [v for r in chosen if (v := value(r)) is not None]
            out[part][name] = ([round(percentile(values, q), 1) for q in (50, 95)] + [round(max(values), 1)]
                               if values else None)
    return out


# what a capacity run's closed loop reports per wave (`closed_waves`), from its records: the client's TTFA, the
# server's own (X-TTFA-Ms, from the engine's submit) and, of that, the wait for admission (Server-Timing's queue),
# and before the submit the server's handler (Server-Timing's intake: its work and its awaits)
WAVE_MEASURES = {"client_ttfa_ms": lambda r: 1e3 * (r["first_byte_s"] - r["send_s"]),
                 "server_ttfa_ms": lambda r: r.get("server_ttfa_ms"),
                 "server_queue_ms": lambda r: r.get("server_queue_ms"),
                 "server_intake_ms": lambda r: r.get("server_intake_ms")}


def waves(records_path: Path) -> dict[str, dict]:
    """`closed_waves` of a condition's records.jsonl: its measured requests that got audio."""
    rows = [r for line in records_path.read_text().splitlines()
            if not (r := json.loads(line)).get("warmup") and r.get("first_byte_s") is not None]
    return closed_waves(rows, WAVE_MEASURES)


def count_errors(errors) -> dict[str, int]:
    """Error messages (None: no error) counted with their numbers blanked ("... to # ms per frame ..."), most
    frequent first."""
    counts: dict[str, int] = {}
    for error in errors:
        if error:
            key = re.sub(r"\d+(\.\d+)?", "#", error)
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def gc_passes(metrics: str) -> dict[str, dict[str, float]]:
    """The server's garbage-collector passes so far, from its /metrics text, by generation: cumulative counts by
    bucket, and the objects they freed ("collected")."""
    out: dict[str, dict[str, float]] = {}
    for generation, le, count in GC_BUCKET.findall(metrics):
        out.setdefault(generation, {})[le] = float(count)
    for generation, count in GC_FREED.findall(metrics):
        out.setdefault(generation, {})["collected"] = float(count)
    return out


def gc_passes_since(now: dict[str, dict[str, float]], before: dict[str, dict[str, float]]) -> dict[str, dict[str, int]]:
    """Passes by generation between two `gc_passes`, how many of them held the server over 20 and over 50 ms, and
    the objects they freed."""
    out = {}
    for generation, buckets in now.items():
        was = before.get(generation, {})
        delta = {le: int(n - was.get(le, 0)) for le, n in buckets.items()}
        out[generation] = {"passes": delta["+Inf"], "over_20ms": delta["+Inf"] - delta["0.02"],
                           "over_50ms": delta["+Inf"] - delta["0.05"], "collected": delta.get("collected", 0)}
    return out


def late_chunks(metrics: str) -> dict[str, float]:
    """Chunks handed out after their listener ran dry so far, from the server's /metrics text: by the engine's own
    account ("engine") and when they reached the event loop ("server"). A stall the client heard that neither
    counts happened after the server let go of the chunk."""
    return {LATE_NAMES[name]: float(value) for name, value in LATE.findall(metrics)}


def intake(metrics: str) -> dict[str, float]:
    """The server's intake so far (its handlers' start to their submit), from its /metrics text: seconds ("sum")
    and requests ("count")."""
    return {kind: float(value) for kind, value in INTAKE.findall(metrics)}


def intake_since(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """A condition's intake: its requests' seconds in all and the mean per request (ms), between two `intake`."""
    seconds, count = (now.get(k, 0.0) - before.get(k, 0.0) for k in ("sum", "count"))
    return {"seconds": round(seconds, 4), "mean_ms": round(1e3 * seconds / count, 4) if count else None}


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return r.read().decode()


def server_marks(url: str, log_path: Path) -> tuple[int, dict, dict, dict]:
    """Where the server's log, its collector's counts, its late chunks and its intake stand before a condition
    (`server_side` reads after)."""
    text = metrics_text(url)
    return log_path.stat().st_size, gc_passes(text), late_chunks(text), intake(text)


def server_side(url: str, log_path: Path, marks: tuple[int, dict, dict, dict], records_path: Path) -> dict:
    """What the server did during a condition, since `marks`: why requests failed, its collector's passes, the
    chunks it handed out late, its intake and its iteration profile."""
    offset, passes, late, taken = marks
    text = metrics_text(url)
    return {"refusals": refusals(records_path), "gc_passes": gc_passes_since(gc_passes(text), passes),
            "late_chunks": {k: int(n - late.get(k, 0)) for k, n in late_chunks(text).items()},
            "intake": intake_since(intake(text), taken), "iteration_profile": profile_since(log_path, offset)}


def profile_since(log_path: Path, offset: int) -> list[str]:
    """The engine's iteration profile lines (mean ms per part of a busy iteration, every 2 s) logged after byte
    `offset` of the server log: where a condition's iterations spent their time."""
    with log_path.open("rb") as f:
        f.seek(offset)
        return [m[1] for m in PROFILE_LINE.finditer(f.read().decode(errors="replace"))]


def requests_for(args, mode: str, load: float) -> int:
    """Measured requests of one condition: --requests, else max(60, 2 x load) in flight, or --poisson-seconds of
    arrivals at a Poisson rate."""
    if args.requests:
        return args.requests
    if mode == "open-poisson":
        return max(60, math.ceil(load * args.poisson_seconds))
    return max(60, math.ceil(2 * load))


def measure(args, out: Path, name: str, serialised: bool, modes: dict[str, list[float]],
            policy: tuple[str, ...] = (), save=lambda _: None) -> dict:
    """Starts the server, sweeps each mode's loads (one condition each, `requests_for` many), stops it; with
    --restart starts it once more and times that start. `save` gets the result so far after every condition,
    so a run cut short (a device lease, a crash) keeps what it measured."""
    prompts = load_corpus("voice_agent")
    options = {"voice": "ryan", "seed": 0, "max_frames": args.max_frames}  # the server's default chunk schedule
    slo, contract = SLO(), Contract(args.contract_ttfa_ms)
    t0, log_path = time.perf_counter(), out / f"server-{name}.log"
    with start(args, out, name, serialised, policy) as url:
        result = {"startup_s": round(time.perf_counter() - t0, 1), "slots": run_sync(wait_ready(url))["slots"]}
        for mode, loads in modes.items():
            conditions = []
            for load in loads:
                requests = requests_for(args, mode, load)
                marks = server_marks(url, log_path)
                condition_dir = out / name / f"{mode}-{load:g}"
                summary = sweep(url, mode, [load], requests, prompts, condition_dir,
                                options=options, warmup=args.warmup, slo=slo, contract=contract)
                (c,) = summary["conditions"]
                c.update(server_side(url, log_path, marks, condition_dir / "records.jsonl"))
                if mode == "closed":
                    c["waves"] = waves(condition_dir / "records.jsonl")
                conditions.append(c)
                save({**result, mode: {"conditions": conditions, "partial": True}})
                print(name, json.dumps({"condition": c["condition"], **{k: c[k] for k in COLUMNS},
                                        "safe": c["slo"]["safe"], "zero_underrun": c["contract_verdict"]["overall"]},
                                       default=float), flush=True)
            safe = safe_capacity(conditions, slo)
            zero = zero_underrun_capacity(conditions, contract)
            result[mode] = {"safe_capacity": safe, "zero_underrun_capacity": zero, "conditions": conditions,
                            "fleet": fleet_size(safe, args.target, args.price_per_hour) if safe else None}
    result["server_log"] = server_log(log_path)
    result["policy"] = " ".join(policy)
    if args.restart:
        t0 = time.perf_counter()
        with start(args, out, f"{name}-restart", serialised, policy):
            result["restart_s"] = round(time.perf_counter() - t0, 1)
        result["restart_log"] = server_log(out / f"server-{name}-restart.log")
    return result


def _misses(verdict: dict) -> str:
    """A table's verdict cell: yes, or no and the criteria missed; the SLO's check holds True per criterion met,
    the contract's verdict "pass"."""
    missed = [k for k, v in verdict.items() if k not in ("safe", "overall") and v not in (True, "pass")]
    return "yes" if not missed else f"no ({', '.join(missed)})"


def table(servers: dict) -> str:
    """The README/issue table: one row per condition, the SLO's verdict (safe) and, beside it, the streams that
    underran at zero buffer (of the valid ones, with their share) and the zero-underrun contract's verdict."""
    rows = ["| server | load | success | TTFA p50 / p95 ms | starvation p95 ms | underruns per stream | audio s/s "
            "| safe | streams that underran | zero-underrun |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in servers.items():
        server = f"{name} ({s['slots']} slot{'s' if s['slots'] != 1 else ''})"
        for mode in ("closed", "open-poisson"):
            for c in s.get(mode, {}).get("conditions", []):
                load = f"closed {c['load']:g}" if mode == "closed" else f"Poisson {c['load']:g} rps"
                share = f" ({c['underrun_share']:.0%})" if c["succeeded"] else ""  # NaN without a valid stream
                rows.append(f"| {server} | {load} | {c['success_rate']:.0%} | "
                            f"{c['ttfa_p50_ms']:.0f} / {c['ttfa_p95_ms']:.0f} | {c['starvation_p95_ms']:.0f} | "
                            f"{c['underruns_mean']:.1f} | {c['audio_s_per_s']:.1f} | {_misses(c['slo'])} | "
                            f"{c['underrun_requests']}/{c['succeeded']}{share} | "
                            f"{_misses(c['contract_verdict'])} |")
    starts = [f"{name}: ready {s['startup_s']} s after start" + (f", {s['restart_s']} s on restart"
                                                                  if "restart_s" in s else "")
              for name, s in servers.items()]
    capacities = [f"{name} {mode}: safe capacity {s[mode]['safe_capacity']:g}, zero-underrun capacity "
                  f"{s[mode]['zero_underrun_capacity']:g}" for name, s in servers.items()
                  for mode in ("closed", "open-poisson") if mode in s]
    return "\n".join(rows + ["", "; ".join(capacities), "", "; ".join(starts)]) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="0.6b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--slots", default="256", help="a count or auto (as many as fit in free device memory)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--frames-per-step", type=int, default=4)
    p.add_argument("--loads", default="1,16,64,128,256", help="closed loop: requests in flight ('' to skip)")
    p.add_argument("--rates", default="10,20,40,60,80", help="Poisson open loop: requests/s ('' to skip)")
    p.add_argument("--serialised-loads", default="1,2,4", help="closed loop on the serialised server")
    p.add_argument("--no-serialised", action="store_true", help="skip the serialised server")
    p.add_argument("--requests", type=int, help="measured requests per condition (default: max(60, 2 x load) "
                                                "closed, --poisson-seconds of arrivals open)")
    p.add_argument("--poisson-seconds", type=float, default=20.0, help="seconds of Poisson arrivals per rate")
    p.add_argument("--policies", default="",
                   help='the batched server once per policy, side by side: "name=flags;name=flags" (flags of '
                        'studies/server.py: serve\'s, --engine and --admission), e.g. '
                        '"lead1s=;lead300=--engine \'{"lead_s": 0.3}\'" (the first start compiles, the others load '
                        'its programs from the compilation cache)')
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests at the start of each condition")
    p.add_argument("--max-frames", type=int, default=48)
    p.add_argument("--seeded-ends", action="store_true",
                   help="each request ends at a frame drawn from its seed and prompt length inside the step (2 to "
                        "--max-frames), unforeseeable as real speech's end (EngineConfig.seeded_ends on the servers)")
    p.add_argument("--restart", action="store_true", help="stop and start each server once more; time that start")
    p.add_argument("--compile-cache", help="the servers' compilation cache (default: a fresh one under --out, so "
                                           "the first start is cold; 'default' for the user's cache; 'off')")
    p.add_argument("--ready-timeout-s", type=float, default=900)
    p.add_argument("--contract-ttfa-ms", type=float, default=100.0,
                   help="zero-underrun contract (beside the SLO): p95 TTFA target in ms")
    p.add_argument("--target", type=float, default=100.0, help="fleet sizing: streams to serve")
    p.add_argument("--price-per-hour", type=float, default=3.5)
    p.add_argument("--out", required=True, help="directory: records per condition, server logs, summary.json, "
                                                "table.md")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "dtype": args.dtype, "context": args.context, "max_frames": args.max_frames,
              "seeded_ends": args.seeded_ends,
              "frames_per_step": args.frames_per_step, "slots_asked": args.slots,
              "contract": vars(Contract(args.contract_ttfa_ms)), "servers": {}}
    batched = {"closed": numbers(args.loads), "open-poisson": numbers(args.rates)}
    policies = [v.partition("=") for v in args.policies.split(";") if v.strip()]
    runs = [(f"batched-{name}", False, batched, tuple(shlex.split(flags))) for name, _, flags in policies]
    runs = runs or [("batched", False, batched, ())]
    if not args.no_serialised:
        runs.append(("serialised", True, {"closed": numbers(args.serialised_loads)}, ()))

    def save(name, server):
        result["servers"][name] = server
        (out / "summary.json").write_text(json.dumps(result, indent=2, default=float))

    for name, serialised, modes, policy in runs:
        save(name, measure(args, out, name, serialised, {m: v for m, v in modes.items() if v}, policy,
                           save=partial(save, name)))
    (out / "table.md").write_text(table(result["servers"]))
    print(table(result["servers"]), flush=True)


if __name__ == "__main__":
    main()
