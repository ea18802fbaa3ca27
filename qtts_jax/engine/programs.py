"""The engine's compiled programs, as pure functions of (params, state, inputs): the state layout every slot
shares, prefill into slots, a step of n frames for some rows (which also writes them into the state's codes ring),
one streaming-codec call that reads its frames from that ring (a newcomer's first frame is a one-frame step and
codec call), and live text appended to a slot's trailing text. The loop (`core.Engine`) jits them once per ladder rung and
donates the state.

Rows are slots gathered by index; a row aimed past the last slot is padding: it reads the last slot (clipped) and
its writes are dropped, so one compiled size serves any number of live rows up to it.

`params` is the talker's state as split once at load (`Model.params`, a plain dict) and `graph` its graph
definition, bound by the engine: each program merges the two at trace time, so a call passes only arrays."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qtts_jax import nn
from qtts_jax.talker import sampling, transformer
from qtts_jax.codec import streaming as codec_streaming
from qtts_jax.codec.config import SAMPLES_PER_FRAME
from qtts_jax.engine.config import EngineConfig
from qtts_jax.generate import RowSettings, RowState, frame_step
from qtts_jax.config import ModelConfig
from qtts_jax.prompt import Prompt, embed_prompt
from qtts_jax.talker.transformer import KVCache, rows_layout

class EngineState(NamedTuple):
    rows: RowState  # each leaf [slots, ...]
    cache: KVCache  # [layers, slots, kv_heads, context, head_dim] each
    settings: RowSettings  # each leaf [slots, ...]
    k: jax.Array  # [slots] frames produced so far
    row0: jax.Array  # [slots] cache row of frame 0 (= the slot's prompt bucket)
    codes: jax.Array  # [slots, context, 16] each slot's frames by index, where the codec reads them (-1: none)


def outcome_shapes(kind: str, rows: int, frames: int, groups: int) -> tuple:
    """What the loop reads of a call of program `kind` ("step" or "codec") for `rows` rows and `frames` frames: a
    step's frames [frames, rows, groups] and valid flags [frames, rows]; a codec call's audio [rows, frames'
    samples]."""
    def codes(n):
        return jax.ShapeDtypeStruct((n, rows, groups), jnp.int32), jax.ShapeDtypeStruct((n, rows), jnp.bool_)

    def audio(n):
        return jax.ShapeDtypeStruct((rows, n * SAMPLES_PER_FRAME), jnp.float32)

    if kind == "step":
        return codes(frames)
    return audio(frames)


def take_rows(tree, idx):
    """Rows `idx` of every leaf (indices past the end read the last row: padding, never written back)."""
    return jax.tree.map(lambda a: jnp.take(a, idx, axis=0, mode="clip"), tree)


def put_rows(tree, idx, value):
    """Write rows `idx` of every leaf, dropping padding rows (indices past the end); in place under donation."""
    return jax.tree.map(lambda a, v: a.at[idx].set(v.astype(a.dtype), mode="drop"), tree, value)


def set_slot(tree, slot, value):
    """Write one slot's values into the batched tree (in place under donation)."""
    return jax.tree.map(lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), slot, 0), tree, value)


def blank_prompt(cfg, length: int):
    return Prompt(
        text=np.full(length, cfg.text.tts_pad, np.int32), codec=np.full(length, -1, np.int32),
        frames=np.full((length, cfg.num_code_groups), -1, np.int32), speaker_row=-1, speaker=None,
        trailing=np.zeros(0, np.int32),
    )


def init_state(cfg: ModelConfig, dtype, c: EngineConfig) -> EngineState:
    """Every slot empty and done, for a model of `cfg` in `dtype`; shapes fixed for the engine's life."""
    b = c.slots
    t = cfg.talker
    shape = (t.num_layers, b, t.num_kv_heads, c.context, t.head_dim)
    cache = KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    vocab, h = cfg.talker.vocab_size, cfg.talker.hidden_size
    rows = RowState(
        key_valid=jnp.zeros((b, c.context), bool), logits=jnp.zeros((b, vocab), jnp.float32),
        hidden=jnp.zeros((b, h), dtype), seen=jnp.zeros((b, vocab), bool), done=jnp.ones(b, bool),
    )
    def params():  # distinct buffers for each field: donated leaves must not alias
        return sampling.SamplingParams(
            jnp.ones(b, bool), jnp.ones(b, jnp.float32), jnp.zeros(b, jnp.int32), jnp.ones(b, jnp.float32)
        )

    settings = RowSettings(
        key=jnp.zeros((b, 2), jnp.uint32), talker=params(), predictor=params(), penalty=jnp.ones(b, jnp.float32),
        max_frames=jnp.zeros(b, jnp.int32), position0=jnp.zeros(b, jnp.int32),
        trailing=jnp.zeros((b, c.max_trailing + 1, h), dtype),
    )
    return EngineState(rows, cache, settings, jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.int32),
                       jnp.zeros((b, c.context, cfg.num_code_groups), jnp.int32))


