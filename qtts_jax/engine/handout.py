"""Audio hand-out: what the engine's sender thread does while the engine thread admits and dispatches.

Each function here waits for a device output and hands chunks to their streams (`Stream.emit`), touching nothing
else of them: the engine thread does the streams' bookkeeping once it has the function's result. `clock` is the
engine's (tests simulate it)."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from qtts_jax.codec.config import SAMPLES_PER_FRAME
from qtts_jax.engine.runner import FirstOutcome
from qtts_jax.engine.stream import FRAME_SECONDS, Chunk, Stream


@dataclasses.dataclass
class HandOut:
    """A codec call in flight: its audio, the streams it is for with their frames (each row's), and its (rows,
    frames) rungs. The sender thread hands its chunks out at the next iteration's start."""

    audio: jax.Array
    due: list[tuple[Stream, int]]
    shape: tuple[int, int]


def send_audio(clock, audio, due: list[tuple[Stream, int]]) -> tuple[list, float, int]:
    """Wait for a codec call's audio and hand its chunks to their streams. Returns the streams it was for, when
    their chunks went out, and how many went out after their listener ran dry."""
    audio = np.asarray(audio)
    now = clock()
    late = 0
    for j, (s, f) in enumerate(due):
        if s.finished or not f:  # cancelled while its audio was in the codec; or its frames were never made
            continue
        h = s.buffered(now)
        late += h is not None and h - f * FRAME_SECONDS < 0  # its listener ran dry first
        s.emit(Chunk(pcm=audio[j, : f * SAMPLES_PER_FRAME], first_frame=s.decoded - f, frames=f, sent_at=now,
                     due=-math.inf if h is None else now + h - f * FRAME_SECONDS))
    return due, now, late


def send_first(clock, new: list[Stream], out: FirstOutcome, decode: np.ndarray):
    """Wait for the newcomers' first program and hand out the audio of those that decoded their frame in it.
    Returns its frames and valid flags (read), when it was read, and which newcomers' chunks went out."""
    frames, valid, audio = (np.asarray(x) for x in out)
    now = clock()
    for j in np.flatnonzero(valid[0, : len(new)]):  # the engine's record keeps this time: before the chunk leaves
        new[j].timings.first_frame = now
    sent = np.asarray(decode, bool) & valid[0, : len(new)] & np.array([not s.finished for s in new], bool)
    for j in np.flatnonzero(sent):
        new[j].emit(Chunk(pcm=audio[j, :SAMPLES_PER_FRAME], first_frame=0, frames=1, sent_at=now))
    return frames, valid, now, sent


def stamp_prefilled(clock, joined: list[Stream], prefill_done) -> None:
    """When the newcomers' prefill is done on the device (their first chunk comes after)."""
    np.asarray(prefill_done)
    now = clock()
    for s in joined:
        s.timings.prefilled = now
