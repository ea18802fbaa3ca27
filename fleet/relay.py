"""How late the fleet's relay brings a stream's chunks to the front, reported back to the replica that made them.

A replica's engine keeps every stream's audio ahead of its listener by a margin that covers the jitter it measures
(`scheduler.Jitter`): in one server, how late its own event loop takes the chunks it hands out. In the fleet each
chunk then crosses Ray (the replica's relay, a deployment handle's stream, the front's event loop) before the
client has it, and that crossing's jitter is out of the engine's sight: one replica on an H100 let 3 of 800
streams stall at 40 rps where `qtts-jax serve` with the same engine let none stall at 60
(bench/results/fleet-relay-0.6b-h100.json). The replica stamps each chunk as its relay reads it; the front measures
each chunk's crossing against the stream's first (its listener's playback starts at the first, so only a later
chunk crossing slower than the first eats into the stream's lead) and reports each replica's worst lateness per
interval, which the replica adds to its engine's jitter. Clocks of two hosts differ by a constant, which the
difference to the first chunk cancels."""

from __future__ import annotations

import time
from collections.abc import Callable

REPORT_S = 0.1  # one report per replica per interval: about as often as an engine iteration hands chunks out


class RelayLateness:
    """The worst lateness of any chunk relayed from each replica since the last `take` (0.0: chunks came, none
    late). Read and written on the front's one event loop."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._worst: dict[str, float] = {}

    def stream(self, replica: str) -> Callable[[float], None]:
        """A recorder for one stream from `replica`: call it with each chunk's stamp (the replica's clock when its
        relay read the chunk) as the chunk reaches the front."""
        first: list[float] = []

        def chunk(stamp: float) -> None:
            crossing = self.clock() - stamp
            if not first:
                first.append(crossing)
            self._worst[replica] = max(self._worst.get(replica, 0.0), crossing - first[0])

        return chunk

    def take(self) -> dict[str, float]:
        """Each replica's worst lateness since the last call (only replicas that relayed a chunk since)."""
        worst, self._worst = self._worst, {}
        return worst