def insert(params, state: EngineState, slots, text, codec, frames, speaker_row, speaker, valid, trailing, knobs,
            ints, *, graph, cfg):
    """Prefill R prompts of one bucket (the bucket is their length) into `slots` [R] together, resetting those
    slots' state; rows aimed past the last slot are padding and change nothing. Returns the state and a small
    array to wait on (the state is donated to the next step)."""
    bucket = text.shape[1]
    talker = nn.merge(graph, params)
    x = embed_prompt(talker, text, codec, frames, speaker_row, speaker)
    logits, hidden, cache = jax.vmap(lambda x, v: talker.prefill(x, v, bucket))(x, valid)
    cache = rows_layout(cache)
    big = KVCache(state.cache.k.at[:, slots, :, :bucket].set(cache.k, mode="drop"),
                  state.cache.v.at[:, slots, :, :bucket].set(cache.v, mode="drop"))
    context = big.k.shape[3]
    key_valid = jnp.zeros((text.shape[0], context), bool).at[:, :bucket].set(valid)
    rows = put_rows(state.rows, slots, RowState(key_valid, logits, hidden, jnp.zeros_like(logits, bool),
                                            jnp.zeros(text.shape[0], bool)))

    def row_settings(knobs, ints, trailing):
        temperature, top_p, penalty, sub_temperature, sub_top_p = (knobs[i] for i in range(5))
        seed, top_k, sub_top_k, max_frames, prompt_len, greedy, sub_greedy = (ints[i] for i in range(7))
        return RowSettings(
            key=jax.random.PRNGKey(seed),
            talker=sampling.SamplingParams(greedy != 0, temperature, top_k.astype(jnp.int32), top_p),
            predictor=sampling.SamplingParams(sub_greedy != 0, sub_temperature, sub_top_k.astype(jnp.int32),
                                              sub_top_p),
            penalty=penalty, max_frames=max_frames.astype(jnp.int32), position0=prompt_len.astype(jnp.int32),
            trailing=talker.embed_text(trailing),
        )

    settings = put_rows(state.settings, slots, jax.vmap(row_settings)(knobs, ints, trailing))
    k = state.k.at[slots].set(0, mode="drop")
    row0 = state.row0.at[slots].set(bucket, mode="drop")
    return state._replace(rows=rows, cache=big, settings=settings, k=k, row0=row0), logits[:, 0]


def append_text(params, state: EngineState, slot, start, ids, count, max_frames, *, graph):
    """Live text: the first `count` of `ids` [L] become trailing text vectors `start`, `start` + 1 ... of slot
    `slot` (the rest of `ids` is padding, dropped), and the slot's frame cap becomes `max_frames`."""
    at = jnp.where(jnp.arange(ids.shape[0]) < count, start + jnp.arange(ids.shape[0]), state.settings.trailing.shape[1])
    trailing = state.settings.trailing.at[slot, at].set(
        nn.merge(graph, params).embed_text(ids).astype(state.settings.trailing.dtype), mode="drop")
    max_frames = state.settings.max_frames.at[slot].set(max_frames)
    return state._replace(settings=state.settings._replace(trailing=trailing, max_frames=max_frames))


def _kernel_or_reference(name: str, what: str, reference, kernel, on_gpu: str = "pallas"):
    """`reference` ("jnp"), the Pallas `kernel(interpret)` ("pallas"; interpreted on CPU, for tests), or "auto":
    `on_gpu` on a GPU, the reference elsewhere (no Triton on CPU)."""
    if name == "auto":
        name = on_gpu if jax.default_backend() == "gpu" else "jnp"
    if name == "jnp":
        return reference
    if name == "pallas":
        return kernel(jax.default_backend() == "cpu")
    raise ValueError(f"unknown {what} {name!r} (jnp, pallas or auto)")


def chooser(name: str):
    """The per-row token chooser the frame step uses."""

    def kernel(interpret):
        from qtts_jax.kernels.sampling import choose_row

        return partial(choose_row, interpret=interpret)

    pick = _kernel_or_reference(name, "sampler", sampling.choose, kernel)

    def scoped(*args, **kwargs):
        with jax.named_scope("sampling"):  # names its kernels in profiles (bench/kernels.py)
            return pick(*args, **kwargs)

    return scoped


