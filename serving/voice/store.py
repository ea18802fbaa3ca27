"""The server's registry of cloned voices: computed once, kept on disk, reloaded at start-up.

Each voice is one ``<name>.npz`` (x-vector, reference codes for ICL, and its description as JSON),
written to a temporary file, fsynced and renamed over the old one, so a crash never leaves a half
written voice. Every file records the fingerprint of the model that made it: an x-vector or codes
from another checkpoint would silently give a different voice, so such files are skipped (and kept).
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import json
import logging
import os
import re
import tempfile
import threading
from pathlib import Path

import numpy as np

from qtts_jax.request import VoicePrompt

log = logging.getLogger(__name__)

NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


@dataclasses.dataclass(frozen=True)
class Voice:
    name: str
    prompt: VoicePrompt
    info: dict  # created, mode, seconds, transcript, consent, source_rate, channels, frames, fingerprint

    def describe(self) -> dict:
        """The voice as the API shows it, with the fields of OpenAI's voice object (object, type, created_at)."""
        out = {"id": self.name, "name": self.name, "object": "audio.voice", "type": "audio_sample",
               **{k: v for k, v in self.info.items() if k != "fingerprint"}}
        if "created" in self.info:
            out["created_at"] = int(datetime.datetime.fromisoformat(self.info["created"]).timestamp())
        return out


class VoiceStore:
    """Name -> `Voice`, mirrored in ``directory``. Safe to call from several threads."""

    def __init__(self, directory: Path, fingerprint: str, max_voices: int = 1000):
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.max_voices = max_voices
        self._voices: dict[str, Voice] = {}
        self._lock = threading.Lock()

    def load(self) -> list[str]:
        """Read every voice file; returns a warning per file skipped (unreadable, or from another model)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        warnings = []
        for path in sorted(self.directory.glob("*.npz")):
            try:
                voice = _read(path)
            except Exception as exc:  # a damaged file must not stop the server
                warnings.append(f"{path.name}: unreadable ({exc})")
                continue
            if voice.info.get("fingerprint") != self.fingerprint:
                warnings.append(f"{path.name}: made by another model, skipped")
                continue
            self._voices[voice.name] = voice
        for w in warnings:
            log.warning("voice store %s: %s", self.directory, w)
        return warnings

    def get(self, name: str) -> Voice | None:
        return self._voices.get(name)

    def voices(self) -> list[Voice]:
        return [self._voices[n] for n in sorted(self._voices)]

    def names(self) -> list[str]:
        return sorted(self._voices)

    def __contains__(self, name: str) -> bool:
        return name in self._voices

    def __len__(self) -> int:
        return len(self._voices)

    def describe(self) -> list[dict]:
        return [v.describe() for v in self.voices()]

    def save(self, voice: Voice) -> None:
        """Write atomically, then make it visible (replacing a voice of the same name)."""
        with self._lock:
            if voice.name not in self._voices and len(self._voices) >= self.max_voices:
                raise OverflowError(f"the registry holds its maximum of {self.max_voices} voices")
            _write_atomic(self.directory / f"{voice.name}.npz", _encode(voice, self.fingerprint))
            self._voices[voice.name] = voice

    def delete(self, name: str) -> bool:
        with self._lock:
            if self._voices.pop(name, None) is None:
                return False
            (self.directory / f"{name}.npz").unlink(missing_ok=True)
            _fsync_dir(self.directory)
            return True


def _encode(voice: Voice, fingerprint: str) -> bytes:
    arrays = {"xvector": np.asarray(voice.prompt.xvector, np.float32)}
    if voice.prompt.ref_codes is not None:
        arrays["ref_codes"] = np.asarray(voice.prompt.ref_codes, np.int32)
    info = {**voice.info, "name": voice.name, "transcript": voice.prompt.ref_text, "fingerprint": fingerprint}
    arrays["info"] = np.frombuffer(json.dumps(info).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _read(path: Path) -> Voice:
    with np.load(path, allow_pickle=False) as z:
        info = json.loads(bytes(z["info"]).decode())
        codes = np.array(z["ref_codes"]) if "ref_codes" in z.files else None
        prompt = VoicePrompt(xvector=np.array(z["xvector"]), ref_codes=codes, ref_text=info.get("transcript"))
    name = info.pop("name")
    if not NAME.match(name) or path.stem != name:
        raise ValueError(f"file name and voice name {name!r} disagree")
    return Voice(name=name, prompt=prompt, info=info)


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Make a rename or unlink durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
