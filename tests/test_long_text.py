"""Cutting text longer than one prompt into parts that fit: whole sentences packed, then clauses, words, and a
hard cut as the last resort; the parts, joined, are the text."""

import pytest

from serving.text.long_text import split


def fits_in(n):
    seen = []

    def fits(text):
        seen.append(text)
        return len(text) <= n

    return fits, seen


def test_sentences_are_packed_and_a_long_one_is_cut_at_clauses_then_words():
    text = "One. Two two. Three, with a clause; and another clause here. Four."
    fits, _ = fits_in(30)
    assert split(text, fits) == ["One. Two two.", "Three, with a clause;", "and another clause here. Four."]
    fits, _ = fits_in(12)
    assert split("Averyveryverylongword and more words", fits) == ["Averyveryver", "ylongword", "and more", "words"]


def test_what_fits_is_one_part_and_cjk_is_cut_at_its_marks():
    fits, seen = fits_in(100)
    assert split("  Short enough.  ", fits) == ["Short enough."] and seen == ["Short enough."]
    fits, _ = fits_in(4)
    assert split("你好。谢谢你们，再见。", fits) == ["你好。", "谢谢你们", "，再见。"]


def test_nothing_fits():
    with pytest.raises(ValueError):
        split("abc", lambda text: False)
