"""The streaming engine on `tiny-random`: equal to `Model.generate`, isolated, guarded, compile-free."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
import threading
import time
import weakref

import numpy as np
import pytest

from serving.bridge import AsyncEngine
from qtts_jax.engine import Engine, PromptTooLong, admission, iteration, plan
from qtts_jax.engine.stream import FRAME_SECONDS
from qtts_jax.request import Request, RequestError
from support import GREEDY, STREAMING, Collector, assert_same_codes, compiles, run, run_small

CONFIG = STREAMING


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def engine(model):
    e = Engine(model, CONFIG)
    e.warmup()
    return e


TEXTS = ["Hello.", "A somewhat longer sentence for the engine to say.", "Third!", "Four four four.", "Five."]


def test_greedy_engine_equals_model_generate(engine, model):
    reqs = [Request(t, speaker="ryan", max_frames=9 + i, non_streaming=i % 2 == 0, **GREEDY) for i, t in enumerate(TEXTS)]
    # five requests on four slots, joining at different iterations: one waits for a free slot
    got = run(engine, [(i, r) for i, r in enumerate(reqs)])
    for req, (stream, col), expected in zip(reqs, got, model.generate(reqs)):
        np.testing.assert_array_equal(np.stack(stream.codes), expected.codes)
        assert col.final.error is None
        assert len(col.audio) == len(expected.codes) * 1920
        np.testing.assert_allclose(col.audio, expected.audio, atol=1e-5, rtol=0)


class SimulatedClock:
    """Engine time that advances `tick` seconds per reading: how fast the engine looks against playback."""

    def __init__(self, tick: float):
        self.now, self.tick = 1000.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


@pytest.fixture
def clock(engine):
    """A simulated clock for one test; the costs its iterations measured (simulated seconds) go with it."""
    costs = {name: dict(getattr(engine, name)) for name in ("step_costs", "first_costs", "prefill_costs")}
    yield lambda tick: engine.set_clock(SimulatedClock(tick))
    engine.set_clock(time.perf_counter)
    for name, value in costs.items():
        setattr(engine, name, value)


@pytest.fixture
def admit_all(monkeypatch):
    """Every waiting request with a free slot starts: on a CPU the playing streams' listeners run dry, and the
    newcomer guard would hold every newcomer back from what a test looks at."""
    monkeypatch.setattr(admission, "admissions", lambda waiting, *args: waiting)


@pytest.fixture
def lead(engine, monkeypatch):
    """Run the engine with another playback lead (a policy setting: no program depends on it)."""
    return lambda seconds: monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, lead_s=seconds))


@pytest.fixture
def cheap(engine, monkeypatch):
    """Every measured cost 1 ms: well inside a frame of audio, so headroom never holds a step back."""
    for name in ("step_costs", "first_costs", "prefill_costs"):
        monkeypatch.setattr(engine, name, {k: 1e-3 for k in getattr(engine, name)})


@pytest.fixture
def burst_lateness(engine, clock, lead, cheap):
    """A fast engine (every cost 1 ms, no lead to build) that has measured 200 ms of lateness at its listeners, as
    in a burst: more than a one-frame first chunk's 80 ms of audio (a new clock forgets it after the test)."""
    clock(1e-4)
    lead(0.0)
    for _ in range(10):
        engine.observe_delivery_lag(0.2)


def test_ahead_of_playback_chunks_follow_the_schedule(engine, clock, lead, cheap):
    clock(1e-4)  # far faster than real time: every stream has plenty of headroom
    lead(0.0)  # no lead to build: the schedule alone sizes the chunks
    (stream, col), = run(engine, [(0, Request("Schedule.", speaker="aiden", max_frames=20, **GREEDY))])
    sizes = [c.frames for c in col.chunks if not c.final]
    assert sizes[:4] == [1, 2, 4, 8] and sum(sizes) == len(stream.codes)
    t = stream.timings
    assert t.submitted <= t.admitted <= t.prefilled <= t.first_frame <= t.first_chunk <= t.finished


def test_each_chunk_after_the_first_carries_when_its_listener_runs_dry_without_it(engine, clock, lead):
    """A listener who plays from the first chunk has, when chunk k arrives, the audio of the chunks before it:
    it runs dry at the first chunk's time plus their frames. The bridge delivers the soonest due first; a first
    chunk is due before any (its listener is waiting for it), the final one after all (it has no audio)."""
    clock(1e-4)
    lead(0.0)
    (stream, col), = run(engine, [(0, Request("Due times.", speaker="aiden", max_frames=20, **GREEDY))])
    first, *rest = [c for c in col.chunks if not c.final]
    assert first.due == -math.inf and col.final.due == math.inf and len(rest) >= 3
    for c in rest:
        assert c.due == pytest.approx(stream.timings.first_chunk + c.first_frame * FRAME_SECONDS)


