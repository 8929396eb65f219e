"""PGDISPATCH_PREPARE_THRESHOLD: off unless set to a whole number; anything else refused in
one line (sql/settings.py)."""

from __future__ import annotations

import pytest

from pgdispatch.sql import InvalidInput, Settings


@pytest.mark.parametrize("raw, threshold", [(None, None), ("", None), ("off", None),
                                            (" OFF ", None), ("0", 0), ("5", 5),
                                            ("1000000", 1000000)])
def test_the_prepare_threshold_is_off_or_a_whole_number(raw, threshold):
    env = {} if raw is None else {"PGDISPATCH_PREPARE_THRESHOLD": raw}
    assert Settings.from_env(env).prepare_threshold == threshold


@pytest.mark.parametrize("raw", ["-1", "5.0", "1e3", "on", "never", "1000001", "٣"])
def test_any_other_prepare_threshold_is_refused_naming_it(raw):
    with pytest.raises(InvalidInput, match=r"^PGDISPATCH_PREPARE_THRESHOLD must be off .* got "):
        Settings.from_env({"PGDISPATCH_PREPARE_THRESHOLD": raw})
