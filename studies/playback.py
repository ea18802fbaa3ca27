"""Playback simulator: how long a real-time player, fed by a stream's chunk arrivals, runs out of audio.

Starvation is measured from the moment the player starts (first byte, or once the start-up buffer is
full), so the time to first audio is never counted as starvation; the two are separate SLOs.
"""

from __future__ import annotations

import dataclasses

from qtts_jax.codec.config import SAMPLE_RATE


@dataclasses.dataclass(frozen=True)
class Playback:
    start_s: float  # when the player started, on the arrival clock
    starvation_s: float  # total time the player had nothing to play after it started
    longest_stall_s: float
    underruns: int  # separate times the buffer ran dry: every stall counts, however short (no threshold)
    audio_s: float
    # audio played when the buffer first ran dry (None: never): a new stream's first chunks, or one well under way
    first_stall_at_s: float | None = None


def simulate(arrivals: list[tuple[float, int]], sample_rate: int = SAMPLE_RATE, buffer_ms: float = 0.0) -> Playback:
    """Plays `(arrival_time_s, samples)` chunks in order; starts at the first chunk, or once `buffer_ms`
    of audio has arrived (or the stream has ended with less)."""
    if buffer_ms < 0:
        raise ValueError(f"buffer_ms must be >= 0, got {buffer_ms}")
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be > 0, got {sample_rate}")
    chunks = [(t, n) for t, n in arrivals if n > 0]
    if not chunks:
        raise ValueError("no audio arrived; validation should have failed this stream")
    if any(b[0] < a[0] for a, b in zip(chunks, chunks[1:])):
        raise ValueError("chunk arrival times must not decrease")
    need = buffer_ms / 1000 * sample_rate
    buffered = 0
    first = len(chunks) - 1
    for i, (_, n) in enumerate(chunks):
        buffered += n
        if buffered >= need:
            first = i
            break
    start = chunks[first][0]
    runout = start + buffered / sample_rate
    starvation = longest = 0.0
    underruns = 0
    first_stall = None
    for t, n in chunks[first + 1:]:
        if t > runout:
            if first_stall is None:
                first_stall = runout - start  # nothing stalled before: all of it played
            stall = t - runout
            starvation += stall
            longest = max(longest, stall)
            underruns += 1
            runout = t
        runout += n / sample_rate
    total = sum(n for _, n in chunks) / sample_rate
    return Playback(start, starvation, longest, underruns, total, first_stall)
