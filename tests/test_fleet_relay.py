"""The front's event-loop lateness probe (fleet/relay.py): plain asyncio, no Ray; tests/test_fleet.py checks that a
running fleet reports it to the replica that served a stream."""

from __future__ import annotations

import asyncio
import time

from fleet.relay import LoopLag


def test_the_probe_reports_a_blocked_loop_to_the_replicas_being_relayed():
    async def main():
        lag, reports, reported = LoopLag(), [], asyncio.Event()

        async def report(replica, seconds):
            reports.append((replica, seconds))
            reported.set()

        async def next_report():
            """Until the probe's next report. The probe then sleeps again, its wait timed from before this test
            resumes: the wake-up that a report schedules runs ahead of the probe's (no task in between)."""
            reported.clear()
            async with asyncio.timeout(10):
                await reported.wait()

        probe = asyncio.ensure_future(lag.run(report))
        lag.opened("a")
        lag.opened("a")
        await next_report()
        lag.closed("a")  # one of a's two streams ends: a is still relayed
        time.sleep(0.05)  # the loop blocked 50 ms: a chunk arriving meanwhile waits as long
        await next_report()  # its worst lateness counts that block
        lag.closed("a")  # right after a report: a is owed none
        before_b = len(reports)
        lag.opened("b")
        await next_report()
        probe.cancel()
        return reports, before_b

    reports, before_b = asyncio.run(main())
    assert {r for r, _ in reports[:before_b]} == {"a"}
    assert max(s for _, s in reports[:before_b]) >= 0.045
    assert min(s for _, s in reports[:before_b]) < 0.02  # an idle loop reports little
    # once a's streams ended it gets no more reports; b, relayed next, gets them
    assert reports[before_b:] and {r for r, _ in reports[before_b:]} == {"b"}
