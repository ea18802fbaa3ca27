"""The fleet's HTTP and WebSocket entry (the Ray Serve ingress): relays each request to an engine replica and adds
`X-Replica` to each response. A speech stream or a WebSocket session takes a lease on the replica the router picks
(its handle's `lease`, open for the stream's or session's life) and goes to that replica's server directly, so its
audio costs one hop, not a Ray message per chunk (on 2 CPU cores the front spent as much CPU as the engine's replica
relaying them); other requests go through the handle.

It decides nothing about a request itself, except whether its API key lets it in, where it goes and what a dead
replica's stream ends with:
- the key is checked here as each replica checks it (serving/http_api/auth.py, the same keys), before any body is read or
  replica is asked, and a key's stream cap counts its streams across the whole fleet;
- a speech request refused by a replica (429, or 503 while that replica warms up or drains) is tried on the others
  (the router excludes those already tried); the client gets the refusal only when every replica refused it;
- a replica that dies before answering is skipped the same way; one that dies mid-stream ends an SSE stream with an
  `error` event, aborts a raw audio stream (a truncated transfer) and sends a WebSocket `error` event and closes;
- /ready, /health and /metrics sum up or label every replica's own answer;
- a voice registered or deleted (Base models) is registered or deleted on every replica;
- how late its event loop runs is reported to the replicas whose streams it relays, whose engines keep that jitter
  in their playback margins (fleet/relay.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid

import aiohttp
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray.exceptions import ActorUnavailableError, RayActorError

from fleet import router
from fleet.relay import LoopLag
from fleet.replica import request_headers, response_headers
from serving.errors import ApiError
from serving.http_api import auth
from serving.schemas import base64_chars
from serving.settings import Settings

log = logging.getLogger("fleet")

GONE = (RayActorError, ActorUnavailableError)  # the replica died or cannot be reached: another one may answer
UNREACHED = (*GONE, aiohttp.ClientConnectionError)  # the same, found on the way to its server
REFUSED = {429, 503}  # the replica's admission said no (or it warms up, or drains): another one may say yes
BROADCAST_TIMEOUT_S = 2.0
_SUMMED = ("slots", "active", "queued", "compiling")  # each replica's figures /ready and /health add up
VOICE_PATH = "/v1/audio/voices/"  # DELETE of one voice: a registry change, made on every replica


class Front:
    """ASGI app over the engine deployment's handle (`__serve_build_asgi_app__`, see fleet/app.py)."""

    async def __init__(self, engine, settings: Settings, deployment: str):
        self.deployment = deployment
        self.keys = auth.keyring(settings)
        # what a speech body may hold (a Base model's inline ref_audio): larger is the server's 413 to give
        self.max_body = settings.max_body_bytes + base64_chars(settings.max_voice_upload_bytes)
        # the handle's first call starts its router; the copies `options` makes after it share that one router
        # (made before it, each would start its own, which waits for the replica list and counts apart)
        await engine.remote()
        self.calls = {name: engine.options(method_name=name, stream=name in ("http", "lease"))
                      for name in ("http", "lease", "stats", "metrics_text", "observe_relay_lag")}
        self.client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                                            timeout=aiohttp.ClientTimeout(total=None))
        self.lag = LoopLag()
        self._probe = asyncio.ensure_future(self.lag.run(self._report_lag))

    async def __del__(self):
        """Ray calls this as the front stops."""
        self._probe.cancel()
        await self.client.close()

    def __serve_build_asgi_app__(self):
        async def app(scope, receive, send):  # a plain coroutine function: what ASGI servers recognise as ASGI 3
            if scope["type"] == "http":
                await self.http(scope, receive, send)
            elif scope["type"] == "websocket":
                await self.websocket(scope, receive, send)
            elif scope["type"] == "lifespan":
                while (msg := await receive())["type"] != "lifespan.shutdown":
                    await send({"type": "lifespan.startup.complete"})
                await send({"type": "lifespan.shutdown.complete"})
        return app

    # ---- HTTP ---------------------------------------------------------------------------------------------

    async def http(self, scope, receive, send) -> None:
        path, method = scope["path"], scope["method"]
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        try:
            key = self.keys.check(method, path, [v for k, v in headers if k == "authorization"])
            body = await _body(receive, self.max_body)
            if (method, path) == ("POST", "/v1/audio/speech"):  # its stream counts against the key's cap
                with self.keys.stream(key):
                    return await self.stream(method, _full(scope), headers, body, receive, send)
        except ApiError as err:
            return await _json(send, err.status, err.body(), err.headers())
        if path in ("/ready", "/health") and method == "GET":
            return await self.readiness(send, path)
        if path == "/metrics" and method == "GET":
            return await self.metrics(send)
        full = _full(scope)
        if (method, path) == ("POST", "/v1/audio/voices") or (method == "DELETE" and path.startswith(VOICE_PATH)):
            return await self.everywhere(method, full, headers, body, send)
        gen = self.calls["http"].remote(method, full, headers, body, route={"stream": False, "exclude": []})
        try:
            head = await gen.__anext__()
        except GONE as exc:
            return await _no_replica(send, exc)
        try:
            return await self._relay(gen, head, send)
        finally:
            gen.cancel()

    async def everywhere(self, method: str, full: str, headers: list, body: bytes, send) -> None:
        """A change to the voice registry (Base models), made on every replica in turn, so that a voice registered
        through the fleet is usable whichever replica a speech request then reaches. The client gets the first
        replica's answer, or the first refusal or failure if any replica did not take the change (the replicas
        that did keep it: the same call again, with `replace` for a registration, makes them agree)."""
        answers = {}
        for replica in self._replicas():
            gen = self.calls["http"].remote(method, full, headers, body, route={"pin": replica})
            try:
                head = await gen.__anext__()
                body_out = b"".join([chunk async for chunk in gen])
                # a replica that left the router meanwhile is not pinned: another may have answered twice
                answers.setdefault(head["replica"], (head, body_out))
            except GONE as exc:
                log.warning("replica %s gone during a voice change: %r", replica, exc)
            finally:
                gen.cancel()
        if not answers:
            return await _no_replica(send, RuntimeError("none is ready"))
        head, body_out = next((a for a in answers.values() if a[0]["status"] >= 300), next(iter(answers.values())))
        await self._relay(_once(body_out), head, send)

    async def stream(self, method: str, full: str, headers: list, body: bytes, receive, send) -> None:
        """A speech request: a lease on the replica the router picks, the request to that replica's server; a
        refusal (or a replica found gone) is tried on the others. A client that goes away ends the request to the
        server, which cancels the stream there (Ray cancels only its own calls, the lease)."""
        rid = re.sub(r"[^A-Za-z0-9_:-]", "", next((v for k, v in headers if k == "x-request-id"), ""))[:96]
        tried: set[str] = set()
        while True:
            # each attempt's own id, the server's request id there (the request's own, made unique)
            route = {"stream": True, "exclude": sorted(tried), "id": f"{rid}.{uuid.uuid4().hex[:12]}"}
            lease, where, response = self.calls["lease"].remote(route=route), None, None
            try:
                where = await lease.__anext__()
                response = await self.client.request(method, where["address"] + full, data=body,
                                                     headers=request_headers(headers, route["id"]),
                                                     allow_redirects=False)
            except UNREACHED as exc:
                lease.cancel()
                if where:
                    tried.add(where["replica"])
                if len(tried) >= len(self._replicas()):
                    return await _no_replica(send, exc)
                log.warning("replica gone before answering; trying another: %r", exc)
                continue
            replica = where["replica"]
            retry = response.status in REFUSED and replica not in tried
            tried.add(replica)
            if retry and len(tried) < len(self._replicas()):
                response.release()
                lease.cancel()
                continue
            head = {"status": response.status, "replica": replica, "headers": response_headers(response.headers)}
            self.lag.opened(replica)
            relay = asyncio.ensure_future(self._relay(response.content.iter_any(), head, send))
            gone = asyncio.ensure_future(_disconnected(receive))
            try:
                await asyncio.wait((relay, gone), return_when=asyncio.FIRST_COMPLETED)
                if relay.done():
                    return relay.result()  # its exception too: a raw stream aborted stays aborted
            finally:
                relay.cancel()
                gone.cancel()
                self.lag.closed(replica)
                # a stream cut short (its client went away) closes the connection, which cancels it in the server
                response.release() if response.content.at_eof() else response.close()
                lease.cancel()

    async def _relay(self, chunks, head: dict, send) -> None:
        """The replica's response as it comes; if the replica fails mid-stream, the end its format allows."""
        headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in head["headers"]]  # ASGI: lower case
        headers.append((b"x-replica", head["replica"].encode()))
        sse = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
        await send({"type": "http.response.start", "status": head["status"], "headers": headers})
        try:
            async for data in chunks:
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except Exception as exc:
            log.warning("replica %s failed mid-stream: %r", head["replica"], exc)
            if not sse:
                raise  # the client sees a truncated transfer, never a silently short file
            event = {"type": "error", "error": {"code": "replica_failed",
                                                "message": f"replica {head['replica']} failed: {type(exc).__name__}"}}
            await send({"type": "http.response.body", "body": _sse(event), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _replicas(self) -> list[str]:
        return router.KNOWN.get(self.deployment, [])

    async def each(self, method: str, *args) -> dict[str, object]:
        """`method` on every replica this front's router knows (dead or slow ones left out), one after another:
        Ray Serve gives the calls a request makes its own request id, so calls pending at once would collide."""
        out = {}
        for i in self._replicas():
            try:
                out[i] = await self._pinned(method, i, *args)
            except (asyncio.TimeoutError, *GONE) as exc:
                log.warning("replica %s did not answer %s: %r", i, method, exc)
        return out

    async def _pinned(self, method: str, replica: str, *args):
        """`method` on `replica` alone, within `BROADCAST_TIMEOUT_S`."""
        return await asyncio.wait_for(_result(self.calls[method].remote(*args, route={"pin": replica})),
                                      BROADCAST_TIMEOUT_S)

    async def _report_lag(self, replica: str, seconds: float) -> None:
        try:
            await self._pinned("observe_relay_lag", replica, seconds)
        except (asyncio.TimeoutError, *GONE):
            pass  # a replica gone since: its streams ended, nothing left to plan for

    async def readiness(self, send, path: str) -> None:
        """/ready: 200 while any replica admits work, with slots, active and queued streams and the programs still
        compiling summed (what the studies read: a measurement waits until none is left, as with one server);
        /health: liveness with the same sums in the batched Rust server's fields."""
        stats = list((await self.each("stats")).values())
        slots, active, queued, compiling = (sum(s[k] for s in stats) for k in _SUMMED)
        replicas = [{k: s[k] for k in ("replica", "ready", *_SUMMED, "margin_ms", "relay_late_p99_ms")} for s in stats]
        if path == "/health":
            return await _json(send, 200, {"status": "ok", "queue_depth": queued, "max_batch": slots,
                                           "active": active, "replicas": replicas})
        if any(s["ready"] for s in stats):
            return await _json(send, 200, {"status": "ready", "slots": slots, "active": active, "queued": queued,
                                           "compiling": compiling, "replicas": replicas})
        return await _json(send, 503, {"status": "warming" if not stats else "draining", "replicas": replicas},
                           {"Retry-After": "5"})

    async def metrics(self, send) -> None:
        """Every replica's Prometheus metrics, each sample labelled with its `replica`."""
        texts = await self.each("metrics_text")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Labelled(texts))
        await _send_whole(send, 200, generate_latest(registry), b"text/plain; version=0.0.4; charset=utf-8")

    # ---- WebSocket ----------------------------------------------------------------------------------------

    async def websocket(self, scope, receive, send) -> None:
        """The server's WebSocket on one replica, chosen and leased like a speech stream (the open session is one
        of its ongoing requests) and reached directly; its messages both ways, in order."""
        if (await receive())["type"] != "websocket.connect":
            return
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        try:
            key = self.keys.check("GET", scope["path"], [v for k, v in headers if k == "authorization"],
                                  [v for k, v in headers if k == "sec-websocket-protocol"])
            with self.keys.stream(key):
                return await self.session(scope, receive, send, headers)
        except ApiError as err:
            return await _deny(scope, send, err)

    async def session(self, scope, receive, send, headers: list) -> None:
        sid = uuid.uuid4().hex
        # the replica checks the key too: the client's Authorization header and subprotocols go on to it
        headers = [(k, v) for k, v in headers if k in ("user-agent", "x-request-id", "authorization")]
        lease, where = self.calls["lease"].remote(route={"stream": True, "id": sid, "session": True}), None
        try:
            where = await lease.__anext__()
            ws = await self.client.ws_connect(where["address"] + scope["path"], headers=headers, autoping=True,
                                              max_msg_size=0, protocols=scope.get("subprotocols") or ())
        except UNREACHED as exc:
            lease.cancel()
            log.warning("no replica for a WebSocket session: %r", exc)
            return await send({"type": "websocket.close", "code": 1013})
        replica = where["replica"]
        await send({"type": "websocket.accept", "headers": [(b"x-replica", replica.encode())],
                    "subprotocol": ws.protocol})
        self.lag.opened(replica)
        pump = asyncio.ensure_future(_client_to_replica(ws, receive))
        try:
            while (msg := await ws.receive()).type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                await send({"type": "websocket.send",
                            "text" if msg.type == aiohttp.WSMsgType.TEXT else "bytes": msg.data})
            if pump.done():
                return  # the client went away first: nobody to tell
            if msg.type == aiohttp.WSMsgType.CLOSE:  # the server's own close frame
                return await send({"type": "websocket.close", "code": msg.data})
            # the connection ended without one (a killed process's socket just closes): the replica failed
            log.warning("replica %s failed mid-session: %s %r", replica, msg.type.name, msg.data)
            event = {"type": "error", "error": {"code": "replica_failed", "message": f"replica {replica} failed",
                                                "param": None}}
            await send({"type": "websocket.send", "text": json.dumps(event)})
            await send({"type": "websocket.close", "code": 1011})
        finally:
            pump.cancel()
            self.lag.closed(replica)
            await ws.close()
            lease.cancel()


class _Labelled:
    """A Prometheus collector of parsed exposition texts, each sample labelled with the replica it came from."""

    def __init__(self, texts: dict[str, str]):
        self.texts = texts

    def collect(self):
        for replica, text in self.texts.items():
            for family in text_string_to_metric_families(text):
                family.samples = [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
                yield family


async def _client_to_replica(ws: aiohttp.ClientWebSocketResponse, receive) -> None:
    """The client's messages to the replica's server socket, until either side closes (a message that finds the
    server's side gone is dropped: the relay the other way tells the client why)."""
    while not ws.closed:
        msg = await receive()
        if msg["type"] == "websocket.disconnect":
            return await ws.close(code=msg.get("code") or 1000)
        try:
            if msg.get("text") is not None:
                await ws.send_str(msg["text"])
            else:
                await ws.send_bytes(msg.get("bytes") or b"")
        except ConnectionError:
            return


async def _once(data: bytes):
    yield data


async def _result(response):
    return await response


async def _disconnected(receive) -> None:
    """Returns once the client has gone away (the request's body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _no_replica(send, exc: BaseException) -> None:
    err = ApiError(503, "no_replica", f"no replica answered: {exc}", retry_after=1)
    await _json(send, 503, err.body(), err.headers())


async def _deny(scope, send, err: ApiError) -> None:
    """A WebSocket refused before its upgrade: the JSON error as an HTTP response where the server can send one
    (ASGI's websocket.http.response), else a close with 1008 (policy violation)."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        return await send({"type": "websocket.close", "code": 1008})
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers().items()]
    await send({"type": "websocket.http.response.start", "status": err.status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body, "more_body": False})


def _full(scope) -> str:
    """The request's path and query, as the replica's server is asked for it."""
    return scope["path"] + (f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else "")


async def _body(receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ApiError(400, "disconnected", "the client went away", "body")
        chunks.append(msg.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            raise ApiError(413, "body_too_large", f"request body too large: more than {limit} bytes", "body")
        if not msg.get("more_body"):
            return b"".join(chunks)


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _json(send, status: int, obj: dict, headers: dict[str, str] | None = None) -> None:
    await _send_whole(send, status, json.dumps(obj).encode(), b"application/json", headers)


async def _send_whole(send, status: int, body: bytes, ctype: bytes, extra: dict[str, str] | None = None) -> None:
    headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
