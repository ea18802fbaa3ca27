"""The training loop and `qtts-jax finetune` on top of it (one file: both load one compiled training step).

A run interrupted between steps and resumed from its checkpoint reaches the same losses at the same steps, and the
same weights, as an uninterrupted run; only the last K checkpoints are kept. End to end on CPU: tiny-random-base,
20 steps, the loss falls, and the exported model serves the new speaker at once (the library and
`synth --speaker`); bad input stops it before training."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import numpy as np
import pytest
import soundfile as sf
from flax import nnx

from qtts_cli.main import RANDOM_MAX_FRAMES, main
from qtts_jax import nn, xla_flags
from qtts_jax.finetune import train
from qtts_jax.finetune.data import Example
from qtts_jax.model import load_model
from qtts_jax.request import Request

RATE = 24000

# the CLI test's settings and batch shapes (64 positions, 32 frames): both run one compiled step
SETTINGS = train.Settings(lr=1e-3, batch=2, accumulate=2, steps=6, seed=3, checkpoint_every=2, keep=2)


class Killed(Exception):
    pass


@pytest.fixture(scope="module")
def examples(tiny_base_model):
    rng = np.random.default_rng(0)
    h = tiny_base_model.cfg.talker.hidden_size
    return [Example(f"line number {i}", rng.integers(0, 2048, (13 + i, 16)).astype(np.int32),
                    rng.standard_normal(h).astype(np.float32)) for i in range(5)]


def run(model, examples, directory, resume=False, on_step=lambda *a: None):
    return train.train(model.talker, model.cfg, model.tokenizer, examples, SETTINGS, directory, resume, on_step)


def test_a_resumed_run_matches_an_uninterrupted_one(tiny_base_model, examples, tmp_path):
    whole = run(tiny_base_model, examples, tmp_path / "whole")

    def kill_after_5(step, total, losses):
        if step == 5:  # step 5 is done but not checkpointed (every 2): its work is lost, as on a SIGKILL
            raise Killed

    with pytest.raises(Killed):
        run(tiny_base_model, examples, tmp_path / "cut", on_step=kill_after_5)
    partial = tmp_path / "cut" / "6.orbax-checkpoint-tmp-1"  # a save cut short by the kill, as orbax names it
    partial.mkdir()
    (partial / "junk").write_bytes(b"half a checkpoint")
    with pytest.raises(train.ResumeError, match="seed"):  # another run's settings: refused, nothing trained
        train.train(tiny_base_model.talker, tiny_base_model.cfg, tiny_base_model.tokenizer, examples,
                    dataclasses.replace(SETTINGS, seed=4), tmp_path / "cut", resume=True)
    resumed = run(tiny_base_model, examples, tmp_path / "cut", resume=True)
    assert resumed.resumed_from == 4
    assert [r["step"] for r in resumed.curve] == list(range(1, 7))
    assert resumed.curve == whole.curve
    jax.tree.map(np.testing.assert_array_equal, nn.flat_params(resumed.talker), nn.flat_params(whole.talker))
    steps = sorted(int(p.name) for p in (tmp_path / "whole").iterdir() if p.name.isdigit())
    assert steps == [4, 6]  # keep=2
    assert not any("tmp" in p.name for p in (tmp_path / "cut").iterdir())


def test_a_released_talker_gives_its_weights_to_the_run_and_trains_the_same(tiny_base_model, examples, tmp_path):
    kept = run(tiny_base_model, examples, tmp_path / "kept")
    fresh = load_model("tiny-random-base")  # the same seeded weights as the fixture's
    released = train.train(fresh.talker, fresh.cfg, fresh.tokenizer, examples, SETTINGS, tmp_path / "released",
                           release=True)
    assert all(a.is_deleted() for a in jax.tree.leaves(nnx.state(fresh.talker, nnx.Param)))
    assert released.curve == kept.curve
    jax.tree.map(np.testing.assert_array_equal, nn.flat_params(released.talker), nn.flat_params(kept.talker))


def test_the_model_learns_and_its_weights_are_left_alone(tiny_base_model, examples, tmp_path):
    before = jax.tree.map(np.array, (tiny_base_model.params, nn.flat_params(tiny_base_model.talker)))
    result = run(tiny_base_model, examples, tmp_path / "run")
    # the model's own weights (its split state and its module) stay untouched
    jax.tree.map(np.testing.assert_array_equal, (tiny_base_model.params, nn.flat_params(tiny_base_model.talker)),
                 before)
    first, last = result.curve[0], result.curve[-1]
    assert last["loss"] < first["loss"]
    written = train.write_curve(result.curve, tmp_path)
    assert [p.name for p in written] == ["loss.json", "loss.png"]


def test_micro_batches_give_the_whole_batchs_loss_and_gradient(tiny_base_model, examples):
    """--micro-batch: a step of 2 rows run as 2 micro-batches of 1 adds up to the same loss and the same gradient
    as the 2 rows in one pass (the accumulated sum holds the gradient after a first call). The whole-batch step has
    the other tests' settings and shapes, so it is compiled once for the file."""
    from flax import nnx

    from qtts_jax.finetune import layout

    model = tiny_base_model
    graph, params = nnx.split(model.talker, nnx.Param)
    batch = layout.collate(model.cfg, model.tokenizer, examples[:2], SETTINGS.batch).arrays()
    out = {}
    for micro in (1, 2):
        init, step, _ = train.programs(graph, model.cfg, SETTINGS.lr, SETTINGS.accumulate, "float32", 0, micro)
        state, frozen = init(nnx.to_pure_dict(params))
        state, parts = step(state, frozen, batch, emit=False)  # the first of 2: the sum holds its gradient
        out[micro] = parts, state["opt"]["acc"]
    for key in ("loss", "talker", "predictor"):
        np.testing.assert_allclose(float(out[2][0][key]), float(out[1][0][key]), rtol=1e-5)
    whole, parts = jax.tree.leaves(out[1][1]), jax.tree.leaves(out[2][1])
    assert len(whole) == len(parts) and any(np.abs(np.asarray(g)).max() > 0 for g in whole)
    for a, b in zip(whole, parts):
        scale = np.abs(np.asarray(a)).max() + 1e-12
        np.testing.assert_allclose(np.asarray(b) / scale, np.asarray(a) / scale, atol=1e-5)
    with pytest.raises(ValueError, match="micro_batch 3 must divide batch 4"):
        train.Settings(batch=4, micro_batch=3)


