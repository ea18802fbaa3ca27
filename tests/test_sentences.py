"""Cutting streamed text into units to speak early: only complete sentences (or clauses) leave the buffer."""

from serving.text.sentences import split_units


def test_split_units_keeps_the_unfinished_rest():
    assert split_units("Hi there. How are", "sentence") == (["Hi there."], "How are")
    assert split_units("Wait... what?! Yes", "sentence") == (["Wait...", "what?!"], "Yes")
    assert split_units("3.5 percent is", "sentence") == ([], "3.5 percent is")  # no space after the dot
    assert split_units("你好。我们", "sentence") == (["你好。"], "我们")
    assert split_units("One, two; three", "clause") == (["One,", "two;"], "three")
    assert split_units("Hi there. How", "none") == ([], "Hi there. How")
    assert split_units("Done. ", "sentence") == (["Done."], "")
