"""The training forward: the loss of a `layout.Batch` from the talker's trainable state (the one module that reads it).

loss = CE(talker, code0 of every frame and the final EOS) + 0.3 × CE(code predictor, codebooks 1-15), both
means over their real targets, as the official recipe weighs them, with the alignment inference uses:

- the talker's output at ``start + j`` (it has seen frames < j) is scored against code0 of frame j, and the
  output at ``start + frames`` against EOS: one shift, not two;
- the code predictor of frame j reads that same hidden state, then E(code0), then codebooks 1..14 through their
  tables, and its head k-1 at position k is scored against codebook k, for k = 1..15: every codebook is trained;
- text ids go through the text projection (`Talker.embed_text`), as at inference.

The state is `nnx.split(talker, nnx.Param, ...)`'s Param state (as a plain dict); the loss merges it back into the
`Talker` (at trace time) and runs the modules' own teacher-forced forwards, `Talker.forward` over each whole
right-padded sequence (pads come after every real position, so causal attention never reads them) and
`CodePredictor.forward` per frame. The state is cast to ``compute_dtype`` inside the loss, so the gradients come
back in its own dtype (fp32 masters).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qtts_jax import nn
from qtts_jax.config import ModelConfig
from qtts_jax.prompt import embed_prompt
from qtts_jax.talker import Talker

SUB_TALKER_WEIGHT = 0.3  # the official recipe's weight of the code predictor's loss


def _targets(lengths: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """Which outputs have a target, per row of a batch of ``n``-frame slots: the talker's [B, n + 1] (codes 0 of
    each real frame, then the EOS) and the code predictor's frames [B, n]; a filler row (length -1) has none."""
    return jnp.arange(n + 1) <= lengths[:, None], jnp.arange(n) < lengths[:, None]


def target_counts(cfg: ModelConfig, batch: tuple) -> tuple[jax.Array, jax.Array]:
    """(talker targets, code predictor targets) of a whole batch: what `losses` divides its sums by."""
    talker, frames = _targets(batch[-1], batch[-2].shape[1])
    return jnp.sum(talker), jnp.sum(frames) * (cfg.num_code_groups - 1)


def _nll_sum(logits: jax.Array, labels: jax.Array, valid: jax.Array) -> jax.Array:
    """Sum over valid targets of -log softmax(logits)[label], in fp32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(jnp.broadcast_to(valid, nll.shape), nll, 0.0))


def _predictor_nll_sum(talker: Talker, hidden: jax.Array, code0: jax.Array, codes: jax.Array, valid: jax.Array,
                       chunk: int | None) -> jax.Array:
    """The code predictor's summed NLL over frames (`hidden` [F, H], `code0` [F, H] embedded, `codes` [F, 16],
    `valid` [F]). With ``chunk``, frames go through in chunks of that many, each recomputed in the backward pass
    (`jax.checkpoint`) rather than kept: over a whole batch's frames (4,800 at 32 clips of 150) the predictor's
    activations are most of a step's memory, and only one chunk's are alive at a time."""
    groups = codes.shape[1] - 1

    def nll(h, c0, fc, v):
        logits = jax.vmap(talker.predictor.forward)(h, c0, fc[:, 1:groups])
        return _nll_sum(logits, fc[:, 1:], v[:, None])

    frames = hidden.shape[0]
    if chunk is None or chunk >= frames:
        return nll(hidden, code0, codes, valid)
    pad = -frames % chunk  # padded frames have no target
    parts = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(-1, chunk, *a.shape[1:])
             for a in (hidden, code0, codes, valid)]
    total, _ = jax.lax.scan(lambda acc, xs: (acc + jax.checkpoint(nll)(*xs), None), jnp.float32(0.0), parts)
    return total


def losses(state: dict, graph: nnx.GraphDef, cfg: ModelConfig, batch: tuple, compute_dtype=jnp.float32,
           counts: tuple | None = None, predictor_chunk: int | None = None) -> tuple[jax.Array, dict]:
    """(total loss, {"talker", "predictor"}) of one batch, given as `layout.Batch.arrays()` (a filler row's
    length, -1, leaves it without targets). ``graph``, ``state``: `nnx.split(talker, nnx.Param, ...)`'s first two.
    Each cross-entropy is a sum over the batch's targets divided by their count, `target_counts(cfg, batch)`; a
    micro-batch passes the whole batch's ``counts``, so the micro-batches' losses (and gradients) add up to the
    whole batch's. ``predictor_chunk``: frames per code-predictor pass, recomputed in the backward pass (None: all
    of them in one, kept)."""
    text, codec, frames, speaker_row, speaker, start, codes, lengths = batch
    talker_n, predictor_n = target_counts(cfg, batch) if counts is None else counts
    talker: Talker = nn.merge(graph, jax.tree.map(lambda a: a.astype(compute_dtype), state))
    n = codes.shape[1]
    x = embed_prompt(talker, text, codec, frames, speaker_row, speaker)  # [B, T, H]
    logits, h = jax.vmap(talker.forward, (0, None))(x, jnp.ones(x.shape[1], bool))  # [B, T, V], [B, T, H]

    talker_valid, frame_valid = _targets(lengths, n)
    j = jnp.arange(n + 1)
    at = jnp.minimum(start[:, None] + j, h.shape[1] - 1)  # outputs that predict frames 0..n (n: EOS)
    labels = jnp.concatenate([codes[..., 0], jnp.zeros_like(codes[:, :1, 0])], axis=1)
    labels = jnp.where(j == lengths[:, None], cfg.codec.eos, labels)
    read = jnp.take_along_axis(logits, at[..., None], axis=1)  # [B, n+1, V]
    talker_loss = _nll_sum(read, labels, talker_valid) / jnp.maximum(talker_n, 1)

    hidden = jnp.take_along_axis(h, at[:, :n, None], axis=1)  # [B, n, H]: frame j's input has not seen frame j
    frame_codes = codes.reshape(-1, cfg.num_code_groups)  # [B*n, 16]
    code0 = nn.rows(talker.codec_embedding[...], frame_codes[:, 0])
    predictor = _predictor_nll_sum(talker, hidden.reshape(-1, h.shape[-1]), code0, frame_codes,
                                   frame_valid.reshape(-1), predictor_chunk) / jnp.maximum(predictor_n, 1)
    return talker_loss + SUB_TALKER_WEIGHT * predictor, {"talker": talker_loss, "predictor": predictor}
