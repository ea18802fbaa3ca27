"""API keys: who may speak, who may change the voices, who may read the metrics.

The operator gives the keys (`--api-key KEY`, or `--api-key @FILE` for a keys file; `QTTS_API_KEY` likewise); a
request only presents one. A key
comes as `Authorization: Bearer KEY`, or, on the WebSocket, which a browser cannot give headers, as the
subprotocol `qtts-key.KEY`. Each key has a role:

  speak    the /v1 API: speech, the WebSocket, models, voices to read
  admin    speak, plus registering and deleting voices, plus /metrics
  metrics  /metrics only (a scraper's key)

and may cap its concurrent streams (speech requests and WebSocket sessions). The server and the fleet's front
check the same table with `Keyring.check`, before any body is read or any engine work is done. Keys are compared
as SHA-256 digests in constant time, held only as digests, and never logged.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import hmac
import ipaddress
import re
from pathlib import Path

from serving.errors import ApiError

SPEAK, VOICES, METRICS = "speak", "voices", "metrics"  # what a request needs
ROLES = {"speak": {SPEAK}, "admin": {SPEAK, VOICES, METRICS}, "metrics": {METRICS}}
SUBPROTOCOL = "qtts"  # our WebSocket protocol's name, answered when a browser offers it beside its key
KEY_PROTOCOL = "qtts-key."  # a subprotocol carrying a key
SOCKET = "/v1/audio/speech/stream"  # the WebSocket: the one path where a subprotocol may carry the key
STREAMS = {("POST", "/v1/audio/speech"), ("GET", SOCKET)}  # what a key's stream cap counts
MIN_KEY_CHARS = 16
# RFC 9110 token characters: what a subprotocol may hold, so every key can ride in one
_TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")
_READ = ("GET", "HEAD", "OPTIONS")
_GENERATE = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


@dataclasses.dataclass(frozen=True, eq=False)
class Key:
    """One key as the server holds it: its digest, never the key itself."""

    where: str  # where it was given ("--api-key", "keys.txt line 3"): what logs and messages may name
    digest: bytes = dataclasses.field(repr=False)
    role: str
    max_streams: int | None = None


def needs(method: str, path: str, public_metrics: bool = False) -> str | None:
    """What a request needs: SPEAK, VOICES or METRICS, or None for an open path (the page, /health, /ready,
    /openapi.json). Decided on the path alone, so the fleet's front and each replica agree."""
    if path == "/metrics":
        return None if public_metrics else METRICS
    if not (path == "/v1" or path.startswith("/v1/")):
        return None
    if path.startswith("/v1/audio/voices") and method not in _READ:
        return VOICES
    return SPEAK


class Keyring:
    """The keys a server takes (none: every path is open) and the streams each has open now."""

    def __init__(self, keys: tuple[Key, ...] = (), public_metrics: bool = False):
        self.keys, self.public_metrics = keys, public_metrics
        self.live: collections.Counter[Key] = collections.Counter()

    @property
    def on(self) -> bool:
        return bool(self.keys)

    def check(self, method: str, path: str, authorizations: list[str], protocols: list[str] = ()) -> Key | None:
        """The key a request may go on with (None: the path is open, or keys are off). Raises a 401 for a missing
        or wrong key, a 403 for a key whose role does not cover the path. `authorizations`: the request's
        Authorization headers; `protocols`: its WebSocket subprotocols (each header split at commas)."""
        need = needs(method, path, self.public_metrics) if self.on else None
        if need is None:
            return None
        key = self._find(_presented(authorizations, protocols))
        if key is None:
            raise ApiError(401, "invalid_api_key", "a valid API key is required: send Authorization: Bearer KEY "
                                                   f"(WebSocket from a browser: the subprotocol {KEY_PROTOCOL}KEY)")
        if need not in ROLES[key.role]:
            what = {VOICES: "registering or deleting voices", METRICS: "/metrics", SPEAK: "the speech API"}[need]
            raise ApiError(403, "insufficient_role", f"this key's role ({key.role}) does not allow {what}")
        return key

    def _find(self, presented: str | None) -> Key | None:
        """The key whose digest matches, comparing with every key in constant time (no early exit)."""
        if presented is None or not _TOKEN.fullmatch(presented):
            return None
        digest, found = _digest(presented), None
        for key in self.keys:
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found

    @contextlib.contextmanager
    def stream(self, key: Key | None):
        """One stream of `key` open for the block; a 429 with Retry-After when its cap is reached."""
        if key is None:
            yield
            return
        if key.max_streams is not None and self.live[key] >= key.max_streams:
            raise ApiError(429, "too_many_streams", f"this key may have {key.max_streams} streams open at once; "
                                                    "retry when one ends", retry_after=1)
        self.live[key] += 1
        try:
            yield
        finally:
            self.live[key] -= 1


