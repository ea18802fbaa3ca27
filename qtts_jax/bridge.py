"""asyncio face of the engine: the engine loop runs on its own thread; each request gets an
`asyncio.Queue` of chunks, fed with `call_soon_threadsafe`, so handlers simply `async for` the audio."""

from __future__ import annotations

import asyncio

from qtts_jax.engine import Engine
from qtts_jax.job import Job
from qtts_jax.stream import Chunk, Stream


class AsyncStream:
    """Async iterator over one request's chunks; ends after the final chunk."""

    def __init__(self, queue: asyncio.Queue):
        self._queue = queue
        self._ended = False
        self.stream: Stream | None = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> Chunk:
        if self._ended:
            raise StopAsyncIteration
        chunk = await self._queue.get()
        self._ended = chunk.final
        return chunk

    def cancel(self) -> None:
        """Stop generating; the slot is freed at the engine's next step."""
        self.stream.cancel()

    @property
    def timings(self):
        return self.stream.timings


class AsyncEngine:
    """Owns the engine thread for an event loop (start/stop fit an aiohttp cleanup_ctx)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    async def start(self, warmup: bool = True) -> None:
        if warmup:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.warmup)
        self.engine.start()

    async def stop(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)

    def submit(self, job: Job) -> AsyncStream:
        """Queue a job from `Engine.prepare` (where a request the engine cannot take is refused)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Chunk] = asyncio.Queue()
        out = AsyncStream(queue)

        def deliver(chunk: Chunk) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, chunk)
            except RuntimeError:  # the event loop is gone: nobody listens, so stop generating
                out.stream.cancel()

        out.stream = self.engine.submit(job, deliver)
        return out