def test_when_measured_lateness_outlasts_a_frame_the_first_chunk_carries_the_steps_frames_too(engine, model,
                                                                                          burst_lateness):
    """With 200 ms of lateness measured (a burst's busy event loop), a one-frame first chunk would play out before
    its next audio reached the listener: the newcomer's first frame is decoded with its first step's frames and
    goes out with them, the same audio as `Model.generate`'s."""
    req = Request("Held first frame.", speaker="aiden", max_frames=12, **GREEDY)
    (stream, col), = run(engine, [(0, req)])
    sizes = [c.frames for c in col.chunks if not c.final]
    assert sizes[0] > 1 and sum(sizes) == len(stream.codes)
    assert col.chunks[0].due == -math.inf and col.chunks[0].first_frame == 0
    (expected,) = model.generate([req])
    np.testing.assert_array_equal(np.stack(stream.codes), expected.codes)
    np.testing.assert_allclose(col.audio, expected.audio, atol=1e-5, rtol=0)


def test_a_held_first_chunk_is_no_longer_than_the_codecs_largest_and_no_frame_is_lost(engine, model, burst_lateness,
                                                                                       monkeypatch):
    """Held for a three-frame step, a first chunk would hold four frames; with two-frame codec calls the largest
    (a schedule of 1 and 2 frames), it holds two and the rest follow: every frame decoded once, the same audio as
    `Model.generate`'s (a chunk wider than the call dropped a frame's audio)."""
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, schedule=(1, 2)))
    monkeypatch.setattr(engine, "sizes", dataclasses.replace(engine.sizes, codec=(1, 2)))  # the schedule's, compiled
    req = Request("Held, then capped.", speaker="aiden", max_frames=12, **GREEDY)
    (stream, col), = run(engine, [(0, req)])
    sizes = [c.frames for c in col.chunks if not c.final]
    assert sizes[0] == 2 and max(sizes) == 2 and sum(sizes) == len(stream.codes)
    (expected,) = model.generate([req])
    np.testing.assert_allclose(col.audio, expected.audio, atol=1e-5, rtol=0)


def test_a_first_chunk_the_client_sized_is_never_held_to_another_size(engine, burst_lateness):
    """Holding concerns one-frame first chunks: a client whose schedule starts with two frames gets two, with
    the same lateness measured that holds a one-frame first chunk for the step."""
    col = Collector()
    stream = engine.submit(engine.prepare(Request("Two first.", speaker="aiden", max_frames=12, **GREEDY), (2, 4)),
                           col)
    while not col.final:
        engine.run_once()
    sizes = [c.frames for c in col.chunks if not c.final]
    assert sizes[0] == 2 and sum(sizes) == len(stream.codes)


def test_a_stream_sends_every_frame_at_once_until_it_has_its_lead_then_follows_the_schedule(engine, clock, lead,
                                                                                             cheap):
    """Far faster than playback, a stream's frames go out in the iteration that made them (three per step) until
    it holds `lead_s` of audio (0.5 s: 7 frames); from then on chunks take the schedule's next sizes (it has sent three: 8)."""
    clock(1e-4)
    lead(0.5)
    (stream, col), = run(engine, [(0, Request("Lead first.", speaker="aiden", max_frames=30, **GREEDY))])
    sizes = [c.frames for c in col.chunks if not c.final]
    assert sizes[:3] == [1, 3, 3]  # 7 frames: 0.56 s in hand
    assert sizes[3] == 8 and set(sizes[3:-1]) == {8}  # the schedule's next size (the last chunk: the LM's tail)
    assert sum(sizes) == len(stream.codes) > 7 + 8


def test_while_a_newcomer_builds_its_lead_no_codec_call_is_wider_than_the_step(engine, clock, lead, cheap,
                                                                              monkeypatch):
    """A stream past its lead sends eight-frame chunks; once a newcomer joins, whose next audio waits in each
    codec call until it has its own lead, no call is wider than the chunk the step's cost counted (three-frame
    steps: the four-frame codec), so the planner's prediction of when that audio goes out holds."""
    clock(1e-4)
    lead(0.5)
    widths = []
    codec = engine.runner.codec
    monkeypatch.setattr(engine.runner, "codec", lambda *a: widths.append(a[-1]) or codec(*a))
    playing, newcomer = Collector(), Collector()
    engine.submit(engine.prepare(Request("Far ahead of its listener.", speaker="ryan", max_frames=36, **GREEDY)),
                  playing)
    while not any(c.frames == 8 for c in playing.chunks):
        assert engine.run_once()
    assert max(widths) == 8
    widths.clear()
    new = engine.submit(engine.prepare(Request("Newcomer.", speaker="aiden", max_frames=12, **GREEDY)), newcomer)
    while new.buffered(engine.clock()) is None or new.buffered(engine.clock()) < 0.5:
        assert engine.run_once()
    assert widths and max(widths) == 4
    while engine.run_once():
        pass
    assert playing.final.error is None and newcomer.final.error is None


