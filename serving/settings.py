"""The server's settings: defaults, then QTTS_* environment variables, then flags (`serving/cli.py`); they also
derive the engine's and admission's configurations."""

from __future__ import annotations

import dataclasses
import os

from qtts_jax.engine import EngineConfig
from serving.admission import AdmissionConfig


# What `qtts-jax serve` takes, as a flag or a QTTS_<NAME> variable (serving/cli.py): each one a user can judge, its
# trade in docs/serving.md. The other fields are fixed for `serve`; tests, studies and benchmarks set them in Python.
SERVE = ("model", "host", "port", "slots", "context", "dtype", "ttfa_target_ms", "max_input_chars", "drain_timeout_s",
         "voices_dir", "voice_aliases", "api_key", "public_metrics", "compile_cache")


@dataclasses.dataclass(frozen=True)
class Settings:
    model: str = "tiny-random"
    host: str = "127.0.0.1"
    port: int = 8000
    slots: int | str = 8  # or "auto": as many as the accelerator's free memory holds (qtts_jax/engine/sizing.py)
    context: int = 1024
    # the weights: "auto" is bfloat16 on a GPU (the checkpoints' own dtype, and what capacity is measured at) and
    # float32 elsewhere (the reference's arithmetic, which parity is checked in)
    dtype: str = "auto"
    ttfa_target_ms: float = 300.0
    max_input_chars: int = 4096
    drain_timeout_s: float = 30.0
    voices_dir: str = "voices"  # Base models: registered voices, one file each, reloaded at start-up
    # OpenAI voice names -> this model's voices: "" (the default table), "a=b,c=d" over it, a JSON file, or "none"
    voice_aliases: str = ""
    # API keys (serving/http_api/auth.py): one admin key, "@FILE" (several, with roles), or "none" (a gateway
    # checks them)
    api_key: str = dataclasses.field(default="", repr=False)
    public_metrics: bool = False  # /metrics without a key, where keys are on
    compile_cache: str = "default"  # persistent XLA cache (`run` only): "default", "off" or a directory
    # ---- fixed for `serve` (docs/serving.md lists them) ----
    warmup: bool = True  # False: each program compiles when first needed (quick starts in tests)
    # EngineConfig fields over its defaults (benchmarks: frames_per_step, seeded_ends, codec_dtype ...)
    engine: dict = dataclasses.field(default_factory=dict)
    # AdmissionConfig fields over its defaults (a serialised study: no limits; tests on a slow CPU: no stall limit)
    admission: dict = dataclasses.field(default_factory=dict)
    max_body_bytes: int = 256 * 1024
    ws_max_messages_per_s: float = 200.0  # an LLM's tokens sent one message each (~100/s) stay under it
    ws_max_message_bytes: int = 64 * 1024
    ws_max_pending_utterances: int = 8
    # connections (`run` only): slowloris, idle sockets and descriptor exhaustion (serving/http_api/connections.py)
    header_timeout_s: float = 10.0  # from a request's first byte to its last header line, else 408 and closed
    idle_timeout_s: float = 75.0  # a connection with no request in progress is closed after this
    max_connections: int = 512  # open HTTP and WebSocket connections; one more gets 503 and is closed
    max_voices: int = 1000
    max_voice_upload_bytes: int = 16 * 1024 * 1024
    voice_min_seconds: float = 1.0
    voice_max_seconds: float = 30.0
    voice_trailing_silence_ms: int = 500  # appended before encoding ICL codes, against phoneme bleed
    warm_voice_encoders: bool = True  # after /ready: compile the encoders for every recording length bucket
    inline_voice_cache: int = 32  # Base models: voices cloned from a request's ref_audio, kept by content hash

    @classmethod
    def from_env(cls, **overrides) -> "Settings":
        """QTTS_<NAME> environment variables of the `SERVE` settings (e.g. QTTS_SLOTS=16), then explicit overrides."""
        values = {}
        for f in dataclasses.fields(cls):
            if f.name not in SERVE:
                continue
            raw = os.environ.get(f"QTTS_{f.name.upper()}")
            if raw is None:
                continue
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            if kind == "int | str":  # a count or a word (slots: "auto")
                values[f.name] = int(raw) if raw.isdigit() else raw
            elif kind.startswith("int"):
                values[f.name] = int(raw)
            elif kind.startswith("float"):
                values[f.name] = float(raw)
            elif kind.startswith("bool"):
                values[f.name] = raw.lower() in ("1", "true", "yes", "on")
            else:
                values[f.name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def engine_config(self) -> EngineConfig:
        buckets = tuple(b for b in EngineConfig.prompt_buckets if b < self.context // 2) or (min(32, self.context // 2),)
        return EngineConfig(**{"slots": self.slots, "context": self.context, "prompt_buckets": buckets,
                               "max_trailing": min(256, self.context // 2), **self.engine})

    def admission_config(self) -> AdmissionConfig:
        return AdmissionConfig(**{"ttfa_target_s": self.ttfa_target_ms / 1000, **self.admission})
