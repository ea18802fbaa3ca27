"""Helpers several test files use (fixtures are in conftest.py): the engine configurations, a driver for the
engine's loop, the audio checks of the server and CLI tests, and waits on the events of a server (its warm-up task,
its engine's snapshot) or of a child process (the lines it prints), which tests use instead of sleeping.

The configurations are few on purpose: an engine's programs depend only on its configuration and the model's
shapes (the same for tiny-random and tiny-random-base), so every engine of one configuration after the first
loads its programs from the session's compilation cache (conftest.py) instead of compiling them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
import wave

import jax
import numpy as np

from qtts_jax.engine import Engine, EngineConfig

# The streaming engine's behaviours (the default chunk schedule, several prompt buckets, multi-frame steps,
# joins while others play): test_engine, test_engine_clone, test_server_voices.
STREAMING = EngineConfig(slots=4, context=256, prompt_buckets=(32, 64, 128), max_trailing=64, frames_per_step=3)
# The smallest engine, for tests about what surrounds it (the server, clients, hostile input): one prompt bucket
# (large enough for the server tests' texts), one-frame steps and chunks. test_server, test_clients,
# test_hardening, and the Pallas sampler's comparison in test_engine.
SMALL = EngineConfig(slots=2, context=128, prompt_buckets=(64,), max_trailing=32, frames_per_step=1, schedule=(1,))

GREEDY = dict(greedy=True, subtalker_greedy=True)

# The keys of conftest's `keys_file`, one of each role, and a speak key capped at one stream.
ADMIN_KEY, SPEAK_KEY, CAPPED_KEY, SCRAPE_KEY = ("admin-key-of-the-tests", "speak-key-of-the-tests",
                                                "capped-key-of-the-tests", "scrape-key-of-the-tests")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def hostile_credentials(key: str) -> list[list[tuple[bytes, bytes]]]:
    """Header lines that do not present `key` (or any key) properly: missing, empty, wrong, near misses, huge,
    non-ASCII and control bytes, other schemes, and repeated or doubled credentials (which one would count?)."""
    k = key.encode()
    auth, proto = b"Authorization", b"Sec-WebSocket-Protocol"
    return [[], [(auth, b"")], [(auth, b"Bearer")], [(auth, b"Bearer ")], [(auth, k)], [(auth, b"Basic " + k)],
            [(auth, b"Bearer " + k[:-1])], [(auth, b"Bearer " + k + b"x")], [(auth, b"Bearer x" + k)],
            [(auth, b"Bearer " + k + b" " + k)], [(auth, b"Bearer " + k.upper())], [(auth, b"Bearer " + b"k" * 12_000)],
            [(auth, b"Bearer " + b"k" * 20_000)], [(auth, "Bearer ключ-ключ-ключ-ключ".encode())],
            [(auth, b"Bearer " + k + "é".encode())], [(auth, b"Bearer " + k + b"\xff\xfe")],
            [(auth, b"Bearer " + k[:4] + b"\x00" + k[4:])],
            [(auth, b"Bearer " + k), (auth, b"Bearer wrong-key-of-the-tests")],
            [(auth, b"Bearer wrong-key-of-the-tests"), (auth, b"Bearer " + k)], [(auth, b"Bearer " + k)] * 2,
            [(proto, b"qtts-key.")],
            [(proto, b"qtts-key." + k[:-1])], [(proto, b"qtts-key." + k + b", qtts-key." + k)],
            [(proto, b"qtts-key." + k), (proto, b"qtts-key.wrong-key-of-the-tests")], [(proto, b"qtts, " + k)],
            [(proto, b"qtts-key.wrong-key-of-the-tests, qtts")], [(proto, "qtts-key.ключ".encode())]]


class Collector:
    """An `on_chunk` callback that keeps every chunk."""

    def __init__(self):
        self.chunks = []
        self._came = threading.Condition()

    def __call__(self, chunk):
        with self._came:
            self.chunks.append(chunk)
            self._came.notify_all()

    def wait(self, count: int, timeout: float) -> bool:
        """Until `count` chunks came (the engine's sender thread hands them out); False if `timeout` passed first."""
        with self._came:
            return self._came.wait_for(lambda: len(self.chunks) >= count, timeout)

    @property
    def audio(self):
        return np.concatenate([c.pcm for c in self.chunks]) if self.chunks else np.zeros(0)

    @property
    def final(self):
        return self.chunks[-1] if self.chunks and self.chunks[-1].final else None


@contextlib.contextmanager
def compiles():
    """The programs compiled while the block runs, as (jax's event, the function's name), from jax's public
    monitoring events; listens only for its own duration: other listeners (the cache's counts) go on."""
    seen = []

    def listener(event, duration, **kwargs):
        if "compile" in event:
            seen.append((event, kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def compiled_programs(seen) -> list[str]:
    """The names of the functions XLA compiled among `compiles()`'s events (tracing and lowering left out)."""
    return [name for event, name in seen if event == "/jax/core/compile/backend_compile_duration"]


def run(engine, plan, max_iters=500):
    """plan: list of (iteration to submit at, Request). Returns [(stream, collector)] in plan order."""
    out = [None] * len(plan)
    for it in range(max_iters):
        for i, (at, req) in enumerate(plan):
            if at == it:
                col = Collector()
                out[i] = (engine.submit(engine.prepare(req), col), col)
        busy = engine.run_once()
        if not busy and all(o is not None and o[1].final for o in out):
            return out
    raise AssertionError("engine did not finish")


def run_small(model, reqs, **overrides):
    """`reqs` submitted together to a SMALL engine with `overrides` of its configuration, run to the end: how a
    kernel or a precision is compared with the reference it replaces."""
    return run(Engine(model, dataclasses.replace(SMALL, **overrides)), [(0, r) for r in reqs])


def assert_same_codes(got, expected):
    """Two `run` results of the same requests produced the same codes, stream by stream."""
    for (stream, _), (reference, _) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(np.stack(stream.codes), np.stack(reference.codes))


async def app_client(aiohttp_client, settings, engine, ready=True):
    """A test client of the server on a shared, already warmed `engine`; by default once /ready says so."""
    from serving.app import create_app

    client = await aiohttp_client(create_app(settings, engine=engine))
    if ready:
        await wait_ready(client)
    return client


async def wait_ready(client, timeout=60.0):
    """Until /ready is 200, waiting for what it reports: the app's warm-up task to end, then its engine to have
    nothing left to compile in the background."""
    from serving.keys import ENGINE, WARMUP_TASK

    app, deadline = client.app, time.monotonic() + timeout
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await asyncio.shield(app[WARMUP_TASK])
    await asyncio.to_thread(app[ENGINE].wait_stats, lambda st: not st.compiling, deadline - time.monotonic())
    r = await client.get("/ready")
    assert r.status == 200, f"server never became ready: {await r.text()}"


def wait_warm(app, loop, timeout=60.0) -> None:
    """From another thread: until the warm-up task of `app`, served on `loop`, has ended (or `timeout` passed)."""
    from serving.keys import WARMUP_TASK

    async def ended():
        await app[WARMUP_TASK]

    with contextlib.suppress(TimeoutError):
        asyncio.run_coroutine_threadsafe(ended(), loop).result(timeout)


class ChildOutput:
    """What a child process prints (started with stdout=PIPE, stderr=STDOUT, text=True), read line by line on a thread
    of its own: a test waits for a line the child prints instead of polling the child or a log file."""

    def __init__(self, proc):
        self._lines: list[str] = []
        self._ended = False
        self._came = threading.Condition()
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    def _read(self, out) -> None:
        for line in out:
            with self._came:
                self._lines.append(line)
                self._came.notify_all()
        with self._came:
            self._ended = True
            self._came.notify_all()

    def wait_for(self, text: str, timeout: float) -> bool:
        """Until a line holding `text` came (True), or the output ended or `timeout` passed first (False)."""
        def seen():
            return any(text in line for line in self._lines)

        with self._came:
            return self._came.wait_for(lambda: seen() or self._ended, timeout) and seen()

    def text(self, timeout: float = 10.0) -> str:
        """All the child printed, once its output ended (it exited); what came, if `timeout` passed first."""
        with self._came:
            self._came.wait_for(lambda: self._ended, timeout)
            return "".join(self._lines)


def pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.int32)


def assert_same_audio(got: np.ndarray, expected: np.ndarray) -> None:
    """Streamed audio equals offline audio up to int16 rounding (streaming codec differs by < 1e-5)."""
    assert len(got) == len(expected) > 0
    assert np.max(np.abs(got - expected)) <= 1


def read_wav(path) -> tuple[int, np.ndarray]:
    with wave.open(str(path)) as w:
        assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
        return w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), np.int16)
