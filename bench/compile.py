"""Why the engine's programs take minutes to compile: each chosen program compiled alone (no parallel contention),
under several sets of XLA flags side by side, with its compile seconds, XLA's memory plan (temp bytes), the
rematerialization warnings XLA printed, one call's run time and its host time (how long the call takes to
return, before the device is waited on) and how many output addresses its calls gave (XLA records a CUDA graph
again whenever one has moved), so a flag that cuts compiling can be checked not to slow the program;
with `--codes-check`, each variant also generates a few seeded streams on a small engine and reports a digest of
their codes, so a flag can be checked not to change what the programs compute.
Each variant runs in a subprocess of its own (XLA reads its flags once); all of them at once, compiling side by
side, then timing their programs one variant at a time under a shared lock once every variant has compiled (a
host-bound program timed while another process compiles reads slower), so that no two time the GPU together and
none times beside a compile. Writes JSON.

    python bench/compile.py --model 0.6b --slots 256 --programs step:256:1,step:256:4,codec:256:8 \
        --variants "default=;no-remat=--xla_disable_hlo_passes=rematerialization" --out runs/compile-0.6b.json

A variant's environment token QTTS_BENCH_PROGRAMS=kind:a:b,... gives it programs of its own (e.g. one program per
variant, so a set compiles in processes side by side: compare with one variant compiling the set alone).
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import glob
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REMAT = re.compile(r"[Cc]an't reduce memory use below ([\d.]+)([KMGT]i?B)")
ENV_TOKEN = re.compile(r"^[A-Z_][A-Z0-9_]*=")  # a variant's NAME=VALUE token: an environment variable, not a flag
# XLA's pass that turns a program's thunks into CUDA graphs logs, at verbosity 2, each thunk it leaves out and why;
# a loop goes into a graph only if every thunk of its body does, so these lines say what keeps a loop on the host
GRAPH_LOG = re.compile(r"command_buffer_conversion_pass\.cc:\d+\] (.*)")
NUMBERS = re.compile(r"0x[0-9a-f]+|\d+")  # what varies between lines that say the same thing


def model_for(args):
    """The random-weight model of --model at --dtype, with the loops that QTTS_BENCH_UNROLL names (a variant's
    environment: "talker" the talker's layers, "groups" the code predictor's group steps, comma-separated)
    unrolled in the source."""
    import jax.numpy as jnp

    from qtts_jax import nn
    from qtts_jax.model import load_model

    model = load_model(args.model, dtype=jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32)
    unroll = {name for name in os.environ.get("QTTS_BENCH_UNROLL", "").split(",") if name}
    if unroll - {"talker", "groups"}:
        raise SystemExit(f"QTTS_BENCH_UNROLL: {sorted(unroll)}; talker and groups are known")
    if unroll:
        talker = nn.merge(model.graph, model.params)
        talker.stack.unrolled = "talker" in unroll
        talker.predictor.unrolled_groups = "groups" in unroll
        model.graph = nn.split(talker)[0]
    return model


def engine_for(args, model=None, **overrides):
    """The engine `qtts-jax serve` builds for these slots and context (on `model`, else one loaded here), with
    --engine's and then `overrides`' fields of its EngineConfig."""
    import dataclasses

    from qtts_jax.engine import Engine
    from serving.settings import Settings

    config = Settings(slots=args.slots, context=args.context, engine=json.loads(args.engine)).engine_config()
    return Engine(model or model_for(args), dataclasses.replace(config, **overrides))


def engine_args(p: argparse.ArgumentParser) -> None:
    """The arguments `engine_for` reads: the model, its dtype, the slots and their context."""
    p.add_argument("--model", default="0.6b")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--engine", default="{}", help='EngineConfig fields as JSON, e.g. \'{"codec_dtype": "bfloat16"}\'')


def seeded_codes(args, model, streams: int, frames: int, **overrides) -> list[np.ndarray]:
    """The codes of `streams` seeded streams of `frames` frames, made together on an 8-slot engine of this variant
    with `overrides` of its configuration (warmed up first, so the programs of every step size it uses are
    compiled)."""
    from qtts_jax.request import Request

    engine = engine_for(args, model=model, slots=8, **overrides)
    engine.warmup()
    made = [engine.submit(engine.prepare(Request(f"Codes check number {i}.", speaker="ryan", seed=i,
                                                 max_frames=frames)), lambda chunk: None) for i in range(streams)]
    while not all(s.finished for s in made):
        engine.run_once()
    return [np.asarray(s.codes, np.int32) for s in made]


def codes_digest(args, model) -> str:
    """A digest of every code of `args.codes_check` seeded streams of 24 frames (`seeded_codes`)."""
    import hashlib

    digest = hashlib.sha256()
    for codes in seeded_codes(args, model, args.codes_check, 24):
        digest.update(codes.tobytes())
    return digest.hexdigest()[:16]


def child(args) -> dict:
    """This process's variant: compile each program alone, then time them all under the shared lock."""
    import jax

    engine = engine_for(args)
    rows, compiled = {}, {}
    # a variant's own programs (QTTS_BENCH_PROGRAMS in its environment): variants that split one set of programs
    # between them compile it in processes side by side, against one variant compiling it alone
    for spec in os.environ.get("QTTS_BENCH_PROGRAMS", args.programs).split(","):
        kind, a, b = spec.split(":")
        a, b = int(a), int(b)
        t0 = time.perf_counter()
        lowered = engine.runner.lower(kind, a, b)
        lower_s = time.perf_counter() - t0
        compiled[spec] = key = (kind, a, b)
        spans = []

        def compile_it():
            engine.runner.programs[key] = lowered.compile()

        t0 = time.perf_counter()
        if args.phases:
            spans = host_spans(traced(compile_it), args.phases)
        else:
            compile_it()
        compile_s = time.perf_counter() - t0
        mem = engine.runner.programs[key].memory_analysis()
        rows[spec] = {"lower_s": round(lower_s, 2), "compile_s": round(compile_s, 2),
                      "temp_gib": round(getattr(mem, "temp_size_in_bytes", 0) / 2**30, 3),
                      **({"compile_spans": spans} if args.phases else {})}
        print(spec, rows[spec], file=sys.stderr, flush=True)
    if args.codes_check:
        rows["codes_digest"] = codes_digest(args, engine.model)
    mark_compiled(args.barrier)
    wait_for_siblings(args.barrier, args.siblings)
    with open(args.lock, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for spec, key in compiled.items():  # each on padding rows (every write dropped), the state threaded
            jax.block_until_ready(engine.runner.idle_call(key))
            host, total, addresses = [], [], set()
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out = engine.runner.idle_call(key)
                host.append(time.perf_counter() - t0)
                jax.block_until_ready(out)
                total.append(time.perf_counter() - t0)
                addresses.add(tuple(a.unsafe_buffer_pointer() for a in jax.tree.leaves(out)))
            rows[spec].update(run_ms=round(statistics.median(total) * 1e3, 3),
                              host_ms=round(statistics.median(host) * 1e3, 3),
                              out_addresses=len(addresses))  # 1: every call's output where the last one's was
            if args.placed_args:
                rows[spec].update(placed_timings(engine.runner, key, args.repeats))
            print(spec, rows[spec], file=sys.stderr, flush=True)
    return rows


def placed_timings(runner, key, repeats: int) -> dict:
    """Run and host ms of program `key` three other ways than the engine's (`run_ms`: its per-call arguments
    (rows, limits...) written into buffers the program keeps, `Runner.inputs_held`, and its outcome into the
    buffers of its last one, `Runner.run`): the arguments copied to the device afresh for every call (`fresh`: new
    buffers each time, as the engine did before 99681c0), placed on the device once and passed again every call
    (`placed`: no copy at all), and the engine's arguments with the outcome in new buffers every call
    (`new_outcome`, as before the outcome was kept). XLA records a CUDA graph again whenever a buffer it reads or
    writes has moved; this tells what that costs, and what the engine's copy into kept buffers costs beside none."""
    import jax

    def call_args():
        return runner.padding_call(*key, runner.state, runner.codec_state)

    host_args = [i for i, a in enumerate(call_args()) if isinstance(a, (np.ndarray, np.generic))]
    placed = {i: jax.device_put(call_args()[i]) for i in host_args}

    def given(way):  # the host arguments as this way passes them
        return tuple(way(i, a) if i in host_args else a for i, a in enumerate(call_args()))

    def new_outcome():  # with no last outcome to write into, the runner makes new buffers for this call's
        runner.outcomes.pop(key, None)
        return call_args()

    ways = {"fresh": lambda: given(lambda i, a: jax.device_put(a)), "placed": lambda: given(lambda i, a: placed[i]),
            "new_outcome": new_outcome}
    out = {}
    for way, args_of in ways.items():
        def call():
            return runner.run(key, args_of())

        jax.block_until_ready(call())
        host, total = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            res = call()
            host.append(time.perf_counter() - t0)
            jax.block_until_ready(res)
            total.append(time.perf_counter() - t0)
        out.update({f"run_ms_{way}": round(statistics.median(total) * 1e3, 3),
                    f"host_ms_{way}": round(statistics.median(host) * 1e3, 3)})
    return out


def mark_compiled(barrier: str, pid: int | None = None) -> None:
    """Variant `pid` (this process's by default) is done compiling, or has ended: it holds no other back."""
    (Path(barrier) / str(pid or os.getpid())).touch()


def wait_for_siblings(barrier: str, siblings: int) -> None:
    """Wait until all `siblings` variants have marked `barrier` (the parent marks any that ends, and ends any past
    its timeout, so none is waited for past that)."""
    while len(list(Path(barrier).iterdir())) < siblings:
        time.sleep(0.2)


def traced(work) -> dict:
    """The JAX profiler's trace (its Chrome-trace JSON) of `work()`, which must wait for its own device work."""
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        work()
        jax.profiler.stop_trace()
        with gzip.open(glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True)[0]) as f:
            return json.load(f)