def test_short_of_headroom_frames_go_out_at_once_one_per_step(engine, clock, monkeypatch):
    """An engine slower than playback (0.3 s per clock reading) sends each frame as soon as it exists instead
    of holding it back for a bigger chunk, and steps one frame at a time, the cheapest wait for the next. It starts
    from an unloaded CPU's costs (not what earlier tests on the shared engine measured under load), so the first
    chunk's next audio is predicted in time and that chunk goes out alone."""
    per_call = {1: 0.04, 2: 0.075, 3: 0.09}  # this CPU's calibration of the tiny model, unloaded
    monkeypatch.setattr(engine, "step_costs", {(rows, n): per_call.get(n, 0.03 * n) for rows, n in engine.step_costs})
    for name in ("first_costs", "prefill_costs"):
        monkeypatch.setattr(engine, name, {k: 0.03 for k in getattr(engine, name)})
    clock(0.3)
    (stream, col), = run(engine, [(0, Request("Hurry up.", speaker="aiden", max_frames=12, **GREEDY))])
    sizes = [c.frames for c in col.chunks if not c.final]
    assert sizes == [1] * len(stream.codes)


def test_seeded_request_same_alone_in_any_slot_and_beside_others(engine):
    target = Request("Seeded and sampled.", speaker="vivian", seed=1234, max_frames=14)
    (alone, alone_audio), = run(engine, [(0, target)])
    others = [Request(t, speaker="eric", seed=i, max_frames=5 + 3 * i) for i, t in enumerate(TEXTS[:3])]
    # the target joins third, while others start and finish around it, in a different slot
    got = run(engine, [(0, others[0]), (1, others[1]), (2, target), (6, others[2])])
    np.testing.assert_array_equal(np.stack(got[2][0].codes), np.stack(alone.codes))
    got2 = run(engine, [(0, others[1]), (0, others[0]), (0, others[2]), (0, target)])
    np.testing.assert_array_equal(np.stack(got2[3][0].codes), np.stack(alone.codes))
    for _, col in (got[2], got2[3]):
        np.testing.assert_allclose(col.audio, alone_audio.audio, atol=1e-5, rtol=0)
    assert len({alone.slot, got[2][0].slot, got2[3][0].slot}) >= 2, "the target should have run in different slots"


def test_cancel_frees_slot_at_next_step(engine):
    col = Collector()
    stream = engine.submit(engine.prepare(Request("Cancel me please.", speaker="ryan", max_frames=100, **GREEDY)), col)
    for _ in range(3):
        engine.run_once()
    assert stream.slot is not None and engine.slots[stream.slot] is stream
    stream.cancel()
    engine.run_once()
    assert engine.slots[stream.slot] is not stream
    assert col.final is not None and col.final.error == "cancelled"
    assert len(stream.codes) < 100


def test_a_stream_submitted_ahead_takes_the_next_free_slot_before_waiting_requests(engine, admit_all):
    """The next part of a long response (its listener is playing) goes before requests waiting for a slot."""
    playing = [engine.submit(engine.prepare(Request(f"Holding slot {i}.", speaker="ryan", max_frames=100, **GREEDY)),
                             Collector()) for i in range(engine.config.slots)]
    engine.run_once()
    assert all(s.slot is not None for s in playing)
    waiting = engine.submit(engine.prepare(Request("I came first.", speaker="eric", max_frames=3)), Collector())
    ahead = engine.submit(engine.prepare(Request("Next part.", speaker="ryan", max_frames=3)), Collector(), ahead=True)
    playing[0].cancel()
    engine.run_once()
    assert ahead.slot is not None and waiting.slot is None
    for s in (*playing, waiting, ahead):
        s.cancel()
    while engine.run_once():
        pass


def test_stats_follow_a_cancel_that_leaves_the_engine_idle(engine):
    """The snapshot admission reads must not keep a cancelled stream: an idle engine that still looked busy
    would be refused work for ever."""
    stream = engine.submit(engine.prepare(Request("Leaving early.", speaker="ryan", max_frames=100, **GREEDY)),
                           Collector())
    engine.run_once()
    assert engine.stats().live == 1 and engine.stats().frames_left[0] > 0
    stream.cancel()
    while engine.run_once():
        pass
    st = engine.stats()
    assert (st.live, st.queued, st.frames_left) == (0, 0, ())


