"""Stateful streaming 12 Hz codec decoder, batched across stream slots.

Every layer of the decoder is causal, so a stream can be decoded a chunk of frames at a time and the
concatenated chunks equal `decoder.decode` of the whole sequence (up to float rounding), provided each
layer gets the history it would have seen in a full decode:

- each causal conv (and each vocoder transposed conv) gets the last inputs of its layer, at that layer's
  rate: a fixed-length *tail* per layer, zeros at the start of a stream (exactly the full decode's zero
  padding);
- each transformer layer gets the rotated keys and the values of the last ``sliding_window - 1`` frames,
  and RoPE positions continue from the slot's own frame counter.

The state is one pytree with a leading slot axis, of a size fixed by the config (independent of stream
length), so one compiled `decode_step` per chunk size serves every mix of slots at different positions.
The upsampling stages' transposed convs have kernel == stride and so need no state.
"""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from qtts_jax import nn
from qtts_jax.codec.config import RESIDUAL_DILATIONS, CodecConfig, CodecDecoderConfig
from qtts_jax.codec.decoder import CodecDecoder, CodecTransformer
from qtts_jax.codec.layers import (
    causal_conv,
    causal_conv_transpose,
    convnext,
    dequantize,
    residual_unit,
    rope_tables,
    snake,
    transformer_layer,
)
from qtts_jax.nn import rms_norm


class StreamState(NamedTuple):
    """Decoder state of every slot; each leaf has the slot axis first."""

    position: jax.Array  # [B] int32: frames already decoded in the slot's current stream
    keys: jax.Array  # [B, layers, window-1, kv_heads, head_dim]: rotated keys of the last frames, oldest first
    values: jax.Array  # [B, layers, window-1, kv_heads, head_dim]
    tails: dict  # layer param path -> [B, frames, channels]: that layer's last inputs (see `tail_shapes`)


