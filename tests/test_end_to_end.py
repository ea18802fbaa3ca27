"""Whole path against the reference's public wrapper: text → codes → 24 kHz audio, and the CLI."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

import qtts_cli.main as cli
from qtts_cli.main import DEFAULT_VOICE, RANDOM_MAX_FRAMES
from qtts_jax.io.audio import to_int16
from qtts_jax.request import Request, VoicePrompt
from serving.voice.aliases import DEFAULT as DEFAULT_ALIASES
from support import read_wav

FRAMES = 8


def test_cli_synth_reproduces_reference_codes_and_audio(reference_wrapper, tmp_path):
    """`qtts-jax synth --greedy` on a reference-written checkpoint: same codes, audio equal to int16 rounding."""
    ref, directory = reference_wrapper("custom_voice")
    text = "Hello from the command line."
    wavs, sr = ref.generate_custom_voice(
        text=text, speaker="ryan", language="english", do_sample=False, subtalker_dosample=False,
        max_new_tokens=FRAMES + 1,
    )
    out, codes_out = tmp_path / "x.wav", tmp_path / "codes.npy"
    rc = cli.main([
        "synth", "--model", str(directory), "--text", text, "--speaker", "ryan", "--language", "english",
        "--greedy", "--max-frames", str(FRAMES), "--out", str(out), "--codes-out", str(codes_out),
    ])
    assert rc == 0
    rate, ours = read_wav(out)
    assert rate == sr == 24000
    codes = np.load(codes_out)
    assert codes.shape == (FRAMES, 16)
    assert len(ours) == len(wavs[0]) == FRAMES * 1920
    assert np.max(np.abs(ours.astype(np.int32) - to_int16(wavs[0]).astype(np.int32))) <= 1
    assert np.abs(ours).max() > 1000, "audio should not be near-silent"


def test_icl_clone_audio_cut_matches_reference(reference_wrapper, checkpoint_model):
    """ICL decodes with the reference frames in front, then cuts their share, as the reference does."""
    import torch
    from qwen_tts.inference.qwen3_tts_model import VoiceClonePromptItem

    ref, _ = reference_wrapper("base")
    model = checkpoint_model("base")
    rng = np.random.default_rng(3)
    xvec = rng.standard_normal(model.cfg.talker.hidden_size).astype(np.float32)
    ref_codes = rng.integers(0, 2048, size=(7, 16))
    item = VoiceClonePromptItem(
        ref_code=torch.tensor(ref_codes), ref_spk_embedding=torch.tensor(xvec), x_vector_only_mode=False,
        icl_mode=True, ref_text="What the reference recording says.",
    )
    text = "Cloned speech follows the reference."
    wavs, _ = ref.generate_voice_clone(
        text=text, language="english", voice_clone_prompt=[item], do_sample=False, subtalker_dosample=False,
        max_new_tokens=FRAMES + 1,
    )
    (result,) = model.generate(Request(
        text, language="english", voice=VoicePrompt(xvec, ref_codes, item.ref_text),
        greedy=True, subtalker_greedy=True, max_frames=FRAMES,
    ))
    assert len(result.audio) == len(wavs[0])
    np.testing.assert_allclose(result.audio, wavs[0], rtol=0, atol=1e-4)


def test_synth_defaults_to_tiny_random_the_servers_voice_and_a_short_cap(tmp_path, capsys, caplog):
    """A newcomer's first `synth`: no --model, no --speaker, no --max-frames. Random weights rarely end, so the
    CLI caps them (16 s of noise otherwise) and says so; the voice is the server's default (alloy -> serena)."""
    out = tmp_path / "hello.wav"
    assert cli.main(["synth", "--text", "Hello", "--out", str(out)]) == 0
    rate, audio = read_wav(out)
    assert rate == 24000 and len(audio) == RANDOM_MAX_FRAMES * 1920
    assert np.abs(audio).max() > 0
    err = capsys.readouterr().err
    assert f"speaker: {DEFAULT_VOICE}" in err and f"max frames: {RANDOM_MAX_FRAMES}" in err
    assert DEFAULT_VOICE == DEFAULT_ALIASES["alloy"]  # the voice a request without one gets from the server
    assert "noise" in caplog.text


def test_synth_writes_the_format_its_out_extension_names(tmp_path, capsys):
    import av

    out = tmp_path / "e.mp3"
    assert cli.main(["synth", "--text", "Hello", "--max-frames", "4", "--out", str(out)]) == 0
    with av.open(str(out)) as f:
        assert f.format.name == "mp3"
        samples = sum(frame.samples for frame in f.decode(audio=0))
    assert samples >= 4 * 1920  # the encoder may pad its last frame
    capsys.readouterr()
    assert cli.main(["synth", "--text", "Hello", "--out", str(tmp_path / "e.mp4")]) == 2
    assert "--out: " in capsys.readouterr().err and not (tmp_path / "e.mp4").exists()


def test_same_seed_same_audio_different_seed_different(tiny_model):
    model = tiny_model
    req = Request("Seeded sampling.", speaker="aiden", seed=7, max_frames=6)
    a, b = model.generate([req, req])
    (c,) = model.generate(Request("Seeded sampling.", speaker="aiden", seed=8, max_frames=6))
    np.testing.assert_array_equal(a.codes, b.codes)
    assert not np.array_equal(a.codes, c.codes)


def test_info_describes_checkpoint(reference_checkpoint, capsys):
    _, directory = reference_checkpoint("custom_voice")
    capsys.readouterr()  # building it may import the reference package, which prints a warning on first import
    assert cli.main(["info", "--model", str(directory)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "custom_voice" and info["size"] == "1b7"
    assert "ryan" in info["speakers"] and "english" in info["languages"]
    assert "sichuan_dialect" not in info["languages"] and info["sample_rate"] == 24000


def test_cli_reports_bad_input_without_traceback(tmp_path, capsys):
    args = ["synth", "--model", "tiny-random", "--out", str(tmp_path / "x.wav")]
    assert cli.main(args + ["--text", "Hi", "--speaker", "nobody"]) == 2
    assert "speaker" in capsys.readouterr().err
    assert cli.main(args + ["--text", "Hi", "--language", "klingon"]) == 2
    assert "language" in capsys.readouterr().err
    assert cli.main(["synth", "--model", str(tmp_path / "nope"), "--text", "Hi", "--out", "x.wav"]) == 2
    assert "nope" in capsys.readouterr().err
    assert not (tmp_path / "x.wav").exists()


def test_text_length_caps_frames_unless_max_frames_is_given(tiny_model):
    """tiny-random rarely samples EOS: without max_frames the text-length guard stops it."""
    model = tiny_model
    req = Request("Hi.", speaker="ryan", greedy=True, subtalker_greedy=True)
    (capped,) = model.generate(req)
    from qtts_jax.prompt import build_prompt

    cap = build_prompt(model.cfg, model.tokenizer, req.resolved(model.cfg, model.defaults)).frame_cap()
    assert capped.frames <= cap < 200
    (explicit,) = model.generate(dataclasses.replace(req, max_frames=cap + 5))
    assert capped.frames == min(explicit.frames, cap)  # the guard cut exactly at the cap, or EOS came first
    np.testing.assert_array_equal(explicit.codes[: capped.frames], capped.codes)
