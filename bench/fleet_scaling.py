"""The fleet's two measured targets (issue 23), in one run on CPU replicas:

1. **Scaling**: the capacity study (closed loop, the seed's SLO and the zero-underrun contract) against the fleet
   with one replica, then with `--replicas` (the same local Ray instance, scaled up in place): the ratio of the
   safe capacities, against the fleet model's assumption that N replicas carry N times one (`studies/fleet.py`).
2. **The Ray path's overhead**: one stream at a time, alternating between `qtts-jax serve` and the one-replica
   fleet (the same settings, the same XLA flags), time to first audio at the client.

CPU replicas reserve one CPU each and run XLA on one thread (fleet/app.py), so on a machine of C cores the fleet
fits C - 1 replicas beside Ray and the client: the summary records how busy the machine was. The default (2
replicas of 1 slot, tiny-random) fits a 2-core machine: each replica's limit is then its own slots, as a GPU
replica's is its own device. With 2 slots each, 4 streams and Ray's processes saturate 2 cores and the engines
step slower than their admission allows (`--slots 2`: 1.5x; bench/results/fleet-scaling-2slots-cpu.json):

    python bench/fleet_scaling.py --out bench/results/fleet-scaling-cpu.json

Where Ray sees GPUs each replica takes one (`--gpus-per-replica`), and `--rates` adds Poisson studies (each
`--poisson-seconds` of arrivals) beside the closed loop. On a machine of one GPU, `--replicas 1` measures the path's
overhead and one GPU replica's capacity, the plain server sharing the GPU for the overhead part (so give each
process part of its memory, XLA_PYTHON_CLIENT_MEM_FRACTION=0.4):

    python bench/fleet_scaling.py --model 0.6b --dtype bfloat16 --frames-per-step 4 --slots 64 --context 512 \
        --replicas 1 --loads 16 32 64 --rates 10 20 --max-frames 60 --out runs/fleet-gpu-0.6b.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.app import RAY_ENV, FleetConfig, build  # noqa: E402
from serving.settings import Settings  # noqa: E402
from studies.capacity import study  # noqa: E402
from studies.corpora import load_corpus  # noqa: E402
from studies.load import speak, wait_ready  # noqa: E402
from studies.records import RequestRecord  # noqa: E402
from studies.server import free_port, local_server  # noqa: E402
from studies.stats import percentile  # noqa: E402
from studies.sweep import run_sync  # noqa: E402

APP = "qtts"


def deploy(url: str, settings: Settings, fleet: FleetConfig, engine_factory=None) -> list[str]:
    """Runs (or rescales) the application and returns the replica ids once /ready lists them all, idle and with
    nothing left compiling."""
    from ray import serve

    replicas = fleet.replicas
    serve.run(build(settings, fleet, engine_factory), name=APP, route_prefix="/")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        body = requests.get(f"{url}/ready", timeout=10).json()
        ids = [r["replica"] for r in body.get("replicas", []) if r["ready"]]
        if len(ids) == replicas:
            run_sync(wait_ready(url, max(1.0, deadline - time.monotonic()), idle=True))  # at full size
            return ids
        time.sleep(0.5)
    raise TimeoutError(f"the fleet never listed {replicas} ready replicas")


async def first_audio(urls: dict[str, str], rounds: int, options: dict, text: str) -> dict[str, list[float]]:
    """TTFA (ms) of one stream at a time at the client and as the server measured it, the servers taking turns, so
    drift hits each alike."""
    out: dict[str, list[float]] = {key: [] for label in urls for key in (label, f"{label} server")}
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as s:
        for _ in range(rounds):
            for label, url in urls.items():
                r = RequestRecord(request_id=uuid.uuid4().hex, condition="closed:1", mode="closed", load=1, prompt=0,
                                  text=text, send_s=0.0)
                await speak(s, url, r, options, t0, 60.0)
                if not r.ok:
                    raise RuntimeError(f"{label}: {r.invalid}")
                out[label].append(r.derived()["ttfa_ms"])
                out[f"{label} server"].append(r.server_ttfa_ms)  # X-TTFA-Ms: inside the server, past the network
    return out


def overhead(url: str, settings: Settings, args, options: dict, text: str) -> dict:
    """The fleet's first-audio cost over `qtts-jax serve` (the target: at most +15 ms at the median)."""
    with local_server(args.model, slots=args.slots, context=args.context, engine=settings.engine,
                      extra_args=("--compile-cache", settings.compile_cache, "--dtype", settings.dtype)) as plain:
        ttfa = run_sync(first_audio({"serve": plain, "fleet": url}, args.ttfa_rounds, options, text))
    out = {label: {"p50_ms": percentile(v, 50), "p95_ms": percentile(v, 95), "n": len(v)} for label, v in ttfa.items()}
    out["p50_difference_ms"] = out["fleet"]["p50_ms"] - out["serve"]["p50_ms"]
    print(json.dumps(out), file=sys.stderr)
    return out


