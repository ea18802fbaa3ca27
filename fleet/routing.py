"""Where a stream goes: the ranking of replicas by headroom, and the ledger of streams one router has sent that
the replicas' stats snapshots do not show yet (or still show, though they have ended). Plain Python without Ray,
so the arithmetic is tested on its own; fleet/router.py feeds it Ray Serve's replicas and callbacks.

A snapshot (fleet.replica.Replica.stats) is up to a stats period old, and a stream reaches the server's counts only
some milliseconds after the router picked its replica. Each stream call therefore carries an id (`route["id"]`,
the server's request id for it), and a snapshot lists, beside its count of the server's streams, their ids: the
count and the list are read together, so a stream is in one exactly when it is in the other. The ledger holds every
stream this router picked a replica for, from the moment it picks (before Ray even sends it: two arrivals ranked
back to back see each other), so that:

- a stream the replica's snapshot does not list yet is one more stream there ("unseen");
- a stream it lists that has ended since is one fewer ("ended").

Id lists, not clocks: no comparison of one process's time with another's.
"""

from __future__ import annotations

import dataclasses
import time

# a replica without a snapshot yet: it is routable only once its engine has warmed up (fleet.replica.Replica), so
# it is idle but for what was sent to it since (the ledger's unseen streams)
EMPTY = {"ready": True, "admit": True, "streams": 0, "ttfa_s": 0.0, "routes": ()}


def rank(candidates: list[tuple[str, dict]], route: dict, since: dict[str, tuple[int, int]]) -> list[list[str]]:
    """Replica ids in the order to try, one per rank. `candidates`: (id, stats snapshot, or {} before its first);
    `since`: per replica, (streams this router sent it that its snapshot does not count yet, streams its snapshot
    counts that have ended since) (Ledger.since).

    A stream goes first to a replica sure to admit it: one that admitted at its snapshot and has no more streams
    since, or one that refused but whose streams have all ended since (an idle engine always admits). Then to one
    that may: it admitted but has more streams now (still fewer than its slots), or it refused but some of its
    streams have ended. Last, one that will refuse. Within each, the least loaded for its slots, then the lowest
    predicted TTFA."""
    ids = [i for i, _ in candidates]
    if route.get("pin") in ids:
        return [[route["pin"]]]
    left = [(i, s) for i, s in candidates if i not in set(route.get("exclude", ()))] or candidates
    if not route.get("stream"):
        return [[i for i, _ in left]]  # Ray picks the least busy of them
    # one deployment's replicas share their settings: a new replica has the slots its peers report
    slots = max((s["slots"] for _, s in candidates if s), default=1)

    def key(item):
        i, s = item
        s = s or {**EMPTY, "slots": slots}
        unseen, ended = since.get(i, (0, 0))
        load = max(s["streams"] + unseen - ended, 0)
        if s["ready"] and ((s["admit"] and unseen <= ended) or (load == 0 and ended)):
            order = 0  # its verdict holds with no more streams than then, or it is idle now
        elif s["ready"] and ((s["admit"] and load < s["slots"]) or (not s["admit"] and ended)):
            order = 1
        else:
            order = 2
        return (order, load / max(s["slots"], 1), s["ttfa_s"] or 0.0)

    return [[i] for i, _ in sorted(left, key=key)]


# a pick Ray has not sent within this long was dropped on the way (its request cancelled while waiting)
PICK_TTL_S = 30.0


@dataclasses.dataclass
class Sent:
    replica: str
    token: str | None
    at: float  # when the router picked it
    routed: bool = False  # Ray sent it and the replica took it (until then it is only the router's pick)
    ended: bool = False


class Ledger:
    """The streams one router has picked replicas for, keyed by Ray's internal request id, until no snapshot needs
    correcting for them."""

    def __init__(self, clock=time.monotonic):
        self.sent: dict[str, Sent] = {}
        self.clock = clock

    def picked(self, request: str, replica: str, token: str | None) -> None:
        """The router ranked `replica` first for `request`: count it there at once (a retry picks afresh)."""
        self.sent[request] = Sent(replica, token, self.clock())

    def routed(self, request: str, replica: str, token: str | None) -> None:
        """The replica took it (Ray may have fallen back to a later rank than the router's pick)."""
        entry = self.sent.setdefault(request, Sent(replica, token, self.clock()))
        entry.replica, entry.routed = replica, True

    def completed(self, request: str, replica: str) -> None:
        """Its call has ended. One that never got routed (refused by Ray's own cap, or failed on the way) is
        forgotten: Ray picks again for it, or it is gone."""
        entry = self.sent.get(request)
        if entry is None or entry.replica != replica:
            return
        if entry.routed:
            entry.ended = True
        else:
            del self.sent[request]

    def since(self, snapshots: dict[str, dict]) -> dict[str, tuple[int, int]]:
        """Per replica (snapshots: id -> its latest snapshot, {} before the first), (unseen, ended) as `rank`
        reads them; forgets the streams no snapshot will need correcting for (ended and not listed, or on a
        replica that is gone) and the picks Ray never sent."""
        out: dict[str, list[int]] = {i: [0, 0] for i in snapshots}
        listed = {i: set(s.get("routes", ())) for i, s in snapshots.items()}
        stale = self.clock() - PICK_TTL_S
        for request, e in list(self.sent.items()):
            if e.replica not in snapshots or (not e.routed and e.at < stale):
                del self.sent[request]
            elif e.token in listed[e.replica]:
                out[e.replica][1] += e.ended
            elif e.ended:
                del self.sent[request]
            else:
                out[e.replica][0] += 1
        return {i: (unseen, ended) for i, (unseen, ended) in out.items()}
