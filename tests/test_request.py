"""Request validation: every unusable field is refused before any device work, naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from qtts_jax import presets
from qtts_jax.config import ModelConfig, SamplingDefaults
from qtts_jax.request import Request, RequestError, VoicePrompt

CUSTOM = ModelConfig.from_dict(presets.tiny_config("custom_voice", "1b7"))
CUSTOM_SMALL = ModelConfig.from_dict(presets.tiny_config("custom_voice", "0b6"))
DESIGN = ModelConfig.from_dict(presets.tiny_config("voice_design", "1b7"))
BASE = ModelConfig.from_dict(presets.tiny_config("base", "1b7"))
DEFAULTS = SamplingDefaults()
XVEC = np.zeros(BASE.talker.hidden_size, np.float32)


@pytest.mark.parametrize(
    "cfg,req,field",
    [
        (CUSTOM, Request("", speaker="ryan"), "text"),
        (CUSTOM, Request("   ", speaker="ryan"), "text"),
        (CUSTOM, Request("Hi"), "speaker"),
        (CUSTOM, Request("Hi", speaker="nobody"), "speaker"),
        (CUSTOM, Request("Hi", speaker="ryan", language="klingon"), "language"),
        (CUSTOM, Request("Hi", speaker="ryan", language="sichuan_dialect"), "language"),
        (CUSTOM_SMALL, Request("Hi", speaker="ryan", instruct="Whisper."), "instruct"),
        (DESIGN, Request("Hi", speaker="ryan"), "speaker"),
        (DESIGN, Request("Hi", voice=VoicePrompt(XVEC)), "voice"),
        (BASE, Request("Hi"), "voice"),
        (BASE, Request("Hi", instruct="Loud."), "instruct"),
        (BASE, Request("Hi", voice=VoicePrompt(np.zeros(3))), "voice"),
        (BASE, Request("Hi", voice=VoicePrompt(XVEC, np.zeros((4, 15), int), "ref")), "voice"),
        (BASE, Request("Hi", voice=VoicePrompt(XVEC, np.full((4, 16), 2048), "ref")), "voice"),
        (BASE, Request("Hi", voice=VoicePrompt(XVEC, np.zeros((4, 16), int))), "voice"),
        (CUSTOM, Request("Hi", speaker="ryan", temperature=0), "temperature"),
        (CUSTOM, Request("Hi", speaker="ryan", top_p=1.5), "top_p"),
        (CUSTOM, Request("Hi", speaker="ryan", top_k=-1), "top_k"),
        (CUSTOM, Request("Hi", speaker="ryan", repetition_penalty=0), "repetition_penalty"),
        (CUSTOM, Request("Hi", speaker="ryan", max_frames=0), "max_frames"),
        (CUSTOM, Request("Hi", speaker="ryan", subtalker_temperature=-1), "subtalker_temperature"),
    ],
)
def test_bad_field_is_named(cfg, req, field):
    with pytest.raises(RequestError) as err:
        req.resolved(cfg, DEFAULTS)
    assert err.value.field == field


def test_defaults_follow_the_reference_wrapper():
    r = Request("Hi", speaker="Ryan", language="English").resolved(CUSTOM, DEFAULTS)
    assert (r.language, r.non_streaming, r.greedy, r.temperature, r.top_k, r.max_frames) == (
        "english", True, False, 0.9, 50, 2047,
    )
    b = Request("Hi", voice=VoicePrompt(XVEC)).resolved(BASE, DEFAULTS)
    assert b.non_streaming is False  # voice clone feeds text in streaming layout by default
    d = Request("Hi", instruct="").resolved(DESIGN, SamplingDefaults(do_sample=False, max_new_tokens=11))
    assert d.instruct is None and d.greedy is True and d.max_frames == 10
