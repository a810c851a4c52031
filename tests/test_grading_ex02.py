"""Exercise 02's checkers (course_lib.grading.ex02_ring_all_reduce): the stub fails, the reference
solution passes, a student module reaching the library's ring is refused, and plausible wrong
answers fail, each with a message naming the mistake."""

import pathlib

import pytest

from course_lib import grading
from course_lib.grading import ex02_ring_all_reduce as grade

from _student import assert_rejected, load_as_student, mutated

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOLUTION = (ROOT / "exercises" / "solutions" / "ex02_ring_all_reduce.py").read_text()
CHECKS = (grade.check_reduce_scatter, grade.check_all_gather, grade.check_all_reduce, grade.check_bytes)


def test_the_plain_stub_fails(tmp_path, monkeypatch):
    stub = load_as_student(tmp_path, monkeypatch, "ex02_ring_all_reduce", refuse=grade.REFUSE)
    for check in CHECKS:
        with pytest.raises(grading.RankError, match="NotImplementedError"):
            check(stub)


def test_the_reference_solution_passes(tmp_path, monkeypatch, capsys):
    solution = load_as_student(tmp_path, monkeypatch, "ex02_ring_all_reduce", SOLUTION, refuse=grade.REFUSE)
    for check in CHECKS:
        check(solution)
    out = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("[rank")]
    assert out[0].startswith("grading ") and out[0].endswith("ex02_ring_all_reduce/student.py")
    assert len(out) == 16 and all(line.startswith("PASS  ") for line in out[1:])


@pytest.mark.parametrize("source", [
    "from course_lib.comm import ring_all_reduce as library_ring\n",
    "from course_lib.comm.collectives import ring_send_chunk\n",
    "import course_lib.comm as c\n\ndef helper(r, k, n):\n    return c.ring_send_chunk(r, k, n)\n",
    "from course_lib.comm.ringviz import simulate_ring\n",
    "from course_lib import comm\n\ndef helper(t):\n    return comm.ring_reduce_scatter(t)\n",
])
def test_a_student_module_using_the_library_answer_is_refused(tmp_path, monkeypatch, source):
    with pytest.raises(grading.CheckFailed, match="already holds this exercise's answer"):
        load_as_student(tmp_path, monkeypatch, "ex02_ring_all_reduce", source + SOLUTION, refuse=grade.REFUSE)


RS_SEND = "        send = chunks[(rank - direction * (step + 1)) % n]\n"
RS_TARGET = "        target = chunks[(rank - direction * (step + 2)) % n]\n"

# Plausible mistakes, each made in the reference solution's source: (replacements, check, message phrase).
WRONG = {
    # notebook 02's schedule kept for the mirrored ring, only the neighbours swapped
    "right-ring schedule used both ways": (
        [(RS_SEND, "        send = chunks[(rank - step - 1) % n]\n"),
         (RS_TARGET, "        target = chunks[(rank - direction * (step + 2)) % n]\n".replace("direction * (step + 2)", "step - 2"))],
        grade.check_reduce_scatter, "(?i)which chunk (must|does) (each )?rank (r )?send"),
    # the direction changes the chunks but every message still goes right
    "always sends to the right": (
        [("    works = [dist.isend(send, (rank + direction) % n), dist.irecv(recv, (rank - direction) % n)]\n",
          "    works = [dist.isend(send, (rank + 1) % n), dist.irecv(recv, (rank - 1) % n)]\n")],
        grade.check_reduce_scatter, "the ranks hung|not chunk r of the sum|its neighbour sends"),
    # the arriving chunk written over the local one instead of added to it
    "received chunk overwrites instead of adding": (
        [("        incoming = scratch[: target.numel()]\n        _ring_step(send, incoming, direction)\n        target.add_(incoming)\n",
          "        _ring_step(send, target, direction)\n")],
        grade.check_reduce_scatter, "not chunk r of the sum"),
    # chunk() splits 10 into 4, 4, 2; tensor_split into 4, 3, 3
    "torch.chunk instead of tensor_split": (
        [("    chunks = torch.tensor_split(tensor.view(-1), n)\n    scratch", "    chunks = tensor.view(-1).chunk(n)\n"
                                                                       "    chunks = list(chunks) + [tensor.view(-1)[:0]] * (n - len(chunks))\n    scratch")],
        grade.check_reduce_scatter, "not chunk r of the sum"),
    # a copy of the chunk returned
    "returns a copy": ([("    return chunks[rank]\n", "    return chunks[rank].clone()\n")],
                       grade.check_reduce_scatter, "a view"),
    # all-gather starting one chunk late
    "all-gather sends the wrong chunk first": (
        [("_ring_step(chunks[(rank - direction * step) % n]", "_ring_step(chunks[(rank - direction * (step + 1)) % n]")],
        grade.check_all_gather, "which chunk does (rank r|each rank) send"),
    # one-way ring for the whole tensor
    "all-reduce uses one direction only": (
        [("    for half, direction in ((first, 1), (second, -1)):\n", "    for half, direction in ((first, 1), (second, 1)):\n")],
        grade.check_bytes, "to EACH neighbour"),
    # the library's collective in disguise
    "all-reduce by dist.all_reduce": (
        [("    first, second = torch.tensor_split(tensor.view(-1), 2)\n",
          "    dist.all_reduce(tensor)\n    return tensor\n    first, second = torch.tensor_split(tensor.view(-1), 2)\n")],
        grade.check_all_reduce, "use only send/recv"),
    # the reduced chunk returned, not the tensor
    "all-reduce returns a chunk": (
        [("        ring_all_gather(half, direction)\n    return tensor\n",
          "        ring_all_gather(half, direction)\n    return first\n")],
        grade.check_all_reduce, "return `tensor` itself"),
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_plausible_wrong_answer_fails(tmp_path, monkeypatch, capsys, name):
    replacements, check, phrase = WRONG[name]
    assert_rejected(tmp_path, monkeypatch, capsys, "ex02_ring_all_reduce", mutated(SOLUTION, replacements), check, phrase,
                    refuse=grade.REFUSE)
