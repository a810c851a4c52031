"""Exercise 09's checkers (course_lib.grading.ex09_context_parallel) separate right from wrong code.

The untouched stubs fail, the reference solution passes, a student module that imports the
library's context parallelism (or PyTorch's) is refused before it runs, and plausible wrong
answers (a plain average, a merge that forgets the rows with no visible key, one that takes
exp of large scores, one that puts the partial in the first rows, one that returns only the
partial's rows; contiguous pieces, leftover tokens dropped or piled on one chunk, even chunks
with the leftovers on the first ones, ranks reversed) fail the check that should catch them,
with a message naming the mistake.
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
    for check in (checks.check_merge_by_hand, checks.check_merge_blocks, checks.check_layout, checks.check_ring):
        with pytest.raises(NotImplementedError, match="exercise 09"):
            check(stub)


def test_the_solution_passes(monkeypatch, capsys):
    monkeypatch.setenv(grading.GRADE_WITH_ENV, "solutions")
    solution = grading.load_student(EXERCISE, refuse=checks.REFUSE)
    checks.check_merge_by_hand(solution)
    checks.check_merge_blocks(solution)
    checks.check_layout(solution)
    checks.check_ring(solution)
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"grading exercises/{EXERCISE}/student.py"
    assert out.count("PASS") == 23 and "FAIL" not in out


def test_the_checker_holds_no_layout():
    """The layout is checked by its properties: no position list is stored in the checker."""
    source = (ROOT / "course_lib" / "grading" / f"{EXERCISE}.py").read_text()
    assert "2 * cp - 1 - r" not in source and "2cp-1-r" not in source.replace(" ", "")


@pytest.mark.parametrize("line", [
    "from course_lib.parallel.cp import merge_partials",
    "from course_lib.parallel.cp.blocks import merge_partials as merge",
    "from course_lib.parallel.cp.layout import chunk_ids",
    "from course_lib.parallel import cp\nzigzag_positions = lambda t, n, r: cp.chunk_ids(n, r, True)",
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


# Plausible mistakes, each made in the reference solution's source (old fragment -> new fragment).
MERGE_OLD = """    m = torch.maximum(lse_a, part_lse)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both -inf: exp(-inf - 0) = 0, not NaN
    w_a, w_b = torch.exp(lse_a - m), torch.exp(part_lse - m)  # <= 1 each: no overflow
"""
MERGE_TAIL = """    total = w_a + w_b  # >= 1 when either part has a visible key (its larger term is exp(0))
    merged_out = (w_a.unsqueeze(-1) * out_a + w_b.unsqueeze(-1) * part_out) / total.clamp_min(1.0).unsqueeze(-1)
"""
EXP_OF_LSE = """    ea, eb = torch.exp(lse_a), torch.exp(part_lse)
    total = ea + eb
    merged_out = (ea[..., None] * out_a + eb[..., None] * part_out) / total.clamp_min(1e-30)[..., None]
    m = torch.zeros_like(total)
