"""The training forward: the loss of a `layout.Batch` from the parameter pytree (the one module that reads it).

loss = CE(talker, code0 of every frame and the final EOS) + 0.3 × CE(code predictor, codebooks 1-15), both
means over their real targets, as the official recipe weighs them, with the alignment inference uses:

- the talker's output at ``start + j`` (it has seen frames < j) is scored against code0 of frame j, and the
  output at ``start + frames`` against EOS: one shift, not two;
- the code predictor of frame j reads that same hidden state, then E(code0), then codebooks 1..14 through their
  tables, and its head k-1 at position k is scored against codebook k, for k = 1..15: every codebook is trained;
- text ids go through the text projection (`talker.embed_text`), as at inference.

Sequences run without a KV cache (one causal pass over the whole padded sequence); parameters are cast to
``compute_dtype`` inside the loss, so the gradients come back in the parameters' own dtype (fp32 masters).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qtts_jax import transformer
from qtts_jax.code_predictor import _project
from qtts_jax.config import DecoderConfig, ModelConfig
from qtts_jax.prompt import embed_prompt

SUB_TALKER_WEIGHT = 0.3  # the official recipe's weight of the code predictor's loss


def causal_stack(params: dict, cfg: DecoderConfig, x: jax.Array) -> jax.Array:
    """x [T, H] through a decoder stack with a causal mask and positions 0..T-1, no cache: final-normed [T, H]."""
    t = x.shape[0]
    cos, sin = transformer.rope_tables(jnp.arange(t), cfg.head_dim, cfg.rope_theta, x.dtype)
    mask = jnp.tril(jnp.ones((t, t), bool))
    scale = cfg.head_dim**-0.5

    def attend(q, k, v, cache, i):
        return transformer._attention(q, k, v, mask, scale), cache

    h, _ = transformer._layers(params, cfg, x, cos, sin, (), attend)
    return h


def _cross_entropy(logits: jax.Array, labels: jax.Array, valid: jax.Array) -> jax.Array:
    """Mean over valid targets of -log softmax(logits)[label], in fp32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    valid = jnp.broadcast_to(valid, nll.shape)
    return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def losses(params: dict, cfg: ModelConfig, batch: tuple, compute_dtype=jnp.float32) -> tuple[jax.Array, dict]:
    """(total loss, {"talker", "predictor"}) of one batch, given as `layout.Batch.arrays()` (a filler row's
    length, -1, leaves it without targets)."""
    text, codec, frames, speaker_row, speaker, start, codes, lengths = batch
    p = jax.tree.map(lambda a: a.astype(compute_dtype), params)
    n = codes.shape[1]
    x = jax.vmap(embed_prompt, (None, 0, 0, 0, 0, 0))(p, text, codec, frames, speaker_row, speaker)
    h = jax.vmap(causal_stack, (None, None, 0))(p["talker"], cfg.talker, x)  # [B, T, H]

    j = jnp.arange(n + 1)
    at = jnp.minimum(start[:, None] + j, h.shape[1] - 1)  # outputs that predict frames 0..n (n: EOS)
    read = jnp.take_along_axis(h, at[..., None], axis=1)  # [B, n+1, H]
    labels = jnp.concatenate([codes[..., 0], jnp.zeros_like(codes[:, :1, 0])], axis=1)
    labels = jnp.where(j == lengths[:, None], cfg.codec.eos, labels)
    talker = _cross_entropy(read @ p["codec_head"], labels, j <= lengths[:, None])

    hidden = read[:, :n]  # [B, n, H]: frame j's predictor input has not seen frame j
    groups = cfg.num_code_groups - 1
    rest = p["cp_embedding"][jnp.arange(groups - 1), codes[..., 1:groups]]  # codebooks 1..14 [B, n, 14, H]
    seq = jnp.concatenate([hidden[:, :, None], p["codec_embedding"][codes[..., 0]][:, :, None], rest], axis=2)
    seq = _project(p, seq.reshape(-1, groups + 1, seq.shape[-1]))
    hp = jax.vmap(causal_stack, (None, None, 0))(p["predictor"], cfg.predictor, seq)  # [B*n, 16, Hc]
    logits = jnp.einsum("fkh,khv->fkv", hp[:, 1:], p["cp_heads"])  # head k-1 at position k
    valid = (jnp.arange(n)[None, :] < lengths[:, None]).reshape(-1)
    predictor = _cross_entropy(logits, codes[..., 1:].reshape(-1, groups), valid[:, None])
    return talker + SUB_TALKER_WEIGHT * predictor, {"talker": talker, "predictor": predictor}
