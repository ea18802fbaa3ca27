"""The fleet's routing arithmetic (fleet/routing.py): plain Python, no Ray, so it runs with the suite in
milliseconds; tests/test_fleet.py drives the same through Ray Serve's router and a running fleet."""

from __future__ import annotations

from fleet.routing import PICK_TTL_S, Ledger, rank

STREAM = {"stream": True}


def _snapshot(admit=True, streams=0, slots=2, ready=True, ttfa=0.05, routes=()):
    return {"ready": ready, "admit": admit, "streams": streams, "slots": slots, "ttfa_s": ttfa, "routes": list(routes)}


def test_rank_puts_a_refusing_replica_after_every_one_that_admits():
    busy_but_admits = _snapshot(streams=1)
    refuses = _snapshot(admit=False)
    assert rank([("a", refuses), ("b", busy_but_admits)], STREAM, {}) == [["b"], ["a"]]
    assert rank([("a", refuses), ("b", {})], STREAM, {}) == [["b"], ["a"]]  # unknown before refusing
    assert rank([("a", _snapshot(ready=False)), ("b", busy_but_admits)], STREAM, {}) == [["b"], ["a"]]


def test_rank_prefers_headroom_and_counts_streams_sent_since_the_snapshot():
    assert rank([("a", _snapshot(streams=1)), ("b", _snapshot())], STREAM, {}) == [["b"], ["a"]]
    # b's snapshot is idle, but two streams went there after it: b is full, a has a slot
    assert rank([("a", _snapshot(streams=1)), ("b", _snapshot())], STREAM, {"b": (2, 0)}) == [["a"], ["b"]]
    # both refused at their snapshots (a stream each), but b's has ended since: b is idle now, and an idle engine
    # always admits
    refusing = _snapshot(admit=False, streams=1)
    assert rank([("a", refusing), ("b", refusing)], STREAM, {"b": (0, 1)}) == [["b"], ["a"]]
    # a admitted at its snapshot but has one more stream since: it may still admit; b refused, but one of its two
    # streams has ended: it may too; both come before c, which refuses, and the less loaded of them first
    assert rank([("c", _snapshot(admit=False, streams=1)), ("a", _snapshot(streams=0)),
                 ("b", _snapshot(admit=False, streams=2))], STREAM, {"a": (1, 0), "b": (0, 1)}) == [["a"], ["b"], ["c"]]


def test_rank_a_new_replica_without_a_snapshot_as_an_empty_one():
    """A replica is routable only once warmed up, so before its first snapshot it is idle but for what this router
    sent it: it comes before a busy replica (not after every known one), and fills up like its peers."""
    busy = _snapshot(streams=1)
    assert rank([("old", busy), ("new", {})], STREAM, {}) == [["new"], ["old"]]
    # one stream sent to it since: as loaded as the old one (1 of 2 slots), after it as less certain to admit
    assert rank([("old", busy), ("new", {})], STREAM, {"new": (1, 0)}) == [["old"], ["new"]]
    # it has as many slots as its peers: with 3 of 4 taken it may still admit, unlike a peer that refuses; with
    # all 4 taken it is the fuller of two that would refuse
    refusing = _snapshot(admit=False, streams=1, slots=4)
    assert rank([("old", refusing), ("new", {})], STREAM, {"new": (3, 0)}) == [["new"], ["old"]]
    assert rank([("old", refusing), ("new", {})], STREAM, {"new": (4, 0)}) == [["old"], ["new"]]
    assert rank([("new", {}), ("other", {})], STREAM, {"new": (1, 0)}) == [["other"], ["new"]]


def test_rank_pins_excludes_and_leaves_other_calls_to_ray():
    both = [("a", _snapshot()), ("b", _snapshot())]
    assert rank(both, {"pin": "b"}, {}) == [["b"]]
    assert rank(both, {"stream": True, "exclude": ["a"]}, {}) == [["b"]]
    assert rank(both, {"stream": True, "exclude": ["a", "b"]}, {}) == [["a"], ["b"]]  # never an empty choice
    assert rank(both, {}, {}) == [["a", "b"]]


def _route(ledger: Ledger, snapshots: dict, request: str) -> str:
    """What StreamRouter.choose_replicas does for one stream: rank on the ledger's view, then count the pick."""
    ranks = rank(list(snapshots.items()), STREAM, ledger.since(snapshots))
    ledger.picked(request, ranks[0][0], f"token-{request}")
    return ranks[0][0]


def test_two_streams_arriving_together_go_to_two_replicas():
    """Race (a): both are ranked on the same snapshots, before Ray has sent either (so before any callback from it):
    the first pick already counts where it went."""
    ledger, snapshots = Ledger(), {"a": _snapshot(), "b": _snapshot()}
    assert {_route(ledger, snapshots, "r1"), _route(ledger, snapshots, "r2")} == {"a", "b"}


def test_a_stream_counts_until_the_replicas_snapshot_does_and_until_it_no_longer_does():
    ledger = Ledger()
    idle = {"a": _snapshot(), "b": _snapshot()}
    first = _route(ledger, idle, "r1")
    ledger.routed("r1", first, "token-r1")
    assert ledger.since(idle)[first] == (1, 0)  # routed, not in a snapshot yet: one more stream there
    counted = {**idle, first: _snapshot(admit=False, streams=1, routes=["token-r1"])}
    assert ledger.since(counted)[first] == (0, 0)  # the snapshot counts it: nothing to add
    ledger.completed("r1", first)
    assert ledger.since(counted)[first] == (0, 1)  # ended since that snapshot: one fewer
    assert ledger.since(idle)[first] == (0, 0) and not ledger.sent  # a snapshot without it: forgotten


def test_the_ledger_follows_where_ray_sent_a_stream_and_forgets_what_it_never_sent():
    now = [0.0]
    ledger = Ledger(clock=lambda: now[0])
    snapshots = {"a": _snapshot(), "b": _snapshot()}
    ledger.picked("r1", "a", "t1")
    ledger.routed("r1", "b", "t1")  # Ray fell back to the next rank
    assert ledger.since(snapshots) == {"a": (0, 0), "b": (1, 0)}
    ledger.picked("r2", "a", "t2")
    ledger.completed("r2", "a")  # failed on the way, never taken: Ray picks again or gives up
    ledger.picked("r3", "a", "t3")  # cancelled while waiting to be sent: no callback ever comes
    assert ledger.since(snapshots) == {"a": (1, 0), "b": (1, 0)}
    now[0] = PICK_TTL_S + 1
    assert ledger.since(snapshots) == {"a": (0, 0), "b": (1, 0)}
    assert ledger.since({"a": _snapshot()}) == {"a": (0, 0)} and not ledger.sent  # b is gone, and its streams
