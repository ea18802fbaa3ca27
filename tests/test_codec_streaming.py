"""The streaming codec decoder equals the full single-pass decode, per slot, whatever the chunking.

Error metric: max |streamed - full| / max |full|. The floor is float rounding, which the random model
amplifies ~25x through the vocoder: the full decode of the same codes in a batch of 1 vs 4 already differs
by ~5e-6, so streaming cannot reach ~1e-6 here; it measures 5e-6 to 9e-6 against TOL (test_codec's 1e-5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qtts_jax import nn
from qtts_jax.codec.config import CodecConfig
from qtts_jax.presets import tiny_codec_config
from qtts_jax.codec.decoder import decode
from qtts_jax.codec.streaming import decode_step, init_state
from qtts_jax.codec.weights import load_codec_decoder, random_codec_decoder

TOL = 1e-5
SPF = 1920
FRAMES = 100  # past the 72-frame attention window, so old keys must drop out of it
SLOTS = 4  # every test uses this many slots, so each chunk size compiles once for the whole file


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def cfg():
    return CodecConfig.from_dict(tiny_codec_config())


@pytest.fixture(scope="module")
def params(cfg):
    return nn.split(random_codec_decoder(cfg, seed=0))[1]


@pytest.fixture(scope="module")
def codes():
    """One stream of FRAMES frames per slot."""
    return np.random.default_rng(0).integers(0, 2048, size=(SLOTS, FRAMES, 16), dtype=np.int32)


@pytest.fixture(scope="module")
def full(params, cfg, codes):
    audio = np.asarray(decode(params, cfg, codes))
    assert np.mean(np.abs(audio) >= 1.0) < 0.01, "random model saturates; parity would be meaningless"
    return audio


def stream(params, cfg, codes: np.ndarray, n: int) -> np.ndarray:
    """Every slot decodes its whole row n frames at a time; the last chunk is padded on the right and its
    extra audio dropped (the decoder is causal, so padding cannot reach earlier samples)."""
    frames = codes.shape[1]
    padded = np.pad(codes, ((0, 0), (0, -frames % n), (0, 0)))
    state, count = init_state(cfg, codes.shape[0]), jnp.full(codes.shape[0], n, jnp.int32)
    pieces = []
    for start in range(0, padded.shape[1], n):
        audio, state = decode_step(params, cfg, state, padded[:, start : start + n], count)
        pieces.append(np.asarray(audio))
    np.testing.assert_array_equal(state.position, padded.shape[1])
    return np.concatenate(pieces, axis=1)[:, : frames * SPF]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 25])
def test_streaming_equals_full_decode(params, cfg, codes, full, n):
    assert rel_err(stream(params, cfg, codes, n), full) <= TOL


def slot(tree, i: int) -> list[np.ndarray]:
    return [np.asarray(leaf[i]) for leaf in jax.tree.leaves(tree)]


def test_slots_at_different_offsets(params, cfg, codes, full):
    """Four slots, chunks of 2 frames, 60 steps. Slot 0 plays stream 0 with a pause (steps 20-24); slot 1
    joins with stream 1 at step 5; slot 2 plays stream 2 for 30 frames, is reset, then plays stream 3 for
    90; slot 3 stays idle. Idle slots get junk codes. Each stream must equal its own full decode (a prefix
    of it, for streams cut short), and an idle slot's state must not change at all."""
    n = 2
    junk = np.random.default_rng(1).integers(0, 2048, size=(SLOTS, n, 16), dtype=np.int32)
    stream_of, cursor = [0, 1, 2, None], [0] * SLOTS
    heard = {s: [] for s in range(SLOTS)}
    state = init_state(cfg, SLOTS)
    layout = jax.tree.map(lambda a: (a.shape, a.dtype), state)
    for step in range(60):
        if step in (5, 15):
            joining = 1 if step == 5 else 2
            fresh = init_state(cfg, 1)
            before, state = state, jax.tree.map(lambda a, z: a.at[joining].set(z[0]), state, fresh)
            assert all(not leaf.any() for leaf in slot(state, joining))
            for other in set(range(SLOTS)) - {joining}:
                for a, b in zip(slot(before, other), slot(state, other)):
                    np.testing.assert_array_equal(a, b)
            if joining == 2:
                stream_of[2], cursor[2] = 3, 0
        active = np.array([step < 20 or 25 <= step < 55, 5 <= step < 55, True, False])
        chunk = junk.copy()
        for s in np.flatnonzero(active):
            chunk[s] = codes[stream_of[s], cursor[s] : cursor[s] + n]
            cursor[s] += n
        before = state
        audio, state = decode_step(params, cfg, state, chunk, jnp.asarray(active * n, jnp.int32))
        assert jax.tree.map(lambda a: (a.shape, a.dtype), state) == layout  # else the next call recompiles
        for s in range(SLOTS):
            if active[s]:
                heard[stream_of[s]].append(np.asarray(audio[s]))
            else:
                for a, b in zip(slot(before, s), slot(state, s)):
                    np.testing.assert_array_equal(a, b)

    np.testing.assert_array_equal(state.position, [100, 100, 90, 0])
    assert not any(leaf.any() for leaf in slot(state, 3))
    for s, frames in [(0, 100), (1, 100), (2, 30), (3, 90)]:
        assert rel_err(np.concatenate(heard[s]), full[s, : frames * SPF]) <= TOL, f"stream {s}"


def test_slots_decode_different_chunk_sizes_in_one_call(params, cfg, codes, full):
    """One call per step of at most 4 frames, each slot taking its own 0-4 (the engine's one codec call per
    iteration): the frames past a slot's count are junk and must not reach its audio or its state."""
    rng = np.random.default_rng(2)
    n, cursor = 4, np.zeros(SLOTS, int)
    heard = {s: [] for s in range(SLOTS)}
    state = init_state(cfg, SLOTS)
    while (cursor < FRAMES).any():
        count = np.minimum(rng.integers(0, n + 1, SLOTS), FRAMES - cursor)
        chunk = rng.integers(0, 2048, size=(SLOTS, n, 16), dtype=np.int32)
        for s in range(SLOTS):
            chunk[s, : count[s]] = codes[s, cursor[s] : cursor[s] + count[s]]
        audio, state = decode_step(params, cfg, state, chunk, jnp.asarray(count, jnp.int32))
        for s in range(SLOTS):
            heard[s].append(np.asarray(audio[s, : count[s] * SPF]))
        cursor += count
    np.testing.assert_array_equal(state.position, FRAMES)
    for s in range(SLOTS):
        assert rel_err(np.concatenate(heard[s]), full[s]) <= TOL, f"slot {s}"


def test_streaming_matches_reference_full_decode(reference_codec, codec_checkpoint, codes):
    """Anchored to the live reference, not just to our `decode`: the reference's single-pass decoder
    (``model.decoder``, not its 300/25-chunked ``decode``) on the same random model."""
    import torch

    reference, checkpoint = reference_codec, codec_checkpoint
    cfg = CodecConfig.from_file(checkpoint)
    params = nn.split(load_codec_decoder(checkpoint, cfg))[1]
    with torch.no_grad():
        ref = reference.decoder(torch.from_numpy(codes.astype(np.int64)).transpose(1, 2)).squeeze(1).numpy()
    assert rel_err(stream(params, cfg, codes, 7), ref) <= TOL
