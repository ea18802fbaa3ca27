"""Voice cloning from raw audio against the reference wrapper, on a reference-written tiny Base checkpoint.

The reference builds the prompt (`create_voice_clone_prompt`: speaker encoder + speech-tokenizer encoder)
and generates greedily; we do the same from the same samples through `Model.clone_voice` and the CLI.
"""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest
import soundfile as sf

import qtts_cli.main as cli
from qtts_jax.io.audio import to_int16
from qtts_jax.request import Request
from support import compiled_programs, compiles, read_wav

FRAMES = 8
REF_TEXT = "What the reference recording says."
TEXT = "Cloned speech from a recording."


@pytest.fixture(scope="module")
def base(reference_wrapper, checkpoint_model):
    """(reference wrapper, our model, checkpoint dir) for the tiny Base checkpoint."""
    ref, directory = reference_wrapper("base")
    return ref, checkpoint_model("base"), directory


def recording(seconds: float, seed: int) -> np.ndarray:
    """Broadband audio: every mel band has energy, so the fp32 log-mel of near-empty bands (where any two
    FFT implementations differ by ~1e-3) does not dominate the comparison."""
    rng = np.random.default_rng(seed)
    return (0.5 * rng.uniform(-1, 1, int(seconds * 24000))).astype(np.float32)


@pytest.mark.parametrize("seconds,seed", [(1.3, 0), (2.07, 1)])
def test_clone_prompt_equals_the_reference(base, seconds, seed):
    ref, model, _ = base
    wav = recording(seconds, seed)
    (item,) = ref.create_voice_clone_prompt(ref_audio=(wav, 24000), ref_text=REF_TEXT)
    ours = model.clone_voice((wav, 24000), REF_TEXT)
    expected_x = item.ref_spk_embedding.float().numpy()
    assert np.abs(ours.xvector - expected_x).max() / np.abs(expected_x).max() < 1e-5
    np.testing.assert_array_equal(ours.ref_codes, item.ref_code.numpy())
    assert ours.ref_codes.shape == (int(np.ceil(seconds * 12.5)), 16) and ours.ref_text == REF_TEXT
    xonly = model.clone_voice((wav, 24000), REF_TEXT, xvector_only=True)
    assert xonly.ref_codes is None and xonly.ref_text is None
    np.testing.assert_array_equal(xonly.xvector, ours.xvector)


@pytest.mark.parametrize("xvector_only", [False, True], ids=["icl", "xvector"])
def test_cli_clone_from_a_file_reproduces_reference_greedy_audio(base, tmp_path, xvector_only):
    ref, _, directory = base
    wav = recording(1.5, 2)
    path = tmp_path / "voice.wav"
    sf.write(path, wav, 24000, subtype="FLOAT")  # lossless: both sides see the same samples
    wavs, sr = ref.generate_voice_clone(
        text=TEXT, language="english", ref_audio=(wav, 24000), ref_text=None if xvector_only else REF_TEXT,
        x_vector_only_mode=xvector_only, do_sample=False, subtalker_dosample=False, max_new_tokens=FRAMES + 1,
    )
    out, codes_out = tmp_path / "out.wav", tmp_path / "codes.npy"
    args = ["synth", "--model", str(directory), "--text", TEXT, "--language", "english", "--ref-audio", str(path),
            "--greedy", "--max-frames", str(FRAMES), "--out", str(out), "--codes-out", str(codes_out)]
    args += ["--xvector-only"] if xvector_only else ["--ref-text", REF_TEXT]
    assert cli.main(args) == 0
    rate, ours = read_wav(out)
    assert rate == sr == 24000 and np.load(codes_out).shape == (FRAMES, 16)
    # ICL: the reference decodes reference + new codes and cuts the reference's share; so do we
    assert len(ours) == len(wavs[0])
    assert np.max(np.abs(ours.astype(np.int32) - to_int16(wavs[0]).astype(np.int32))) <= 1
    assert np.abs(ours).max() > 1000


def test_clone_refusals(base, tiny_model):
    ref, model, _ = base
    with pytest.raises(Exception, match="at least"):
        model.clone_voice((recording(0.3, 0), 24000), REF_TEXT)
    cv = tiny_model
    with pytest.raises(Exception, match="only Base models"):
        cv.clone_voice((recording(1.5, 0), 24000), REF_TEXT)
    # a cloned voice at another sample rate is resampled first (16 kHz in, 24 kHz codes)
    voice = model.clone_voice((recording(1.5, 3)[:24000], 16000), REF_TEXT)
    assert voice.ref_codes.shape == (19, 16)
    (res,) = model.generate(Request("Short.", voice=voice, max_frames=3, greedy=True, subtalker_greedy=True))
    assert res.frames <= 3


def test_warmup_compiles_every_bucket_so_registration_never_does(tiny_base_model):
    model = tiny_base_model
    jax.clear_caches()  # nothing an earlier test compiled: the warm-up must compile every bucket itself
    with compiles() as warm_up:
        model.voice_encoders.warmup(max_seconds=3.0, trailing_silence_s=0.5)
    per_function = collections.Counter(compiled_programs(warm_up))
    assert sum(n >= 2 for n in per_function.values()) >= 2  # 3 s spans several buckets of both encoders
    with compiles() as cloning:
        for seconds in (1.0, 1.7, 2.2, 3.0):
            model.clone_voice((recording(seconds, 5), 24000), REF_TEXT, trailing_silence_s=0.5)
    assert compiled_programs(cloning) == []
