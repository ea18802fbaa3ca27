"""`qtts-jax finetune`: a Base checkpoint and a JSONL of one speaker's clips in, a CustomVoice checkpoint out."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULTS = dict(lr=2e-5, batch=2, accumulate=4, epochs=3)  # the official script's defaults


def add_finetune_parser(sub) -> argparse.ArgumentParser:
    f = sub.add_parser(
        "finetune", help="fine-tune a Base model on one speaker's recordings into a CustomVoice model",
        description="Trains the talker and code predictor on JSONL lines {\"audio\": WAV, \"text\": transcript, "
                    "\"ref_audio\": WAV} (paths relative to the JSONL), then writes OUT/model, a Hugging Face-layout "
                    "CustomVoice checkpoint with the new speaker, which `serve --model OUT/model` and "
                    "`synth --speaker NAME` use at once. Also in OUT: checkpoints/, loss.json, loss.png. "
                    "Defaults are the official script's; its README's recipe is --lr 2e-6 --batch 32 --epochs 10.")
    f.add_argument("--model", required=True, help="Base checkpoint directory, or tiny-random-base (random weights)")
    f.add_argument("--data", required=True, type=Path, help="training JSONL (codes are cached beside it)")
    f.add_argument("--speaker", required=True, help="the new speaker's name (stored lower-case)")
    f.add_argument("--out", required=True, type=Path, help="run directory: checkpoints, loss curve, model/")
    f.add_argument("--epochs", type=int, default=DEFAULTS["epochs"], help="passes over the data (default 3)")
    f.add_argument("--steps", type=int, help="train this many steps (batches) instead of --epochs")
    f.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="AdamW learning rate (default 2e-5)")
    f.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="examples per step (default 2)")
    f.add_argument("--accumulate", type=int, default=DEFAULTS["accumulate"],
                   help="steps whose mean gradient makes one update (default 4)")
    f.add_argument("--micro-batch", type=int, metavar="N",
                   help="examples per forward/backward pass, a divisor of --batch: a step adds its micro-batches' "
                        "gradients, the same as the whole batch's, in less memory (default: the whole batch)")
    f.add_argument("--predictor-chunk", type=int, metavar="N",
                   help="frames per code-predictor pass, recomputed in the backward pass instead of kept: less "
                        "memory for more compute, the same gradients (default: every frame in one pass)")
    f.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="forward/backward arithmetic; weights and optimiser state stay fp32 (default float32; "
                        "bfloat16 on a GPU, as the official recipe)")
    f.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="train low-rank adapters of this rank on the attention and MLP projections instead of every "
                        "weight, merged into the export (default 0: every weight trains)")
    f.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (default 100)")
    f.add_argument("--keep", type=int, default=3, help="checkpoints kept, the latest ones (default 3)")
    f.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT/checkpoints")
    f.add_argument("--seed", type=int, default=0, help="order of the examples (default 0)")
    return f


class UsageError(ValueError):
    """A flag that cannot be honoured; the message names it."""


def _check(args) -> None:
    for name in ("epochs", "batch", "accumulate", "checkpoint_every", "keep"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    from qtts_jax.finetune.train import micro_batches

    try:
        micro_batches(args.batch, args.micro_batch)
    except ValueError:
        raise UsageError(f"--micro-batch must divide --batch ({args.batch})") from None
    if args.lora < 0:
        raise UsageError("--lora must be >= 0")
    if args.predictor_chunk is not None and args.predictor_chunk < 1:
        raise UsageError("--predictor-chunk must be >= 1")
    if args.steps is not None and args.steps < 1:
        raise UsageError("--steps must be >= 1")
    if not args.lr > 0:
        raise UsageError("--lr must be > 0")
    if not args.speaker.strip() or not args.speaker.replace("_", "").replace("-", "").isalnum():
        raise UsageError("--speaker must be a name of letters, digits, '_' or '-'")
    held = args.out / "checkpoints"
    if not args.resume and held.is_dir() and any(p.name.isdigit() for p in held.iterdir()):
        raise UsageError(f"--out: {held} already holds checkpoints; pass --resume to continue that run, "
                         "or choose another --out")


def finetune(args) -> int:
    from qtts_jax import xla_flags
    from qtts_jax.io.errors import CheckpointError
    from qtts_jax.finetune import data, train
    from qtts_jax.finetune.export import export
    from qtts_jax.model import load_model

    xla_flags.claim_device_memory()
    try:
        _check(args)
        model = load_model(args.model)
        if model.voice_encoders is None:
            raise UsageError(f"--model: fine-tuning starts from a Base model; this is a {model.cfg.model_type} model")
        examples = data.prepare(args.data, model.voice_encoders)
    except (UsageError, data.DataError, CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = train.Settings(lr=args.lr, batch=args.batch, accumulate=args.accumulate, epochs=args.epochs,
                              steps=args.steps, seed=args.seed, checkpoint_every=args.checkpoint_every,
                              keep=args.keep, compute_dtype=args.compute_dtype, lora=args.lora,
                              micro_batch=args.micro_batch, predictor_chunk=args.predictor_chunk)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{len(examples)} examples, {settings.total_steps(len(examples))} steps", file=sys.stderr)
    try:
        with _Progress() as progress:
            # the model's talker weights become the training state: one copy on the device (the codec stays)
            run = train.train(model.talker, model.cfg, model.tokenizer, examples, settings, args.out / "checkpoints",
                              args.resume, progress, release=True,
                              on_resume=lambda step: print(f"resumed from step {step}", file=sys.stderr))
    except train.ResumeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    curve = train.write_curve(run.curve, args.out)
    # every example was trained with its own reference's x-vector; the speaker row holds their mean
    xvector = sum(e.xvector for e in examples) / len(examples)
    out = export(run.talker, args.model, args.speaker, xvector, args.out / "model", (model.codec, model.codec_cfg))
    last = run.curve[-1]
    print(f"step {last['step']}: loss {last['loss']:.4f}; wrote {out} (speaker {args.speaker.lower()}) and "
          f"{', '.join(p.name for p in curve)}")
    return 0


class _Progress:
    """A tqdm bar with the loss on a terminal (tqdm is in the train extra), else a line every 10 steps."""

    def __enter__(self):
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self.tqdm, self.bar = tqdm, None
        return self

    def __call__(self, step: int, total: int, losses: dict) -> None:
        if self.tqdm is not None:
            if self.bar is None:
                self.bar = self.tqdm(total=total, initial=step - 1, unit="step", file=sys.stderr)
            self.bar.set_postfix(loss=f"{losses['loss']:.4f}")
            self.bar.update(1)
        elif step % 10 == 0 or step == total:
            print(f"step {step}/{total}: loss {losses['loss']:.4f}", file=sys.stderr)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
