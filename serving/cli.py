"""`qtts-jax serve`: flags override QTTS_* environment variables, which override the defaults."""

from __future__ import annotations

import argparse

# serving.settings.Settings fields without a flag (tests/test_cli_help.py keeps this list equal to them)
ENV_ONLY = ("QTTS_MAX_BODY_BYTES", "QTTS_WS_MAX_MESSAGES_PER_S", "QTTS_WS_MAX_MESSAGE_BYTES",
            "QTTS_WS_MAX_PENDING_UTTERANCES", "QTTS_WARMUP", "QTTS_MAX_VOICES", "QTTS_MAX_VOICE_UPLOAD_BYTES",
            "QTTS_VOICE_MIN_SECONDS", "QTTS_VOICE_MAX_SECONDS", "QTTS_VOICE_TRAILING_SILENCE_MS",
            "QTTS_WARM_VOICE_ENCODERS", "QTTS_INLINE_VOICE_CACHE", "QTTS_SEEDED_ENDS")


def add_serve_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="run the OpenAI-compatible speech server (HTTP + WebSocket)",
                       description="Every flag can also be set by an environment variable QTTS_<NAME>, "
                                   "e.g. QTTS_SLOTS=16 or QTTS_TTFA_TARGET_MS=250.",
                       epilog="Settings with no flag, by environment variable only: " + ", ".join(ENV_ONLY) + ".")
    return add_server_flags(s)


