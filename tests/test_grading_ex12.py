"""Exercise 12's checkers (course_lib.grading.ex12_reshard): the stub fails, the reference
solution passes, a student module that imports the library's shard rule or resharding code is
refused, and plausible wrong answers fail."""

import importlib.util
import pathlib

import pytest

from course_lib import grading
from course_lib.grading import ex12_reshard as grade

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOLUTION = (ROOT / "exercises" / "solutions" / "ex12_reshard.py").read_text()
CHEAP = (grade.check_shard_range, grade.check_read_plan, grade.check_reshard_flat)


def module_from(tmp_path, source, name):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_plain_stub_fails(monkeypatch):
    monkeypatch.delenv(grading.GRADE_WITH_ENV, raising=False)
    stub = grading.load_student("ex12_reshard", refuse=grade.REFUSE)
    for check in CHEAP:
        with pytest.raises(NotImplementedError):
            check(stub)


def test_the_reference_solution_passes_the_cheap_checks(monkeypatch, capsys):
    monkeypatch.setenv(grading.GRADE_WITH_ENV, "solutions")
    solution = grading.load_student("ex12_reshard", refuse=grade.REFUSE)
    for check in CHEAP:
        check(solution)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "grading exercises/ex12_reshard/student.py"  # the file graded, then the checks
    out = out[1:]
    assert len(out) == 6 and all(line.startswith("PASS  ") for line in out)


def test_the_reference_solution_passes_on_ranks(monkeypatch, capsys):
    monkeypatch.setenv(grading.GRADE_WITH_ENV, "solutions")
    solution = grading.load_student("ex12_reshard", refuse=grade.REFUSE)
    grade.check_reads_on_ranks(solution)
    grade.check_resume_on_fewer_ranks(solution)
    out = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("[rank")]
    out = [line for line in out if line != "grading exercises/ex12_reshard/student.py"]  # printed once per script
    assert len(out) == 5 and all(line.startswith("PASS  ") for line in out)


@pytest.mark.parametrize("source", [
    "from course_lib.parallel.zero.flat import shard_bounds\n",
    "from course_lib.parallel.zero import shard_bounds\n",
    "import course_lib.parallel.zero as z\n\ndef shard_range(n, w, r):\n    return z.shard_bounds(n, w, r)\n",
    "from course_lib.checkpoint.reshard import Box\n",
    "from course_lib.checkpoint import flat_range_boxes\n",
    "import course_lib.checkpoint.reader\n",
])
def test_a_student_module_using_the_library_answer_is_refused(tmp_path, monkeypatch, source):
    (tmp_path / "ex12_reshard").mkdir()
    (tmp_path / "ex12_reshard" / "student.py").write_text(source + SOLUTION)
    monkeypatch.setattr(grading, "EXERCISES_DIR", tmp_path)
    monkeypatch.delenv(grading.GRADE_WITH_ENV, raising=False)
    with pytest.raises(grading.CheckFailed, match="already holds this exercise's answer"):
        grading.load_student("ex12_reshard", refuse=grade.REFUSE)


# Plausible mistakes, each made in the reference solution's source:
# name -> (old fragment, new fragment, the check that must reject it, a phrase of its message)
BUILD_LOOP = """        shard = torch.zeros(size, dtype=old_shards[0].dtype)
        for old, src_start, src_stop, dst_start in read_plan(numel, len(old_shards), new_world, new_rank):
            shard[dst_start:dst_start + src_stop - src_start] = old_shards[old][src_start:src_stop]"""
