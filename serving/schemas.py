"""Request bodies: strict validation into the engine's `Request`, every failure an `ApiError` naming the field.

One table (`SPEECH_FIELDS`) drives both the validator and the JSON Schema in `/openapi.json`, so the
document and the code cannot drift. Types are strict (a bool is not a number, a float is not an int).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from qtts_jax.request import Request, VoicePrompt
from serving.audio.encoders import FORMATS, STREAM_BY_DEFAULT
from serving.audio.out import output_rate
from serving.audio.resample import RATES
from serving.errors import ApiError, bad

MAX_SEED = 2**32 - 1
INPUT_FORMATS = ("auto", "text", "ssml")
OPENAI_MODEL_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
# vLLM-Omni's task types <-> the checkpoint kinds they need
TASK_TYPES = {"CustomVoice": "custom_voice", "VoiceDesign": "voice_design", "Base": "base"}
# fields only vLLM-Omni's clients send: a body with one of them gets vLLM-Omni's defaults (see `speech_options`)
OMNI_FIELDS = frozenset({"task_type", "non_streaming_mode", "max_new_tokens", "initial_codec_chunk_frames",
                         "x_vector_only_mode"})
_HF_SIZES = {"0b6": "0.6B", "1b7": "1.7B"}
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# ISO 639-1 codes (and xx-YY locales) -> the model's language names, for clients of the batched Rust server
LANGUAGE_CODES = {"zh": "chinese", "en": "english", "de": "german", "it": "italian", "pt": "portuguese",
                  "es": "spanish", "ja": "japanese", "ko": "korean", "fr": "french", "ru": "russian"}


# C0/C1 controls and DEL, except tab, line feed and carriage return; surrogates left unpaired by JSON "\ud800"
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def task_type(model) -> str:
    """The served model's vLLM-Omni task type (CustomVoice, VoiceDesign or Base)."""
    return {v: k for k, v in TASK_TYPES.items()}[model.cfg.model_type]


def served_names(model) -> tuple[str, ...]:
    """The names a request's `model` may use: the served name, `qwen3-tts`, and the Hugging Face id of a
    checkpoint of this kind and size (`Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice`), which vLLM-Omni's clients send."""
    size = _HF_SIZES.get(model.cfg.model_size, model.cfg.model_size)
    hf = f"Qwen/Qwen3-TTS-12Hz-{size}-{task_type(model)}"
    return tuple(dict.fromkeys((model.name, "qwen3-tts", hf, f"Qwen/{model.name}")))


def check_text(field: str, text: str) -> str:
    """Refuse text that no tokenizer or UTF-8 encoder should see: lone surrogates and control characters."""
    if _SURROGATE.search(text):
        raise bad(field, "contains an unpaired UTF-16 surrogate: not valid Unicode text", "invalid_text")
    if m := _CONTROL.search(text):
        raise bad(field, f"must not contain control characters (found U+{ord(m.group()):04X})", "invalid_text")
    return text


async def read_json(request, limit: int) -> Any:
    """The body as JSON, read up to `limit` bytes (413 naming `body` beyond; a route may allow more than the
    app-wide size, e.g. for base64 audio)."""
    data = bytearray()
    while chunk := await request.content.readany():
        data += chunk
        if len(data) > limit:
            raise ApiError(413, "body_too_large", f"request body too large: more than {limit} bytes", "body")
    if not data:
        raise bad("body", "is empty; send a JSON object", "invalid_json")
    try:
        return json.loads(bytes(data))
    except (ValueError, RecursionError) as exc:
        raise bad("body", f"is not valid JSON ({str(exc)[:100]})", "invalid_json") from None


@dataclasses.dataclass(frozen=True)
class Field:
    kind: str  # string | number | integer | boolean | schedule | voice
    description: str
    required: bool = False
    enum: tuple | None = None
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    max_length: int | None = None
    default: Any = None

    def schema(self) -> dict:
        if self.kind == "voice":
            out = {"oneOf": [{"type": "string", "minLength": 1, "maxLength": 64},
                             {"type": "object", "properties": {"id": {"type": "string", "minLength": 1,
                                                                      "maxLength": 64}},
                              "required": ["id"], "additionalProperties": False}]}
        elif self.kind == "schedule":
            out = {"type": "array", "minItems": 1, "maxItems": 16, "items": {"type": "integer"}}
        else:
            out = {"type": self.kind}
        if self.enum is not None:
            out["enum"] = list(self.enum)
        if self.minimum is not None:  # OpenAPI 3.0 (JSON Schema draft 5): exclusiveMinimum is a flag on minimum
            out["minimum"] = self.minimum
            if self.exclusive_minimum:
                out["exclusiveMinimum"] = True
        if self.maximum is not None:
            out["maximum"] = self.maximum
        if self.max_length is not None:
            out["maxLength"] = self.max_length
            if self.kind == "string":
                out["minLength"] = 1 if self.required else 0
        if self.default is not None:
            out["default"] = self.default
        out["description"] = self.description
        return out


