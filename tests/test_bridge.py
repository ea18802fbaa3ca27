"""The asyncio bridge's report of how late its requests take their chunks (the engine's margin covers it)."""

import asyncio
import math
import threading
import time

import numpy as np

from qtts_jax.engine.stream import Chunk
from serving.bridge import AsyncStream, Outbox


class Watched(asyncio.Queue):
    """A stream's queue that says when its request first waits on it: a batch is handed out once every request
    waits, as in a server, where each has long been waiting for its next chunk."""

    def __init__(self):
        super().__init__()
        self.waited = asyncio.Event()

    async def get(self):
        self.waited.set()
        return await super().get()


async def waiting(streams) -> None:
    """Until each stream's request waits on its queue."""
    async with asyncio.timeout(10):
        for stream in streams:
            await stream.queue.waited.wait()


def test_the_lag_reported_for_a_batch_counts_until_its_last_request_took_its_chunk():
    """Requests that take a batch's chunks one after another, each working on the event loop before its next await,
    make the last of them take its chunk that much later: the lag the outbox reports includes that work, where a
    report at the batch's delivery would not."""
    work_s, requests = 0.01, 5

    async def scenario():
        lags, reported = [], asyncio.Event()
        outbox = Outbox(asyncio.get_running_loop(), lambda lag: (lags.append(lag), reported.set()))
        streams = [AsyncStream(Watched()) for _ in range(requests)]

        async def request(stream):
            chunk = await stream.__anext__()
            time.sleep(work_s)  # encoding and writing it, on the event loop
            return chunk

        tasks = [asyncio.create_task(request(s)) for s in streams]
        await waiting(streams)
        chunk = Chunk(np.zeros(1920, np.float32), 0, 1, sent_at=time.perf_counter())
        handing = threading.Thread(target=lambda: [outbox.put(chunk, s) for s in streams])
        handing.start()
        handing.join()
        taken = await asyncio.gather(*tasks)
        async with asyncio.timeout(10):
            await reported.wait()
        return lags, taken

    lags, taken = asyncio.run(scenario())
    assert len(taken) == requests and len(lags) == 1  # one batch, one report
    assert lags[0] >= requests * work_s


def test_a_batch_reaches_its_requests_soonest_due_first():
    """The coroutines of one batch run one after another, so the order is who waits: chunks with nothing playing
    yet (a first chunk) go first, then the rest by when their listeners run dry without them."""
    async def scenario():
        outbox = Outbox(asyncio.get_running_loop(), lambda lag: None)
        taken = []

        async def request(name, stream):
            await stream.__anext__()
            taken.append(name)

        order = [("far ahead", 105.0), ("first", -math.inf), ("second chunk", 100.02), ("ahead", 101.0)]
        streams = {name: AsyncStream(Watched()) for name, _ in order}
        tasks = [asyncio.create_task(request(name, s)) for name, s in streams.items()]
        await waiting(streams.values())
        for name, due in order:
            outbox.put(Chunk(np.zeros(1920, np.float32), 1, 1, sent_at=100.0, due=due), streams[name])
        await asyncio.gather(*tasks)
        return taken

    assert asyncio.run(scenario()) == ["first", "second chunk", "ahead", "far ahead"]


def test_a_requests_own_chunks_keep_their_order_whatever_else_is_more_urgent():
    """A stream's last audio chunk and its final chunk handed out before the event loop ran reach it in that order
    (the final one first would end the stream and lose the audio), while another request's more urgent chunk in
    the same batch still goes first."""
    async def scenario():
        outbox = Outbox(asyncio.get_running_loop(), lambda lag: None)
        ending, urgent = AsyncStream(Watched()), AsyncStream(Watched())
        taken = []

        async def request(name, stream):
            async for chunk in stream:
                taken.append((name, len(chunk.pcm), chunk.final))

        tasks = [asyncio.create_task(request("ending", ending)), asyncio.create_task(request("urgent", urgent))]
        await waiting([ending, urgent])
        audio = np.zeros(1920, np.float32)
        outbox.put(Chunk(audio, 10, 1, sent_at=100.0, due=100.5), ending)
        outbox.put(Chunk(audio, 1, 1, sent_at=100.0, due=100.01), urgent)
        outbox.put(Chunk(np.zeros(0, np.float32), 11, 0, sent_at=100.0, final=True, due=math.inf), ending)
        outbox.put(Chunk(np.zeros(0, np.float32), 2, 0, sent_at=100.0, final=True, due=math.inf), urgent)
        await asyncio.gather(*tasks)
        return taken

    assert asyncio.run(scenario()) == [("urgent", 1920, False), ("urgent", 0, True),
                                       ("ending", 1920, False), ("ending", 0, True)]
