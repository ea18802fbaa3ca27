"""GPU benchmark of the streaming engine at the real 0.6B / 1.7B shapes (random weights, bf16).

For each engine size: the iteration cost per live-batch rung as the warm-up measures it (step + codec),
first PCM of a burst of arrivals and of a newcomer on an idle engine and beside N live streams (queue /
prefill / first frame / first chunk), steady-state audio seconds per wall second with every slot live,
memory at rest and per slot, and the compiled step's instructions of the whole KV cache's shape (copies).
EOS is made unreachable (its id moved outside the vocabulary) so every stream runs its forced frame
count. Writes JSON.

With a Base model (``0.6b-base``) it also measures voice cloning: the time to register a voice (speaker
encoder and speech-tokenizer encoder per reference length, and priming the codec state of an ICL voice),
and the first-PCM latency of an ICL request (longer prompt) against an x-vector one, idle and beside
live streams.

    python bench/engine.py --model 0.6b --slots 1,8,32,64 --out runs/engine-0.6b.json
    python bench/engine.py --model 0.6b-base --slots 64 --out runs/engine-0.6b-base.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from qtts_jax.engine import Engine, EngineConfig  # noqa: E402
from qtts_jax.codec import encoder as codec_encoder  # noqa: E402
from qtts_jax.codec.config import SAMPLE_RATE  # noqa: E402
from qtts_jax.model import load_model  # noqa: E402
from qtts_jax.request import Request, VoicePrompt  # noqa: E402
from qtts_jax.speaker.ecapa import speaker_embedding  # noqa: E402

MODELS = ("0.6b", "1.7b", "tiny-random", "0.6b-base", "1.7b-base", "tiny-random-base")


def device_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_in_use")


def without_eos(model):
    """Move EOS outside the vocabulary: nothing can stop a stream before its frame cap."""
    cfg = model.cfg
    model.cfg = dataclasses.replace(cfg, codec=dataclasses.replace(cfg.codec, eos=cfg.talker.vocab_size + 7))
    return model


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t0)
    return out


def long_request(i: int, frames: int, voice: VoicePrompt | None = None) -> Request:
    """A stream of a forced length: a preset speaker, or ``voice`` on Base models."""
    return Request(f"Benchmark stream number {i}.", speaker=None if voice else "ryan", voice=voice, seed=i,
                   max_frames=frames)


def default_voice(model) -> VoicePrompt | None:
    if model.cfg.model_type != "base":
        return None
    return VoicePrompt(np.random.default_rng(0).standard_normal(model.cfg.talker.hidden_size).astype(np.float32))


def full_cache_ops(engine: Engine, rows: int, frames: int) -> dict:
    """Instructions of the compiled step (for `rows` live rows) whose result has the whole KV cache's shape,
    by opcode. In-place updates (scatter, dynamic-update-slice, the loop's own tuple plumbing) are expected;
    a copy, transpose or loop fusion of that shape is a per-call copy of the whole cache."""
    import re

    k = engine.runner.state.cache.k
    shape = f"{jnp.dtype(k.dtype).name.replace('bfloat16', 'bf16').replace('float32', 'f32')}[{','.join(map(str, k.shape))}]"
    text = engine.runner.program("step", rows, frames).as_text()
    ops: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (\S+?)(?:\{[^}]*\})? ([\w\-]+)\(", line)
        if m and m.group(1) == shape:
            kind = re.search(r"kind=(\w+)", line)
            op = m.group(2) + (f":{kind.group(1)}" if kind else "")
            ops[op] = ops.get(op, 0) + 1
    copies = sum(v for o, v in ops.items() if o in ("copy", "transpose") or o.startswith("fusion:kLoop"))
    return {"cache_shape": shape, "ops": ops, "copies": copies}


def bench_slots(model, slots: int, args) -> dict:
    """One engine of `slots` slots: compile time, the warm-up's measured iteration cost per live-batch rung,
    first PCM idle and beside live streams, steady-state throughput with every slot live, memory, and the
    compiled step's full-cache copies."""
    config = EngineConfig(
        slots=slots, context=args.context, prompt_buckets=(64,), max_trailing=32,
        frames_per_step=args.frames_per_step, frames_cap_base=args.context, sampler=args.sampler,
    )
    before = device_bytes()
    engine = Engine(model, config)
    jax.block_until_ready(engine.runner.state)
    at_rest = device_bytes()
    t0 = time.perf_counter()
    engine.warmup()
    compile_s = time.perf_counter() - t0
    frames = args.context - 64 - 8
    voice = default_voice(model)
    ttfa_idle = [first_pcm(engine, long_request(k, 8, voice), to_the_end=True) for k in range(3)][-1]

    # a burst: slots-1 requests at once, then a newcomer beside them once they play
    sink = lambda chunk: None  # noqa: E731
    burst = [engine.submit(engine.prepare(long_request(i + 1, frames, voice)), sink) for i in range(slots - 1)]
    t0 = time.perf_counter()
    while any(s.timings.first_chunk is None for s in burst):
        engine.run_once()
    burst_first = sorted((s.timings.first_chunk - s.timings.submitted) * 1e3 for s in burst) or [0.0]
    for _ in range(8):
        engine.run_once()
    ttfa_loaded = first_pcm(engine, long_request(slots, frames, voice)) if slots > 1 else ttfa_idle

    # steady state with every slot live: audio handed out per wall second
    audio = [0]

    def count(chunk):
        audio[0] += len(chunk.pcm)

    for s in engine.slots:
        if s is not None:
            s.on_chunk = count
    for _ in range(4):
        engine.run_once()
    audio[0] = 0
    t0 = time.perf_counter()
    iterations = 0
    while time.perf_counter() - t0 < args.steady_s and engine.active == slots:
        engine.run_once()
        iterations += 1
    wall = time.perf_counter() - t0
    costs = {f"{b}x{n}": round(v * 1e3, 2) for (b, n), v in sorted(engine.step_costs.items())}
    row = {
        "slots": slots,
        "compile_s": round(compile_s, 1),
        "iteration_ms_by_rows_x_frames": costs,
        "prefill_ms_by_requests": {r: round(v * 1e3, 2) for r, v in sorted(engine.prefill_costs.items())},
        "steady_audio_s_per_wall_s": round(audio[0] / SAMPLE_RATE / wall, 1),
        "steady_ms_per_iteration": round(wall / max(iterations, 1) * 1e3, 2),
        "burst_first_pcm_ms_p50_p95_max": [round(float(np.percentile(burst_first, q)), 1) for q in (50, 95, 100)],
        "ttfa_idle_ms": ttfa_idle,
        "ttfa_beside_live_ms": ttfa_loaded,
        "full_cache_ops_in_step": {n: full_cache_ops(engine, slots, n) for n in config.step_sizes},
        "memory_state_bytes": None if before is None else at_rest - before,
        "memory_bytes_per_slot": None if before is None else (at_rest - before) / slots,
    }
    for s in engine.slots:
        if s is not None:
            s.cancel()
    engine.run_once()
    del engine
    return row


def bench_clone(model, args) -> dict:
    """Registration cost per reference length, and ICL vs x-vector first PCM (idle and beside live streams)."""
    enc = model.voice_encoders
    rng = np.random.default_rng(0)
    registration = []
    for seconds in (3.0, 10.0, 20.0):
        wav = (0.3 * rng.standard_normal(int(seconds * SAMPLE_RATE))).astype(np.float32)
        spk = timed(lambda: speaker_embedding(enc.speaker_params, enc.speaker_cfg, wav), args.repeats + 1)
        enc_t = timed(lambda: codec_encoder.encode(enc.codec_encoder_params, enc.codec_cfg, wav), args.repeats + 1)
        registration.append({
            "reference_s": seconds,
            "speaker_encoder_first_ms": round(spk[0] * 1e3, 1),  # includes compiling for this length
            "speaker_encoder_ms": round(statistics.median(spk[1:]) * 1e3, 2),
            "codec_encoder_first_ms": round(enc_t[0] * 1e3, 1),
            "codec_encoder_ms": round(statistics.median(enc_t[1:]) * 1e3, 2),
        })
        print(json.dumps(registration[-1]), flush=True)
    if args.registration_only:
        return {"registration": registration}
    t0 = time.perf_counter()
    enc.warmup(30.0, 0.5)  # the server does this in the background after /ready: every remaining bucket
    warmup_s = time.perf_counter() - t0
    slots = args.clone_slots
    config = EngineConfig(slots=slots, context=args.context, prompt_buckets=(64, 256), max_trailing=32,
                          frames_per_step=args.frames_per_step, frames_cap_base=args.context, sampler=args.sampler)
    engine = Engine(model, config)
    engine.warmup()
    wav = (0.3 * rng.standard_normal(10 * SAMPLE_RATE)).astype(np.float32)
    icl = model.clone_voice((wav, SAMPLE_RATE), "The ten seconds of reference speech say this sentence, and more.")
    xvec = VoicePrompt(icl.xvector)
    prime = timed(lambda: engine.runner.prime(icl.ref_codes), args.repeats)
    engine.prepare_voice(icl.ref_codes)
    out = {"registration": registration, "encoder_warmup_30s_remaining_buckets_s": round(warmup_s, 1),
           "clone_slots": slots, "icl_reference_frames": len(icl.ref_codes),
           "prime_codec_ms": round(statistics.median(prime) * 1e3, 2),
           "icl_prompt_rows": len(engine.prepare(long_request(0, 8, icl)).prompt),
           "xvector_prompt_rows": len(engine.prepare(long_request(0, 8, xvec)).prompt)}
    for name, voice in (("xvector", xvec), ("icl", icl)):
        out[f"ttfa_idle_{name}_ms"] = statistics.median(
            first_pcm(engine, long_request(k, 8, voice), to_the_end=True)["first_chunk_ms"] for k in range(5))
    sink = lambda chunk: None  # noqa: E731
    frames = args.context - 256 - 8
    for i in range(slots - 2):
        engine.submit(engine.prepare(long_request(100 + i, frames, xvec)), sink)
    for _ in range(12):  # past every stream's first chunks: steady state
        engine.run_once()
    beside = {"xvector": [], "icl": []}
    for k in range(3):  # alternate, so neither kind always comes first
        for name, voice in (("xvector", xvec), ("icl", icl)):
            beside[name].append(first_pcm(engine, long_request(k, 8, voice), to_the_end=True))
    for name, timings in beside.items():
        out[f"ttfa_beside_{slots - 2}_live_{name}_ms"] = statistics.median(t["first_chunk_ms"] for t in timings)
        out[f"timings_beside_{slots - 2}_live_{name}"] = timings
    for s in engine.slots:
        if s is not None:
            s.cancel()
    engine.run_once()
    return out


def first_pcm(engine: Engine, request: Request, to_the_end: bool = False) -> dict:
    """Timings up to the request's first PCM; ``to_the_end`` also lets it finish, freeing its slot for the
    next measurement (else a run of measurements fills the engine and the later ones queue)."""
    got = []
    stream = engine.submit(engine.prepare(request), got.append)
    while not any(len(c.pcm) for c in got):
        engine.run_once()
    timings = stream.timings.as_dict()
    while to_the_end and not stream.finished:
        engine.run_once()
    return timings


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=MODELS, default="0.6b",
                   help="tiny-random only smoke-tests this script on a CPU; -base models add the cloning section")
    p.add_argument("--clone-slots", type=int, default=64, help="engine size for the ICL first-PCM comparison")
    p.add_argument("--registration-only", action="store_true",
                   help="cloning section: only the encoder times (e.g. on a CPU, where a real-size engine is too slow)")
    p.add_argument("--slots", default="1,8,32,64,128,256,512")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--frames-per-step", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--steady-s", type=float, default=5.0, help="seconds of steady state timed per engine")
    p.add_argument("--sampler", choices=["jnp", "pallas", "auto"], default="auto")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    t0 = time.perf_counter()
    dtype = jnp.float32 if args.model.startswith("tiny-random") else jnp.bfloat16
    model = without_eos(load_model(args.model, dtype=dtype))
    result = {
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "model": args.model,
        "dtype": jnp.dtype(dtype).name,
        "context": args.context,
        "frames_per_step": args.frames_per_step,
        "sampler": args.sampler,
        "load_s": round(time.perf_counter() - t0, 1),
        "rows": [],
    }
    if model.cfg.model_type == "base":
        result["clone"] = bench_clone(model, args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    for slots in [int(s) for s in args.slots.split(",") if s]:
        try:
            result["rows"].append(bench_slots(model, slots, args))
        except Exception as exc:  # out of memory ends the sweep, with the reason recorded
            result["rows"].append({"slots": slots, "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
            break
        finally:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps(result["rows"][-1]), flush=True)


if __name__ == "__main__":
    main()
