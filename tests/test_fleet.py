"""The Ray Serve fleet (fleet/) on CPU: tiny-random replicas of 2 slots behind the front, in one local Ray instance,
checking API keys (the requests send an admin key). Its own job (`make test-fleet`, marked `fleet`): it needs the
fleet extra and a few minutes of Ray."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import requests

ray = pytest.importorskip("ray")  # the fleet extra; `make test` deselects this file, `make test-fleet` installs it
from ray import serve  # noqa: E402

from fleet.app import RAY_ENV, FleetConfig, build  # noqa: E402
from serving.settings import Settings  # noqa: E402
from studies.load import wait_ready  # noqa: E402
from studies.sweep import run_sync  # noqa: E402
from support import ADMIN_KEY, CAPPED_KEY, SPEAK_KEY, bearer  # noqa: E402

pytestmark = pytest.mark.fleet

FRAME_BYTES = 1920 * 2  # one 80 ms frame of s16le PCM
APP = "qtts"
KEY = bearer(ADMIN_KEY)


def _router():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from fleet.router import StreamRouter

    return StreamRouter(deployment_id=DeploymentID(name="Engine", app_name=APP),
                        handle_source=DeploymentHandleSource.UNKNOWN)


def _candidate(replica: str, **stats):
    """What Ray Serve hands the router for one replica: its id and its latest stats snapshot ({} before the first)."""
    snapshot = {"ready": True, "admit": True, "streams": 0, "slots": 2, "ttfa_s": 0.05, "routes": []}
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=replica),
                           routing_stats={**snapshot, **stats} if stats else {})


def _stream_call(request: str):
    return SimpleNamespace(kwargs={"route": {"stream": True, "id": f"token-{request}"}},
                           metadata=SimpleNamespace(internal_request_id=request))


def _first_choice(router, candidates, request: str) -> str:
    ranks = asyncio.run(router.choose_replicas(candidates, _stream_call(request)))
    return ranks[0][0].replica_id.unique_id


def test_the_router_sends_two_streams_arriving_together_to_two_replicas():
    """Both are ranked before Ray has sent either (before any callback reaches the router), on the same snapshots."""
    router = _router()
    candidates = [_candidate("a", admit=True), _candidate("b", admit=True)]

    async def together():
        return await asyncio.gather(*(router.choose_replicas(candidates, _stream_call(r)) for r in ("r1", "r2")))

    firsts = {ranks[0][0].replica_id.unique_id for ranks in asyncio.run(together())}
    assert firsts == {"a", "b"}


def test_the_router_ranks_a_new_replica_without_stats_as_an_empty_one():
    router = _router()
    assert _first_choice(router, [_candidate("old", streams=1), _candidate("new")], "r1") == "new"
    # that stream counts there until the new replica's snapshot lists it: the next goes to the old one's free slot
    assert _first_choice(router, [_candidate("old", streams=1), _candidate("new")], "r2") == "old"


def test_autoscaling_aims_each_replica_at_its_safe_capacity_less_headroom():
    settings = Settings(slots=8)
    assert FleetConfig(replicas=2).autoscaling(settings) is None
    cfg = FleetConfig(replicas=2, max_replicas=4, safe_capacity=14, headroom=0.4).autoscaling(settings)
    assert (cfg["min_replicas"], cfg["max_replicas"], cfg["initial_replicas"]) == (1, 4, 2)
    assert cfg["target_ongoing_requests"] == pytest.approx(10)
    assert FleetConfig(min_replicas=1).autoscaling(settings)["target_ongoing_requests"] == pytest.approx(8 / 1.4)
    with pytest.raises(ValueError, match="safe-capacity"):
        FleetConfig(max_replicas=2).autoscaling(Settings(slots="auto"))
    with pytest.raises(ValueError):
        FleetConfig(min_replicas=3, max_replicas=2).autoscaling(settings)


def test_a_cpu_replica_of_one_cpu_runs_xla_on_one_thread_and_keeps_the_users_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    env = FleetConfig().actor_options()["runtime_env"]["env_vars"]
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/d", "--xla_cpu_multi_thread_eigen=false"]
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")  # the user's choice wins
    env = FleetConfig().actor_options()["runtime_env"]["env_vars"]
    assert env["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=true"
    assert "runtime_env" not in FleetConfig(gpus=1).actor_options()  # a GPU replica: XLA's defaults
    assert "runtime_env" not in FleetConfig(cpus=4).actor_options()  # several cores: its pool uses them


# ---- a running fleet -------------------------------------------------------------------------------------------


def _settings(**overrides) -> Settings:
    return Settings(**{"model": "tiny-random", "slots": 2, "context": 1024, "engine": {"frames_per_step": 1},
                       "drain_timeout_s": 60, "compile_cache": os.environ["QTTS_TEST_COMPILE_CACHE"], **overrides})


@pytest.fixture(scope="module")
def url(serving_xla_flags):
    # the replicas (their runtime env starts from these) compile as a user's do: at the suite's fast-compile flags
    # a tiny-random step takes twice as long, and two replicas beside Ray on CI's two cores fall behind real time
    os.environ.update(RAY_ENV, XLA_FLAGS=serving_xla_flags)
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _deploy(url: str, settings: Settings, fleet: FleetConfig) -> None:
    serve.run(build(settings, fleet), name=APP, route_prefix="/")
    _replicas(url, fleet.replicas)


def _replicas(url: str, count: int, timeout_s: float = 240) -> list[str]:
    """The replica ids /ready lists, once there are `count` of them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = requests.get(f"{url}/ready", timeout=10)
        ids = [x["replica"] for x in r.json()["replicas"] if x["ready"]]
        if r.status_code == 200 and len(ids) == count:
            return ids
        time.sleep(0.5)  # Ray tells no one when a replica has warmed up or replaced one killed: ask again
    raise TimeoutError(f"/ready never listed {count} replicas (last: {r.json()})")


