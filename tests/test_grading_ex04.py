"""Exercise 04's checkers (course_lib.grading.ex04_memory_techniques): the stub fails, the
reference solution passes, a student module reaching the course's mixed-precision optimizer or
torch's GradScaler is refused, and plausible wrong answers fail, each with a message naming the
mistake."""

import pathlib

import pytest
import torch

from course_lib import grading
from course_lib.grading import ex04_memory_techniques as grade

from _student import assert_rejected, load_as_student, mutated

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOLUTION = (ROOT / "exercises" / "solutions" / "ex04_memory_techniques.py").read_text()


@pytest.fixture(autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_the_plain_stub_fails(tmp_path, monkeypatch):
    stub = load_as_student(tmp_path, monkeypatch, "ex04_memory_techniques", refuse=grade.REFUSE)
    for check in grade.CHECKS:
        with pytest.raises(NotImplementedError):
            check(stub)


def test_the_reference_solution_passes(tmp_path, monkeypatch, capsys):
    solution = load_as_student(tmp_path, monkeypatch, "ex04_memory_techniques", SOLUTION, refuse=grade.REFUSE)
    for check in grade.CHECKS:
        check(solution)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("grading ") and out[0].endswith("ex04_memory_techniques/student.py")
    assert len(out) == 24 and all(line.startswith("PASS  ") for line in out[1:])


@pytest.mark.parametrize("source", [
    "from course_lib.techniques.amp import MixedPrecisionOptimizer\n",
    "from course_lib.techniques import amp\n",
    "import course_lib.techniques.amp as a\n\ndef helper(g):\n    return a.found_inf(g)\n",
    "from torch.amp import GradScaler\n",
    "import torch\n\ndef helper():\n    return torch.amp.GradScaler('cpu')\n",
])
def test_a_student_module_using_the_library_answer_is_refused(tmp_path, monkeypatch, source):
    with pytest.raises(grading.CheckFailed, match="already holds this exercise's answer"):
        load_as_student(tmp_path, monkeypatch, "ex04_memory_techniques", source + SOLUTION, refuse=grade.REFUSE)


CLIP = "            torch.nn.utils.clip_grad_norm_(masters, max_norm)  # fp32: the squares cannot overflow\n"
CLEAR = "    for p, m in zip(params, masters):\n        p.grad = m.grad = None\n"

# Plausible mistakes, each made in the reference solution's source: (replacements, check, message phrase).
WRONG = {
    # small gradients underflow when divided in fp16
    "unscaled in 16 bits": (
        [("p.grad.to(torch.float32) * (1.0 / loss_scale)", "(p.grad * (1.0 / loss_scale)).to(torch.float32)")],
        grade.check_dynamic_scale, "unscaled in fp32"),
    # a nan passes an isinf test
    "only inf skips the step": (
        [("not torch.isfinite(g).all()", "torch.isinf(g).any()")], grade.check_skip, "step skipped"),
    # the 16-bit parameters written back into the masters: small updates round away again
    "masters refreshed from the 16-bit weights": (
        [("        optimizer.step()\n", "        with torch.no_grad():\n            for p, m in zip(params, masters):\n"
                                     "                m.copy_(p)\n        optimizer.step()\n")],
        grade.check_small_updates, "add up"),
    # the parameters never see the new masters
    "masters not copied back": (
        [("                p.copy_(m)  # round", "                pass  # round")], grade.check_one_step,
        "the masters, rounded"),
    # a skipped step leaves its garbage gradients for the next backward to add to
    "gradients kept on a skipped step": (
        [(CLEAR, ""), ("                p.copy_(m)  # round the fp32 master to the parameter's 16 bits\n",
                       "                p.copy_(m)  # round the fp32 master to the parameter's 16 bits\n"
                       "        for p, m in zip(params, masters):\n            p.grad = m.grad = None\n")],
        grade.check_skip, "gradients cleared"),
    # no clipping at all
    "max_norm ignored": ([(CLIP, "            pass\n")], grade.check_clipping, "global norm"),
    # clipping the scaled 16-bit gradients (max_norm in the wrong units, the norm in fp16)
    "clipped before unscaling": (
        [(CLIP, "            pass\n"), ("    grads = []\n", "    if max_norm is not None:\n"
                                                         "        torch.nn.utils.clip_grad_norm_(params, max_norm)\n"
                                                         "    grads = []\n")],
        grade.check_clipping, "overflow fp16"),
    # each tensor clipped on its own
    "per-tensor clipping": (
        [(CLIP, "            for m in masters:\n                torch.nn.utils.clip_grad_norm_([m], max_norm)\n")],
        grade.check_clipping, "over all the parameters together"),
    # the norm taken from the scaled fp16 gradients, then unscaled
    "norm of the scaled fp16 gradients": (
        [(CLIP, "            norm = torch.stack([p.grad.norm() for p in params if p.grad is not None]).norm()\n"
                "            norm = norm.float().item() / loss_scale\n"
                "            for m in masters:\n"
                "                if m.grad is not None:\n"
                "                    m.grad.mul_(min(1.0, max_norm / (norm + 1e-6)))\n")],
        grade.check_clipping, "overflow fp16"),
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_plausible_wrong_answer_fails(tmp_path, monkeypatch, capsys, name):
    replacements, check, phrase = WRONG[name]
    assert_rejected(tmp_path, monkeypatch, capsys, "ex04_memory_techniques", mutated(SOLUTION, replacements), check, phrase,
                    refuse=grade.REFUSE)
