"""The compilation cache: XLA's persistent cache, and the engine's own compiled programs kept beside it, so a
restarted server, or another replica on the same kind of device, starts without compiling.

XLA's cache is keyed by the lowered program, so a hit still traces and lowers every program first (a second or so
each, one at a time under the GIL). The engine's programs are therefore also kept whole (`ProgramStore`), keyed
by everything they are built from, and loaded without tracing. Every program is cached, however fast it compiled
or small it is (jax's defaults skip programs under 1 s). Hits are counted, so the server can say at start-up how
much came from the cache.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib.metadata
import logging
import os
import pickle
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

import jax
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

_counts: collections.Counter = collections.Counter()
_this_thread = threading.local()  # XLA's cache events of this thread's compiles (jax records them in the caller)
_dir: Path | None = None  # set by `enable`
_HIT = "/jax/compilation_cache/cache_hits"
_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"
_PACKAGE = Path(__file__).resolve().parents[1]  # qtts_jax/: its source is part of every program's key


def default_dir() -> Path:
    """$XDG_CACHE_HOME/qtts-jax/xla, or ~/.cache/qtts-jax/xla."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qtts-jax" / "xla"


def enable(where: str) -> Path | None:
    """`where`: "default" (`default_dir()`), "off", or a directory. Call before anything compiles; returns the
    directory in use (None when off)."""
    global _dir
    if where == "off":
        return None
    path = default_dir() if where == "default" else Path(where).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size floor
    if _dir is None:
        jax.monitoring.register_event_listener(_count)
    _dir = path
    return path


def directory() -> Path | None:
    """The cache's directory (None when off)."""
    return _dir


def summary() -> str:
    """What the cache did so far in this process, for the start-up log, in one line, so a warm restart reads as
    "0 compiled": engine programs loaded whole, then XLA programs (an engine program may be several) loaded and
    compiled."""
    if _dir is None:
        return "compilation cache off"
    hits, total = _counts[_HIT], _counts[_REQUEST]
    return (f"{_counts['stored']} engine programs loaded whole and {_counts['made']} made; "
            f"{total} XLA programs: {hits} loaded from the compilation cache {_dir}, {total - hits} compiled")


def _count(event: str, **_) -> None:
    if event in (_HIT, _REQUEST):
        _counts[event] += 1
        setattr(_this_thread, event, getattr(_this_thread, event, 0) + 1)


def program_store(built_from) -> ProgramStore | None:
    """The store of the programs built from `built_from` (the model's and engine's shapes and settings: see
    `describe`) on this device, with this JAX and this package's source; None when the cache is off."""
    root = directory()
    if root is None:
        return None
    device = jax.devices()[0]
    source = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        source.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes())
    versions = []
    for package in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin"):
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    key = "\n".join([describe(built_from), *versions, device.platform, device.device_kind,
                     getattr(device.client, "platform_version", ""), os.environ.get("XLA_FLAGS", ""),
                     source.hexdigest()])
    return ProgramStore(root / "engine" / hashlib.sha256(key.encode()).hexdigest()[:32])


def describe(value) -> str:
    """`value` as text that depends on its contents alone: mappings in key order, dataclasses field by field. A
    model built from shapes (a compile worker's) and one built from weights must name the same store, and the
    variables' metadata in flax's graph definitions keeps its keys in the order each was made in."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ",".join(f"{f.name}={describe(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__name__}({fields})"
    if isinstance(value, Mapping):
        items = sorted(value.items(), key=lambda item: repr(item[0]))
        return "{" + ",".join(f"{k!r}:{describe(v)}" for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[{','.join(map(describe, value))}]"
    return repr(value)


class ProgramStore:
    """Compiled programs, serialized one file each under `root`. The files are trusted as the cache directory is:
    a program is loaded with pickle, as jax's own cache loads its entries."""

    def __init__(self, root: Path):
        self.root = root

    def _path(self, key: tuple) -> Path:
        return self.root / ("-".join(map(str, key)) + ".pkl")

    def has(self, key: tuple) -> bool:
        return self._path(key).exists()

    def load(self, key: tuple):
        """The program `key` stored earlier, or None (not stored, or unreadable by this process)."""
        path = self._path(key)
        if not path.exists():
            return None
        try:
            exe = serialize_executable.deserialize_and_load(*pickle.loads(path.read_bytes()))
        except Exception as e:  # a partial or foreign file costs a compile, not a failed start
            log.warning("compiling %s again: its stored program did not load (%s)", path.name, e)
            return None
        _counts["stored"] += 1
        return exe

    @staticmethod
    def compile(lowered) -> tuple:
        """`lowered` compiled, and whether XLA really compiled it here: a program that XLA's cache (or jax's memory
        of this process's compiles) handed back instead may have been loaded, and a loaded program does not
        serialize whole again (on a CPU its kernels are gone), so the store keeps only fresh ones."""
        before = (getattr(_this_thread, _REQUEST, 0), getattr(_this_thread, _HIT, 0))
        exe = lowered.compile()
        return exe, (getattr(_this_thread, _REQUEST, 0), getattr(_this_thread, _HIT, 0)) == (before[0] + 1, before[1])

    def save(self, key: tuple, exe) -> None:
        """Keep `exe` (compiled here: `compile`) as program `key`, written whole or not at all (replicas may share
        the directory)."""
        _counts["made"] += 1
        self._write(self._path(key), pickle.dumps(serialize_executable.serialize(exe)))

    def _write(self, path: Path, data: bytes) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.root, delete=False, suffix=".tmp") as f:
            f.write(data)
        os.replace(f.name, path)

    def load_timings(self) -> dict:
        """Idle seconds per call of the programs made here, timed with nothing compiling beside them, by program
        (with ("first", rung, 1): a first frame). They seed the loop's costs until live measurements replace them."""
        path = self.root / "settled-timings.pkl"
        try:
            return pickle.loads(path.read_bytes()) if path.exists() else {}
        except Exception as e:
            log.warning("timing the programs again: their kept timings did not load (%s)", e)
            return {}

    def save_timings(self, timings: dict) -> None:
        """`timings` (what `load_timings` gave, and more) kept for the next start."""
        self._write(self.root / "settled-timings.pkl", pickle.dumps(timings))
