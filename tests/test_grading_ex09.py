"""Exercise 09's checkers (course_lib.grading.ex09_context_parallel) separate right from wrong code.

The untouched stubs fail, the reference solution passes, a student module that imports the
library's context parallelism (or PyTorch's) is refused before it runs, and plausible wrong
answers (a plain average, a merge that forgets the rows with no visible key, one that takes
exp of large scores, contiguous chunks, an assignment that is not a partition) fail the check
that should catch them.
"""

import pathlib

import pytest

from course_lib import grading
from course_lib.grading import ex09_context_parallel as checks

from _student import load_as_student

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXERCISE = "ex09_context_parallel"
SOLUTION = (ROOT / "exercises" / "solutions" / f"{EXERCISE}.py").read_text()


def _load(tmp_path, monkeypatch, source: str):
    """Load `source` as the learner's student.py, as the exercise notebook does (with its refusals)."""
    return load_as_student(tmp_path, monkeypatch, EXERCISE, source, refuse=checks.REFUSE)


def test_the_stubs_fail(monkeypatch):
    monkeypatch.delenv(grading.GRADE_WITH_ENV, raising=False)
    stub = grading.load_student(EXERCISE, refuse=checks.REFUSE)
    for check in (checks.check_merge_by_hand, checks.check_merge_blocks, checks.check_zigzag, checks.check_ring):
        with pytest.raises(NotImplementedError, match="exercise 09"):
            check(stub)


def test_the_solution_passes(monkeypatch, capsys):
    monkeypatch.setenv(grading.GRADE_WITH_ENV, "solutions")
    solution = grading.load_student(EXERCISE, refuse=checks.REFUSE)
    checks.check_merge_by_hand(solution)
    checks.check_merge_blocks(solution)
    checks.check_zigzag(solution)
    checks.check_ring(solution)
    out = capsys.readouterr().out
    assert out.count("PASS") == 21 and "FAIL" not in out


@pytest.mark.parametrize("line", [
    "from course_lib.parallel.cp import merge_partials",
    "from course_lib.parallel.cp.blocks import merge_partials as merge",
    "from course_lib.parallel.cp.layout import chunk_ids",
    "from course_lib.parallel import cp\nzigzag_chunks = lambda n, r: cp.chunk_ids(n, r, True)",
    "import course_lib.parallel.cp.layout as layout",
    "import importlib\nm = importlib.import_module('course_lib.parallel.cp.blocks')",
    "from torch.distributed.tensor.experimental._context_parallel._attention import _SDPAMerger",
    "from course_lib.grading.ex09_context_parallel import _causal_pairs",
])
def test_a_module_importing_the_librarys_answer_is_refused(tmp_path, monkeypatch, line):
    with pytest.raises(grading.CheckFailed, match="already holds this exercise's answer"):
        _load(tmp_path, monkeypatch, SOLUTION + "\n" + line + "\n")


def test_what_the_exercise_may_use_is_allowed():
    source = "import math\nimport torch\nimport torch.nn.functional as F\nfrom course_lib.dims import ParallelDims\n"
    assert grading.refused_uses(source, checks.REFUSE) == []
    assert grading.refused_uses(SOLUTION, checks.REFUSE) == []
    assert grading.refused_uses((ROOT / "exercises" / EXERCISE / "student.py").read_text(), checks.REFUSE) == []


# Wrong answers: the solution with one definition replaced (an appended definition wins).
PLAIN_AVERAGE = '''
def merge_partials(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)
'''
FORGETS_NO_VISIBLE_KEY = '''
def merge_partials(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b, lse
'''
EXP_OF_LARGE_SCORES = '''
def merge_partials(out_a, lse_a, out_b, lse_b):
    ea, eb = torch.exp(lse_a), torch.exp(lse_b)
    total = ea + eb
    out = (ea[..., None] * out_a + eb[..., None] * out_b) / total.clamp_min(1e-30)[..., None]
    return out, torch.log(total)
'''
LSE_KEPT_FROM_A = '''
_merge = merge_partials

def merge_partials(out_a, lse_a, out_b, lse_b):
    return _merge(out_a, lse_a, out_b, lse_b)[0], lse_a
'''
CONTIGUOUS = '''
def zigzag_chunks(cp, rank):
    return [2 * rank, 2 * rank + 1]
'''
ONE_CHUNK = '''
def zigzag_chunks(cp, rank):
    return [rank]
'''
OVERLAPPING = '''
def zigzag_chunks(cp, rank):
    return [rank, rank + 1]
'''
RANKS_REVERSED = '''
def zigzag_chunks(cp, rank):
    return [cp - 1 - rank, cp + rank]
'''
WRONG = {"plain average": PLAIN_AVERAGE, "forgets no visible key": FORGETS_NO_VISIBLE_KEY,
         "exp of large scores": EXP_OF_LARGE_SCORES, "lse kept from a": LSE_KEPT_FROM_A, "contiguous": CONTIGUOUS,
         "one chunk": ONE_CHUNK, "overlapping": OVERLAPPING, "ranks reversed": RANKS_REVERSED}


@pytest.mark.parametrize("wrong, check, match", [
    ("plain average", "by_hand", "the worked example: out over all three keys"),
    ("plain average", "blocks", "two key sets, merged: out"),
    ("plain average", "ring", "output rows equal single-process causal attention"),
    ("forgets no visible key", "by_hand", "no visible key in either part"),
    ("forgets no visible key", "blocks", "largest difference NaN"),
    ("exp of large scores", "by_hand", "large scores"),
    ("lse kept from a", "by_hand", "the worked example: lse"),
    ("lse kept from a", "ring", "output rows equal"),
    ("contiguous", "zigzag", "every rank must score the same number of pairs"),
    ("contiguous", "ring", r"pairs each rank scored in the ring \(equal work\)"),
    ("one chunk", "zigzag", "two of the 2cp = 2 chunks"),
    ("one chunk", "ring", "fix zigzag_chunks first"),
    ("overlapping", "zigzag", "chunk 1 is held by ranks"),
    ("ranks reversed", "zigzag", "rank r starts at chunk r"),
])
def test_a_wrong_answer_fails_its_check(tmp_path, monkeypatch, wrong, check, match):
    student = _load(tmp_path, monkeypatch, SOLUTION + WRONG[wrong])
    run = {"by_hand": lambda: checks.check_merge_by_hand(student),
           "blocks": lambda: checks.check_merge_blocks(student),
           "zigzag": lambda: checks.check_zigzag(student),
           "ring": lambda: checks.check_ring(student, cps=(2,))}[check]
    with pytest.raises(grading.CheckFailed, match=match):
        run()