def test_stats_name_the_stream_of_each_entry(engine):
    """Admission finds a long input's part in flight by its stream id: each entry of the snapshot names its
    stream, in the entries' order, in a slot and in the queue."""
    streams = [engine.submit(engine.prepare(Request(t, speaker="ryan", max_frames=50, **GREEDY)), Collector())
               for t in TEXTS[: engine.config.slots + 1]]
    engine.run_once()
    st = engine.stats()
    in_slots = [s for s in engine.slots if s is not None]
    assert st.live_ids == tuple(s.id for s in in_slots) and len(st.live_ids) == engine.config.slots
    assert st.frames_left == tuple(s.frames_cap - len(s.codes) for s in in_slots)
    assert st.queued_ids == (streams[-1].id,) and st.queued_frames == (streams[-1].frames_cap,)
    for s in streams:
        s.cancel()
    while engine.run_once():
        pass


def test_stats_read_the_streams_in_slots_and_their_frames_left_together(engine, monkeypatch):
    """Between two published snapshots, streams join slots (and leave them): `stats()` counts them as they are
    now, and must count their frames left with them, or admission's slot arithmetic runs out of slots (an
    IndexError that turned a burst's 429s into 500s). The iteration is held in its prefill: the streams are in
    slots, the snapshot is still the one published before them."""
    inside, release = threading.Event(), threading.Event()
    prefill = engine.runner.prefill
    monkeypatch.setattr(engine.runner, "prefill", lambda *a: (inside.set(), release.wait(60), prefill(*a))[2])
    streams = [engine.submit(engine.prepare(Request(t, speaker="ryan", max_frames=50, **GREEDY)), Collector())
               for t in TEXTS[: engine.config.slots]]
    iteration = threading.Thread(target=engine.run_once)
    iteration.start()
    try:
        assert inside.wait(60)
        st = engine.stats()
    finally:
        release.set()
        iteration.join()
    assert st.live == engine.config.slots and len(st.frames_left) == st.live and min(st.frames_left) > 0
    for s in streams:
        s.cancel()
    while engine.run_once():
        pass


def test_guards(engine, model):
    with pytest.raises(PromptTooLong) as err:
        engine.prepare(Request("x" * 400, speaker="ryan"))
    assert err.value.field == "text"
    # runaway guard: no explicit max_frames, the cap comes from the text length (a stream stops at its job's cap:
    # test_greedy_engine_equals_model_generate; Model.generate at the same text-length cap: test_end_to_end)
    job = engine.prepare(Request("Hi.", speaker="ryan", **GREEDY))
    assert job.frames_cap == job.prompt.frame_cap(CONFIG.frames_cap_base, CONFIG.frames_per_text_token) < CONFIG.context


def test_no_compilation_in_steady_state(engine):
    with compiles() as seen:
        run(engine, [(0, Request("No compiles.", speaker="ryan", max_frames=17)),
                     (2, Request("Another one here.", speaker="sohee", seed=3, max_frames=11, non_streaming=False))])
    assert seen == []


def test_asyncio_bridge_streams_chunks_with_timings(engine):
    async def main():
        bridge = AsyncEngine(engine)
        await bridge.start(warmup=False)  # the module's engine is compiled already
        try:
            streams = [bridge.submit(engine.prepare(Request(t, speaker="ryan", max_frames=6, **GREEDY)))
                       for t in TEXTS[:3]]
            results = []
            for s in streams:
                chunks = [c async for c in s]
                results.append((s, chunks))
            cancelled = bridge.submit(engine.prepare(Request("Gone.", speaker="ryan", max_frames=200, **GREEDY)))
            first = await cancelled.__anext__()
            cancelled.cancel()
            rest = [c async for c in cancelled]
            return results, first, rest
        finally:
            await bridge.stop()

    results, first, rest = asyncio.run(main())
    for s, chunks in results:
        assert chunks[-1].final and chunks[-1].error is None
        assert sum(c.frames for c in chunks) == s.stream.frames <= 6  # the frames the core made for it
        assert all(v is not None for v in s.timings.as_dict().values())
    assert first.frames >= 1 and len(first.pcm) == first.frames * 1920
    assert rest[-1].final and rest[-1].error == "cancelled"


