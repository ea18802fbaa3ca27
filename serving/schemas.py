"""Request bodies: strict validation into a `Request`, every failure an `ApiError` naming the field.

One table (`SPEECH_FIELDS`) drives both the validator and the JSON Schema in `/openapi.json`, so the
document and the code cannot drift. Types are strict (a bool is not a number, a float is not an int).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from qtts_jax.request import Request, RequestError
from serving.audio_encoders import FORMATS

MAX_SEED = 2**32 - 1
OPENAI_MODEL_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
# engine/Request field -> API field, so errors name what the caller sent
API_FIELD = {"text": "input", "speaker": "voice", "instruct": "instructions"}


class ApiError(Exception):
    """An error response: HTTP status, machine code, the offending field (or None), a message."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.field, self.retry_after = status, code, message, field, retry_after

    def body(self) -> dict:
        err = {"message": self.message, "type": _ERROR_TYPES.get(self.status, "server_error"), "code": self.code,
               "param": self.field}
        if self.retry_after is not None:
            err["retry_after"] = self.retry_after
        return {"error": err}


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                408: "invalid_request_error", 409: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


def bad(field: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, code, f"{field}: {message}" if field else message, field)


# C0/C1 controls and DEL, except tab, line feed and carriage return; surrogates left unpaired by JSON "\ud800"
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def check_text(field: str, text: str) -> str:
    """Refuse text that no tokenizer or UTF-8 encoder should see: lone surrogates and control characters."""
    if _SURROGATE.search(text):
        raise bad(field, "contains an unpaired UTF-16 surrogate: not valid Unicode text", "invalid_text")
    if m := _CONTROL.search(text):
        raise bad(field, f"must not contain control characters (found U+{ord(m.group()):04X})", "invalid_text")
    return text


def from_request_error(exc: RequestError) -> ApiError:
    field = API_FIELD.get(exc.field, exc.field)
    msg = str(exc).split(": ", 1)[-1]
    return bad(field, msg)


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


def speech_fields(max_input_chars: int = 4096) -> dict[str, Field]:
    return {
        "model": Field("string", "Served model name (or an OpenAI alias tts-1, tts-1-hd, gpt-4o-mini-tts)",
                       max_length=256),
        "input": Field("string", "Text to speak", required=True, max_length=max_input_chars),
        "voice": Field("voice", "Speaker name, or a registered cloned voice on Base models (see /v1/audio/voices), "
                               "or {\"id\": name}", required=True),
        "response_format": Field("string", "Audio format", enum=FORMATS, default="mp3"),
        "speed": Field("number", "Playback speed; only 1.0 is supported (other values are refused)",
                       minimum=0.25, maximum=4.0, default=1.0),
        "instructions": Field("string", "Style instruction (models that accept one)", max_length=4096),
        "stream_format": Field("string", "audio: bytes of the format; sse: speech.audio.delta events",
                               enum=("audio", "sse"), default="audio"),
        "stream": Field("boolean", "Send audio as it is generated (chunked) instead of one file", default=False),
        "language": Field("string", "Language name or auto", max_length=32, default="auto"),
        "seed": Field("integer", "Sampling seed; same seed, same audio", minimum=0, maximum=MAX_SEED, default=0),
        "greedy": Field("boolean", "Argmax decoding for talker and code predictor"),
        "temperature": Field("number", "Sampling temperature", minimum=0, exclusive_minimum=True, maximum=10),
        "top_k": Field("integer", "Top-k (0 disables)", minimum=0, maximum=1_000_000),
        "top_p": Field("number", "Top-p", minimum=0, exclusive_minimum=True, maximum=1),
        "repetition_penalty": Field("number", "Repetition penalty on generated codes", minimum=0,
                                    exclusive_minimum=True, maximum=10),
        "max_frames": Field("integer", "Cap on 80 ms frames", minimum=1, maximum=100_000),
        "chunk_schedule": Field("schedule", "Frames per audio chunk, in order, the last repeating (e.g. [1,2,4,8])"),
    }


