"""The Pallas decode-attention kernel (interpret mode on CPU) equals the jnp reference that gathers whole slots,
and the engine with it generates what it generates without it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from qtts_jax.kernels.attention import rows_attention
from qtts_jax.request import Request
from qtts_jax.talker.transformer import gather_rows_attention
from support import GREEDY, assert_same_codes, run_small


@pytest.mark.parametrize("capacity, group", [(128, 2), (96, 1), (64, 4)])
def test_kernel_equals_the_gathering_reference(capacity, group):
    """Rows in any slot order, a padding row past the last slot, lengths from 1 to the whole context (a partial
    last block included), and prompt padding masked inside the length."""
    rng = np.random.default_rng(capacity)
    layers, slots, kvh, d, batch = 3, 5, 2, 32, 6
    cache_k, cache_v = (jnp.asarray(rng.standard_normal((layers, slots, kvh, capacity, d)), jnp.float32)
                        for _ in range(2))
    q = jnp.asarray(rng.standard_normal((batch, kvh * group, d)), jnp.float32)
    idx = jnp.array([0, 3, 4, 1, slots, 2], jnp.int32)  # slots: a padding row, reading the last slot
    rows = jnp.array([0, capacity // 2 + 5, capacity - 1, 5, 30, 63], jnp.int32)
    valid = rng.random((batch, capacity)) > 0.3
    valid[np.arange(batch), np.asarray(rows)] = True  # a row always sees its own key
    mask = jnp.asarray(valid) & (jnp.arange(capacity)[None] <= rows[:, None])
    for layer in range(layers):
        args = (q, cache_k, cache_v, jnp.int32(layer), idx, rows + 1, mask)
        expected = gather_rows_attention(*args, scale=d**-0.5)
        got = rows_attention(*args, scale=d**-0.5, interpret=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_engine_with_the_kernel_generates_the_same_codes(tiny_model):
    """Greedy and seeded requests, side by side in one engine: the same codes with the kernel as without."""
    reqs = [Request("Attention straight from the cache.", speaker="ryan", max_frames=7, **GREEDY),
            Request("Seeded beside it.", speaker="eric", seed=11, max_frames=5)]
    assert_same_codes(run_small(tiny_model, reqs, attention="pallas"), run_small(tiny_model, reqs, attention="jnp"))