def test_a_finished_request_is_freed_by_reference_counting_alone(engine):
    """Once its final chunk is out, nothing of a request served through the asyncio bridge is left in a reference
    cycle: its handle, engine stream and queue go as soon as the handler drops them, with the garbage collector off.
    Each request used to be such a cycle (handle -> stream -> callback -> handle), and under load only the
    collector's full passes freed them, holding the GIL and the engine loop 20-50 ms at a time."""
    async def main():
        bridge = AsyncEngine(engine)
        await bridge.start(warmup=False)
        try:
            out = bridge.submit(engine.prepare(Request("Freed at once.", speaker="ryan", max_frames=4, **GREEDY)))
            chunks = [c async for c in out]
            return weakref.ref(out), weakref.ref(out.stream), chunks
        finally:
            await bridge.stop()

    gc.disable()
    try:
        handle, stream, chunks = asyncio.run(main())
        assert chunks[-1].final and chunks[-1].error is None
        assert handle() is None and stream() is None
    finally:
        gc.enable()


def test_pallas_sampler_makes_the_same_choices(model):
    """The engine with the Pallas sampling kernel (interpreted on CPU) picks what the jnp reference picks."""
    reqs = [Request("Pallas or not.", speaker="ryan", seed=5, max_frames=4),
            Request("Greedy too.", speaker="eric", max_frames=3, **GREEDY)]
    assert_same_codes(run_small(model, reqs, sampler="pallas"), run_small(model, reqs, sampler="jnp"))


def test_newcomer_gets_its_first_chunk_at_once_and_joins_the_long_step_of_the_playing_streams(engine, clock,
                                                                                            cheap):
    """A newcomer's first frame and its audio run in a program of their own, ahead of the step: its first chunk
    leaves in the iteration it joins, and it then steps with the playing streams in that same iteration, as many
    frames as its one frame of audio outlasts (here all three: every cost is 1 ms)."""
    clock(1e-4)  # far faster than playback
    playing, newcomer = Collector(), Collector()
    old = engine.submit(engine.prepare(Request("Already playing for a while.", speaker="ryan", max_frames=40, **GREEDY)),
                        playing)
    for _ in range(4):
        engine.run_once()
    assert playing.chunks and not old.lm_done
    before = len(old.codes)
    new = engine.submit(engine.prepare(Request("Newcomer.", speaker="aiden", max_frames=20, **GREEDY)), newcomer)
    engine.run_once()
    assert len(old.codes) - before == CONFIG.frames_per_step
    assert [c.frames for c in newcomer.chunks] == [1] and len(new.codes) == 1 + CONFIG.frames_per_step
    engine.run_once()  # the frames it stepped went to the codec at once (it has no lead yet) and are out now
    assert [c.frames for c in newcomer.chunks][:2] == [1, CONFIG.frames_per_step]
    while engine.run_once():
        pass
    assert playing.final.error is None and newcomer.final.error is None


def test_how_late_newcomers_first_audio_goes_out_behind_a_codec_call_is_measured_and_published(engine, cheap, lead,
                                                                                              admit_all):
    """A newcomer's first frame runs on the device after the previous iteration's codec call, so its first audio
    goes out later than its own programs' (here 2 ms) cost after the iteration's start: the loop measures by how
    much (the step planner and admission count the newcomer's deadline from then), only in iterations with a
    codec call ahead of it, and publishes it in the stats."""
    engine.set_clock(time.perf_counter)  # a new clock: nothing measured yet
    lead(10.0)  # every frame of the playing stream goes to the codec in the iteration that made it
    playing, newcomer = Collector(), Collector()
    engine.submit(engine.prepare(Request("Already playing.", speaker="ryan", max_frames=30, **GREEDY)), playing)
    for _ in range(2):
        engine.run_once()
    assert not engine.first_late and engine.stats().first_late_s == 0.0  # nothing ran ahead of its first frame
    ahead = engine.audio_in_flight.shape  # the playing stream's codec call, queued before the newcomer's first frame
    new = engine.submit(engine.prepare(Request("Newcomer.", speaker="aiden", max_frames=10, **GREEDY)), newcomer)
    engine.run_once()
    assert list(engine.first_late) == [ahead]  # measured for that call's shape
    (late,) = engine.first_late[ahead]
    assert new.codes and late > 0 and engine.stats().first_late_s == pytest.approx(late)
    while engine.run_once():
        pass
    assert playing.final.error is None and newcomer.final.error is None


