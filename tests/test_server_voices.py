"""The voice registry on loopback with `tiny-random-base`: register, use by name, persist, refuse bad input."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import aiohttp
import jax
import numpy as np
import openai
import pytest
import pytest_asyncio
import soundfile as sf

from qtts_jax.io.audio import to_int16
from qtts_jax.engine import Engine
from qtts_jax.request import Request
from serving.app import ENGINE, VOICE_WARMUP, VOICES, Settings, create_app
from serving.http_api import voice_routes
from support import SMALL, STREAMING, app_client, assert_same_audio, compiled_programs, compiles, pcm

pytestmark = pytest.mark.asyncio

CONFIG = STREAMING  # test_engine's (4 slots: the three-voice batch fits): its programs come from the compilation cache


@pytest.fixture(scope="module")
def model(tiny_base_model):
    return tiny_base_model


@pytest.fixture(scope="module")
def engine(model):
    e = Engine(model, CONFIG)
    e.warmup()
    return e


def recording(seconds: float, rate: int = 24000, pitch: float = 180.0, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * pitch * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)) + 0.02 * rng.standard_normal(len(t))
    return x.astype(np.float32)


def wav_bytes(x: np.ndarray, rate: int = 24000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def form(name=None, audio=None, **fields) -> aiohttp.FormData:
    f = aiohttp.FormData()
    if name is not None:
        f.add_field("name", name)
    if audio is not None:
        f.add_field("audio", audio, filename="ref.wav", content_type="audio/wav")
    for k, v in fields.items():
        f.add_field(k, str(v))
    return f


@pytest_asyncio.fixture
async def make_client(aiohttp_client, engine, tmp_path):
    async def make(voices_dir=tmp_path / "voices", **overrides):
        overrides.setdefault("warm_voice_encoders", False)  # compiled on demand; one test checks the warm-up
        # tiny-random on a CPU is slower than real time: no real-time limit here (test_admission tests it)
        settings = Settings(slots=CONFIG.slots, context=CONFIG.context, ttfa_target_ms=5000, admission={"starvation_s": 1e9},
                            voices_dir=str(voices_dir), **overrides)
        return await app_client(aiohttp_client, settings, engine)

    return make


async def speech(client, voice, text, seed=0, max_frames=8):
    r = await client.post("/v1/audio/speech", json={"input": text, "voice": voice, "response_format": "pcm",
                                                     "seed": seed, "max_frames": max_frames, "stream": True})
    assert r.status == 200, await r.text()
    return pcm(await r.read())


def offline(model, prompt, text, seed=0, max_frames=8):
    (res,) = model.generate(Request(text, voice=prompt, seed=seed, max_frames=max_frames))
    return to_int16(res.audio).astype(np.int32)


async def test_register_use_list_show_delete_and_reload(make_client, model, tmp_path):
    client = await make_client()
    audio = recording(1.6)
    r = await client.post("/v1/audio/voices", data=form("Alice", wav_bytes(audio), transcript="Hello, it is me.",
                                                        consent="recorded with permission"))
    body = await r.json()
    assert r.status == 201, body
    assert r.headers["Location"] == "/v1/audio/voices/alice"
    assert body["id"] == "alice" and body["mode"] == "icl" and body["transcript"] == "Hello, it is me."
    assert body["consent"] == "recorded with permission" and body["seconds"] == pytest.approx(1.6)
    # the stored prompt is what Model.clone_voice computes (with the server's default trailing silence)
    stored = client.app[VOICES].get("alice").prompt
    direct = model.clone_voice(wav_bytes(audio), "Hello, it is me.", trailing_silence_s=0.5)
    np.testing.assert_array_equal(stored.ref_codes, direct.ref_codes)
    np.testing.assert_array_equal(stored.xvector, direct.xvector)
    assert body["frames"] == len(direct.ref_codes) == int(np.ceil((1.6 + 0.5) * 12.5))

    got = await speech(client, "alice", "Speak as Alice.", seed=3)
    assert_same_audio(got, offline(model, stored, "Speak as Alice.", seed=3))

    r = await client.post("/v1/audio/voices", data=form("bob", wav_bytes(recording(1.2, pitch=120)), xvector_only="true",
                                                        transcript="ignored"))
    assert r.status == 201 and (await r.json())["mode"] == "xvector"
    listed = (await (await client.get("/v1/audio/voices")).json())["voices"]
    assert [v["id"] for v in listed] == ["alice", "bob"] and all("fingerprint" not in v for v in listed)
    assert (await (await client.get("/v1/audio/voices/BOB")).json())["mode"] == "xvector"
    # base64 (here a data: URL) in a plain field instead of a file part: the same voice
    b64 = aiohttp.FormData({"name": "alice2", "transcript": "Hello, it is me.",
                            "audio": "data:audio/wav;base64," + base64.b64encode(wav_bytes(audio)).decode()},
                           default_to_multipart=True)
    assert (await client.post("/v1/audio/voices", data=b64)).status == 201
    np.testing.assert_array_equal(client.app[VOICES].get("alice2").prompt.ref_codes, stored.ref_codes)
    assert (await client.delete("/v1/audio/voices/alice2")).status == 200

    # a fresh server on the same directory has both voices, and they give the same audio
    files = sorted(p.name for p in (tmp_path / "voices").iterdir())
    assert files == ["alice.npz", "bob.npz"]  # no temporary files left behind
    await client.close()  # (the apps share one engine: one at a time)
    client = await make_client()
    assert client.app[VOICES].names() == ["alice", "bob"]
    assert_same_audio(await speech(client, "alice", "Speak as Alice.", seed=3), got)

    r = await client.delete("/v1/audio/voices/bob")
    assert r.status == 200 and (await r.json())["deleted"] is True
    assert (await client.delete("/v1/audio/voices/bob")).status == 404
    r = await client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "bob"})
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == "voice" and err["code"] == "unknown_voice"
    assert sorted(p.name for p in (tmp_path / "voices").iterdir()) == ["alice.npz"]


async def test_cloned_voices_in_one_batch_each_equal_their_solo_output(make_client, model):
    client = await make_client()
    for name, pitch, extra in [("ann", 150, {"transcript": "First voice."}), ("ben", 110, {"xvector_only": "1"}),
                               ("cat", 240, {"transcript": "A third one speaks here."})]:
        r = await client.post("/v1/audio/voices", data=form(name, wav_bytes(recording(1.3, pitch=pitch, seed=pitch)),
                                                            **extra))
        assert r.status == 201, await r.text()
    jobs = [("ann", "One, two.", 1), ("ben", "Three, four.", 2), ("cat", "Five, six.", 3)]
    together = await asyncio.gather(*(speech(client, v, t, s) for v, t, s in jobs))
    for (voice, text, seed), got in zip(jobs, together):
        prompt = client.app[VOICES].get(voice).prompt
        assert_same_audio(got, offline(model, prompt, text, seed))


async def test_websocket_session_uses_a_registered_voice(make_client, model):
    client = await make_client()
    r = await client.post("/v1/audio/voices", data=form("dee", wav_bytes(recording(1.4)), transcript="Some words."))
    assert r.status == 201
    async with client.ws_connect("/v1/audio/speech/stream") as ws:
        await ws.receive_json()  # session.created
        await ws.send_json({"type": "session.update", "session": {"voice": "nobody"}})
        err = await ws.receive_json()
        assert err["type"] == "error" and err["error"]["param"] == "voice"
        await ws.send_json({"type": "session.update", "session": {"voice": "dee", "seed": 4, "max_frames": 6}})
        assert (await ws.receive_json())["type"] == "session.updated"
        await ws.send_json({"type": "input_text.append", "text": "Over the socket."})
        await ws.send_json({"type": "input_text.commit"})
        audio = b""
        while True:
            msg = await ws.receive()
            if msg.type == aiohttp.WSMsgType.BINARY:
                audio += msg.data
            elif json.loads(msg.data)["type"] in ("utterance.done", "error"):
                assert json.loads(msg.data)["type"] == "utterance.done", msg.data
                break
    prompt = client.app[VOICES].get("dee").prompt
    assert_same_audio(pcm(audio), offline(model, prompt, "Over the socket.", seed=4, max_frames=6))


async def test_bad_registrations_get_4xx_naming_the_field(make_client):
    client = await make_client(max_voice_upload_bytes=200_000, voice_max_seconds=3.0)
    good = wav_bytes(recording(1.2))

    async def expect(data, status, param, **kw):
        r = await client.post("/v1/audio/voices", data=data, **kw)
        body = await r.json()
        assert r.status == status and body["error"]["param"] == param, body
        return body["error"]["message"]

    await expect(json.dumps({"name": "x"}), 400, "audio", headers={"Content-Type": "application/json"})
    await expect(json.dumps(["x"]), 400, "body", headers={"Content-Type": "application/json"})
    await expect(json.dumps({"name": "x", "audio_sample": 5}), 400, "audio_sample",
                 headers={"Content-Type": "application/json"})
    await expect(json.dumps({"name": "x", "audio": "/etc/passwd"}), 400, "audio",
                 headers={"Content-Type": "application/json"})
    await expect(form(audio=good), 400, "name")
    await expect(form("bad name!", good), 400, "name")
    await expect(form("nofile"), 400, "audio")  # url-encoded: the file is missing
    await expect(aiohttp.FormData({"name": "nofile"}, default_to_multipart=True), 400, "audio")
    await expect(form("junk", b"RIFF" + b"\0" * 2000), 400, "audio")
    assert "at least" in await expect(form("short", wav_bytes(recording(0.4))), 400, "audio")
    assert "at most" in await expect(form("long", wav_bytes(recording(3.5))), 400, "audio")
    assert "silent" in await expect(form("quiet", wav_bytes(recording(1.5) * 1e-4)), 400, "audio")
    await expect(form("huge", wav_bytes(recording(2.9, rate=48000))), 413, "audio")
    await expect(form("odd", good, colour="blue"), 400, "colour")
    await expect(form("flag", good, xvector_only="maybe"), 400, "xvector_only")
    await expect(form("pad", good, trailing_silence_ms=99999), 400, "trailing_silence_ms")
    assert (await client.post("/v1/audio/voices", data=form("twice", good, transcript="Hi there."))).status == 201
    await expect(form("twice", good), 409, "name")
    r = await client.post("/v1/audio/voices", data=form("twice", good, replace="true", xvector_only="true"))
    assert r.status == 201 and (await r.json())["mode"] == "xvector"
    assert (await client.get("/v1/audio/voices/none")).status == 404


async def test_openai_sdk_voice_creation_json_registration_and_openai_voice_names(make_client, model):
    """OpenAI voice names on a Base model are a 400 that says how to register one, until a voice of that name
    exists; the OpenAI SDK's `voices.create` (multipart `audio_sample`) and a JSON body with base64 register."""
    client = await make_client()
    r = await client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "alloy"})
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == "voice" and "POST /v1/audio/voices" in err["message"]
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused-locally", max_retries=0)
    voice = await sdk.audio.voices.create(name="alloy", consent="cons_local", audio_sample=(
        "alloy.wav", wav_bytes(recording(1.3, pitch=160, seed=8)), "audio/wav"))
    assert (voice.id, voice.object, voice.type) == ("alloy", "audio.voice", "audio_sample") and voice.created_at > 0
    await sdk.close()
    got = await speech(client, "alloy", "Now it exists.", seed=2)
    assert_same_audio(got, offline(model, client.app[VOICES].get("alloy").prompt, "Now it exists.", seed=2))
    b64 = base64.b64encode(wav_bytes(recording(1.2, pitch=130))).decode()
    r = await client.post("/v1/audio/voices", json={"name": "jay", "audio_sample": b64, "xvector_only": True})
    assert r.status == 201 and (await r.json())["mode"] == "xvector"
    aliases = {a["id"]: a for a in (await (await client.get("/v1/audio/voices")).json())["aliases"]}
    assert aliases["alloy"]["available"] is True and aliases["ash"] == {"id": "ash", "voice": "ash",
                                                                          "available": False}


