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
import urllib.request
from pathlib import Path

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


def _get(url: str, timeout_s: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
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


def provenance(run_id: str, servers: dict[str, dict]) -> dict:
    """The block summary.json and the report carry; `servers` maps each label to `server(...)`."""
    return {"run_id": run_id, "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **commit(), "servers": servers, "packages": packages(), "machine": machine()}
