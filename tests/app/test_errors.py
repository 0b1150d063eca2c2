"""kvbench.errors.first_line: the one line an error message quotes."""
from kvbench.errors import first_line


def test_first_line_takes_the_first_stripped_line():
    assert first_line(ValueError("\n  bad value 'x'  \nTraceback detail")) == "bad value 'x'"
    assert first_line("one\ntwo") == "one"


def test_an_empty_message_falls_back_to_the_type_name_or_the_given_text():
    assert first_line(KeyError()) == "KeyError"
    assert first_line(OSError("   \n ")) == "OSError"
    assert first_line(ValueError(""), fallback="damaged") == "damaged"
    assert first_line("") == ""