async def test_inline_ref_audio_clones_per_request_and_is_cached_by_content(make_client, model, monkeypatch):
    """The batched Rust server's per-request cloning: `text`, an ISO `language`, base64 `ref_audio` and `ref_text`
    give a whole WAV with x-rtf in the cloned voice; the same reference again is not re-encoded; bad references
    are 400s naming ref_audio, with the registry's checks."""
    client = await make_client(inline_voice_cache=1)
    clones = []
    clone = model.clone_voice
    monkeypatch.setattr(model, "clone_voice", lambda *a: clones.append(1) or clone(*a))
    wav = wav_bytes(recording(1.5, pitch=200, seed=5))
    body = {"text": "Cloned inline.", "language": "en", "ref_audio": base64.b64encode(wav).decode(),
            "ref_text": "Hello, it is me.", "max_frames": 8, "seed": 3}
    first = await client.post("/v1/audio/speech", json=body)
    assert first.status == 200, await first.text()
    assert first.headers["Content-Type"] == "audio/wav" and float(first.headers["x-rtf"]) > 0
    audio, rate = sf.read(io.BytesIO(await first.read()), dtype="int16")
    prompt = clone(wav, "Hello, it is me.", trailing_silence_s=0.5)
    (res,) = model.generate(Request("Cloned inline.", voice=prompt, language="english", seed=3, max_frames=8))
    assert rate == 24000
    assert_same_audio(audio.astype(np.int32), to_int16(res.audio).astype(np.int32))
    again = await client.post("/v1/audio/speech", json=body)
    assert_same_audio(sf.read(io.BytesIO(await again.read()), dtype="int16")[0].astype(np.int32),
                      audio.astype(np.int32))
    assert len(clones) == 1  # the cached voice: no second encoding
    other = {**body, "ref_audio": base64.b64encode(wav_bytes(recording(1.2, pitch=120))).decode()}
    del other["ref_text"]  # x-vector only
    assert (await client.post("/v1/audio/speech", json=other)).status == 200 and len(clones) == 2
    assert len(client.app[voice_routes.INLINE]) == 1  # bounded: the older one was dropped

    async def expect(change: dict, param: str, code: str | None = None):
        r = await client.post("/v1/audio/speech", json={k: v for k, v in {**body, **change}.items() if v is not None})
        err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == param and (code is None or err["code"] == code), err

    await expect({"ref_audio": base64.b64encode(wav_bytes(recording(0.4))).decode()}, "ref_audio")
    await expect({"ref_audio": base64.b64encode(wav_bytes(recording(1.5) * 1e-4)).decode()}, "ref_audio")
    await expect({"ref_audio": "/etc/passwd"}, "ref_audio", "path_not_accepted")
    await expect({"ref_audio": "not base64!"}, "ref_audio")
    await expect({"voice": "alice"}, "ref_audio", "conflict")
    await expect({"ref_audio": None, "ref_text": None}, "voice", "missing_field")  # a Base model has no default
    await expect({"ref_audio": None}, "ref_text", "missing_field")


