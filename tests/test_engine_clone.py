"""Cloned voices in the streaming engine (Base model): equal to `Model.generate`, isolated in a batch."""

from __future__ import annotations

import numpy as np
import pytest

from qtts_jax.engine import Engine
from qtts_jax.request import Request, VoicePrompt
from support import GREEDY, STREAMING, run

CONFIG = STREAMING  # test_engine's: its programs come from the compilation cache


@pytest.fixture(scope="module")
def model(tiny_base_model):
    return tiny_base_model


@pytest.fixture(scope="module")
def engine(model):
    e = Engine(model, CONFIG)
    e.warmup()
    return e


def _voices(model):
    rng = np.random.default_rng(1)
    h, groups = model.cfg.talker.hidden_size, model.cfg.num_code_groups
    xvec = lambda: rng.standard_normal(h).astype(np.float32)  # noqa: E731
    codes = lambda n: rng.integers(0, 2048, (n, groups)).astype(np.int32)  # noqa: E731
    return {
        "icl_a": VoicePrompt(xvec(), codes(11), "Reference words."),
        "icl_b": VoicePrompt(xvec(), codes(23), "Other ones, somewhat longer."),
        "xvec": VoicePrompt(xvec()),
    }


def test_icl_stream_continues_the_reference_like_model_generate(engine, model):
    voices = _voices(model)
    for name, voice in voices.items():
        req = Request("Hello there, clone.", voice=voice, max_frames=10, **GREEDY)
        (stream, col), = run(engine, [(0, req)])
        (expected,) = model.generate(req)
        assert col.final.error is None, name
        np.testing.assert_array_equal(np.stack(stream.codes), expected.codes)
        # the streaming codec starts from the reference's state: same audio as decode(ref + new) minus the ref
        np.testing.assert_allclose(col.audio, expected.audio, atol=2e-5, err_msg=name)
        if voice.ref_codes is not None:  # and the reference context matters, so the check above has teeth
            assert np.abs(model.decode(expected.codes) - expected.audio).max() > 1e-3


def test_cloned_voices_are_isolated_in_one_batch(engine, model):
    voices = _voices(model)
    reqs = [Request(t, voice=v, seed=s, max_frames=9)
            for (t, v, s) in [("One voice speaking.", voices["icl_a"], 3), ("Another one.", voices["xvec"], 4),
                              ("And a third voice.", voices["icl_b"], 5), ("Again the first.", voices["icl_a"], 6)]]
    together = run(engine, [(0, r) for r in reqs])
    for req, (stream, col) in zip(reqs, together):
        (solo_stream, solo), = run(engine, [(0, req)])
        np.testing.assert_array_equal(np.stack(stream.codes), np.stack(solo_stream.codes))
        # Audio to the streaming codec's rounding floor (test_codec_streaming's 1e-5): rows share codec calls
        # whose chunk length is the longest due chunk, so a row's convolutions run at other lengths than alone.
        # A voice leaking into another would differ by ~1e-1.
        np.testing.assert_allclose(col.audio, solo.audio, atol=1e-5)