def test_audio_goes_out_while_the_step_is_being_dispatched(engine, clock, cheap, monkeypatch):
    """The step's call holds the engine thread while the device runs its loop trips (30-40 ms on a GPU): a
    newcomer's first chunk and the playing streams' audio of the previous codec call go out meanwhile, from the
    sender thread, not after it returns. Here the step's call waits until both have gone out (or 10 s)."""
    clock(1e-4)
    playing, newcomer = Collector(), Collector()
    old = engine.submit(engine.prepare(Request("Already playing.", speaker="ryan", max_frames=40, **GREEDY)), playing)
    for _ in range(3):
        engine.run_once()
    new = engine.submit(engine.prepare(Request("Newcomer.", speaker="aiden", max_frames=20, **GREEDY)), newcomer)
    chunks_before = len(playing.chunks)
    seen_during_step = []
    step = engine.runner.step

    def slow_step(*args):
        deadline = time.monotonic() + 10
        newcomer.wait(1, 10)
        playing.wait(chunks_before + 1, deadline - time.monotonic())
        seen_during_step.append((len(newcomer.chunks), len(playing.chunks) - chunks_before))
        return step(*args)

    monkeypatch.setattr(engine.runner, "step", slow_step)
    engine.run_once()
    assert seen_during_step == [(1, 1)]
    assert newcomer.chunks[0].frames == 1 and len(new.codes) > 1
    monkeypatch.setattr(engine.runner, "step", step)
    while engine.run_once():
        pass
    assert playing.final.error is None and newcomer.final.error is None
    assert sum(c.frames for c in playing.chunks) == len(old.codes)


def test_the_playing_streams_audio_goes_out_while_newcomers_are_admitted(engine, clock, cheap, monkeypatch):
    """In a burst the engine thread spends tens of ms admitting and prefilling newcomers (host work, contended by
    the event loop taking the burst's requests): the previous codec call's audio must not wait for that. Here the
    newcomer's prefill call waits until the playing stream's next chunk has gone out (or 5 s)."""
    clock(1e-4)
    playing = Collector()
    old = engine.submit(engine.prepare(Request("Already playing.", speaker="ryan", max_frames=40, **GREEDY)), playing)
    for _ in range(3):
        engine.run_once()
    engine.submit(engine.prepare(Request("Newcomer.", speaker="aiden", max_frames=20, **GREEDY)), Collector())
    chunks_before = len(playing.chunks)
    seen_during_prefill = []
    prefill = engine.runner.prefill

    def slow_prefill(*args):
        playing.wait(chunks_before + 1, 5)
        seen_during_prefill.append(len(playing.chunks) - chunks_before)
        return prefill(*args)

    monkeypatch.setattr(engine.runner, "prefill", slow_prefill)
    engine.run_once()
    assert seen_during_prefill == [1]
    monkeypatch.setattr(engine.runner, "prefill", prefill)
    while engine.run_once():
        pass
    assert playing.final.error is None
    assert sum(c.frames for c in playing.chunks) == len(old.codes)


