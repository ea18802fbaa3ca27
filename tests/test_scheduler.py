"""The engine's decisions on arrays alone, without a device: step size, chunks due, the measured margin."""

from __future__ import annotations

import numpy as np
import pytest

from qtts_jax.engine import Jitter, chunks_due, step_frames
from qtts_jax.engine.scheduler import first_chunk_alone
from qtts_jax.engine.costs import prefill_calls
from qtts_jax.engine.stream import FRAME_SECONDS

COSTS = {1: 0.030, 2: 0.055, 4: 0.100}  # seconds of a step iteration (codec included) by frames


def flat(seconds: float) -> dict[int, float]:
    """The same delivery delay after a step of any size."""
    return dict.fromkeys(COSTS, seconds)


def test_step_takes_the_most_frames_that_every_headroom_outlasts():
    assert step_frames(COSTS, np.array([0.5, 0.3]), None, 0.0, 0.01, 0.2).frames == 4
    # the tightest stream decides: 0.07 s in hand, less the margin, fits a two-frame step only
    assert step_frames(COSTS, np.array([0.5, 0.07]), None, 0.0, 0.01, 0.2).frames == 2
    # the newcomers' prefill and first frame run first and come out of the same headroom
    assert step_frames(COSTS, np.array([0.07]), None, 0.02, 0.01, 0.2).frames == 1


def test_newcomers_one_frame_of_audio_bounds_the_step_they_join():
    plan = step_frames(COSTS, np.array([2.0]), FRAME_SECONDS, 0.015, 0.01, 0.2)
    assert plan.frames == 2  # 55 ms + 10 ms margin < 80 ms; a 100 ms four-frame step would starve them
    assert plan.predicted_s == pytest.approx(0.015 + COSTS[2])
    assert step_frames(COSTS, np.array([2.0]), None, 0.015, 0.01, 0.2).frames == 4


def test_newcomers_whose_first_audio_goes_out_late_may_join_a_longer_step():
    """Their first audio waited on the device behind the previous codec call (which the measured costs count), so
    their listener started that much later: with 40 ms of it measured, a 100 ms step plus 10 ms of margin and 10 ms
    of delivery fits their 80 + 40 ms; without it, only a 55 ms one."""
    assert step_frames(COSTS, np.array([2.0]), FRAME_SECONDS, 0.015, 0.01, 0.2, flat(0.010), 0.040).frames == 4
    assert step_frames(COSTS, np.array([2.0]), FRAME_SECONDS, 0.015, 0.01, 0.2, flat(0.010), 0.0).frames == 2
    # the playing streams' headroom still bounds it
    assert step_frames(COSTS, np.array([0.07]), FRAME_SECONDS, 0.015, 0.01, 0.2, flat(0.010), 0.040).frames == 1


def test_a_newcomers_first_frame_goes_out_alone_only_if_its_next_audio_can_follow_within_it():
    """Its next audio comes with the shortest step and that step's delivery; it must arrive before the first
    frame's 80 ms have played, the margin spared, else the first frame waits to go out with it."""
    assert first_chunk_alone(0.030, 0.0, 0.010)  # 30 + 10 ms within 80
    assert first_chunk_alone(FRAME_SECONDS - 0.010, 0.0, 0.010)  # exactly the frame
    assert not first_chunk_alone(0.030, 0.0, 0.060)  # a 60 ms margin (a burst's lateness): 90 ms > 80
    assert first_chunk_alone(0.030, 0.020, 0.060)  # its listener starts 20 ms later: 90 ms within 100


def test_a_long_step_is_avoided_unless_only_it_keeps_up():
    # within the headroom, but longer than max_step_s: an arrival would wait for it
    assert step_frames(COSTS, np.array([2.0]), None, 0.0, 0.01, 0.06).frames == 2
    # a one-frame iteration slower than its 80 ms of audio: only the long step keeps up, so it is taken
    slow = {1: 0.085, 2: 0.120, 4: 0.200}
    assert step_frames(slow, np.array([2.0]), None, 0.0, 0.01, 0.1).frames == 4


def test_nothing_fits_steps_one_frame():
    assert step_frames(COSTS, np.array([0.01]), None, 0.0, 0.01, 0.2).frames == 1
    assert step_frames(COSTS, np.array([]), None, 0.0, 0.01, 0.2).frames == 4  # no audio out yet: no bound


def test_below_the_lead_every_frame_goes_out_past_it_the_schedule_decides():
    pending = np.array([1, 3, 3, 8, 2, 0])
    want = np.array([2, 4, 4, 8, 8, 8])
    lm_done = np.array([False, False, False, False, True, False])
    headroom = np.array([0.3, 0.3, 1.5, 1.5, 1.5, 0.1])
    got = chunks_due(pending, want, lm_done, headroom, lead_s=1.0, horizon_s=0.05, most=8)
    # below the lead: all it has; past it: wait for the schedule (3 < 4), or send its size; LM done: the rest
    np.testing.assert_array_equal(got, [1, 3, 0, 8, 2, 0])


