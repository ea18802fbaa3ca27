"""The model runner alone, without the loop: its calls return typed outcomes, and calibrating on the live state
(what a warm-up does before serving) leaves every slot's state as it was."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from qtts_jax.engine.runner import Calibration, FirstOutcome, Runner, StepOutcome, stages
from qtts_jax.request import Request
from support import GREEDY, SMALL


def test_calibrating_on_the_live_state_leaves_a_playing_slot_untouched(tiny_model):
    from qtts_jax.engine import Engine

    runner = Runner(tiny_model, SMALL)
    job = Engine(tiny_model, SMALL).prepare(Request("A slot in use.", speaker="ryan", max_frames=8, **GREEDY))
    runner.prefill(job.bucket, [(0, job)], 1)
    live, none = np.array([True, False]), np.zeros(2, bool)
    first = runner.first(np.array([0, SMALL.slots], np.int32), live, live, live)
    step = runner.step(np.array([0, SMALL.slots], np.int32), np.array([1, 0], np.int32), 1)
    assert isinstance(first, FirstOutcome) and isinstance(step, StepOutcome)
    assert np.asarray(first.frames).shape == (1, 2, 16) and np.asarray(first.valid).tolist() == [[True, False]]
    assert np.asarray(step.frames).shape == (1, 2, 16) and np.asarray(step.valid).tolist() == [[True, False]]
    audio = runner.codec(np.array([0, SMALL.slots], np.int32), none, np.array([1, 0], np.int32),
                         np.array([1, 0], np.int32), 1)
    assert np.abs(np.asarray(audio[0])).max() > 0
    before = jax.tree.map(np.array, (runner.state, runner.codec_state))

    keys = [key for stage in stages(SMALL) for key in stage]
    timed = runner.calibrate(keys)

    after = jax.tree.map(np.array, (runner.state, runner.codec_state))
    jax.tree.map(np.testing.assert_array_equal, after, before)
    assert isinstance(timed, Calibration)
    assert set(timed.steps) == {(a, n) for kind, a, n in keys if kind == "step"}
    assert set(timed.firsts) == {a for kind, a, n in keys if kind == "step" and n == 1 and a in SMALL.first_sizes}
    assert set(timed.prefills) == set(SMALL.prefill_sizes)  # timed at the largest bucket only
    assert all(v > 0 for costs in (timed.steps, timed.firsts, timed.prefills) for v in costs.values())


def test_a_runners_states_are_one_program_and_its_first_buffers_none(tiny_model):
    """A fresh state is one program, its live one and a scratch alike, each leaf a buffer of its own (the calls
    donate them); a program's first per-call inputs and outcome are zeros copied from the host. Made with jnp.zeros,
    each shape was a program to compile on a cold start, or load on a restart: 73 of a 16-slot engine's 98."""
    from support import compiled_programs, compiles

    from qtts_jax.engine import Engine

    config = dataclasses.replace(SMALL, context=SMALL.context + 40)  # a shape no other test makes
    with compiles() as seen:
        runner = Runner(tiny_model, config)
        scratch = runner.scratch()
        again = Runner(tiny_model, config)
    assert compiled_programs(seen) == ["jit(_fresh_states)"]
    for state in ((runner.state, runner.codec_state), (scratch.state, scratch.codec_state)):
        leaves = jax.tree.leaves(state)
        assert len({a.unsafe_buffer_pointer() for a in leaves}) == len(leaves)
    job = Engine(tiny_model, config).prepare(Request("A slot in use.", speaker="ryan", max_frames=8, **GREEDY))
    again.prefill(job.bucket, [(0, job)], 1)
    again.compile([("step", 2, 1)])
    with compiles() as seen:
        again.step(np.array([0, config.slots], np.int32), np.array([1, 0], np.int32), 1)
    # at most the inputs' copy into their kept buffers (once a process for their shapes), and nothing else
    assert set(compiled_programs(seen)) <= {"jit(_write_into)"}