def capacity(summary: dict) -> dict:
    """What the scaling comparison needs from one study's summary.json (the full one stays in --runs-dir)."""
    server = summary["servers"][0]
    keep = ("load", "requests", "success_rate", "rejected_429", "ttfa_p95_ms", "starvation_p95_ms", "underrun_share",
            "throughput_rps", "verdict", "contract_verdict")
    return {"safe_capacity": server["safe_capacity"], "safe_capacity_status": server["safe_capacity_status"],
            "zero_underrun_capacity": server["zero_underrun_capacity"], "machine_load": server["machine_load"],
            "conditions": [{k: c[k] for k in keep} for c in server["conditions"]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights (and the codec's)")
    ap.add_argument("--frames-per-step", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=2, help="the fleet compared with one replica (default 2)")
    ap.add_argument("--loads", type=int, nargs="*", default=[1, 2, 3], help="streams in flight (closed loop)")
    ap.add_argument("--rates", type=float, nargs="*", default=[], help="Poisson arrivals, requests/s (open loop)")
    ap.add_argument("--poisson-seconds", type=float, default=20.0, help="seconds of arrivals per rate")
    ap.add_argument("--gpus-per-replica", type=float,
                    help="GPUs each replica takes (default: 1 when Ray sees a GPU, else 0: CPU replicas)")
    ap.add_argument("--requests", type=int, default=60, help="measured requests per load (59 bound a p95)")
    ap.add_argument("--max-frames", type=int, default=24)
    ap.add_argument("--ttfa-rounds", type=int, default=40, help="single streams per server for the overhead")
    ap.add_argument("--parts", nargs="+", choices=("overhead", "scaling"), default=["overhead", "scaling"])
    ap.add_argument("--sim-device", action="store_true",
                    help="replicas over a simulated H200 each (bench/sim_device.py, the host's work inside each "
                         "call included; tiny-random prepares the requests): the fleet's own host side on a CPU")
    ap.add_argument("--runs-dir", default="runs/fleet-scaling")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.sim_device and "overhead" in args.parts:
        ap.error("--sim-device measures the scaling part only (bench/host_serving.py runs one server over it)")

    import ray
    from ray import serve

    os.environ.update(RAY_ENV)
    settings = Settings(model=args.model, slots=args.slots, context=args.context, dtype=args.dtype,
                        engine={"frames_per_step": args.frames_per_step, "codec_dtype": args.dtype},
                        compile_cache=os.environ.get("QTTS_COMPILE_CACHE", "/tmp/qtts-fleet-scaling-xla"))
    engine_factory = None
    if args.sim_device:
        from bench.sim_device import sim_engine

        settings = dataclasses.replace(settings, model="tiny-random", warm_voice_encoders=False)
        engine_factory = functools.partial(sim_engine, xla_host=True)
        # Ray's local workers inherit this process's environment: the replicas can import bench.sim_device
        root = str(Path(__file__).resolve().parents[1])
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    options = {"voice": "ryan", "seed": 0, "max_frames": args.max_frames}  # the server's default chunk schedule
    prompts = load_corpus("voice_agent")
    runs = Path(args.runs_dir)
    result: dict = {"bench": "fleet_scaling", "model": args.model, "dtype": args.dtype, "slots": args.slots,
                    "context": args.context, "frames_per_step": args.frames_per_step,
                    "replicas": args.replicas, "loads": args.loads, "rates": args.rates, "requests": args.requests,
                    "poisson_seconds": args.poisson_seconds,
                    "max_frames": args.max_frames, "cpus": os.cpu_count(), "sim_device": args.sim_device,
                    "ray_serve_env": {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE")},
                    "command": " ".join([Path(sys.executable).name, *sys.argv])}
    ray.init(num_cpus=max(os.cpu_count() or 1, args.replicas + 1), include_dashboard=False, logging_level="ERROR")
    gpus = args.gpus_per_replica
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    # the plain server gets the replicas' XLA flags, so the overhead compares the paths, not the engines
    env_vars = FleetConfig(gpus=gpus).actor_options().get("runtime_env", {}).get("env_vars", {})
    os.environ["XLA_FLAGS"] = env_vars.get("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    result.update(gpus_per_replica=gpus, xla_flags=os.environ["XLA_FLAGS"])
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    try:
        deploy(url, settings, FleetConfig(replicas=1, gpus=gpus), engine_factory)
        if "overhead" in args.parts:
            result["overhead"] = overhead(url, settings, args, options, prompts[0])
        for replicas in sorted({1, args.replicas}) if "scaling" in args.parts else ():
            if replicas > 1:
                deploy(url, settings, FleetConfig(replicas=replicas, gpus=gpus), engine_factory)
            label = f"{replicas} replica{'s' * (replicas > 1)}"
            if args.loads:
                summary = study({label: url}, runs / f"{replicas}-replicas", "closed", args.loads, args.requests,
                                prompts, options)
                result[label] = capacity(summary)
                print(label, json.dumps({k: v for k, v in result[label].items() if k != "conditions"}),
                      file=sys.stderr)
            for rate in args.rates:  # each rate its own study: its requests are its seconds of arrivals
                summary = study({label: url}, runs / f"{replicas}-replicas-poisson-{rate:g}", "open-poisson", [rate],
                                max(1, round(rate * args.poisson_seconds)), prompts, options)
                result.setdefault(f"{label}, Poisson", []).append(capacity(summary))
                print(label, rate, json.dumps(result[f"{label}, Poisson"][-1]["conditions"]), file=sys.stderr)
            Path(args.out).write_text(json.dumps(result, indent=1, default=float))
    finally:
        serve.shutdown()
        ray.shutdown()
    if "scaling" in args.parts and args.replicas > 1 and args.loads:
        one, many = result["1 replica"], result[f"{args.replicas} replicas"]
        result["scaling"] = {
            "safe_capacity_ratio": many["safe_capacity"] / one["safe_capacity"] if one["safe_capacity"] else None,
            "zero_underrun_capacity_ratio": many["zero_underrun_capacity"] / one["zero_underrun_capacity"]
            if one["zero_underrun_capacity"] else None,
            "fleet_model_safe_capacity": args.replicas * one["safe_capacity"],  # N replicas carry N times one
        }
        print(json.dumps(result["scaling"]), file=sys.stderr)
    # issue 25's measure: the highest Poisson rate inside the zero-underrun contract, N replicas against one
    if "scaling" in args.parts and args.replicas > 1 and args.rates:
        one, many = (max(c["zero_underrun_capacity"] for c in result[f"{label}, Poisson"])
                     for label in ("1 replica", f"{args.replicas} replicas"))
        result["poisson_scaling"] = {"zero_underrun_rate_1": one, f"zero_underrun_rate_{args.replicas}": many,
                                     "ratio": many / one if one else None}
        print(json.dumps(result["poisson_scaling"]), file=sys.stderr)
    Path(args.out).write_text(json.dumps(result, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
