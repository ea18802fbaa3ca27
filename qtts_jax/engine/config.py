"""The engine's fixed shape: slots, context, prompt buckets, the ladders every program is compiled for, and the
playback policy (the lead to build, the least margin to keep)."""

from __future__ import annotations

import bisect
import dataclasses

from qtts_jax.engine.stream import DEFAULT_SCHEDULE


def geometric(low: int, high: int, factor: int = 4) -> tuple[int, ...]:
    """low, factor·low, factor²·low ... below high, then high itself."""
    sizes, n = [], max(1, low)
    while n < high:
        sizes.append(n)
        n *= factor
    return (*sizes, high)


def rung(sizes: tuple[int, ...], n: int) -> int:
    """The smallest size in the ascending ladder `sizes` that holds n."""
    return sizes[min(bisect.bisect_left(sizes, n), len(sizes) - 1)]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    slots: int = 8
    context: int = 1024  # KV-cache rows per slot: prompt bucket + frames
    # Prompt lengths compiled for. No 32: a short prompt padded to 64 costs a prefill the same launches, and each
    # bucket is a prefill program per ladder size at start-up (`Settings.engine_config` keeps 32 for tiny contexts).
    prompt_buckets: tuple[int, ...] = (64, 128, 256)
    max_trailing: int = 256  # text tokens fed one per frame (streaming-text layout)
    frames_per_step: int = 4  # the most frames one step call runs (playback headroom permitting)
    schedule: tuple[int, ...] = DEFAULT_SCHEDULE  # frames per audio chunk once a stream has its lead: 1, 2, 4, 8 ...
    frames_per_text_token: int = 8  # runaway guard: cap = base + this x text tokens
    frames_cap_base: int = 24
    # "pallas" (the kernel, several times faster than the reference on a GPU: docs/benchmarks.md), "jnp" (the
    # reference), or "auto": the kernel on GPU, the reference elsewhere (no Triton on CPU).
    sampler: str = "auto"
    # How the talker reads each row's keys and values: "pallas" (a kernel that reads a row's slot where it lies and
    # only the rows it has written), "jnp" (the reference: the whole slot gathered, then masked), or "auto": the
    # kernel on GPU, the reference elsewhere.
    attention: str = "auto"
    # How a frame runs the talker's and the code predictor's layers: "pallas" (four fused kernels a layer, which
    # also write and read the cache, so `attention` goes unused), "jnp" (XLA's fusions of the model's code), or
    # "auto": XLA's, whose cuBLAS products are faster than the kernels' Triton ones (docs/benchmarks.md).
    layers: str = "auto"
    # Benchmarks on random weights, which rarely emit end-of-speech: each stream ends at a frame drawn from its seed
    # inside the step program (`generate.frame_code0`), which the scheduler cannot foresee, as real speech ends.
    seeded_ends: bool = False
    cached_voices: int = 64  # ICL voices whose primed codec state stays on the device (LRU)
    # Live-batch ladder of the step and the codec: `min_batch` times powers of 4 up to `slots`, or explicit
    # sizes. Each rung compiles the step and the codec at every size (minutes at 256 rows on a GPU), and
    # a call's cost grows slowly with its rows (below 16 it is launch overhead), so rungs are far apart.
    batch_sizes: tuple[int, ...] | None = None
    min_batch: int = 16
    # Requests per prefill call; a prefill ladder of powers of 8 up to this. Wider calls served a closed burst
    # better on the simulated device but worse on the GPU (docs/benchmarks.md).
    max_prefill: int = 32
    # Newcomers whose first frame one iteration runs: its programs exist for the rungs up to this only (each
    # holds a step and a codec; the large rungs cost a cold start half a minute each and serve only bursts,
    # whose later arrivals then start one iteration later). Poisson arrivals up to capacity never bring more than
    # 64 at once, but a closed loop as wide as the slots does: 128 starts such a burst in two iterations instead of
    # four, for one program more (docs/benchmarks.md).
    max_first: int = 128
    # The longest a step may run: a request arriving during it waits that long before its own prefill, and then
    # for its own path (the codec call queued behind the step, its prefill, its first frame and audio). 60 ms keeps
    # first audio within the field's 100 ms at the 95th percentile at no cost in throughput (docs/benchmarks.md).
    max_step_s: float = 0.06
    # Playback policy. Every stream builds a lead of `lead_s` of audio from spare compute, each frame going
    # out as soon as it exists until then; beyond it chunks follow `schedule`. The margin kept in hand beyond
    # an iteration's predicted cost is the jitter measured between prediction, engine and listener (see
    # `scheduler.Jitter`), never less than `min_margin_s`.
    lead_s: float = 1.0
    min_margin_s: float = 0.01
    # The streaming codec's arithmetic: "float32" (the reference's), or "bfloat16", which puts its convolutions on
    # tensor cores in the channels-last layout cuDNN runs natively; in fp32 XLA hands cuDNN channels-first tensors
    # and cuDNN converts them back, a fifth of a codec call's time (docs/benchmarks.md).
    codec_dtype: str = "float32"
    # Processes that compile the programs a background warm-up has still to make (`compile_workers`), each tracing
    # and compiling its share on its own interpreter and XLA client: None, as many as the machine's cores allow on
    # a GPU and none elsewhere (a CPU's programs compile in seconds); 0, none.
    compile_workers: int | None = None

    def __post_init__(self):
        for name in ("max_prefill", "max_first"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be at least 1")

    @property
    def codec_sizes(self) -> tuple[int, ...]:
        """Chunk sizes the codec is compiled for: the schedule's, plus powers of two to flush tails."""
        top = max(self.schedule)
        return tuple(sorted(set(self.schedule) | {1 << i for i in range(top.bit_length()) if 1 << i <= top}))

    @property
    def ladder(self) -> tuple[int, ...]:
        if self.batch_sizes is not None:
            return tuple(sorted(set(self.batch_sizes) | {self.slots}))
        sizes = set(geometric(min(self.min_batch, self.slots), self.slots))
        if self.slots // 2 > self.min_batch:  # where calls are large, a rung halfway saves the most
            sizes.add(self.slots // 2)
        return tuple(sorted(sizes))

    @property
    def first_sizes(self) -> tuple[int, ...]:
        """Rungs of the newcomers' first-frame program: the ladder's up to `max_first` (at least its smallest)."""
        ladder = self.ladder
        return tuple(n for n in ladder if n <= max(self.max_first, ladder[0]))

    @property
    def prefill_sizes(self) -> tuple[int, ...]:
        """1, 8, ... up to `max_prefill`: a few newcomers an iteration under steady arrivals, the largest for
        bursts; a prefill of 8 rows costs about what one of 4 does (launch-bound), and each size is a program
        per prompt bucket to compile at start-up."""
        return geometric(1, min(self.max_prefill, self.slots), factor=8)

    @property
    def step_sizes(self) -> tuple[int, ...]:
        """Frames a step call may run: powers of two up to `frames_per_step`, and it. A two-frame step is what
        lets a loaded engine build a lead while newcomers, with one frame of audio each, join every iteration.
        Each is a program of its own: as a loop bound of one program the count makes a GPU loop that reads its
        condition on the host every trip, so the call returns only once the device is done and no host work
        overlaps the step."""
        top = max(1, self.frames_per_step)
        return tuple(sorted({1 << i for i in range(top.bit_length()) if 1 << i <= top} | {top}))