def _speech(url: str, frames: int, headers: dict = KEY, **extra) -> requests.Response:
    body = {"input": "Hello there.", "voice": "ryan", "response_format": "pcm", "stream": True,
            "max_frames": frames, "chunk_schedule": [1], **extra}
    return requests.post(f"{url}/v1/audio/speech", json=body, stream=True, timeout=120, headers=headers)


class Stream(threading.Thread):
    """A streamed request read in the background: its response, bytes, and the error that ended it, if any."""

    def __init__(self, url: str, frames: int, **extra):
        super().__init__(daemon=True)
        self.url, self.frames, self.extra = url, frames, extra
        self.started, self.body, self.error, self.response = threading.Event(), b"", None, None
        self.cancelled = threading.Event()
        self.ended = False
        self._grew = threading.Condition()  # notified as the body grows, and once the stream ended
        self.start()

    def run(self):
        try:
            self.response = _speech(self.url, self.frames, **self.extra)
            self.started.set()
            for data in self.response.iter_content(chunk_size=None):
                with self._grew:
                    self.body += data
                    self._grew.notify_all()
                if self.cancelled.is_set():
                    break  # the client goes away (the with-block closes the connection)
            self.response.close()
        except requests.RequestException as exc:
            self.error = exc
        finally:
            self.started.set()
            with self._grew:
                self.ended = True
                self._grew.notify_all()

    def wait_for(self, count: int, timeout: float = 120) -> None:
        """Until the body holds `count` bytes, or the stream ended."""
        with self._grew:
            self._grew.wait_for(lambda: len(self.body) >= count or self.ended, timeout)

    def cancel(self) -> None:
        self.cancelled.set()
        self.join(30)

    @property
    def replica(self) -> str:
        assert self.started.wait(60) and self.response is not None, self.error
        return self.response.headers["X-Replica"]


