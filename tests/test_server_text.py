"""Text as production sends it, through the server with `tiny-random`: long input spoken in parts as one stream,
SSML (pauses, prosody, hostile documents) and word timings on SSE and both WebSockets."""

from __future__ import annotations

import base64
import json
import time
import tracemalloc

import aiohttp
import numpy as np
import pytest
import pytest_asyncio

from qtts_jax.engine import Engine
from serving.app import ADMISSION, BRIDGE, Settings
from serving.text.script import build
from support import SMALL, app_client, pcm

pytestmark = pytest.mark.asyncio
SETTINGS = Settings(slots=SMALL.slots, context=SMALL.context, ttfa_target_ms=2000, admission={"starvation_s": 1e9})
BODY = dict(voice="ryan", seed=3, max_frames=6, response_format="pcm", stream=True)
# four sentences, each fitting SMALL's 64-token prompt bucket alone (tiny-random: a token a character), no two together
SENTENCES = ["The first sentence is here and fits.", "A second one follows it right away.",
             "Then comes a third, a little longer.", "And the fourth one ends the text."]
RATE = 24000


@pytest.fixture(scope="module")
def engine(tiny_model):
    e = Engine(tiny_model, SMALL)
    e.warmup()
    return e


@pytest_asyncio.fixture
async def make_client(aiohttp_client, engine):
    async def make(settings=SETTINGS):
        return await app_client(aiohttp_client, settings, engine)

    return make


@pytest_asyncio.fixture
async def client(make_client):
    return await make_client()


async def speak(client, **body) -> np.ndarray:
    r = await client.post("/v1/audio/speech", json={**BODY, **body})
    assert r.status == 200, await r.text()
    return pcm(await r.read())


async def sse(client, **body) -> tuple[np.ndarray, list[dict]]:
    r = await client.post("/v1/audio/speech", json={**BODY, "stream_format": "sse", **body})
    assert r.status == 200, await r.text()
    events = [json.loads(line[6:]) for line in (await r.text()).split("\n") if line.startswith("data: ")]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    return pcm(audio), events


async def receive(ws, words_event: str, until: str) -> tuple[list[dict], float]:
    """A socket's word timings and seconds of PCM up to the event `until`; no error on the way."""
    words, audio = [], b""
    async for msg in ws:
        if msg.type == aiohttp.WSMsgType.BINARY:
            audio += msg.data
            continue
        event = json.loads(msg.data)
        assert event["type"] != "error", event
        words += event["words"] if event["type"] == words_event else []
        if event["type"] == until:
            return words, len(audio) / 2 / RATE
    raise AssertionError(f"socket closed before {until}")


def assert_timings(words: list[dict], texts: list[str], audio_s: float) -> None:
    """Every word of `texts` in order, starts never decreasing, each word within the audio."""
    assert [w["word"] for w in words] == " ".join(texts).split()
    starts = [w["start"] for w in words]
    assert starts == sorted(starts) and starts[0] >= 0
    assert all(w["start"] <= w["end"] <= audio_s + 1e-3 for w in words)


async def test_long_input_is_one_stream_of_its_sentences(client):
    """Longer than a prompt: spoken sentence by sentence, each exactly as it sounds alone with the same voice,
    seed and settings, back to back in one response; word timings count from the response's start. Admission
    counts the parts after the first (each capped at max_frames) from the start until each is submitted."""
    alone = [await speak(client, input=s) for s in SENTENCES]
    admission, opened = client.app[ADMISSION], []
    real_open = admission.open

    def open_track(*args):
        track = real_open(*args)
        opened.append((track, tuple(track.to_come)))
        return track

    admission.open = open_track
    audio, events = await sse(client, input=" ".join(SENTENCES), word_timestamps=True)
    np.testing.assert_array_equal(audio, np.concatenate(alone))
    [(track, to_come)] = opened
    assert to_come == (BODY["max_frames"],) * (len(SENTENCES) - 1) and track.to_come == []
    done = events[-1]
    assert done["type"] == "speech.audio.done" and done["timings"]["parts"] == len(SENTENCES)
    words = [w for e in events if e["type"] == "speech.words" for w in e["words"]]
    assert_timings(words, SENTENCES, len(audio) / RATE)
    second = next(w for w in words if w["word"] == "A")  # the second part starts after the first one's audio
    assert second["start"] >= len(alone[0]) / RATE - 1e-3


async def test_input_beyond_max_input_chars_is_a_plain_400(make_client):
    client = await make_client(Settings(**{**SETTINGS.__dict__, "max_input_chars": 100}))
    r = await client.post("/v1/audio/speech", json={**BODY, "input": "word " * 30})
    body = await r.json()
    assert r.status == 400 and body["error"]["param"] == "input"
    assert body["error"]["message"] == "input: is 150 characters long; this server takes at most 100"