def test_a_failed_step_ends_each_stream_after_the_audio_the_sender_still_had(engine, cheap, monkeypatch):
    """A device failure ends every stream with an error chunk, and that chunk is the last: audio the sender
    thread was still handing out (here slowed to 0.2 s) goes out before it, never after."""
    col = Collector()
    engine.submit(engine.prepare(Request("Doomed.", speaker="ryan", max_frames=20, **GREEDY)), col)
    send_first = iteration.send_first

    def slow_send_first(*args):
        time.sleep(0.2)  # still busy when the step fails: fail_all waits for the sender, so an event would deadlock
        return send_first(*args)

    def failing(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(iteration, "send_first", slow_send_first)
    monkeypatch.setattr(engine.runner, "step", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.run_once()
    engine.fail_all("engine failure: device lost")  # what the loop does with the exception
    assert [c.final for c in col.chunks] == [False, True] and col.final.error == "engine failure: device lost"


def test_delivery_lag_reported_by_the_bridge_widens_the_margin(engine):
    """Chunks that reach the event loop late are jitter the playback margin must cover."""
    floor = engine.config.min_margin_s
    engine.set_clock(time.perf_counter)  # forget the iterations earlier tests ran: only the lag is measured
    assert engine.jitter.margin() == floor
    for _ in range(10):
        engine.observe_delivery_lag(0.05)
    assert engine.jitter.margin() == pytest.approx(0.05)
    engine.set_clock(time.perf_counter)  # a new clock starts a new measurement
    assert engine.jitter.margin() == floor


def test_the_margin_covers_all_but_the_rarest_measured_lateness(model):
    """The margin is the 99th percentile of the lateness measured in its window: one sample in a hundred (a
    rare pause) stays above it rather than shortening every step."""
    engine = Engine(model, CONFIG)
    for late in [0.012] * 99 + [0.05]:
        engine.observe_delivery_lag(late)
    assert engine.jitter.margin() == pytest.approx(0.012, abs=1e-3)


class ManualClock:
    """Engine time that moves only when the test moves it."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_waits_while_a_playing_streams_headroom_cannot_pay_for_its_prefill(engine, monkeypatch):
    """Newcomers' prefill and first frame run before the playing streams' next frame: with 70 ms of audio in
    hand and 90 ms of work ahead of that frame, arrivals wait in the queue; once the playing stream has stepped
    ahead, they start."""
    for name in ("step_costs", "first_costs", "prefill_costs"):
        monkeypatch.setattr(engine, name, {k: 0.030 for k in getattr(engine, name)})
    clock = ManualClock()
    engine.set_clock(clock)
    try:
        playing = engine.submit(engine.prepare(Request("Playing on.", speaker="ryan", max_frames=40, **GREEDY)),
                                Collector())
        engine.run_once()  # its first chunk at 1000.0, then one step of three frames into the codec
        assert playing.decoded == 1 + CONFIG.frames_per_step
        clock.now += playing.decoded * 0.08 - 0.07  # 70 ms of audio left in hand
        late = [engine.submit(engine.prepare(Request(t, speaker="aiden", max_frames=8, **GREEDY)), Collector())
                for t in ("Burst one.", "Burst two.")]
        engine.run_once()
        assert all(s.slot is None for s in late) and len(engine.queue) == 2
        engine.run_once()  # the playing stream stepped three more frames meanwhile: 310 ms in hand
        assert all(s.slot is not None for s in late) and not engine.queue
    finally:
        while engine.run_once():  # leave the shared engine idle, whatever happened
            clock.now += 0.01
        engine.set_clock(time.perf_counter)
    assert all(s.finished for s in (playing, *late))


def test_bfloat16_codec_keeps_the_codes_and_the_audio_it_decodes(model):
    """The codec in bfloat16 changes only the arithmetic of the audio: the same codes, and audio that follows the
    fp32 codec's within bf16 rounding (`EngineConfig.codec_dtype`, a choice for speed)."""
    reqs = [Request("The codec in half precision.", speaker="ryan", max_frames=8, **GREEDY),
            Request("A second stream.", speaker="eric", seed=3, max_frames=6)]
    fp32, bf16 = run_small(model, reqs, codec_dtype="float32"), run_small(model, reqs, codec_dtype="bfloat16")
    assert_same_codes(bf16, fp32)
    for (_, c32), (_, c16) in zip(fp32, bf16):
        assert c16.final.error is None and c16.audio.dtype == np.float32 and len(c16.audio) == len(c32.audio)
        error = np.linalg.norm(c16.audio - c32.audio) / np.linalg.norm(c32.audio)
        assert 0 < error < 0.1  # bf16 keeps 8 bits a value, rounded through some 40 layers: 6% on CPU here


LIVE_TEXT = "Thanks for calling you."


def test_live_text_ids_are_the_whole_texts_however_it_is_cut(model):
    """Ids handed out piece by piece are a prefix of the whole text's at every point and all of them at the end,
    for cuts inside words, before punctuation, spaces and a combining accent (NFC merges it into its letter)."""
    from serving.sockets.live_text import LiveText
    from qtts_jax.prompt import text_ids_of

    rng = np.random.default_rng(0)
    for text in (LIVE_TEXT, "  It's 12.5 km,\n\n then: cafe\u0301!  ", "你好。我们 走吧"):
        whole = text_ids_of(model.tokenizer, text.strip())
        for _ in range(20):
            cuts = sorted(rng.choice(np.arange(1, len(text)), size=min(6, len(text) - 1), replace=False))
            live, got = LiveText(model.tokenizer), []
            for a, b in zip([0, *cuts], [*cuts, len(text)]):
                got += live.add(text[a:b])
                assert got == whole[: len(got)] and live.stable == text[: live.end].strip()
            assert got + live.finish() == whole


def test_live_text_joins_the_playing_stream_and_makes_the_codes_of_the_whole_text(engine, model, monkeypatch):
    """A seeded request whose text arrives in pieces (a word cut across them; some before the stream is admitted,
    some only after it has read every id it had, so it waits) makes exactly the codes of the same request given
    the whole text at once; a stream that waits for text is not stepped and does not end; the completion ends
    the text. Every step asks for 3 frames, so the stream also stops inside a step where its text runs out."""
    from qtts_jax.engine.scheduler import StepPlan
    from serving.sockets.live_text import LiveText

    monkeypatch.setattr(plan, "step_frames", lambda *a, **k: StepPlan(CONFIG.frames_per_step, 0.0))
    req = Request(LIVE_TEXT, speaker="ryan", seed=3, max_frames=30, non_streaming=False)
    [(whole, _)] = run(engine, [(0, req)])
    assert len(whole.codes) > len(whole.job.prompt.trailing)  # the text is read while frames are made

    pieces = ["Tha", "nks for ", "cal", "ling y", "ou."]
    live = LiveText(model.tokenizer)
    first = live.add(pieces[0]) + live.add(pieces[1])
    job = engine.prepare(dataclasses.replace(req, text=live.stable), live=True)
    assert job.live and job.bucket == whole.job.bucket and len(job.prompt.trailing) == len(first) - 1
    col = Collector()
    stream = engine.submit(job, col)
    engine.append_text(stream, live.add(pieces[2]))  # queued: it joins at admission
    waits = 0
    for piece in pieces[3:]:
        while engine.run_once():
            assert not stream.lm_done
        assert stream.waiting_text and len(stream.codes) == stream.text_known  # read all it has, then waits
        waits += 1
        engine.append_text(stream, live.add(piece))
    engine.append_text(stream, live.finish(), complete=True)
    with pytest.raises(RequestError, match="complete"):
        engine.append_text(stream, [1])
    for _ in range(500):
        if not engine.run_once() and col.final:
            break
    assert waits == 2 and col.final.error is None
    np.testing.assert_array_equal(np.stack(stream.codes), np.stack(whole.codes))


def test_live_text_that_outgrows_the_trailing_buffer_is_refused_whole(engine, model):
    job = engine.prepare(Request("Hi there", speaker="ryan", max_frames=5), live=True)
    stream = engine.submit(job, Collector())
    room = CONFIG.max_trailing - len(job.prompt.trailing) - 1  # the tts_eos of the completion needs a place
    with pytest.raises(PromptTooLong, match="max_trailing"):
        engine.append_text(stream, [100] * (room + 1))
    engine.append_text(stream, [100] * room)
    engine.append_text(stream, [], complete=True)
    stream.cancel()
    while engine.run_once():
        pass
    assert stream.finished


def test_the_iteration_profile_logs_the_margin_the_loop_planned_with(engine, caplog, monkeypatch):
    """A capacity run reads the margin beside the iteration's parts from the log: when streams ran dry, whether the
    margin had covered the lateness measured then."""
    import logging
    import re

    from qtts_jax.engine.profile import IterationProfile

    monkeypatch.setattr(engine, "profile", IterationProfile(every_s=0.0))
    with caplog.at_level(logging.INFO, logger="qtts_jax.engine.profile"):
        run(engine, [(0, Request("Profiled.", speaker="aiden", max_frames=4, **GREEDY))])
    margins = [float(m) for m in re.findall(r"'margin_ms': ([\d.]+)", caplog.text)]
    assert margins and min(margins) >= engine.config.min_margin_s * 1e3


def test_no_module_is_merged_or_nnx_jitted_on_the_per_frame_path(engine, monkeypatch):
    """The modules are merged back from their state at trace time only: once the engine's programs are compiled,
    serving requests frame after frame calls neither `nnx.merge` nor `nnx.jit` (each would cost a Python walk of the
    model per call)."""
    from flax import nnx

    run(engine, [(0, Request("Compiled first.", speaker="aiden", max_frames=6, **GREEDY))])  # every shape traced
    calls = []
    for name in ("merge", "jit"):
        real = getattr(nnx, name)
        monkeypatch.setattr(nnx, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    got = run(engine, [(0, Request("Then served.", speaker="aiden", max_frames=6, **GREEDY))])
    assert len(got[0][0].codes) > 1 and calls == []


def test_newcomers_are_prefilled_in_the_calls_their_measured_costs_make_cheapest(engine, clock, monkeypatch):
    """Three newcomers of one prompt bucket go in one padded call of 4 where a call costs about the same whatever
    its rows (launch-bound), and in three calls of 1 where a call costs by its rows; the codes are the same."""
    clock(1e-4)
    reqs = [Request(t, speaker="ryan", max_frames=6, seed=i, **GREEDY) for i, t in enumerate(TEXTS[::2])]
    prefill, calls = engine.runner.prefill, []

    def counting(bucket, rows, r):
        calls.append((len(rows), r))
        return prefill(bucket, rows, r)

    monkeypatch.setattr(engine.runner, "prefill", counting)
    outcomes = {}
    for name, costs in (("launch-bound", {1: 0.010, 4: 0.011}), ("by rows", {1: 0.010, 4: 0.040})):
        monkeypatch.setattr(engine, "prefill_costs", costs)
        calls.clear()
        outcomes[name] = (run(engine, [(0, r) for r in reqs]), list(calls))
    assert outcomes["launch-bound"][1] == [(3, 4)]
    assert outcomes["by rows"][1] == [(1, 1)] * 3
    assert_same_codes(outcomes["by rows"][0], outcomes["launch-bound"][0])
