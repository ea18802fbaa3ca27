"""Stream-aware routing: a stream goes to the replica whose engine has the most headroom for it, from each replica's
stats snapshot (fleet.replica.Replica.stats: the server's own admission verdict, slots, live and queued streams),
not to the shortest queue as Ray Serve's default power-of-two-choices does.

A snapshot is up to `request_routing_stats_period_s` old, so every stream this router sent to a replica after its
snapshot was taken counts as one more stream there. A stale verdict can still be wrong: the front then retries a
refused stream on the other replicas (`route["exclude"]`), so a client is refused only when every replica refused.
`route["pin"]` sends a call to one replica (a WebSocket session's messages, the front's per-replica /ready).
"""

from __future__ import annotations

import collections
import time

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

# replica ids this process's routers know, per deployment: the front's /ready and /metrics ask each one
KNOWN: dict[str, list[str]] = {}


def rank(candidates: list[tuple[str, dict]], route: dict, since: dict[str, tuple[int, int]]) -> list[list[str]]:
    """Replica ids in the order to try, one per rank. `candidates`: (id, stats snapshot, or {} before the first);
    `since`: per replica, (streams this router sent it, streams it counted that have ended) since its snapshot."""
    ids = [i for i, _ in candidates]
    if route.get("pin") in ids:
        return [[route["pin"]]]
    left = [(i, s) for i, s in candidates if i not in set(route.get("exclude", ()))] or candidates
    if not route.get("stream"):
        return [[i for i, _ in left]]  # Ray picks the least busy of them

    def key(item):
        i, s = item
        if not s:
            return (1, 0.0, 0.0)  # no snapshot yet
        sent, ended = since.get(i, (0, 0))
        load = s["active"] + s["queued"] + sent - ended
        if s["ready"] and s["admit"]:  # it admitted at the snapshot: still, unless what we sent since fills it
            order = 0 if sent <= ended or load < s["slots"] else 2
        else:  # it refused at the snapshot: it may admit again once a stream it counted has ended
            order = 1 if s["ready"] and ended else 2
        return (order, load / max(s["slots"], 1), s["ttfa_s"] or 0.0)

    return [[i] for i, _ in sorted(left, key=key)]


class StreamRouter(RequestRouter):
    """Ray Serve request router of the engine deployment (`request_router_config` in fleet/app.py)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._open: dict[str, float] = {}  # internal request id -> when this router sent that stream
        self._events: dict[str, collections.deque] = collections.defaultdict(collections.deque)  # id -> (sent, ended)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        route = (pending_request.kwargs.get("route") if pending_request else None) or {}
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        stats = [(i, r.routing_stats or {}) for i, r in by_id.items()]
        since, now = {}, time.time()
        for i, s in stats:
            events, at = self._events[i], s.get("at", 0.0)
            while events and events[0][1] is not None and events[0][1] < now - 60:
                events.popleft()
            # sent after the snapshot: not in it; sent before it and ended after it: counted in it, gone now
            since[i] = (sum(sent > at for sent, _ in events), sum(sent <= at < ended for sent, ended in events if ended))
        return [[by_id[i] for i in group] for group in rank(stats, route, since)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        if (pending_request.kwargs.get("route") or {}).get("stream"):
            now = time.time()
            self._open[pending_request.metadata.internal_request_id] = now
            self._events[replica_id.unique_id].append((now, None))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        sent = self._open.pop(internal_request_id, None)
        if sent is not None:
            events = self._events[replica_id.unique_id]
            for n, (t, _) in enumerate(events):
                if t == sent:
                    events[n] = (sent, time.time())
                    break

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # Ray Serve unpickles this class by value, with a copy of this module's globals: write to the module itself
        import fleet.router

        fleet.router.KNOWN[self._deployment_id.name] = [r.replica_id.unique_id for r in replicas]
