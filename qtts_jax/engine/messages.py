"""What the host (the server's process) and the engine core say to each other, both ways, as message batches.

The core (the model on the device, the engine loop, voice priming and the voice encoders) may run in a process of
its own (`core_process`) or on a thread beside its host (`core_host.in_process`); both speak these types, so the
two modes differ only in whether a batch is pickled. Each direction sends lists of messages, never one message per
chunk: the host whatever its requests queued since its last send, the core whatever the engine handed out since its
last send (one codec call's audio, an iteration's), with the snapshot admission reads.

Streams are named by the host's ids (`Submit.id`): the core's snapshot names its streams by them too."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from qtts_jax.engine.config import EngineConfig
from qtts_jax.engine.job import Job
from qtts_jax.engine.stats import EngineStats

# ---- host -> core --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Submit:
    """A prepared job to queue (`Engine.submit`); `submitted` on the shared monotonic clock (`time.perf_counter`
    reads CLOCK_MONOTONIC, one clock for every process of the host)."""

    id: int
    job: Job
    ahead: bool
    submitted: float


@dataclasses.dataclass(frozen=True)
class AppendText:
    """Live text for a stream (`Engine.append_text`), already checked by the host against the trailing buffer."""

    id: int
    ids: tuple[int, ...]
    complete: bool


@dataclasses.dataclass(frozen=True)
class Cancel:
    id: int


@dataclasses.dataclass(frozen=True)
class DeliveryLag:
    """How late the host's listeners took a batch of chunks (`Engine.observe_delivery_lag`)."""

    seconds: float


@dataclasses.dataclass(frozen=True)
class Call:
    """Work the host waits for, answered by a `Reply` with the same `call`: `name` is one of `core_host.CALLS`
    (warm up and start the loop, prime an ICL voice's codec state, clone a voice, compile the voice encoders)."""

    call: int
    name: str
    args: tuple = ()


@dataclasses.dataclass(frozen=True)
class Stop:
    """Stop the loop and end the core (a process core exits)."""


# ---- core -> host --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hello:
    """The core's first message once its model is loaded: what the host needs for its text work and its answers
    (`host_model.HostModel`), the engine's config with its slots resolved, the device's backend. `error`: the core
    could not start (the slots do not fit, a missing checkpoint file): the host raises it."""

    model: Any = None  # host_model.HostModel
    config: EngineConfig | None = None
    backend: str = ""
    stats: EngineStats | None = None  # the engine's snapshot before any stream
    error: BaseException | None = None


class ChunkOut(NamedTuple):
    """One chunk of one stream, its PCM at `[start, start + samples)` of its batch's `pcm`, with the stream's
    timings as they are now (the host's handle mirrors them) and the frames it has made. A named tuple: a batch
    holds hundreds, and a tuple pickles in a fraction of a dataclass's time (bench/core_hop.py)."""

    id: int
    start: int
    samples: int
    first_frame: int
    frames: int
    sent_at: float
    final: bool
    error: str | None
    due: float
    made: int
    timings: tuple  # admitted, prefilled, first_frame, first_chunk, finished, compiled_before


@dataclasses.dataclass(frozen=True)
class Reply:
    call: int
    value: Any = None
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True)
class Batch:
    """What the core sends after each hand-out: its chunks (their PCM in one array, one buffer to copy), the
    engine's snapshot taken after them (named by the host's stream ids), the programs compiled on demand so far,
    and the answers to calls that finished."""

    chunks: tuple[ChunkOut, ...]
    pcm: np.ndarray
    stats: EngineStats
    compiled_on_demand: int
    replies: tuple[Reply, ...] = ()
