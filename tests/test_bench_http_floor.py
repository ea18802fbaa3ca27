"""bench/http_floor.py against its own instant server: every measured request is matched to its handler's start,
and the client's first-audio time splits into the part before the handler and the part after it."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("bench_http_floor", Path(__file__).parents[1] / "bench" / "http_floor.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_each_request_is_matched_to_its_handler_and_its_time_splits_there(tmp_path):
    result = asyncio.run(bench.measure(4, tmp_path, frames=3))
    assert (result["requests"], result["failed"]) == (8, 0)  # two waves of 4, each stamped by the server
    waves = [result[k] for k in ("first wave", "the rest") if k in result]
    assert sum(w["requests"] for w in waves) == 8
    for w in waves:
        ttfa, before, after = (w[k] for k in ("client_ttfa_ms", "send_to_handler_ms", "handler_to_first_byte_ms"))
        assert 0 < before[2] <= ttfa[2] and 0 < after[0] <= ttfa[2]