def _check(name: str, f: Field, v: Any) -> Any:
    if f.kind == "string":
        if not isinstance(v, str):
            raise bad(name, "must be a string", "invalid_type")
        check_text(name, v)
        if f.max_length is not None and len(v) > f.max_length:
            raise bad(name, f"must be at most {f.max_length} characters", "too_long")
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
    request: Request
    response_format: str
    stream: bool
    stream_format: str
    schedule: tuple[int, ...] | None


def parse_options(body: Any, fields: dict[str, Field], *, required: bool = True) -> dict:
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


def build_request(opts: dict, *, model, served_names: tuple[str, ...], codec_sizes: tuple[int, ...],
                  voices=None) -> tuple[Request, tuple[int, ...] | None]:
    """Checked options -> a resolved-valid `Request` (model-level checks raise `ApiError` 400)."""
    if "model" in opts and opts["model"] not in served_names + OPENAI_MODEL_ALIASES:
        raise bad("model", f"{opts['model']!r} is not served here; use one of {list(served_names)}", "model_not_found")
    if "input" in opts and not opts["input"].strip():
        raise bad("input", "must not be empty", "empty")
    if opts.get("speed", 1.0) != 1.0:
        raise bad("speed", "only 1.0 is supported: time-stretching would change the voice, so it is refused "
                           "rather than ignored", "unsupported")
    schedule = None
    if "chunk_schedule" in opts:
        schedule = tuple(opts["chunk_schedule"])
        if any(n not in codec_sizes for n in schedule):
            raise bad("chunk_schedule", f"each entry must be one of {list(codec_sizes)}")
    voice = opts.get("voice")
    cfg = model.cfg
    speaker = prompt = None
    if cfg.model_type == "custom_voice":
        speaker = voice.lower() if voice else None
        if speaker is not None and speaker not in cfg.speakers:
            raise bad("voice", f"{voice!r} is not one of {sorted(cfg.speakers)}", "unknown_voice")
    elif cfg.model_type == "base" and voice:
        found = voices.get(voice.lower()) if voices is not None else None
        if found is None:
            known = voices.names()[:20] if voices is not None else []
            raise bad("voice", f"{voice!r} is not a registered voice (POST /v1/audio/voices to register one; "
                               f"registered: {known})", "unknown_voice")
        prompt = found.prompt
    elif voice:
        raise bad("voice", f"a {cfg.model_type} model has no named voices")
    greedy = opts.get("greedy")
    req = Request(
        text=opts.get("input", ""), speaker=speaker, voice=prompt, language=opts.get("language", "auto"),
        instruct=opts.get("instructions") or None, seed=opts.get("seed", 0), greedy=greedy,
        subtalker_greedy=greedy, temperature=opts.get("temperature"), top_k=opts.get("top_k"),
        top_p=opts.get("top_p"), repetition_penalty=opts.get("repetition_penalty"),
        max_frames=opts.get("max_frames"),
    )
    try:
        req.resolved(model.cfg, model.defaults)
    except RequestError as exc:
        raise from_request_error(exc) from None
    return req, schedule


def parse_speech(body: Any, *, model, served_names, codec_sizes, max_input_chars: int, voices=None) -> SpeechParams:
    opts = parse_options(body, speech_fields(max_input_chars))
    req, schedule = build_request(opts, model=model, served_names=served_names, codec_sizes=codec_sizes,
                                  voices=voices)
    stream_format = opts.get("stream_format", "audio")
    return SpeechParams(
        request=req, response_format=opts.get("response_format", "mp3"),
        stream=opts.get("stream", False) or stream_format == "sse", stream_format=stream_format,
        schedule=schedule,
    )


def speech_schema(max_input_chars: int = 4096) -> dict:
    fields = speech_fields(max_input_chars)
    return {
        "type": "object",
        "properties": {k: f.schema() for k, f in fields.items()},
        "required": [k for k, f in fields.items() if f.required],
        "additionalProperties": False,
    }
