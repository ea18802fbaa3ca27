"""The clients people already use, unmodified, against a live `tiny-random` server on 127.0.0.1: the official
`openai` SDK (sync, async, progressive streaming, every format, `speed` and `sample_rate`), pipecat's
`OpenAITTSService` with its default voice, a client written to the batched Rust server's README (urllib,
`text`/`language`, `x-rtf`, `/health`), and clients of vLLM-Omni's speech API written to its documented shape
(REST fields with their meaning, its WebSocket protocol on our path, our open-loop generator sending
`non_streaming_mode`). The server checks API keys, and each client sends its speak key the way it does for any
server that wants one (`api_key=`, an Authorization header). tiny-random's audio is noise, so lengths, rates and events are checked here; the
time-stretch's pitch and duration on real waveforms are test_audio_out's.

One small engine and one server for the module keep it fast. tiny-random's random weights rarely end on their
own, so the SDK calls cap frames through `extra_body`; the framework and Rust-style clients cannot, and run
to the cap the engine derives from their short text.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import urllib.request
import wave

import aiohttp
import av
import numpy as np
import openai
import pytest
import soundfile as sf
from aiohttp import web

from qtts_jax.engine import Engine
from serving.app import ADMISSION, METRICS, Settings, create_app
from studies.load import open_loop
from support import SCRAPE_KEY, SMALL, SPEAK_KEY, assert_same_audio, bearer, pcm, wait_warm

CONFIG = SMALL  # test_hardening's too: its programs come from the compilation cache
FRAME = 1920  # samples per 80 ms frame at 24 kHz
FRAMES = 10
KEY = bearer(SPEAK_KEY)  # what the clients that take headers, not an api_key, send
HF_ID = "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"  # tiny-random is a 1.7B-shaped CustomVoice model


class Live:
    """The app on a loopback port, served from a thread of its own (sync clients block the test's thread)."""

    def __init__(self, engine: Engine, settings: Settings):
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(engine, settings, started), daemon=True)
        self.thread.start()
        assert started.wait(60), "the server did not start"
        wait_warm(self.app, self.loop)
        assert urllib.request.urlopen(self.url + "/ready", timeout=5).status == 200, "the server never became ready"

    def _serve(self, engine, settings, started) -> None:
        asyncio.set_event_loop(self.loop)
        self.app = create_app(settings, engine=engine)
        self.runner = web.AppRunner(self.app, handler_cancellation=True)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        started.set()
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server(tiny_model, keys_file):
    engine = Engine(tiny_model, CONFIG)
    engine.warmup()
    live = Live(engine, Settings(slots=CONFIG.slots, context=CONFIG.context, ttfa_target_ms=5000, warmup=False,
                                 api_key="@" + keys_file))
    yield live
    live.close()


def sdk(server, cls=openai.OpenAI):
    return cls(base_url=server.url + "/v1", api_key=SPEAK_KEY, max_retries=0)


