"""The output audio path without a server: G.711 against the ITU reference rules (Python's `audioop`), the
streaming resampler against the whole-file one, the WSOLA time-stretch's length, pitch and continuity chunk by
chunk, and every format at every rate through `StreamOut`."""

from __future__ import annotations

import asyncio
import io
import threading
import warnings

import numpy as np
import pytest
import soundfile as sf
import soxr

from serving.audio import g711
from serving.audio.out import StreamOut, awhole, output_rate, whole
from serving.audio.resample import RATES, StreamResampler
from serving.audio.timestretch import TimeStretch
from serving.errors import ApiError

SR = 24000


def voiced(seconds: float, f0: float = 180.0) -> np.ndarray:
    """A vowel-like test signal: harmonics of f0 under a slow amplitude wobble."""
    t = np.arange(int(seconds * SR)) / SR
    x = sum(np.sin(2 * np.pi * f0 * h * t) / h for h in range(1, 8)) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    return (0.2 * x).astype(np.float32)


def pitch(y: np.ndarray) -> float:
    """F0 by the autocorrelation peak between 60 and 400 Hz, on 200 ms from the middle."""
    y = y[len(y) // 2: len(y) // 2 + 4800]
    ac = np.correlate(y, y, "full")[len(y) - 1:]
    lo, hi = SR // 400, SR // 60
    return SR / (lo + np.argmax(ac[lo:hi]))


def chunked(process, finish, x: np.ndarray, size: int = 1920) -> np.ndarray:
    return np.concatenate([process(x[i:i + size]) for i in range(0, len(x), size)] + [finish()])


def test_g711_matches_the_reference_encoder_on_every_sample():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")  # gone in Python 3.13; the tables are checked where it exists
    x = np.arange(-32768, 32768, dtype=np.int16)
    assert g711.encode("ulaw", x) == audioop.lin2ulaw(x.tobytes(), 2)
    assert g711.encode("alaw", x) == audioop.lin2alaw(x.tobytes(), 2)


def test_streaming_resampler_equals_the_whole_file_and_keeps_the_length():
    x = voiced(1.0)
    for rate in RATES:
        r = StreamResampler(SR, rate)
        got = chunked(r.process, r.finish, x)
        assert len(got) == round(len(x) * rate / SR), rate
        if rate != SR:
            np.testing.assert_allclose(got, soxr.resample(x, SR, rate, quality="HQ"), atol=1e-4)
        else:
            assert np.array_equal(got, x)


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
def test_time_stretch_keeps_pitch_and_gives_the_exact_length_chunk_by_chunk(speed):
    x = voiced(2.0)
    ts = TimeStretch(speed)
    y = chunked(ts.process, ts.finish, x)
    assert len(y) == round(len(x) / speed)
    assert abs(pitch(y) / pitch(x) - 1) < 0.02, (pitch(x), pitch(y))
    # no clicks: no step between samples larger than the input's own (frames line up by cross-correlation)
    assert np.abs(np.diff(y[: -SR // 10])).max() <= 1.1 * np.abs(np.diff(x)).max()
    # odd chunk sizes give the same audio: the algorithm does not see chunk edges
    ts = TimeStretch(speed)
    assert np.allclose(chunked(ts.process, ts.finish, x, size=777), y, atol=1e-6)


def test_time_stretch_at_speed_one_is_the_input_and_bad_speeds_are_refused():
    x = voiced(0.3)
    ts = TimeStretch(1.0)
    assert np.array_equal(chunked(ts.process, ts.finish, x), x)
    for bad in (0.2, 4.5):
        with pytest.raises(ValueError):
            TimeStretch(bad)


def test_every_format_at_every_rate_streams_or_is_refused_naming_sample_rate():
    x = voiced(0.5)
    for fmt in ("pcm", "wav", "flac", "mp3", "opus", "aac", "ulaw", "alaw"):
        for rate in RATES:
            try:
                r = output_rate(fmt, rate)
            except ApiError as err:
                assert err.field == "sample_rate" and (fmt in ("ulaw", "alaw") or rate in (22050, 44100)), (fmt, rate)
                continue
            out = StreamOut(fmt, r, 1.0, max_model_samples=len(x))
            data = b"".join(out.encode(x[i:i + 1920]) for i in range(0, len(x), 1920)) + out.finish()
            if fmt in ("wav", "flac"):
                audio, got = sf.read(io.BytesIO(data))
                assert got == rate and len(audio) == round(len(x) * rate / SR), (fmt, rate)
                np.testing.assert_allclose(audio, sf.read(io.BytesIO(whole(fmt, x, rate)))[0], atol=1e-4)
            elif fmt in ("pcm", "ulaw", "alaw"):
                assert len(data) == round(len(x) * r / SR) * (2 if fmt == "pcm" else 1), (fmt, rate)
            else:
                assert len(data) > 100, (fmt, rate)
    assert output_rate("ulaw", None) == 8000 and output_rate("mp3", None) == SR


@pytest.mark.parametrize("fmt, off_loop", [("mp3", True), ("opus", True), ("aac", True), ("pcm", False),
                                           ("flac", False)])
def test_compressed_formats_are_encoded_off_the_event_loop_in_order_and_the_same(fmt, off_loop):
    """From a coroutine, MP3, Opus and AAC are encoded on the encoding threads (their encoders let go of the GIL, and
    on the event loop a few hundred streams of them would hold up every chunk), each stream's calls one after
    another, into exactly the bytes inline encoding makes; the cheap formats stay on the loop. A whole file too."""
    x = voiced(1.0)
    pieces = [x[i:i + 1920] for i in range(0, len(x), 1920)]
    inline = StreamOut(fmt)
    expected = b"".join(inline.encode(p) for p in pieces) + inline.finish()

    async def main():
        out, threads = StreamOut(fmt), []
        encode = out.encode

        def spy(pcm):
            threads.append(threading.get_ident())
            return encode(pcm)

        out.encode = spy
        got = b"".join([await out.aencode(p) for p in pieces]) + await out.afinish()
        return got, threads, threading.get_ident(), await awhole(fmt, x)

    got, threads, loop_thread, file = asyncio.run(main())
    assert same_stream(got, expected)
    assert len(threads) == len(pieces) and (loop_thread not in threads) == off_loop
    assert same_stream(file, whole(fmt, x))


def same_stream(a: bytes, b: bytes) -> bool:
    """Equal bytes, but for what an Ogg stream draws at random: each page's serial number and the checksum over it."""
    if not a.startswith(b"OggS"):
        return a == b
    a, b = bytearray(a), bytearray(b)
    for page in (i for i in range(len(a)) if a.startswith(b"OggS", i)):
        a[page + 14:page + 18] = b[page + 14:page + 18] = b"\0" * 4
        a[page + 22:page + 26] = b[page + 22:page + 26] = b"\0" * 4
    return a == b
