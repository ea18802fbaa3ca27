"""One optimiser step equals torch AdamW after torch's clip_grad_norm_ on the same gradients; accumulating k
micro-batches equals one step on their mean gradient."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from qtts_jax.finetune import optimizer


def tree(rng, scale=1.0):
    return {"a": (scale * rng.standard_normal((4, 3))).astype(np.float32),
            "b": {"c": (scale * rng.standard_normal(5)).astype(np.float32)}}


@pytest.mark.parametrize("grad_scale", [0.01, 5.0])  # under and over the clipping norm
def test_steps_equal_torch_adamw_with_clipping(grad_scale):
    import torch

    rng = np.random.default_rng(0)
    params = tree(rng)
    grads = [tree(rng, grad_scale) for _ in range(3)]
    tx = optimizer.make(lr=1e-2)
    state = tx.init(params)
    ours = params
    for g in grads:
        updates, state = jax.jit(tx.update)(g, state, ours)
        ours = optax.apply_updates(ours, updates)

    leaves, treedef = jax.tree.flatten(params)
    tensors = [torch.tensor(a, requires_grad=True) for a in leaves]
    opt = torch.optim.AdamW(tensors, lr=1e-2, weight_decay=0.01)
    for g in grads:
        for t, gl in zip(tensors, jax.tree.leaves(g)):
            t.grad = torch.tensor(gl)
        torch.nn.utils.clip_grad_norm_(tensors, 1.0)
        opt.step()
    for got, want in zip(jax.tree.leaves(ours), tensors):
        np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), rtol=1e-5, atol=1e-7)


def test_accumulation_is_one_step_on_the_mean_gradient():
    """Three batches only add their gradients up; the fourth's update equals one step on the four's mean."""
    rng = np.random.default_rng(1)
    params = tree(rng)
    micro = [tree(rng, 3.0) for _ in range(4)]
    tx = optimizer.make(lr=1e-2)
    state = optimizer.init(tx, params, accumulate=4)
    for g in micro[:3]:
        state = {**state, "acc": jax.jit(optimizer.add)(state["acc"], g)}
    total = jax.jit(optimizer.add)(state["acc"], micro[3])
    p, state = jax.jit(optimizer.update, static_argnums=(0, 4))(tx, total, state, params, 4)
    mean = jax.tree.map(lambda *g: sum(g) / len(g), *micro)
    updates, _ = tx.update(mean, tx.init(params), params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), p,
                 optax.apply_updates(params, updates))
    jax.tree.map(lambda a: np.testing.assert_array_equal(a, np.zeros_like(a)), state["acc"])  # a new sum begins
