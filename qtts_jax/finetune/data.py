"""The training data: a JSONL of ``{"audio", "text", "ref_audio"}`` lines, checked, then encoded.

Every line is checked before anything is encoded or trained (valid JSON, the three fields, a non-empty text,
files that exist and decode, clips of 1-30 s), so bad lines stop the run at once with a `DataError` naming each
line and its field. Each ``audio`` becomes its 16-codebook 12 Hz codes (our speech-tokenizer encoder) and each
``ref_audio`` the speaker encoder's x-vector, as the official ``prepare_data.py`` and its dataset compute them.
Both are cached beside the JSONL (``<name>.cache/``), keyed by the file's path, size and mtime and by the
encoders' fingerprint, so a second run (or a resumed one) encodes nothing again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from qtts_jax.clone import VoiceEncoders
from qtts_jax.codec import encoder as codec_encoder
from qtts_jax.io.reference_audio import AudioLimits, ReferenceAudio, load_reference_audio
from qtts_jax.request import RequestError
from qtts_jax.speaker.ecapa import speaker_embedding

FIELDS = ("audio", "text", "ref_audio")
LIMITS = AudioLimits(min_seconds=1.0, max_seconds=30.0)


class DataError(ValueError):
    """A training line that cannot be used; names the file, the line (1-based) and the field."""

    def __init__(self, path: Path, line: int, field: str, message: str):
        super().__init__(f"{path}:{line}: {field}: {message}")
        self.line, self.field = line, field
        self.problems = [self]

    @classmethod
    def every(cls, problems: list[DataError]) -> DataError:
        """One error for all the bad lines, so a file is fixed in one pass: a line of the message each.
        `line` and `field` are the first's."""
        if len(problems) == 1:
            return problems[0]
        err = cls.__new__(cls)
        ValueError.__init__(err, f"{len(problems)} bad lines:\n" + "\n".join(map(str, problems)))
        err.line, err.field, err.problems = problems[0].line, problems[0].field, problems
        return err


@dataclasses.dataclass(frozen=True)
class Line:
    number: int  # 1-based line of the JSONL
    audio: Path
    text: str
    ref_audio: Path


@dataclasses.dataclass(frozen=True)
class Example:
    text: str
    codes: np.ndarray  # [frames, 16] int32
    xvector: np.ndarray  # [talker hidden] float32


def _read(path: Path) -> tuple[list[Line], list[DataError]]:
    """The good lines and a problem per bad one."""
    try:
        raw = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(path, 0, "data", f"cannot be read: {exc}") from None
    lines, problems = [], []
    for number, text in enumerate(raw, 1):
        if text.strip():
            try:
                lines.append(_line(path, number, text))
            except DataError as exc:
                problems.append(exc)
    if not lines and not problems:
        raise DataError(path, 0, "data", "has no training lines")
    return lines, problems


def _line(path: Path, number: int, text: str) -> Line:
    try:
        item = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(path, number, "json", f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(item, dict):
        raise DataError(path, number, "json", "each line must be a JSON object")
    for field in FIELDS:
        if not isinstance(item.get(field), str):
            raise DataError(path, number, field, "missing or not a string")
    if not item["text"].strip():
        raise DataError(path, number, "text", "must not be empty")
    files = {field: _file(path, number, field, item[field]) for field in ("audio", "ref_audio")}
    return Line(number, files["audio"], item["text"], files["ref_audio"])


def _file(jsonl: Path, number: int, field: str, value: str) -> Path:
    p = Path(value)
    p = p if p.is_absolute() else jsonl.parent / p
    if not p.is_file():
        raise DataError(jsonl, number, field, f"file {p} does not exist")
    if not os.access(p, os.R_OK):
        raise DataError(jsonl, number, field, f"file {p} is not readable")
    return p


def load_clip(jsonl: Path, line: Line, field: str) -> ReferenceAudio:
    """Decode one of a line's files to checked mono 24 kHz (1-30 s, not silent, not clipped)."""
    try:
        return load_reference_audio(getattr(line, field), LIMITS)
    except (RequestError, OSError) as exc:
        message = str(exc).removeprefix("audio: ")
        raise DataError(jsonl, line.number, field, message) from None


class Cache:
    """Encoded clips beside the JSONL, one .npy per (file, what, encoders), written under a temporary name."""

    def __init__(self, jsonl: Path, fingerprint: str):
        self.directory = Path(jsonl).with_name(Path(jsonl).name + ".cache")
        self.fingerprint = fingerprint

    def path(self, source: Path, what: str) -> Path:
        st = source.stat()
        key = f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}|{what}|{self.fingerprint}"
        return self.directory / f"{what}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.npy"

    def put(self, path: Path, value: np.ndarray) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.npy")
        np.save(tmp, value)
        os.replace(tmp, path)


def prepare(jsonl: Path, encoders: VoiceEncoders) -> list[Example]:
    """Check every line, then encode what the cache does not hold yet.

    Files missing from the cache are decoded and checked first (fields, existence, 1-30 s) and only then
    encoded, so a bad line late in a long file is reported before minutes of encoding; a cached file was
    checked when it was encoded. Every bad line is reported at once, each with its first problem."""
    jsonl = Path(jsonl)
    lines, problems = _read(jsonl)
    cache = Cache(jsonl, encoders.fingerprint())
    what = {"audio": "codes", "ref_audio": "xvector"}
    todo = {}
    for line in lines:
        for field in what:
            path = cache.path(getattr(line, field), what[field])
            if path not in todo and not path.is_file():
                try:
                    load_clip(jsonl, line, field)
                except DataError as exc:
                    problems.append(exc)
                    break
                todo[path] = (line, field)
    if problems:
        raise DataError.every(sorted(problems, key=lambda e: e.line))
    for path, (line, field) in todo.items():
        samples = load_clip(jsonl, line, field).samples
        if field == "audio":
            value = codec_encoder.encode(encoders.codec_encoder_params, encoders.codec_cfg, samples).astype(np.int32)
        else:
            value = speaker_embedding(encoders.speaker_params, encoders.speaker_cfg, samples).astype(np.float32)
        cache.put(path, value)
    return [
        Example(line.text, np.load(cache.path(line.audio, "codes")), np.load(cache.path(line.ref_audio, "xvector")))
        for line in lines
    ]