def base64_chars(n_bytes: int) -> int:
    """The longest base64 text (or data: URL of it) for `n_bytes` of data."""
    return 4 * ((n_bytes + 2) // 3) + 64


@functools.lru_cache(maxsize=8)
def speech_fields(max_input_chars: int = 4096, max_ref_audio_bytes: int = 16 * 1024 * 1024) -> Mapping[str, Field]:
    """The speech body's fields, built once per limits (every request is checked against them) and read-only."""
    return MappingProxyType({
        "model": Field("string", "Served model name (or an OpenAI alias tts-1, tts-1-hd, gpt-4o-mini-tts)",
                       max_length=256),
        "input": Field("string", "Text to speak, or an SSML <speak> document (see input_format); text longer than "
                                 "one prompt is spoken in parts, back to back, in one stream", required=True,
                       max_length=max_input_chars),
        "input_format": Field("string", "text, ssml, or auto: SSML when the input starts with <speak (or <?xml)",
                              enum=INPUT_FORMATS, default="auto"),
        "word_timestamps": Field("boolean", "Stream events with the estimated start and end of every word (SSE and "
                                            "the WebSockets; estimates from the prompt layout, no aligner)"),
        "voice": Field("voice", "Speaker name, an OpenAI voice name (alloy, ash, …: see aliases in "
                                "/v1/audio/voices), a registered cloned voice on Base models, or {\"id\": name}. "
                                "Optional for bodies that use text or ref_audio (the batched Rust server's clients)",
                       required=True),
        "response_format": Field("string", "Audio format (default mp3; wav for bodies that use text)", enum=FORMATS,
                                 default="mp3"),
        "speed": Field("number", "Playback speed, pitch kept (a time-stretch of the stream)", minimum=0.25,
                       maximum=4.0, default=1.0),
        "sample_rate": Field("integer", "Output sample rate in Hz (default 24000, the model's; ulaw/alaw: 8000)",
                             enum=RATES),
        "instructions": Field("string", "Style instruction (models that accept one)", max_length=4096),
        "stream_format": Field("string", "audio: bytes of the format; sse: speech.audio.delta events",
                               enum=("audio", "sse"), default="audio"),
        "stream": Field("boolean", "Send audio as it is generated (chunked) instead of one file; default true "
                                   "(false for flac and for bodies that use text)"),
        "language": Field("string", "Language name, ISO 639-1 code (en, es, fr, …) or auto", max_length=32,
                          default="auto"),
        "seed": Field("integer", "Sampling seed; same seed, same audio", minimum=0, maximum=MAX_SEED, default=0),
        "greedy": Field("boolean", "Argmax decoding for talker and code predictor"),
        "temperature": Field("number", "Sampling temperature", minimum=0, exclusive_minimum=True, maximum=10),
        "top_k": Field("integer", "Top-k (0 disables)", minimum=0, maximum=1_000_000),
        "top_p": Field("number", "Top-p", minimum=0, exclusive_minimum=True, maximum=1),
        "repetition_penalty": Field("number", "Repetition penalty on generated codes", minimum=0,
                                    exclusive_minimum=True, maximum=10),
        "max_frames": Field("integer", "Cap on 80 ms frames", minimum=1, maximum=100_000),
        "chunk_schedule": Field("schedule", "Frames per audio chunk, in order, the last repeating (e.g. [1,2,4,8])"),
        # the batched Rust server's request fields
        "text": Field("string", "Same as input (either one)", max_length=max_input_chars),
        "voice_id": Field("string", "Same as voice", max_length=64),
        "ref_audio": Field("string", "Base models: base64 WAV (or other audio) to clone the voice from for this "
                                     "request; cached by content", max_length=base64_chars(max_ref_audio_bytes)),
        "ref_text": Field("string", "Transcript of ref_audio (ICL cloning); without it, x-vector only",
                          max_length=4096),
        # vLLM-Omni's extension fields
        "task_type": Field("string", "vLLM-Omni: the task, which must be the served model's kind (inferred when "
                                     "omitted)", enum=tuple(TASK_TYPES)),
        "non_streaming_mode": Field("boolean", "vLLM-Omni: prompt layout; true puts the whole text before the "
                                               "codes, false feeds it beside them (default: false on Base, true "
                                               "otherwise). Not about how the audio is sent"),
        "max_new_tokens": Field("integer", "vLLM-Omni: cap on generated codec tokens (frames + the end token)",
                                minimum=1, maximum=100_001),
        "initial_codec_chunk_frames": Field("integer", "vLLM-Omni: frames in the first audio chunk (0: the "
                                                       "server's schedule)", minimum=0, maximum=64),
        "x_vector_only_mode": Field("boolean", "vLLM-Omni: clone from the speaker embedding only (no in-context "
                                               "reference), for ref_audio or a registered voice"),
    })


def _check(name: str, f: Field, v: Any) -> Any:
    if f.kind == "string":
        if not isinstance(v, str):
            raise bad(name, "must be a string", "invalid_type")
        check_text(name, v)
        if f.max_length is not None and len(v) > f.max_length:
            raise bad(name, f"is {len(v)} characters long; this server takes at most {f.max_length}", "too_long")
    elif f.kind == "boolean":
        if not isinstance(v, bool):
            raise bad(name, "must be a boolean", "invalid_type")
    elif f.kind == "integer":
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad(name, "must be an integer", "invalid_type")
    elif f.kind == "number":
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad(name, "must be a number", "invalid_type")
        if not math.isfinite(v):
            raise bad(name, "must be finite")
        v = float(v)
    elif f.kind == "voice":
        if isinstance(v, dict):
            if set(v) != {"id"}:
                raise bad(name, "an object voice must be exactly {\"id\": name}", "invalid_type")
            v = v["id"]
        if not isinstance(v, str) or not v or len(v) > 64:
            raise bad(name, "must be a voice name (1-64 characters) or {\"id\": name}", "invalid_type")
        check_text(name, v)
    elif f.kind == "schedule":
        if not isinstance(v, list) or not 1 <= len(v) <= 16 or any(
                isinstance(x, bool) or not isinstance(x, int) for x in v):
            raise bad(name, "must be a list of 1 to 16 integers", "invalid_type")
    if f.enum is not None and v not in f.enum:
        raise bad(name, f"{v!r} is not one of {list(f.enum)}")
    if f.minimum is not None:
        if (v <= f.minimum) if f.exclusive_minimum else (v < f.minimum):
            raise bad(name, f"must be {'>' if f.exclusive_minimum else '>='} {f.minimum}")
    if f.maximum is not None and v > f.maximum:
        raise bad(name, f"must be <= {f.maximum}")
    return v


@dataclasses.dataclass(frozen=True)
class SpeechParams:
    """How to send the audio (what to say is the request's `Script`: serving/text/script.py)."""

    response_format: str
    stream: bool
    stream_format: str
    rust_dialect: bool  # the body used `text`: a client of the batched Rust server (whole WAV by default)
    sample_rate: int = 24000  # of the audio sent
    speed: float = 1.0
    word_timestamps: bool = False  # SSE: speech.audio.words events


def parse_options(body: Any, fields: Mapping[str, Field], *, required: bool = True) -> dict:
    """Type/range checks of a JSON object against `fields`; unknown keys are refused by name."""
    if not isinstance(body, dict):
        raise bad("body", "must be a JSON object", "invalid_json")
    for key in body:
        if key not in fields:
            name = str(key)[:64] or '""'
            raise bad(name, f"unknown field; expected one of {sorted(fields)}", "unknown_field")
    out = {}
    for name, f in fields.items():
        if name not in body or body[name] is None:
            if required and f.required:
                raise bad(name, "is required", "missing_field")
            continue
        out[name] = _check(name, f, body[name])
    return out


def language(value: str) -> str:
    """A language name, `auto`, or an ISO 639-1 code / locale (en, es-MX, fr_FR) -> the name the model knows."""
    code = value.strip().lower().replace("_", "-").split("-")[0]
    return LANGUAGE_CODES.get(code, value)


def resolve_voice(voice: str | None, *, model, voices=None, aliases: dict[str, str] | None = None):
    """A voice name (speaker, OpenAI alias or registered voice) -> (speaker, prompt); 400 naming `voice`."""
    cfg, aliases = model.cfg, aliases or {}
    if voice is None:
        return None, None
    name = voice.lower()
    if cfg.model_type == "custom_voice":
        speaker = name if name in cfg.speakers else aliases.get(name)
        if speaker is None:
            raise bad("voice", f"{voice!r} is not one of {sorted(cfg.speakers)} nor an OpenAI voice name "
                               f"{sorted(aliases)}", "unknown_voice")
        return speaker, None
    if cfg.model_type == "base":
        found = voices.get(name) if voices is not None else None
        if found is None and name in aliases:
            target = aliases[name]
            found = voices.get(target) if voices is not None else None
            if found is None:
                raise bad("voice", f"{voice!r} is an OpenAI voice name; on this Base model it stands for the "
                                   f"registered voice {target!r}, which is not registered: register it with "
                                   f"POST /v1/audio/voices (name={target}, audio=@recording.wav, transcript=…), "
                                   f"map the name to another voice with --voice-aliases {name}=NAME, or send "
                                   "ref_audio (base64) with the request", "unknown_voice")
        if found is None:
            known = voices.names()[:20] if voices is not None else []
            raise bad("voice", f"{voice!r} is not a registered voice (POST /v1/audio/voices to register one; "
                               f"registered: {known})", "unknown_voice")
        return None, found.prompt
    raise bad("voice", f"a {cfg.model_type} model has no named voices")


def build_request(opts: dict, *, engine, served_names: tuple[str, ...], voices=None,
                  aliases: dict[str, str] | None = None, prompt: VoicePrompt | None = None
                  ) -> tuple[Request, tuple[int, ...] | None]:
    """Checked options -> the `Request` (its text the whole input) and chunk schedule for `Engine.prepare`;
    refusals that need no prompt layout are `ApiError` 400 naming the field. `prompt` is a voice cloned for this
    request from its `ref_audio`."""
    if "model" in opts and opts["model"] not in served_names + OPENAI_MODEL_ALIASES:
        raise bad("model", f"{opts['model']!r} is not served here; use one of {list(served_names)}", "model_not_found")
    if "input" in opts and not opts["input"].strip():
        raise bad("input", "must not be empty", "empty")
    if "task_type" in opts and opts["task_type"] != (served := task_type(engine.model)):
        raise bad("task_type", f"{opts['task_type']} needs a {opts['task_type']} checkpoint; this server runs a "
                               f"{served} model: use task_type {served!r} or leave it out", "task_mismatch")
    voice = opts.get("voice")
    if prompt is not None:
        if voice is not None:
            raise bad("ref_audio", "give either voice or ref_audio, not both", "conflict")
        speaker = None
    else:
        speaker, prompt = resolve_voice(voice, model=engine.model, voices=voices, aliases=aliases)
    if opts.get("x_vector_only_mode") and prompt is not None and prompt.ref_codes is not None:
        prompt = VoicePrompt(xvector=prompt.xvector)  # the registered voice's embedding alone
    max_frames = opts.get("max_frames")
    if "max_new_tokens" in opts:
        if max_frames is not None:
            raise bad("max_new_tokens", "give either max_frames or max_new_tokens, not both", "conflict")
        max_frames = max(opts["max_new_tokens"] - 1, 1)  # the last token is the end of speech, not a frame
    greedy = opts.get("greedy")
    req = Request(
        text=opts.get("input", ""), speaker=speaker, voice=prompt, language=language(opts.get("language", "auto")),
        instruct=opts.get("instructions") or None, seed=opts.get("seed", 0), greedy=greedy,
        subtalker_greedy=greedy, temperature=opts.get("temperature"), top_k=opts.get("top_k"),
        top_p=opts.get("top_p"), repetition_penalty=opts.get("repetition_penalty"),
        max_frames=max_frames, non_streaming=opts.get("non_streaming_mode"),
    )
    schedule = tuple(opts["chunk_schedule"]) if "chunk_schedule" in opts else None
    if opts.get("initial_codec_chunk_frames"):
        if schedule is not None:
            raise bad("initial_codec_chunk_frames", "give either chunk_schedule or initial_codec_chunk_frames, "
                                                    "not both", "conflict")
        first, sizes = opts["initial_codec_chunk_frames"], engine.config.codec_sizes
        if first not in sizes:
            raise bad("initial_codec_chunk_frames", f"must be one of {list(sizes)} (the chunk sizes this server's "
                                                    "codec is compiled for) or 0", "unsupported")
        schedule = (first, *engine.config.schedule[1:]) if len(engine.config.schedule) > 1 else (
            first, *engine.config.schedule)
    return req, schedule


def speech_options(body: Any, *, model, max_input_chars: int, max_ref_audio_bytes: int) -> dict:
    """The speech body's checked options, its dialect folded in: `text` -> `input`, `voice_id` -> `voice`, and
    on CustomVoice a missing `voice` is the default one (vivian in vLLM-Omni's dialect, as there; else alloy)."""
    opts = parse_options(body, speech_fields(max_input_chars, max_ref_audio_bytes), required=False)
    for alias, name in (("text", "input"), ("voice_id", "voice")):
        if alias in opts:
            if name in opts:
                raise bad(alias, f"give either {name} or {alias}, not both", "conflict")
            opts[name] = opts.pop(alias)
    if "text" in body:
        opts["_dialect"] = "rust"
    elif OMNI_FIELDS & set(body):
        opts["_dialect"] = "omni"
    if "input" not in opts:
        raise bad("input", "is required", "missing_field")
    if "ref_text" in opts and "ref_audio" not in opts:
        raise bad("ref_text", "is the transcript of ref_audio: send ref_audio too", "missing_field")
    if "ref_audio" in opts:
        if _URL.match(opts["ref_audio"].strip()) or opts["ref_audio"].strip().lower().startswith("file:"):
            raise bad("ref_audio", "is a URL: the server never fetches a URL or opens a file named in a request; "
                                   "send the recording itself as a base64 data URL (data:audio/wav;base64,...)",
                      "url_not_accepted")
        if opts.get("x_vector_only_mode") is False and "ref_text" not in opts:
            raise bad("ref_text", "x_vector_only_mode false clones in context, from ref_audio and its transcript: "
                                  "send ref_text", "missing_field")
        if model.cfg.model_type != "base":
            raise bad("ref_audio", f"cloning a voice needs a Base checkpoint; this server runs a "
                                   f"{model.cfg.model_type} model", "unsupported")
    if "voice" not in opts and "ref_audio" not in opts:
        # optional on CustomVoice, as vLLM-Omni's clients expect: its dialect gets its default speaker, any other
        # body the server's default voice (alloy), the one synth and the page use
        if opts.get("_dialect") == "omni" and "vivian" in model.cfg.speakers:
            opts["voice"] = "vivian"
        elif model.cfg.model_type == "custom_voice":
            opts["voice"] = "alloy"
        else:
            raise bad("voice", f"is required: a {model.cfg.model_type} model has no default voice", "missing_field")
    return opts


def parse_speech(opts: dict) -> SpeechParams:
    """Options from `speech_options` -> how to send the audio."""
    rust, omni = opts.get("_dialect") == "rust", opts.get("_dialect") == "omni"
    fmt = opts.get("response_format", "wav" if rust or omni else "mp3")
    rate = output_rate(fmt, opts.get("sample_rate"))
    stream_format = opts.get("stream_format", "audio")
    if omni:  # vLLM-Omni: a whole file unless stream_format says otherwise; stream=true alone means SSE
        stream_format = opts.get("stream_format", "sse" if opts.get("stream") else None)
        stream, stream_format = stream_format is not None, stream_format or "audio"
    else:
        stream = opts.get("stream", False if rust else fmt in STREAM_BY_DEFAULT)
    return SpeechParams(response_format=fmt, stream=stream or stream_format == "sse",
                        stream_format=stream_format, rust_dialect=rust, sample_rate=rate,
                        speed=opts.get("speed", 1.0), word_timestamps=opts.get("word_timestamps", False))


def speech_schema(max_input_chars: int = 4096, max_ref_audio_bytes: int = 16 * 1024 * 1024) -> dict:
    fields = speech_fields(max_input_chars, max_ref_audio_bytes)
    return {
        "type": "object",
        "properties": {k: f.schema() for k, f in fields.items()},
        "required": [k for k, f in fields.items() if f.required],
        "additionalProperties": False,
    }
