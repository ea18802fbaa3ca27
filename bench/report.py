"""The JSON a CPU bench writes: what it measured, the command that reproduces it, the machine's CPU count and the
result, which is also printed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def write(out: str, what: str, result: dict) -> None:
    report = {"what": what, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "cpus": os.cpu_count(),
              **result}
    Path(out).write_text(json.dumps(report, indent=1))
    print(json.dumps(result, indent=1))
