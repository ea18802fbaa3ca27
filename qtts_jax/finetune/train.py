"""The training loop: seeded batches, jitted steps, checkpoints and resume, the loss curve.

A step is one batch; with ``accumulate`` k the weights change every k steps (their mean gradient). The order of
the examples is a seeded permutation per epoch, so a run resumed from its checkpoint at step s sees exactly the
batches an uninterrupted run sees after step s, and reaches the same losses. Parameters and optimiser state stay
in fp32; ``compute_dtype`` bfloat16 runs the forward and backward in bf16 (the official recipe's mixed precision).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qtts_jax import nn
from qtts_jax.config import ModelConfig
from qtts_jax.finetune import forward, layout, lora, optimizer
from qtts_jax.finetune.checkpoints import Checkpoints
from qtts_jax.finetune.data import Example
from qtts_jax.talker import Talker
from qtts_jax.io.text import TextTokenizer


@dataclasses.dataclass(frozen=True)
class Settings:
    lr: float = 2e-5  # the official script's default (its README fine-tunes at 2e-6 with batch 32)
    batch: int = 2
    accumulate: int = 4
    epochs: int = 3
    steps: int | None = None  # overrides epochs
    seed: int = 0
    checkpoint_every: int = 100
    keep: int = 3
    compute_dtype: str = "float32"
    lora: int = 0  # rank of low-rank adapters on the projections (0: every weight trains)
    # examples per forward and backward pass (None: the whole batch): a step runs the batch in micro-batches and
    # adds their gradients, which equal the whole batch's, in a fraction of the activations' memory
    micro_batch: int | None = None
    # frames per code-predictor pass, recomputed in the backward pass instead of kept (None: every frame of the
    # micro-batch in one pass): the predictor's activations over a batch's frames are most of a step's memory
    predictor_chunk: int | None = None

    def __post_init__(self):
        micro_batches(self.batch, self.micro_batch)
        if self.predictor_chunk is not None and self.predictor_chunk < 1:
            raise ValueError(f"predictor_chunk {self.predictor_chunk} must be at least 1")

    def total_steps(self, n_examples: int) -> int:
        return self.steps if self.steps is not None else self.epochs * batches_per_epoch(n_examples, self.batch)


def micro_batches(batch: int, micro_batch: int | None) -> int:
    """How many micro-batches a step of ``batch`` examples runs (ValueError unless ``micro_batch`` divides it)."""
    if micro_batch is None:
        return 1
    if not (0 < micro_batch <= batch and batch % micro_batch == 0):
        raise ValueError(f"micro_batch {micro_batch} must divide batch {batch}")
    return batch // micro_batch


def batches_per_epoch(n_examples: int, batch: int) -> int:
    return math.ceil(n_examples / batch)


def batch_indices(n_examples: int, batch: int, seed: int, step: int) -> np.ndarray:
    """The examples of (0-based) ``step``: epoch e's seeded permutation, cut into batches (the last one short)."""
    per_epoch = batches_per_epoch(n_examples, batch)
    epoch, i = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n_examples)
    return order[i * batch:(i + 1) * batch]


def emits(step: int, accumulate: int) -> bool:
    """Whether (0-based) ``step`` is the one of its ``accumulate`` that updates the weights (the last)."""
    return (step + 1) % accumulate == 0


class ResumeError(ValueError):
    """A checkpoint made by a run whose settings or data differ: resuming it would not continue that run."""


def _identity(settings: Settings, n_examples: int) -> dict:
    """What a resumed run must share with the run that saved the checkpoint (its length may change)."""
    fixed = dataclasses.asdict(settings)
    for free in ("steps", "epochs", "checkpoint_every", "keep", "micro_batch", "predictor_chunk"):
        fixed.pop(free)
    return {**fixed, "examples": n_examples}


@dataclasses.dataclass
class Run:
    talker: Talker  # the trained talker (fp32), LoRA adapters merged
    curve: list[dict]  # one {"step", "loss", "talker", "predictor"} per step, from step 1
    resumed_from: int | None