def decode(fmt: str, data: bytes) -> tuple[np.ndarray, int]:
    """Samples and rate as a player would get them: libsndfile for WAV and FLAC, FFmpeg for the rest."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2"), 24000
    if fmt in ("wav", "flac"):
        audio, rate = sf.read(io.BytesIO(data), dtype="int16")
        return audio, rate
    container = av.open(io.BytesIO(data))
    frames = list(container.decode(audio=0))
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]), frames[0].sample_rate


def test_openai_sdk_sync_every_format_decodes_to_the_right_length_and_rate(server):
    """Each format through `client.audio.speech.create`, OpenAI's default voice: lossless ones are the same
    samples as `pcm`; lossy ones decode at their rate to the asked-for length (within codec padding)."""
    client = sdk(server)
    ref = None
    for fmt in ("pcm", "wav", "flac", "mp3", "opus", "aac"):
        r = client.audio.speech.create(model="tts-1", voice="alloy", input="Every format.", response_format=fmt,
                                       extra_body={"max_frames": FRAMES, "seed": 4})
        audio, rate = decode(fmt, r.content)
        if fmt in ("pcm", "wav", "flac"):
            assert rate == 24000
            ref = audio if ref is None else ref
            assert len(audio) == FRAMES * FRAME and np.array_equal(audio, ref), fmt
        else:
            assert rate == (48000 if fmt == "opus" else 24000), fmt
            assert abs(len(audio) / rate - FRAMES * 0.08) < 0.1, (fmt, len(audio) / rate)
        assert r.response.headers["content-type"].startswith("audio/")


def test_openai_sdk_streams_progressively_by_default(server):
    """`with_streaming_response` gets chunked audio while the request is still generating, for every format
    that streams; `"stream": false` is one file with Content-Length and the Rust server's x-rtf."""
    client = sdk(server)
    for fmt in ("pcm", "wav", "mp3", "opus", "aac"):
        with client.audio.speech.with_streaming_response.create(
                model="gpt-4o-mini-tts", voice="ash", input="Progressively.", response_format=fmt,
                extra_body={"max_frames": 24}) as r:
            assert r.headers["transfer-encoding"] == "chunked" and "content-length" not in r.headers
            chunks = r.iter_bytes()
            first = next(chunks)
            open_streams = len(server.app[ADMISSION].streams)  # the request is still generating
            rest = b"".join(chunks)
        assert first and open_streams == 1, (fmt, open_streams)
        audio, rate = decode(fmt, first + rest)
        assert abs(len(audio) / rate - 24 * 0.08) < 0.1, fmt
    r = client.audio.speech.create(model="tts-1", voice="ash", input="Whole.", response_format="wav",
                                   extra_body={"max_frames": FRAMES, "stream": False})
    assert int(r.response.headers["content-length"]) == len(r.content) and float(r.response.headers["x-rtf"]) > 0
    with wave.open(io.BytesIO(r.content)) as w:
        assert w.getnframes() == FRAMES * FRAME  # exact sizes in a whole file


def test_streamed_flac_is_read_by_libsndfile(server):
    """A FLAC asked for as a stream states its frame cap and is padded to it: soundfile reads it whole."""
    client = sdk(server)
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="nova", input="Flac.", response_format="flac",
            extra_body={"max_frames": FRAMES, "stream": True, "seed": 2}) as r:
        assert r.headers["transfer-encoding"] == "chunked"
        data = r.read()
    audio, rate = sf.read(io.BytesIO(data), dtype="int16")
    pcm = client.audio.speech.create(model="tts-1", voice="nova", input="Flac.", response_format="pcm",
                                     extra_body={"max_frames": FRAMES, "seed": 2}).content
    assert rate == 24000 and np.array_equal(audio, np.frombuffer(pcm, "<i2"))


def test_openai_sdk_async_models_and_voices(server):
    """The async client; `models.retrieve`; OpenAI voice names listed as aliases; an unknown voice is a 400."""
    async def go():
        client = sdk(server, openai.AsyncOpenAI)
        async with client.audio.speech.with_streaming_response.create(
                model="tts-1-hd", voice="shimmer", input="Async.", response_format="pcm",
                extra_body={"max_frames": FRAMES}) as r:
            data = b"".join([c async for c in r.iter_bytes()])
        assert len(data) == FRAMES * FRAME * 2
        assert (await client.models.retrieve("tts-1")).id == "tts-1"
        assert (await client.models.retrieve("tiny-random")).id == "tiny-random"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("gpt-5")
        with pytest.raises(openai.BadRequestError, match="voice"):
            await client.audio.speech.create(model="tts-1", voice="nobody", input="x")
        await client.close()

    asyncio.run(go())
    listed = json.loads(urllib.request.urlopen(urllib.request.Request(server.url + "/v1/audio/voices",
                                                                      headers=KEY)).read())
    aliases = {a["id"]: a["voice"] for a in listed["aliases"]}
    assert {"alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse"} <= set(aliases)
    assert set(aliases.values()) <= {v["id"] for v in listed["voices"]}


