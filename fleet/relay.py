"""How late the front's event loop runs, reported to the replicas whose streams it relays.

A replica's engine keeps every stream's audio ahead of its listener by a margin that covers the jitter it measures
(`scheduler.Jitter`): in one server, how late its own event loop takes the chunks it hands out. In the fleet each
chunk then passes the front's event loop before the client has it, and that loop's lateness is out of the
engine's sight: without this, a fleet let streams stall at their second chunk at rates where `qtts-jax serve`
with the same engine let none stall (docs/fleet.md). The front
runs a probe that sleeps `PROBE_S` at a time and measures how late it wakes: a chunk arriving meanwhile waits as
long. Every `REPORT_S` the worst lateness goes to each replica the front relays a stream for, whose engine adds
it to its jitter."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

PROBE_S = 0.005
REPORT_S = 0.1  # about as often as an engine iteration hands chunks out


class LoopLag:
    """The worst lateness of the running event loop since the last report; `relaying` holds how many streams the
    front relays from each replica now (the replicas that get the reports)."""

    def __init__(self):
        self.relaying: dict[str, int] = {}
        self.worst = 0.0
        self._any = asyncio.Event()  # set while some stream is relayed

    def opened(self, replica: str) -> None:
        self.relaying[replica] = self.relaying.get(replica, 0) + 1
        self._any.set()

    def closed(self, replica: str) -> None:
        if (n := self.relaying.get(replica, 0) - 1) > 0:
            self.relaying[replica] = n
        else:
            self.relaying.pop(replica, None)
            if not self.relaying:
                self._any.clear()

    async def run(self, report: Callable[[str, float], Awaitable[None]]) -> None:
        """Probe while any stream is relayed; every `REPORT_S`, `report(replica, seconds)` for each replica relayed
        meanwhile."""
        loop = asyncio.get_running_loop()
        since = loop.time()
        reported: set[str] = set()
        while True:
            if not self.relaying and not reported:  # nobody to report to: no probing until a stream opens
                await self._any.wait()
            before = loop.time()
            await asyncio.sleep(PROBE_S)
            now = loop.time()
            self.worst = max(self.worst, now - before - PROBE_S)
            reported |= self.relaying.keys()
            if now - since >= REPORT_S:
                worst, self.worst, since = self.worst, 0.0, now
                for replica in reported:
                    await report(replica, worst)
                reported = set()
