"""Which kernels an engine program spends its device time in: each chosen program is called under the JAX
profiler, and the trace is reduced to, per call, the wall time, the time some kernel ran (the rest is the device
waiting for the host to launch the next one), the number of kernels launched, and the kernels (and the HLO ops they
come from) that take the most time, and per model part (the talker's layers, the code predictor, sampling, the
codec: the named scopes in the model's code) its kernels and their time. Beside them, the achieved FLOP/s of a step
(its matrix products over its wall time) and XLA's count of its memory traffic. Every figure is also given per
frame. With
--variants, each program is profiled once per engine configuration, side by side in one run; compile seconds are
beside each (all programs compile at once, so they are comparable within a run only). Writes JSON.

    python bench/kernels.py --model 0.6b --slots 256 --programs step:256:1,codec:256:1,step:16:1 \
        --variants "fp32=;bf16=codec_dtype=bfloat16" --out runs/kernels-0.6b.json
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import glob
import gzip
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compile import engine_for, model_for, traced  # noqa: E402


def device_events(trace: dict) -> tuple[dict[str, list[dict]], dict]:
    """The trace's complete events on the device, by line kind ("kernels": the streams' kernels and copies;
    "xla_ops": the HLO ops they belong to), and seconds per (process, thread) for every line of the trace, so a
    reader can check what was counted."""
    procs, threads = {}, {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[e["pid"], e["tid"]] = e["args"]["name"]
    lines = collections.Counter()
    events = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        proc, thread = procs.get(e["pid"], str(e["pid"])), threads.get((e["pid"], e["tid"]), str(e["tid"]))
        lines[f"{proc} | {thread}"] += e.get("dur", 0) / 1e6
        if "/device:" in proc:
            events["kernels" if "Stream" in thread else "xla_ops" if "Ops" in thread else "other"].append(e)
    return events, {k: round(v, 4) for k, v in lines.most_common(40)}


def busy_us(events: list[dict]) -> float:
    """Microseconds during which at least one of `events` ran (overlapping kernels counted once)."""
    total, end = 0.0, -1.0
    for e in sorted(events, key=lambda e: e["ts"]):
        start, stop = e["ts"], e["ts"] + e.get("dur", 0)
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


PARTS = ("sampling", "code_predictor", "talker", "codec")  # named scopes in the model's code, innermost wins


def op_parts(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the model part its `op_name` metadata names (the innermost of `PARTS`, else
    "other"), read from a compiled program's text."""
    parts = {}
    for name, op_name in re.findall(r'%?([\w.\-]+) = [^\n]*?metadata=\{op_name="([^"]*)"', hlo_text):
        found = [(op_name.rfind(part), part) for part in PARTS if part in op_name]
        parts[name] = max(found)[1] if found else "other"
    return parts


def by_part(events: list[dict], parts: dict[str, str], calls: int) -> dict:
    """Kernels per call and their ms per call, per model part. A kernel inside a CUDA graph is attributed to the
    graph's op, so its own name (an XLA fusion's kernel is the fusion's name, '.' written '_') is tried too."""
    by_kernel = {name.replace(".", "_"): part for name, part in parts.items()}
    out: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        args = e.get("args", {})
        op = str(args.get("hlo_op") or args.get("long_name") or "").lstrip("%").split(" ")[0].split("=")[0]
        entry = out[parts.get(op) or by_kernel.get(e["name"], "other")]
        entry[0] += e.get("dur", 0)
        entry[1] += 1
    return {part: {"kernels_per_call": round(n / calls, 1), "ms_per_call": round(t / 1e3 / calls, 3)}
            for part, (t, n) in sorted(out.items())}


def frame_flops(cfg) -> float:
    """The matrix products' FLOPs of one row's frame (talker step, code predictor's 15 codes, their heads): twice
    the weights each token meets. XLA's own cost analysis counts a loop's body once and a cuBLAS call not at all."""
    def layer(d):
        q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        return d.hidden_size * (q + 2 * kv) + q * d.hidden_size + 3 * d.hidden_size * d.intermediate_size

    t, p = cfg.talker, cfg.predictor
    projection = t.hidden_size * p.hidden_size if t.hidden_size != p.hidden_size else 0
    groups = cfg.num_code_groups - 1
    talker = t.num_layers * layer(t) + t.hidden_size * t.vocab_size
    predictor = (groups + 1) * (p.num_layers * layer(p) + projection) + groups * p.hidden_size * p.vocab_size
    return 2.0 * (talker + predictor)


def costs(exe, wall_s: float, rows: int, frames: int, flops_per_row_frame: float | None) -> dict:
    """Achieved arithmetic (the products of `frame_flops` for every row and frame, over the wall time) and XLA's
    count of the program's memory traffic per frame and per second: achieved, not peak."""
    analysis = exe.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis or {}
    traffic = float(analysis.get("bytes accessed", 0.0))
    out = {"gbytes_per_frame_xla": round(traffic / frames / 1e9, 3),
           "achieved_gbytes_s_xla": round(traffic / wall_s / 1e9, 1)}
    if flops_per_row_frame:
        flops = flops_per_row_frame * rows * frames
        out |= {"gflop_per_frame": round(flops / frames / 1e9, 1), "achieved_tflops": round(flops / wall_s / 1e12, 1)}
    return out