"""
EVEN_OLD = """    shares = [T // cp + (r < T % cp) for r in range(cp)]
    front = [(s + 1) // 2 for s in shares]
    back = [s // 2 for s in shares]
    lengths = front + back[::-1]  # the 2cp chunks in position order
"""
LAYOUT_TAIL = """    lengths = front + back[::-1]  # the 2cp chunks in position order
    starts = [sum(lengths[:i]) for i in range(2 * cp + 1)]
    return [p for i in (rank, 2 * cp - 1 - rank) for p in range(starts[i], starts[i + 1])]
"""
WRONG = {
    # the two sides weighted equally, whatever each has seen
    "plain average": ("merged_out = (w_a.unsqueeze(-1) * out_a + w_b.unsqueeze(-1) * part_out) / "
                      "total.clamp_min(1.0).unsqueeze(-1)", "merged_out = (out_a + part_out) / 2"),
    # the max taken as is: a row with no key on either side gives -inf - (-inf) = NaN
    "forgets no visible key": (MERGE_OLD, MERGE_OLD.replace(
        "    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both -inf: exp(-inf - 0) = 0, not NaN\n",
        "")),
    # exp of the lse itself: overflows fp32 above 88.7
    "exp of large scores": (MERGE_OLD + MERGE_TAIL, EXP_OF_LSE),
    # the partial's rows taken as the first k rows of the running result
    "first rows": ("lse_a, out_a = lse[..., rows], out[..., rows, :]",
                   "rows = torch.arange(len(rows)); lse_a, out_a = lse[..., rows], out[..., rows, :]"),
    # only the merged rows returned
    "only the partial's rows": ("    return new_out, new_lse\n",
                                "    return new_out[..., rows, :], new_lse[..., rows]\n"),
    # cp contiguous pieces: the last rank does most of the causal work
    "contiguous pieces": (LAYOUT_TAIL, "    starts = [sum(shares[:i]) for i in range(cp + 1)]\n"
                                       "    return list(range(starts[rank], starts[rank + 1]))\n"),
    # 2cp chunks of T // 2cp: the leftover tokens belong to nobody
    "leftovers dropped": (EVEN_OLD, "    lengths = [T // (2 * cp)] * (2 * cp)\n"),
    # 2cp chunks of T // 2cp, the leftovers added to the last chunk: rank 0 holds them all
    "leftovers on the last chunk": (EVEN_OLD, "    lengths = [T // (2 * cp)] * (2 * cp - 1) + "
                                              "[T - (2 * cp - 1) * (T // (2 * cp))]\n"),
    # 2cp chunks as even as possible, the longer ones first: the late chunks are short, so the
    # ranks that hold early long chunks do too little
    "leftovers on the first chunks": (EVEN_OLD, "    lengths = [T // (2 * cp) + (i < T % (2 * cp)) for i in "
                                                "range(2 * cp)]\n"),
    # rank r holds the mirror pair of rank cp-1-r: the ranks out of sequence order
    "ranks reversed": ("for i in (rank, 2 * cp - 1 - rank)", "for i in (cp - 1 - rank, cp + rank)"),
}


@pytest.mark.parametrize("wrong, check, match", [
    ("plain average", "by_hand", "the worked example: out over all three keys"),
    ("plain average", "ring", "output rows equal single-process causal attention"),
    ("forgets no visible key", "by_hand", "a row that has seen no key must stay out = 0 and lse = -inf, never NaN"),
    ("exp of large scores", "by_hand", r"large scores \(lse 100 and 101: exp of them overflows fp32\)"),
    ("first rows", "by_hand", "a partial holding rows 1, 2, 3 of four"),
    ("first rows", "blocks", "each partial on the rows that see its keys"),
    ("only the partial's rows", "by_hand", "return every row of it, the partial's 3 rows merged in"),
    ("contiguous pieces", "layout", "the busiest rank scores"),
    ("contiguous pieces", "ring", "the spread must be fewer than T"),
    ("leftovers dropped", "layout", "is held by no rank"),
    ("leftovers dropped", "ring", "fix zigzag_positions first"),
    ("leftovers on the last chunk", "layout", "where did the T mod 2cp tokens that do not fill a whole chunk go"),
    ("leftovers on the first chunks", "layout", "spread the leftover tokens so that no rank collects the late ones"),
    ("ranks reversed", "layout", r"rank r's first run must come before rank r\+1's"),
])
def test_a_wrong_answer_fails_its_check(tmp_path, monkeypatch, wrong, check, match):
    old, new = WRONG[wrong]
    assert old in SOLUTION  # the mutant really changes the solution
    student = _load(tmp_path, monkeypatch, SOLUTION.replace(old, new))
    run = {"by_hand": lambda: checks.check_merge_by_hand(student),
           "blocks": lambda: checks.check_merge_blocks(student),
           "layout": lambda: checks.check_layout(student),
           "ring": lambda: checks.check_ring(student, cases=((23, 2),))}[check]
    with pytest.raises(grading.CheckFailed, match=match) as failure:
        run()
    assert "exercise 09" not in str(failure.value)


def test_every_mutant_is_tried():
    assert len(WRONG) >= 5