def _counted(url: str, endpoint: str, outcome: str) -> dict[str, float]:
    """Requests of `endpoint` that ended in `outcome` on each replica (the fleet's /metrics, labelled by replica)."""
    text = requests.get(f"{url}/metrics", timeout=10, headers=KEY).text
    pattern = rf'qtts_requests_total\{{endpoint="{endpoint}",outcome="{outcome}",replica="(\w+)"\}} (\S+)'
    return {m[0]: float(m[1]) for m in re.findall(pattern, text)}


def _rejected(url: str) -> dict[str, float]:
    """Speech requests each replica's own admission refused."""
    return _counted(url, "/v1/audio/speech", "rejected")


def _kill(replica: str) -> None:
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#Engine#{replica}", namespace="serve"), no_restart=True)


@pytest.fixture(scope="module")
def fleet_of_two(url, keys_file):
    """Two replicas whose admission takes a stream only when idle (a 1 ms TTFA target): a busy replica refuses.
    They and the front check keys."""
    settings = _settings(ttfa_target_ms=1, api_key="@" + keys_file)
    # one replica first: it compiles into the shared compilation cache, and the second loads from it in seconds
    # (two compiling at once on two cores take about as long as one after the other)
    _deploy(url, settings, FleetConfig(replicas=1, stats_period_s=0.2))
    _deploy(url, settings, FleetConfig(replicas=2, stats_period_s=0.2))
    return url


def test_the_fleet_serves_the_servers_api(fleet_of_two):
    url = fleet_of_two
    ids = _replicas(url, 2)
    # a study starts once nothing is left compiling in any replica's background warm-up, as with one server
    ready = run_sync(wait_ready(url, 120, idle=True))
    assert (ready["slots"], ready["active"], ready["queued"], ready["compiling"]) == (4, 0, 0, 0)
    assert [r["compiling"] for r in ready["replicas"]] == [0, 0]
    r = _speech(url, 4)
    assert r.status_code == 200 and r.headers["X-Replica"] in ids and "X-TTFA-Ms" in r.headers
    assert len(r.content) == 4 * FRAME_BYTES
    sse = _speech(url, 3, stream_format="sse")
    events = [json.loads(line[6:]) for line in sse.iter_lines() if line.startswith(b"data: ")]
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["frames"] == 3
    assert sum(len(base64.b64decode(e["audio"])) for e in events[:-1]) == 3 * FRAME_BYTES
    bad = requests.post(f"{url}/v1/audio/speech", json={"input": "", "voice": "ryan"}, timeout=30, headers=KEY)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input" and bad.headers["X-Replica"] in ids
    assert requests.get(f"{url}/v1/models", timeout=10, headers=KEY).json()["data"][0]["id"] == "tiny-random"
    assert set(_rejected(url)) <= set(ids) and all(f'replica="{i}"' in requests.get(f"{url}/metrics", headers=KEY).text
                                                    for i in ids)
    # the front reported its event loop's lateness to the replicas whose streams it relayed
    served = {r.headers["X-Replica"], sse.headers["X-Replica"]}
    deadline = time.monotonic() + 10
    while True:
        entries = [e for e in _ready_entries(url) if e["replica"] in served]
        if all(e["relay_late_p99_ms"] is not None for e in entries):
            break
        assert time.monotonic() < deadline, entries
        time.sleep(0.2)  # the front's reports reach /ready through the replicas' stats (every 0.2 s), not as events
    assert all(e["relay_late_p99_ms"] >= 0 and e["margin_ms"] > 0 for e in entries)
    # a voice registration goes to every replica (these CustomVoice ones each refuse it, naming the model)
    before = _counted(url, "/v1/audio/voices", "bad_request")
    r = requests.post(f"{url}/v1/audio/voices", json={"name": "x", "audio": "AAAA"}, timeout=30, headers=KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model" and r.headers["X-Replica"] in ids
    after = _counted(url, "/v1/audio/voices", "bad_request")
    assert {i: after.get(i, 0) - before.get(i, 0) for i in ids} == {i: 1 for i in ids}


def test_the_front_and_every_replica_check_the_keys(fleet_of_two):
    """The front refuses a missing or wrong key (401) and a speak key's voice change (403) before asking any
    replica (no X-Replica), caps a key's streams across the fleet (429), and takes a browser's key as a WebSocket
    subprotocol; a replica asked without a key refuses too."""
    import asyncio

    import aiohttp

    url = fleet_of_two
    for headers in ({}, bearer("wrong-key-of-the-tests")):
        r = requests.post(f"{url}/v1/audio/speech", json={"input": "Hi.", "voice": "ryan"}, headers=headers)
        assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key") and "X-Replica" not in r.headers
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
    r = requests.delete(f"{url}/v1/audio/voices/ryan", headers=bearer(SPEAK_KEY))
    assert (r.status_code, r.json()["error"]["code"]) == (403, "insufficient_role") and "X-Replica" not in r.headers
    assert requests.get(f"{url}/metrics", headers=bearer(SPEAK_KEY)).status_code == 403
    first = _speech(url, 40, headers=bearer(CAPPED_KEY))  # a key capped at one stream: its second is refused
    r = requests.post(f"{url}/v1/audio/speech", json={"input": "Hi.", "voice": "ryan"}, headers=bearer(CAPPED_KEY))
    assert (r.status_code, r.headers["Retry-After"]) == (429, "1") and "X-Replica" not in r.headers
    first.close()

    async def sockets():
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.WSServerHandshakeError):
                await s.ws_connect(f"{url}/v1/audio/speech/stream")
            async with s.ws_connect(f"{url}/v1/audio/speech/stream",
                                    protocols=("qtts", f"qtts-key.{SPEAK_KEY}")) as ws:
                return ws.protocol, (await ws.receive_json())["type"]

    assert asyncio.run(sockets()) == ("qtts", "session.created")
    handle = serve.get_deployment_handle("Engine", APP).options(method_name="http", stream=True)

    async def replica_asked_directly():
        gen = handle.remote("GET", "/v1/models", [], b"", route={"stream": False, "exclude": []})
        head = await gen.__anext__()
        gen.cancel()
        return head["status"]

    assert asyncio.run(replica_asked_directly()) == 401


