"""`qtts-jax` command line: `synth` (text -> WAV) and `info` (what a checkpoint is) from the library, `serve`
from `serving.cli` and `study` from `studies.cli`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import numpy as np

from qtts_jax.checkpoint import CheckpointError
from qtts_jax.request import Request, RequestError
from serving.cli import add_serve_parser, serve


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qtts-jax", description="Qwen3-TTS (12 Hz) in JAX")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("synth", help="synthesize text into a 24 kHz WAV")
    s.add_argument("--model", required=True, help="checkpoint directory (Hugging Face layout) or tiny-random")
    s.add_argument("--text", required=True)
    s.add_argument("--speaker", help="CustomVoice speaker (default: the first one listed by `info`)")
    s.add_argument("--language", default="auto")
    s.add_argument("--instruct", help="style instruction (VoiceDesign; CustomVoice 1.7B)")
    s.add_argument("--ref-audio", help="Base models: reference recording of the voice to clone (WAV/FLAC/MP3/OGG)")
    s.add_argument("--ref-text", help="transcript of --ref-audio: clones in ICL mode (without it: x-vector only)")
    s.add_argument("--xvector-only", action="store_true", help="clone from the speaker embedding alone")
    s.add_argument("--ref-silence", type=float, default=0.0, metavar="SECONDS",
                   help="silence appended to the reference before encoding, against its last phonemes bleeding "
                        "into the output (0 = as the reference implementation)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--greedy", action="store_true", help="argmax decoding for talker and code predictor")
    s.add_argument("--max-frames", type=int, help="cap on complete 80 ms frames")
    s.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    s.add_argument("--out", required=True, help="output .wav")
    s.add_argument("--codes-out", help="also save the codes [frames, 16] as .npy")
    i = sub.add_parser("info", help="print what a checkpoint is (kind, size, speakers, languages)")
    i.add_argument("--model", required=True)
    add_serve_parser(sub)
    sub.add_parser("study", help="capacity studies of a server: `qtts-jax study {capacity,sustained,fleet} --help`",
                   add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["study"]:  # the studies toolkit owns its own arguments
        from studies.cli import main as study_main

        return study_main(argv[1:], prog="qtts-jax study")
    args = _parser().parse_args(argv)
    if args.command == "serve":
        # JAX probes for a TPU on every start and logs the missing libtpu.so, which reads as an error on CPU/GPU
        logging.getLogger("jax._src.xla_bridge").addFilter(lambda r: "libtpu.so" not in r.getMessage())
        return serve(args)
    import jax.numpy as jnp

    from qtts_jax.audio import write_wav
    from qtts_jax.model import load_model

    try:
        model = load_model(args.model, dtype=jnp.dtype(getattr(args, "dtype", "float32")))
        if args.command == "info":
            info = model.info()
            if model.name.startswith("tiny-random"):  # a test preset: its config borrows 1.7B's rules (instruct)
                info["size"] = f"tiny (random; follows {info['size']} rules)"
            print(json.dumps(info, indent=2))
            return 0
        voice = None
        if model.cfg.model_type == "base":
            if not args.ref_audio:
                raise RequestError("ref_audio", "a Base model clones a voice: pass --ref-audio FILE [--ref-text T]")
            voice = model.clone_voice(args.ref_audio, args.ref_text, args.xvector_only, args.ref_silence)
            print(f"voice: {'ICL' if voice.ref_codes is not None else 'x-vector only'} clone of {args.ref_audio}",
                  file=sys.stderr)
        elif args.ref_audio:
            raise RequestError("ref_audio", f"only Base models clone voices; this is a {model.cfg.model_type} model")
        speaker = args.speaker
        if speaker is None and model.cfg.model_type == "custom_voice":
            speaker = sorted(model.cfg.speakers)[0]
            print(f"speaker: {speaker} (pass --speaker to choose)", file=sys.stderr)
        req = Request(
            text=args.text, speaker=speaker, language=args.language, instruct=args.instruct, voice=voice, seed=args.seed,
            greedy=True if args.greedy else None, subtalker_greedy=True if args.greedy else None,
            max_frames=args.max_frames,
        )
        t0 = time.perf_counter()
        (result,) = model.generate(req)
        elapsed = time.perf_counter() - t0
    except (CheckpointError, RequestError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_wav(args.out, result.audio, result.sample_rate)
    if args.codes_out:
        np.save(args.codes_out, result.codes)
    seconds = len(result.audio) / result.sample_rate
    print(f"wrote {args.out}: {result.frames} frames, {seconds:.2f} s of audio in {elapsed:.2f} s")
    if model.is_noise:
        print(f"note: {model.name} has random weights, so this audio is noise", file=sys.stderr)
    return 0
