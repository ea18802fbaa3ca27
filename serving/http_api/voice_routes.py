"""Voice registry endpoints (Base models): register from a recording, list, show, delete.

Registration reads a multipart form (bounded, field by field) or a JSON object with base64 audio; the recording
is `audio` or `audio_sample` (the OpenAI SDK's and vLLM-Omni's name). It decodes and checks the audio, runs both
encoders once off the event loop, checks that the voice's prompt fits this server's engine, primes the
codec state of ICL voices, and only then writes the voice to disk and makes it usable by name.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import hashlib
import re
import time

from aiohttp import BodyPartReader, hdrs, web
from aiohttp.multipart import parse_content_disposition

from qtts_jax.io.reference_audio import AudioLimits, decode_base64_audio, load_reference_audio
from qtts_jax.request import Request, RequestError, VoicePrompt
from serving.errors import ApiError, bad, from_request_error
from serving.keys import ENGINE, MODEL, SETTINGS, VOICES
from serving.schemas import base64_chars, check_text, read_json
from serving.voice.store import NAME, Voice

TEXT_FIELDS = {"name": 64, "transcript": 4096, "consent": 1000, "xvector_only": 8, "trailing_silence_ms": 8,
               "replace": 8, "type": 16}
AUDIO_FIELDS = ("audio", "audio_sample")  # the same recording under either name (OpenAI SDK: audio_sample)
FORM_SCHEMA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": NAME.pattern, "description": "Voice name (lowercase) for `voice`"},
        "audio": {"type": "string", "format": "binary",
                  "description": "Recording (WAV/FLAC/MP3/OGG, 1-30 s) as a file part, or base64 / a data: URL "
                                 "as a plain field; file paths are refused (the server opens no file a client "
                                 "names). The same body may be JSON with these fields, audio as base64"},
        "audio_sample": {"type": "string", "format": "binary", "description": "Same as audio (OpenAI's name)"},
        "type": {"type": "string", "enum": ["audio_sample"], "description": "OpenAI's creation method; only "
                                                                           "audio_sample"},
        "transcript": {"type": "string", "description": "What the recording says: enables ICL cloning"},
        "consent": {"type": "string", "description": "Consent note stored with the voice"},
        "xvector_only": {"type": "boolean", "description": "Clone from the speaker embedding only"},
        "trailing_silence_ms": {"type": "integer", "minimum": 0, "maximum": 2000,
                                "description": "Silence appended before encoding (ICL), against phoneme bleed"},
        "replace": {"type": "boolean", "description": "Overwrite a voice of the same name"},
    },
}
REGISTRATION = web.AppKey("voice_registration", asyncio.Lock)
INLINE = web.AppKey("inline_voices", collections.OrderedDict)  # sha256 of ref_audio + ref_text -> VoicePrompt
_BASE64 = re.compile(r"[A-Za-z0-9+/=\s]*")
# what a path looks like: absolute, home, relative, file: URL, Windows drive or separator, or a file extension
_PATH = re.compile(r"^(/|~|\.\.?/|file:|[A-Za-z]:)|\\|\.[A-Za-z0-9]{1,5}\s*$")


def setup(app: web.Application) -> None:
    app[REGISTRATION] = asyncio.Lock()
    app[INLINE] = collections.OrderedDict()
    r = app.router
    r.add_post("/v1/audio/voices", register)
    r.add_get("/v1/audio/voices/{name}", show)
    r.add_delete("/v1/audio/voices/{name}", delete)


def _store(app):
    store = app.get(VOICES)
    if store is None:
        kind = app[MODEL].cfg.model_type
        raise ApiError(400, "unsupported", f"voice cloning needs a Base checkpoint; this server runs a {kind} model",
                       "model")
    return store


async def register(request: web.Request) -> web.Response:
    app = request.app
    store, settings = _store(app), app[SETTINGS]
    if request.content_type == "application/json":
        form = await _read_json_form(request, settings.max_voice_upload_bytes)
    else:
        form = await _read_form(request, settings.max_voice_upload_bytes)
    if form.get("type", "audio_sample") != "audio_sample":
        raise bad("type", "only audio_sample is supported (a voice is cloned from a recording)")
    name = form.get("name", "").strip().lower()
    if not name:
        raise bad("name", "is required", "missing_field")
    if not NAME.match(name):
        raise bad("name", f"must match {NAME.pattern} (lowercase letters, digits, '_', '.', '-')")
    if "audio" not in form:
        raise bad("audio", "is required: attach the recording as a file field audio (or audio_sample)",
                  "missing_field")
    replace = _flag(form, "replace")
    if name in store and not replace:
        raise ApiError(409, "voice_exists", f"name: voice {name!r} exists; send replace=true to overwrite", "name")
    xvector_only = _flag(form, "xvector_only")
    silence_ms = _int(form, "trailing_silence_ms", settings.voice_trailing_silence_ms, 0, 2000)
    transcript = form.get("transcript", "").strip() or None
    limits = AudioLimits(min_seconds=settings.voice_min_seconds, max_seconds=settings.voice_max_seconds)
    async with app[REGISTRATION]:  # one registration at a time: the encoders share the device with live streams
        t0 = time.perf_counter()
        try:
            voice = await asyncio.get_running_loop().run_in_executor(
                None, _clone, app, form["audio"], transcript, xvector_only, silence_ms, limits)
        except RequestError as exc:
            raise from_request_error(exc) from None
        elapsed_ms = (time.perf_counter() - t0) * 1000
    prompt, ref = voice
    info = {
        "mode": "icl" if prompt.ref_codes is not None else "xvector",
        "transcript": prompt.ref_text,
        "consent": form.get("consent") or None,
        "seconds": round(ref.seconds, 3),
        "source_rate": ref.source_rate,
        "channels": ref.channels,
        "frames": 0 if prompt.ref_codes is None else len(prompt.ref_codes),
        "trailing_silence_ms": silence_ms if prompt.ref_codes is not None else 0,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "register_ms": round(elapsed_ms, 1),
    }
    v = Voice(name=name, prompt=prompt, info=info)
    try:
        store.save(v)
    except OverflowError as exc:
        raise ApiError(507, "registry_full", str(exc), "name") from None
    return web.json_response(v.describe(), status=201, headers={"Location": f"/v1/audio/voices/{name}"})


async def inline_voice(app, ref_audio: str, ref_text: str | None) -> VoicePrompt:
    """A speech request's own voice from its base64 `ref_audio` (the batched Rust server's per-request cloning),
    checked as a registration is. Kept in a bounded LRU keyed by the audio's and transcript's hash, so a client
    that sends the same reference with every request pays for the encoders once."""
    settings, cache = app[SETTINGS], app[INLINE]
    data = audio_from_text(ref_audio.encode("utf-8", "replace"), "ref_audio")
    transcript = (ref_text or "").strip() or None
    key = hashlib.sha256(data + b"\0" + (transcript or "").encode()).hexdigest()
    if key not in cache:
        limits = AudioLimits(min_seconds=settings.voice_min_seconds, max_seconds=settings.voice_max_seconds)
        async with app[REGISTRATION]:  # the encoders run one at a time, as for registration
            if key not in cache:  # a request with the same reference may have cloned it while this one waited
                try:
                    prompt, _ = await asyncio.get_running_loop().run_in_executor(
                        None, _clone, app, data, transcript, False, settings.voice_trailing_silence_ms, limits)
                except RequestError as exc:
                    field = {"audio": "ref_audio", "transcript": "ref_text"}.get(exc.field, exc.field)
                    raise bad(field, str(exc).split(": ", 1)[-1]) from None
                if settings.inline_voice_cache < 1:
                    return prompt
                cache[key] = prompt
                while len(cache) > settings.inline_voice_cache:
                    cache.popitem(last=False)
    cache.move_to_end(key)
    return cache[key]


def _clone(app, audio: bytes, transcript, xvector_only, silence_ms, limits):
    """Off the event loop: decode, encode, check the prompt fits, prime the codec state (ICL)."""
    model, engine = app[MODEL], app[ENGINE]
    ref = load_reference_audio(audio, limits)
    prompt = model.clone_voice(ref, transcript, xvector_only, silence_ms / 1000)
    try:
        engine.prepare(Request("Check.", voice=prompt, max_frames=1))  # the voice's prompt fits this engine
    except RequestError:
        seconds = ref.seconds + silence_ms / 1000
        raise RequestError("audio", f"with its transcript, {seconds:.1f} s of reference is too long a prompt for "
                                    "this server's engine; use a shorter recording or xvector_only") from None
    if prompt.ref_codes is not None:
        engine.prepare_voice(prompt.ref_codes)
    return prompt, ref


async def show(request: web.Request) -> web.Response:
    v = _store(request.app).get(request.match_info["name"].lower())
    if v is None:
        raise ApiError(404, "voice_not_found", f"voice {request.match_info['name']!r} is not registered", "name")
    return web.json_response(v.describe())


async def delete(request: web.Request) -> web.Response:
    name = request.match_info["name"].lower()
    if not _store(request.app).delete(name):
        raise ApiError(404, "voice_not_found", f"voice {name!r} is not registered", "name")
    return web.json_response({"id": name, "deleted": True})


async def _read_form(request: web.Request, max_audio_bytes: int) -> dict:
    if request.content_type == "application/x-www-form-urlencoded":
        raise bad("audio", "must be sent as a file: use multipart/form-data (curl -F audio=@voice.wav)",
                  "missing_field")
    if request.content_type != "multipart/form-data":
        raise bad("body", "must be multipart/form-data (or JSON) with fields name, audio (or audio_sample) and "
                          "optionally transcript, consent, xvector_only, trailing_silence_ms, replace",
                  "invalid_content_type")
    try:
        reader = await request.multipart()
        form: dict = {}
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                name = parse_content_disposition(part.headers.get(hdrs.CONTENT_DISPOSITION))[1].get("name")
                raise bad(name or "body", "must be a single part, not a nested multipart", "invalid_body")
            field = part.name or ""
            if field in form or (field in AUDIO_FIELDS and "audio" in form):
                raise bad(field, "is given twice (audio and audio_sample are one field)", "duplicate_field")
            if field in AUDIO_FIELDS:
                data = await _read_part(part, max_audio_bytes, field)
                # a file part is the recording's bytes; a plain field is base64 or a data: URL of it
                form["audio"] = data if part.filename is not None else audio_from_text(data, field)
            elif field in TEXT_FIELDS:
                raw = await _read_part(part, TEXT_FIELDS[field] * 4, field)
                try:
                    form[field] = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise bad(field, "must be UTF-8 text") from None
                if len(form[field]) > TEXT_FIELDS[field]:
                    raise bad(field, f"must be at most {TEXT_FIELDS[field]} characters", "too_long")
                check_text(field, form[field])
            else:
                raise bad(field[:64] or '""', f"unknown field; expected audio, audio_sample or one of "
                                              f"{sorted(TEXT_FIELDS)}", "unknown_field")
    except (ValueError, AssertionError) as exc:  # malformed multipart framing
        raise bad("body", f"is not a valid multipart form ({str(exc)[:100]})", "invalid_body") from None
    return form


async def _read_json_form(request: web.Request, max_audio_bytes: int) -> dict:
    """A JSON registration: the multipart form's fields as a JSON object, the audio as base64 or a data: URL."""
    body = await read_json(request, base64_chars(max_audio_bytes) + 64 * 1024)
    if not isinstance(body, dict):
        raise bad("body", "must be a JSON object", "invalid_json")
    form: dict = {}
    for key, value in body.items():
        if key in AUDIO_FIELDS:
            if "audio" in form:
                raise bad(key, "is given twice (audio and audio_sample are one field)", "duplicate_field")
            if not isinstance(value, str):
                raise bad(key, "must be base64 text or a data: URL", "invalid_type")
            form["audio"] = audio_from_text(value.encode("utf-8", "replace"), key)
        elif key in TEXT_FIELDS:
            if isinstance(value, bool):
                value = "true" if value else "false"
            elif isinstance(value, int) and key == "trailing_silence_ms":
                value = str(value)
            if not isinstance(value, str):
                raise bad(key, "must be a string" + (" or boolean" if key in ("xvector_only", "replace") else ""),
                          "invalid_type")
            if len(value) > TEXT_FIELDS[key]:
                raise bad(key, f"must be at most {TEXT_FIELDS[key]} characters", "too_long")
            form[key] = check_text(key, value)
        else:
            raise bad(str(key)[:64] or '""', f"unknown field; expected audio, audio_sample or one of "
                                             f"{sorted(TEXT_FIELDS)}", "unknown_field")
    return form