def _ready_entries(url: str) -> list[dict]:
    return requests.get(f"{url}/ready", timeout=10).json()["replicas"]


def test_websocket_session_through_the_fleet(fleet_of_two):
    import asyncio

    import aiohttp

    async def session():
        async with aiohttp.ClientSession(headers=KEY) as s, s.ws_connect(f"{fleet_of_two}/v1/audio/speech/stream") as ws:
            for msg in ({"type": "session.update", "session": {"voice": "ryan", "max_frames": 3}},
                        {"type": "input_text.append", "text": "Hello there."}, {"type": "input_text.commit"}):
                await ws.send_str(json.dumps(msg))
            audio, kinds = 0, []
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    audio += len(msg.data)
                    continue
                kinds.append(json.loads(msg.data))
                if kinds[-1]["type"] == "utterance.done":
                    await ws.send_str(json.dumps({"type": "session.update", "session": {"voice": 5}}))
                if kinds[-1]["type"] == "error":
                    return audio, kinds

    audio, events = asyncio.run(session())
    assert audio == 3 * FRAME_BYTES and "utterance.done" in [e["type"] for e in events]
    assert events[-1]["error"]["param"] == "voice"  # the server's own validation, through the relay


def test_a_stream_never_goes_to_a_replica_that_refuses_while_another_has_headroom(fleet_of_two):
    url = fleet_of_two
    first = Stream(url, 200)
    first.replica  # noqa: B018 - its response has started: the router has counted it
    both = [first, Stream(url, 200)]
    assert both[1].replica != first.replica  # the second went where the first was not
    refused = _speech(url, 3)  # every replica now refuses: only then the client hears it
    assert refused.status_code == 429 and "Retry-After" in refused.headers
    assert refused.json()["error"]["code"] == "overloaded"
    for s in both:
        s.join(120)
        assert s.error is None and len(s.body) == 200 * FRAME_BYTES
    long = Stream(url, 200)
    busy = long.replica  # `busy` now refuses (a 1 ms TTFA target and a live stream), whether or not the router's
    before = _rejected(url)  # snapshot of it shows that yet: it counts `long` there either way
    for _ in range(2):
        r = _speech(url, 3)
        assert r.status_code == 200 and r.headers["X-Replica"] != busy
        assert len(r.content) == 3 * FRAME_BYTES
    assert long.is_alive()  # `busy` refused all along
    assert _rejected(url).get(busy, 0) == before.get(busy, 0)  # routing never even tried it
    long.join(120)


