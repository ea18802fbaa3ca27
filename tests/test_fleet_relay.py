"""The front's event-loop lateness probe (fleet/relay.py): plain asyncio, no Ray; tests/test_fleet.py checks that a
running fleet reports it to the replica that served a stream."""

from __future__ import annotations

import asyncio
import time

from fleet.relay import REPORT_S, LoopLag


def test_the_probe_reports_a_blocked_loop_to_the_replicas_being_relayed():
    async def main():
        lag, reports = LoopLag(), []

        async def report(replica, seconds):
            reports.append((replica, seconds))

        probe = asyncio.ensure_future(lag.run(report))
        lag.opened("a")
        lag.opened("a")
        await asyncio.sleep(2 * REPORT_S)
        lag.closed("a")  # one of a's two streams ends: a is still relayed
        await asyncio.sleep(0.01)
        time.sleep(0.05)  # the loop blocked 50 ms: a chunk arriving meanwhile waits as long
        await asyncio.sleep(2 * REPORT_S)
        lag.closed("a")
        await asyncio.sleep(2 * REPORT_S)
        before_b = len(reports)
        lag.opened("b")
        await asyncio.sleep(2 * REPORT_S)
        probe.cancel()
        return reports, before_b

    reports, before_b = asyncio.run(main())
    assert {r for r, _ in reports[:before_b]} == {"a"}
    assert max(s for _, s in reports[:before_b]) >= 0.045
    assert min(s for _, s in reports[:before_b]) < 0.02  # an idle loop reports little
    # once a's streams ended it gets no more reports; b, relayed next, gets them
    assert reports[before_b:] and {r for r, _ in reports[before_b:]} == {"b"}
