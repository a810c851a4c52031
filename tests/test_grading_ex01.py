"""Exercise 01's checkers (course_lib.grading.ex01_memory_math): the stub fails, the reference
solution passes, a student module reaching the course's estimator is refused, and plausible
wrong answers fail, each with a message naming the mistake."""

import pathlib

import pytest

from course_lib import grading
from course_lib.grading import ex01_memory_math as grade

from _student import assert_rejected, load_as_student, mutated

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOLUTION = (ROOT / "exercises" / "solutions" / "ex01_memory_math.py").read_text()


def plans(student):
    grade.check_plan("one node, 8 GPUs", student.plan_70b_on_8_gpus(), 8, allow_offload=True)
    grade.check_plan("8 nodes, 64 GPUs", student.plan_70b_on_64_gpus(), 64, allow_offload=False)


CHECKS = (grade.check_state_bytes, grade.check_needs_offload, plans, grade.check_training_days)


def test_the_plain_stub_fails(tmp_path, monkeypatch):
    stub = load_as_student(tmp_path, monkeypatch, "ex01_memory_math", refuse=grade.REFUSE)
    for check in CHECKS:
        with pytest.raises(NotImplementedError):
            check(stub)


def test_the_reference_solution_passes(tmp_path, monkeypatch, capsys):
    solution = load_as_student(tmp_path, monkeypatch, "ex01_memory_math", SOLUTION, refuse=grade.REFUSE)
    for check in CHECKS:
        check(solution)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("grading ") and out[0].endswith("ex01_memory_math/student.py")
    assert len(out) == 10 and all(line.startswith("PASS  ") for line in out[1:])


@pytest.mark.parametrize("source", [
    "from course_lib.estimate import model_state_bytes\n",
    "from course_lib import estimate\n",
    "import course_lib.estimate.memory as mem\n\ndef helper(n):\n    return mem.model_state_bytes(n)\n",
    "from course_lib.estimate.compute import training_time\n",
    "import course_lib\n\ndef helper(n):\n    return course_lib.estimate.training_flops(n, 1)\n",
])
def test_a_student_module_using_the_library_answer_is_refused(tmp_path, monkeypatch, source):
    with pytest.raises(grading.CheckFailed, match="already holds this exercise's answer"):
        load_as_student(tmp_path, monkeypatch, "ex01_memory_math", source + SOLUTION, refuse=grade.REFUSE)


# Plausible mistakes, each made in the reference solution's source: (replacements, check, message phrase).
WRONG = {
    # shards rounded down: the padding forgotten (and a model smaller than dp holds nothing)
    "shard rounded down": ([("shard = -(-n_params // dp)", "shard = n_params // dp")],
                           grade.check_state_bytes, "padded shard"),
    # n / dp in floats: a fraction of an element
    "fractional shard": ([("shard = -(-n_params // dp)", "shard = n_params / dp")],
                         grade.check_state_bytes, "whole elements"),
    # stage 1 taken to shard the gradients as well
    "stages shifted": ([("grad * (shard if zero_stage >= 2 else n_params)", "grad * (shard if zero_stage >= 1 else n_params)")],
                       grade.check_state_bytes, "which of them does each ZeRO stage shard"),
    # the fp32 accumulation buffer forgotten
    "fp32 accumulation buffer forgotten": ([('"bf16_fp32_accum": (2, 6, 12)', '"bf16_fp32_accum": (2, 2, 12)')],
                                           grade.check_state_bytes, "per parameter in this recipe"),
    # autocast taken for bf16 storage (same 16 bytes in all, split differently)
    "autocast stores bf16": ([('"bf16_autocast": (4, 4, 8)', '"bf16_autocast": (2, 2, 12)')],
                             grade.check_state_bytes, "per parameter in this recipe"),
    # exactly full counted as not fitting
    "the limit itself refused": ([("/ n_gpus > gpu_bytes", "/ n_gpus >= gpu_bytes")],
                                 grade.check_needs_offload, "exactly fills"),
    # 16 bytes assumed whatever the argument says
    "bytes_per_param ignored": ([("n_params * bytes_per_param / n_gpus", "n_params * 16 / n_gpus")],
                                grade.check_needs_offload, "bytes_per_param is an argument"),
    # hours, not days
    "seconds per hour": ([("/ 86400", "/ 3600")], grade.check_training_days, "a day is how many seconds"),
    # MFU left out
    "MFU forgotten": ([("(n_gpus * peak_flops * mfu)", "(n_gpus * peak_flops)")], grade.check_training_days,
                      "deliver how many FLOP/s"),
    # the 8-GPU plan without offload: the optimizer state alone is 12 B x 70.6e9 / 8 per GPU
    "8 GPUs without offload": ([('"zero_stage": 0, "recompute": "selective", "offload": "optimizer"}',
                                 '"zero_stage": 0, "recompute": "selective", "offload": "none"}')],
                               plans, "more than the budget"),
    # tensor parallelism across nodes
    "tp across nodes": ([('{"dp": 8, "tp": 8, "pp": 1, "zero_stage": 1', '{"dp": 4, "tp": 16, "pp": 1, "zero_stage": 1')],
                        plans, "stays inside one node"),
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_plausible_wrong_answer_fails(tmp_path, monkeypatch, capsys, name):
    replacements, check, phrase = WRONG[name]
    assert_rejected(tmp_path, monkeypatch, capsys, "ex01_memory_math", mutated(SOLUTION, replacements), check, phrase,
                    refuse=grade.REFUSE)
