"""course_lib.grading.stored: digests of exact answers (the checkers keep no readable answer)."""

import pytest

from course_lib import grading
from course_lib.grading.stored import check_digest, digest


def test_digest_is_canonical_and_tells_values_apart():
    assert digest({"b": 1, "a": (2, 3)}) == digest({"a": [2, 3], "b": 1})  # key order and tuple/list do not matter
    assert digest(1) != digest(True) != digest("1")  # bool, int and str are different answers
    assert digest([1, 2]) != digest([2, 1])
    assert len(digest(0)) == 64


def test_floats_are_refused_because_rounding_would_decide_the_verdict():
    with pytest.raises(TypeError, match="exact values"):
        digest([1, 0.5])


def test_check_digest_passes_and_fails_without_showing_the_answer(capsys):
    check_digest("plan", (0, 1, 2), digest((0, 1, 2)))
    assert capsys.readouterr().out.splitlines()[-1].startswith("PASS")
    with pytest.raises(grading.CheckFailed) as error:
        check_digest("plan", (0, 2, 1), digest((0, 1, 2)), hint="Is the order reversed?")
    assert "(0, 2, 1)" in str(error.value) and "Is the order reversed?" in str(error.value)
    assert "(0, 1, 2)" not in str(error.value)
