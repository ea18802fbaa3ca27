"""The training loop: a run interrupted between steps and resumed from its checkpoint reaches the same losses at
the same steps, and the same weights, as an uninterrupted run; only the last K checkpoints are kept."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from qtts_jax.finetune import train
from qtts_jax.finetune.data import Example

# test_finetune_cli's settings and batch shapes (64 positions, 32 frames), so both load one compiled step
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
    return train.train(model.params, model.cfg, model.tokenizer, examples, SETTINGS, directory, resume, on_step)


def test_a_resumed_run_matches_an_uninterrupted_one(tiny_base_model, examples, tmp_path):
    whole = run(tiny_base_model, examples, tmp_path / "whole")

    def kill_after_5(step, total, losses):
        if step == 5:  # step 5 is done but not checkpointed (every 2): its work is lost, as on a SIGKILL
            raise Killed

    with pytest.raises(Killed):
        run(tiny_base_model, examples, tmp_path / "cut", on_step=kill_after_5)
    resumed = run(tiny_base_model, examples, tmp_path / "cut", resume=True)
    assert resumed.resumed_from == 4
    assert [r["step"] for r in resumed.curve] == list(range(1, 7))
    assert resumed.curve == whole.curve
    jax.tree.map(np.testing.assert_array_equal, resumed.params, whole.params)
    steps = sorted(int(p.name) for p in (tmp_path / "whole").iterdir() if p.name.isdigit())
    assert steps == [4, 6]  # keep=2
    assert not any("tmp" in p.name for p in (tmp_path / "cut").iterdir())


def test_the_model_learns_and_its_weights_are_left_alone(tiny_base_model, examples, tmp_path):
    before = jax.tree.map(np.array, tiny_base_model.params)
    result = run(tiny_base_model, examples, tmp_path / "run")
    jax.tree.map(np.testing.assert_array_equal, tiny_base_model.params, before)  # the model's own stay untouched
    first, last = result.curve[0], result.curve[-1]
    assert last["loss"] < first["loss"]
    written = train.write_curve(result.curve, tmp_path)
    assert [p.name for p in written] == ["loss.json", "loss.png"]
