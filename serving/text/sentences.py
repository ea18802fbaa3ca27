"""Where text streamed in pieces may be cut into units to speak while the rest is still coming: after a
sentence's end (or a clause's), so audio for what is complete starts before the client says the text is done.
("live" cuts nothing: the text joins one utterance as it comes, serving/sockets/live_input.py.)"""

from __future__ import annotations

import re

GRANULARITIES = ("none", "sentence", "clause", "live")
# after these marks and a space, or right after the full-width marks that take no space
_ENDS = {"sentence": re.compile(r"(?<=[.!?…])\s+|(?<=[。！？])"),
         "clause": re.compile(r"(?<=[.!?…,;:])\s+|(?<=[。！？，；：、])")}


def split_units(text: str, granularity: str) -> tuple[list[str], str]:
    """The complete units at the head of `text` (non-blank) and the unfinished rest to keep buffering."""
    if granularity in ("none", "live"):
        return [], text
    *units, rest = _ENDS[granularity].split(text)
    return [u for u in units if u.strip()], rest
