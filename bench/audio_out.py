"""CPU benchmark of what `speed`, `sample_rate` and the G.711 formats cost per stream, and how exact they are.

Each stream is the engine's 80 ms chunks (1,920 samples at 24 kHz) of a 10 s voiced test signal (harmonics of
an F0 gliding 110 -> 220 Hz under a syllable-rate wobble, the shape of speech the WSOLA must keep in pitch)
pushed through `serving.audio.out.StreamOut` one chunk at a time, as a socket or chunked response does.
Per condition: CPU milliseconds per second of model audio (median of --runs; the share of one core one stream
takes is that / 1000), the output length against round(samples / speed) at the asked rate (duration error),
and the F0 of the output against the input's (pitch kept). No accelerator: this work runs on the server's CPU.

Then, per format, the audio seconds a second that one thread and two threads encoding streams at once get through
(`parallel`): an encoder that lets go of the GIL goes about twice as fast on two threads (the server runs those
off its event loop, `serving.audio.out.OFF_LOOP`); one that holds it goes no faster, or slower.

    python bench/audio_out.py --out bench/results/audio-out-cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.audio.out import StreamOut  # noqa: E402

SR = 24000
CHUNK = 1920


def signal(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    f0 = 110 + 110 * t / seconds  # glide
    phase = 2 * np.pi * np.cumsum(f0) / SR
    x = sum(np.sin(h * phase) / h for h in range(1, 10)) * (0.55 + 0.45 * np.sin(2 * np.pi * 4 * t))
    return (0.2 * x).astype(np.float32)


def f0_at(y: np.ndarray, rate: int, centre: float) -> float:
    """F0 by the autocorrelation peak (60-400 Hz) of 100 ms around `centre` (a share of the length)."""
    n = int(0.1 * rate)
    at = int(centre * (len(y) - n))
    seg = y[at:at + n] - y[at:at + n].mean()
    ac = np.correlate(seg, seg, "full")[n - 1:]
    lo, hi = rate // 400, rate // 60
    return rate / (lo + int(np.argmax(ac[lo:hi])))


def run(fmt: str, rate: int, speed: float, x: np.ndarray, runs: int) -> dict:
    times, data = [], b""
    for _ in range(runs):
        out = StreamOut(fmt, rate, speed)
        t0 = time.process_time()
        parts = [out.encode(x[i:i + CHUNK]) for i in range(0, len(x), CHUNK)]
        parts.append(out.finish())
        times.append(time.process_time() - t0)
        data = b"".join(parts)
    row = {"format": fmt, "sample_rate": rate, "speed": speed,
           "cpu_ms_per_audio_s": round(1000 * statistics.median(times) / (len(x) / SR), 3)}
    if fmt in ("pcm", "ulaw", "alaw"):  # raw: the length is in the bytes (a codec's frames pad it)
        samples = len(data) // (2 if fmt == "pcm" else 1)
        expected = round(len(x) / speed) * rate / SR
        row.update(output_s=round(samples / rate, 4), expected_s=round(expected / rate, 4),
                   duration_error_pct=round(100 * (samples - expected) / expected, 4))
    if fmt == "pcm":
        y = np.frombuffer(data, "<i2").astype(np.float32) / 32767
        ratios = [f0_at(y, rate, c) / f0_at(x, SR, c) for c in (0.2, 0.5, 0.8)]
        row["pitch_ratio"] = [round(r, 4) for r in ratios]  # output F0 / input F0 at 20%, 50%, 80% of the clip
    return row


def parallel(fmt: str, x: np.ndarray, threads: int, seconds: float = 2.0) -> float:
    """Audio seconds a second that `threads` threads, each encoding a stream of `x` chunk by chunk, get through."""
    done = [0] * threads

    def work(i: int) -> None:
        out, at, t0 = StreamOut(fmt), 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            out.encode(x[at:at + CHUNK])
            done[i] += CHUNK
            at = (at + CHUNK) % (len(x) - CHUNK)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(done) / SR / seconds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench/results/audio-out-cpu.json"))
    args = ap.parse_args(argv)
    x = signal(args.seconds)
    rows = [run("pcm", 24000, s, x, args.runs) for s in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0)]
    rows += [run("pcm", r, 1.0, x, args.runs) for r in (8000, 16000, 22050, 44100, 48000)]
    rows += [run(f, 8000, s, x, args.runs) for f in ("ulaw", "alaw") for s in (1.0, 1.5)]
    rows += [run("mp3", 24000, s, x, args.runs) for s in (1.0, 2.0)]
    par = []
    for fmt in ("pcm", "wav", "ulaw", "flac", "mp3", "aac", "opus"):
        one, two = parallel(fmt, x, 1), parallel(fmt, x, 2)
        par.append({"format": fmt, "audio_s_per_s_1_thread": round(one, 1), "audio_s_per_s_2_threads": round(two, 1),
                    "speedup": round(two / one, 2)})
    result = {"bench": "audio_out", "what": "CPU cost per stream of speed (WSOLA), resampling and G.711, "
                                           "chunk by chunk; duration error; pitch kept; encoders on 1 and 2 threads",
              "signal": f"{args.seconds:g} s voiced, F0 110->220 Hz, 80 ms chunks", "runs": args.runs,
              "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
              "rows": rows, "parallel": par}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for r in rows + par:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