def test_the_code_predictor_in_recomputed_chunks_gives_the_same_loss_and_gradient(tiny_base_model, examples):
    """--predictor-chunk: the code predictor over a few frames at a time, recomputed in the backward pass (the last
    chunk padded with frames that have no target), gives the loss and the gradient of all frames in one pass."""
    from flax import nnx

    from qtts_jax.finetune import layout

    model = tiny_base_model
    graph, params = nnx.split(model.talker, nnx.Param)
    batch = layout.collate(model.cfg, model.tokenizer, examples[:2], SETTINGS.batch).arrays()
    frames = batch[-2].shape[0] * batch[-2].shape[1]
    chunk = frames // 2 + 1  # two chunks, the second padded
    assert frames % chunk
    out = {}
    for c in (None, chunk):
        init, step, _ = train.programs(graph, model.cfg, SETTINGS.lr, SETTINGS.accumulate, "float32", 0, 1,
                                       predictor_chunk=c)
        state, frozen = init(nnx.to_pure_dict(params))
        state, parts = step(state, frozen, batch, emit=False)  # the first of 2: the sum holds its gradient
        out[c] = parts, state["opt"]["acc"]
    for key in ("loss", "talker", "predictor"):
        np.testing.assert_allclose(float(out[chunk][0][key]), float(out[None][0][key]), rtol=1e-5)
    whole, chunked = jax.tree.leaves(out[None][1]), jax.tree.leaves(out[chunk][1])
    assert len(whole) == len(chunked) and any(np.abs(np.asarray(g)).max() > 0 for g in whole)
    for a, b in zip(whole, chunked):
        scale = np.abs(np.asarray(a)).max() + 1e-12
        np.testing.assert_allclose(np.asarray(b) / scale, np.asarray(a) / scale, atol=1e-5)
    with pytest.raises(ValueError, match="predictor_chunk 0 must be at least 1"):
        train.Settings(predictor_chunk=0)


