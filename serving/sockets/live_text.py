"""Text that arrives in pieces (an LLM's words), as the token ids the streaming prompt layout feeds, handed out
only once they can no longer change.

A word split across messages ("Thanks" + "giving") tokenizes differently from its halves, so the ids of the
text's unfinished end are held back until more text or the completion shows how it ends. The Qwen2 byte-level
BPE merges only inside a pre-token (its split regex: letter runs with one leading non-letter, single digits,
punctuation runs with their trailing newlines, whitespace runs), so the text before a position `m` tokenizes the
same whatever follows when no pre-token can run across `m`: after a letter when a non-letter follows (a letter
run ends there), after a digit (digits are pre-tokens of one), or after any non-space when a space or tab follows
(it starts the next pre-token, and only newlines join a punctuation run). A combining mark after `m` could merge
into the character before it under NFC, so it is never a cut. Text leading whitespace is dropped, as a whole
request's text is stripped.
"""

from __future__ import annotations

import unicodedata

from qtts_jax.prompt import text_ids_of
from qtts_jax.io.text import TextTokenizer


def stable_end(text: str) -> int:
    """The last position of `text` before which its tokens cannot change, whatever text follows (0: none)."""
    for m in range(len(text) - 1, 0, -1):
        before, after = text[m - 1], text[m]
        cat_b, cat_a = unicodedata.category(before)[0], unicodedata.category(after)[0]
        if cat_a == "M":
            continue
        if (cat_b == "L" and cat_a != "L") or cat_b == "N" or (
                not before.isspace() and after.isspace() and after not in "\r\n"):
            return m
    return 0


class LiveText:
    """One utterance's text as it arrives: `add(piece)` and `finish()` return the ids that became final."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.text = ""
        self.ids: list[int] = []  # handed out so far: the ids of text[:self.end]
        self.end = 0

    def add(self, piece: str) -> list[int]:
        self.text += piece
        return self._upto(stable_end(self.text))

    def finish(self) -> list[int]:
        """The rest: the ids of the whole text (the request's text once it is complete)."""
        return self._upto(len(self.text))

    @property
    def stable(self) -> str:
        """The text whose ids are handed out (as a request's text: stripped)."""
        return self.text[: self.end].strip()

    def rest(self) -> str:
        """The text whose ids are not handed out yet."""
        return self.text[self.end:]

    def _upto(self, end: int) -> list[int]:
        if end <= self.end:
            return []
        ids = text_ids_of(self.tokenizer, self.text[:end].strip())
        if ids[: len(self.ids)] != self.ids:  # the argument above says never; a bug must not speak wrong text
            raise ValueError("live text: the ids of the text received so far changed")
        new, self.ids, self.end = ids[len(self.ids):], ids, end
        return new