@functools.lru_cache(maxsize=None)
def tail_shapes(cfg: CodecConfig) -> Mapping[str, tuple[int, int]]:
    """(frames, channels) of the input history each stateful conv layer needs, keyed by its param path.

    A causal conv needs its last (k-1)*dilation inputs; a transposed conv with kernel k and stride s needs
    (k-1)//s (1 in the vocoder, where k = 2s). Vocoder tails hold the input *before* the SnakeBeta that
    precedes each conv (pointwise, so it is simply recomputed on the tail). Kernel sizes come from the
    module's parameters, so this cannot drift from them. Cached per config: building the abstract module takes
    a good fraction of a second, and every ICL voice primed (`init_state`) asks.
    """
    d = cfg.decoder
    shapes = nn.state_shapes(nnx.eval_shape(lambda: CodecDecoder(cfg)))

    def kernel(path: str) -> int:
        return shapes[f"{path}/w"][0]

    tails = {"pre_conv": (kernel("pre_conv") - 1, d.codebook_dim)}
    for s in range(len(d.upsampling_ratios)):
        tails[f"upsample/{s}/convnext"] = (kernel(f"upsample/{s}/convnext/dwconv") - 1, d.latent_dim)
    tails["vocoder/conv_in"] = (kernel("vocoder/conv_in") - 1, d.latent_dim)
    for b, rate in enumerate(d.upsample_rates):
        block = f"vocoder/blocks/{b}"
        tails[f"{block}/conv"] = ((kernel(f"{block}/conv") - 1) // rate, d.decoder_dim >> b)
        for u, dilation in enumerate(RESIDUAL_DILATIONS):
            frames = (kernel(f"{block}/units/{u}/conv1") - 1) * dilation
            tails[f"{block}/units/{u}"] = (frames, d.decoder_dim >> (b + 1))
    tails["vocoder/conv_out"] = (kernel("vocoder/conv_out") - 1, d.decoder_dim >> len(d.upsample_rates))
    return MappingProxyType(tails)


def init_state(cfg: CodecConfig, num_slots: int, dtype=jnp.float32) -> StreamState:
    """All slots at the start of a stream (position 0, empty history)."""
    d = cfg.decoder
    kv_shape = (num_slots, d.num_hidden_layers, d.sliding_window - 1, d.num_key_value_heads, d.head_dim)
    return StreamState(
        position=jnp.zeros((num_slots,), jnp.int32),
        keys=jnp.zeros(kv_shape, dtype),
        values=jnp.zeros(kv_shape, dtype),
        tails={name: jnp.zeros((num_slots, *shape), dtype) for name, shape in tail_shapes(cfg).items()},
    )


@functools.partial(jax.jit, static_argnums=1)
def decode_step(
    params: dict, cfg: CodecConfig, state: StreamState, codes: jax.Array, count: jax.Array
) -> tuple[jax.Array, StreamState]:
    """Decode the next ``count[b]`` frames of every slot: codes [B, n, Q] int -> (audio [B, n * 1920] in
    [-1, 1], state). ``params``: a `CodecDecoder`'s state (`nn.split`), the full decoder's weights.

    Slot b decodes its first ``count[b]`` <= n frames; the rest of its row is ignored, so slots with chunks of
    different sizes share one call (compiled once per n). Its audio is valid for ``count[b] * 1920`` samples;
    with ``count[b] == 0`` its state is unchanged. Every layer is causal, so the ignored frames cannot
    change the valid samples; the state keeps the history as of frame ``count[b]``.
    """
    d = cfg.decoder
    n = codes.shape[1]
    tails = {}
    m: CodecDecoder = nn.merge(nn.graph_of(CodecDecoder, cfg), params)

    def with_history(name: str, x: jax.Array) -> tuple[jax.Array, int]:
        """x prefixed by the layer's stored inputs; records the inputs up to each slot's last valid frame
        (the next tail) as a side effect."""
        kept = state.tails[name].shape[1]
        extended = jnp.concatenate([state.tails[name], x], axis=1)
        tails[name] = _window(extended, count * (x.shape[1] // n), kept)
        return extended, kept

    x, history = with_history("pre_conv", dequantize(m.quantizer, codes))
    x = causal_conv(x, m.pre_conv, history=history)
    x, keys, values = _transformer_step(m.transformer, d, x, state, count)
    for s, (stage, factor) in enumerate(zip(m.upsample, d.upsampling_ratios)):
        x = causal_conv_transpose(x, stage.conv, factor)  # kernel == stride (decoder.py): no history
        x, history = with_history(f"upsample/{s}/convnext", x)
        x = convnext(x, stage.convnext, history=history)

    voc = m.vocoder
    x, history = with_history("vocoder/conv_in", x)
    x = causal_conv(x, voc.conv_in, history=history)
    for b, (block, rate) in enumerate(zip(voc.blocks, d.upsample_rates)):
        x, history = with_history(f"vocoder/blocks/{b}/conv", x)
        x = causal_conv_transpose(snake(x, block.snake), block.conv, rate, history=history)
        for u, (unit, dilation) in enumerate(zip(block.units, RESIDUAL_DILATIONS)):
            x, history = with_history(f"vocoder/blocks/{b}/units/{u}", x)
            x = residual_unit(x, unit, dilation, history=history)
    x, history = with_history("vocoder/conv_out", x)
    x = causal_conv(snake(x, voc.snake_out), voc.conv_out, history=history)
    audio = jnp.clip(x[..., 0], -1.0, 1.0).astype(jnp.float32)

    new = StreamState(state.position + count, keys, values, tails)
    new = jax.tree.map(lambda n, old: n.astype(old.dtype), new, state)
    return audio, new


def _window(x: jax.Array, start: jax.Array, length: int) -> jax.Array:
    """Per slot b, x[b, start[b] : start[b] + length] (x [B, T, ...], start [B])."""
    return jax.vmap(lambda row, s: lax.dynamic_slice_in_dim(row, s, length, axis=0))(x, start)


def _transformer_step(p: CodecTransformer, d: CodecDecoderConfig, x: jax.Array, state: StreamState, count: jax.Array):
    """The pre-transformer on one chunk, attending over each slot's cached window; returns the output and
    the caches as of each slot's frame ``count``. Key j of the concatenated [cache, chunk] sits at position ``position - (W-1) + j``;
    the mask is the full decode's sliding window (0 <= query - key < W) plus "key position >= 0", which
    hides the cache's empty entries at the start of a stream."""
    n, past = x.shape[1], d.sliding_window - 1
    query_pos = state.position[:, None] + jnp.arange(n)  # [B, n]
    key_pos = state.position[:, None] + jnp.arange(-past, n)  # [B, past + n]
    distance = query_pos[:, :, None] - key_pos[:, None, :]
    mask = (distance >= 0) & (distance < d.sliding_window) & (key_pos[:, None, :] >= 0)
    mask = mask[:, None, None]  # broadcast over [kv heads, group] of the scores
    cos, sin = rope_tables(d, query_pos, jnp)

    def layer_step(layer, h, past_k, past_v):
        past_kv = (past_k.astype(h.dtype), past_v.astype(h.dtype))
        h, (k, v) = transformer_layer(h, layer, d, cos, sin, mask, past_kv)
        return h, (_window(k, count, past), _window(v, count, past))  # the window ending at frame count

    caches = (jnp.moveaxis(state.keys, 1, 0), jnp.moveaxis(state.values, 1, 0))  # scan over layers
    x, (keys, values) = nn.scan(p.layers, layer_step, p.input_proj(x), *caches)
    x = p.output_proj(rms_norm(x, p.norm[...], d.rms_norm_eps))
    return x, jnp.moveaxis(keys, 0, 1), jnp.moveaxis(values, 0, 1)
