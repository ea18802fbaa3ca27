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


def warp(logits: jax.Array, p: SamplingParams) -> jax.Array:
    """Temperature → top-k → top-p, each exactly as HF's warpers (ties at the k-th value are kept)."""
    scores = logits / p.temperature
    vocab = scores.shape[-1]
    desc = jnp.sort(scores)[::-1]
    kth = desc[jnp.clip(p.top_k, 1, vocab) - 1]
    scores = jnp.where((p.top_k > 0) & (scores < kth), NEG_INF, scores)
    order = jnp.argsort(scores)  # ascending, as HF sorts for top-p
    cum = jnp.cumsum(jax.nn.softmax(scores[order]))
    drop_sorted = (cum <= 1.0 - p.top_p).at[-1].set(False)
    drop = jnp.zeros(vocab, bool).at[order].set(drop_sorted)
    return jnp.where((p.top_p < 1.0) & drop, NEG_INF, scores)


def choose(logits: jax.Array, gumbel: jax.Array, p: SamplingParams) -> jax.Array:
    """Argmax for greedy rows; otherwise a draw from the warped distribution by the Gumbel-max trick.

    The noise is an input (`noise(key, vocab)`), so two implementations given the same noise must
    make the same draw, and a row's draws depend only on its own key.
    """
    logits = logits.astype(jnp.float32)
    drawn = jnp.argmax(warp(logits, p) + gumbel)
    return jnp.where(p.greedy, jnp.argmax(logits), drawn).astype(jnp.int32)


def noise(key: jax.Array, vocab: int) -> jax.Array:
    """Standard Gumbel noise for one draw over `vocab` ids."""
    return jax.random.gumbel(key, (vocab,), jnp.float32)
