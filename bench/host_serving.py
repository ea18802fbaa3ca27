"""The whole server's host side under load, with the device simulated: `qtts-jax serve`'s app and engine loop over
`sim_device.RealTimeRunner` (each call costs what it costs on the H200, 0.6B shape), swept with the capacity
study's Poisson open loop (and, with `--loads`, its closed loop) under the zero-underrun contract (a client that
plays from the first byte and counts any stall). What is left between this and the GPU server is what XLA does
on the host inside its calls, unless a variant passes `--xla-host` (each call then holds the engine's thread as
long as the H200's did: sim_device.py): what this shows comes from the loop's decisions on the device's real costs
and from the host's own work (the event loop, the engine's threads, the GIL between them).

Each variant is one server process started with its own settings (`name=flags`, flags of this script's `--serve`
mode, e.g. `--xla-host` or `--setting max_step_s=0.04`), all variants in one run, one after another. Writes
JSON: per variant and rate the study's columns, the refusals and the engine's iteration profile.

    python bench/host_serving.py --rates 40,60 --variants "default=;step-40ms=--setting max_step_s=0.04" \
        --out bench/results/host-serving-cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.capacity import COLUMNS, requests_for, server_marks, server_side, waves  # noqa: E402


def serve(argv: list[str]) -> int:
    """The child: one server over the simulated device."""
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--xla-host", action="store_true",
                   help="each device call holds the engine's thread for XLA's host work in it, as on the H200")
    p.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE",
                   help="an EngineConfig or AdmissionConfig field over its default, its value as JSON, e.g. "
                        "max_step_s=0.04 (repeatable)")
    args = p.parse_args(argv)
    from bench.sim_device import sim_engine
    from qtts_jax.engine import EngineConfig
    from serving.app import run
    from serving.admission import AdmissionConfig
    from serving.settings import Settings

    engine, admission = {}, {}
    for item in args.setting:
        name, _, value = item.partition("=")
        for config, fields in ((engine, EngineConfig), (admission, AdmissionConfig)):
            if name in {f.name for f in dataclasses.fields(fields)}:
                config[name] = json.loads(value)
                break
        else:
            p.error(f"--setting {item}: no such field of EngineConfig or AdmissionConfig")
    settings = Settings.from_env(port=args.port, slots=args.slots, context=512, compile_cache="off",
                                 warm_voice_encoders=False, engine=engine, admission=admission)
    return run(settings, sim_engine(settings, xla_host=args.xla_host))


def sweep_variant(args, name: str, flags: str, out: Path) -> dict:
    from studies.corpora import load_corpus
    from studies.load import wait_ready
    from studies.server import free_port
    from studies.slo import SLO, Contract
    from studies.sweep import run_sync, sweep

    port = free_port()
    log_path = out / f"server-{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(port), "--slots", str(args.slots),
                                 *shlex.split(flags)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "QTTS_DRAIN_TIMEOUT_S": "5"})
    url = f"http://127.0.0.1:{port}"
    conditions = []
    try:
        run_sync(wait_ready(url, 120, idle=True))
        contract = Contract(args.contract_ttfa_ms)
        for mode, load in [("closed", n) for n in args.loads] + [("open-poisson", r) for r in args.rates]:
            marks = server_marks(url, log_path)
            closed = mode == "closed"
            cdir = out / name / (f"closed-{load}" if closed else f"poisson-{load:g}")
            summary = sweep(url, mode, [load], requests_for(args, mode, load), load_corpus("voice_agent"), cdir,
                            options={"voice": "ryan", "seed": 0, "max_frames": args.max_frames},
                            warmup=args.warmup, slo=SLO(), contract=contract)
            (c,) = summary["conditions"]
            row = {"mode": mode, "load" if closed else "rate": load, **{k: c[k] for k in COLUMNS},
                   "zero_underrun": c["contract_verdict"]["overall"],
                   **server_side(url, log_path, marks, cdir / "records.jsonl")}
            if closed:
                row["waves"] = waves(cdir / "records.jsonl")
            conditions.append(row)
            print(name, json.dumps({k: v for k, v in row.items() if k != "iteration_profile"}, default=float),
                  flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"flags": flags, "conditions": conditions}


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        sys.exit(serve(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="40,60", help="Poisson requests/s ('' for none)")
    p.add_argument("--loads", default="", help="closed loop: requests in flight")
    p.add_argument("--variants", default="default=", help='"name=flags;name=flags" (flags of the --serve mode)')
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--seconds", dest="poisson_seconds", type=float, default=20.0, help="of Poisson arrivals per rate")
    p.add_argument("--requests", type=int, help="measured requests per condition (default: max(60, 2 x load) "
                                                "closed, --seconds of arrivals Poisson)")
    p.add_argument("--max-frames", type=int, default=60)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--contract-ttfa-ms", type=float, default=100.0)
    p.add_argument("--runs-dir", help="keep each rate's records and the server logs here (default: discarded)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    args.rates = [float(x) for x in args.rates.split(",") if x]
    args.loads = [int(x) for x in args.loads.split(",") if x]
    result = {"command": " ".join(sys.argv), "slots": args.slots, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(args.runs_dir or tmp)
        runs.mkdir(parents=True, exist_ok=True)
        for item in args.variants.split(";"):
            name, _, flags = item.partition("=")
            result["variants"][name] = sweep_variant(args, name, flags, runs)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2, default=float) + "\n")


if __name__ == "__main__":
    main()
