"""GPU use and memory sampled with `nvidia-smi` while a measurement runs; absent or failing -> null fields.

The samples come from the machine running the study, so they describe the server's GPU only when the
server runs on that machine (a local server, or a study started on the GPU host).
"""

from __future__ import annotations

import asyncio
import shutil

QUERY = ("--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits")


def nvidia_smi() -> str | None:
    """Path of nvidia-smi on PATH, or None."""
    return shutil.which("nvidia-smi")


def parse_sample(text: str) -> list[tuple[float, float]]:
    """`nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits` output ->
    [(utilisation %, memory used MiB)] per GPU; raises ValueError on anything else ("[N/A]" included)."""
    rows = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            raise ValueError(f"unexpected nvidia-smi line {line!r}")
        rows.append((float(parts[0]), float(parts[1])))
    if not rows:
        raise ValueError("nvidia-smi printed no GPUs")
    return rows


class GpuSampler:
    """`async with GpuSampler(...) as g:` samples every `interval_s` until the block ends; `g.result()` is
    {"gpu_util_mean_pct", "gpu_mem_peak_mib", "gpu_samples", "gpu_error"}: the mean over samples of the
    GPUs' mean utilisation, and the peak over samples of their summed used memory. Without nvidia-smi (or
    with `enabled=False`) both numbers are None and gpu_error says why; a failing nvidia-smi never raises."""

    def __init__(self, enabled: bool = True, interval_s: float = 0.5, gpu_ids: str | None = None,
                 exe: str | None = None):
        self.exe = (exe or nvidia_smi()) if enabled else None
        self.interval_s = interval_s
        self.gpu_ids = gpu_ids
        self.samples: list[list[tuple[float, float]]] = []
        self.error: str | None = None if self.exe else ("disabled" if not enabled else "nvidia-smi not found")
        self._task: asyncio.Task | None = None

    async def sample_once(self) -> None:
        args = [self.exe, *QUERY] + (["-i", self.gpu_ids] if self.gpu_ids else [])
        try:
            proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), timeout=10)
            if proc.returncode != 0:
                raise ValueError(f"exit {proc.returncode}: {err.decode(errors='replace').strip()[:200]}")
            self.samples.append(parse_sample(out.decode(errors="replace")))
        except (OSError, ValueError, asyncio.TimeoutError) as exc:
            self.error = f"nvidia-smi: {exc}"[:300]

    async def _loop(self) -> None:
        while self.error is None:
            await self.sample_once()
            await asyncio.sleep(self.interval_s)

    async def __aenter__(self) -> "GpuSampler":
        if self.exe:
            self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            if not self.samples and self.error is None:  # the window ended before the first answer
                await self.sample_once()

    def result(self) -> dict:
        ok = bool(self.samples)
        return {
            "gpu_util_mean_pct": sum(sum(u for u, _ in s) / len(s) for s in self.samples) / len(self.samples)
            if ok else None,
            "gpu_mem_peak_mib": max(sum(m for _, m in s) for s in self.samples) if ok else None,
            "gpu_samples": len(self.samples),
            "gpu_error": None if ok and self.error is None else self.error,
        }