def summarise(events: list[dict], calls: int, top: int) -> dict:
    """Per call: device-busy ms and kernel count; the `top` kernels by total time (with the HLO op, when the
    trace names it)."""
    by_name: dict[str, list] = collections.defaultdict(lambda: [0.0, 0, ""])
    for e in events:
        args = e.get("args", {})
        op = args.get("hlo_op") or args.get("long_name") or args.get("tf_op") or ""
        entry = by_name[e["name"]]
        entry[0] += e.get("dur", 0)
        entry[1] += 1
        entry[2] = entry[2] or str(op)[:240]
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "busy_ms_per_call": round(busy_us(events) / 1e3 / calls, 3),
        "kernels_per_call": round(len(events) / calls, 1),
        "top": [{"kernel": k[:160], "ms_per_call": round(t / 1e3 / calls, 3), "count_per_call": round(n / calls, 1),
                 "op": op} for k, (t, n, op) in ranked],
    }


def variants(text: str) -> dict[str, dict]:
    """"name=field=value,field=value;name2=" -> {name: EngineConfig overrides}; values are typed from the fields'
    defaults."""
    from qtts_jax.engine import EngineConfig

    kinds = {f.name: type(getattr(EngineConfig(), f.name)) for f in dataclasses.fields(EngineConfig)}
    out = {}
    for part in filter(None, (x.strip() for x in text.split(";"))):
        name, _, rest = part.partition("=")
        pairs = [kv.split("=", 1) for kv in rest.split(",") if kv]
        out[name] = {k: (v.lower() in ("1", "true", "on")) if kinds[k] is bool else kinds[k](v) for k, v in pairs}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="0.6b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--programs", default="step:256:1,codec:256:1,step:16:1",
                   help="kind:a:b of step|codec|first|insert (insert: bucket and requests), comma-separated")
    p.add_argument("--variants", default="default=",
                   help='engine configurations side by side: "name=field=value,...;name2=..." (EngineConfig fields)')
    p.add_argument("--calls", type=int, default=5, help="profiled calls per program")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--hlo", action="store_true",
                   help="also write each program's optimized HLO beside --out (what a kernel's name belongs to)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import jax

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    model = model_for(args)
    engines = {name: engine_for(args, model, **overrides) for name, overrides in variants(args.variants).items()}
    keys = [(kind, int(a), int(b)) for kind, a, b in (x.split(":") for x in args.programs.split(","))]
    jobs = [(name, engine, key) for name, engine in engines.items() for key in keys]
    lowered = [engine.runner.lower(*key) for _, engine, key in jobs]

    def compile_one(low):
        t0 = time.perf_counter()
        return low.compile(), time.perf_counter() - t0

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        compiled = list(pool.map(compile_one, lowered))
    result = {"model": args.model, "dtype": args.dtype, "slots": args.slots, "context": args.context,
              "device": str(jax.devices()[0]), "command": " ".join(sys.argv), "programs": {}}
    for (variant, engine, key), (exe, compile_s) in zip(jobs, compiled):
        engine.runner.programs[key] = exe
        for _ in range(2):  # the first call of an executable pays its one-off set-up
            jax.block_until_ready(engine.runner.idle_call(key))
        walls = []

        def calls():
            for _ in range(args.calls):
                t0 = time.perf_counter()
                jax.block_until_ready(engine.runner.idle_call(key))
                walls.append(time.perf_counter() - t0)

        events, lines = device_events(traced(calls))
        name = ":".join(map(str, (variant, *key)))
        hlo = exe.as_text()
        if args.hlo:
            Path(args.out).with_suffix(f".{name.replace(':', '-')}.hlo.txt").write_text(hlo)
        wall = statistics.median(walls)
        frames = key[2] if key[0] in ("step", "codec") else 1
        kernels = summarise(events.get("kernels", []), args.calls, args.top)
        result["programs"][name] = {
            "wall_ms": round(wall * 1e3, 3), "frames": frames, "wall_ms_per_frame": round(wall * 1e3 / frames, 3),
            "kernels_per_frame": round(kernels["kernels_per_call"] / frames, 1),
            "busy_share": round(kernels["busy_ms_per_call"] / (wall * 1e3), 3),
            **costs(exe, wall, key[1], frames, frame_flops(model.cfg) if key[0] == "step" else None),
            "parts": by_part(events.get("kernels", []), op_parts(hlo), args.calls),
            "compile_s": round(compile_s, 2), "trace_lines_s": lines,
            **{kind: summarise(e, args.calls, args.top) for kind, e in events.items()}}
        r = result["programs"][name]
        print(name, {k: r.get(k) for k in ("wall_ms_per_frame", "kernels_per_frame", "busy_share", "achieved_tflops")},
              r["parts"], flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
