"""asyncio face of the engine: the engine's core runs in a process of its own or on a thread (`CoreClient`); each
request gets an `asyncio.Queue` of chunks, so handlers simply `async for` the audio.

Chunks cross threads through one outbox per event loop: whatever the core's batches hand out before the loop next runs
moves into the requests' queues in ONE `call_soon_threadsafe` callback (one wake-up of the event loop per engine
iteration, not one per chunk per stream). Once the requests' coroutines have taken the batch's chunks (each works up
to its next await in turn), the outbox reports how long after the engine handed out the oldest chunk the last was
taken: jitter the engine's playback margin must cover, since a listener's playback runs from when its request
takes its first chunk."""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from functools import partial

from qtts_jax.engine import Engine
from qtts_jax.engine.core_client import CoreClient, CoreStream
from qtts_jax.engine.job import Job
from qtts_jax.engine.stream import Chunk


class AsyncStream:
    """Async iterator over one request's chunks; ends after the final chunk."""

    def __init__(self, queue: asyncio.Queue):
        self.queue = queue  # where the outbox delivers its chunks
        self._ended = False
        self.stream: CoreStream | None = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> Chunk:
        if self._ended:
            raise StopAsyncIteration
        chunk = await self.queue.get()
        self._ended = chunk.final
        return chunk

    def cancel(self) -> None:
        """Stop generating; the slot is freed at the engine's next step."""
        self.stream.cancel()

    @property
    def timings(self):
        return self.stream.timings


class Outbox:
    """Chunks from the engine thread, delivered into their queues by one event-loop callback per batch."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_lag):
        self.loop, self.on_lag = loop, on_lag
        self._lock = threading.Lock()
        self._items: list[tuple[Chunk, AsyncStream]] = []
        self._since = 0.0

    def put(self, chunk: Chunk, out: AsyncStream) -> None:
        """Engine thread: queue one chunk; the first of a batch schedules the delivery."""
        with self._lock:
            first = not self._items
            self._items.append((chunk, out))
            if first:
                self._since = time.perf_counter()
        if first:
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the event loop is gone: nobody listens, so stop generating
                with self._lock:
                    items, self._items = self._items, []
                for _, out in items:
                    out.stream.cancel()

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, since = self._items, [], self._since
        # the coroutines wake in this order and each works through its request's chunks before the next: the
        # requests whose listeners run dry soonest first (a newcomer's second chunk before a far-ahead stream's);
        # a request's own chunks keep their order
        requests: dict[int, list] = {}
        for item in items:
            requests.setdefault(id(item[1]), []).append(item)
        for request in sorted(requests.values(), key=lambda its: min(chunk.due for chunk, _ in its)):
            for chunk, out in request:
                out.queue.put_nowait(chunk)
        # the coroutines these chunks wake run next, in turn, each taking its chunk and working up to its next
        # await; this runs after them: the lag of the batch's last taking, which is where its listener's clock is
        self.loop.call_soon(self._taken, since)

    def _taken(self, since: float) -> None:
        self.on_lag(time.perf_counter() - since)


class AsyncEngine:
    """Starts and stops the engine's core for an event loop (start/stop fit an aiohttp cleanup_ctx)."""

    def __init__(self, engine: CoreClient | Engine):
        """`engine`: a core's client, or an `Engine` to run on a thread here (`CoreClient.in_process`)."""
        self.engine = engine if isinstance(engine, CoreClient) else CoreClient.in_process(engine)
        self._outboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its outbox

    async def start(self, warmup: bool = True) -> None:
        """Start the loop after the warm-up that lets it serve. On a GPU the rest compiles in the background (its
        autotuning makes a cold start minutes); on a CPU everything compiles first: it takes seconds there and
        would share the cores the first requests need."""
        loop = asyncio.get_running_loop()
        if warmup:
            background = self.engine.backend != "cpu"
            await loop.run_in_executor(None, partial(self.engine.warmup, background=background))
        await loop.run_in_executor(None, self.engine.start)

    async def stop(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)

    def submit(self, job: Job, ahead: bool = False) -> AsyncStream:
        """Queue a job from `Engine.prepare` (where a request the engine cannot take is refused); `ahead`: before
        the waiting requests (see `Engine.submit`)."""
        loop = asyncio.get_running_loop()
        outbox = self._outboxes.get(loop)
        if outbox is None:
            outbox = self._outboxes[loop] = Outbox(loop, self.engine.observe_delivery_lag)
        out = AsyncStream(asyncio.Queue())
        out.stream = self.engine.submit(job, lambda chunk: outbox.put(chunk, out), ahead)
        return out

    def append_text(self, out: AsyncStream, ids: list[int], complete: bool = False) -> None:
        """`Engine.append_text` for a live stream from `submit` (checked here, sent to the core: no need to leave
        the loop)."""
        self.engine.append_text(out.stream, ids, complete)