async def test_voices_from_another_model_or_damaged_files_are_skipped(make_client, tmp_path):
    directory = tmp_path / "shared"
    client = await make_client(voices_dir=directory)
    assert (await client.post("/v1/audio/voices", data=form("keep", wav_bytes(recording(1.2)),
                                                            xvector_only="1"))).status == 201
    data = dict(np.load(directory / "keep.npz"))
    info = json.loads(bytes(data["info"]).decode())
    info.update(name="other", fingerprint="0" * 16)
    data["info"] = np.frombuffer(json.dumps(info).encode(), np.uint8)
    np.savez(directory / "other.npz", **data)
    (directory / "broken.npz").write_bytes(b"not a zip")
    await client.close()
    again = await make_client(voices_dir=directory)
    assert again.app[VOICES].names() == ["keep"]
    assert (directory / "other.npz").exists() and (directory / "broken.npz").exists()  # kept, not deleted


async def test_custom_voice_server_refuses_registration(aiohttp_client, tmp_path, tiny_model):
    engine = Engine(tiny_model, SMALL)  # its start-up request compiles (warmup=False): SMALL's programs are cached
    client = await aiohttp_client(create_app(Settings(voices_dir=str(tmp_path / "v"), warmup=False), engine=engine))
    r = await client.post("/v1/audio/voices", data=form("x", wav_bytes(recording(1.2))))
    body = await r.json()
    assert r.status == 400 and body["error"]["param"] == "model" and "Base" in body["error"]["message"]


