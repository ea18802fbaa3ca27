"""When each word of a spoken part is estimated to start and end in the audio the client plays. No aligner runs.

A word cannot be spoken before its first text token reaches the talker (`qtts_jax.prompt.text_entry_frames`:
frame 0 for text in the prompt, one token a frame in the streaming layouts), and speech goes through a part's
tokens at a roughly even pace, so a word that starts at token k of n is placed at frame max(entry(k), F·k/n) of
the part's F frames. It ends where the next word starts (the last one where the part ends). Times are seconds
from the start of the whole response, as played: prosody, `speed`, pauses and earlier parts included.
"""

from __future__ import annotations

import bisect
import re

from qtts_jax.engine.job import Job
from qtts_jax.prompt import text_entry_frames

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"  # kana and ideographs: a word each, no spaces
_WORD = re.compile(rf"[{_CJK}]|[^\s{_CJK}]*(?![{_CJK}])[^\W_][^\s{_CJK}]*")  # with a letter or digit


def estimate(job: Job, tokenizer, frames: int, start_s: float, duration_s: float) -> list[dict]:
    """[{"word", "start", "end"}] for the words of `job`'s text, spoken in `frames` frames that play for
    `duration_s` from `start_s`; starts never decrease and all lie within [start_s, start_s + duration_s]."""
    text = job.request.text
    token_ends = [end for _, end in tokenizer.offsets(text)]
    n = len(token_ends)
    entry = text_entry_frames(job.prompt, n)
    words = [(m.start(), m.group()) for m in _WORD.finditer(text)]
    starts = []
    for char, _ in words:
        k = min(bisect.bisect_right(token_ends, char), n - 1)  # the token holding the word's first character
        frame = float(min(max(entry[k], frames * k / n), frames))
        starts.append(start_s + (duration_s * frame / frames if frames else 0.0))
    ends = starts[1:] + [start_s + duration_s]
    return [{"word": w, "start": round(s, 3), "end": round(e, 3)} for (_, w), s, e in zip(words, starts, ends)]
