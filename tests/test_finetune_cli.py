"""`qtts-jax finetune` end to end on CPU: tiny-random-base, 20 steps, the loss falls, and the exported model
serves the new speaker at once (the library and `synth --speaker`). Bad input stops it before training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf

from qtts_cli.main import main
from qtts_jax.model import load_model
from qtts_jax.request import Request

RATE = 24000


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    rows = []
    for i, text in enumerate(["good morning", "see you soon", "thanks a lot"]):
        t = np.arange(int((1.0 + 0.3 * i) * RATE)) / RATE
        wav = 0.3 * np.sin(2 * np.pi * (120 + 30 * i) * t) + 0.05 * rng.standard_normal(len(t))
        sf.write(root / f"clip{i}.wav", wav.astype(np.float32), RATE)
        rows.append({"audio": f"clip{i}.wav", "text": text, "ref_audio": "clip0.wav"})
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "train.jsonl"


def test_finetune_learns_and_its_export_serves_the_new_speaker(dataset, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["finetune", "--model", "tiny-random-base", "--data", str(dataset), "--speaker", "Nova",
               "--out", str(out), "--steps", "20", "--lr", "1e-3", "--accumulate", "2", "--checkpoint-every", "10"])
    assert rc == 0, capsys.readouterr().err
    curve = json.loads((out / "loss.json").read_text())
    assert [r["step"] for r in curve] == list(range(1, 21))
    losses = [r["loss"] for r in curve]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    assert (out / "loss.png").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "20"]

    model = load_model(out / "model")
    assert model.cfg.model_type == "custom_voice" and sorted(model.cfg.speakers) == ["nova"]
    (result,) = model.generate(Request(text="hello", speaker="Nova", max_frames=4))
    assert result.frames > 0 and len(result.audio) == result.frames * 1920

    wav = tmp_path / "nova.wav"
    assert main(["synth", "--model", str(out / "model"), "--speaker", "nova", "--text", "hello",
                 "--max-frames", "4", "--out", str(wav)]) == 0
    assert sf.info(wav).samplerate == RATE

    # the same --out again without --resume is refused; with it, the finished run has nothing left to do
    assert main(["finetune", "--model", "tiny-random-base", "--data", str(dataset), "--speaker", "Nova",
                 "--out", str(out), "--steps", "20"]) == 2
    assert "--resume" in capsys.readouterr().err


def test_bad_data_stops_before_training(dataset, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(dataset.read_text().replace('"thanks a lot"', '""').replace("clip", str(dataset.parent) + "/clip"))
    rc = main(["finetune", "--model", "tiny-random-base", "--data", str(bad), "--speaker", "nova",
               "--out", str(tmp_path / "run"), "--steps", "2"])
    assert rc == 2
    assert "bad.jsonl:3: text: must not be empty" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
