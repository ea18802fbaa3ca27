"""The server's settings: defaults, then QTTS_* environment variables, then flags (`serving/cli.py`); they also
derive the engine's and admission's configurations."""

from __future__ import annotations

import dataclasses
import os

from qtts_jax.engine import EngineConfig
from serving.scheduler import AdmissionConfig


@dataclasses.dataclass(frozen=True)
class Settings:
    model: str = "tiny-random"
    host: str = "127.0.0.1"
    port: int = 8000
    slots: int | str = 8  # or "auto": as many as the accelerator's free memory holds (qtts_jax/engine/sizing.py)
    context: int = 1024
    frames_per_step: int = 4
    lead_ms: float = 1000.0  # playback lead each stream builds from spare compute (EngineConfig.lead_s)
    max_step_ms: float = 60.0  # the longest step; a request arriving during it waits for it (EngineConfig.max_step_s)
    cap_iteration: bool = False  # max_step_ms bounds the newcomers' programs ahead of the step too (EngineConfig)
    max_prefill: int = 32  # requests one prefill call takes (EngineConfig.max_prefill)
    max_first: int = 128  # newcomers one iteration starts at most (EngineConfig.max_first)
    newcomer_guard: bool = True  # start only the newcomers the playing streams' headroom pays for (EngineConfig)
    margin_quantile: float = 0.99  # share of the measured lateness the playback margin covers (EngineConfig)
    hold_first: bool = False  # a newcomer's first frame waits for its step's if it could play out first (EngineConfig)
    # the weights: "auto" is bfloat16 on a GPU (the checkpoints' own dtype, and what capacity is measured at) and
    # float32 elsewhere (the reference's arithmetic, which parity is checked in)
    dtype: str = "auto"
    codec_dtype: str = "float32"  # the streaming codec's arithmetic (EngineConfig.codec_dtype)
    ttfa_target_ms: float = 300.0
    starvation_ms: float = 0.0  # the zero-underrun contract: no admitted stream may stall
    max_queue: int | None = None
    max_input_chars: int = 4096
    max_body_bytes: int = 256 * 1024
    drain_timeout_s: float = 30.0
    ws_max_messages_per_s: float = 200.0  # an LLM's tokens sent one message each (~100/s) stay under it
    ws_max_message_bytes: int = 64 * 1024
    ws_max_pending_utterances: int = 8
    # connections (`run` only): slowloris, idle sockets and descriptor exhaustion (serving/connections.py)
    header_timeout_s: float = 10.0  # from a request's first byte to its last header line, else 408 and closed
    idle_timeout_s: float = 75.0  # a connection with no request in progress is closed after this
    max_connections: int = 512  # open HTTP and WebSocket connections; one more gets 503 and is closed
    # Python's thread switch interval in a serving process (`serve_alone`): how long the engine thread may wait
    # for the GIL while the event loop runs Python (the interpreter's default is 5; serve_alone says why 0.1)
    switch_interval_ms: float = 0.1
    warmup: bool = True
    seeded_ends: bool = False  # benchmarks on random weights: streams end at a seeded frame (EngineConfig)
    voices_dir: str = "voices"  # Base models: registered voices, one file each, reloaded at start-up
    max_voices: int = 1000
    max_voice_upload_bytes: int = 16 * 1024 * 1024
    voice_min_seconds: float = 1.0
    voice_max_seconds: float = 30.0
    voice_trailing_silence_ms: int = 500  # appended before encoding ICL codes, against phoneme bleed
    warm_voice_encoders: bool = True  # after /ready: compile the encoders for every recording length bucket
    compile_cache: str = "default"  # persistent XLA cache (`run` only): "default", "off" or a directory
    # OpenAI voice names -> this model's voices: "" (the default table), "a=b,c=d" over it, a JSON file, or "none"
    voice_aliases: str = ""
    inline_voice_cache: int = 32  # Base models: voices cloned from a request's ref_audio, kept by content hash
    # API keys (serving/auth.py): one admin key, or "none" (a gateway in front checks them); a keys file of several
    api_key: str = dataclasses.field(default="", repr=False)
    api_keys_file: str = ""
    public_metrics: bool = False  # /metrics without a key, where keys are on

    @classmethod
    def from_env(cls, **overrides) -> "Settings":
        """QTTS_<FIELD> environment variables (e.g. QTTS_SLOTS=16), then explicit overrides."""
        values = {}
        for f in dataclasses.fields(cls):
            raw = os.environ.get(f"QTTS_{f.name.upper()}")
            if raw is None:
                continue
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            if kind == "int | str":  # a count or a word (slots: "auto")
                values[f.name] = int(raw) if raw.isdigit() else raw
            elif "int" in kind and "None" in kind:
                values[f.name] = None if raw.lower() in ("", "none") else int(raw)
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

    def model_dtype(self) -> str:
        """The weights' dtype `dtype` names on this machine's backend."""
        from qtts_jax.model import weights_dtype

        return weights_dtype(self.dtype)

    def engine_config(self) -> EngineConfig:
        buckets = tuple(b for b in EngineConfig.prompt_buckets if b < self.context // 2) or (min(32, self.context // 2),)
        return EngineConfig(slots=self.slots, context=self.context, frames_per_step=self.frames_per_step,
                            prompt_buckets=buckets, max_trailing=min(256, self.context // 2),
                            lead_s=self.lead_ms / 1000, max_step_s=self.max_step_ms / 1000,
                            cap_iteration=self.cap_iteration, max_prefill=self.max_prefill, max_first=self.max_first,
                            guard_newcomers=self.newcomer_guard, codec_dtype=self.codec_dtype,
                            margin_quantile=self.margin_quantile, hold_first=self.hold_first,
                            seeded_ends=self.seeded_ends)

    def admission(self) -> AdmissionConfig:
        return AdmissionConfig(ttfa_target_s=self.ttfa_target_ms / 1000, starvation_s=self.starvation_ms / 1000,
                               max_queue=self.max_queue)
