"""Persistent XLA compilation cache, so a restarted server loads its compiled programs instead of compiling
them again (a 256-slot engine spends most of its 80-90 s start in XLA).

Every program is cached, however fast it compiled or small it is (jax's defaults skip programs under 1 s,
which would leave most of the engine's per-bucket programs out). Hits are counted through
`jax.monitoring`, so the server can say at start-up how much came from the cache.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import jax

_counts: collections.Counter = collections.Counter()
_dir: Path | None = None  # set by `enable`
_HIT = "/jax/compilation_cache/cache_hits"
_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"


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


def summary() -> str:
    """What the cache did so far in this process, for the start-up log: XLA programs (an engine program may be
    several) loaded from the cache and compiled, in one line, so a warm restart reads as "0 compiled"."""
    if _dir is None:
        return "compilation cache off"
    hits, total = _counts[_HIT], _counts[_REQUEST]
    return f"{total} XLA programs: {hits} loaded from the compilation cache {_dir}, {total - hits} compiled"


def _count(event: str, **_) -> None:
    if event in (_HIT, _REQUEST):
        _counts[event] += 1
