"""Where one engine frame step spends its time, per part, at the real shapes (GPU, random weights, bf16).

The engine's step for B rows is: per row, code0 sampling (`generate.frame_code0`, vmapped) and the code
predictor's 15 sequential codes, then one talker decode of the B rows against the shared KV cache. This
times each part alone at several row counts (and the codec's one-frame call), with the sampler the engine
uses and the jnp reference, plus how long each program took to compile: the evidence for what a step's
cost grows with. Writes JSON.

    python bench/step_parts.py --model 0.6b --slots 256 --rows 16,256 --out runs/step-parts-0.6b.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from qtts_jax import nn  # noqa: E402
from qtts_jax.engine import Engine, EngineConfig  # noqa: E402
from qtts_jax.engine import programs  # noqa: E402
from qtts_jax.generate import frame_code0  # noqa: E402
from qtts_jax.model import load_model  # noqa: E402


def parts(graph, cfg, codec_cfg, sampler: str) -> dict:
    """name -> function(params, codec_params, state, codec_state, idx) of one part for the rows `idx` (`params`:
    the talker's state, merged with its graph definition `graph` at trace time, as the engine's programs do)."""
    choose = programs.chooser(sampler)

    def codes(params, codec_params, state, codec_state, idx):
        rows, settings, k = programs.take_rows(state.rows, idx), programs.take_rows(state.settings, idx), programs.take_rows(state.k, idx)
        return jax.vmap(partial(frame_code0, cfg, choose=choose))(rows, settings, k)

    def predictor(params, codec_params, state, codec_state, idx):
        rows, settings = programs.take_rows(state.rows, idx), programs.take_rows(state.settings, idx)
        token = jnp.zeros(idx.shape, jnp.int32)
        keys = jax.random.split(jax.random.PRNGKey(0), idx.shape[0])
        talker = nn.merge(graph, params)
        return jax.vmap(lambda h, t, key, p: talker.predict(h, t, key, p, choose))(
            rows.hidden, token, keys, settings.predictor)

    def talker_decode(params, codec_params, state, codec_state, idx):
        rows, k, row0 = programs.take_rows(state.rows, idx), programs.take_rows(state.k, idx), programs.take_rows(state.row0, idx)
        x = jnp.zeros((idx.shape[0], cfg.talker.hidden_size), rows.hidden.dtype)
        settings = programs.take_rows(state.settings, idx)
        logits, hidden, cache = nn.merge(graph, params).decode_rows(x, state.cache, idx, row0 + k,
                                                                    settings.position0 + k, rows.key_valid)
        return state._replace(cache=cache), (logits, hidden)

    def step(params, codec_params, state, codec_state, idx):
        return programs.step(params, state, idx, jnp.ones(idx.shape, jnp.int32), graph=graph, cfg=cfg,
                             choose=choose, attention=programs.attender("auto"), n=1)

    def codec(params, codec_params, state, codec_state, idx):
        b = idx.shape[0]
        codes = jnp.zeros((b, 1, cfg.num_code_groups), jnp.int32)
        return programs.decode_frames(codec_params, codec_state, idx, jnp.zeros(b, bool), codes,
                                      jnp.ones(b, jnp.int32), cfg=codec_cfg)

    return {"codes": codes, "predictor": predictor, "talker": talker_decode, "step": step, "codec": codec}


# parts that return the engine state or the codec state: argument -> output index (donated and fed back, as in
# the engine, so that no part pays for a copy of the state the engine does not make)
DONATES = {"step": (2, 0), "talker": (2, 0), "codec": (3, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="0.6b")
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rows", default="16,256")
    p.add_argument("--samplers", default="pallas,jnp")
    p.add_argument("--parts", default="predictor,talker,step,codec", help="of codes,predictor,talker,step,codec")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model = load_model(args.model, dtype=jnp.bfloat16)
    engine = Engine(model, EngineConfig(slots=args.slots, context=args.context, prompt_buckets=(32,)))
    # lowering only reads shapes
    args_of = (model.params, model.codec_params, engine.runner.state, engine.runner.codec_state)
    jobs = []
    for sampler in args.samplers.split(","):
        for name, fn in parts(model.graph, model.cfg, model.codec_cfg, sampler).items():
            if name not in args.parts.split(",") or (sampler != args.samplers.split(",")[0]
                                                      and name not in ("codes", "predictor", "step")):
                continue  # parts without a sampler are timed once
            for b in (int(r) for r in args.rows.split(",")):
                idx = np.arange(b, dtype=np.int32) % args.slots
                donate = (DONATES[name][0],) if name in DONATES else ()
                jobs.append((f"{name}/{sampler}/{b}", jax.jit(fn, donate_argnums=donate).lower(*args_of, idx), idx))

    def compile_one(job):
        t = time.perf_counter()
        return job[1].compile(), time.perf_counter() - t

    result = {"model": args.model, "slots": args.slots, "context": args.context, "device": str(jax.devices()[0]),
              "parts": {}}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        compiled = list(pool.map(compile_one, jobs))
    state = list(args_of)

    def call(name, exe, idx):
        out = exe(*state, idx)
        if name in DONATES:
            arg, at = DONATES[name]
            state[arg] = out[at]
        return out

    for (key, _, idx), (exe, compile_s) in zip(jobs, compiled):
        name = key.split("/")[0]
        jax.block_until_ready(call(name, exe, idx))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(call(name, exe, idx))
            times.append(time.perf_counter() - t0)
        result["parts"][key] = {"ms": round(statistics.median(times) * 1e3, 3), "compile_s": round(compile_s, 1)}
        print(key, result["parts"][key], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