def add_server_flags(s: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The server's settings as flags: `serve`'s, and each replica's of `qtts-jax cluster`."""
    s.add_argument("--model", help="checkpoint directory, tiny-random or tiny-random-base (QTTS_MODEL; default tiny-random)")
    s.add_argument("--host", help="bind address (QTTS_HOST; default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (QTTS_PORT; default 8000)")
    s.add_argument("--slots", type=_slots, help="concurrent streams compiled into the engine, or auto: as many as "
                                                 "the accelerator's free memory holds (8 on a CPU); a count that "
                                                 "does not fit is refused at start (QTTS_SLOTS; default 8)")
    s.add_argument("--context", type=int, help="KV rows per slot (QTTS_CONTEXT; default 1024)")
    s.add_argument("--frames-per-step", type=int, help="the most frames one engine step runs, playback headroom "
                                                        "permitting (QTTS_FRAMES_PER_STEP; default 4)")
    s.add_argument("--lead-ms", type=float, help="playback lead each stream builds from spare compute before its "
                                                 "chunks grow to the schedule's sizes (QTTS_LEAD_MS; default 1000)")
    s.add_argument("--max-step-ms", type=float, help="the longest engine step, which a newly arrived request waits "
                                                     "for, unless only a longer one keeps up (QTTS_MAX_STEP_MS; default 60)")
    s.add_argument("--max-prefill", type=_count, help="requests one prefill call takes: newcomers are prefilled in "
                                                   "the cheapest mix of calls of 1, 8, 64, ... and this many, each "
                                                   "size a program per prompt bucket (QTTS_MAX_PREFILL; default 32)")
    s.add_argument("--max-first", type=_count, help="newcomers one engine iteration starts at most, a first-frame "
                                                 "program per ladder rung up to it (QTTS_MAX_FIRST; default 128)")
    s.add_argument("--dtype", choices=["auto", "float32", "bfloat16"],
                   help="weights dtype (QTTS_DTYPE; default auto: bfloat16 on a GPU, float32 elsewhere)")
    s.add_argument("--codec-dtype", choices=["float32", "bfloat16"],
                   help="the streaming codec's arithmetic: bfloat16 runs its convolutions on tensor cores "
                        "(QTTS_CODEC_DTYPE; default float32, the reference's)")
    s.add_argument("--ttfa-target-ms", type=float, help="admission TTFA target (QTTS_TTFA_TARGET_MS; default 300)")
    s.add_argument("--starvation-ms", type=float, help="underrun an admitted stream may suffer; the default 0 "
                                                       "refuses (429) what would make any playing stream stall")
    s.add_argument("--max-queue", type=int, help="waiting requests beyond the slots (default: slots)")
    s.add_argument("--max-input-chars", type=int, help="longest input text (default 4096)")
    s.add_argument("--drain-timeout-s", type=float, help="SIGTERM: how long in-flight streams may finish (default 30)")
    s.add_argument("--header-timeout-s", type=float, help="a request's headers must arrive within this, else 408 "
                                                          "and the connection closes (slowloris; default 10)")
    s.add_argument("--idle-timeout-s", type=float, help="close a connection idle this long (default 75)")
    s.add_argument("--max-connections", type=int, help="open connections; more get 503 (default 512)")
    s.add_argument("--switch-interval-ms", type=_positive,
                   help="Python's thread switch interval: how long the engine thread, back from a device call, may "
                        "wait for the interpreter while the event loop takes requests (QTTS_SWITCH_INTERVAL_MS; "
                        "default 0.1, Python's own 5)")
    s.add_argument("--voices-dir", help="Base models: where registered voices are kept (QTTS_VOICES_DIR; "
                                        "default ./voices)")
    s.add_argument("--voice-aliases", metavar="NAME=VOICE,...|FILE|none",
                   help="OpenAI voice names (alloy, ash, …) -> this model's voices, over the default table "
                        "(README); a JSON file of them, or none (QTTS_VOICE_ALIASES; default: the table)")
    s.add_argument("--api-key", metavar="KEY|none",
                   help="the key every /v1 request and WebSocket must present (Authorization: Bearer KEY), with the "
                        "admin role; none: no keys, a gateway in front checks them (QTTS_API_KEY; default: none "
                        "needed on 127.0.0.1, elsewhere the server refuses to start without a key or none)")
    s.add_argument("--api-keys-file", metavar="FILE",
                   help="several keys, one 'KEY ROLE [MAX_STREAMS]' a line; ROLE speak, admin (speak and change "
                        "voices, read /metrics) or metrics; MAX_STREAMS caps the key's concurrent streams "
                        "(QTTS_API_KEYS_FILE; default none)")
    s.add_argument("--public-metrics", type=_on_off, metavar="{on,off}",
                   help="on: /metrics needs no key even where keys are on (a scraper on a private network); off: an "
                        "admin or metrics key (QTTS_PUBLIC_METRICS; default off)")
    s.add_argument("--compile-cache", metavar="DIR|off",
                   help="persistent XLA compilation cache, so a restart skips compiling (QTTS_COMPILE_CACHE; "
                        "default $XDG_CACHE_HOME/qtts-jax/xla, else ~/.cache/qtts-jax/xla)")
    return s


def _on_off(text: str) -> bool:
    if text in ("on", "off"):
        return text == "on"
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def _count(text: str, expected: str = "a positive count") -> int:
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")


def _number(text: str, ok, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is not None and ok(value):
        return value
    raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")


def _positive(text: str) -> float:
    return _number(text, lambda v: 0.0 < v < float("inf"), "a positive number")


def _slots(text: str) -> int | str:
    return text if text == "auto" else _count(text, "a positive count or auto")


def settings_from_args(args):
    """Settings: the flags of `add_server_flags`, over QTTS_* environment variables, over the defaults."""
    from serving.settings import Settings

    keys = ("model", "host", "port", "slots", "context", "frames_per_step", "lead_ms", "max_step_ms",
            "max_prefill", "max_first", "dtype", "codec_dtype", "ttfa_target_ms", "starvation_ms", "max_queue", "max_input_chars", "drain_timeout_s", "voices_dir")
    keys += ("compile_cache", "header_timeout_s", "idle_timeout_s", "max_connections", "voice_aliases",
             "switch_interval_ms", "api_key", "api_keys_file", "public_metrics")
    return Settings.from_env(**{k: getattr(args, k) for k in keys})


def serve(args) -> int:
    from serving.app import run

    return run(settings_from_args(args))