async def test_ssml_break_is_silence_of_its_length(client):
    audio = await speak(client, input='<speak>One two.<break time="120ms"/>Three four.</speak>')
    quiet = np.abs(audio) <= 1
    runs, n = [], 0
    for q in quiet:  # the longest run of silence (tiny-random's noise has none of its own)
        n = n + 1 if q else 0
        runs.append(n)
    assert abs(max(runs) / RATE - 0.120) <= 0.005


async def test_ssml_prosody_rate_pitch_and_volume(client):
    plain = await speak(client, input="Prosody here.", max_frames=10)
    fast = await speak(client, input='<speak><prosody rate="150%">Prosody here.</prosody></speak>', max_frames=10)
    assert abs(len(fast) / len(plain) - 1 / 1.5) <= 0.05 / 1.5
    quiet = await speak(client, input='<speak><prosody volume="-6dB">Prosody here.</prosody></speak>',
                        max_frames=10)
    assert np.max(np.abs(quiet - np.round(plain * 10 ** (-6 / 20)))) <= 1
    high = await speak(client, input='<speak><prosody pitch="+3st">Prosody here.</prosody></speak>', max_frames=10)
    assert abs(len(high) - len(plain)) <= 2  # a pitch shift keeps the length (its pitch: test_ssml.py)


async def test_emphasis_is_an_instruction_where_the_model_takes_one(engine):
    script = build({"input": "<speak>Say <emphasis level='strong'>this</emphasis> now.</speak>", "voice": "ryan"},
                   engine=engine, served_names=("tiny-random",))
    assert [j.request.instruct for j in script.jobs] == [None, "Say this with strong emphasis.", None]


@pytest.mark.parametrize("document, names", [
    ('<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;">'
     '<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;"><!ENTITY lol4 "&lol3;&lol3;&lol3;&lol3;&lol3;">]>'
     '<speak>&lol4;</speak>', "<!DOCTYPE>"),
    ('<!DOCTYPE speak [<!ENTITY xxe SYSTEM "file:///etc/passwd">]><speak>&xxe;</speak>', "<!DOCTYPE>"),
    ("<speak>" + "<s>" * 10_000 + "deep" + "</s>" * 10_000 + "</speak>", "<s>: nesting deeper"),
    ("<speak>Hi <audio src='x.wav'/></speak>", "<audio>"),
    ('<speak>Hi <break time="11s"/></speak>', "<break>: time 11s"),
    ("<speak> <break/> </speak>", "no text"),
    ("<speak>Hi <prosody rate='fast'>open", "not well-formed"),
])
async def test_hostile_and_bad_ssml_is_a_fast_400_that_reaches_no_engine(make_client, document, names):
    client = await make_client(Settings(**{**SETTINGS.__dict__, "max_input_chars": 100_000}))
    submitted = []
    bridge = client.app[BRIDGE]
    bridge.submit = lambda job: submitted.append(job)  # nothing may get this far
    await client.post("/v1/audio/speech", json={**BODY, "input": "<speak><x/></speak>"})  # the connection's set-up
    t0 = time.perf_counter()
    r = await client.post("/v1/audio/speech", json={**BODY, "input": document})
    elapsed = time.perf_counter() - t0
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == "input" and names in err["message"], err
    tracemalloc.start()  # again, its allocations traced (which slows it down, so not timed)
    await client.post("/v1/audio/speech", json={**BODY, "input": document})
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 0.05 and peak < 4 * 1024 * 1024 and not submitted, (elapsed, peak)


async def test_word_timings_and_ssml_on_our_websocket(client):
    """SSML waits for the commit even with sentence splitting on; word events come after each part's audio and
    count the pause."""
    async with client.ws_connect("/v1/audio/speech/stream") as ws:
        await ws.send_json({"type": "session.update", "session": {"voice": "ryan", "seed": 3, "max_frames": 6,
                            "word_timestamps": True, "split_granularity": "sentence", "input_format": "ssml"}})
        await ws.send_json({"type": "input_text.append", "text": "<speak>Hello there. <break time='300ms'/>"})
        await ws.send_json({"type": "input_text.append", "text": "Bye now.</speak>"})
        await ws.send_json({"type": "input_text.commit"})
        words, seconds = await receive(ws, "utterance.words", "utterance.done")
    assert_timings(words, ["Hello there.", "Bye now."], seconds)
    assert words[2]["start"] >= 6 * 0.08 + 0.3 - 1e-3  # after the first part's six frames and the pause


async def test_word_timings_on_vllm_omni_websocket(client):
    async with client.ws_connect("/v1/audio/speech/stream") as ws:
        await ws.send_json({"type": "session.config", "voice": "ryan", "seed": 3, "max_new_tokens": 7,
                            "response_format": "pcm", "stream_audio": True, "word_timestamps": True})
        await ws.send_json({"type": "input.text", "text": " ".join(SENTENCES[:2])})
        await ws.send_json({"type": "input.done"})
        words, seconds = await receive(ws, "audio.words", "session.done")
    assert_timings(words, SENTENCES[:2], seconds)
