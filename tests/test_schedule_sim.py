"""The engine loop's scheduling over a simulated device (bench/schedule_sim.py): one device running the calls in
order at the H200's costs for the 0.6B shape, on a simulated clock, with the server's admission and listeners who
play from the first byte. Deterministic, so the zero-underrun contract is a plain assertion here."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

from serving.settings import Settings

spec = importlib.util.spec_from_file_location("schedule_sim", Path(__file__).parents[1] / "bench" / "schedule_sim.py")
schedule_sim = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = schedule_sim  # its dataclasses look their module up there
spec.loader.exec_module(schedule_sim)


def test_under_steady_poisson_arrivals_every_stream_is_served_and_none_runs_dry(tiny_model):
    """120 requests a second of 60 frames for 5 s on 256 slots, 5 ms of host work an iteration: newcomers join
    every iteration, beside streams that send eight-frame chunks once they are a second ahead. Each newcomer's next
    audio goes out in a codec call that must run no longer than planned, or its listener, 80 ms into its first
    frame, runs dry (158 of 450 did, 108 more were refused, before codec calls were held to the step's width)."""
    config = Settings(slots=256, context=512).engine_config()
    got = schedule_sim.run_rate(tiny_model, config, rate=120.0, seconds=5.0, frames=60, scale=1.0, host_s=0.005,
                                seed=0)
    assert got["requests"] > 500 and got["refused"] == 0 and got["errors"] == 0
    assert got["served"] == got["requests"] and got["underrun_requests"] == 0
    assert got["frames_per_step"] > 2  # steps stay long enough to keep up, not one frame at a time


def test_a_closed_loop_as_wide_as_the_slots_is_served_whole_within_the_seed_slo(tiny_model):
    """256 clients on 256 slots, each sending its next request when its last ends (or is refused, at once): all 256
    arrive together, then come back in waves as their streams end. Every request is served, none runs dry, and p95
    first audio stays within the seed SLO's 300 ms although the first wave prefills 256 requests at once."""
    config = Settings(slots=256, context=512).engine_config()
    got = schedule_sim.run_rate(tiny_model, config, rate=0.0, seconds=0.0, frames=60, scale=1.0, host_s=0.005,
                                seed=0, closed=256)
    assert got["requests"] == 512 and got["refused"] == 0 and got["errors"] == 0
    assert got["served"] == 512 and got["underrun_requests"] == 0
    assert got["ttfa_p95_ms"] <= 300



def test_an_engine_started_without_a_warm_up_serves_every_stream_as_its_rungs_first_run(tiny_model):
    """Nothing timed before the first requests (a server's `Settings.warmup` off), and each rung's step cost only once a
    step that wide has run: arrivals that fill the slots climb the ladder rung by rung, and every decision that
    reads a cost (admission, the newcomer guard, the step planner) takes one not timed yet as none. Each request
    is served or refused, none fails and none runs dry (the newcomer guard once failed every stream on a rung with
    no one-frame step timed)."""
    config = Settings(slots=256, context=512).engine_config()
    got = schedule_sim.run_rate(tiny_model, config, rate=60.0, seconds=4.0, frames=60, scale=1.0, host_s=0.005,
                                seed=0, warmup=False)
    assert got["requests"] > 200 and got["errors"] == 0 and got["served"] + got["refused"] == got["requests"]
    assert got["underrun_requests"] == 0


def test_a_jittered_device_runs_each_call_longer_by_a_random_delay_the_same_for_a_seed():
    """`--jitter-ms`: every call costs its measured time plus a delay drawn from an exponential of that mean,
    drawn from the seed, so side-by-side runs see the same delays."""
    import numpy as np

    config = Settings(slots=256, context=512).engine_config()
    idx, limits = np.arange(64, dtype=np.int32), np.ones(64, np.int32)

    def busy(jitter_s):
        runner = schedule_sim.RealTimeRunner(config, 0, clock=schedule_sim.Clock(), jitter_s=jitter_s)
        for _ in range(200):
            runner.step(idx, limits, 1)
        return runner.busy

    plain, jittered = busy(0.0), busy(0.005)
    assert jittered == busy(0.005)
    assert 0.004 < (jittered - plain) / 200 < 0.006  # the mean of 200 draws of an exponential of mean 5 ms


def test_with_xla_host_a_call_holds_its_thread_for_its_launches_and_until_the_device_is_nearly_through():
    """`xla_host`: a call returns after its own host time, and no sooner than the launch queue's reach before the
    device finishes it; without it a call returns at once (the clock is the engine thread's)."""
    import numpy as np
    from bench import sim_device

    config = Settings(slots=256, context=512).engine_config()
    idx, limits = np.arange(256, dtype=np.int32), np.full(256, 4, np.int32)

    def returned_after(xla_host, frames, busy_before=0.0):
        clock = sim_device.Clock()
        runner = sim_device.RealTimeRunner(config, 0, clock=clock, xla_host=xla_host)
        start = clock.now
        runner.free = start + busy_before  # the device still running earlier calls
        runner.step(idx, limits, frames)
        return clock.now - start, runner.free - start

    assert returned_after(False, 4)[0] == 0.0
    held, _ = returned_after(True, 1)  # a one-frame step: the device finishes it within the queue's reach
    assert held == pytest.approx(sim_device.step_host_s(1))
    held, done = returned_after(True, 4)  # 55 ms of device work: the launches wait for the queue
    assert done == pytest.approx(sim_device.step_s(256, 4))
    assert held == pytest.approx(done - sim_device.LAUNCH_AHEAD_S)
    held, done = returned_after(True, 1, busy_before=0.05)  # behind 50 ms of queued work
    assert held == pytest.approx(done - sim_device.LAUNCH_AHEAD_S) and held > sim_device.step_host_s(1)


def test_in_real_time_a_held_call_takes_the_gil_back_as_often_as_xla_does(monkeypatch):
    """In real time a held call sleeps in `GIL_TAKES` parts, each ending in a taking-back of the GIL that waits for
    the thread holding it, as XLA's calls do; they add up to the hold. A wait for an output is one sleep."""
    import numpy as np
    from bench import sim_device

    now, sleeps = [100.0], []

    def sleep(seconds):
        sleeps.append(seconds)
        now[0] += seconds

    # the simulator's own clock and sleep only (the `time` module itself stays as other threads see it)
    monkeypatch.setattr(sim_device, "time", types.SimpleNamespace(perf_counter=lambda: now[0], sleep=sleep))
    config = Settings(slots=256, context=512).engine_config()
    runner = sim_device.RealTimeRunner(config, 0, xla_host=True)
    out = runner.step(np.arange(256, dtype=np.int32), np.full(256, 1, np.int32), 1)
    assert len(sleeps) == sim_device.GIL_TAKES
    assert sum(sleeps) == pytest.approx(sim_device.step_host_s(1))
    sleeps.clear()
    np.asarray(out[0])  # the rest of the device's work: one wait
    assert len(sleeps) == 1 and now[0] == pytest.approx(runner.free)


def test_an_event_loop_taking_each_chunk_in_turn_delays_what_listeners_hear_and_widens_the_margin(tiny_model):
    """`--chunk-us`: the server's event loop takes a hand-out's chunks one after another, 120 µs each, so at 120
    requests a second (about a hundred chunks a hand-out) its last listener hears its chunk about 12 ms after the
    engine handed it out. The engine's margin takes that lag in, first audio comes later, and no stream runs dry;
    without it, each listener hears its chunk at the hand-out."""
    config = Settings(slots=256, context=512).engine_config()
    args = dict(rate=120.0, seconds=5.0, frames=60, scale=1.0, host_s=0.005, seed=0)
    prompt = schedule_sim.run_rate(tiny_model, config, **args)
    queued = schedule_sim.run_rate(tiny_model, config, chunk_s=120e-6, **args)
    assert queued["margin_ms_at_end"] > prompt["margin_ms_at_end"]
    assert queued["ttfa_p50_ms"] > prompt["ttfa_p50_ms"] and queued["ttfa_p95_ms"] > prompt["ttfa_p95_ms"]
    assert queued["served"] == prompt["served"] == queued["requests"] and queued["underrun_requests"] == 0


def test_the_simulated_device_is_a_runner_the_loop_warms_up_and_serves_over(tiny_model):
    """The loop takes either device half (`DeviceRunner`): the real runner and the simulated one have every call it
    makes, and the simulated engine comes up as a server's does, compiling its larger rungs in the background on
    a scratch state, then serves a request to its end."""
    from qtts_jax.engine import DeviceRunner, Engine, Runner, warmup
    from qtts_jax.request import Request
    from support import SMALL

    config = Settings(slots=32, context=512).engine_config()
    clock = schedule_sim.Clock()
    runner = schedule_sim.RealTimeRunner(config, clock=clock)
    assert isinstance(runner, DeviceRunner) and isinstance(Runner(tiny_model, SMALL), DeviceRunner)
    engine = Engine(tiny_model, config, runner=runner)
    engine.set_clock(clock)
    engine.warmup(background=True)
    assert warmup.wait(engine, 30) and engine.stats().compiling == 0 and engine.stats().ladder == config.ladder
    chunks = []
    engine.submit(engine.prepare(Request("One request.", speaker="ryan", max_frames=12)), chunks.append)
    while engine.run_once():
        pass
    assert chunks[-1].final and chunks[-1].error is None and sum(c.frames for c in chunks) == chunks[-1].first_frame > 0
