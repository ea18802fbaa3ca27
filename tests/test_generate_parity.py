"""Greedy code sequences equal the official reference's, exactly, for every prompt mode.

The reference side tokenizes with its own Qwen2TokenizerFast from the checkpoint directory and runs
`Qwen3TTSForConditionalGeneration.generate`; our side loads the same directory with `load_model`.
"""

from __future__ import annotations

import numpy as np
import pytest

from qtts_jax.model import load_model
from qtts_jax.request import Request, VoicePrompt

FRAMES = 6


@pytest.fixture(scope="module")
def models(reference_checkpoint, checkpoint_model):
    """(kind, size, shape) -> (reference model, reference tokenizer, our model), cached."""
    cache = {}

    def get(kind, size="1b7", shape="narrow_predictor_mqa"):
        if (kind, size, shape) not in cache:
            from transformers import AutoTokenizer

            ref, directory = reference_checkpoint(kind, size, shape)
            tok = AutoTokenizer.from_pretrained(directory)
            cache[kind, size, shape] = (ref, tok, checkpoint_model(kind, size, shape))
        return cache[kind, size, shape]

    return get


def reference_codes(ref, tok, reqs: list[Request], non_streaming: bool, frames: int = FRAMES) -> list[np.ndarray]:
    """Run the reference generate on a batch of requests (greedy; N frames = N + 1 tokens)."""
    import torch

    def ids(text):
        return torch.tensor([tok(text)["input_ids"]])

    kwargs = {}
    if any(r.instruct for r in reqs):
        kwargs["instruct_ids"] = [ids(f"<|im_start|>user\n{r.instruct}<|im_end|>\n") if r.instruct else None for r in reqs]
    if any(r.voice is not None for r in reqs):
        kwargs["voice_clone_prompt"] = dict(
            ref_code=[None if r.voice.ref_codes is None else torch.tensor(r.voice.ref_codes) for r in reqs],
            ref_spk_embedding=[torch.tensor(r.voice.xvector) for r in reqs],
            x_vector_only_mode=[r.voice.ref_codes is None for r in reqs],
            icl_mode=[r.voice.ref_codes is not None for r in reqs],
        )
        kwargs["ref_ids"] = [
            ids(f"<|im_start|>assistant\n{r.voice.ref_text}<|im_end|>\n") if r.voice.ref_text else None for r in reqs
        ]
    codes, _ = ref.generate(
        input_ids=[ids(f"<|im_start|>assistant\n{r.text}<|im_end|>\n<|im_start|>assistant\n") for r in reqs],
        languages=[r.language for r in reqs],
        speakers=[r.speaker for r in reqs],
        non_streaming_mode=non_streaming,
        max_new_tokens=frames + 1,
        do_sample=False,
        subtalker_dosample=False,
        **kwargs,
    )
    return [c.numpy() for c in codes]


def ours(model, reqs: list[Request], non_streaming: bool, frames: int = FRAMES) -> list[np.ndarray]:
    import dataclasses

    reqs = [
        dataclasses.replace(r, greedy=True, subtalker_greedy=True, max_frames=frames, non_streaming=non_streaming)
        for r in reqs
    ]
    return [r.codes for r in model.generate(reqs)]


def assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.shape[1] == 16
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("non_streaming", [True, False], ids=["non_streaming", "streaming_text"])
@pytest.mark.parametrize(
    "request_",
    [
        Request("Hello there, how are you today?", speaker="ryan", language="english"),
        Request("Good morning!", speaker="Vivian", language="auto"),
        Request("Dialect speaker, chinese turns into his dialect.", speaker="eric", language="chinese"),
        Request("Dialect speaker with auto.", speaker="dylan", language="auto"),
        Request("Speak it slowly.", speaker="serena", language="english", instruct="Very sad and slow."),
    ],
    ids=["english", "auto", "dialect_chinese", "dialect_auto", "instruct"],
)
def test_custom_voice(models, request_, non_streaming):
    ref, tok, model = models("custom_voice")
    assert_same(ours(model, [request_], non_streaming), reference_codes(ref, tok, [request_], non_streaming))


