"""Float32 PCM chunks (at the output rate: serving/audio/out.py converts the model's 24 kHz) -> bytes of the
response format, incrementally.

Every encoder has `encode(pcm) -> bytes` (whatever is ready now; may be empty) and `finish() -> bytes`.
Streaming encoders hand bytes out as soon as the codec produces them:

- `pcm`: raw signed 16-bit little-endian mono (what OpenAI clients assume for `pcm`).
- `wav`: a RIFF header whose sizes are 0xFFFFFFFF when streaming (length unknown), exact otherwise.
- `ulaw` / `alaw`: G.711, one byte a sample, no header (8 kHz telephony: serving/audio/g711.py).
- `mp3`: lameenc (incremental `encode` + `flush`), mono.
- `opus`: PyAV's Ogg muxer with libopus (8, 12, 16, 24 or 48 kHz only), `page_duration` 20 ms so pages leave progressively.
- `aac`: PyAV's ADTS muxer with FFmpeg's AAC encoder: every frame carries its own header, so it streams.
- `flac`: PyAV's FLAC muxer. A whole file has exact STREAMINFO totals. A stream cannot know its length, and
  libsndfile takes a total of 0 ("unknown") as 2^63-1 frames and fails on a file shorter than its header says,
  so a streamed FLAC states the request's frame cap and is padded with silence to it (`FlacStreamEncoder`).

Float -> int16 is `round(clip(x, -1, 1) * 32767)`, the same rule a client uses to compare with offline audio.
"""

from __future__ import annotations

import io
import struct

import numpy as np

from qtts_jax.io.audio import to_int16
from qtts_jax.codec.config import SAMPLE_RATE, SAMPLES_PER_FRAME
from serving.audio import g711

FORMATS = ("mp3", "opus", "aac", "wav", "pcm", "flac", "ulaw", "alaw")
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)  # the rates libopus encodes at
# streamed unless the request says "stream": false; FLAC is a whole file unless it says "stream": true, since a
# streamed FLAC must state a length up front (the frame cap, padded with silence) and a whole one is exact
STREAM_BY_DEFAULT = frozenset(FORMATS) - {"flac"}
CONTENT_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "ulaw": "audio/basic",  # RFC 2046: 8 kHz μ-law mono, no header
    "alaw": "audio/x-alaw-basic",
}
SAMPLE_FORMATS = {"pcm": "s16le", "wav": "s16le", "ulaw": "mulaw", "alaw": "alaw"}  # X-Sample-Format of raw ones


def wav_header(sample_rate: int = SAMPLE_RATE, data_bytes: int | None = None) -> bytes:
    """44-byte PCM16 mono header; `data_bytes=None` marks an open-ended (streaming) file."""
    data = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI", b"RIFF", riff, b"WAVE", b"fmt ", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16,
        b"data", data,
    )


class Encoder:
    def encode(self, pcm: np.ndarray) -> bytes:
        raise NotImplementedError

    def finish(self) -> bytes:
        return b""


class PcmEncoder(Encoder):
    def encode(self, pcm):
        return to_int16(pcm).tobytes()


class G711Encoder(Encoder):
    def __init__(self, law: str):
        self._law = law

    def encode(self, pcm):
        return g711.encode(self._law, to_int16(pcm))


class WavStreamEncoder(Encoder):
    """Header first (open-ended sizes), then PCM16 as it comes."""

    def __init__(self, sample_rate: int = SAMPLE_RATE):
        self._header = wav_header(sample_rate)

    def encode(self, pcm):
        out, self._header = self._header + to_int16(pcm).tobytes(), b""
        return out

    def finish(self):
        out, self._header = self._header, b""
        return out


class Mp3Encoder(Encoder):
    def __init__(self, sample_rate: int = SAMPLE_RATE, bitrate_kbps: int = 64):
        import lameenc

        self._enc = lameenc.Encoder()
        self._enc.set_bit_rate(bitrate_kbps)
        self._enc.set_in_sample_rate(sample_rate)
        self._enc.set_channels(1)
        self._enc.set_quality(5)

    def encode(self, pcm):
        data = to_int16(pcm).tobytes()
        return bytes(self._enc.encode(data)) if data else b""

    def finish(self):
        return bytes(self._enc.flush())


class _Sink:
    """A write-only file object that PyAV muxes into; `take()` returns what arrived since last time."""

    def __init__(self):
        self._parts: list[bytes] = []

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self._parts = b"".join(self._parts), []
        return out