def test_pipecat_openai_tts_service_with_its_default_voice(server):
    """pipecat's OpenAITTSService as shipped (voice alloy, gpt-4o-mini-tts, streamed pcm) in a real pipeline:
    audio frames at 24 kHz come out, and no error frame goes either way."""
    from pipecat.frames.frames import EndFrame, ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.runner import PipelineRunner
    from pipecat.pipeline.task import PipelineParams, PipelineTask
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.services.openai.tts import OpenAITTSService

    class Tap(FrameProcessor):
        """Keeps every frame that passes, either way."""

        def __init__(self):
            super().__init__()
            self.frames = []

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            self.frames.append(frame)
            await self.push_frame(frame, direction)

    async def go():
        before, after = Tap(), Tap()
        tts = OpenAITTSService(api_key=SPEAK_KEY, base_url=server.url + "/v1")
        task = PipelineTask(Pipeline([before, tts, after]), params=PipelineParams(audio_out_sample_rate=24000))
        await task.queue_frames([TTSSpeakFrame("Hi."), EndFrame()])
        await PipelineRunner(handle_sigint=False).run(task)
        return before.frames + after.frames

    frames = asyncio.run(go())
    assert not [f.error for f in frames if isinstance(f, ErrorFrame)]
    audio = [f for f in frames if isinstance(f, TTSAudioRawFrame)]
    assert audio and {(f.sample_rate, f.num_channels) for f in audio} == {(24000, 1)}
    assert sum(len(f.audio) for f in audio) % (FRAME * 2) == 0  # whole 80 ms frames of s16le


def test_client_written_to_the_rust_servers_readme(server):
    """What the batched Rust server's README and usage guide show: `text` + `language` (names and ISO codes),
    a whole WAV with x-rtf by default, a streamed WAV (44-byte header, then PCM) with `stream: true`, and
    `/health` with queue_depth and max_batch."""
    def post(body: dict):
        req = urllib.request.Request(server.url + "/v1/audio/speech", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **KEY})
        return urllib.request.urlopen(req, timeout=120)

    health = json.loads(urllib.request.urlopen(server.url + "/health").read())
    assert health["status"] == "ok" and health["queue_depth"] == 0 and health["max_batch"] == CONFIG.slots
    resp = post({"text": "Hello world", "language": "english"})
    assert resp.headers["Content-Type"] == "audio/wav" and float(resp.headers["x-rtf"]) > 0
    assert float(resp.headers["x-ttfa-ms"]) > 0
    with wave.open(io.BytesIO(resp.read())) as w:
        assert (w.getframerate(), w.getsampwidth(), w.getnchannels()) == (24000, 2, 1) and w.getnframes() > 0
    for language in ("es", "fr"):
        resp = post({"text": "Buenos días", "language": language, "stream": True, "temperature": 0.7})
        assert resp.headers["x-audio-format"] == "pcm-s16le-24000-mono"
        header, pcm = resp.read(44), resp.read()
        assert header[:4] == b"RIFF" and header[8:12] == b"WAVE" and len(pcm) > 0 and len(pcm) % 2 == 0
    with pytest.raises(urllib.error.HTTPError) as err:
        post({"text": "Hello", "language": "xx"})
    assert err.value.code == 400 and json.loads(err.value.read())["error"]["param"] == "language"


def test_metrics_end_to_end_sizes_model_label_build_info_and_unrouted(server):
    """After the clients above (or on its own): per-request histograms labelled by model, the build info,
    and a 404 counted apart rather than as an `unknown` endpoint."""
    sdk(server).audio.speech.create(model="tts-1", voice="alloy", input="Measured.", response_format="pcm",
                                    extra_body={"max_frames": 4})
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(urllib.request.Request(server.url + "/v1/no/such/path", headers=KEY))
    text = urllib.request.urlopen(urllib.request.Request(server.url + "/metrics", headers=bearer(SCRAPE_KEY))).read()
    text = text.decode()
    registry = server.app[METRICS].registry
    labels = {"model": "tiny-random", "endpoint": "/v1/audio/speech"}
    assert registry.get_sample_value("qtts_request_duration_seconds_count", labels) >= 1
    assert registry.get_sample_value("qtts_request_input_chars_sum", {"model": "tiny-random"}) >= len("Measured.")
    assert registry.get_sample_value("qtts_request_audio_seconds_sum", {"model": "tiny-random"}) >= 4 * 0.08
    assert registry.get_sample_value("qtts_unrouted_requests_total", {"status": "404"}) >= 1
    assert 'endpoint="unknown"' not in text
    info = [line for line in text.splitlines() if line.startswith("qtts_build_info{")]
    assert len(info) == 1 and 'model="tiny-random"' in info[0] and 'slots="2"' in info[0]


