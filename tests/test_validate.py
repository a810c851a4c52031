import pytest

from course_lib._validate import check_divides, check_int, check_one_of


def test_check_int():
    assert check_int("tp", 4) == 4
    assert check_int("n", 7.5e9, allow_integral_float=True) == 7_500_000_000
    assert check_int("k", 0, minimum=0) == 0
    for bad, msg in [(True, "tp=True must be an int"), (2.5, "tp=2.5 must be an int"), (0, "tp=0 must be a positive int"),
                     ("2", "tp='2' must be an int")]:
        with pytest.raises(ValueError, match=msg):
            check_int("tp", bad)
    with pytest.raises(ValueError, match="n=7.5e9|n=7500000000.0"):
        check_int("n", 7.5e9)
    with pytest.raises(ValueError, match="m=1 must be an int >= 2"):
        check_int("m", 1, minimum=2)


def test_check_one_of_and_divides():
    check_one_of("s", "1f1b", ("gpipe", "1f1b"))
    with pytest.raises(ValueError, match=r"s='x' must be one of \('gpipe', '1f1b'\)"):
        check_one_of("s", "x", ("gpipe", "1f1b"))
    check_divides("tp", 2, "n_head", 8)
    with pytest.raises(ValueError, match="tp=3 must divide n_head=8"):
        check_divides("tp", 3, "n_head", 8)


def test_check_int_maximum_and_rule():
    assert check_int("i", 3, minimum=0, maximum=3) == 3
    for bad in (-1, 4, True, 2.0):
        with pytest.raises(ValueError, match=rf"i={bad!r} must be an int in \[0, 3\]$"):
            check_int("i", bad, minimum=0, maximum=3)
    # rule: the caller's words, for a type and a range failure alike
    for bad in (0, "1"):
        with pytest.raises(ValueError, match=rf"^k={bad!r} must be an int >= 1 \(steps of history\)$"):
            check_int("k", bad, rule="an int >= 1 (steps of history)")
    with pytest.raises(ValueError, match=r"^r=4 must be an int in \[0, 4\) \(the world has 4 ranks\)$"):
        check_int("r", 4, minimum=0, maximum=3, rule="an int in [0, 4) (the world has 4 ranks)")
