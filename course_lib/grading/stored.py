"""Expected answers stored as digests, so that a checker module holds no readable answer.

A learner can open every file of `course_lib`; a checker that keeps its expected plan, count or
layout as a literal hands the answer to anyone who reads it. For an *exact* answer (integers,
strings, booleans, tuples, lists and dicts of them) the checker stores `digest(answer)` instead:
SHA-256 of a canonical text form, which says whether a learner's value is right and nothing
about what the right one is. Floats are not digested (a rounding boundary would make the verdict
depend on the last bit): a float answer is checked against a property, a formula evaluated at
check time, or a run of the single process.

    digest(value)                          -> 64 hex characters
    check_digest(label, got, expected, hint=...)  PASS, or CheckFailed with the hint
"""

from __future__ import annotations

import hashlib

from course_lib.grading import CheckFailed, announce, passed


def _canonical(value) -> str:
    """One text per value: dict keys sorted, tuples and lists alike, bool apart from int."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return f"int:{value}"
    if isinstance(value, str):
        return "str:" + repr(value)
    if isinstance(value, (tuple, list)):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    if isinstance(value, dict):
        items = sorted((_canonical(k), _canonical(v)) for k, v in value.items())
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    if isinstance(value, float):
        raise TypeError(f"digest() takes exact values; got the float {value!r}: check floats against a "
                        "property, a formula or the single process instead")
    raise TypeError(f"digest() takes int, str, bool, None, tuple, list or dict; got {type(value).__name__}")


def digest(value) -> str:
    """SHA-256 (hex) of the canonical form of an exact value."""
    return hashlib.sha256(_canonical(value).encode()).hexdigest()


def check_digest(label: str, got, expected: str, *, hint: str = "") -> None:
    """Pass when digest(got) == expected; otherwise fail showing what the learner's code returned
    and `hint` (what the mistake usually is, in the learner's terms), never the expected value."""
    announce()
    try:
        ok = digest(got) == expected
    except TypeError as error:
        raise CheckFailed(f"{label}: {error}") from None
    if not ok:
        raise CheckFailed(f"{label}: your code returned {got!r}, which is not the answer."
                          + (f"\n {hint}" if hint else ""))
    passed(label)
