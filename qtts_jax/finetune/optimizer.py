"""The optimiser: gradients clipped to global norm 1.0, then AdamW (weight decay 0.01), with the gradients of
``accumulate`` batches added up and one update on their mean every ``accumulate`` calls.

The official recipe's settings (torch AdamW's betas and eps; accelerate's clipping of the accumulated gradient).
Its state follows the parameters' dtype, which the trainer keeps in fp32 whatever the compute dtype.

Which step updates is the caller's to say (the trainer knows it from the step's index): the others call `add`, so a
program that only accumulates reads and writes the gradient sum and nothing else. `optax.MultiSteps` decides inside
the program instead: every call runs the clipping and AdamW over every weight and its moments and keeps one result
in k, several times the gradient sum's memory traffic, three calls in four for nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

WEIGHT_DECAY = 0.01
CLIP_NORM = 1.0


def make(lr: float, weight_decay: float = WEIGHT_DECAY, clip_norm: float = CLIP_NORM, b1: float = 0.9,
         b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    """The update of one (mean) gradient: clipping, then AdamW."""
    return optax.chain(optax.clip_by_global_norm(clip_norm),
                       optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))


def init(tx: optax.GradientTransformation, params, accumulate: int = 1) -> dict:
    """The optimiser's state: the chain's ("chain") and, accumulating, the sum of the gradients so far ("acc")."""
    state = {"chain": tx.init(params)}
    if accumulate > 1:
        state["acc"] = jax.tree.map(jnp.zeros_like, params)
    return state


def add(total, grads):
    """The gradient sum with one more batch's gradients: all that a step which does not update computes."""
    return jax.tree.map(jnp.add, total, grads)


def update(tx: optax.GradientTransformation, total, state: dict, params, accumulate: int = 1):
    """(params, state) after the update that ends an accumulation: ``tx`` on the mean of ``total``, the sum of the
    accumulation's gradients with this batch's (`add` to ``state["acc"]``; without accumulation, this batch's
    gradients), the weights moved, and a new sum begun."""
    grads = jax.tree.map(lambda a: a / accumulate, total) if accumulate > 1 else total
    updates, chain = tx.update(grads, state["chain"], params)
    new = {"chain": chain}
    if accumulate > 1:
        new["acc"] = jax.tree.map(jnp.zeros_like, grads)
    return optax.apply_updates(params, updates), new
