"""Batched token selection: a Pallas kernel and the jnp reference it must equal, with one signature.

The reference (`*_ref`) vmaps `qtts_jax.talker.sampling` over rows and sorts every row twice (top-k, then
top-p's ascending sort). Pallas GPU lowers no sort, and the kernel (one program per row, the whole
row in registers) replaces each sort by an exact threshold search built from reductions only:

* Floats are compared through a monotone int32 image of their bits (`_key`), so a bisection over
  int32 lands on an exact element value in 32 steps.
* top-k: the k-th largest value is the largest key t with count(key >= t) >= k; keep key >= t
  (ties at the k-th value kept, as HF).
* top-p: HF sorts ascending (the reference with a stable argsort: equal values in index order),
  takes cum = cumsum(softmax) and drops positions where cum <= 1 - top_p, always keeping the last.
  The dropped set is a prefix of that (value, index) order, found by two searches: the largest
  value key a with mass(key <= a) <= 1 - top_p, then, inside the next value b, the largest index m
  with mass(key < b or (key == b and idx <= m)) <= 1 - top_p. That prefix is dropped except the
  last element (the largest value, highest index): the reference's tie rule, ties included.
* draw: argmax(warped + gumbel) as max, then the lowest index attaining it (jnp.argmax's rule);
  greedy rows take the argmax of the processed logits, before any warper.

The elementwise part (talker penalty and masks, temperature) runs in XLA just before the kernel,
fused with the padding, by the reference's own functions: Triton lowers float division to the
approximate `div.full.f32`, and XLA's division keeps the scores bit-identical to the reference's.

Known divergence: the top-p masses are tree sums of probabilities in the original order (and on GPU
use Triton's exp and division), where the reference takes a sequential cumsum in sorted order; they
round differently (~1e-7), so a row whose cumulative mass lies within rounding of 1 - top_p can keep
one element more or fewer. Everything else (processing, temperature, top-k, ties, the draw)
matches the reference exactly.

On GPU the kernel lowers through Pallas-Triton, whose blocks must be powers of two, so rows are
padded to the next power of two (3072 -> 4096) with -inf scores that are never chosen. (A Mosaic-GPU
port would need row tiles of at most 256 for TMA, explicit layouts for iota, and 128-element output
stores; Triton is deprecated from JAX 0.11 but still shipped.)
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from qtts_jax.talker import sampling
from qtts_jax.talker.sampling import SamplingParams

NUM_WARPS = 4  # 4096-wide rows: 32 elements per thread
_INT32_MAX = 2**31 - 1
_KEY_NEG_INF = -2139095041  # _key(-inf): the smallest key of any non-NaN float


def _key(x: jax.Array) -> jax.Array:
    """int32 image of float32 that orders like the floats (-0 folded onto +0 so they tie as floats do)."""
    bits = lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _last_true(pred, lo, hi, steps: int):
    """Largest t in [lo, hi) with pred(t), for pred true at lo and monotone (true, then false).

    `steps` must cover log2(hi - lo); the midpoint is an overflow-free floor average.
    """

    def body(_, bounds):
        lo, hi = bounds
        mid = (lo & hi) + ((lo ^ hi) >> 1)
        ok = pred(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    return lax.fori_loop(0, steps, body, (jnp.int32(lo), jnp.int32(hi)))[0]


def _argmax(y: jax.Array, idx: jax.Array) -> jax.Array:
    """The first index of the maximum, as jnp.argmax."""
    return jnp.min(jnp.where(y == jnp.max(y), idx, y.shape[0]))


def _top_k(scores, key, kmax, top_k, vocab: int):
    k = jnp.clip(top_k, 1, vocab)
    kth = _last_true(lambda t: jnp.sum((key >= t).astype(jnp.int32)) >= k, _KEY_NEG_INF, kmax + 1, 32)
    keep = key >= kth
    return jnp.where(keep, scores, -jnp.inf), jnp.where(keep, key, _KEY_NEG_INF)


def _top_p(scores, key, kmax, top_p, idx):
    e = jnp.exp(scores - jnp.max(scores))
    prob = e / jnp.sum(e)
    limit = 1.0 - top_p

    def mass(mask):
        return jnp.sum(jnp.where(mask, prob, 0.0))

    a = _last_true(lambda t: mass(key <= t) <= limit, _KEY_NEG_INF - 1, kmax + 1, 32)
    b = jnp.min(jnp.where(key > a, key, _INT32_MAX))  # the value group the cut falls in

    def upto(j):
        return (key < b) | ((key == b) & (idx <= j))

    n = scores.shape[0]
    m = _last_true(lambda j: mass(upto(j)) <= limit, -1, n, n.bit_length())
    last = jnp.max(jnp.where(key == kmax, idx, -1))
    return jnp.where(upto(m) & (idx != last), -jnp.inf, scores)


def _kernel(scores_ref, gumbel_ref, greedy_ref, top_k_ref, top_p_ref, out_ref, *, vocab: int):
    """One row: the argmax of the scores if greedy, else top-k → top-p → Gumbel-max, each warper
    skipped when its setting disables it."""
    scores = scores_ref[0, :]
    idx = lax.broadcasted_iota(jnp.int32, scores.shape, 0)
    top_k, top_p = top_k_ref[0], top_p_ref[0]

    def draw():
        key = _key(scores)
        kmax = jnp.max(key)
        s, k = lax.cond(
            (top_k > 0) & (top_k < vocab),
            lambda s, k: _top_k(s, k, kmax, top_k, vocab),
            lambda s, k: (s, k),
            scores,
            key,
        )
        s = lax.cond(top_p < 1.0, lambda s: _top_p(s, k, kmax, top_p, idx), lambda s: s, s)
        return _argmax(s + gumbel_ref[0, :], idx)

    out_ref[0] = lax.cond(greedy_ref[0] != 0, lambda: _argmax(scores, idx), draw)


def _call(logits, params: SamplingParams, gumbel, interpret: bool):
    """Elementwise prologue in XLA (fused with the padding), selection in the kernel.

    The prologue divides by the temperature here, not in the kernel, because Triton lowers float
    division to the approximate `div.full.f32`: XLA's division keeps the scores bit-identical to the
    reference's. Greedy rows keep their undivided logits, as the reference takes their argmax there.
    """
    batch, vocab = logits.shape
    width = 1 << (vocab - 1).bit_length()  # Triton blocks are powers of two

    def pad(a, value):
        return jnp.pad(a, ((0, 0), (0, width - vocab)), constant_values=value)

    logits = logits.astype(jnp.float32)
    greedy = params.greedy.astype(bool)
    scores = jnp.where(greedy[:, None], logits, logits / params.temperature.astype(jnp.float32)[:, None])
    row_spec = pl.BlockSpec((1, width), lambda i: (i, 0))
    one_spec = pl.BlockSpec((1,), lambda i: (i,))
    return pl.pallas_call(
        partial(_kernel, vocab=vocab),
        out_shape=jax.ShapeDtypeStruct((batch,), jnp.int32),
        grid=(batch,),
        in_specs=[row_spec, row_spec, one_spec, one_spec, one_spec],
        out_specs=one_spec,
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="sample_rows",
    )(
        pad(scores, -jnp.inf),
        pad(gumbel.astype(jnp.float32), 0.0),
        greedy.astype(jnp.int32),
        params.top_k.astype(jnp.int32),
        params.top_p.astype(jnp.float32),
    )


def process_talker(logits, seen, penalty, num_generated, eos: int):
    """The talker's elementwise processing (repetition penalty, min-new-tokens, suppression) of
    [B, V] float32 logits, by the reference's own row functions: shared by both implementations."""

    def row(x, s, pen, n):
        return sampling.talker_mask(sampling.repetition_penalty(x, s, pen), n, eos)

    return jax.vmap(row)(logits.astype(jnp.float32), seen, penalty, num_generated)


