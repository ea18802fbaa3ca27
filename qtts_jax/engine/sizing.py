"""How many engine slots fit in the accelerator's free memory, computed from the engine's own state shapes.

Bytes per slot = state + workspace:

- **state** is exact: `jax.eval_shape` of `programs.init_state` (talker KV cache, sampling settings,
  trailing text vectors, ...) at two slot counts, differenced, plus the streaming codec decoder's state of
  one slot (`codec.streaming.init_state`). Nothing is allocated to find it.
- **workspace** is an estimate of the activations that grow with the batch, from the config's shapes:
  the largest per-slot activation of the two widest programs, each kept ``LIVE_BUFFERS`` times (a conv or
  matmul's input and output, a residual branch and one fusion temporary are live together):
  the codec decoding the schedule's largest chunk (float32 at the vocoder stage that is longest x widest;
  5.9 MB per slot for the released codec at 8 frames), and one prompt prefilled at the largest bucket
  (float32, the SwiGLU gate+up or the attention scores, whichever is wider; 6.3 MB for 0.6B at 256).
  A frame step's own activations (one token per slot) are far below both.

What does not grow with the batch (compiled programs, XLA/cuDNN scratch, allocator fragmentation, the
voice encoders of a Base model) is covered by keeping ``RESERVE_FRACTION`` of the free memory back, plus
the codec state of the engine's cache of primed ICL voices for a Base model.

Free memory is ``bytes_limit - bytes_in_use`` from the device's allocator, read after the weights are
loaded. A CPU has no allocator statistics: there the host's available RAM bounds the count, and
``--slots auto`` picks ``CPU_SLOTS``, since a CPU runs out of compute long before memory.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from qtts_jax.codec import streaming as codec_streaming
from qtts_jax.engine.config import EngineConfig
from qtts_jax.engine.programs import init_state
from qtts_jax.model import Model

LIVE_BUFFERS = 4
RESERVE_FRACTION = 0.10
CPU_SLOTS = 8


class SlotsDoNotFit(ValueError):
    """More slots were asked for than the free memory holds (raised before anything is allocated)."""


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    """The arithmetic behind a slot count, kept so the refusal and the start-up log can show it."""

    fit: int  # slots that fit
    state_bytes: int  # per slot, exact
    workspace_bytes: int  # per slot, estimated
    fixed_bytes: int  # reserve + primed-voice cache, independent of the slot count
    free_bytes: int
    source: str  # where free_bytes was read

    @property
    def slot_bytes(self) -> int:
        return self.state_bytes + self.workspace_bytes

    def describe(self) -> str:
        return (f"{self.fit} slots fit in {_gib(self.free_bytes)} {self.source} at {_mib(self.slot_bytes)} per slot "
                f"({_mib(self.state_bytes)} state + {_mib(self.workspace_bytes)} workspace), "
                f"{_gib(self.fixed_bytes)} kept back")


def plan(model: Model, config: EngineConfig, device: jax.Device | None = None) -> SlotPlan:
    """Per-slot bytes for `config` (its slot count is ignored) and how many slots `device`'s free memory holds."""
    state = _nbytes(_state_shapes(model, config, 2)) - _nbytes(_state_shapes(model, config, 1))
    codec_slot = _nbytes(jax.eval_shape(lambda: codec_streaming.init_state(model.codec_cfg, 1)))
    state += codec_slot
    workspace = LIVE_BUFFERS * (_codec_activation_bytes(model, max(config.schedule))
                                + _prefill_activation_bytes(model, max(config.prompt_buckets)))
    free, source = available_bytes(device or jax.devices()[0])
    voices = config.cached_voices * codec_slot if model.voice_encoders is not None else 0
    fixed = int(RESERVE_FRACTION * free) + voices
    fit = max(0, (free - fixed) // (state + workspace))
    return SlotPlan(fit, state, workspace, fixed, free, source)


def resolve_slots(model: Model, config: EngineConfig, requested: int | str,
                  device: jax.Device | None = None) -> tuple[int, SlotPlan]:
    """`requested` slots ("auto": as many as fit; `CPU_SLOTS` on a CPU), or `SlotsDoNotFit` saying what fits."""
    device = device or jax.devices()[0]
    p = plan(model, config, device)
    if requested == "auto":
        slots = min(CPU_SLOTS, p.fit) if device.platform == "cpu" else p.fit
        if slots < 1:
            raise SlotsDoNotFit(f"not even one slot fits: {p.describe()}")
        return slots, p
    if requested > p.fit:
        raise SlotsDoNotFit(f"{requested} slots do not fit: {p.describe()}; ask for at most --slots {p.fit} "
                            f"(or --slots auto), or a shorter --context")
    return requested, p


def available_bytes(device: jax.Device) -> tuple[int, str]:
    """Free bytes of the device's allocator, or the host's available RAM where there is none (CPU)."""
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats["bytes_in_use"], f"free on {device.platform}:{device.id}"
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return kib * 1024, "of available host RAM"


def _state_shapes(model: Model, config: EngineConfig, slots: int):
    return jax.eval_shape(lambda: init_state(model.cfg, model.dtype, dataclasses.replace(config, slots=slots)))


def _nbytes(tree) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _codec_activation_bytes(model: Model, frames: int) -> int:
    """Largest float32 activation of one slot's codec decode of `frames`: upsampler, then each vocoder block
    (length x its rate, channels halved)."""
    d = model.codec_cfg.decoder
    length = frames * math.prod(d.upsampling_ratios)
    largest = length * max(d.latent_dim, d.decoder_dim)
    for b, rate in enumerate(d.upsample_rates):
        length *= rate
        largest = max(largest, length * (d.decoder_dim >> (b + 1)))
    return 4 * largest


def _prefill_activation_bytes(model: Model, tokens: int) -> int:
    """Largest float32 activation of one prompt's talker prefill: SwiGLU gate+up, or the attention scores."""
    t = model.cfg.talker
    return 4 * tokens * max(2 * t.intermediate_size, t.num_heads * tokens)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
