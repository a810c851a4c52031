"""Exercise 03's checkers (course_lib.grading.ex03_ddp): the stub fails, the reference solution
passes, a student module reaching the library's DDP or torch's is refused, and plausible wrong
answers fail, each with a message naming the mistake."""

import pathlib

import pytest

from course_lib import grading
from course_lib.grading import ex03_ddp as grade

from _student import assert_rejected, load_as_student, mutated

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOLUTION = (ROOT / "exercises" / "solutions" / "ex03_ddp.py").read_text()


def test_the_plain_stub_fails(tmp_path, monkeypatch):
    stub = load_as_student(tmp_path, monkeypatch, "ex03_ddp", refuse=grade.REFUSE)
    with pytest.raises(NotImplementedError):
        grade.check_build_buckets(stub)
    with pytest.raises(grading.CheckFailed, match="NotImplementedError"):
        grade.check_steps_on_ranks(stub)


def test_the_reference_solution_passes(tmp_path, monkeypatch, capsys):
    solution = load_as_student(tmp_path, monkeypatch, "ex03_ddp", SOLUTION, refuse=grade.REFUSE)
    grade.check_build_buckets(solution)
    grade.check_steps_on_ranks(solution)
    out = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("[rank")]
    assert out[0] == "grading ex03_ddp/student.py" or out[0].startswith("grading ") and out[0].endswith("student.py")
    assert len(out) == 10 and all(line.startswith("PASS  ") for line in out[1:])


@pytest.mark.parametrize("source", [
    "from course_lib.parallel import assign_buckets\n",
    "from course_lib.parallel.dp.ddp import DDP\n",
    "import course_lib.parallel as P\n\ndef helper(s, c):\n    return P.assign_buckets(s, c)\n",
    "from course_lib.parallel.dp import ddp as d\n",
    "from torch.nn.parallel import DistributedDataParallel\n",
])
def test_a_student_module_using_the_library_answer_is_refused(tmp_path, monkeypatch, source):
    with pytest.raises(grading.CheckFailed, match="already holds this exercise's answer"):
        load_as_student(tmp_path, monkeypatch, "ex03_ddp", source + SOLUTION, refuse=grade.REFUSE)


def test_a_helper_in_a_sibling_module_is_refused(tmp_path, monkeypatch):
    (tmp_path / "ex03_ddp").mkdir()
    (tmp_path / "ex03_ddp" / "buckets_helper.py").write_text(
        "from course_lib.parallel import assign_buckets\n\ndef layout(s, c):\n    return assign_buckets(s, c)\n")
    source = ("import sys, pathlib\nsys.path.insert(0, str(pathlib.Path(__file__).parent))\n"
              "import buckets_helper\n\n" + SOLUTION + "\n\ndef guess(s, c):\n    return buckets_helper.layout(s, c)\n")
    with pytest.raises(grading.CheckFailed, match="already holds this exercise's answer"):
        load_as_student(tmp_path, monkeypatch, "ex03_ddp", source, refuse=grade.REFUSE)


LOOP = ("        while self.next < len(self.buckets) and self.ready[self.next] == len(self.buckets[self.next]):\n"
        "            self._launch(self.next)\n")
FINISH_LAUNCH = ("        while self.next < len(self.buckets):\n"
                 "            self._launch(self.next)\n")

# Plausible mistakes, each made in the reference solution's source: (replacements, check, message phrase).
WRONG = {
    # PyTorch closes a bucket once it holds AT LEAST the cap
    "bucket launched only when strictly over the cap": (
        [("if size >= bucket_cap_bytes:", "if size > bucket_cap_bytes:")], "buckets", "at least the cap"),
    # the reverse of the indices, whatever order is given
    "order ignored": (
        [("    for i in order:\n", "    for i in reversed(range(len(sizes_bytes))):\n")], "buckets", "in the order given"),
    # no check that the order is a permutation
    "any order accepted": (
        [("    if sorted(order) != list(range(len(sizes_bytes))):\n", "    if False:\n")], "buckets", "exactly once"),
    # replicas never made equal
    "no broadcast of rank 0's parameters": (
        [("                dist.broadcast(p, src=self.src, group=group)\n", "                pass\n")],
        "ranks", "rank 0's values"),
    # the sum, not the mean
    "gradients not divided by N": ([(".div_(self.world_size)", "")], "ranks", "not the average"),
    # wait at once: right numbers, no overlap
    "waits for the all-reduce inside the hook": (
        [("        self.next = b + 1\n", "        self.pending[-1][1].wait()\n        self.next = b + 1\n")],
        "ranks", "waiting inside the gradient hook"),
    # counters kept from the previous step: nothing launches during backward from then on
    "bookkeeping not reset between steps": (
        [("        self.pending.clear()\n        self.ready = [0] * len(self.buckets)\n        self.next = 0\n",
          "        self.pending.clear()\n")], "ranks", "reset"),
    # a bucket leaves as soon as it is full, whatever the ranks' order
    "buckets launched as they fill, not in index order": (
        [(LOOP, "        b = self.bucket_of[param]\n        if self.ready[b] == len(self.buckets[b]):\n"
                "            self._launch(b)\n"), (FINISH_LAUNCH, "")], "ranks", "same bucket"),
    # each rank keeps its own observation
    "rebuilt from each rank's own order": (
        [("            dist.broadcast(order, src=self.src, group=self.group)\n", "")], "ranks", "different bucket layouts"),
    # the reverse-registration guess kept
    "buckets never rebuilt": (
        [("        if self.arrived is not None:  # after the first step", "        if False:  #")],
        "ranks", "order the gradients really"),
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_plausible_wrong_answer_fails(tmp_path, monkeypatch, capsys, name):
    replacements, which, phrase = WRONG[name]
    check = grade.check_build_buckets if which == "buckets" else grade.check_steps_on_ranks
    assert_rejected(tmp_path, monkeypatch, capsys, "ex03_ddp", mutated(SOLUTION, replacements), check, phrase,
                    refuse=grade.REFUSE)