@partial(jax.jit, static_argnames=("eos", "interpret"))
def sample_talker(logits, seen, penalty, num_generated, eos: int, params: SamplingParams, gumbel, *, interpret=False):
    """Talker code0 for each row [B, V]: penalty, EOS/suppression masks, then greedy or a draw."""
    return _call(process_talker(logits, seen, penalty, num_generated, eos), params, gumbel, interpret)


@partial(jax.jit, static_argnames=("interpret",))
def sample_plain(logits, params: SamplingParams, gumbel, *, interpret=False):
    """Code-predictor token for each row [B, V]: greedy or a warped draw, no logits processing."""
    return _call(logits, params, gumbel, interpret)


@partial(jax.jit, static_argnames=("eos", "interpret"))
def sample_talker_ref(
    logits, seen, penalty, num_generated, eos: int, params: SamplingParams, gumbel, *, interpret=False
):
    """`sample_talker` by the jnp reference (`interpret` only keeps the signatures interchangeable)."""
    processed = process_talker(logits, seen, penalty, num_generated, eos)
    return jax.vmap(sampling.choose)(processed, gumbel, params)


@partial(jax.jit, static_argnames=("interpret",))
def sample_plain_ref(logits, params: SamplingParams, gumbel, *, interpret=False):
    """`sample_plain` by the jnp reference (`interpret` only keeps the signatures interchangeable)."""
    return jax.vmap(sampling.choose)(logits, gumbel, params)


def choose_row(logits, gumbel, p: SamplingParams, warps=None, *, interpret=False):
    """One row through the kernel, with `qtts_jax.talker.sampling.choose`'s signature: the engine's frame
    step is written per stream and vmapped, and vmap turns this into one batched kernel launch. (`warps` goes
    unused: the kernel's threshold searches have no sort to skip.)"""
    params = jax.tree.map(lambda a: jnp.asarray(a)[None], p)
    return _call(logits[None], params, gumbel[None], interpret)[0]
