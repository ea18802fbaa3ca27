"""The loop's decisions, as pure functions of numbers the loop already has: how many frames the playing streams
step, which streams' chunks are due and how many frames each, and the margin that covers measured jitter.

Nothing here touches a device or a stream object, so each rule is tested on arrays alone (tests/test_scheduler.py).
The rules serve one contract: a stream, once its first audio is out, never runs dry at a listener who plays from
the first byte. A stream's *headroom* is the audio it has handed out minus what such a listener has played.

- **Lead.** Until a stream's headroom reaches `lead_s`, every frame it has goes to the codec in the iteration that
  made it (a lead builds at the rate the engine outpaces playback); past the lead, chunks follow the stream's
  schedule (fewer, larger codec calls).
- **Step size.** The most frames whose predicted iteration, and the wait until its audio is handed out, leave
  every stream's headroom above the margin, where newcomers, joining the step right after their one-frame first
  chunk, must get their next audio before that frame has played; and no longer than `max_step_s` (a request
  arriving meanwhile waits for it) unless only a longer step keeps up with playback.
- **Newcomers.** An iteration starts only as many waiting requests as the playing streams' headroom pays for:
  their prefill and first frame run before the playing streams' next frame, so a burst of arrivals waits an
  iteration or two rather than making a playing stream run dry.
- **Prefill calls.** Waiting newcomers are prefilled in the calls whose measured costs sum least
  (`costs.prefill_calls`, which the cost of a prefill is also counted by).
- **Margin.** The late side of what was measured: iterations that ran longer than predicted, audio handed out
  later than usual after them, and chunks their listeners' coroutines took later than the engine handed them out.
  Not a constant guessed here.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable

import numpy as np

from qtts_jax.engine.costs import newcomer_budget
from qtts_jax.engine.stream import FRAME_SECONDS


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One iteration's step: `frames` for the playing rows, and the iteration's predicted duration."""

    frames: int
    predicted_s: float


def step_frames(costs: dict[int, float], headroom: np.ndarray, newcomer_audio_s: float | None, extra_s: float,
                margin_s: float, max_step_s: float, delivery_s: dict[int, float] | None = None,
                first_late_s: float = 0.0) -> StepPlan:
    """Frames to step, from `costs` (frames -> seconds of a step iteration at this batch, the codec included):

    - `headroom` [N]: seconds of audio each playing stream with audio has in hand now;
    - `newcomer_audio_s`: the audio newcomers get from their first-frame program this iteration (None: none do);
      their next audio comes with this step's, so the step must not outlast it;
    - `extra_s`: the newcomers' prefill and first-frame programs, which run before the step;
    - `delivery_s`: per step size, from the end of the iteration to its audio being handed out (its codec call,
      as wide as the step, and the next iteration's admission and dispatch come first), measured: the audio of
      this step reaches its streams that much after it (0 where not given);
    - `first_late_s`: how much later than `extra_s` after the iteration's start the newcomers' first audio goes
      out, measured (it waits on the device behind the previous iteration's codec call, which `costs` count):
      their listener starts that much later, so their next audio may come that much later too.
    """
    delivery_s = delivery_s or {}
    budget = math.inf
    if len(headroom):
        budget = float(np.min(headroom)) - margin_s - extra_s
    if newcomer_audio_s is not None:
        budget = min(budget, newcomer_budget(newcomer_audio_s, first_late_s, margin_s))
    sizes = sorted(costs)
    fits = [n for n in sizes if costs[n] + delivery_s.get(n, 0.0) <= budget]
    brief = [n for n in fits if costs[n] <= max_step_s and costs[n] + extra_s <= n * FRAME_SECONDS]
    n = max(brief or fits, default=sizes[0])
    return StepPlan(n, extra_s + costs[n])


def first_chunk_alone(next_audio_s: float, first_late_s: float, margin_s: float) -> bool:
    """Whether newcomers' one-frame first chunks go out on their own, ahead of the step: only when their next audio,
    `next_audio_s` after their own programs (the shortest step and its delivery, measured), reaches them before that
    frame has played, with the margin to spare. Otherwise the first frame is decoded with the step's frames and goes
    out with them: a longer first chunk, first audio one step later, and no listener that runs dry after 80 ms
    because the engine is loaded or the measured lateness (a burst of arrivals, a busy event loop) exceeds one frame
    of audio."""
    return next_audio_s <= newcomer_budget(FRAME_SECONDS, first_late_s, margin_s)