def test_voice_aliases_default_override_file_env_and_bad_targets(server, tmp_path, monkeypatch):
    """The alias table: OpenAI's names on the default, overrides merged over it (flag/env text or a JSON file),
    `none` for no aliases, and a target the model lacks refused when the app is made (start-up exits 2)."""
    from serving.app import ALIASES, ENGINE
    from serving.voice import aliases

    engine = server.app[ENGINE]
    speakers = engine.model.cfg.speakers
    default = aliases.table("", "custom_voice", speakers)
    assert set(default) == set(aliases.OPENAI_VOICES) and default["ash"] == "ryan"
    (tmp_path / "a.json").write_text(json.dumps({"alloy": "Eric", "house": "vivian"}))
    monkeypatch.setenv("QTTS_VOICE_ALIASES", str(tmp_path / "a.json"))
    app = create_app(Settings.from_env(warmup=False), engine=engine)
    assert app[ALIASES] == {**default, "alloy": "eric", "house": "vivian"}
    app = create_app(Settings(voice_aliases="nova=ryan, ash=aiden", warmup=False), engine=engine)
    assert (app[ALIASES]["nova"], app[ALIASES]["ash"], app[ALIASES]["echo"]) == ("ryan", "aiden", "eric")
    assert create_app(Settings(voice_aliases="none", warmup=False), engine=engine)[ALIASES] == {}
    for spec, message in (("alloy=nobody", "name no speaker"), ("alloy", "cannot read"), ("=ryan", "lowercase")):
        with pytest.raises(ValueError, match=message):
            create_app(Settings(voice_aliases=spec, warmup=False), engine=engine)
    assert aliases.table("", "base", ()) == {v: v for v in aliases.OPENAI_VOICES}


def post(server, body: dict):
    req = urllib.request.Request(server.url + "/v1/audio/speech", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **KEY})
    return urllib.request.urlopen(req, timeout=120)


def refused(server, body: dict) -> dict:
    with pytest.raises(urllib.error.HTTPError) as err:
        post(server, body)
    assert err.value.code == 400
    return json.loads(err.value.read())["error"]


def test_vllm_omni_rest_fields_are_honoured(server):
    """The documented body: HF model id, task_type, language, max_new_tokens (frames + end token),
    sample_rate 8000, non_streaming_mode; a whole WAV by default with the usage headers; `stream: true` is SSE
    (speech.audio.* events), `stream_format: audio` raw bytes."""
    body = {"model": HF_ID, "input": "Hello, how are you?", "voice": "vivian", "language": "English",
            "task_type": "CustomVoice", "max_new_tokens": 11, "non_streaming_mode": True, "sample_rate": 8000,
            "initial_codec_chunk_frames": 1, "seed": 3}
    r = post(server, body)
    assert r.headers["Content-Type"] == "audio/wav" and "chunked" not in r.headers.get("Transfer-Encoding", "")
    audio, rate = sf.read(io.BytesIO(r.read()), dtype="int16")
    assert rate == 8000 and len(audio) == 10 * FRAME // 3  # 10 frames of 80 ms at 8 kHz
    assert r.headers["x-vllm-omni-output-tokens"] == "10"
    r = post(server, {**body, "response_format": "pcm", "stream": True})
    assert r.headers["Content-Type"] == "text/event-stream"
    events = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"} and events[-1]["type"] == "speech.audio.done"
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(pcm) == 2 * len(audio) and events[-1]["usage"]["output_tokens"] == 10
    r = post(server, {**body, "response_format": "pcm", "stream_format": "audio"})
    assert r.headers["Transfer-Encoding"] == "chunked" and r.headers["X-Sample-Rate"] == "8000"
    assert r.read() == pcm  # seeded: the same audio however it is sent


def test_non_streaming_mode_changes_the_prompt_layout(server):
    """The field has its meaning: the same seeded greedy request in the two layouts gives other audio, and each
    layout gives the same audio twice."""
    def speak(layout):
        return post(server, {"input": "Layouts differ.", "voice": "ryan", "response_format": "pcm", "greedy": True,
                             "max_new_tokens": 7, "non_streaming_mode": layout}).read()
    a, b = speak(True), speak(False)
    assert a == speak(True) and len(a) == len(b) == 6 * FRAME * 2 and a != b