class AvEncoder(Encoder):
    """PyAV (bundled FFmpeg) muxer + encoder; `streaming` writes to a non-seekable sink."""

    def __init__(self, container: str, codec: str, sample_rate: int = SAMPLE_RATE, streaming: bool = True,
                 options: dict | None = None, bit_rate: int | None = None):
        import av

        self._av = av
        self._sink = _Sink() if streaming else io.BytesIO()
        self._out = av.open(self._sink, mode="w", format=container, options=options or {})
        self._stream = self._out.add_stream(codec, rate=sample_rate, layout="mono")
        if bit_rate:
            self._stream.bit_rate = bit_rate
        self._rate = sample_rate
        self._pts = 0
        self._streaming = streaming

    def _take(self) -> bytes:
        return self._sink.take() if self._streaming else b""

    def encode(self, pcm):
        s16 = to_int16(pcm)
        if len(s16) == 0:
            return b""
        frame = self._av.AudioFrame.from_ndarray(s16[None, :], format="s16", layout="mono")
        frame.sample_rate = self._rate
        frame.pts = self._pts
        self._pts += len(s16)
        for packet in self._stream.encode(frame):
            self._out.mux(packet)
        return self._take()

    def finish(self):
        for packet in self._stream.encode(None):
            self._out.mux(packet)
        self._out.close()
        return self._take() if self._streaming else self._sink.getvalue()


class FlacStreamEncoder(Encoder):
    """Streamed FLAC whose STREAMINFO states `total_samples` (the request's cap): the audio is padded with
    silence to that length at `finish`, so the file is exactly what its header says and libsndfile reads it."""

    def __init__(self, total_samples: int, sample_rate: int = SAMPLE_RATE):
        self._enc = AvEncoder("flac", "flac", sample_rate, streaming=True)
        self._total = total_samples
        self._sent = 0
        self._header_pending = True

    def encode(self, pcm):
        pcm = np.asarray(pcm, np.float32)[: max(self._total - self._sent, 0)]
        self._sent += len(pcm)
        return self._patch(self._enc.encode(pcm))

    def finish(self):
        tail = self._enc.encode(np.zeros(max(self._total - self._sent, 0), np.float32))
        return self._patch(tail + self._enc.finish())

    def _patch(self, data: bytes) -> bytes:
        """Write the total into the first STREAMINFO (36 bits from bit 108 of the block's 34 bytes)."""
        if not self._header_pending or len(data) < 4 + 4 + 18:
            return data
        assert data[:4] == b"fLaC" and data[4] & 0x7F == 0, "FLAC must start with STREAMINFO"
        self._header_pending = False
        out = bytearray(data)
        at = 8 + 10  # "fLaC" + block header + min/max block and frame sizes
        word = int.from_bytes(out[at:at + 8], "big")
        word = (word & ~((1 << 36) - 1)) | self._total
        out[at:at + 8] = word.to_bytes(8, "big")
        return bytes(out)


def make_encoder(fmt: str, streaming: bool, sample_rate: int = SAMPLE_RATE, total_samples: int | None = None
                 ) -> Encoder:
    """`total_samples` (streamed FLAC only): the length its header states, the audio padded to it."""
    if fmt == "pcm":
        return PcmEncoder()
    if fmt == "wav":
        return WavStreamEncoder(sample_rate)
    if fmt in g711.TABLES:
        return G711Encoder(fmt)
    if fmt == "mp3":
        return Mp3Encoder(sample_rate)
    if fmt == "opus":
        return AvEncoder("ogg", "libopus", sample_rate, streaming, options={"page_duration": "20000"},
                         bit_rate=32000)
    if fmt == "aac":
        return AvEncoder("adts", "aac", sample_rate, streaming, bit_rate=64000)
    if fmt == "flac":
        if streaming and total_samples is not None:
            return FlacStreamEncoder(total_samples, sample_rate)
        return AvEncoder("flac", "flac", sample_rate, streaming)
    raise ValueError(f"unknown format {fmt!r}")


def encode_whole(fmt: str, pcm: np.ndarray, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A complete file (exact WAV sizes, finalized FLAC header)."""
    if fmt == "wav":
        data = to_int16(pcm).tobytes()
        return wav_header(sample_rate, len(data)) + data
    enc = make_encoder(fmt, streaming=False, sample_rate=sample_rate)
    out = enc.encode(pcm)
    return out + enc.finish()
