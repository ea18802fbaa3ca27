"""A server's warm-up in stages: serving from the least that is compiled while the rest compiles in the
background, growing to every slot and step size, with the same codes."""

from __future__ import annotations

import dataclasses
import threading

from qtts_jax.engine import Engine
from qtts_jax.engine import warmup as warming
from qtts_jax.request import Request
from support import SMALL, assert_same_codes, run


def test_background_warmup_serves_its_smallest_rung_at_once_then_grows_to_every_slot(tiny_model, monkeypatch):
    """`warmup(background=True)` returns with the least that serves compiled and timed: the smallest rung, one
    frame a step: the engine serves that many streams (the next waits for a free one) and says so in its stats;
    once the rest is compiled and timed on its own thread, every slot and step size serves, and the codes are the
    same. Each stage runs every program it compiled, those it does not time too (an executable's first call pays a
    one-off set-up: on a GPU, loading its kernels), so the loop pays it for none; the last calls `on_compiled` on
    the warm-up's thread before the stats say nothing is left to compile (a server freezes the collector there,
    before a benchmark that waits for it starts measuring)."""
    # SMALL's programs but a second rung and a 2-frame step: most come from the session's compilation cache
    engine = Engine(tiny_model, dataclasses.replace(SMALL, batch_sizes=(1,), frames_per_step=2))
    runner, ran, hooked = engine.runner, set(), []
    compile_, gate, rest = runner.compile, threading.Event(), warming.rest

    def compile_counting(keys):
        compile_(keys)
        for key in keys:
            exe = runner.programs[key]
            runner.programs[key] = lambda *args, key=key, exe=exe, **kwargs: (ran.add(key), exe(*args, **kwargs))[1]

    runner.compile = compile_counting
    monkeypatch.setattr(runner, "stored", lambda keys: False)  # a cold start: nothing kept whole to load at once
    engine.on_compiled = lambda: hooked.append((threading.current_thread().name, engine.stats().compiling,
                                                ran == set(runner.programs)))
    monkeypatch.setattr(warming, "rest", lambda *args: gate.wait() and rest(*args))
    engine.warmup(background=True)
    assert ran == set(runner.programs) and ("append", 1, 8) in ran  # the live-text append: no timing needs it
    st = engine.stats()
    # to come: a prefill of 2 and rung 1's 2-frame step; rung 2's two steps and codec call
    assert (st.slots, st.ladder, st.step_sizes, st.compiling) == (1, (1,), (1,), 5)
    assert engine.compiling == 5  # what admission's observer reads, without the snapshot
    reqs = [Request("One at a time.", speaker="ryan", seed=3, max_frames=4),
            Request("Then me.", speaker="eric", seed=4, max_frames=3)]
    alone = run(engine, [(0, r) for r in reqs])
    assert alone[1][0].timings.admitted >= alone[0][0].timings.finished
    gate.set()
    assert warming.wait(engine, 300)
    st = engine.stats()
    assert (st.slots, st.ladder, st.step_sizes, st.compiling) == (2, (1, 2), (1, 2), 0)
    assert engine.compiling == 0
    assert {(2, 1), (2, 2)} <= set(st.step_costs) and 2 in st.first_costs and 2 in st.prefill_costs
    # what the loop measured while XLA compiled is dropped: the idle timings again, iteration time measured anew
    assert st.step_costs == engine.idle_step_costs and st.iteration_s == 0.0
    assert hooked == [("qtts-warmup", 3, True)]  # rung 2's three programs not yet published
    together = run(engine, [(0, r) for r in reqs])
    assert together[0][0].timings.admitted == together[1][0].timings.admitted
    assert_same_codes(together, alone)



def test_a_warmup_whose_programs_are_all_kept_whole_serves_every_slot_at_once(tiny_model, monkeypatch):
    """When the compilation cache holds every program whole, loading them takes seconds: the warm-up does it all
    before it returns, even when asked to go on in the background, and the engine is at full size at once."""
    engine = Engine(tiny_model, dataclasses.replace(SMALL, batch_sizes=(1,), frames_per_step=2))
    monkeypatch.setattr(engine.runner, "stored", lambda keys: True)
    monkeypatch.setattr(warming, "rest", lambda *args: (_ for _ in ()).throw(AssertionError("a background stage")))
    engine.warmup(background=True)
    st = engine.stats()
    assert (st.slots, st.ladder, st.step_sizes, st.compiling) == (2, (1, 2), (1, 2), 0)


def test_programs_compiled_ahead_by_workers_are_loaded_by_the_background_stages(tiny_model, tmp_path, monkeypatch):
    """A core process starts compile workers on every program before it loads the model (`warmup.compile_ahead`,
    from the model's shapes): the warm-up loads each stage, the first too, from what the workers stored without
    tracing one, reaches every slot, and the workers are gone."""
    from qtts_jax.engine import compile_cache
    from qtts_jax.engine.runner import stages

    monkeypatch.setattr(compile_cache, "directory", lambda: tmp_path)
    config = dataclasses.replace(SMALL, batch_sizes=(1,), frames_per_step=2, context=SMALL.context + 24,
                                 compile_workers=1)
    ahead = warming.compile_ahead("tiny-random", "float32", config)
    engine = Engine(tiny_model, config)
    engine.compiling_ahead = ahead
    traced, lower = [], engine.runner.lower
    monkeypatch.setattr(engine.runner, "lower", lambda *key: (traced.append(key), lower(*key))[1])
    engine.warmup(background=True)
    assert warming.wait(engine, 300)
    assert traced == [] and engine.runner.stored([key for stage in stages(config) for key in stage])
    assert engine.stats().slots == config.slots
    assert all(proc.wait(timeout=60) is not None for proc, _ in ahead.procs)  # done, or stopped by the warm-up


def test_only_timings_taken_with_nothing_compiling_are_kept_and_the_last_stage_retimes_every_program(
        tiny_model, tmp_path, monkeypatch):
    """Timed beside compiles (on a GPU the workers' autotuning shares the device), a stage's timings serve the loop
    but are not kept for the next start; once the last stage is made, every program is timed again, the loop's
    costs become those timings, the first stage's too, and the compilation cache keeps them."""
    from qtts_jax.engine import compile_cache

    monkeypatch.setattr(compile_cache, "directory", lambda: tmp_path)
    engine = Engine(tiny_model, dataclasses.replace(SMALL, batch_sizes=(1,), frames_per_step=2,
                                                    context=SMALL.context + 24))
    gate, rest = threading.Event(), warming.rest
    monkeypatch.setattr(engine.runner, "stored", lambda keys: False)  # a cold start, in stages
    monkeypatch.setattr(warming, "rest", lambda *args: gate.wait() and rest(*args))
    engine.warmup(background=True)
    store = engine.runner.store
    provisional = dict(engine.stats().step_costs)
    assert store.load_timings() == {} and (1, 1) in provisional  # served on, not kept
    gate.set()
    assert warming.wait(engine, 300)
    kept, st = store.load_timings(), engine.stats()
    for (rows, frames), cost in st.step_costs.items():
        chunk = min(s for s in SMALL.codec_sizes if s >= min(max(SMALL.schedule), frames))
        assert cost == kept["step", rows, frames] + kept["codec", rows, chunk]
    assert st.step_costs[1, 1] != provisional[1, 1]  # the first stage's timing too, taken again
    assert st.first_costs == {rows: kept["first", rows, 1] for rows in st.first_costs}
