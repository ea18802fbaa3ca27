"""Progress bars for long study work, drawn only on a terminal so logs and notebook outputs stay clean."""

from __future__ import annotations

import sys

from tqdm import tqdm


def bar(total: float | None, desc: str, unit: str = "it", stream=None) -> tqdm:
    """A tqdm bar on `stream` (stderr), disabled unless that stream is a TTY."""
    stream = stream or sys.stderr
    return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=not stream.isatty(), leave=False,
                dynamic_ncols=True)