def test_while_a_stream_below_its_lead_waits_on_the_call_no_chunk_is_wider_than_the_step_planned():
    """A newcomer (0.1 s in hand) waits for its next audio in this codec call, which the planner counted as two
    frames wide: the far-ahead streams send two-frame chunks instead of their schedule's eight (or everything they
    have), and a stream before its first chunk still gets its schedule's first size."""
    pending = np.array([2, 8, 9, 4])
    want = np.array([2, 8, 8, 4])
    lm_done = np.array([False, False, True, False])
    headroom = np.array([0.1, 1.5, 1.5, np.nan])
    args = dict(lm_done=lm_done, lead_s=1.0, horizon_s=0.05, most=8)
    np.testing.assert_array_equal(chunks_due(pending, want, headroom=headroom, width=2, **args), [2, 2, 2, 4])
    # nobody below the lead has a chunk due: the schedule decides, as without a width
    headroom[0] = 1.5
    pending[0] = 1
    np.testing.assert_array_equal(chunks_due(pending, want, headroom=headroom, width=2, **args), [0, 8, 8, 4])
    np.testing.assert_array_equal(chunks_due(pending, want, headroom=headroom, **args), [0, 8, 8, 4])


def test_before_first_audio_only_the_schedule_decides():
    got = chunks_due(np.array([1, 3]), np.array([1, 4]), np.array([False, False]), np.array([np.nan, np.nan]),
                     lead_s=1.0, horizon_s=0.05, most=8)
    np.testing.assert_array_equal(got, [1, 0])  # the second waits for its four-frame first chunk


def test_without_a_lead_a_chunk_goes_early_only_when_headroom_would_run_out():
    args = dict(pending=np.array([3, 3]), want=np.array([4, 4]), lm_done=np.array([False, False]), lead_s=0.0,
                most=8)
    np.testing.assert_array_equal(chunks_due(headroom=np.array([0.04, 0.5]), horizon_s=0.05, **args), [3, 0])
    # at most the codec's largest chunk at once
    np.testing.assert_array_equal(chunks_due(np.array([12]), np.array([16]), np.array([False]), np.array([0.0]),
                                             lead_s=1.0, horizon_s=0.05, most=8), [8])


def test_margin_is_a_high_quantile_of_measured_lateness_never_below_the_floor():
    jitter = Jitter(floor_s=0.01, window=100)
    assert jitter.margin() == 0.01
    for late in [-0.002] * 50 + [0.001] * 48 + [0.030, 0.045]:  # early iterations count as on time
        jitter.add(late)
    assert jitter.margin() == pytest.approx(np.quantile([0.0] * 50 + [0.001] * 48 + [0.030, 0.045], 0.99))
    assert 0.03 < jitter.margin() < 0.045
    for _ in range(100):  # the window forgets: a quiet machine gets its floor back
        jitter.add(0.0)
    assert jitter.margin() == 0.01


def test_first_frame_programs_stop_at_max_first_and_larger_bursts_cost_more_calls():
    from qtts_jax.engine import EngineConfig
    from qtts_jax.engine.stats import EngineStats

    c = EngineConfig(slots=256, max_first=64)
    assert c.ladder == (16, 64, 128, 256) and c.first_sizes == (16, 64)
    assert EngineConfig(slots=8, max_first=4).first_sizes == (8,)  # the smallest rung always exists
    costs = {16: 0.010, 64: 0.020}
    st = EngineStats(slots=256, live=0, queued=0, oldest_wait_s=0.0, frames_left=(), queued_frames=(),
                     ladder=c.ladder, step_sizes=(1,), headroom_margin_s=0.0,
                     step_costs={}, prefill_costs={1: 0.001, 32: 0.004}, first_costs=costs, iteration_s=0.0,
                     min_headroom_s=None, iterations=0, recent_frame_s=())
    assert st.costs.first(3) == 0.010 and st.costs.first(40) == 0.020
    assert st.costs.first(64 + 10) == 0.020 + 0.010  # 74 newcomers: two iterations' first-frame programs
    assert st.costs.prefill(33) == 0.004 + 0.001


def test_newcomers_start_only_as_far_as_the_least_headroom_pays_for_their_prefill_and_first_frame():
    from qtts_jax.engine import newcomers_that_fit

    def iteration_s(m):  # prefill + first frame grow with the newcomers, then the playing rows' one-frame step
        return 0.004 * m + 0.030

    assert newcomers_that_fit(10, 0.100, 0.010, iteration_s) == 10  # 0.070 s for ten: fits in 0.090
    assert newcomers_that_fit(10, 0.062, 0.010, iteration_s) == 5  # five take 0.050 s of 0.052: the rest wait
    assert newcomers_that_fit(10, 0.040, 0.010, iteration_s) == 0  # not even one: they wait, nobody runs dry
    assert newcomers_that_fit(10, None, 0.010, iteration_s) == 10  # nothing playing: nobody can run dry
    assert newcomers_that_fit(0, 1.0, 0.010, iteration_s) == 0