def attender(name: str):
    """How the frame step's talker reads each row's keys and values from the shared cache."""

    def kernel(interpret):
        from qtts_jax.kernels.attention import rows_attention

        return partial(rows_attention, interpret=interpret)

    return _kernel_or_reference(name, "attention", transformer.gather_rows_attention, kernel)


def layer_kernels(name: str):
    """How the frame step runs the talker's and the code predictor's layers: "pallas" (four fused kernels a layer,
    `kernels.layer`), "jnp" (XLA's own fusions of the model's code: None), or "auto": XLA's on a GPU too, since
    the kernels' Triton products are slower than cuBLAS's (docs/benchmarks.md)."""

    def kernel(interpret):
        from qtts_jax.kernels import layer

        return layer.kernels(interpret=interpret)

    return _kernel_or_reference(name, "layers", None, kernel, on_gpu="jnp")


def step(params, state: EngineState, idx, limit, *, graph, cfg, choose, attention, layers=None, seeded_ends=False,
         n: int):
    """`n` frames for the rows of slots `idx` [B] in one scan, row j making at most `limit[j]` of them (a live
    text stream stops before the frame that would read text it does not have yet; padding rows aimed past the
    last slot have 0). Only those rows are read and written: a row past its limit keeps its state, and the cache
    row its discarded frame wrote is written again by the real one. Returns frames [n, B, 16] and valid [n, B]
    (false past a row's end or its limit)."""
    rows = take_rows(state.rows, idx)
    rows = rows._replace(done=rows.done | (limit <= 0))
    settings, k0, row0 = take_rows(state.settings, idx), take_rows(state.k, idx), take_rows(state.row0, idx)
    talker = nn.merge(graph, params)

    def body(carry, t):
        rows, cache, k, codes = carry
        active = t < limit
        new_rows, cache, frame = frame_step(talker, cfg, rows, cache, idx, settings, k, row0 + k, choose,
                                            attention, layers, seeded_ends)
        new_rows = jax.tree.map(lambda a, b: jnp.where(active.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
                                new_rows, rows)
        codes = codes.at[idx, k].set(jnp.where((new_rows.done | ~active)[:, None], -1, frame), mode="drop")
        k = jnp.where(rows.done | ~active, k, k + 1)
        return (new_rows, cache, k, codes), (frame, active & ~new_rows.done)

    (rows, cache, k, codes), out = jax.lax.scan(body, (rows, state.cache, k0, state.codes), jnp.arange(n))
    return state._replace(rows=put_rows(state.rows, idx, rows), cache=cache, k=put_rows(state.k, idx, k),
                          codes=codes), out


def codec(params, state: codec_streaming.StreamState, ring, idx, fresh, start, count, *, cfg, n: int):
    """One streaming-codec call for the slots `idx` [B], reading their frames where the step wrote them (`ring`,
    the engine state's `codes`): row j decodes frames start[j] .. start[j] + count[j] - 1 (at most `n`), fewer
    where the ring says a frame was never made (its stream ended first). So the loop can queue this call right
    behind the step that makes the frames, before it has read them."""
    codes = ring.at[idx[:, None], start[:, None] + jnp.arange(n)].get(mode="clip")  # [B, n, 16]
    made = jnp.cumprod(codes[..., 0] >= 0, axis=1).sum(axis=1)  # a stream's frames are a prefix
    return decode_frames(params, state, idx, fresh, jnp.maximum(codes, 0), jnp.minimum(count, made), cfg=cfg)


def decode_frames(params, state: codec_streaming.StreamState, idx, fresh, codes, count, *, cfg):
    """The streaming codec for the slots `idx` [B]: row j decodes its first `count[j]` frames of `codes[j]`,
    from a zero state where `fresh[j]` (a new stream). Only those slots' state is touched."""
    with jax.named_scope("codec"):  # names its kernels in profiles (bench/kernels.py)
        return _decode_frames(params, state, idx, fresh, codes, count, cfg=cfg)


def _decode_frames(params, state, idx, fresh, codes, count, *, cfg):
    rows = take_rows(state, idx)
    rows = jax.tree.map(lambda a: jnp.where(fresh.reshape((-1,) + (1,) * (a.ndim - 1)), jnp.zeros_like(a), a), rows)
    audio, rows = codec_streaming.decode_step(params, cfg, rows, codes, count)
    return audio, put_rows(state, idx, rows)