def test_lora_starts_from_the_base_model_and_changes_only_the_projections(tiny_base_model, examples, tmp_path):
    settings = dataclasses.replace(SETTINGS, lora=2, steps=4, lr=1e-2)
    full = run(tiny_base_model, examples, tmp_path / "full")
    adapted = train.train(tiny_base_model.talker, tiny_base_model.cfg, tiny_base_model.tokenizer, examples, settings,
                          tmp_path / "lora")
    np.testing.assert_allclose(adapted.curve[0]["loss"], full.curve[0]["loss"], rtol=1e-6)  # B = 0 at the start
    assert adapted.curve[-1]["loss"] < adapted.curve[0]["loss"]
    base, trained = nn.flat_params(tiny_base_model.talker), nn.flat_params(adapted.talker)
    assert trained.keys() == base.keys()
    for path, value in trained.items():
        moved = not np.array_equal(np.asarray(value), np.asarray(base[path]))
        projection = re.fullmatch(r"(predictor/)?stack/layers/(wqkv|wo|gate_up|down)", path) is not None
        assert moved == projection, path  # the projections of both stacks moved, nothing else


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
    assert model.is_noise and model.info()["noise"]  # trained from random weights: still noise, and flagged
    (result,) = model.generate(Request(text="hello", speaker="Nova", max_frames=4))
    assert result.frames > 0 and len(result.audio) == result.frames * 1920

    # synth caps the noise as on the preset it came from
    wav = tmp_path / "nova.wav"
    capsys.readouterr()
    assert main(["synth", "--model", str(out / "model"), "--speaker", "nova", "--text", "hello",
                 "--out", str(wav)]) == 0
    assert f"max frames: {RANDOM_MAX_FRAMES}" in capsys.readouterr().err
    assert sf.info(wav).samplerate == RATE and sf.info(wav).frames == RANDOM_MAX_FRAMES * 1920

    # the same --out again without --resume is refused; with it, the run goes on and says so before its progress
    args = ["finetune", "--model", "tiny-random-base", "--data", str(dataset), "--speaker", "Nova",
            "--out", str(out), "--lr", "1e-3", "--accumulate", "2", "--checkpoint-every", "10", "--steps", "22"]
    assert main(args) == 2
    assert "--resume" in capsys.readouterr().err
    assert main([*args, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "resumed from step 20" in err and err.index("resumed from step 20") < err.index("/22")


def test_bad_data_stops_before_training(dataset, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(dataset.read_text().replace('"thanks a lot"', '""').replace("clip", str(dataset.parent) + "/clip"))
    rc = main(["finetune", "--model", "tiny-random-base", "--data", str(bad), "--speaker", "nova",
               "--out", str(tmp_path / "run"), "--steps", "2"])
    assert rc == 2
    assert "bad.jsonl:3: text: must not be empty" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_micro_batch_that_does_not_divide_the_batch_stops_before_anything_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    rc = main(["finetune", "--model", "tiny-random-base", "--data", str(tmp_path / "none.jsonl"), "--speaker", "nova",
               "--out", str(tmp_path / "run"), "--batch", "4", "--micro-batch", "3"])
    assert rc == 2
    assert "--micro-batch must divide --batch (4)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    # the training process claims the device's memory before any backend starts (xla_flags.claim_device_memory)
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == xla_flags.TRAINING_MEMORY_FRACTION