@pytest.mark.parametrize("instruct", ["A deep, calm male voice.", None])
def test_voice_design(models, instruct):
    ref, tok, model = models("voice_design")
    req = Request("Designing a voice from words.", language="english", instruct=instruct)
    assert_same(ours(model, [req], True), reference_codes(ref, tok, [req], True))


def _voice(model, rng, icl: bool, ref_frames: int = 5) -> VoicePrompt:
    h = model.cfg.talker.hidden_size
    xvec = rng.standard_normal(h).astype(np.float32)
    if not icl:
        return VoicePrompt(xvector=xvec)
    codes = rng.integers(0, 2048, size=(ref_frames, 16))
    return VoicePrompt(xvector=xvec, ref_codes=codes, ref_text="This is what the reference says.")


@pytest.mark.parametrize("non_streaming", [True, False], ids=["non_streaming", "streaming_text"])
@pytest.mark.parametrize(
    "mode,text,ref_frames",
    [
        ("xvector", "Cloned from an x-vector only.", 5),
        ("icl", "A long target text, longer than the reference codes are.", 5),
        ("icl", "Short.", 40),
    ],
    ids=["xvector", "icl_text_longer", "icl_codes_longer"],
)
def test_base_voice_clone(models, mode, text, ref_frames, non_streaming):
    ref, tok, model = models("base")
    rng = np.random.default_rng(ref_frames)
    req = Request(text, language="english", voice=_voice(model, rng, mode == "icl", ref_frames))
    assert_same(ours(model, [req], non_streaming), reference_codes(ref, tok, [req], non_streaming))


def test_batch_of_different_lengths_matches_reference_and_singles(models):
    """Left-padded batches: each row equals the reference batch row and our own single-request run."""
    ref, tok, model = models("custom_voice")
    reqs = [
        Request("One.", speaker="aiden", language="english"),
        Request("A rather longer sentence to make the prompts differ in length.", speaker="sohee", language="korean"),
        Request("Middle length text here.", speaker="ono_anna", language="japanese"),
    ]
    batch = ours(model, reqs, False)
    assert_same(batch, reference_codes(ref, tok, reqs, False))
    assert_same(batch, [ours(model, [r], False)[0] for r in reqs])


@pytest.mark.parametrize("shape", ["equal_width_gqa", "talker_mqa"])
def test_other_shapes(models, shape):
    """Predictor as wide as the talker (no projection), and MQA in the talker."""
    ref, tok, model = models("custom_voice", "1b7", shape)
    req = Request("Other shapes of the same model.", speaker="uncle_fu", language="english")
    for non_streaming in (True, False):
        assert_same(ours(model, [req], non_streaming), reference_codes(ref, tok, [req], non_streaming))


def test_long_generation_with_eos_cut(models):
    """Many frames (repetition penalty in play over a long history) and the EOS cut, if EOS comes."""
    ref, tok, model = models("custom_voice")
    req = Request("Keep going for a while.", speaker="ryan", language="english")
    a = ours(model, [req], True, frames=40)
    assert_same(a, reference_codes(ref, tok, [req], True, frames=40))


def test_eos_stops_rows_early_in_a_batch(models, tmp_path):
    """Make EOS win at frame 3 of one request (its head row = 1.5 x the row of the code chosen there):
    that row stops early while the others run on, exactly as in the reference."""
    import torch
    from ref_model import build_reference_model, config_dict, write_checkpoint

    ref, tok, model = models("custom_voice")
    reqs = [Request("This one ends early.", speaker="ryan", language="english"),
            Request("This one has a different text and goes on.", speaker="vivian", language="english")]
    chosen = reference_codes(ref, tok, reqs[:1], True, frames=FRAMES)[0][3, 0]
    eos_ref = build_reference_model(config_dict("custom_voice"))
    eos_ref.load_state_dict(ref.state_dict())
    with torch.no_grad():
        head = eos_ref.talker.codec_head.weight
        head[model.cfg.codec.eos] = 1.5 * head[int(chosen)]
    directory = write_checkpoint(tmp_path / "eos", eos_ref)
    expected = reference_codes(eos_ref, tok, reqs, True, frames=FRAMES)
    assert min(len(c) for c in expected) < FRAMES
    assert_same(ours(load_model(directory), reqs, True, frames=FRAMES), expected)
