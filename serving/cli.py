"""`qtts-jax serve`: flags override QTTS_* environment variables, which override the defaults."""

from __future__ import annotations

import argparse


def add_serve_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="run the OpenAI-compatible speech server (HTTP + WebSocket)",
                       description="Every flag can also be set by an environment variable QTTS_<NAME>, "
                                   "e.g. QTTS_SLOTS=16 or QTTS_TTFA_TARGET_MS=250; docs/serving.md says what each "
                                   "trades. Everything else the engine decides from its measurements.")
    return add_server_flags(s)


def add_server_flags(s: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The server's settings as flags (`serving.settings.SERVE`): `serve`'s, and each replica's of `qtts-jax cluster`."""
    s.add_argument("--model", help="checkpoint directory, tiny-random or tiny-random-base (QTTS_MODEL; default tiny-random)")
    s.add_argument("--host", help="bind address (QTTS_HOST; default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (QTTS_PORT; default 8000)")
    s.add_argument("--slots", type=_slots, help="concurrent streams compiled into the engine, or auto: as many as "
                                                 "the accelerator's free memory holds (8 on a CPU); a count that "
                                                 "does not fit is refused at start (QTTS_SLOTS; default 8)")
    s.add_argument("--context", type=int, help="KV rows per slot: a prompt and the frames spoken after it; longer "
                                               "costs memory per slot (QTTS_CONTEXT; default 1024)")
    s.add_argument("--dtype", choices=["auto", "float32", "bfloat16"],
                   help="weights dtype (QTTS_DTYPE; default auto: bfloat16 on a GPU, float32 elsewhere)")
    s.add_argument("--ttfa-target-ms", type=float, help="first audio later than this is refused with 429 when "
                                                        "predicted: lower refuses more under load "
                                                        "(QTTS_TTFA_TARGET_MS; default 300)")
    s.add_argument("--max-input-chars", type=int, help="longest input text (QTTS_MAX_INPUT_CHARS; default 4096)")
    s.add_argument("--drain-timeout-s", type=float, help="SIGTERM: how long in-flight streams may finish "
                                                         "(QTTS_DRAIN_TIMEOUT_S; default 30)")
    s.add_argument("--voices-dir", help="Base models: where registered voices are kept (QTTS_VOICES_DIR; "
                                        "default ./voices)")
    s.add_argument("--voice-aliases", metavar="NAME=VOICE,...|FILE|none",
                   help="OpenAI voice names (alloy, ash, …) -> this model's voices, over the default table "
                        "(README); a JSON file of them, or none (QTTS_VOICE_ALIASES; default: the table)")
    s.add_argument("--api-key", metavar="KEY|@FILE|none",
                   help="the key every /v1 request and WebSocket must present (Authorization: Bearer KEY), with the "
                        "admin role; @FILE: several, one 'KEY ROLE [MAX_STREAMS]' a line (ROLE speak, admin or "
                        "metrics; MAX_STREAMS caps the key's concurrent streams); none: no keys, a gateway in front "
                        "checks them (QTTS_API_KEY; default: none needed on 127.0.0.1, elsewhere the server refuses "
                        "to start without one)")
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


def _slots(text: str) -> int | str:
    if text == "auto" or (text.isdigit() and int(text) > 0):
        return text if text == "auto" else int(text)
    raise argparse.ArgumentTypeError(f"expected a positive count or auto, got {text!r}")


def settings_from_args(args, **fixed):
    """Settings: the flags of `add_server_flags`, over QTTS_* environment variables, over the defaults; `fixed`
    sets fields that are not `serve` settings (studies/server.py's engine and admission)."""
    from serving.settings import SERVE, Settings

    return Settings.from_env(**{k: getattr(args, k) for k in SERVE}, **fixed)


def serve(args) -> int:
    from serving.app import run

    return run(settings_from_args(args))