def _presented(authorizations: list[str], protocols: list[str]) -> str | None:
    """The one key a request presents, or None: no key, or more than one place or copy of it (ambiguous)."""
    bearer = [a.strip()[7:].strip() for a in authorizations if a.strip()[:7].lower() == "bearer "]
    given = [p.strip()[len(KEY_PROTOCOL):] for header in protocols for p in header.split(",")
             if p.strip().startswith(KEY_PROTOCOL)]
    if len(authorizations) + len(given) != 1:
        return None
    return (bearer or given or [None])[0]


def subprotocols(offered: list[str]) -> tuple[str, ...]:
    """The subprotocols the WebSocket may answer with: ours among those offered (`qtts`, or a key's alone), so a
    browser's handshake, which fails unless one of its offers is answered, succeeds."""
    ours = [p.strip() for header in offered for p in header.split(",")
            if p.strip() == SUBPROTOCOL or p.strip().startswith(KEY_PROTOCOL)]
    return tuple(sorted(ours, key=lambda p: p != SUBPROTOCOL))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def keyring(settings) -> Keyring:
    """The keys `settings` give (api_key: a key, "@FILE" or "none"; public_metrics). Raises ValueError, naming the
    fix, for a server bound beyond loopback with no key (unless api_key is "none": a gateway in front checks them),
    and naming the line of a malformed keys file."""
    given = settings.api_key
    if given == "none":
        return Keyring(public_metrics=settings.public_metrics)
    if given.startswith("@"):
        keys = _read(Path(given[1:]))
    else:
        keys = [_key(given, "--api-key (QTTS_API_KEY)", "admin")] if given else []
    if not keys and not is_loopback(settings.host):
        raise ValueError(f"--host {settings.host} is reachable beyond this machine and no API key is set: give one "
                         "with --api-key KEY (or QTTS_API_KEY), several with --api-key @FILE, or --api-key none "
                         f"if a gateway in front checks keys. A key: {_GENERATE}")
    digests = [k.digest for k in keys]
    for k in keys:
        if digests.count(k.digest) > 1:
            raise ValueError(f"{k.where}: this key is given twice")
    return Keyring(tuple(keys), settings.public_metrics)


def _read(path: Path) -> list[Key]:
    """A keys file: one `KEY ROLE [MAX_STREAMS]` a line; blank lines and lines starting with # are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key @{path}: cannot be read ({exc.__class__.__name__})") from None
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"{path} line {n}"
        if len(fields) not in (2, 3):
            raise ValueError(f"{where}: expected KEY ROLE [MAX_STREAMS], got {len(fields)} fields")
        cap = None
        if len(fields) == 3:
            if not (fields[2].isdigit() and int(fields[2]) > 0):
                raise ValueError(f"{where}: MAX_STREAMS must be a positive count")
            cap = int(fields[2])
        keys.append(_key(fields[0], where, fields[1], cap))
    if not keys:
        raise ValueError(f"--api-key @{path}: holds no key")
    return keys


def _key(secret: str, where: str, role: str, max_streams: int | None = None) -> Key:
    if role not in ROLES:
        raise ValueError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
    if len(secret) < MIN_KEY_CHARS or not _TOKEN.fullmatch(secret):
        raise ValueError(f"{where}: a key must be at least {MIN_KEY_CHARS} characters of letters, digits and "
                         f"!#$%&'*+.^_`|~- (it may travel as a WebSocket subprotocol); make one with {_GENERATE}")
    return Key(where, _digest(secret), role, max_streams)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()
