"""One engine replica: the speech server's own aiohttp app (serving.app.create_app), listening inside the replica,
reached through Ray deployment handles and, for speech streams and WebSocket sessions, directly.

Running the server itself, not a copy of its routes, keeps request validation, admission, encoding, SSE and error
bodies exactly the server's. A speech stream takes a `lease` on the replica through its handle (Ray Serve's
router picks the replica; the open lease is the stream's ongoing request, which autoscaling counts and a drain
waits for) and the front then sends the request to this server's own TCP address, so its audio crosses one HTTP
hop instead of one Ray message per chunk; a WebSocket session the same way. Other requests' responses stream
through the handles. Every method takes a `route` keyword that the router reads (fleet/router.py). A stream's
`route["id"]` becomes the server's request id, so this replica's stats list it exactly while the server's admission
counts the stream (from admission to the response's end), and a session's while its lease is open
(fleet/routing.py).
"""

from __future__ import annotations

import asyncio
import collections
import os
import tempfile

import aiohttp
from aiohttp import web

from serving.errors import ApiError
from serving.settings import Settings

# hop-by-hop headers (the front frames its own response) and those Ray Serve's proxy sets itself (it passes the
# request id on to the server, which echoes it)
HOP_HEADERS = frozenset(("connection", "keep-alive", "transfer-encoding", "upgrade", "date", "server", "x-request-id"))


class Replica:
    """A Ray Serve deployment class (wrapped by `fleet.app.build`); ready only once the engine has warmed up, so
    the router never sees a replica that would answer 503."""

    async def __init__(self, settings: Settings, engine_factory=None):
        from qtts_jax.engine import compile_cache
        from serving.app import create_app, serve_alone
        from serving.keys import WARMUP_ERROR, WARMUP_TASK

        self.id = _replica_id()
        # a shared compilation cache turns a new replica's minutes of XLA into seconds
        compile_cache.enable(settings.compile_cache)
        self.app = create_app(settings, engine=engine_factory(settings) if engine_factory else None)
        serve_alone(self.app)  # a replica is a serving process of its own, as `qtts-jax serve` is
        self.dir = tempfile.mkdtemp(prefix="qtts-replica-")
        self.sock = os.path.join(self.dir, "server.sock")
        self.runner = web.AppRunner(self.app, handler_cancellation=True)
        await self.runner.setup()
        await web.UnixSite(self.runner, self.sock).start()
        direct = web.TCPSite(self.runner, _node_address(), 0)  # the speech streams' own path (`lease`)
        await direct.start()
        self.address = direct.name
        await asyncio.shield(self.app[WARMUP_TASK])
        if self.app[WARMUP_ERROR]:
            raise RuntimeError(f"warm-up failed: {self.app[WARMUP_ERROR][0]}")
        self.client = aiohttp.ClientSession(connector=aiohttp.UnixConnector(self.sock, limit=0),
                                            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        self.sessions: set[str] = set()  # the route ids of the WebSocket sessions open now (`stats` lists them)
        self.relay_late: collections.deque[float] = collections.deque(maxlen=512)  # the front's reports, seconds

    async def lease(self, route: dict | None = None):
        """A speech stream's or WebSocket session's place on this replica: {"replica", "address"} (where the front
        sends the request itself, a stream with the route's id as its X-Request-Id), then nothing until the front
        cancels the call at the stream's or session's end. Open, it is one of this replica's ongoing requests, as
        the stream is; a session's (`route["session"]`) route id is listed in `stats` meanwhile."""
        route = route or {}
        session = route.get("id") if route.get("session") else None
        if session:
            self.sessions.add(session)
        try:
            yield {"replica": self.id, "address": self.address}
            await asyncio.Event().wait()
        finally:
            self.sessions.discard(session)

    async def http(self, method: str, path: str, headers: list, body: bytes, route: dict | None = None):
        """The server's answer to one HTTP request that is not a speech stream: first {"status", "headers",
        "replica"}, then the body's bytes as they come."""
        async with self.client.request(method, f"http://replica{path}", headers=request_headers(headers),
                                       data=body, allow_redirects=False) as r:
            yield {"status": r.status, "replica": self.id, "headers": response_headers(r.headers)}
            async for data in r.content.iter_any():
                yield data

    def observe_relay_lag(self, seconds: float, route: dict | None = None) -> None:
        """The front's report: its event loop, which relays this replica's streams to their clients, ran up to
        `seconds` late. That is jitter between the engine and the client, as the server's own event loop's
        lateness is, so the engine's playback margin covers it (fleet/relay.py)."""
        from serving.keys import ENGINE

        self.relay_late.append(seconds)
        self.app[ENGINE].observe_delivery_lag(seconds)

    def stats(self, route: dict | None = None) -> dict:
        """What routing and the front's /ready need, from the engine's stats snapshot and the server's own
        admission (`Admission.admit` only reads the snapshot: asking changes nothing). `streams` (the server's
        admitted streams, each until its response ends) and `routes` (their request ids, and the sessions') are read
        together, so the router's ledger can tell which of its streams this snapshot counts."""
        from serving.keys import ADMISSION, ENGINE

        admission, st = self.app[ADMISSION], self.app[ENGINE].stats()
        try:
            ttfa, admit = admission.admit(), True
        except ApiError:
            ttfa, admit = None, False
        tracks = list(admission.streams.values())
        late = sorted(self.relay_late)
        return {"replica": self.id, "ready": admission.accepting, "admit": admit, "ttfa_s": ttfa, "slots": st.slots,
                "active": st.live, "queued": st.queued, "compiling": st.compiling, "streams": len(tracks),
                "margin_ms": round(st.headroom_margin_s * 1e3, 2),
                "relay_late_p99_ms": round(late[int(0.99 * (len(late) - 1))] * 1e3, 2) if late else None,
                "routes": [t.request_id for t in tracks] + [i for i in self.sessions if i]}

    def metrics_text(self, route: dict | None = None) -> str:
        """The server's own metrics (the front labels each replica's samples), read from its app: the front has
        checked the scraper's key."""
        from serving.http_api.routes import exposition

        return exposition(self.app).decode()

    __call__ = stats  # the handle's plain call (the front's first, which starts the router every call shares)

    def record_routing_stats(self) -> dict:
        """Ray Serve pulls this every `request_routing_stats_period_s` for the router."""
        return self.stats()

    async def __del__(self):
        """Ray calls this once its graceful shutdown has waited for the open streams: stop the server and engine."""
        await self.client.close()
        await self.runner.cleanup()


def request_headers(headers: list, token: str | None = None) -> list[tuple[str, str]]:
    """A client's request headers as the server gets them: without the hop-by-hop ones and the host; a stream's
    X-Request-Id is its route's id (`token`), else the client's own is kept."""
    drop = HOP_HEADERS | {"host"} if token else HOP_HEADERS - {"x-request-id"} | {"host"}
    return [(k, v) for k, v in headers if k.lower() not in drop] + ([("X-Request-Id", token)] if token else [])


def response_headers(headers) -> list[tuple[str, str]]:
    """The server's response headers the front passes on (it frames its own response)."""
    return [(k, v) for k, v in headers.items() if k.lower() not in HOP_HEADERS]


def _node_address() -> str:
    """This node's address, where the front reaches the replica's server (loopback outside a Ray cluster)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - not inside Ray (a unit test)
        return "127.0.0.1"


def _replica_id() -> str:
    """Ray Serve's id of this replica (what `X-Replica` says); the process id outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not inside a Serve replica (a unit test)
        return f"pid{os.getpid()}"
