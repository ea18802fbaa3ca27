"""Admission against the engine's published costs: unit cases on a snapshot (and the parts still to come of long
inputs), then a simulated engine and clock under Poisson arrivals, below and above its capacity."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from qtts_jax.engine import EngineStats, rung, step_frames
from qtts_jax.engine.stream import FRAME_SECONDS, Timings
from serving.admission import AdmissionConfig, Admission, StreamTrack
from serving.errors import ApiError

LADDER = (8, 16, 32, 64)
PREFILLS = (1, 2, 4, 8, 16, 32)


def iteration_cost(rows: int, frames: int) -> float:
    """The simulated engine: a fixed launch cost plus, per frame, a part that grows with the batch."""
    return 0.010 + frames * (0.003 + 0.00025 * rung(LADDER, rows))


def prefill_cost(requests: int) -> float:
    return 0.004 + 0.0005 * rung(PREFILLS, requests)


def first_cost(newcomers: int) -> float:
    """Newcomers' first frame and its audio: a one-frame call of their own rows."""
    return iteration_cost(newcomers, 1)


def snapshot(live=(), queued=(), slots=64, iteration_s=0.03, scale=1.0) -> EngineStats:
    """live: frames left per stream in a slot; queued: frame caps of waiting requests. An entry is a number of
    frames, or (stream id, frames) for the stream of a part admission tracks (`part`)."""
    live_ids, frames_left = _named(live)
    queued_ids, queued_frames = _named(queued)
    return EngineStats(
        slots=slots, live=len(live), queued=len(queued), oldest_wait_s=0.0, frames_left=frames_left,
        queued_frames=queued_frames, live_ids=live_ids, queued_ids=queued_ids, ladder=LADDER, step_sizes=(1, 4),
        step_costs={(b, n): scale * iteration_cost(b, n) for b in LADDER for n in (1, 4)},
        prefill_costs={r: scale * prefill_cost(r) for r in PREFILLS},
        first_costs={b: scale * first_cost(b) for b in LADDER}, headroom_margin_s=0.02, iteration_s=iteration_s,
        min_headroom_s=None, iterations=1, recent_frame_s=(),
    )


