"""Reference-audio input: formats, base64, mixdown, resampling as the reference does, and refusals."""

import base64
import io

import librosa
import numpy as np
import pytest
import soundfile as sf

from qtts_jax.io.reference_audio import SAMPLE_RATE, AudioLimits, load_reference_audio, prepare_reference
from qtts_jax.request import RequestError


def _voice_like(seconds: float, rate: int, channels: int = 2) -> np.ndarray:
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * rate)) / rate
    mono = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)) + 0.01 * rng.standard_normal(len(t))
    return np.stack([mono, 0.5 * mono], 1).astype(np.float32)[:, :channels]


def _encode(x: np.ndarray, rate: int, fmt: str, subtype: str) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


@pytest.mark.parametrize("fmt,subtype", [("WAV", "PCM_16"), ("WAV", "FLOAT"), ("FLAC", "PCM_24"),
                                         ("OGG", "VORBIS"), ("MP3", "MPEG_LAYER_III")])
def test_formats_decode_like_soundfile_then_mix_and_resample_like_the_reference(fmt, subtype):
    rate = 16000
    data = _encode(_voice_like(1.5, rate), rate, fmt, subtype)
    # The reference wrapper: soundfile decode, mean over channels, librosa.resample (soxr_hq) to 24 kHz.
    decoded, sr = sf.read(io.BytesIO(data), dtype="float32")
    expected = librosa.resample(decoded.mean(axis=-1).astype(np.float32), orig_sr=sr, target_sr=SAMPLE_RATE)
    got = load_reference_audio(data)
    assert (got.source_rate, got.channels) == (rate, 2)
    n = len(expected)  # Vorbis: PyAV keeps the encoder's end padding that libsndfile trims
    assert len(got.samples) >= n and len(got.samples) - n <= 1024
    np.testing.assert_allclose(got.samples[:n], expected, atol=1e-6)


def test_base64_data_url_and_path_give_the_same_audio(tmp_path):
    data = _encode(_voice_like(1.2, SAMPLE_RATE, 1), SAMPLE_RATE, "WAV", "PCM_16")
    path = tmp_path / "ref.wav"
    path.write_bytes(data)
    b64 = base64.b64encode(data).decode()
    outs = [load_reference_audio(x).samples for x in (data, b64, "data:audio/wav;base64," + b64, str(path), path)]
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    expected = sf.read(io.BytesIO(data), dtype="float32")[0]
    np.testing.assert_array_equal(outs[0], expected)  # 24 kHz mono passes through untouched


@pytest.mark.parametrize("source,message", [
    (b"", "empty"),
    (b"RIFF" + b"\x00" * 400, "could not be decoded"),
    ("not base64 at all, and no such file" * 10, "neither an existing file nor valid base64"),
    ("/no/such/reference.wav", "does not exist"),
])
def test_undecodable_input_is_refused_naming_the_field(source, message):
    with pytest.raises(RequestError, match=message) as info:
        load_reference_audio(source)
    assert info.value.field == "audio"


def test_length_limits():
    limits = AudioLimits(min_seconds=1.0, max_seconds=3.0)
    with pytest.raises(RequestError, match="at least 1 s"):
        prepare_reference(_voice_like(0.6, SAMPLE_RATE), SAMPLE_RATE, limits)
    with pytest.raises(RequestError, match="at most 3 s"):
        prepare_reference(_voice_like(3.5, SAMPLE_RATE), SAMPLE_RATE, limits)
    # a long file is refused without decoding all of it
    data = _encode(_voice_like(8.0, 8000), 8000, "WAV", "PCM_16")
    with pytest.raises(RequestError, match="at most 3 s"):
        load_reference_audio(data, limits)
    assert prepare_reference(_voice_like(2.0, 8000), 8000, limits).seconds == pytest.approx(2.0)


def test_silence_clipping_and_non_finite_are_refused():
    quiet = _voice_like(1.5, SAMPLE_RATE) * 1e-3
    with pytest.raises(RequestError, match="silent"):
        prepare_reference(quiet, SAMPLE_RATE)
    clipped = np.clip(_voice_like(1.5, SAMPLE_RATE) * 20, -1, 1)
    with pytest.raises(RequestError, match="clipped"):
        prepare_reference(clipped, SAMPLE_RATE)
    # a few full-scale peaks are normal and accepted
    ok = _voice_like(1.5, SAMPLE_RATE)
    ok[::1000] = 1.0
    prepare_reference(ok, SAMPLE_RATE)
    bad = _voice_like(1.5, SAMPLE_RATE)
    bad[10, 0] = np.nan
    with pytest.raises(RequestError, match="NaN"):
        prepare_reference(bad, SAMPLE_RATE)
    with pytest.raises(RequestError, match="sample rate"):
        prepare_reference(_voice_like(1.5, SAMPLE_RATE), 7)