WRONG = {
    # floor instead of ceiling: shards too small whenever the world does not divide the unit
    "shard size rounded down": ("size = -(-numel // world_size)", "size = numel // world_size",
                                grade.check_shard_range, "shard_range on every rank of 6 layouts worked out by hand"),
    # a rank outside the world accepted
    "no range check": ("    if not 0 <= rank < world_size:\n        raise", "    if False:\n        raise",
                       grade.check_shard_range, "must raise ValueError"),
    # one past the end: the last element of every shard read twice (or an extra padding element)
    "overlap one too long": ("lo, hi = max(start, a), min(stop, b)", "lo, hi = max(start, a), min(stop, b) + 1",
                             grade.check_read_plan, "is not a non-empty slice of an old shard"),
    # forgetting to stop at numel: the last new rank reads old padding
    "reads the padding": ("stop = min(stop, numel)", "pass", grade.check_read_plan, "past numel=10: padding"),
    # the destination as a global offset instead of local to the new shard
    "global destination": ("plan.append((old, lo - a, hi - a, lo - start))", "plan.append((old, lo - a, hi - a, lo))",
                           grade.check_read_plan, "do not fit in a new shard"),
    # empty overlaps listed too
    "empty reads listed": ("if lo < hi:", "if lo <= hi:", grade.check_read_plan, "is not a non-empty slice"),
    # what the stub forbids: every old shard joined into the whole unit, then sliced
    "concatenates every old shard": (BUILD_LOOP, """        full = torch.cat(old_shards)
        shard = torch.zeros(size, dtype=old_shards[0].dtype)
        real = full[new_rank * size:min((new_rank + 1) * size, numel)]
        shard[:len(real)] = real""", grade.check_reshard_flat, r"used all of old shard 0 at once \(cat\)"),
    # the same whole unit assembled from slices, so no torch.cat to see: the reads are not the plan's
    "assembles the whole unit": (BUILD_LOOP, """        full = torch.zeros(numel, dtype=old_shards[0].dtype)
        s_old = -(-numel // len(old_shards))
        for k, o in enumerate(old_shards):
            n = max(0, min(s_old, numel - k * s_old))
            if n:
                full[k * s_old:k * s_old + n] = o[0:n]
        shard = torch.zeros(size, dtype=old_shards[0].dtype)
        real = full[new_rank * size:min((new_rank + 1) * size, numel)]
        shard[:len(real)] = real""", grade.check_reshard_flat, "its read plans name"),
    # a defensive copy of each old shard before slicing it
    "copies each old shard": ("old_shards[old][src_start:src_stop]", "old_shards[old].clone()[src_start:src_stop]",
                              grade.check_reshard_flat, r"used all of old shard 0 at once \(clone\)"),
    # new shards in the default dtype, not the old shards'
    "float shards": ("shard = torch.zeros(size, dtype=old_shards[0].dtype)", "shard = torch.zeros(size)",
                     grade.check_reshard_flat, "int64 tensors of shape"),
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_plausible_wrong_answer_fails(tmp_path, name):
    old, new, check, phrase = WRONG[name]
    assert old in SOLUTION
    wrong = module_from(tmp_path, SOLUTION.replace(old, new), "wrong_ex12")
    with pytest.raises(grading.CheckFailed, match=phrase):
        check(wrong)


def test_no_plan_or_range_is_stored_readable():
    source = pathlib.Path(grade.__file__).read_text()
    assert "(1, 1, 3, 0)" not in source and "[(0, 3), (3, 6)" not in source  # rows of the hand-worked answers
    assert not hasattr(grade, "EXPECTED_PLANS") and not hasattr(grade, "EXPECTED_RANGES")


def test_reading_the_padding_shows_in_the_resharded_values(tmp_path):
    """reshard_flat on top of the padding-reading plan: the old padding's marker lands in the
    new padding, where zeros belong."""
    wrong = module_from(tmp_path, SOLUTION.replace("stop = min(stop, numel)", "pass"), "wrong_ex11_pad")
    with pytest.raises(grading.CheckFailed, match="marks the old padding"):
        grade.check_reshard_flat(wrong)


def test_the_rules_name_what_a_plan_breaks():
    # 10 elements, old shards of 3 on 4 ranks, new shards of 4 on 3 ranks; new rank 2 owns [8, 12)
    assert grade.plan_errors("p", [(2, 2, 3, 0), (3, 0, 1, 1)], 10, 4, 3, 2, 3, 4) == []
    assert "padding" in grade.plan_errors("p", [(2, 2, 3, 0), (3, 0, 3, 1)], 10, 4, 3, 2, 3, 4)[0]
    assert "into global offset" in grade.plan_errors("p", [(2, 2, 3, 1), (3, 0, 1, 2)], 10, 4, 3, 2, 3, 4)[0]
    assert "each element once" in grade.plan_errors("p", [(2, 2, 3, 0)], 10, 4, 3, 2, 3, 4)[0]
    assert "increasing" in grade.plan_errors("p", [(3, 0, 1, 1), (2, 2, 3, 0)], 10, 4, 3, 2, 3, 4)[0]