def test_a_programs_per_call_inputs_keep_their_device_buffers_and_take_each_calls_values(tiny_model):
    """XLA records a CUDA graph again whenever a buffer it reads has moved: each call's rows and limits are written
    into the buffers the program read last time, and the call sees the new values; a call with the last call's
    values writes nothing (no copy, no program), and the call after it still sees its own."""
    from qtts_jax.engine import Engine

    runner = Runner(tiny_model, SMALL)
    job = Engine(tiny_model, SMALL).prepare(Request("A slot in use.", speaker="ryan", max_frames=8, **GREEDY))
    runner.prefill(job.bucket, [(0, job)], 1)
    key = ("step", 2, 1)  # slot 0 in the first row, then the second (twice), then the first again
    valid, addresses, buffers = [], [], []
    first, second = ([0, SMALL.slots], [1, 0]), ([SMALL.slots, 0], [0, 1])
    for idx, limits in (first, second, second, first):
        step = runner.step(np.array(idx, np.int32), np.array(limits, np.int32), 1)
        valid.append(np.asarray(step.valid)[0].tolist())
        buffers.append(runner.held[key].buffers)
        addresses.append([a.unsafe_buffer_pointer() for a in buffers[-1]])
        np.testing.assert_array_equal(np.asarray(buffers[-1][0]), idx)
        np.testing.assert_array_equal(np.asarray(buffers[-1][1]), limits)
    assert valid == [[True, False], [False, True], [False, True], [True, False]]
    assert addresses[0] == addresses[1] == addresses[2] == addresses[3]
    assert buffers[2] is buffers[1] and buffers[3] is not buffers[2]  # the repeat wrote nothing


def test_a_programs_outcome_takes_the_last_ones_buffers_and_is_read_before_the_next_call(tiny_model):
    """XLA records a CUDA graph again whenever a buffer it writes has moved: a step's, first frame's and codec
    call's outcome is written where the same program's last outcome was (its buffers donated), with each call's
    own values, so an outcome is readable until the next call of that program and no longer."""
    from qtts_jax.engine import Engine

    runner = Runner(tiny_model, SMALL)
    job = Engine(tiny_model, SMALL).prepare(Request("A slot in use.", speaker="ryan", max_frames=8, **GREEDY))
    runner.prefill(job.bucket, [(0, job)], 1)
    steps, addresses = [], []
    for idx, limits in (([0, SMALL.slots], [1, 0]), ([SMALL.slots, 0], [0, 1])):
        step = runner.step(np.array(idx, np.int32), np.array(limits, np.int32), 1)
        # copies: on a CPU np.asarray may share the buffer, and a buffer numpy holds is copied, not donated
        steps.append((np.array(step.frames), np.array(step.valid)[0].tolist()))
        addresses.append([a.unsafe_buffer_pointer() for a in step])
    assert [valid for _, valid in steps] == [[True, False], [False, True]]
    assert addresses[0] == addresses[1]
    assert (steps[0][0][0, 0] >= 0).all() and (steps[1][0][0, 1] >= 0).all()  # each call's own frame, read in time
    audio = [runner.codec(np.array([0, SMALL.slots], np.int32), np.zeros(2, bool), np.array([k, 0], np.int32),
                          np.array([1, 0], np.int32), 1) for k in (0, 1)]
    assert audio[0].is_deleted() and not audio[1].is_deleted()  # the second call wrote into the first's buffers
    assert np.abs(np.asarray(audio[1])[0]).max() > 0
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(audio[0])