def _named(entries) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ids, frames) of snapshot entries; an unnamed entry gets an id no part has (parts' ids are positive)."""
    pairs = [e if isinstance(e, tuple) else (-1 - k, e) for k, e in enumerate(entries)]
    return tuple(i for i, _ in pairs), tuple(f for _, f in pairs)


class Snapshots:
    def __init__(self, st):
        self.st = st

    def stats(self):
        return self.st

    @property
    def compiling(self):
        return self.st.compiling

    compiled_on_demand = 0  # a warmed-up engine compiles nothing on demand


def ready_admission(st, **config) -> Admission:
    admission = Admission(Snapshots(st), AdmissionConfig(**config))
    admission.ready = True
    return admission


def test_not_ready_and_draining_are_503_with_retry_after():
    admission = Admission(Snapshots(snapshot()), AdmissionConfig())
    with pytest.raises(ApiError) as err:
        admission.admit()
    assert (err.value.status, err.value.code) == (503, "not_ready") and err.value.retry_after >= 1
    admission.ready, admission.draining = True, True
    with pytest.raises(ApiError) as err:
        admission.admit()
    assert (err.value.status, err.value.code) == (503, "draining") and err.value.retry_after >= 1


def test_free_slot_admits_with_ttfa_of_one_prefill_and_one_first_frame():
    st = snapshot(live=[40] * 10)
    expected = st.iteration_s + prefill_cost(1) + first_cost(1)
    assert ready_admission(st).admit() == pytest.approx(expected)


def test_first_chunks_observed_while_the_engine_compiles_do_not_count():
    """A first chunk that took 2 s while XLA compiled the larger rungs (a warm-up request) must not make the
    prediction refuse a burst once the engine is done; observed after that, it counts."""
    slow = Timings(admitted=0.0, first_chunk=2.0)
    st = snapshot(live=[40] * 10)
    admission = ready_admission(dataclasses.replace(st, compiling=3))
    admission.observe(slow)
    admission.engine.st = st
    assert admission.admit() == pytest.approx(st.iteration_s + prefill_cost(1) + first_cost(1))
    admission.observe(slow)
    with pytest.raises(ApiError, match="predicted first audio"):
        admission.admit()


def test_a_first_chunk_that_waited_on_a_program_compiled_on_demand_does_not_count():
    """An engine started without a warm-up compiles each program as a request first needs it (seconds, on a real
    model): a first chunk submitted before such a compile may have waited on it and must not make admission refuse
    what comes after; one submitted after the compile counts."""
    st = snapshot(live=[40] * 10)
    admission = ready_admission(st)
    admission.engine.compiled_on_demand = 3
    admission.observe(Timings(admitted=0.0, first_chunk=2.0, compiled_before=2))
    assert admission.admit() == pytest.approx(st.iteration_s + prefill_cost(1) + first_cost(1))
    admission.observe(Timings(admitted=0.0, first_chunk=2.0, compiled_before=3))
    with pytest.raises(ApiError, match="predicted first audio"):
        admission.admit()


def test_burst_waiting_is_one_prefill_not_one_each():
    """Twenty requests already waiting for free slots add one 32-request prefill to the prediction, not 20."""
    st = snapshot(live=[40] * 10, queued=[48] * 20)
    ttfa = ready_admission(st).admit()
    assert ttfa == pytest.approx(st.iteration_s + prefill_cost(21) + first_cost(21))
    assert ttfa < 0.3


def test_a_request_waits_for_a_slot_only_once_those_ahead_of_it_took_every_free_one():
    """Four free slots: with three requests ahead of it one is left for it; with four ahead of it, it waits for
    the first of theirs or the playing streams' to end (those ahead have 5 frames, the playing 40)."""
    st = snapshot(live=[40] * 60, queued=[5] * 3)
    admission = ready_admission(st)
    assert admission.predict(st, *admission.load(st))[0] == 0.0
    st = snapshot(live=[40] * 60, queued=[5] * 4)
    admission = ready_admission(st)
    start, _, frame_s, _ = admission.predict(st, *admission.load(st))
    assert start == pytest.approx(5 * frame_s) and frame_s > 0


def test_full_slots_wait_for_the_first_to_free_and_refuse_past_the_target():
    # full slots: every iteration takes a newcomer (prefill, first frame) before the others' step
    newcomer = prefill_cost(1) + first_cost(1)
    per_frame = newcomer + iteration_cost(64, 1)  # a longer step would leave the newcomer short of audio
    soon = snapshot(live=[3] + [40] * 63)  # one stream 3 frames from the end
    assert ready_admission(soon).admit() == pytest.approx(soon.iteration_s + 3 * per_frame + newcomer)
    late = snapshot(live=[40] * 64)
    with pytest.raises(ApiError) as err:
        ready_admission(late).admit()
    assert (err.value.status, err.value.code) == (429, "overloaded") and err.value.retry_after >= 1
    assert "target" in err.value.message


def test_refuses_what_would_let_playing_streams_run_dry():
    """An engine that, taking a newcomer each iteration, spends more than a frame of audio (80 ms) per frame at
    every step size refuses another stream, even with free slots and a loose TTFA target; the same engine idle
    still admits."""
    slow = snapshot(live=[40] * 4, scale=8.0)
    newcomer = slow.costs.prefill(1) + slow.costs.first(1)
    assert all((newcomer + slow.costs.step(5, n)) / n > FRAME_SECONDS for n in (1, 4))
    with pytest.raises(ApiError) as err:
        ready_admission(slow, ttfa_target_s=10.0).admit()
    assert err.value.status == 429 and "run dry" in err.value.message
    assert ready_admission(snapshot(scale=5.0), ttfa_target_s=0.05).admit() > 0.05  # idle: admitted anyway
    assert ready_admission(slow, ttfa_target_s=10.0, starvation_s=1e9).admit() > 0  # no starvation limit


def test_a_waiting_burst_is_paid_once_not_per_frame():
    """Forty requests already waiting cost one batched prefill and first frame, paid once out of the playing
    streams' headroom: with ample headroom another is admitted, although that one iteration outlasts a frame
    of audio; with little headroom it is refused."""
    st = snapshot(live=[40] * 20, queued=[48] * 40)
    burst = st.costs.prefill(41) + st.costs.first(41)
    assert burst + st.costs.step(61, 1) > FRAME_SECONDS
    roomy = dataclasses.replace(st, min_headroom_s=1.0)
    assert ready_admission(roomy, ttfa_target_s=10.0).admit() > 0
    tight = dataclasses.replace(st, min_headroom_s=burst - 0.01)  # the burst would outlast the headroom
    with pytest.raises(ApiError) as err:
        ready_admission(tight, ttfa_target_s=10.0).admit()
    assert err.value.status == 429 and "waiting requests" in err.value.message
    assert ready_admission(tight, ttfa_target_s=10.0, starvation_s=0.1).admit() > 0  # within a tolerated stall


def test_the_engines_delivery_delay_counts_against_the_headroom():
    """The playing streams' audio goes out only after the engine's next admission and dispatch: a burst that fits
    the headroom with 5 ms to spare is refused once the engine reports 10 ms between an iteration and its audio."""
    st = snapshot(live=[40] * 20, queued=[48] * 40)
    burst = st.costs.prefill(41) + st.costs.first(41)
    spare = dataclasses.replace(st, min_headroom_s=burst + 0.005)
    assert ready_admission(spare, ttfa_target_s=10.0).admit() > 0
    with pytest.raises(ApiError) as err:
        ready_admission(dataclasses.replace(spare, delivery_s=0.010), ttfa_target_s=10.0).admit()
    assert err.value.status == 429 and "waiting requests" in err.value.message


def test_a_stream_already_behind_its_listener_stops_admission():
    """By default (the zero-underrun contract) any playing stream behind its listener stops admission; with a
    tolerated underrun, only one behind by more than that."""
    st = dataclasses.replace(snapshot(live=[40] * 4), min_headroom_s=-0.005)
    with pytest.raises(ApiError) as err:
        ready_admission(st).admit()
    assert err.value.status == 429 and "behind" in err.value.message
    assert ready_admission(st, starvation_s=0.1).admit() > 0
    with pytest.raises(ApiError):
        ready_admission(dataclasses.replace(st, min_headroom_s=-0.15), starvation_s=0.1).admit()


def test_a_burst_past_one_prefill_call_counts_every_call():
    st = snapshot(queued=[48] * 70)  # 71 requests: two full prefill calls of 32 and one of 7 (rung 8)
    assert st.costs.prefill(71) == pytest.approx(2 * prefill_cost(32) + prefill_cost(8))


def test_queue_full_is_429():
    with pytest.raises(ApiError) as err:
        ready_admission(snapshot(live=[5] * 64, queued=[48] * 4), max_queue=4, ttfa_target_s=10.0).admit()
    assert (err.value.status, err.value.code) == (429, "queue_full")


_part_ids = itertools.count(1)


def part() -> int:
    """A request's part in flight, as admission knows it: the id of its engine stream, which names that stream's
    entry in the snapshot (its frames left in a slot, or its frame cap while it waits)."""
    return next(_part_ids)


def test_a_long_requests_parts_still_to_come_keep_its_slot():
    """Full slots, one stream 3 frames from the end of its part: a newcomer gets that slot soon, unless the
    request has parts still to come. They follow in that slot, so the newcomer would wait for the next stream
    to end (40 frames), past the target: refused like any other; admitted again once that request is gone."""
    near_end = part()
    st = snapshot(live=[(near_end, 3)] + [40] * 63)
    per_frame = prefill_cost(1) + first_cost(1) + iteration_cost(64, 1)  # as in the full-slots case above
    admission = ready_admission(st)
    one_part = admission.open("short", 40, near_end)
    assert admission.admit() == pytest.approx(st.iteration_s + 3 * per_frame + prefill_cost(1) + first_cost(1))
    admission.close(one_part)
    long = admission.open("long", 240, near_end, to_come=(100, 100))
    assert sorted(admission.load(st)[0])[-2:] == [40, 203]
    with pytest.raises(ApiError) as err:
        admission.admit()
    assert (err.value.status, err.value.code) == (429, "overloaded") and "target" in err.value.message
    assert err.value.retry_after >= 40 * per_frame
    admission.close(long)
    assert admission.admit() < 0.3


def test_two_long_requests_admitted_one_after_another_see_each_others_parts_to_come():
    """Two slots, two long requests (a 4-frame part, then 200 frames) just admitted and waiting: a third
    request would get a slot after 4 frames if only their first parts counted; their parts still to come hold
    both slots for 204 frames, so it is refused."""
    a, b = part(), part()
    st = snapshot(queued=[(a, 4), (b, 4)], slots=2)
    admission = ready_admission(st, max_queue=4)
    assert admission.predict(st, [], [4, 4])[0] < 0.3 and admission.admit() < 0.3  # the first parts alone
    for rid, first in (("a", a), ("b", b)):
        admission.open(rid, 204, first, to_come=(200,))
    assert admission.load(st) == ([], [204, 204])
    with pytest.raises(ApiError) as err:
        admission.admit()
    assert err.value.status == 429 and "target" in err.value.message


def test_parts_to_come_count_until_submitted_then_only_in_the_snapshot():
    """One request's parts through their life: waiting, then playing, its part lengthened by those to come;
    done generating, those wait ahead of the others (the next part is about to be submitted ahead); each
    submitted part is the engine's to count, never counted twice; a closed request counts no more."""
    admission = ready_admission(snapshot())
    first = part()
    track = admission.open("long", 210, first, to_come=(100, 100))
    assert admission.load(snapshot(queued=[7, (first, 10)])) == ([], [7, 210])
    assert admission.load(snapshot(live=[30, (first, 6)], queued=[7])) == ([30, 206], [7])
    assert admission.load(snapshot(live=[30, (first, 0)], queued=[7])) == ([30, 0], [200, 7])
    second = part()
    track.next_part(second)
    assert admission.load(snapshot(live=[30], queued=[(second, 100), 7])) == ([30], [200, 7])
    third = part()
    track.next_part(third)
    assert track.to_come == [] and admission.load(snapshot(live=[30, (third, 100)], queued=[7])) == ([30, 100], [7])
    admission.close(track)
    assert admission.load(snapshot(live=[30, 100])) == ([30, 100], [])


def test_a_tolerated_stall_counts_the_frames_still_to_come():
    """With an underrun budget, an engine slowed past 80 ms a frame may take another stream while every playing
    stream has few enough frames left to lose less than the budget; not when one has a long input's parts still
    to come: it would lose the overrun on each of their frames too."""
    long_part = part()
    st = snapshot(live=[(long_part, 10)] + [10] * 3, scale=8.0)
    frame_s = ready_admission(st).predict(st, [10] * 4, [])[2]
    assert frame_s > 2 * FRAME_SECONDS  # each frame loses more than a frame of audio's worth...
    admission = ready_admission(st, ttfa_target_s=10.0, starvation_s=10 * frame_s)  # ...but 10 frames lose less
    assert admission.admit() > 0
    admission.open("long", 510, long_part, to_come=(500,))
    with pytest.raises(ApiError) as err:
        admission.admit()
    assert err.value.status == 429 and "run dry" in err.value.message
    admission.close(next(iter(admission.streams.values())))
    assert admission.admit() > 0


@dataclasses.dataclass
class SimStream:
    arrival: float
    cap: int  # frames of the part in flight
    part: int = dataclasses.field(default_factory=part)  # its stream id, which names it in the snapshot
    made: int = 0  # frames of the part in flight made so far
    track: StreamTrack | None = None  # its parts still to come, as admission counts them
    first_chunk: float | None = None
    sent: int = 0
    starved: float = 0.0

    @property
    def left(self) -> int:
        return self.cap - self.made


def simulate(rate: float, seconds: float = 20.0, frames: int = 48, slots: int = 64, seed: int = 0,
             parts: int = 1) -> dict:
    """Poisson arrivals against admission and an engine loop in simulated time that follows the real
    engine's rules: every waiting request that has a slot joins, prefilled together, and gets its first frame
    from a call of its own; then the playing streams and the newcomers step the frames the engine's own
    `step_frames` picks from their headroom (margin 20 ms); frames go out each iteration; a zero-buffer
    listener per stream. A request of `parts` parts (a long input) queues each next part ahead of the waiting
    requests as the one before ends, its listener playing on."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, int(rate * seconds * 1.2)))
    arrivals = list(arrivals[arrivals < seconds])
    engine = Snapshots(None)
    admission = Admission(engine, AdmissionConfig(ttfa_target_s=0.3))
    admission.ready = True
    caps = [frames // parts] * parts
    t, last, queue, live, done, refused = 0.0, 0.03, [], [], [], 0
    while arrivals or queue or live:
        while arrivals and arrivals[0] <= t:
            engine.st = snapshot([(s.part, s.left) for s in live], [(s.part, s.left) for s in queue], slots, last)
            try:
                admission.admit()
                s = SimStream(arrivals.pop(0), caps[0])
                s.track = admission.open("sim", frames, s.part, tuple(caps[1:]))
                queue.append(s)
            except ApiError as err:
                assert err.status == 429 and err.retry_after >= 1
                refused += 1
                arrivals.pop(0)
        joined = queue[: slots - len(live)]
        queue = queue[len(joined):]
        live += joined
        if not live:
            t = arrivals[0]
            continue
        playing = [s for s in live if s.first_chunk is not None]
        extra = prefill_cost(len(joined)) + first_cost(len(joined)) if joined else 0.0
        for s in joined:
            s.first_chunk = t + extra if s.first_chunk is None else s.first_chunk
            s.sent += 1
            s.made += 1
        headroom = np.array([s.first_chunk + s.sent * FRAME_SECONDS - t for s in playing])
        costs = {n: iteration_cost(len(live), n) for n in (1, 4)}
        plan = step_frames(costs, headroom, FRAME_SECONDS if joined else None, extra, 0.02, 0.1)
        last = plan.predicted_s
        t += last
        for s in live:
            got = min(plan.frames, s.left)
            s.starved += max(0.0, t - (s.first_chunk + s.sent * FRAME_SECONDS))
            s.sent += got
            s.made += got
        ended = [s for s in live if s.left == 0]
        live = [s for s in live if s.left > 0]
        for s in ended:
            if s.track.to_come:  # its next part, ahead of those waiting
                s.part, s.cap, s.made = part(), s.track.to_come[0], 0
                s.track.next_part(s.part)
                queue.insert(0, s)
            else:
                done.append(s)
                admission.close(s.track)
    ttfa = np.array([s.first_chunk - s.arrival for s in done])
    return {"admitted": len(done), "refused": refused, "ttfa_p95": float(np.percentile(ttfa, 95)),
            "starved_max": max(s.starved for s in done)}


@pytest.mark.parametrize("parts", [1, 4])
def test_below_capacity_nothing_is_refused_and_nothing_starves(parts):
    for rate in (5, 15, 25):
        got = simulate(rate, parts=parts)
        assert got["refused"] == 0, (rate, got)
        assert got["starved_max"] == 0.0 and got["ttfa_p95"] <= 0.3, (rate, got)


@pytest.mark.parametrize("parts, seconds", [(1, 20.0), (4, 8.0)])
def test_above_capacity_refuses_and_keeps_admitted_streams_playing(parts, seconds):
    """Also when every request is a long input of four parts back to back: admission counts the parts still to
    come, so none waits for a slot they keep (8 s of arrivals: each admission counts every open request)."""
    got = simulate(150, seconds, parts=parts)
    assert got["refused"] > 0.3 * (got["refused"] + got["admitted"]), got
    assert got["starved_max"] == 0.0 and got["ttfa_p95"] <= 0.3, got  # the zero-underrun contract


def test_costs_not_timed_yet_count_as_none():
    """An engine not warmed up has timed nothing: its snapshot's costs are zero, not a failure (`Settings.warmup` off)."""
    st = dataclasses.replace(snapshot(live=(10,)), step_costs={}, prefill_costs={}, first_costs={})
    assert st.costs.step(1, 1) == st.costs.prefill(3) == st.costs.first(3) == 0.0
    timed = snapshot(live=(10,))
    assert timed.costs.prefill(3) > 0 and timed.costs.first(3) > 0 and timed.costs.step(1, 1) > 0
