"""Form numbers: only ASCII digits with an optional sign are whole numbers."""

from __future__ import annotations

import pytest

from pgdispatch.sql.errors import InvalidInput
from pgdispatch.sql.validate import MAX_BATCH_LIMIT, check_int, check_max_batch, check_number


@pytest.mark.parametrize("text, value", [("12", 12), (" 12 ", 12), ("+3", 3), ("0", 0), (7.0, 7)])
def test_form_numbers_in_ascii_digits_are_read(text, value):
    assert check_int("max running", text, 0, 100) == value


@pytest.mark.parametrize("text", ["\u0662", "\uff11", "1_000", "1e3", "0x10", "2.5", "", "-", "+"])
def test_other_digits_and_number_syntaxes_are_refused(text):
    """int() alone takes Arabic-Indic and full-width digits and underscores (found by a
    fresh-user run: the limits form set a bound of 2 from "\u0662")."""
    with pytest.raises(InvalidInput, match="must be a whole number"):
        check_int("max running", text, 0, 100)


def test_range_is_checked_after_reading():
    with pytest.raises(InvalidInput, match="between 0 and 100, got -1"):
        check_int("max running", "-1", 0, 100)


@pytest.mark.parametrize("check, value, said", [
    (check_int, True, "priority must be a whole number, got true"),
    (check_int, None, "priority must be a whole number, got null"),
    (check_int, "abc", 'priority must be a whole number, got "abc"'),
    (check_int, "x" * 5000, f'priority must be a whole number, got "{"x" * 40}…"'),
    (check_int, [1], "priority must be a whole number, got a list"),
    (check_int, 2.5, "priority must be a whole number, got 2.5"),
    (check_number, False, "priority must be a number, got false"),
    (check_number, {"a": 1}, "priority must be a finite number, got an object"),
])
def test_a_refused_value_is_shown_as_the_request_spelled_it(check, value, said):
    """JSON's true/false/null, not Python's True/False/None (fresh-user run: "priority must
    be a whole number, got True"); long text cut, so one bad field is one short line."""
    with pytest.raises(InvalidInput) as caught:
        check("priority", value, 0, 100)
    assert str(caught.value) == said


@pytest.mark.parametrize("value", [1, 10, MAX_BATCH_LIMIT])
def test_a_max_batch_in_range_is_kept(value):
    assert check_max_batch(value) == value


@pytest.mark.parametrize("value, shown", [(0, "0"), (1001, "1001"), ("10", "'10'"),
                                          (True, "True"), (2.0, "2.0"), (None, "None")])
def test_a_max_batch_out_of_range_or_not_an_int_is_refused(value, shown):
    """Typed input only (the CLI has parsed it): text and bools are refused, not read."""
    with pytest.raises(InvalidInput) as caught:
        check_max_batch(value)
    assert str(caught.value) == f"max batch must be an integer from 1 to 1000, got {shown}"