def _replicas_answering():
    """aiohttp's public request tracing, and the X-Replica header of each response a session gets through it, in
    order: a WebSocket's handshake is one of them."""
    import aiohttp

    answered, trace = [], aiohttp.TraceConfig()

    async def ended(session, context, params):
        answered.append(params.response.headers.get("X-Replica"))

    trace.on_request_end.append(ended)
    return trace, answered


async def _session_cut_by_a_kill(url: str) -> tuple[str, int, list[dict], int]:
    """A WebSocket session whose replica is killed once 4 frames of its utterance have played: the replica, the audio
    bytes, the events and the close code the client got."""
    import aiohttp

    trace, answered = _replicas_answering()
    async with aiohttp.ClientSession(headers=KEY, trace_configs=[trace]) as s, \
            s.ws_connect(f"{url}/v1/audio/speech/stream") as ws:
        victim = answered[-1]
        for msg in ({"type": "session.update", "session": {"voice": "ryan", "max_frames": 200}},
                    {"type": "input_text.append", "text": "Hello there."}, {"type": "input_text.commit"}):
            await ws.send_str(json.dumps(msg))
        audio, events, killed = 0, [], False
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                audio += len(msg.data)
            elif msg.type == aiohttp.WSMsgType.TEXT:
                events.append(json.loads(msg.data))
            if audio >= 4 * FRAME_BYTES and not killed:
                await asyncio.to_thread(_kill, victim)
                killed = True
        return victim, audio, events, ws.close_code


def test_a_replica_killed_mid_stream_ends_its_streams_with_an_error_and_the_rest_go_to_survivors(fleet_of_two):
    url = fleet_of_two
    for fmt in ("sse", "pcm", "ws"):
        _replicas(url, 2)  # Ray has replaced the replica killed in the round before
        if fmt == "ws":  # the session gets an error event and a close that says the server failed
            victim, audio, events, code = run_sync(_session_cut_by_a_kill(url))
            assert 4 * FRAME_BYTES <= audio < 200 * FRAME_BYTES and code == 1011
            assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "replica_failed", events
            assert "utterance.done" not in [e["type"] for e in events]
        else:
            doomed = Stream(url, 200, **({"stream_format": "sse"} if fmt == "sse" else {}))
            victim = doomed.replica
            doomed.wait_for(4 * FRAME_BYTES)
            _kill(victim)
            doomed.join(60)
        if fmt == "sse":  # the stream ends with an error event, not speech.audio.done
            events = re.findall(rb"^data: (.*)$", doomed.body, re.M)
            assert events, (doomed.error, doomed.body[:300])
            last = json.loads(events[-1])
            assert doomed.error is None and last["type"] == "error" and last["error"]["code"] == "replica_failed"
        elif fmt == "pcm":  # a truncated transfer, never a silently short file
            assert isinstance(doomed.error, requests.exceptions.ChunkedEncodingError)
            assert len(doomed.body) < 200 * FRAME_BYTES
        for _ in range(4):
            r = _speech(url, 3)
            # the survivor, or the replica Ray starts in the victim's place (as soon as it is up, it is idle)
            assert r.status_code == 200 and r.headers["X-Replica"] != victim, r.content
            assert len(r.content) == 3 * FRAME_BYTES
        assert victim not in _replicas(url, 2)  # and Ray started a new one in its place


