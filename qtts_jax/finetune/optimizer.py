"""The optimiser chain: gradients clipped to global norm 1.0, then AdamW (weight decay 0.01), accumulated over
``accumulate`` micro-batches (`optax.MultiSteps`: the mean gradient, one update every k calls).

The official recipe's settings (torch AdamW's betas and eps; accelerate's clipping of the accumulated gradient).
Its state follows the parameters' dtype, which the trainer keeps in fp32 whatever the compute dtype.
"""

from __future__ import annotations

import optax

WEIGHT_DECAY = 0.01
CLIP_NORM = 1.0


def make(lr: float, accumulate: int = 1, weight_decay: float = WEIGHT_DECAY, clip_norm: float = CLIP_NORM,
         b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    chain = optax.chain(optax.clip_by_global_norm(clip_norm),
                        optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    return optax.MultiSteps(chain, every_k_schedule=accumulate) if accumulate > 1 else chain