def test_the_wait_until_audio_is_handed_out_shortens_the_step_it_follows():
    """An iteration's audio goes out only after the next iteration's admission and dispatch: 30 ms measured
    there come out of a newcomer's one frame of audio and out of a playing stream's headroom."""
    assert step_frames(COSTS, np.array([2.0]), FRAME_SECONDS, 0.0, 0.01, 0.2).frames == 2
    assert step_frames(COSTS, np.array([2.0]), FRAME_SECONDS, 0.0, 0.01, 0.2, delivery_s=flat(0.03)).frames == 1
    assert step_frames(COSTS, np.array([0.12]), None, 0.0, 0.01, 0.2).frames == 4
    assert step_frames(COSTS, np.array([0.12]), None, 0.0, 0.01, 0.2, delivery_s=flat(0.03)).frames == 2


def test_a_longer_step_is_delivered_later_by_its_wider_codec_call():
    """The audio of a four-frame step goes out after a four-frame codec call, measured at 30 ms where a one-frame
    call takes 10: newcomers with 80 + 40 ms in hand fit the 100 ms step with 10 ms of delivery, not with 30."""
    delivery = {1: 0.010, 2: 0.015, 4: 0.030}
    assert step_frames(COSTS, np.array([2.0]), FRAME_SECONDS, 0.015, 0.01, 0.2, flat(0.010), 0.040).frames == 4
    assert step_frames(COSTS, np.array([2.0]), FRAME_SECONDS, 0.015, 0.01, 0.2, delivery, 0.040).frames == 2


def test_prefill_calls_are_the_cheapest_mix_of_the_measured_sizes():
    launch_bound = ((1, 0.005), (8, 0.006), (64, 0.020), (128, 0.035))
    assert prefill_calls(launch_bound, 10) == (8, 8)  # 12 ms, where one padded call of 64 took 20
    assert prefill_calls(launch_bound, 300) == (128, 128, 64)  # full calls of the largest, then the rest's best
    by_rows = ((1, 0.001), (8, 0.008), (64, 0.064), (128, 0.128))
    assert prefill_calls(by_rows, 10) == (8, 1, 1)
    assert prefill_calls(by_rows, 16) == (8, 8)  # as cheap as 8 and eight 1s: the fewer calls
    assert prefill_calls(((32, 0.01),), 0) == (32,)  # at least one request is prefilled


def test_an_iterations_plan_groups_prefills_by_bucket_and_steps_what_its_streams_allow():
    """`plan.schedule` from numbers alone: newcomers' prefills go in the cheapest calls per prompt bucket; a
    newcomer's one-frame first chunk goes out alone, ahead of the step, and the step is no longer than that
    audio; a stream waiting for text is not stepped, and one whose text
    runs out sooner is limited to it."""
    from qtts_jax.engine import EngineConfig
    from qtts_jax.engine.costs import Costs
    from qtts_jax.engine.plan import PrefillCall, Sizes, prefills, schedule

    costs = Costs(steps={(8, 1): 0.01, (8, 4): 0.09}, prefills={1: 0.002, 8: 0.004}, firsts={8: 0.005}, ladder=(8,))
    calls = prefills([64, 128, 64], costs, (1, 8))
    assert calls == (PrefillCall(64, (0, 2), 8), PrefillCall(128, (1,), 1))
    config = EngineConfig(slots=8, max_step_s=0.5)
    # two playing streams (the second waits for text), two newcomers (next chunks 1 and 2)
    plan = schedule(calls, np.array([1.0, 1.0]), np.array([1, 2]), [None, 0, None, 3], costs,
                    Sizes((8,), (8,), (1, 4), (1,), (1, 8)), config, 0.01, 0.0)
    assert plan.decode_first == (True, False) and plan.first_rung == 8
    assert plan.step.frames == 1 and plan.step_rows == (0, 2, 3)
    assert plan.limits == (1, 1, 1)  # a 4-frame step would outlast the newcomer's one-frame first chunk
    assert plan.extra_s == pytest.approx(0.004 + 0.005)  # three requests in one call of 8, two first frames


def test_a_codec_call_takes_the_rows_with_a_chunk_due_at_their_rungs():
    """`plan.codec_call` from numbers: only the streams with a chunk due are rows, each with its own frames; the
    call is padded to the ladder's rung for its rows and the codec's for its widest row; nothing due, no call."""
    from qtts_jax.engine.plan import CodecCall, codec_call

    args = dict(lead_s=1.0, horizon_s=0.05, ladder=(2, 4, 8), codec_sizes=(1, 2, 4, 8), step=None)
    call = codec_call(np.array([2, 1, 3]), np.array([2, 4, 4]), np.array([False, False, False]),
                      np.array([1.5, 1.5, 0.1]), **args)
    assert call == CodecCall(rows=(0, 2), counts=(2, 3), rung=2, frames=4)
    assert codec_call(np.array([1]), np.array([2]), np.array([False]), np.array([1.5]), **args) is None