async def test_encoders_are_compiled_in_the_background_after_ready(make_client, engine):
    jax.clear_caches()  # nothing an earlier test compiled: the warm-up must compile both encoders itself
    with compiles() as warm_up:
        client = await make_client(warm_voice_encoders=True, voice_max_seconds=2.5, voice_trailing_silence_ms=300)
        (warming,) = client.app[VOICE_WARMUP]
        await warming
    assert len(set(compiled_programs(warm_up))) >= 2  # the speaker encoder and the codec's encoder
    with compiles() as registering:
        for name, seconds in (("a", 1.1), ("b", 2.5)):
            r = await client.post("/v1/audio/voices", data=form(name, wav_bytes(recording(seconds)), transcript="Hi."))
            assert r.status == 201
    assert compiled_programs(registering) == []
    # a restart prepares the stored ICL voices' codec state in the same background pass
    await client.close()
    engine.runner.primed_voices.clear()  # the apps' engine (their core runs it on a thread here)
    again = await make_client(warm_voice_encoders=True, voice_max_seconds=2.5, voice_trailing_silence_ms=300)
    await again.app[VOICE_WARMUP][0]
    assert len(engine.runner.primed_voices) == 2


async def test_vllm_omni_clone_from_a_data_url_over_rest_and_its_websocket(make_client, model):
    """vLLM-Omni's Base request: task_type Base, ref_audio as a base64 data URL, x_vector_only_mode (the
    embedding alone, ref_text ignored), max_new_tokens; the same voice from its WebSocket's sticky session.config.
    Both give the audio the model gives offline for the x-vector-only clone."""
    client = await make_client()
    wav = wav_bytes(recording(1.5, pitch=200, seed=5))
    url = "data:audio/wav;base64," + base64.b64encode(wav).decode()
    body = {"input": "Cloned by vLLM-Omni.", "task_type": "Base", "ref_audio": url, "ref_text": "Ignored words.",
            "x_vector_only_mode": True, "max_new_tokens": 7, "seed": 3, "response_format": "pcm"}
    r = await client.post("/v1/audio/speech", json=body)
    assert r.status == 200, await r.text()
    got = pcm(await r.read())
    prompt = model.clone_voice(wav, None, trailing_silence_s=0.5)
    assert_same_audio(got, offline(model, prompt, "Cloned by vLLM-Omni.", seed=3, max_frames=6))
    for change, param in (({"x_vector_only_mode": False, "ref_text": None}, "ref_text"),
                          ({"task_type": "CustomVoice"}, "task_type")):
        r = await client.post("/v1/audio/speech", json={k: v for k, v in {**body, **change}.items() if v is not None})
        assert r.status == 400 and (await r.json())["error"]["param"] == param
    async with client.ws_connect("/v1/audio/speech/stream") as ws:
        await ws.send_json({"type": "session.config", **{k: v for k, v in body.items() if k != "input"}})
        await ws.send_json({"type": "input.text", "text": "Cloned by vLLM-Omni."})
        await ws.send_json({"type": "input.done"})
        audio, kinds = b"", []
        while "session.done" not in kinds:
            msg = await ws.receive()
            if msg.type == aiohttp.WSMsgType.BINARY:
                audio += msg.data
            else:
                kinds.append(json.loads(msg.data)["type"])
        assert kinds == ["audio.start", "audio.done", "session.done"]
        assert_same_audio(pcm(audio), got)