def newcomers_that_fit(waiting: int, min_headroom_s: float | None, margin_s: float,
                       iteration_s: Callable[[int], float]) -> int:
    """How many of `waiting` requests (free slots permitting) this iteration starts: the most m for which
    `iteration_s(m)`, the seconds until the playing streams' next audio when m newcomers are prefilled and take
    their first frame ahead of the step (which they then join), stays within the least headroom of the streams
    with audio out, `min_headroom_s`, less the margin. All of them when no stream has audio out (nobody can run
    dry); none when even m = 1 does not fit: they wait while the playing streams step on and gain headroom.
    `iteration_s` grows with m (costs by ladder rung), so the answer is found by bisection."""
    if waiting <= 0 or min_headroom_s is None:
        return max(waiting, 0)
    budget = min_headroom_s - margin_s
    lo, hi = 0, waiting
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if iteration_s(mid) <= budget else (lo, mid - 1)
    return lo


def chunks_due(pending: np.ndarray, want: np.ndarray, lm_done: np.ndarray, headroom: np.ndarray, lead_s: float,
               horizon_s: float, most: int, width: int | None = None) -> np.ndarray:
    """Frames each stream hands to this iteration's codec call (0: none), per stream:

    `pending` frames made but not yet decoded, `want` its schedule's next chunk size, `lm_done` no more frames
    will come, `headroom` its audio in hand (NaN before its first chunk: then only the schedule decides, which
    is what fixes its first-audio latency). A stream below its lead, or whose headroom would not outlast
    `horizon_s` (the next iteration and the margin), sends everything it has, up to `most` (the codec's largest
    chunk); past its lead it waits for its schedule's size, or sends the rest once its LM is done.

    `width`: the codec chunk the step planner counted on (its step's frames). The call runs as long as its widest
    row, and the streams below their lead (newcomers among them) wait for their next audio in it: while any of
    them has a chunk due, no stream with audio out sends more than `width` frames (one far-ahead stream's
    eight-frame chunk would make the call several times as long and their audio late). Otherwise the schedule
    decides, and a stream's first chunk is always its schedule's (its client chose that first-audio latency).
    """
    pending = np.asarray(pending, np.int64)
    headroom = np.asarray(headroom, float)
    started = ~np.isnan(headroom)
    with np.errstate(invalid="ignore"):
        short = headroom < max(lead_s, horizon_s)  # NaN compares False: no audio yet
    limit = np.full(len(pending), most)
    if width is not None and np.any(short & (pending > 0)):
        limit[started] = min(most, width)
        want = np.where(started, np.minimum(want, limit), want)
    full = pending >= want
    due = (pending > 0) & (lm_done | full | short)
    return np.where(due, np.where(full & ~short & ~lm_done, want, np.minimum(pending, limit)), 0)


# The share of the measured lateness the margin covers: the rare late sample beyond it costs one late chunk, a
# margin over every sample shortens every step while newcomers join (docs/benchmarks-history.md, the margin quantile).
MARGIN_QUANTILE = 0.99


class Jitter:
    """How late things ran beyond what the loop planned, over a recent window: each sample is seconds late
    (an iteration longer than predicted; its audio handed out later than usual; a batch of chunks taken by its
    listeners after the engine handed it out). The margin is a high quantile of them, so it covers what this
    machine and this load really do.

    `add` is safe from any thread (a deque append); `margin` is read on the engine thread."""

    def __init__(self, floor_s: float, window: int = 512, quantile: float = MARGIN_QUANTILE):
        self.floor_s, self.quantile = floor_s, quantile
        self._samples: collections.deque[float] = collections.deque(maxlen=window)

    def add(self, late_s: float) -> None:
        self._samples.append(max(float(late_s), 0.0))

    def margin(self) -> float:
        if not self._samples:
            return self.floor_s
        return max(self.floor_s, float(np.quantile(np.fromiter(self._samples, float), self.quantile)))
