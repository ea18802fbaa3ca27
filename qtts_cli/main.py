"""`qtts-jax` command line: `synth` (text -> WAV) and `info` (what a checkpoint is) from the library, `finetune`
from `qtts_cli.finetune`, `serve` from `serving.cli`, `cluster` from `fleet.cli` and `study` from `studies.cli`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from fleet.cli import add_cluster_parser, cluster
from qtts_jax.io.errors import CheckpointError
from qtts_cli.finetune import add_finetune_parser, finetune
from qtts_jax.request import Request, RequestError
from serving.cli import add_serve_parser, serve
from serving.voice.aliases import DEFAULT as VOICE_ALIASES

DEFAULT_VOICE = VOICE_ALIASES["alloy"]  # the server's default voice on CustomVoice models, so synth sounds the same
RANDOM_MAX_FRAMES = 24  # random weights rarely reach EOS: without a cap a short text runs ~16 s of noise
# --out's extension -> the format synth writes, by the server's encoders (.ogg holds Opus, as the server sends it)
OUT_FORMATS = {".wav": "wav", ".mp3": "mp3", ".flac": "flac", ".opus": "opus", ".ogg": "opus", ".aac": "aac",
               ".pcm": "pcm"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qtts-jax", description="Qwen3-TTS (12 Hz) in JAX")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("synth", help="synthesize text into a 24 kHz WAV",
                       description="Every flag's default is in its help; the model defaults to tiny-random.")
    s.add_argument("--model", default="tiny-random",
                   help="checkpoint directory (Hugging Face layout), tiny-random or tiny-random-base "
                        "(default tiny-random: random weights, so the audio is noise)")
    s.add_argument("--text", required=True, help="what to say")
    s.add_argument("--speaker", help="CustomVoice speaker (default: alloy's speaker, as the server's default voice, "
                                     f"{DEFAULT_VOICE}; else the first one `info` lists)")
    s.add_argument("--language", default="auto", help="a language name as `info` lists them, or auto (default auto)")
    s.add_argument("--instruct", help="style instruction (VoiceDesign; CustomVoice 1.7B; default none)")
    s.add_argument("--ref-audio", help="Base models: reference recording of the voice to clone (WAV/FLAC/MP3/OGG, "
                                       "1-30 s; required on Base models)")
    s.add_argument("--ref-text", help="transcript of --ref-audio: clones in ICL mode (default none: x-vector only)")
    s.add_argument("--xvector-only", action="store_true",
                   help="clone from the speaker embedding alone even with --ref-text (default off)")
    s.add_argument("--ref-silence", type=float, default=0.0, metavar="SECONDS",
                   help="silence appended to the reference before encoding, against its last phonemes bleeding "
                        "into the output (default 0 = as the reference implementation)")
    s.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same audio (default 0)")
    s.add_argument("--greedy", action="store_true",
                   help="argmax decoding for talker and code predictor (default off: sampled)")
    s.add_argument("--max-frames", type=int,
                   help=f"cap on complete 80 ms frames (default: a real model ends on its own; random weights, "
                        f"which rarely end, stop after {RANDOM_MAX_FRAMES} = {RANDOM_MAX_FRAMES * 0.08:.2f} s)")
    s.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights dtype (default float32; bfloat16 halves memory)")
    s.add_argument("--out", default="speech.wav",
                   help=f"output file; its extension names the format ({', '.join(OUT_FORMATS)}; .pcm: raw s16le "
                        "24 kHz mono) (default speech.wav)")
    s.add_argument("--codes-out", help="also save the codes [frames, 16] as .npy (default: not saved)")
    i = sub.add_parser("info", help="print what a checkpoint is (kind, size, speakers, languages)")
    i.add_argument("--model", default="tiny-random",
                   help="checkpoint directory, tiny-random or tiny-random-base (default tiny-random)")
    add_finetune_parser(sub)
    add_serve_parser(sub)
    add_cluster_parser(sub)
    sub.add_parser("study", help="capacity studies of a server: `qtts-jax study {capacity,sustained,fleet} --help`",
                   add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["study"]:  # the studies toolkit owns its own arguments
        from studies.cli import main as study_main

        return study_main(argv[1:], prog="qtts-jax study")
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        # JAX probes for a TPU on every start and logs the missing libtpu.so, which reads as an error on CPU/GPU
        logging.getLogger("jax._src.xla_bridge").addFilter(lambda r: "libtpu.so" not in r.getMessage())
        return serve(args)
    if args.command == "cluster":
        return cluster(args)
    if args.command == "finetune":
        return finetune(args)
    if args.command == "synth" and Path(args.out).suffix.lower() not in OUT_FORMATS:
        print(f"error: --out: {args.out!r} does not end in a format synth writes ({', '.join(OUT_FORMATS)})",
              file=sys.stderr)
        return 2
    import jax.numpy as jnp

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
            speaker = DEFAULT_VOICE if DEFAULT_VOICE in model.cfg.speakers else sorted(model.cfg.speakers)[0]
            print(f"speaker: {speaker} (pass --speaker to choose)", file=sys.stderr)
        max_frames = args.max_frames
        if max_frames is None and model.is_noise:
            max_frames = RANDOM_MAX_FRAMES
            print(f"max frames: {max_frames} (random weights rarely end; pass --max-frames to change)",
                  file=sys.stderr)
        req = Request(
            text=args.text, speaker=speaker, language=args.language, instruct=args.instruct, voice=voice, seed=args.seed,
            greedy=True if args.greedy else None, subtalker_greedy=True if args.greedy else None,
            max_frames=max_frames,
        )
        t0 = time.perf_counter()
        (result,) = model.generate(req)
        elapsed = time.perf_counter() - t0
    except (CheckpointError, RequestError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_audio(Path(args.out), result.audio)
    if args.codes_out:
        np.save(args.codes_out, result.codes)
    seconds = len(result.audio) / result.sample_rate
    print(f"wrote {args.out}: {result.frames} frames, {seconds:.2f} s of audio in {elapsed:.2f} s")
    return 0


def write_audio(path: Path, audio: np.ndarray) -> None:
    """24 kHz model audio as the file `path`'s extension names (`OUT_FORMATS`)."""
    from qtts_jax.io.audio import write_wav
    from qtts_jax.codec.config import SAMPLE_RATE
    from serving.audio.out import whole

    fmt = OUT_FORMATS[path.suffix.lower()]
    if fmt == "wav":
        write_wav(path, audio, SAMPLE_RATE)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(whole(fmt, audio))
