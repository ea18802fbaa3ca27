"""A local `qtts-jax serve` subprocess on loopback for studies, CI and `make study`; stopped on exit.

`serialised=True` runs one stream at a time with an unbounded wait queue and no admission limits, like a
lock around a single-stream engine, so one study can compare batching with serialisation. The subprocess is this
module's `main`: `serve`'s flags, and beside them the engine's and admission's library configuration a study or a
benchmark varies (`--engine`, `--admission`, `--no-warmup`), which `serve` fixes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
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
                 extra_args: tuple[str, ...] = (), engine: dict | None = None, admission: dict | None = None,
                 port: int | None = None):
    """Yields the base URL of a ready server on 127.0.0.1, at its full size (nothing left compiling in the
    background); SIGTERM (then kill) on exit. `slots` may be "auto"; `extra_args` are `serve` flags, `engine` and
    `admission` fields of EngineConfig and AdmissionConfig over their defaults; `port` a free one by default (a
    client that must reach the server before it is ready takes one from `free_port` first)."""
    port = port or free_port()
    engine = {"frames_per_step": frames_per_step, **(engine or {})}
    admission = {**({"max_queue": 100000, "starvation_s": 1e9} if serialised else {}), **(admission or {})}
    args = server_command("--model", model, "--host", "127.0.0.1", "--port", str(port),
                          "--slots", str(1 if serialised else slots), "--context", str(context), *extra_args,
                          engine=engine, admission=admission)
    if serialised:
        args += ["--ttfa-target-ms", "1e9"]
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


def server_command(*flags: str, engine: dict | None = None, admission: dict | None = None,
                   warmup: bool = True) -> list[str]:
    """The command line of a server subprocess: the library configuration `main` takes, then `flags` (`serve`'s, or
    more `--engine`/`--admission` fields, which win)."""
    return [sys.executable, "-m", "studies.server", "--engine", json.dumps(engine or {}),
            "--admission", json.dumps(admission or {}), *(() if warmup else ("--no-warmup",)), *flags]


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


def main(argv: list[str] | None = None) -> int:
    """`qtts-jax serve` with the library configuration a study, benchmark or test varies beside its settings."""
    from serving.app import run
    from serving.cli import add_server_flags, settings_from_args

    p = argparse.ArgumentParser(prog="python -m studies.server", description=main.__doc__)
    add_server_flags(p)
    p.add_argument("--engine", type=json.loads, action="append", default=[],
                   help='EngineConfig fields over its defaults, as JSON: {"frames_per_step": 1, "seeded_ends": true} '
                        "(repeatable: merged, the later winning)")
    p.add_argument("--admission", type=json.loads, action="append", default=[],
                   help='AdmissionConfig fields over its defaults, as JSON: {"starvation_s": 1e9} (repeatable)')
    p.add_argument("--no-warmup", action="store_true",
                   help="compile each program when first needed: a quick start, slow first requests")
    args = p.parse_args(argv)
    engine = {k: v for fields in args.engine for k, v in fields.items()}
    admission = {k: v for fields in args.admission for k, v in fields.items()}
    return run(settings_from_args(args, engine=engine, admission=admission, warmup=not args.no_warmup))


if __name__ == "__main__":
    sys.exit(main())