def test_programs_kept_whole_load_untraced_for_the_same_engine_only(tiny_model, tmp_path, monkeypatch, caplog):
    """The compilation cache keeps each compiled program whole, with its idle timings: a second runner of the
    same model and configuration loads it without tracing, computes the same frames and reads the same timings;
    another configuration, or a file that does not load, compiles afresh."""
    import dataclasses

    from qtts_jax.engine import Engine, compile_cache

    monkeypatch.setattr(compile_cache, "directory", lambda: tmp_path)
    # a context no other test compiles for: these programs are compiled here, not handed back by XLA's cache
    config = dataclasses.replace(SMALL, context=SMALL.context + 8)
    job = Engine(tiny_model, config).prepare(Request("Kept whole.", speaker="ryan", max_frames=8, **GREEDY))
    keys = [("insert", job.bucket, 1), ("step", 2, 1), ("codec", 2, 1)]

    def frames(runner):
        runner.prefill(job.bucket, [(0, job)], 1)
        return np.asarray(runner.step(np.array([0, config.slots], np.int32), np.array([1, 0], np.int32), 1).frames)

    def traced(runner):
        calls = []
        lower = runner.lower
        monkeypatch.setattr(runner, "lower", lambda *key: (calls.append(key), lower(*key))[1])
        runner.compile(keys)
        return calls

    first, second = Runner(tiny_model, config), Runner(tiny_model, config)
    assert traced(first) == keys and traced(second) == []
    np.testing.assert_array_equal(frames(second), frames(first))
    assert second.calibrate(keys) == first.calibrate(keys)  # timed once, when made: the second start reads them
    assert second.stored(keys) and not second.stored([*keys, ("step", 1, 1)])
    other = Runner(tiny_model, dataclasses.replace(config, frames_per_step=config.frames_per_step + 1))
    assert traced(other) == keys  # built from another configuration: a store of its own
    (stored,) = [p for p in first.store.root.iterdir() if p.name.startswith("step")]
    stored.write_bytes(b"not a program")
    assert traced(Runner(tiny_model, config)) == [("step", 2, 1)] and "did not load" in caplog.text


@pytest.mark.parametrize("source", ["preset", "checkpoint"])
def test_a_compile_workers_programs_load_untraced_and_compute_what_the_engines_own_do(source, tiny_model,
                                                                                       checkpoint_model, tmp_path,
                                                                                       monkeypatch):
    """A worker process builds the model from its shapes alone (from a preset, or a checkpoint directory's
    configs) and compiles programs into the compilation cache: the engine's runner, of the model loaded with its
    weights, finds them there under its own key, loads them without tracing, and they compute the same frames and
    audio as programs the runner compiled itself."""
    import dataclasses

    from qtts_jax.engine import compile_cache

    monkeypatch.setattr(compile_cache, "directory", lambda: tmp_path)
    model = tiny_model if source == "preset" else checkpoint_model()
    config = dataclasses.replace(SMALL, context=SMALL.context + 16, compile_workers=1)
    keys = [("step", 2, 1), ("codec", 2, 1)]
    runner = Runner(model, config)
    workers = runner.compile_elsewhere(keys)
    assert workers is not None and len(workers.procs) == 1
    workers.wait(keys, runner.stored)
    workers.stop()
    assert runner.stored(keys) and runner.compile_elsewhere(keys) is None  # nothing left for a worker
    lowered = []
    lower = runner.lower
    monkeypatch.setattr(runner, "lower", lambda *key: (lowered.append(key), lower(*key))[1])
    runner.compile(keys)
    assert lowered == []
    own = Runner(model, dataclasses.replace(config, compile_workers=0))  # another key: compiled here
    assert own.compile_elsewhere(keys) is None and not own.stored(keys)
    request = Request("Made elsewhere.", speaker="ryan", max_frames=8, **GREEDY)
    from qtts_jax.engine import Engine

    prepared = Engine(model, config).prepare(request)
    outcomes = []
    for r in (runner, own):
        r.prefill(prepared.bucket, [(0, prepared)], 1)
        idx = np.array([0, config.slots], np.int32)
        frames = np.asarray(r.step(idx, np.array([1, 0], np.int32), 1).frames)
        audio = np.asarray(r.codec(idx, np.array([True, False]), np.zeros(2, np.int32), np.array([1, 0], np.int32), 1))
        outcomes.append((frames, audio))
    np.testing.assert_array_equal(outcomes[0][0], outcomes[1][0])
    np.testing.assert_array_equal(outcomes[0][1], outcomes[1][1])
