"""Text longer than one prompt, cut into parts that each fit one: whole sentences packed together, an overlong
sentence cut at its clauses, then its words, and a word that still does not fit cut where it must. The parts
are spoken back to back (serving/utterance.py), so a seam falls where a speaker would pause anyway whenever
the text allows it."""

from __future__ import annotations

from typing import Callable

from serving.text.sentences import split_units


def split(text: str, fits: Callable[[str], bool]) -> list[str]:
    """`text` (stripped) as parts for which `fits` holds, in order; raises ValueError when not even one
    character fits."""
    text = text.strip()
    if fits(text):
        return [text]
    for granularity in ("sentence", "clause"):
        units, rest = split_units(text, granularity)
        units += [rest] if rest.strip() else []
        if len(units) > 1:
            return _pack(units, fits)
    words = text.split()
    return _pack(words, fits) if len(words) > 1 else _cut(text, fits)


def _pack(units: list[str], fits) -> list[str]:
    """Consecutive units joined into as few parts as fit; a unit too long alone is split finer, and its last
    piece packed on with what follows."""
    parts, current = [], ""
    for unit in units:
        joined = _join(current, unit) if current else unit
        if fits(joined):
            current = joined
            continue
        if current:
            parts.append(current)
        *done, current = [unit] if fits(unit) else split(unit, fits)
        parts += done
    return parts + ([current] if current else [])


def _join(a: str, b: str) -> str:
    """Two units as they were written: by a space, except where Chinese or Japanese text (which has none) meets."""
    return a + b if _unspaced(a[-1]) or _unspaced(b[0]) else f"{a} {b}"


def _unspaced(c: str) -> bool:
    return "\u3000" <= c <= "\u9fff" or "\uff00" <= c <= "\uffef"  # CJK marks, kana, ideographs; full-width forms


def _cut(text: str, fits) -> list[str]:
    """Unbroken text (no space, no mark): the longest prefix that fits, found by bisection, repeatedly."""
    parts = []
    while text:
        lo, hi = 0, len(text)  # fits(text[:lo]) holds (or lo == 0); fits(text[:hi + 1]) does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(text[:mid]) else (lo, mid - 1)
        if lo == 0:
            raise ValueError("not even one character fits a prompt")
        parts.append(text[:lo])
        text = text[lo:]
    return parts