def test_vllm_omni_refusals_name_the_field(server):
    base = {"input": "hi", "voice": "vivian"}
    err = refused(server, {**base, "task_type": "Base"})
    assert err["param"] == "task_type" and "CustomVoice" in err["message"]
    err = refused(server, {**base, "ref_audio": "https://example.com/reference.wav", "ref_text": "x"})
    assert err["param"] == "ref_audio" and "base64 data URL" in err["message"]
    err = refused(server, {**base, "ref_audio": "file:///etc/passwd"})
    assert err["param"] == "ref_audio" and "never" in err["message"]
    err = refused(server, {**base, "speaker_embedding": [0.1]})  # a field we do not take: the list of those we do
    assert err["param"] == "speaker_embedding" and "non_streaming_mode" in err["message"]
    assert refused(server, {**base, "initial_codec_chunk_frames": 2})["param"] == "initial_codec_chunk_frames"
    assert refused(server, {**base, "max_new_tokens": 5, "max_frames": 4})["param"] == "max_new_tokens"
    assert refused(server, {**base, "sample_rate": 11025})["param"] == "sample_rate"
    assert refused(server, {**base, "response_format": "ulaw", "sample_rate": 16000})["param"] == "sample_rate"
    assert refused(server, {**base, "speed": 5})["param"] == "speed"
    model = urllib.request.urlopen(urllib.request.Request(f"{server.url}/v1/models/{HF_ID}", headers=KEY))
    assert json.loads(model.read())["id"] == HF_ID


async def _events(ws, until: str):
    """Messages up to and including the event `until`: (JSON events, binary payloads)."""
    events, audio = [], []
    async for msg in ws:
        if msg.type == aiohttp.WSMsgType.BINARY:
            audio.append(msg.data)
            continue
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        events.append(json.loads(msg.data))
        if events[-1]["type"] == until:
            return events, audio
    raise AssertionError(f"socket closed before {until}: {events}")


