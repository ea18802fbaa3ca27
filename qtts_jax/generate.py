"""Batch generation of codec frames with the reference's semantics (HF `generate` on the talker).

Each row: prefill its prompt; then per frame k, choose code0 from the current logits (repetition
penalty over generated code0 only, EOS barred for k < 2, special ids suppressed), run the code
predictor for codes 1..15, and feed the summed frame embedding plus the k-th trailing text vector
through one talker step. N chosen code0 tokens give N-1 frames; a row stops at EOS, which is not a
frame. Rows are independent (`vmap` of the single-sequence step): a row's codes do not depend on
what else is in the batch, and its random draws come from its own seed folded with the frame index.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qtts_jax import nn
from qtts_jax.talker import sampling, transformer
from qtts_jax.config import ModelConfig
from qtts_jax.prompt import Prompt, embed_prompt
from qtts_jax.request import Request
from qtts_jax.talker import Talker
from qtts_jax.talker.transformer import KVCache, rows_layout


class RowState(NamedTuple):
    """What each row carries from frame to frame, besides its keys/values in the shared cache."""

    key_valid: jax.Array  # [S] cache rows that hold real tokens
    logits: jax.Array  # [V] float32, for the next code0
    hidden: jax.Array  # [H] final-normed talker state that produced `logits`
    seen: jax.Array  # [V] bool, code0 tokens generated so far
    done: jax.Array  # bool


class RowSettings(NamedTuple):
    """Per-row constants for the whole generation."""

    key: jax.Array
    talker: sampling.SamplingParams
    predictor: sampling.SamplingParams
    penalty: jax.Array
    max_frames: jax.Array
    position0: jax.Array  # RoPE position of the first generated frame = real prompt length
    trailing: jax.Array  # [N+1, H] trailing text vectors; rows past a request's own text are P(tts_pad)


def row_settings(req: Request, prompt_len: int, trailing: jax.Array) -> RowSettings:
    return RowSettings(
        key=jax.random.PRNGKey(req.seed),
        talker=sampling.SamplingParams.make(req.greedy, req.temperature, req.top_k, req.top_p),
        predictor=sampling.SamplingParams.make(
            req.subtalker_greedy, req.subtalker_temperature, req.subtalker_top_k, req.subtalker_top_p
        ),
        penalty=jnp.float32(req.repetition_penalty),
        max_frames=jnp.int32(req.max_frames),
        position0=jnp.int32(prompt_len),
        trailing=trailing,
    )


SEEDED_END = 0x7E0D  # folded into a row's key to draw where a seeded end falls (`frame_code0`)


def frame_code0(cfg: ModelConfig, state: RowState, s: RowSettings, k: jax.Array, choose=sampling.choose,
                seeded_ends: bool = False):
    """Code0 of frame k of ONE row, whether the row is now done, and the key its code predictor draws with.

    `choose` picks a token from processed logits (the jnp reference or the Pallas kernel's row form).
    `seeded_ends` (benchmarks on random weights, which rarely end on their own) ends the row at a frame drawn
    from its key and its prompt's length, between 2 and its cap, inside the program, as an end-of-speech token
    would: nothing on the host knows it in advance, and a load that sends one seed still gets varied ends.
    """
    logits = sampling.repetition_penalty(state.logits, state.seen, s.penalty)
    logits = sampling.talker_mask(logits, k, cfg.codec.eos)
    key_talker, key_predictor = jax.random.split(jax.random.fold_in(s.key, k))
    token = choose(logits, sampling.noise(key_talker, logits.shape[-1]), s.talker)
    done = state.done | (k >= s.max_frames)
    if seeded_ends:
        key = jax.random.fold_in(jax.random.fold_in(s.key, SEEDED_END), s.position0)
        end = jax.random.randint(key, (), 2, jnp.maximum(s.max_frames, 2) + 1)
        done = done | (k >= end)
    token = jnp.where(done, cfg.codec.eos, token)
    return token, done | (token == cfg.codec.eos), key_predictor


def frame_step(
    talker: Talker, cfg: ModelConfig, state: RowState, cache: KVCache, slots: jax.Array, s: RowSettings,
    k: jax.Array, row: jax.Array, choose=sampling.choose, attention=transformer.gather_rows_attention, layers=None,
    seeded_ends: bool = False,
):
    """Advance B rows by one frame each: row b is slot `slots[b]` of `cache`, at frame k[b], written at cache
    row `row[b]`. Returns (state, cache, frame codes [B, 16]). `choose` picks tokens and `attention` reads the
    cache (the jnp references by default, or the Pallas kernels of the same signatures); `layers`
    (`kernels.layer.LayerKernels`) runs the talker's and the code predictor's layers fused instead; `seeded_ends`
    as `frame_code0`'s.

    Code0 is chosen per row (`vmap`), then the code predictor makes codes 1..15 (per row, or batched through
    `layers`), and the talker step that follows is one batched call against the shared cache. Nothing mixes
    rows, so a row's codes do not depend on the batch.
    """
    choose = partial(choose, warps=sampling.Warps.of(s.talker, s.predictor))  # outside the vmap: one for the batch
    token, done, keys = jax.vmap(partial(frame_code0, cfg, choose=choose, seeded_ends=seeded_ends))(state, s, k)
    if layers is None:
        rest = jax.vmap(lambda *a: talker.predict(*a, choose)[0])(state.hidden, token, keys, s.predictor)
    else:
        rest = talker.predict_rows(state.hidden, token, keys, s.predictor, choose, layers)
    frame = jnp.concatenate([token[:, None], rest], axis=1)
    x = talker.embed_codes(frame) + jax.vmap(lambda t, k: t[jnp.minimum(k, t.shape[0] - 1)])(s.trailing, k)
    key_valid = state.key_valid.at[jnp.arange(row.shape[0]), row].set(True)
    logits, hidden, cache = talker.decode_rows(x, cache, slots, row, s.position0 + k, key_valid, attention, layers)
    seen = state.seen.at[jnp.arange(row.shape[0]), frame[:, 0]].set(True)
    return RowState(key_valid, logits, hidden, seen, done), cache, frame


def _bucket(n: int, smallest: int = 16) -> int:
    """Power-of-two padding so a handful of compiled shapes serve every prompt length."""
    return max(smallest, 1 << (n - 1).bit_length())


class Generator:
    """Compiled prefill and frame step for one model; `run` generates a padded batch. The programs are `jax.jit`
    over the talker's state (`params`, split once at load) with its graph definition bound, merged at trace time."""

    def __init__(self, graph, cfg: ModelConfig):
        self.cfg = cfg
        self._prefill = jax.jit(partial(self._prefill_batch, graph=graph, cfg=cfg), static_argnames="capacity")
        self._step = jax.jit(partial(self._step_batch, graph=graph, cfg=cfg), donate_argnums=(1, 2))

    @staticmethod
    def _prefill_batch(params, text, codec, frames, speaker_row, speaker, valid, trailing_ids, *, graph, cfg,
                       capacity):
        talker = nn.merge(graph, params)
        x = embed_prompt(talker, text, codec, frames, speaker_row, speaker)
        logits, hidden, cache = jax.vmap(lambda x, v: talker.prefill(x, v, capacity))(x, valid)
        cache = rows_layout(cache)
        key_valid = jnp.zeros((x.shape[0], capacity), bool).at[:, : x.shape[1]].set(valid)
        seen = jnp.zeros(logits.shape, bool)
        state = RowState(key_valid, logits, hidden, seen, jnp.zeros(x.shape[0], bool))
        return state, cache, talker.embed_text(trailing_ids)

    @staticmethod
    def _step_batch(params, state, cache, settings, k, row, *, graph, cfg):
        b = state.done.shape[0]
        return frame_step(nn.merge(graph, params), cfg, state, cache, jnp.arange(b), settings, jnp.full(b, k),
                          jnp.full(b, row))

    def run(self, params: dict, prompts: list[Prompt], requests: list[Request]) -> list[np.ndarray]:
        """Codes [frames, 16] per request (EOS and everything after it cut), from the talker's state ``params``."""
        cfg = self.cfg
        length = _bucket(max(len(p) for p in prompts))
        horizon = max(r.max_frames for r in requests)
        capacity = _bucket(length + horizon)
        batch = pad_prompts(prompts, length, cfg)
        trailing_len = _bucket(max(len(p.trailing) for p in prompts) + 1, 8)
        trailing_ids = np.full((len(prompts), trailing_len), cfg.text.tts_pad, np.int32)
        for i, p in enumerate(prompts):
            trailing_ids[i, : len(p.trailing)] = p.trailing
        state, cache, trailing = self._prefill(params, *batch, trailing_ids, capacity=capacity)
        settings = jax.tree.map(
            lambda *xs: jnp.stack(xs),
            *[row_settings(r, len(p), t) for r, p, t in zip(requests, prompts, trailing)],
        )
        frames = []
        for k in range(horizon):
            state, cache, frame = self._step(params, state, cache, settings, jnp.int32(k), jnp.int32(length + k))
            frames.append(frame)
            if bool(state.done.all()):
                break
        codes = np.stack(jax.device_get(frames), axis=1)  # [B, K, 16]
        out = []
        for i, r in enumerate(requests):
            first0 = codes[i, :, 0]
            eos = np.flatnonzero(first0 == cfg.codec.eos)
            n = min(int(eos[0]) if len(eos) else len(first0), r.max_frames)
            out.append(codes[i, :n])
        return out


def pad_prompts(prompts: list[Prompt], length: int, cfg: ModelConfig):
    """Left-pad every prompt to `length` (pads have no parts, so they embed to zero, and are masked)."""
    b, groups, h = len(prompts), cfg.num_code_groups, cfg.talker.hidden_size
    text = np.full((b, length), -1, np.int32)
    codec = np.full((b, length), -1, np.int32)
    frames = np.full((b, length, groups), -1, np.int32)
    speaker_row = np.full(b, -1, np.int32)
    speaker = np.zeros((b, h), np.float32)
    valid = np.zeros((b, length), bool)
    for i, p in enumerate(prompts):
        off = length - len(p)
        text[i, off:], codec[i, off:], frames[i, off:] = p.text, p.codec, p.frames
        valid[i, off:] = True
        if p.speaker is not None:
            speaker_row[i], speaker[i] = p.speaker_row + off, p.speaker
    return text, codec, frames, speaker_row, speaker, valid
