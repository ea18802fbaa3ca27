"""Fine-tuning throughput: our training step beside the official recipe's (sft_12hz.py) in torch, same shapes.

For each Base shape (random weights): steps/s and peak device memory of one training step (forward, backward,
clipping, AdamW with accumulation) at a batch of B clips of F frames with T text tokens. Ours: `qtts_jax.finetune`
(fp32 weights and optimiser state, bf16 compute). The official step: its forward (the speaker encoder on each
batch's reference mels, the talker with labels, the code predictor's finetune forward), backward, clipping and
torch AdamW, on bf16 weights under bf16 autocast, with flash-attention 2 when installed (else SDPA; the JSON says
which). Each side runs in its own subprocess, so neither's allocator or peak counts against the other. Writes JSON.

    python bench/finetune.py --out runs/finetune-h200.json                   # 0.6b-base and 1.7b-base, batch 32
    python bench/finetune.py --tiny --out runs/finetune-cpu.json             # tiny-random-base on a CPU
    python bench/finetune.py --sides ours --compile-only --micro-batch 8     # XLA's memory plan, on any machine
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TINY = dict(models="tiny-random-base", batch=2, frames=16, text=12, steps=3, warmup=1)


def _examples(model, batch: int, frames: int, text: int, seed: int = 0):
    import numpy as np

    from qtts_jax.finetune.data import Example

    rng = np.random.default_rng(seed)
    words = "the quick brown fox jumps over a lazy dog while we wait"
    return [Example((words * 8)[:text], rng.integers(0, 2048, (frames, 16)).astype(np.int32),
                    rng.standard_normal(model.cfg.talker.hidden_size).astype(np.float32)) for _ in range(batch)]


def ours(args) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from qtts_jax import xla_flags
    from qtts_jax.finetune import layout, train
    from qtts_jax.model import load_model

    xla_flags.claim_device_memory()  # as `qtts-jax finetune` does; torch's allocator has no cap to lift

    model = load_model(args.model, dtype=jnp.float32)
    batch = layout.collate(model.cfg, model.tokenizer, _examples(model, args.batch, args.frames, args.text)).arrays()
    graph, params = nnx.split(model.talker, nnx.Param)
    micro = train.micro_batches(args.batch, args.micro_batch)
    # as `qtts-jax finetune` does: the model's weights become the state (donated), one copy on the device
    init, step, _ = train.programs(graph, model.cfg, 1e-5, args.accumulate, args.compute_dtype, 0, micro,
                                   donate_params=True, predictor_chunk=args.predictor_chunk)
    params = nnx.to_pure_dict(params)
    t0 = time.perf_counter()
    # compiled ahead of time: XLA's plan of the step's device memory comes with it, also where it would not fit;
    # two programs, the one that updates the weights (planned here) and, accumulating, the one that only adds
    state, frozen = jax.eval_shape(init, params)
    programs = dataclasses.replace(step, update=step.update.lower(state, frozen, batch).compile(), add=step.add and (
        step.add.lower(state["params"], state["opt"]["acc"], frozen, batch).compile()))
    compiled = programs.update
    compile_s = time.perf_counter() - t0
    plan = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    row = {"compile_s": compile_s, "micro_batch": args.micro_batch or args.batch,
           "predictor_chunk": args.predictor_chunk,
           "plan_temp_bytes": plan.temp_size_in_bytes if plan else None,
           "plan_argument_bytes": plan.argument_size_in_bytes if plan else None,
           "plan_flops": cost.get("flops"), "plan_bytes_accessed": cost.get("bytes accessed"),
           "sequence_positions": int(batch[0].shape[1]), "compute_dtype": args.compute_dtype,
           "device": str(jax.devices()[0])}
    if args.compile_only:
        return row

    def run(state, i):  # the i-th step of a run: it updates the weights every --accumulate, as the official loop
        return programs(state, frozen, batch, train.emits(i, args.accumulate))

    state, frozen = init(params)
    batch = jax.device_put(batch)
    for i in range(1 + args.warmup):
        state, parts = run(state, i)
    jax.block_until_ready(parts)
    t0 = time.perf_counter()
    for i in range(args.steps):
        state, parts = run(state, i)
    jax.block_until_ready(parts)
    elapsed = time.perf_counter() - t0
    stats = jax.devices()[0].memory_stats() or {}
    row = {**row, "steps_per_s": args.steps / elapsed, "loss": float(parts["loss"]),
           "peak_bytes": stats.get("peak_bytes_in_use")}
    if args.profile:
        row["profile"] = profile(run, state, args.profile)
    return row


def profile(run, state, calls: int, top: int = 40) -> dict:
    """Where `calls` more steps (`run(state, i)`, the i-th of a run) spend their device time: the kernels and the
    HLO ops they come from, as `bench/kernels.py` reduces an engine program's trace (busy ms and kernels per step,
    the `top` by time)."""
    import jax

    from bench.kernels import device_events, summarise, traced

    def steps():
        s = state
        for i in range(calls):
            s, parts = run(s, i)
        jax.block_until_ready(parts)

    events, _ = device_events(traced(steps))
    return {kind: summarise(e, calls, top) for kind, e in events.items() if kind != "other"}


def official(args) -> dict:
    import torch

    from qtts_jax import presets
    from qtts_jax.finetune.forward import SUB_TALKER_WEIGHT

    try:
        import torchaudio  # noqa: F401  (qwen_tts imports it; where it is missing, the tests' stand-in serves)
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "refstub"))
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        import flash_attn  # noqa: F401

        attn = "flash_attention_2"
    except ImportError:
        attn = "sdpa" if device == "cuda" else "eager"
    config_dict, _ = presets.preset_configs(args.model)
    config_dict["talker_config"]["code_predictor_config"]["num_code_groups"] = 16  # the released files say 16
    cfg = Qwen3TTSConfig(**config_dict)
    for c in (cfg, cfg.talker_config, cfg.talker_config.code_predictor_config):
        c._attn_implementation = attn
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3TTSForConditionalGeneration(cfg).to(torch.bfloat16).train()
    tc = cfg.talker_config
    b, n, m = args.batch, args.frames, args.text + 3  # the role tokens lead the text ids
    t = m + n + 8
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, tc.text_vocab_size, (b, t), generator=g)
    codec = torch.randint(0, 2048, (b, t), generator=g)
    codec_ids = torch.randint(0, 2048, (b, t, 16), generator=g)
    codec_mask = torch.zeros((b, t), dtype=torch.bool)
    codec_mask[:, 8 + m - 1:8 + m - 1 + n] = True
    labels = torch.full((b, t), -100)
    labels[:, 8 + m - 1:8 + m + n] = codec[:, 8 + m - 1:8 + m + n]
    ref_mels = torch.randn(b, 281, 128)  # 3 s of reference audio
    batch = [x.to(device) for x in (text, codec, codec_ids, codec_mask, labels, ref_mels)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)

    def step(i):
        text, codec, codec_ids, codec_mask, labels, ref_mels = batch
        with torch.autocast(device, dtype=torch.bfloat16):
            spk = model.speaker_encoder(ref_mels.to(torch.bfloat16)).detach()
            x = model.talker.text_projection(model.talker.get_text_embeddings()(text))
            ce = model.talker.model.codec_embedding(codec)
            ce[:, 6, :] = spk
            x = x + ce
            tables = model.talker.code_predictor.get_input_embeddings()
            for k in range(1, 16):
                x = x + tables[k - 1](codec_ids[:, :, k]) * codec_mask[..., None]
            out = model.talker(inputs_embeds=x, attention_mask=torch.ones_like(text), labels=labels,
                               output_hidden_states=True)
            hidden = out.hidden_states[0][-1][:, :-1][codec_mask[:, 1:]]
            _, sub_loss = model.talker.forward_sub_talker_finetune(codec_ids[codec_mask], hidden)
            loss = (out.loss + SUB_TALKER_WEIGHT * sub_loss) / args.accumulate
        loss.backward()
        if (i + 1) % args.accumulate == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        return loss

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    for i in range(1 + args.warmup):
        step(i)
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step(i)
    sync()
    elapsed = time.perf_counter() - t0
    row = {"steps_per_s": args.steps / elapsed, "loss": float(loss) * args.accumulate, "attention": attn,
           "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
           "sequence_positions": t, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    if args.profile:
        row["profile"] = torch_profile(step, sync, args.profile, device)
    return row


def torch_profile(step, sync, calls: int, device: str, top: int = 40) -> dict:
    """The official step's side of `profile`: where `calls` more steps (`step(i)`, the i-th) spend their time, by
    torch's profiler: per op (its kernels' device time on a GPU, its own CPU time elsewhere), ms per step, the `top`."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(calls):
            step(i)
        sync()
    events = prof.key_averages()
    names = ("device_time_total", "cuda_time_total") if device == "cuda" else ()  # torch's name, newer or older
    key = next((k for k in names if hasattr(events[0], k)), "self_cpu_time_total")
    ops = sorted(events, key=lambda e: -getattr(e, key))[:top]
    return {"time": key, "top": [{"op": e.key[:160], "ms_per_step": round(getattr(e, key) / 1e3 / calls, 3),
                                  "calls_per_step": round(e.count / calls, 1)} for e in ops]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="0.6b-base,1.7b-base")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--frames", type=int, default=150, help="frames per clip (150 = 12 s)")
    p.add_argument("--text", type=int, default=60, help="text tokens per clip")
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--compute-dtype", default="bfloat16")
    p.add_argument("--micro-batch", type=int, help="ours: examples per forward/backward pass (default: the batch)")
    p.add_argument("--predictor-chunk", type=int,
                   help="ours: frames per code-predictor pass, recomputed in the backward pass (default: all at once)")
    p.add_argument("--compile-only", action="store_true",
                   help="ours: compile the step and report XLA's memory plan, without running it (any machine)")
    p.add_argument("--steps", type=int, default=8, help="timed steps, after one compiling and --warmup more")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile", type=int, default=0,
                   help="profile this many more steps: ours, their kernels and HLO ops by device time; the "
                        "official step, its ops by torch's profiler")
    p.add_argument("--tiny", action="store_true", help="tiny-random-base at CPU sizes: " + json.dumps(TINY))
    p.add_argument("--sides", default="ours,official")
    p.add_argument("--side", help=argparse.SUPPRESS)  # a subprocess's one side
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
        if args.compute_dtype == "bfloat16":
            args.compute_dtype = "float32"
    if args.side:
        print(json.dumps({"ours": ours, "official": official}[args.side](args)))
        return
    results = {"batch": args.batch, "frames": args.frames, "text_tokens": args.text, "accumulate": args.accumulate,
               "micro_batch": args.micro_batch or args.batch, "command": " ".join(sys.argv[1:]), "models": {}}
    for name in args.models.split(","):
        row = {}
        for side in args.sides.split(","):
            cmd = [sys.executable, __file__, "--side", side, "--model", name] + [
                f"--{k}={getattr(args, k.replace('-', '_'))}"
                for k in ("batch", "frames", "text", "accumulate", "compute-dtype", "steps", "warmup", "profile")] + (
                [f"--micro-batch={args.micro_batch}"] if args.micro_batch else []) + (
                [f"--predictor-chunk={args.predictor_chunk}"] if args.predictor_chunk else []) + (
                ["--compile-only"] if args.compile_only else [])
            env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            row[side] = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {
                "error": done.stderr[-2000:]}
            print(name, side, row[side], file=sys.stderr)
        if all("steps_per_s" in row.get(s, {}) for s in ("ours", "official")):
            row["speedup"] = row["ours"]["steps_per_s"] / row["official"]["steps_per_s"]
        results["models"][name] = row
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
