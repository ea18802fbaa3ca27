"""Word timings estimated from the prompt layout: the frame at which each text token reaches the talker, and the
words placed from it (serving/audio/word_timings.py). Over SSE and both WebSockets: test_server_text.py."""

import re

import numpy as np
import pytest

from qtts_jax.engine.job import Job
from qtts_jax.prompt import build_prompt, text_entry_frames
from qtts_jax.request import Request
from serving.audio.word_timings import estimate

TEXT = "Words reach the talker, one a frame."


def job(model, non_streaming: bool) -> Job:
    req = Request(TEXT, speaker="ryan", non_streaming=non_streaming).resolved(model.cfg, model.defaults)
    return Job(req, build_prompt(model.cfg, model.tokenizer, req), bucket=64, frames_cap=100, schedule=(1,))


@pytest.mark.parametrize("non_streaming", [True, False])
def test_entry_frames_follow_the_prompt_layout(tiny_model, non_streaming):
    ids = tiny_model.tokenizer.encode(TEXT)
    prompt = job(tiny_model, non_streaming).prompt
    entry = text_entry_frames(prompt, len(ids))
    if non_streaming:  # all in the prompt, in order, before the first frame
        assert not entry.any() and ids == [t for t in prompt.text if t in ids][:len(ids)]
    else:  # the first beside codec_bos at the prompt's end, then trailing[k - 1] beside frame k's step
        assert list(entry) == list(range(len(ids)))
        assert prompt.text[-1] == ids[0] and list(prompt.trailing[:len(ids) - 1]) == ids[1:]


def test_words_are_monotonic_within_the_audio_and_never_before_their_text(tiny_model):
    words = estimate(job(tiny_model, non_streaming=True), tiny_model.tokenizer, 40, 1.0, 3.2)
    assert [w["word"] for w in words] == TEXT.split()
    assert words[0]["start"] == 1.0 and words[-1]["end"] == 4.2
    assert all(a["start"] <= a["end"] == b["start"] for a, b in zip(words, words[1:]))
    # streaming text and fewer frames than tokens (a capped stream): a word waits for its first token's frame
    # (tiny-random: token k is character k, fed at frame k; 80 ms a frame here)
    streamed = estimate(job(tiny_model, non_streaming=False), tiny_model.tokenizer, 31, 0.0, 31 * 0.08)
    assert [w["start"] for w in streamed] == [round(0.08 * m.start(), 3) for m in re.finditer(r"\S+", TEXT)]