def audio_from_text(data: bytes, field: str = "audio") -> bytes:
    """A plain audio field: base64 or a data: URL, decoded here, so the decoder only ever sees bytes. Text
    that looks like a path is refused as such, without looking at the file system (whether it exists or not)."""
    text = data.decode("ascii", "replace").strip()
    long_base64 = len(text) >= 256 and _BASE64.fullmatch(text)  # an MP3's base64 starts with '//'
    if not text.startswith("data:") and not long_base64 and _PATH.search(text):
        raise bad(field, "file paths are not accepted: send the recording's bytes as a file part "
                         "(curl -F audio=@voice.wav), base64 or a data: URL", "path_not_accepted")
    try:
        return decode_base64_audio(text)
    except RequestError as exc:
        raise bad(field, str(exc).split(": ", 1)[-1]) from None


async def _read_part(part, limit: int, field: str) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk(64 * 1024):
        data += chunk
        if len(data) > limit:
            raise ApiError(413, "body_too_large", f"{field}: larger than {limit} bytes", field)
    return bytes(data)


def _flag(form: dict, field: str) -> bool:
    raw = form.get(field, "false").strip().lower()
    if raw not in ("true", "false", "1", "0", "yes", "no", "on", "off", ""):
        raise bad(field, "must be true or false")
    return raw in ("true", "1", "yes", "on")


def _int(form: dict, field: str, default: int, lo: int, hi: int) -> int:
    raw = form.get(field, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad(field, "must be an integer") from None
    if not lo <= value <= hi:
        raise bad(field, f"must be in [{lo}, {hi}]")
    return value
