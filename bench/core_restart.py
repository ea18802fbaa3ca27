"""A served engine core killed and brought back, from outside: `qtts-jax serve` started (its core in a process of
its own), one streaming request, then the core process killed with SIGKILL mid-stream. Reports what the client of
that stream saw, what /ready said and when, how long the server took to serve again (its new core loads its programs
from the compilation cache the first core wrote), and a request served after. Writes JSON.

    python bench/core_restart.py --model 0.6b --slots 16 --context 512 --out runs/core-restart.json
    python bench/core_restart.py --model tiny-random --slots 2 --context 256 --out runs/core-restart-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import write  # noqa: E402
from studies.server import free_port  # noqa: E402


def ready(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except (urllib.error.URLError, ConnectionError):
        return 0, {}


def speak(url: str, frames: int, on_first=None) -> dict:
    """One streaming PCM request: status, bytes, seconds to first byte and in all, and how it ended."""
    body = json.dumps({"input": "The core may go away while I speak.", "voice": "ryan", "response_format": "pcm",
                       "stream": True, "max_frames": frames}).encode()
    req = urllib.request.Request(url + "/v1/audio/speech", body, {"Content-Type": "application/json"})
    t0, got, first, ended = time.perf_counter(), 0, None, "complete"
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status = r.status
            while chunk := r.read1(65536):
                if first is None:
                    first = time.perf_counter() - t0
                    if on_first is not None:
                        on_first()
                got += len(chunk)
    except urllib.error.HTTPError as e:
        status, ended = e.code, e.read().decode()[:200]
    except Exception as e:  # a cut transfer
        status, ended = 200, f"cut: {type(e).__name__}"
    return {"status": status, "bytes": got, "first_byte_s": first, "total_s": time.perf_counter() - t0,
            "ended": ended}


def cores(pid: int) -> list[int]:
    """The server's engine cores: its spawned children, not multiprocessing's resource tracker."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return [k for k in kids if b"resource_tracker" not in Path(f"/proc/{k}/cmdline").read_bytes()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="0.6b")
    p.add_argument("--slots", default="16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--frames", type=int, default=120, help="frames of the request the kill interrupts")
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--out")
    args = p.parse_args()
    port, cache = free_port(), tempfile.mkdtemp(prefix="qtts-core-restart-")
    url, log = f"http://127.0.0.1:{port}", open(Path(cache) / "server.log", "w")
    t0 = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "qtts_cli", "serve", "--model", args.model, "--port", str(port),
                               "--slots", args.slots, "--context", str(args.context), "--dtype", args.dtype,
                               "--compile-cache", cache], stdout=log, stderr=subprocess.STDOUT)
    result = {"model": args.model, "slots": args.slots}
    try:
        while ready(url)[0] != 200:
            assert server.poll() is None and time.perf_counter() - t0 < args.timeout_s, "the server never got ready"
            time.sleep(0.5)
        result["ready_s"] = round(time.perf_counter() - t0, 1)
        result["before"] = speak(url, 12)
        (core,) = cores(server.pid)
        killed = {}
        statuses = []

        def kill():
            os.kill(core, signal.SIGKILL)
            killed["at"] = time.perf_counter()

        result["killed_stream"] = speak(url, args.frames, on_first=lambda: threading.Timer(0.3, kill).start())
        while True:
            code, body = ready(url)
            if not statuses or statuses[-1][1:] != (code, body.get("status")):
                statuses.append((round(time.perf_counter() - killed["at"], 2), code, body.get("status")))
            if code == 200:
                break
            assert time.perf_counter() - killed["at"] < args.timeout_s, "the core never came back"
            time.sleep(0.1)
        result["ready_again_s"] = round(time.perf_counter() - killed["at"], 1)
        result["ready_after_kill"] = statuses
        result["after"] = speak(url, 12)
        result["core_replaced"] = cores(server.pid) != [core]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        log.close()
    result["server_exit"] = server.returncode
    result["log_tail"] = (Path(cache) / "server.log").read_text().splitlines()[-15:]
    if args.out:
        write(args.out, "an engine core killed mid-stream and replaced (bench/core_restart.py)", result)
    else:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