def test_vllm_omni_websocket_client(server):
    """A client written to vLLM-Omni's WebSocket protocol: its first message is session.config and the first
    thing it hears is audio.start (no greeting of ours); two utterances on one socket with the sticky config;
    bad messages are error events and the socket goes on; stream_audio false is one WAV per sentence;
    sentence splitting starts audio before input.done; session.close closes with 1000."""
    async def go():
        async with aiohttp.ClientSession(headers=KEY) as http, http.ws_connect(
                server.url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
            await ws.send_json({"type": "session.config", "model": HF_ID, "voice": "vivian",
                                "response_format": "pcm", "stream_audio": True, "max_new_tokens": 7,
                                "sample_rate": 16000, "speed": 2.0})
            for utterance in (0, 1):
                await ws.send_json({"type": "input.text", "text": "Hello "})
                await ws.send_json({"type": "input.text", "text": "world."})
                await ws.send_json({"type": "input.done"})
                events, audio = await _events(ws, "session.done")
                assert [e["type"] for e in events] == ["audio.start", "audio.done", "session.done"], events
                start, done, end = events
                assert (start["utterance_index"], start["sentence_text"], start["sample_rate"]) == (
                    utterance, "Hello world.", 16000)
                pcm = b"".join(audio)
                assert len(pcm) == done["total_bytes"] == 2 * (6 * FRAME // 2) * 2 // 3  # speed 2, 16 kHz
                assert not done["error"] and end == {"type": "session.done", "utterance_index": utterance,
                                                     "total_sentences": 1}
            for bad, param in (({"type": "dance"}, "type"), ({"type": "session.config", "frobnicate": 1},
                                                               "frobnicate"),
                               ({"type": "session.config", "voice": "nobody"}, "voice"),
                               ({"type": "input.text", "text": 5}, "text")):
                await ws.send_json(bad)
                ev = await ws.receive_json()
                assert ev["type"] == "error" and ev["param"] == param and ev["message"], (bad, ev)
            await ws.send_str("not json")
            assert (await ws.receive_json())["type"] == "error"
            await ws.send_json({"type": "session.config", "voice": "ryan", "max_new_tokens": 5,
                                "split_granularity": "sentence"})
            await ws.send_json({"type": "input.text", "text": "First one. Second"})
            events, audio = await _events(ws, "audio.done")  # the first sentence plays before input.done
            assert events[0]["sentence_text"] == "First one." and audio[0][:4] == b"RIFF"
            assert len(audio) == 1 and sf.read(io.BytesIO(audio[0]))[0].shape == (4 * FRAME,)
            await ws.send_json({"type": "input.text", "text": " one."})
            await ws.send_json({"type": "input.done"})
            events, audio = await _events(ws, "session.done")
            assert [e.get("sentence_index") for e in events] == [1, 1, None] and events[-1]["total_sentences"] == 2
            await ws.send_json({"type": "session.close"})
            assert (await ws.receive()).type == aiohttp.WSMsgType.CLOSE and ws.close_code == 1000

    asyncio.run(go())


def test_our_websocket_takes_rate_speed_and_ulaw(server):
    """Our protocol still greets first, and its session takes the same output choices (8 kHz μ-law here) and
    vLLM-Omni's sentence splitting."""
    async def go():
        async with aiohttp.ClientSession(headers=KEY) as http, http.ws_connect(
                server.url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
            assert (await ws.receive_json())["type"] == "session.created"
            await ws.send_json({"type": "session.update", "session": {"voice": "ryan", "max_frames": 6,
                                                                      "response_format": "ulaw", "speed": 0.5}})
            ev = await ws.receive_json()
            assert (ev["type"], ev["format"], ev["sample_rate"]) == ("session.updated", "g711_ulaw", 8000)
            await ws.send_json({"type": "session.update", "session": {"sample_rate": 24000}})
            assert (await ws.receive_json())["error"]["param"] == "sample_rate"
            await ws.send_json({"type": "input_text.append", "text": "Telephone."})
            await ws.send_json({"type": "input_text.commit"})
            events, audio = await _events(ws, "utterance.done")
            assert len(b"".join(audio)) == 6 * FRAME * 2 // 3 and events[-1]["sample_rate"] == 8000
            # sentence splitting: the complete sentence is queued and spoken before any commit
            await ws.send_json({"type": "session.update", "session": {"split_granularity": "sentence",
                                                                      "max_frames": 3}})
            await _events(ws, "session.updated")
            await ws.send_json({"type": "input_text.append", "text": "First part. Still typing"})
            events, audio = await _events(ws, "utterance.done")
            assert [e["type"] for e in events] == ["utterance.queued", "utterance.started", "utterance.done"]
            assert audio and not events[-1]["cancelled"]
            await ws.send_json({"type": "input_text.commit"})  # the rest
            events, audio = await _events(ws, "utterance.done")
            assert events[0]["utterance_id"] == 3 and audio

    asyncio.run(go())


def test_open_loop_generator_sending_non_streaming_mode_all_succeed(server, monkeypatch):
    """The field's benchmark sends vLLM-Omni's non_streaming_mode with every request: our open-loop generator
    doing so gets every request served, every stream valid (with the key QTTS_API_KEY gives it)."""
    monkeypatch.setenv("QTTS_API_KEY", SPEAK_KEY)
    records = asyncio.run(open_loop(server.url, rate=1.0, requests=4, prompts=["Open loop one.", "And two."],
                                    options={"voice": "ryan", "non_streaming_mode": False, "max_new_tokens": 4,
                                             "stream_format": "audio"}))  # a rate a 2-core CPU carries
    assert [r.status for r in records] == [200] * 4 and all(r.ok for r in records), [r.error or r.invalid
                                                                                     for r in records]


def test_openai_sdk_speed_and_sample_rate(server):
    """The openai SDK's own `speed`, and `sample_rate` through extra_body: the length is the frames' audio
    divided by the speed at the asked rate; `ulaw` is 8 kHz G.711, one byte a sample."""
    client = sdk(server)
    for speed, rate in ((2.0, 16000), (0.5, 48000), (1.0, 22050)):
        r = client.audio.speech.create(model=HF_ID, voice="alloy", input="Speed.", response_format="pcm",
                                       speed=speed, extra_body={"sample_rate": rate, "max_frames": 8})
        assert r.response.headers["x-sample-rate"] == str(rate)
        assert len(r.content) == 2 * round(round(8 * FRAME / speed) * rate / 24000), (speed, rate)
    r = client.audio.speech.create(model="tts-1", voice="alloy", input="Phone.", response_format="ulaw",
                                   extra_body={"max_frames": 8})
    assert r.response.headers["content-type"] == "audio/basic" and len(r.content) == 8 * FRAME // 3
    assert len(set(r.content)) > 10 and np.frombuffer(r.content, np.uint8).std() > 0


LIVE = "Hello there my friend."  # 22 ids on tiny-random's byte-level tokenizer: within SMALL's max_trailing


async def _until_audio(ws):
    """Events up to the first binary message, and that message."""
    events = []
    async for msg in ws:
        if msg.type == aiohttp.WSMsgType.BINARY:
            return events, msg.data
        events.append(json.loads(msg.data))
    raise AssertionError(f"socket closed before audio: {events}")


def test_live_text_on_vllm_omni_websocket_is_one_stream_that_starts_before_input_done(server):
    """split_granularity live: audio of the first words comes before the rest is even sent; the later text joins
    the same sentence (one audio.start / audio.done), and with the same seed and layout the audio is the
    buffered whole text's."""
    async def go():
        async with aiohttp.ClientSession(headers=KEY) as http, http.ws_connect(
                server.url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
            config = {"type": "session.config", "voice": "ryan", "response_format": "pcm", "stream_audio": True,
                      "max_new_tokens": 31, "non_streaming_mode": False, "seed": 1}
            await ws.send_json(config)
            await ws.send_json({"type": "input.text", "text": LIVE})
            await ws.send_json({"type": "input.done"})
            _, whole = await _events(ws, "session.done")
            await ws.send_json({**config, "split_granularity": "live"})
            await ws.send_json({"type": "input.text", "text": "Hello there "})
            events, first = await _until_audio(ws)  # nothing more has been sent
            assert [e["type"] for e in events] == ["audio.start"] and events[0]["sentence_text"] == "Hello there"
            for piece in ("my fri", "end."):
                await ws.send_json({"type": "input.text", "text": piece})
            await ws.send_json({"type": "input.done"})
            events, rest = await _events(ws, "session.done")
            assert [e["type"] for e in events] == ["audio.done", "session.done"] and events[1]["total_sentences"] == 1
            live = b"".join([first, *rest])
            assert events[0]["total_bytes"] == len(live) == 30 * FRAME * 2  # the text's frames, to the cap
            assert_same_audio(pcm(live), pcm(b"".join(whole)))

    asyncio.run(go())


def test_live_text_on_our_websocket_starts_before_commit_and_joins_one_utterance(server):
    """Ours: the first words' audio before the commit, the rest joining the same utterance; cancel stops a live
    utterance and the next text opens another; text beyond the engine's trailing text buffer (SMALL: 32 ids)
    is spoken as the next utterance, none of it lost."""
    async def go():
        async with aiohttp.ClientSession(headers=KEY) as http, http.ws_connect(
                server.url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
            await ws.send_json({"type": "session.update", "session": {"voice": "ryan", "max_frames": 30, "seed": 1,
                                                                      "split_granularity": "live"}})
            await _events(ws, "session.updated")
            await ws.send_json({"type": "input_text.append", "text": "Hello there "})
            events, first = await _until_audio(ws)
            assert [e["type"] for e in events] == ["utterance.queued", "utterance.started"]
            for piece in ("my fri", "end."):
                await ws.send_json({"type": "input_text.append", "text": piece})
            await ws.send_json({"type": "input_text.commit"})
            events, rest = await _events(ws, "utterance.done")
            assert [e["type"] for e in events] == ["utterance.done"] and not events[0]["cancelled"]
            assert events[0]["frames"] == 30 and len(first) + len(b"".join(rest)) == 30 * FRAME * 2
            # cancel: the live utterance stops, the next text opens another
            await ws.send_json({"type": "input_text.append", "text": "Wait for "})
            await _until_audio(ws)
            await ws.send_json({"type": "cancel"})
            events, _ = await _events(ws, "utterance.done")
            assert events[-1]["cancelled"] and events[-1]["utterance_id"] == 2
            # 45 ids: the first utterance takes what fits, the rest is the next one
            await ws.send_json({"type": "session.update", "session": {"max_frames": 2}})
            await _events(ws, "session.updated")
            for word in "One two three four five six seven eight nine ten".split():
                await ws.send_json({"type": "input_text.append", "text": word + " "})
            await ws.send_json({"type": "input_text.commit"})
            events, _ = await _events(ws, "utterance.done")
            events += (await _events(ws, "utterance.done"))[0]
            queued = [e["utterance_id"] for e in events if e["type"] == "utterance.queued"]
            done = [e for e in events if e["type"] == "utterance.done"]
            assert queued == [3, 4] and [d["cancelled"] for d in done] == [False, False], events

    asyncio.run(go())
