"""Fine-tuning data: every bad line is refused before anything is encoded, naming its line and field; good lines
become our encoders' codes and x-vectors, cached beside the JSONL."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf

from qtts_jax.codec import encoder as codec_encoder
from qtts_jax.finetune import data
from qtts_jax.finetune.data import DataError

RATE = 24000


def voice(path, seconds, seed=0):
    t = np.arange(int(seconds * RATE)) / RATE
    rng = np.random.default_rng(seed)
    wav = 0.3 * np.sin(2 * np.pi * (150 + 40 * seed) * t) + 0.05 * rng.standard_normal(len(t))
    sf.write(path, wav.astype(np.float32), RATE)
    return path


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture
def clips(tmp_path):
    return {"a": voice(tmp_path / "a.wav", 1.5, 1), "b": voice(tmp_path / "b.wav", 2.0, 2),
            "ref": voice(tmp_path / "ref.wav", 1.2, 3)}


GOOD = {"audio": "a.wav", "text": "hello there", "ref_audio": "ref.wav"}


@pytest.mark.parametrize("row, field, says", [
    ('{"audio": "a.wav", "text": ', "json", "not valid JSON"),
    ('["a.wav"]', "json", "JSON object"),
    ({"text": "hi", "ref_audio": "ref.wav"}, "audio", "missing"),
    ({**GOOD, "text": "   "}, "text", "empty"),
    ({**GOOD, "text": 3}, "text", "not a string"),
    ({**GOOD, "audio": "nowhere.wav"}, "audio", "does not exist"),
    ({**GOOD, "ref_audio": "short.wav"}, "ref_audio", "at least 1 s"),
    ({**GOOD, "audio": "long.wav"}, "audio", "at most 30 s"),
    ({**GOOD, "audio": "junk.wav"}, "audio", "could not be decoded"),
])
def test_a_bad_line_is_refused_naming_line_and_field(tmp_path, clips, tiny_base_model, monkeypatch, row, field, says):
    voice(tmp_path / "short.wav", 0.5)
    voice(tmp_path / "long.wav", 31)
    (tmp_path / "junk.wav").write_bytes(b"RIFF not really a wave file")
    jsonl = write_jsonl(tmp_path / "train.jsonl", [GOOD, {**GOOD, "audio": "b.wav"}, row])
    monkeypatch.setattr(codec_encoder, "encode", lambda *a, **k: pytest.fail("encoded before every line was checked"))
    with pytest.raises(DataError) as err:
        data.prepare(jsonl, tiny_base_model.voice_encoders)
    assert (err.value.line, err.value.field) == (3, field)
    assert f"train.jsonl:3: {field}:" in str(err.value) and says in str(err.value)


def test_every_bad_line_is_named_at_once(tmp_path, clips, tiny_base_model):
    (tmp_path / "junk.wav").write_bytes(b"RIFF not really a wave file")
    jsonl = write_jsonl(tmp_path / "train.jsonl", [
        {**GOOD, "audio": "junk.wav"}, GOOD, '{"audio": "a.wav"', {"audio": "a.wav", "ref_audio": "ref.wav"}])
    with pytest.raises(DataError) as err:
        data.prepare(jsonl, tiny_base_model.voice_encoders)
    assert [(p.line, p.field) for p in err.value.problems] == [(1, "audio"), (3, "json"), (4, "text")]
    assert str(err.value).splitlines()[0] == "3 bad lines:"
    assert all(f"train.jsonl:{n}: " in str(err.value) for n in (1, 3, 4))


def test_missing_jsonl_is_refused(tmp_path, tiny_base_model):
    with pytest.raises(DataError, match="cannot be read"):
        data.prepare(tmp_path / "absent.jsonl", tiny_base_model.voice_encoders)


def test_lines_become_codes_and_xvectors_and_are_cached(tmp_path, clips, tiny_base_model, monkeypatch):
    jsonl = write_jsonl(tmp_path / "train.jsonl", [GOOD, {**GOOD, "audio": str(clips["b"]), "text": "second"}])
    enc = tiny_base_model.voice_encoders
    examples = data.prepare(jsonl, enc)
    assert [e.text for e in examples] == ["hello there", "second"]
    for e, seconds, name in zip(examples, (1.5, 2.0), ("a", "b")):
        wav, _ = sf.read(clips[name], dtype="float32")
        np.testing.assert_array_equal(e.codes, codec_encoder.encode(enc.codec_encoder_params, enc.codec_cfg, wav))
        assert e.codes.shape == (int(np.ceil(seconds * 12.5)), 16)
    xvector = tiny_base_model.clone_voice(clips["ref"], xvector_only=True).xvector
    np.testing.assert_allclose(examples[0].xvector, xvector, rtol=1e-6)
    assert len(list((tmp_path / "train.jsonl.cache").glob("*.npy"))) == 3  # two clips, one reference
    monkeypatch.setattr(codec_encoder, "encode", lambda *a, **k: pytest.fail("a cached clip was encoded again"))
    again = data.prepare(jsonl, enc)
    for a, b in zip(examples, again):
        np.testing.assert_array_equal(a.codes, b.codes)