def train(talker: Talker, cfg: ModelConfig, tok: TextTokenizer, examples: list[Example], settings: Settings,
          checkpoint_dir: Path, resume: bool = False, on_step: Callable[[int, int, dict], None] = lambda *a: None,
          release: bool = False, on_resume: Callable[[int], None] = lambda step: None) -> Run:
    """Train a copy of ``talker`` (its `nnx.Param` state, in fp32; the module itself is left alone) on
    ``examples``; ``on_resume(step)`` once a checkpoint is restored, before any step (so its message comes before a
progress bar); ``on_step(step, total, losses)`` after every step. With ``settings.lora``, only adapters train
    (the state and the checkpoints hold them alone) and the returned talker has them merged.

    ``release``: hand ``talker``'s weights over to the training state instead (donated: the module's arrays are
    deleted), so that a process that trains once keeps one copy of the weights on the device, not two (7.6 GB at
    the 1.7B shape in fp32)."""
    # Exhaustive: the talker holds nothing but Params, so this state is all there is to train and to merge back.
    graph, params = nnx.split(talker, nnx.Param)
    init, step_fn, result = programs(graph, cfg, settings.lr, settings.accumulate, settings.compute_dtype,
                                     settings.lora, micro_batches(settings.batch, settings.micro_batch), release,
                                     settings.predictor_chunk)
    state, frozen = init(nnx.to_pure_dict(params))
    ckpt = Checkpoints(checkpoint_dir, settings.checkpoint_every, settings.keep)
    total = settings.total_steps(len(examples))
    done, curve, resumed = 0, [], None
    identity = _identity(settings, len(examples))
    if resume and ckpt.latest() is not None:
        resumed = ckpt.latest()
        saved = ckpt.restore_meta(resumed)
        changed = sorted(k for k in identity if saved["run"].get(k) != identity[k])
        if changed:
            ckpt.close()
            raise ResumeError("--resume: the checkpoint's run had other " + ", ".join(
                f"{k} ({saved['run'].get(k)!r}, now {identity[k]!r})" for k in changed))
        state, meta = ckpt.restore(resumed, state)
        done, curve = resumed, meta["curve"]
        on_resume(resumed)
    try:
        for step in range(done, total):
            idx = batch_indices(len(examples), settings.batch, settings.seed, step)
            batch = layout.collate(cfg, tok, [examples[i] for i in idx], settings.batch)
            state, parts = step_fn(state, frozen, batch.arrays(), emit=emits(step, settings.accumulate))
            record = {"step": step + 1, **{k: float(v) for k, v in parts.items()}}
            curve.append(record)
            ckpt.save(step + 1, state, {"curve": curve, "run": identity}, last=step + 1 == total)
            on_step(step + 1, total, record)
    finally:
        ckpt.close()
    return Run(nn.merge(graph, result(frozen, state["params"])), curve, resumed)


