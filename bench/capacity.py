"""Capacity study on the GPU without the notebook toolchain: a batched and a serialised local server of the
same model, each swept in closed loop with the studies library, side by side in one JSON.

Same method and library as `qtts-jax study capacity` (SLOs, zero-buffer starvation, safe capacity, fleet),
with JSON instead of the HTML report: the GPU machine has no papermill/nbconvert. Random weights force
frame counts via ``max_frames``.

    python bench/capacity.py --model 0.6b --slots 64 --loads 1,2,4,8,16,32,64 --serialised-loads 1,2,4 \
        --out runs/capacity-0.6b
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from studies.corpora import load_corpus  # noqa: E402
from studies.fleet import fleet_size  # noqa: E402
from studies.server import local_server  # noqa: E402
from studies.slo import SLO  # noqa: E402
from studies.sweep import sweep  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="0.6b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--frames-per-step", type=int, default=4)
    p.add_argument("--loads", default="1,2,4,8,16,32,64")
    p.add_argument("--serialised-loads", default="1,2,4")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-frames", type=int, default=48)
    p.add_argument("--target", type=float, default=100.0)
    p.add_argument("--price-per-hour", type=float, default=3.5)
    p.add_argument("--out", required=True, help="directory: one sub-directory of records per server, summary.json")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_corpus("voice_agent")
    options = {"voice": "ryan", "seed": 0, "max_frames": args.max_frames, "chunk_schedule": [1, 2, 4]}
    slo = SLO()
    result = {"model": args.model, "dtype": args.dtype, "max_frames": args.max_frames, "servers": {}}
    for name, serialised, loads in (("batched", False, args.loads), ("serialised", True, args.serialised_loads)):
        t0 = time.perf_counter()
        extra = ("--dtype", args.dtype)
        with local_server(args.model, slots=args.slots, context=args.context, frames_per_step=args.frames_per_step,
                          serialised=serialised, log_path=out / f"server-{name}.log", ready_timeout_s=600,
                          extra_args=extra) as url:
            started = time.perf_counter() - t0
            summary = sweep(url, "closed", [float(x) for x in loads.split(",")], args.requests, prompts,
                            out / name, options=options, warmup=args.warmup, slo=slo)
        safe = summary["safe_capacity"]
        result["servers"][name] = {
            "slots": 1 if serialised else args.slots, "startup_s": round(started, 1),
            "safe_capacity": safe,
            "fleet": fleet_size(safe, args.target, args.price_per_hour) if safe else None,
            "conditions": [{k: c[k] for k in c if k != "per_request"} for c in summary["conditions"]],
        }
        (out / "summary.json").write_text(json.dumps(result, indent=2, default=float))
        print(name, "safe capacity:", safe, flush=True)
        for c in summary["conditions"]:
            print(json.dumps({k: c.get(k) for k in ("condition", "success_rate", "ttfa_p50_ms", "ttfa_p95_ms",
                                                     "starvation_p95_ms", "throughput_rps", "audio_s_per_s", "slo")}, default=float),
                  flush=True)


if __name__ == "__main__":
    main()
