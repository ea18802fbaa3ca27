"""Per-request records: every timestamp a study needs, one JSON object per line so runs can be re-analysed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


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
    retry_after: str | None = None
    warmup: bool = False
    protocol: str = "http"  # http (streamed POST) | ws (WebSocket utterance)

    @property
    def ok(self) -> bool:
        return self.invalid is None

    @property
    def ttfa_s(self) -> float | None:
        return None if self.first_byte_s is None else self.first_byte_s - self.send_s


def write_jsonl(path: str | Path, records: list[RequestRecord], append: bool = False) -> None:
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(dataclasses.asdict(r)) + "\n")


def read_jsonl(path: str | Path) -> list[RequestRecord]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                d["chunks"] = [tuple(c) for c in d["chunks"]]
                out.append(RequestRecord(**d))
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{n}: not a request record ({exc})") from None
    return out