def host_spans(trace: dict, top: int) -> list[dict]:
    """The `top` host-side span names of a trace by their summed seconds, each with its count: where a compile's
    time goes (XLA's passes, its autotuners, code generation), as XLA names its own work (Python's frames, named
    "$file:line function", left out). Nested spans each count their whole length, so the sums overlap."""
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    total, count = collections.Counter(), collections.Counter()
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and "/host:" in procs.get(e["pid"], "") and not e["name"].startswith("$"):
            name = NUMBERS.sub("#", e["name"])[:120]
            total[name] += e.get("dur", 0) / 1e6
            count[name] += 1
    return [{"span": name, "s": round(s, 2), "count": count[name]} for name, s in total.most_common(top)]


def _read(f) -> str:
    f.seek(0)
    return f.read()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_args(p)
    p.add_argument("--programs", default="step:256:1,step:256:4,codec:256:8,insert:128:32",
                   help="kind:rung:size of step|first|codec|insert, comma-separated")
    p.add_argument("--variants", default="default=",
                   help='"name=XLA flags;name=flags" (an empty value: none; a NAME=VALUE token sets an environment '
                        'variable of that variant\'s process)')
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--codes-check", type=int, default=0, metavar="N",
                   help="also generate N seeded streams on an 8-slot engine and report a digest of their codes")
    p.add_argument("--graph-log", action="store_true",
                   help="count the reasons XLA gives for each thunk it leaves out of a command buffer (CUDA graph)")
    p.add_argument("--placed-args", action="store_true",
                   help="also time each program with its per-call arguments copied afresh each call, placed once, "
                        "and with its outcome in new buffers each call")
    p.add_argument("--phases", type=int, default=0, metavar="N",
                   help="trace each compile with the profiler and report its N host spans of most seconds")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="compile the variants one after another, each alone on the machine, not side by side")
    p.add_argument("--child-timeout-s", type=float, default=200, help="give up on a variant after this long")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lock", default="/tmp/qtts-compile-bench.lock", help=argparse.SUPPRESS)
    p.add_argument("--barrier", help=argparse.SUPPRESS)  # where each child marks itself compiled
    p.add_argument("--siblings", type=int, default=1, help=argparse.SUPPRESS)  # how many children mark it
    p.add_argument("--out")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    result = {"model": args.model, "slots": args.slots, "context": args.context, "variants": {}}
    base = os.environ.get("XLA_FLAGS", "")
    started, wall = {}, {}
    variants = args.variants.split(";")
    siblings = 1 if args.one_at_a_time else len(variants)
    barrier = tempfile.mkdtemp(prefix="qtts-compile-bench-")

    def finish(running):  # a variant that ends early (it failed) counts as compiled: the others must not wait for it
        while running:
            for name, (_, proc, _, _, t0) in list(running.items()):
                if proc.poll() is None and time.perf_counter() - t0 > args.child_timeout_s:
                    proc.kill()
                if proc.poll() is not None:
                    mark_compiled(barrier, proc.pid)
                    wall[name] = round(time.perf_counter() - t0, 1)
                    del running[name]
            time.sleep(0.2)

    for variant in variants:
        name, _, flags = variant.partition("=")
        # a token NAME=VALUE (no leading dashes) is an environment variable of the variant's process, the rest XLA's
        settings = dict(t.split("=", 1) for t in flags.split() if ENV_TOKEN.match(t))
        xla = " ".join(t for t in flags.split() if not ENV_TOKEN.match(t))
        # every variant holds its own engine on the one GPU: no process may take most of its memory up front
        env = {**os.environ, **settings, "XLA_FLAGS": f"{base} {xla}".strip(), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        if args.graph_log:
            env.update(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="command_buffer_conversion_pass=2")
        cmd = [sys.executable, __file__, "--child", "--barrier", barrier, "--siblings", str(siblings),
               *sys.argv[1:]]
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        started[name] = (flags, subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True), out, err,
                         time.perf_counter())
        if args.one_at_a_time:
            finish({name: started[name]})
            shutil.rmtree(barrier)
            os.mkdir(barrier)
    finish({name: v for name, v in started.items() if name not in wall})
    for name, (flags, proc, out, err, _) in started.items():
        stdout, stderr = (_read(f) for f in (out, err))
        log = "\n".join(line for line in stderr.splitlines() if not GRAPH_LOG.search(line))
        sys.stderr.write(log[-4000:])
        plans = [f"{v} {u}" for v, u in REMAT.findall(stderr)]
        graph_log = collections.Counter(NUMBERS.sub("#", m) for m in GRAPH_LOG.findall(stderr))
        result["variants"][name] = {
            "xla_flags": flags, "wall_s": wall[name], "returncode": proc.returncode,
            "remat_warnings": len(plans), "remat_plans": plans[:8],
            **({"graph_log": dict(graph_log.most_common(30))} if args.graph_log else {}),
            "programs": json.loads(stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None,
            "log_tail": None if proc.returncode == 0 else log[-2000:]}
        print(name, json.dumps(result["variants"][name]), flush=True)
    shutil.rmtree(barrier, ignore_errors=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
