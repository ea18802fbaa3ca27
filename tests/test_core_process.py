"""The engine core in a process of its own (`serve`'s): a core that dies ends its streams with an error, never a hang,
`/ready` says 503 while it is down, and the server starts a new one and serves again."""

import asyncio
import os
import signal

import aiohttp
import pytest

from qtts_jax.engine import Engine
from qtts_jax.engine.core_client import CoreClient
from qtts_jax.request import Request, RequestError
from serving.app import create_app
from serving.keys import ENGINE, WARMUP_ERROR, WARMUP_TASK
from serving.settings import Settings
from support import GREEDY, SMALL

SPEECH = {"model": "tts-1", "voice": "ryan", "response_format": "pcm", "stream": True,
          "input": "A stream long enough to be playing when its engine core is killed, " * 3}


@pytest.mark.asyncio
async def test_a_killed_core_ends_its_streams_with_an_error_reports_not_ready_and_is_restarted(aiohttp_client):
    # one slot, one frame a step, no warm-up: the fewest programs to compile (the session's cache keeps them)
    settings = Settings(slots=1, context=128, engine={"frames_per_step": 1}, warmup=False, warm_voice_encoders=False,
                        compile_cache=os.environ["QTTS_TEST_COMPILE_CACHE"])
    app = create_app(settings)
    core = app[ENGINE]
    assert core.process is not None and core.process.pid != os.getpid()
    loop, back = asyncio.get_running_loop(), asyncio.Event()
    tell = core.on_up
    core.on_up = lambda up: (tell(up), up and loop.call_soon_threadsafe(back.set))
    client = await aiohttp_client(app)
    await app[WARMUP_TASK]
    assert not app[WARMUP_ERROR] and (await client.get("/ready")).status == 200

    resp = await client.post("/v1/audio/speech", json=SPEECH)
    assert resp.status == 200
    assert await resp.content.readany()  # audio is playing
    os.kill(core.process.pid, signal.SIGKILL)
    with pytest.raises(aiohttp.ClientPayloadError):  # the transfer is cut, as for any engine failure mid-stream
        while await resp.content.readany():
            pass
    ready = await client.get("/ready")
    assert ready.status == 503 and (await ready.json())["status"] == "restarting"
    refused = await client.post("/v1/audio/speech", json={**SPEECH, "stream": False})
    assert refused.status == 503

    await asyncio.wait_for(back.wait(), timeout=300)
    assert (await client.get("/ready")).status == 200
    again = await client.post("/v1/audio/speech", json={**SPEECH, "input": "Served again."})
    assert again.status == 200 and len(await again.read()) > 0


def test_the_clients_snapshot_counts_a_burst_at_once_and_names_its_streams(tiny_model):
    """Admission judges a burst request by request: jobs submitted since the core's last snapshot are queued in it at
    once (an `ahead` one first), named by the handles' ids; live text is refused on this side as the engine would."""
    core = CoreClient.in_process(Engine(tiny_model, SMALL))  # its loop not started: nothing is admitted
    try:
        jobs = [core.prepare(Request(f"Request {i}.", speaker="ryan", max_frames=5 + i, **GREEDY)) for i in range(3)]
        first, second = (core.submit(job, lambda chunk: None) for job in jobs[:2])
        urgent = core.submit(jobs[2], lambda chunk: None, ahead=True)
        st = core.stats()
        assert (st.live, st.queued) == (0, 3)
        assert st.queued_ids == (urgent.id, first.id, second.id) and st.queued_frames == (7, 5, 6)
        with pytest.raises(RequestError, match="complete"):
            core.append_text(first, [1, 2])  # not a live job
    finally:
        core.stop()
