"""What one iteration's execution gives back to the loop's bookkeeping.

The device half of an iteration is in flight when the loop gets these: outputs not yet read and the sender
thread's work not yet done. The loop reads them in `Engine._update`, in the order that keeps host work
overlapping the device's."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import numpy as np

from qtts_jax.engine.runner import StepOutcome
from qtts_jax.engine.stream import Stream


@dataclasses.dataclass(frozen=True)
class IterationResult:
    """An executed plan, in flight: the newcomers and the step's rows as streams (the plan names them by
    position), the step's outcome, and the sender thread's work started for this iteration (the previous codec
    call's hand-out, the newcomers' prefill stamp and their first chunks)."""

    new: list[Stream]
    stepping: list[Stream]
    limits: np.ndarray  # per step row: the most frames it may make
    step: StepOutcome | None
    handed: concurrent.futures.Future | None
    prefilled: concurrent.futures.Future | None
    first: concurrent.futures.Future | None