UTTERANCES = 8  # what one socket may have waiting (Settings.ws_max_pending_utterances): all sent up front


def test_scale_down_during_streams_cuts_none(url):
    """Autoscaling at 1.5 streams a replica: a long stream and an idle WebSocket session on the first replica bring
    up a second; a session of eight utterances starts there (the replica with headroom: the first has a live
    stream), the long stream and the idle session end, and, one stream needing one replica (with room for the
    test's /ready calls), Ray removes the newest replica, the second, mid-session; it takes no new work and stops
    only after the session has played all eight."""
    import asyncio

    import aiohttp

    # the session's 1600 frames take about a minute on 2 cores, most of it after the scale-down began: the drain
    # must be allowed longer than that (at 60 s one run in three cut the session's last utterance)
    fleet = FleetConfig(replicas=1, min_replicas=1, max_replicas=2, safe_capacity=1.5, headroom=0, upscale_delay_s=1,
                        downscale_delay_s=1, look_back_period_s=1, stats_period_s=0.2)
    _deploy(url, _settings(drain_timeout_s=300), fleet)
    (first,) = _replicas(url, 1)
    # an idle engine always admits it; its text caps it at thousands of frames (minutes), so it plays until cancelled
    long = Stream(url, 100_000, input="Hello there. " * 300)
    assert long.replica == first

    async def session():  # every message up front: none can reach a replica once it drains
        seen, audio, scaled = [], 0, []
        trace, answered = _replicas_answering()
        async with aiohttp.ClientSession(headers=KEY, trace_configs=[trace]) as s:
            async with s.ws_connect(f"{url}/v1/audio/speech/stream"):  # the first replica's second request
                assert answered[-1] == first
                (second,) = set(await asyncio.to_thread(_replicas, url, 2)) - {first}
                ws = await s.ws_connect(f"{url}/v1/audio/speech/stream")
                replica = answered[-1]
            # 1600 frames: longer than the autoscaler takes to remove a replica (up to ~10 s) on a fast machine
            await ws.send_str(json.dumps({"type": "session.update", "session": {"voice": "ryan", "max_frames": 200}}))
            for _ in range(UTTERANCES):
                await ws.send_str(json.dumps({"type": "input_text.append", "text": "Hello there."}))
                await ws.send_str(json.dumps({"type": "input_text.commit"}))
            await ws.send_str(json.dumps({"type": "close"}))
            await asyncio.to_thread(long.cancel)  # the first replica's requests are gone: one is too many now

            async def watch():  # the events seen when /ready first lists the first replica alone
                while True:
                    async with s.get(f"{url}/ready") as r:
                        if [x["replica"] for x in (await r.json())["replicas"]] == [first]:
                            return scaled.append(len(seen))
                    await asyncio.sleep(0.2)  # only /ready shows Ray removing the replica: ask as the session plays

            watching = asyncio.ensure_future(watch())
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    audio += len(msg.data)
                else:
                    seen.append(json.loads(msg.data))
            watching.cancel()
            return second, replica, seen, audio, scaled, ws.close_code

    second, replica, seen, audio, scaled, code = asyncio.run(session())
    assert replica == second
    assert scaled and scaled[0] < len(seen), "the fleet did not scale down while the session played"
    done = [e for e in seen if e["type"] == "utterance.done"]
    assert len(done) == UTTERANCES and not any(e["cancelled"] for e in done) and code == 1000, seen
    assert "error" not in [e["type"] for e in seen], seen
    assert audio == sum(e["frames"] for e in done) * FRAME_BYTES
    assert _replicas(url, 1) == [first]