@functools.lru_cache(maxsize=8)
def programs(graph: nnx.GraphDef, cfg: ModelConfig, lr: float, accumulate: int, compute_dtype: str,
             lora_rank: int = 0, micro: int = 1, donate_params: bool = False,
             predictor_chunk: int | None = None):
    """(init, step, result), jitted and kept per talker graph and configuration: runs of the same settings in one
    process compile them once. init(params) -> (state, frozen): the trained part and its optimiser state (the steps
    donate it), and what stays fixed (LoRA: the base weights; else nothing), copied to fp32 in one program (an eager
    op per leaf would compile one per shape); ``params`` is the talker's Param state as a plain dict (`init` of
    optax and the checkpoints take it as it is; ``donate_params``: init consumes it). step(state, frozen, batch,
    emit), its batch run as ``micro`` equal micro-batches, one after the other, the code predictor over
    ``predictor_chunk`` frames at a time (`forward.losses`), the weights moved only where ``emit`` (a `Step`: two
    programs; always, without accumulation); result(frozen, trained) -> the full Param state."""
    tx = optimizer.make(lr)
    combine = lora.merge if lora_rank else (lambda frozen, trained: trained)

    def init(params):
        params = jax.tree.map(lambda a: a.astype(jnp.float32), params)
        trained, frozen = (lora.init(params, lora_rank), params) if lora_rank else (params, None)
        return {"params": trained, "opt": optimizer.init(tx, trained, accumulate)}, frozen

    def gradients(trained, frozen, batch, total=None):
        """(``total`` plus this batch's gradients, or them alone; the losses). Micro-batches add theirs straight into
        ``total``: a separate sum begun at zero would be one more fp32 copy of the weights (7.7 GB at 1.7B)."""
        counts = forward.target_counts(cfg, batch)

        def loss(trained, part):
            return forward.losses(combine(frozen, trained), graph, cfg, part, jnp.dtype(compute_dtype), counts,
                                  predictor_chunk)

        grad = jax.value_and_grad(loss, has_aux=True)
        if micro == 1:
            (total_loss, parts), grads = grad(trained, batch)
            return (grads if total is None else optimizer.add(total, grads)), {"loss": total_loss, **parts}

        # each micro-batch's loss is its share of the batch's (the batch's target counts divide it)
        def plus(acc, part):
            return jax.tree.map(jnp.add, acc, grad(trained, part)), None

        parts_of = jax.tree.map(lambda a: a.reshape(micro, a.shape[0] // micro, *a.shape[1:]), batch)
        losses, grads = jax.eval_shape(grad, trained, jax.tree.map(lambda a: a[0], parts_of))
        zeros = functools.partial(jax.tree.map, lambda a: jnp.zeros(a.shape, a.dtype))
        start = (zeros(losses), zeros(grads) if total is None else total)
        ((total_loss, parts), grads), _ = jax.lax.scan(plus, start, parts_of)
        return grads, {"loss": total_loss, **parts}

    def update(state, frozen, batch):
        total, parts = gradients(state["params"], frozen, batch, state["opt"].get("acc"))
        params, opt = optimizer.update(tx, total, state["opt"], state["params"], accumulate)
        return {"params": params, "opt": opt}, parts

    def add(trained, total, frozen, batch):
        return gradients(trained, frozen, batch, total)

    init = jax.jit(init, donate_argnums=(0,) if donate_params else ())
    step = Step(jax.jit(update, donate_argnums=0), jax.jit(add, donate_argnums=1) if accumulate > 1 else None)
    return init, step, jax.jit(combine)


@dataclasses.dataclass(frozen=True)
class Step:
    """One training step, as two programs: ``update`` (state, frozen, batch) -> (state, losses), which moves the
    weights (on the mean of the gradients summed so far, accumulating), and ``add`` (trained, sum, frozen, batch)
    -> (sum, losses), which only adds this batch's gradients to the sum (None without accumulation). ``add`` takes
    the weights without donating them and leaves the optimiser's state out, so nothing but the sum is read or
    written beside the forward and backward pass: a program that returned the weights and moments unchanged would
    copy them."""

    update: Callable
    add: Callable | None

    def __call__(self, state: dict, frozen, batch, emit: bool) -> tuple[dict, dict]:
        """The step whose place in its accumulation ``emit`` tells (`emits`)."""
        if emit or self.add is None:
            return self.update(state, frozen, batch)
        total, parts = self.add(state["params"], state["opt"]["acc"], frozen, batch)
        return {"params": state["params"], "opt": {**state["opt"], "acc": total}}, parts


def write_curve(curve: list[dict], directory: Path) -> list[Path]:
    """loss.json always; loss.png too when matplotlib is installed (the study extra). Written, then renamed."""
    directory = Path(directory)
    written = [directory / "loss.json"]
    tmp = directory / f"loss.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(curve, indent=1))
    os.replace(tmp, written[0])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in curve]
    for key in ("loss", "talker", "predictor"):
        ax.plot(steps, [r[key] for r in curve], label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.legend()
    fig.tight_layout()
    png = directory / "loss.png"
    tmp = directory / f"loss.tmp{os.getpid()}.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, png)
    return written + [png]
