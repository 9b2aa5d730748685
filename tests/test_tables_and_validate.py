"""The one table formatter (omnibal.tables) and the one set of number checks (omnibal.validate)."""

import numpy as np
import pytest

from omnibal.errors import InputError
from omnibal.tables import format_cell, format_table, markdown_table, text_table
from omnibal.validate import (
    check_non_negative_int,
    check_non_negative_number,
    check_positive_int,
    check_positive_number,
)


def test_text_table_aligns_columns_and_rules_the_header():
    rows = [["stage", "time"], ["0", "1.5"], ["10", "12.25"]]
    assert text_table(rows).splitlines() == ["stage  time", "-----  -----", "0      1.5", "10     12.25"]
    assert text_table(rows, align="right").splitlines()[2] == "    0    1.5"


def test_markdown_table_and_cells():
    assert markdown_table([["a", "b"], [1, 2.5]]) == "| a | b |\n| --- | --- |\n| 1 | 2.5000 |"
    assert format_cell(1234.5) == "1234" and format_cell(0.12345) == "0.1235" and format_cell(True) == "True"
    assert format_table([]) == ""


def test_markdown_table_compact_and_right_aligned():
    assert markdown_table([["a", "b"], ["x", "1"]], compact=True).splitlines()[1] == "|---|---|"
    assert markdown_table([["a", "b", "c"]], right=(1, 2)).splitlines()[1] == "| --- | ---: | ---: |"
    assert markdown_table([["a", ""], ["x", ""]]).splitlines() == ["| a |  |", "| --- | --- |", "| x |  |"]


@pytest.mark.parametrize("check, good, bad", [
    (check_positive_int, [1, np.int64(3)], [0, -1, 1.0, True, "2", None]),
    (check_non_negative_int, [0, 5], [-1, 0.5, False]),
    (check_positive_number, [0.1, 3], [0, -1.0, float("nan"), float("inf"), True, "1"]),
    (check_non_negative_number, [0, 0.0, 2.5], [-0.1, float("nan"), True]),
])
def test_checks_accept_and_refuse(check, good, bad):
    for value in good:
        check(value, "n")
    for value in bad:
        with pytest.raises(InputError) as info:
            check(value, "n", source="--n")
        assert info.value.source == "--n" and info.value.field == "n"
