"""Per-request records: every timestamp a study needs, one JSON object per line so runs can be re-analysed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from studies.playback import simulate


@dataclasses.dataclass
class RequestRecord:
    """One request. Times are seconds on the client's monotonic clock relative to `send_s`'s condition start."""

    request_id: str
    condition: str  # e.g. "closed:4" or "open-poisson:2.0"
    mode: str  # closed | open-fixed | open-poisson
    load: float  # concurrency (closed) or requests/s (open)
    prompt: int  # index into the corpus
    text: str
    send_s: float
    first_byte_s: float | None = None
    end_s: float | None = None
    chunks: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (arrival_s, samples)
    status: int | None = None
    error: str | None = None  # transport/HTTP error text
    invalid: str | None = None  # why the stream failed validation (None: valid)
    sample_rate: int | None = None
    server_ttfa_ms: float | None = None
    server_queue_ms: float | None = None  # of that, waiting for admission to a slot (the engine's queue)
    server_intake_ms: float | None = None  # before it: the server's handler start to the engine's submit
    retry_after: str | None = None
    refusals: int = 0  # sends the server refused (429/503) before the last, each followed by a wait of its Retry-After
    refusal: str | None = None  # why the first refused send was refused (the server's message)
    warmup: bool = False
    protocol: str = "http"  # http (streamed POST) | ws (WebSocket utterance)
    server: str = ""  # which server of a study (its label), so one DataFrame can hold a comparison

    @property
    def ok(self) -> bool:
        return self.invalid is None

    @property
    def ttfa_s(self) -> float | None:
        return None if self.first_byte_s is None else self.first_byte_s - self.send_s


    def derived(self, buffer_ms: float = 0.0) -> dict:
        """The per-request numbers a planner tabulates: TTFA and, for a player with `buffer_ms` of start-up
        buffer, starvation, underruns, longest stall and audio seconds; None for a failed stream."""
        if not self.ok:
            return {"buffer_ms": buffer_ms, **dict.fromkeys(DERIVED[1:])}
        p = simulate(self.chunks, self.sample_rate, buffer_ms)
        return {"buffer_ms": buffer_ms, "ttfa_ms": 1000 * self.ttfa_s, "starvation_ms": 1000 * p.starvation_s,
                "longest_stall_ms": 1000 * p.longest_stall_s, "underruns": p.underruns, "audio_s": p.audio_s}


DERIVED = ("buffer_ms", "ttfa_ms", "starvation_ms", "longest_stall_ms", "underruns", "audio_s")


def write_jsonl(path: str | Path, records: list[RequestRecord], append: bool = False, buffer_ms: float = 0.0) -> None:
    """One JSON object per request: the raw record plus its derived numbers (`RequestRecord.derived`), so
    `pandas.read_json(path, lines=True)` gives a table without re-simulating playback."""
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({**dataclasses.asdict(r), **r.derived(buffer_ms)}) + "\n")


def read_jsonl(path: str | Path) -> list[RequestRecord]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                d["chunks"] = [tuple(c) for c in d["chunks"]]
                for k in DERIVED:  # recomputed from the raw fields on demand
                    d.pop(k, None)
                out.append(RequestRecord(**d))
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{n}: not a request record ({exc})") from None
    return out
