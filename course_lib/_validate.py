"""The argument checks every module shares, so that bad input reads the same everywhere:

    check_int("tp", 0, minimum=1)        ValueError: tp=0 must be a positive int   (bools and integral
                                         floats handled; maximum=, and rule= for the words of the rule)
    check_one_of("schedule", s, SCHEDULES)
    check_divides("pp", 3, "n_layer", 8)  ValueError: pp=3 must divide n_layer=8

Each raises ValueError naming the value and the rule, and is called in the parent before any
rank starts or waits.
"""

from __future__ import annotations


def check_int(name: str, value, minimum: int | None = 1, allow_integral_float: bool = False, *,
              maximum: int | None = None, rule: str | None = None) -> int:
    """value as an int with minimum <= value (<= maximum when given). `True` is not an int here;
    7.5e9-style integral floats are accepted (and converted) only with allow_integral_float, as
    people type counts that way. rule: the words after "must be" in the error, where the range
    means something the bare numbers do not say ("an int in [0, n=4)", "an int >= 1 (steps of
    amax history)"); by default "a positive int", "an int >= m" or "an int in [m, M]"."""
    if allow_integral_float and isinstance(value, float) and value.is_integer():
        value = int(value)
    if rule is None and maximum is not None:
        rule = f"an int in [{minimum}, {maximum}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be " + (rule or "an int" + (f" >= {minimum}" if minimum is not None else "")))
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name}={value!r} must be " + (rule or ("a positive int" if minimum == 1 else f"an int >= {minimum}")))
    return value


def check_bool(name: str, value) -> bool:
    """True or False itself (not 0, 1 or a string), else a ValueError naming the value."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")
    return value


def check_one_of(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {tuple(choices)}")


def check_divides(name: str, value: int, of_name: str, of_value: int) -> None:
    if of_value % value:
        raise ValueError(f"{name}={value} must divide {of_name}={of_value}")
