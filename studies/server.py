"""A local `qtts-jax serve` subprocess on loopback for studies, CI and `make study`; stopped on exit.

`serialised=True` runs one stream at a time with an unbounded wait queue and no admission limits, like a
lock around a single-stream engine, so one study can compare batching with serialisation.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from studies.load import wait_ready
from studies.progress import bar
from studies.sweep import run_sync


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(model: str = "tiny-random", slots: int | str = 4, context: int = 256, frames_per_step: int = 1,
                 serialised: bool = False, log_path: str | Path | None = None, ready_timeout_s: float = 900.0,
                 extra_args: tuple[str, ...] = ()):
    """Yields the base URL of a ready server on 127.0.0.1, at its full size (nothing left compiling in the
    background); SIGTERM (then kill) on exit. `slots` may be "auto"."""
    port = free_port()
    args = [sys.executable, "-m", "qtts_cli", "serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--slots", str(1 if serialised else slots), "--context", str(context),
            "--frames-per-step", str(frames_per_step), *extra_args]
    if serialised:
        args += ["--max-queue", "100000", "--ttfa-target-ms", "1e9", "--starvation-ms", "1e9"]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "QTTS_DRAIN_TIMEOUT_S": "5"})
    url = f"http://127.0.0.1:{port}"
    try:
        run_sync(_ready_or_died(proc, url, ready_timeout_s))  # also inside Jupyter's running event loop
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if log_path:
            log.close()


async def _ready_or_died(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    ready = asyncio.ensure_future(wait_ready(url, timeout_s, idle=True))
    with bar(None, f"warming up {url}", "s") as progress:  # compiling takes minutes on a CPU
        while not ready.done():
            if proc.poll() is not None:
                ready.cancel()
                raise RuntimeError(f"server exited with code {proc.returncode} before it was ready (see its log)")
            await asyncio.sleep(0.2)
            progress.update(0.2)
    ready.result()
