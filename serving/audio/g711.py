"""G.711 μ-law and A-law: the 8-bit companded audio that telephone networks carry (Twilio and Telnyx media
streams take μ-law at 8 kHz). Each is a 65,536-entry table from int16 samples, built once with the segment
rules of the ITU reference (Sun's g711.c, as Python's former `audioop` encodes them)."""

from __future__ import annotations

import numpy as np

_ULAW_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_ALAW_SEG_END = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def _ulaw_table() -> np.ndarray:
    x = np.arange(-32768, 32768, dtype=np.int64) >> 2  # 14-bit
    mask = np.where(x < 0, 0x7F, 0xFF)
    x = np.minimum(np.abs(x), 8159) + 0x21
    seg = np.searchsorted(_ULAW_SEG_END, x)
    code = np.where(seg >= 8, 0x7F, (seg << 4) | ((x >> (seg + 1)) & 0xF))
    return (code ^ mask).astype(np.uint8)


def _alaw_table() -> np.ndarray:
    x = np.arange(-32768, 32768, dtype=np.int64) >> 3  # 13-bit
    mask = np.where(x >= 0, 0xD5, 0x55)
    x = np.where(x >= 0, x, -x - 1)
    seg = np.searchsorted(_ALAW_SEG_END, x)
    low = np.where(seg < 2, x >> 1, x >> np.maximum(seg, 1)) & 0xF
    code = np.where(seg >= 8, 0x7F, (seg << 4) | low)
    return (code ^ mask).astype(np.uint8)


TABLES = {"ulaw": _ulaw_table(), "alaw": _alaw_table()}


def encode(law: str, s16: np.ndarray) -> bytes:
    """int16 samples -> one byte each in `law` ("ulaw" or "alaw")."""
    return TABLES[law][np.asarray(s16, np.int16).astype(np.int32) + 32768].tobytes()
