"""Where a study's numbers came from: run id, commit, each server's model, fingerprint and configuration,
package versions and the machine, so a planner can tell whether two reports are comparable."""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from studies.load import key_headers

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("qtts-jax", "jax", "jaxlib", "numpy", "aiohttp", "pandas", "matplotlib", "papermill", "nbconvert")


def _run(*args: str) -> str | None:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def commit() -> dict:
    """The checkout's HEAD and whether tracked files differ from it (a dirty tree is not that commit)."""
    head = _run("git", "-C", str(ROOT), "rev-parse", "HEAD")
    status = _run("git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no") if head else None
    return {"commit": head, "dirty": bool(status) if head else None}


def packages() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def machine() -> dict:
    """The machine running the study (the server's, for a local server): CPU model and count, memory, GPUs."""
    cpu = platform.processor() or None
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    except (ValueError, OSError, AttributeError):
        mem_gib = None
    smi = shutil.which("nvidia-smi")
    gpus = (_run(smi, "-L") or "").splitlines() if smi else []
    return {"hostname": platform.node(), "platform": platform.platform(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "memory_gib": mem_gib, "gpus": gpus}


# Other processes using a quarter of a core on average compete with the servers and clients being measured
BUSY_CORES = 0.25


def _busy_ticks() -> int | None:
    """CPU ticks every process spent running, machine-wide (/proc/stat's first line: all but idle and iowait)."""
    try:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9])
    except (OSError, ValueError):
        return None
    return user + nice + system + irq + softirq + steal


def _own_ticks() -> int:
    """CPU ticks of this process and its descendants (the local servers, the load clients), reaped ones included."""
    parents, ticks = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited meanwhile
            continue
        fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        parents[int(stat.parent.name)] = int(fields[1])
        ticks[int(stat.parent.name)] = sum(map(int, fields[11:15]))  # utime, stime, cutime, cstime
    ours = {os.getpid()}
    for pid in sorted(parents):  # a child's pid may be lower than its parent's: walk up from each instead
        chain, p = [], pid
        while p in parents and p not in ours and p not in chain and p > 1:
            chain.append(p)
            p = parents[p]
        if p in ours:
            ours.update(chain)
    return sum(ticks.get(pid, 0) for pid in ours)


class MachineLoad:
    """How busy the machine was while a study measured: load average before and after, and the CPU time that
    processes other than the study (its servers and clients included) spent meanwhile. Other work competes for
    the CPU the servers and clients need, so a busy machine makes verdicts worse than the server's own."""

    def __init__(self):
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.start = self._snapshot()

    def _snapshot(self) -> dict:
        busy = _busy_ticks()
        return {"t": time.monotonic(), "busy": busy, "own": _own_ticks() if busy is not None else None,
                "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}

    def result(self) -> dict:
        end, start = self._snapshot(), self.start
        wall = end["t"] - start["t"]
        out = {"wall_s": round(wall, 1), "cpu_count": os.cpu_count(), "load_avg_start": start["loadavg"],
               "load_avg_end": end["loadavg"], "busy_cores": BUSY_CORES}
        if start["busy"] is None or end["busy"] is None or wall <= 0:
            return {**out, "other_cpu_s": None, "study_cpu_s": None, "other_cores": None, "busy": None}
        own = (end["own"] - start["own"]) / self.hz
        other = max(0.0, (end["busy"] - start["busy"]) / self.hz - own)
        return {**out, "study_cpu_s": round(own, 1), "other_cpu_s": round(other, 1),
                "other_cores": round(other / wall, 2), "busy": other / wall >= BUSY_CORES}


def _get(url: str, timeout_s: float = 10.0):
    with urllib.request.urlopen(urllib.request.Request(url, headers=key_headers()), timeout=timeout_s) as resp:
        return json.loads(resp.read())


def checkpoint_digest(model: str) -> str:
    """A checkpoint directory's identity without reading gigabytes: its JSON configs in full, and each weight
    file's name, size and first 1 MiB (the safetensors header: every tensor's name, shape, dtype and offset).
    A preset name stands for itself: its random weights are a function of the name."""
    path = Path(model)
    if not path.is_dir():
        return hashlib.sha256(model.encode()).hexdigest()
    digest = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        if f.suffix == ".json":
            digest.update(f.name.encode() + f.read_bytes())
        elif f.suffix == ".safetensors":
            with open(f, "rb") as fh:
                digest.update(f"{f.name}:{f.stat().st_size}".encode() + fh.read(2 ** 20))
    return digest.hexdigest()


def server(url: str, config: dict | None = None) -> dict:
    """What a server says it serves (/ready slots, /v1/models info) and a model fingerprint: sha256 of that
    info, plus, for a server this study started (`config`, how it was started), of its checkpoint
    (`checkpoint_digest`); a remote server is fingerprinted from what it reports about itself only."""
    out: dict = {"url": url, "config": config}
    try:
        out["slots"] = _get(f"{url}/ready").get("slots")
        (model,) = _get(f"{url}/v1/models")["data"]
        out["model"] = model.get("info", {"model": model.get("id")})
    except (OSError, ValueError, KeyError) as exc:  # urllib's errors are OSErrors; the study goes on without it
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
        return out
    digest = hashlib.sha256(json.dumps(out["model"], sort_keys=True).encode())
    if config and config.get("model"):
        digest.update(checkpoint_digest(config["model"]).encode())
    out["model_fingerprint"] = digest.hexdigest()[:16]
    out["fingerprint_of"] = "/v1/models info and checkpoint files" if config else "/v1/models info (remote server)"
    return out


def provenance(run_id: str, servers: dict[str, dict], machine_load: dict | None = None) -> dict:
    """The block summary.json and the report carry; `servers` maps each label to `server(...)`,
    `machine_load` is `MachineLoad.result()` over the measurement."""
    return {"run_id": run_id, "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **commit(), "servers": servers, "packages": packages(), "machine": machine(), "machine_load": machine_load}
