"""The clients people already use, unmodified, against a live `tiny-random` server on 127.0.0.1: the official
`openai` SDK (sync, async, progressive streaming, every format), pipecat's `OpenAITTSService` with its default
voice, and a client written to the batched Rust server's README (urllib, `text`/`language`, `x-rtf`, `/health`).

One small engine and one server for the module keep it fast. tiny-random's random weights rarely end on their
own, so the SDK calls cap frames through `extra_body`; the framework and Rust-style clients cannot, and run
to the cap the engine derives from their short text.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
import urllib.request
import wave

import av
import numpy as np
import openai
import pytest
import soundfile as sf
from aiohttp import web

from qtts_jax.engine import Engine
from serving.app import METRICS, SCHEDULER, Settings, create_app
from support import SMALL

CONFIG = SMALL  # test_hardening's too: its programs come from the compilation cache
FRAME = 1920  # samples per 80 ms frame at 24 kHz
FRAMES = 10


class Live:
    """The app on a loopback port, served from a thread of its own (sync clients block the test's thread)."""

    def __init__(self, engine: Engine, settings: Settings):
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(engine, settings, started), daemon=True)
        self.thread.start()
        assert started.wait(60), "the server did not start"
        for _ in range(600):
            try:
                if urllib.request.urlopen(self.url + "/ready", timeout=5).status == 200:
                    return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("the server never became ready")

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
def server(tiny_model):
    engine = Engine(tiny_model, CONFIG)
    engine.warmup()
    live = Live(engine, Settings(slots=CONFIG.slots, context=CONFIG.context, ttfa_target_ms=5000, warmup=False))
    yield live
    live.close()


def sdk(server, cls=openai.OpenAI):
    return cls(base_url=server.url + "/v1", api_key="unused-locally", max_retries=0)


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
            open_streams = len(server.app[SCHEDULER].streams)  # the request is still generating
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
    listed = json.loads(urllib.request.urlopen(server.url + "/v1/audio/voices").read())
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
        tts = OpenAITTSService(api_key="unused-locally", base_url=server.url + "/v1")
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
                                     headers={"Content-Type": "application/json"})
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
        urllib.request.urlopen(server.url + "/v1/no/such/path")
    text = urllib.request.urlopen(server.url + "/metrics").read().decode()
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
    from serving import aliases
    from serving.app import ALIASES, ENGINE

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
