"""Stream-aware routing in Ray Serve: a stream goes to the replica whose engine has the most headroom for it, from
each replica's stats snapshot (fleet.replica.Replica.stats: the server's own admission verdict, slots, live and
queued streams), not to the shortest queue as Ray Serve's default power-of-two-choices does. The ranking and the
ledger that corrects stale snapshots are fleet/routing.py; this module wires them to Ray Serve's request-router API.

A stale verdict can still be wrong: the front then retries a refused stream on the other replicas
(`route["exclude"]`), so a client is refused only when every replica refused. `route["pin"]` sends a call to one
replica (a WebSocket session's messages, the front's per-replica /ready).
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from fleet.routing import Ledger, rank

# replica ids this process's routers know, per deployment: the front's /ready and /metrics ask each one
KNOWN: dict[str, list[str]] = {}


class StreamRouter(RequestRouter):
    """Ray Serve request router of the engine deployment (`request_router_config` in fleet/app.py)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ledger = Ledger()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        # no await in here: ranking and counting the pick are one step, so a stream routed at the same moment
        # (another routing task of this router) already sees this one
        route = _route(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        snapshots = {i: r.routing_stats or {} for i, r in by_id.items()}
        ranks = rank(list(snapshots.items()), route, self._ledger.since(snapshots))
        if route.get("stream") and "pin" not in route and ranks:
            self._ledger.picked(pending_request.metadata.internal_request_id, ranks[0][0], route.get("id"))
        return [[by_id[i] for i in group] for group in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        route = _route(pending_request)
        if route.get("stream") and "pin" not in route:
            self._ledger.routed(pending_request.metadata.internal_request_id, replica_id.unique_id, route.get("id"))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._ledger.completed(internal_request_id, replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # Ray Serve unpickles this class by value, with a copy of this module's globals: write to the module itself
        import fleet.router

        fleet.router.KNOWN[self._deployment_id.name] = [r.replica_id.unique_id for r in replicas]


def _route(pending_request: PendingRequest | None) -> dict:
    return (pending_request.kwargs.get("route") if pending_request else None) or {}
