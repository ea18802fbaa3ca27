"""What the loop records of its streams from what the device gave back: frames made, first chunks counted as
decoded, codec counts corrected for frames never made.

Each function changes only the streams it is given; a stream with nothing left goes to `finish` (the loop's: it
frees the slot and sends the final chunk)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from qtts_jax.engine.handout import HandOut
from qtts_jax.engine.stream import Stream


def record(streams: list[Stream], frames: np.ndarray, valid: np.ndarray, now: float,
           finish: Callable[[Stream], None], limits: np.ndarray | None = None) -> None:
    """New frames [n, B, 16] (valid [n, B]) of `streams` (row j is streams[j], asked for `limits[j]` frames, all n
    by default; those already done with their LM are skipped): a stream whose frames stop early, or that reached
    its cap, is done with its LM (and finishes here if nothing of it is left to decode)."""
    n = frames.shape[0]
    for j, stream in enumerate(streams):
        if stream.lm_done:
            continue
        good = valid[:, j]
        count = int(good.sum()) if good.all() else int(np.argmin(good))
        if count:
            stream.codes.extend(frames[:count, j])
            stream.pending += count
            if stream.timings.first_frame is None:
                stream.timings.first_frame = now
        if count < (n if limits is None else limits[j]) or len(stream.codes) >= stream.frames_cap:
            stream.lm_done = True
            if stream.pending == 0 and stream.inflight == 0:  # ended with nothing left to decode
                finish(stream)


def take_first(new: list[Stream], frames: np.ndarray, valid: np.ndarray, now: float, sent: np.ndarray,
               finish: Callable[[Stream], None]) -> None:
    """Record newcomers' first frames, and count the first chunk `handout.send_first` handed out as decoded."""
    record(new, frames, valid, now, finish)
    for j in np.flatnonzero(sent):
        s = new[j]
        s.fresh_codec = False
        s.pending -= 1
        s.decoded += 1
        if s.lm_done and s.pending == 0:
            finish(s)


def settle_audio(handout: HandOut) -> None:
    """Once the step is read: a stream that made fewer frames than the codec call counted on (it ended) had only
    those decoded (the call reads which frames exist); its counts follow."""
    for j, (s, f) in enumerate(handout.due):
        if s.pending < 0:  # counted frames that were never made
            short, s.pending = -s.pending, 0
            s.decoded -= short
            s.inflight = f - short
            handout.due[j] = (s, f - short)
