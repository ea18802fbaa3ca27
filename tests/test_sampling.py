"""Our logits processing equals Hugging Face 4.57's processors and warpers, as the reference uses them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from qtts_jax.talker import sampling

V, EOS = 3072, 2150


def assert_same_scores(ours, hf) -> None:
    """The same tokens masked, and the survivors within 1 ulp: XLA's CPU float32 division is not
    always correctly rounded (torch's is), so x / 0.9 may differ in the last bit."""
    ours = np.asarray(ours)
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(hf))
    finite = ~np.isneginf(hf)
    np.testing.assert_allclose(ours[finite], hf[finite], rtol=2.5e-7, atol=0)


def hf_talker(logits: np.ndarray, generated: list[int], penalty: float) -> np.ndarray:
    procs = LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(penalty),
            MinNewTokensLengthLogitsProcessor(0, 2, EOS),
            SuppressTokensLogitsProcessor([i for i in range(V - 1024, V) if i != EOS]),
        ]
    )
    ids = torch.tensor([generated], dtype=torch.long).reshape(1, -1)
    return procs(ids, torch.tensor(logits)[None].clone())[0].numpy()


def hf_warp(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    ids = torch.zeros((1, 0), dtype=torch.long)
    return LogitsProcessorList(warpers)(ids, torch.tensor(logits)[None].clone())[0].numpy()


@pytest.mark.parametrize("generated", [[], [5], [5, 5, 77, 2049, 3000], list(range(0, 400, 3))])
@pytest.mark.parametrize("penalty", [1.05, 1.3])
def test_talker_processors_equal_hf(generated, penalty):
    logits = np.random.default_rng(len(generated)).standard_normal(V).astype(np.float32) * 3
    seen = np.zeros(V, bool)
    seen[generated] = True
    process = jax.jit(lambda x, s, p, n: sampling.talker_mask(sampling.repetition_penalty(x, s, p), n, EOS))
    ours = process(jnp.asarray(logits), jnp.asarray(seen), jnp.float32(penalty), jnp.int32(len(generated)))
    assert_same_scores(ours, hf_talker(logits, generated, penalty))


def test_eos_barred_for_two_steps_then_allowed():
    logits = np.zeros(V, np.float32)
    logits[EOS] = 100.0
    for step, allowed in [(0, False), (1, False), (2, True)]:
        out = sampling.talker_mask(jnp.asarray(logits), jnp.int32(step), EOS)
        assert (int(jnp.argmax(out)) == EOS) == allowed
        assert bool(jnp.all(jnp.isinf(out[2048:EOS]))) and bool(jnp.all(jnp.isinf(out[EOS + 1 :])))


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(0.9, 50, 1.0), (1.0, 0, 1.0), (0.7, 0, 0.8), (1.3, 20, 0.5), (0.9, 1, 1.0), (0.9, 5000, 0.95)],
)
def test_warpers_equal_hf(temperature, top_k, top_p):
    logits = np.random.default_rng(top_k).standard_normal(2048).astype(np.float32) * 2
    logits[:10] = logits[0]  # ties at the top are kept by top-k, as in HF
    p = sampling.SamplingParams.make(False, temperature, top_k, top_p)
    ours = np.asarray(jax.jit(sampling.warp)(jnp.asarray(logits), p))
    assert_same_scores(ours, hf_warp(logits, temperature, top_k, top_p))


def test_greedy_takes_argmax_before_warping():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal(2048).astype(np.float32))
    p = sampling.SamplingParams.make(True, 0.5, 1, 0.1)
    assert int(sampling.choose(logits, sampling.noise(jax.random.PRNGKey(0), 2048), p)) == int(jnp.argmax(logits))


def test_draws_follow_the_warped_distribution():
    """Sampled tokens stay inside top-k and their frequencies match softmax(logits / T)."""
    logits = jnp.asarray([3.0, 2.0, 1.0, 0.5, -1.0, -2.0])
    p = sampling.SamplingParams.make(False, 0.9, 3, 1.0)
    keys = jax.random.split(jax.random.PRNGKey(1), 20000)
    draws = np.asarray(jax.vmap(lambda k: sampling.choose(logits, sampling.noise(k, 6), p))(keys))
    assert set(np.unique(draws)) <= {0, 1, 2}
    expected = np.asarray(jax.nn.softmax(logits[:3] / 0.9))
    freq = np.bincount(draws, minlength=3)[:3] / len(draws)
    np.testing.assert_allclose(freq, expected, atol=0.015)


def _rows(*settings) -> sampling.SamplingParams:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *[sampling.SamplingParams.make(*s) for s in settings])


@pytest.mark.parametrize("rows,applies", [
    ([(True, 0.7, 50, 0.8), (True, 1.0, 1, 0.5)], (False, False)),  # greedy rows discard their draws
    ([(False, 0.9, 0, 1.0), (True, 0.7, 50, 0.8)], (False, False)),  # top-k 0 and top-p 1 keep every score
    ([(False, 0.9, 50, 1.0), (False, 0.9, 0, 1.0)], (True, False)),  # the reference's defaults: no top-p sort
    ([(False, 0.9, 0, 1.0), (False, 1.3, 0, 0.5)], (False, True)),
    ([(True, 0.9, 0, 1.0), (False, 1.3, 20, 0.5)], (True, True)),
])
def test_a_batch_skips_the_warpers_none_of_its_rows_applies_and_chooses_the_same(rows, applies):
    p = _rows(*rows * 16)  # each row 16 times, with noise of its own: 16 draws
    warps = sampling.Warps.of(p)
    assert (bool(warps.top_k), bool(warps.top_p)) == applies
    logits = jax.random.normal(jax.random.PRNGKey(2), (len(p.greedy), V)) * 3
    gumbel = jax.vmap(lambda k: sampling.noise(k, V))(jax.random.split(jax.random.PRNGKey(3), len(p.greedy)))

    @jax.jit
    def batch(logits, gumbel, p, warps):  # the warps stay outside the vmap, as in the frame step
        return jax.vmap(lambda x, g, q: sampling.choose(x, g, q, warps))(logits, gumbel, p)

    every = batch(logits, gumbel, p, sampling.Warps())
    np.testing.assert_array_equal(batch(logits, gumbel, p, warps), every)
    if any(applies):  # a warper a row applies, skipped, changes that row's draw: the flags are what keeps it
        assert not np.array_equal(batch(logits, gumbel, p, sampling.Warps(False, False)), every)
