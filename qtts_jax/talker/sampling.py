"""Token selection with the reference's (Hugging Face 4.57) semantics, for one row at a time.

Every knob is a per-row *value*, not a Python constant, so one compiled function serves any mix of
requests (the engine vmaps these over slots). Order, as HF applies it for the talker:
repetition penalty → min-new-tokens (EOS masked) → suppression of the special range → (sampling
only) temperature → top-k → top-p → draw. Greedy rows take the argmax of the processed logits,
before the warpers, as HF does.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


class SamplingParams(NamedTuple):
    """Per-row sampling settings; each field a scalar array (vmapped: one per row)."""

    greedy: jax.Array  # bool
    temperature: jax.Array  # float
    top_k: jax.Array  # int; 0 disables
    top_p: jax.Array  # float; 1.0 disables

    @classmethod
    def make(cls, greedy: bool, temperature: float, top_k: int, top_p: float) -> "SamplingParams":
        return cls(jnp.asarray(greedy), jnp.asarray(temperature, jnp.float32),
                   jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32))


def repetition_penalty(logits: jax.Array, seen: jax.Array, penalty: jax.Array) -> jax.Array:
    """HF RepetitionPenaltyLogitsProcessor: seen tokens' logits shrink toward (or past) zero."""
    penalized = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(seen, penalized, logits)


def talker_mask(logits: jax.Array, num_generated: jax.Array, eos: int, min_new_tokens: int = 2) -> jax.Array:
    """MinNewTokens then SuppressTokens: only codes [0, V-1024) and EOS survive; EOS not before step 2."""
    ids = jnp.arange(logits.shape[-1])
    vocab = logits.shape[-1]
    banned = (ids >= vocab - 1024) & (ids != eos)
    banned = banned | ((ids == eos) & (num_generated < min_new_tokens))
    return jnp.where(banned, NEG_INF, logits)


class Warps(NamedTuple):
    """Which warpers some row of a batch applies, as bools outside the per-row `vmap`: `warp` skips the sort of a
    warper no row applies (the sorts are most of a frame on CPU). Skipping changes no row's scores (a greedy row
    discards its draw; top-k 0 and top-p 1 keep every score), so every choice stays the same. The default applies
    both, for callers that know nothing of the batch."""

    top_k: jax.Array | bool = True
    top_p: jax.Array | bool = True

    @classmethod
    def of(cls, *batches: SamplingParams) -> "Warps":
        """What the rows of `batches` (batched `SamplingParams`, e.g. a batch's talker and predictor settings)
        apply."""
        sampled = jnp.concatenate([~p.greedy for p in batches])
        return cls(jnp.any(sampled & jnp.concatenate([p.top_k > 0 for p in batches])),
                   jnp.any(sampled & jnp.concatenate([p.top_p < 1.0 for p in batches])))


def _top_k(scores: jax.Array, p: SamplingParams) -> jax.Array:
    desc = jnp.sort(scores)[::-1]
    kth = desc[jnp.clip(p.top_k, 1, scores.shape[-1]) - 1]
    return jnp.where((p.top_k > 0) & (scores < kth), NEG_INF, scores)


def _top_p(scores: jax.Array, p: SamplingParams) -> jax.Array:
    order = jnp.argsort(scores)  # ascending, as HF sorts for top-p
    cum = jnp.cumsum(jax.nn.softmax(scores[order]))
    drop_sorted = (cum <= 1.0 - p.top_p).at[-1].set(False)
    drop = jnp.zeros(scores.shape[-1], bool).at[order].set(drop_sorted)
    return jnp.where((p.top_p < 1.0) & drop, NEG_INF, scores)


def _when(applies: jax.Array | bool, warper, scores: jax.Array, p: SamplingParams) -> jax.Array:
    if applies is True:
        return warper(scores, p)
    return jax.lax.cond(applies, warper, lambda s, _: s, scores, p)


def warp(logits: jax.Array, p: SamplingParams, warps: Warps = Warps()) -> jax.Array:
    """Temperature → top-k → top-p, each exactly as HF's warpers (ties at the k-th value are kept); a warper that
    `warps` says no row of the batch applies is skipped."""
    scores = logits / p.temperature
    return _when(warps.top_p, _top_p, _when(warps.top_k, _top_k, scores, p), p)


def choose(logits: jax.Array, gumbel: jax.Array, p: SamplingParams, warps: Warps = Warps()) -> jax.Array:
    """Argmax for greedy rows; otherwise a draw from the warped distribution by the Gumbel-max trick.

    The noise is an input (`noise(key, vocab)`), so two implementations given the same noise must
    make the same draw, and a row's draws depend only on its own key. `warps`: what the batch applies.
    """
    logits = logits.astype(jnp.float32)
    drawn = jnp.argmax(warp(logits, p, warps) + gumbel)
    return jnp.where(p.greedy, jnp.argmax(logits), drawn).astype(jnp.int32)


def noise(key: jax.Array, vocab: int) -> jax.Array:
    """Standard Gumbel noise for one draw over `vocab` ids."""
    return jax.random.gumbel(key, (vocab,), jnp.float32)
