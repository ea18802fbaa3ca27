"""The fleet's relay lateness (fleet/relay.py): plain Python, no Ray; tests/test_fleet.py checks that a running
fleet reports it to the replica that served the stream."""

from __future__ import annotations

import pytest

from fleet.relay import RelayLateness


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_chunk_is_late_by_how_much_longer_it_crossed_than_its_streams_first():
    clock = Clock()
    relay = RelayLateness(clock)
    chunk = relay.stream("a")
    clock.now = 5.010  # the first chunk took 10 ms (the replica's clock is another host's: stamps near 5 s)
    chunk(5.000)
    clock.now = 5.130  # the second took 30 ms: 20 ms later than the first, into the stream's lead
    chunk(5.100)
    clock.now = 5.205  # the third crossed faster than the first: not late
    chunk(5.200)
    assert relay.take() == {"a": pytest.approx(0.020)}
    assert relay.take() == {}  # nothing relayed since


def test_each_replica_gets_its_own_streams_worst_and_a_prompt_stream_reports_zero():
    clock = Clock()
    relay = RelayLateness(clock)
    a1, a2, b = relay.stream("a"), relay.stream("a"), relay.stream("b")
    for rec, first, later in ((a1, 0.010, 0.015), (a2, 0.050, 0.090), (b, 0.020, 0.020)):
        for stamp, crossing in ((1.0, first), (2.0, later)):
            clock.now = stamp + crossing
            rec(stamp)
    # a2 started slow (50 ms) and its second chunk took 40 ms more; a1's 5 ms is not the worst; b was steady
    assert relay.take() == {"a": pytest.approx(0.040), "b": 0.0}
