"""Exercise 14's checkers (course_lib.grading.ex14_debugging) separate right from wrong code.

The untouched stubs fail, the reference solution passes, a student module that imports the
catalogue of broken runs (the answers) or the library's data parallelism is refused before it
runs, and the broken runs themselves, with the plausible half-fixes, fail the check that should
catch them.
"""

import pathlib
import re

import pytest

from course_lib import RankError, grading
from course_lib.grading import ex14_debugging as checks

from _student import load_as_student

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXERCISE = "ex14_debugging"
SOLUTION = (ROOT / "exercises" / "solutions" / f"{EXERCISE}.py").read_text()


def _load(tmp_path, monkeypatch, source: str):
    """Load `source` as the learner's student.py, as the exercise notebook does (with its refusals)."""
    return load_as_student(tmp_path, monkeypatch, EXERCISE, source, refuse=checks.REFUSE)


def test_the_stubs_fail(monkeypatch):
    monkeypatch.delenv(grading.GRADE_WITH_ENV, raising=False)
    stub = grading.load_student(EXERCISE, refuse=checks.REFUSE)
    with pytest.raises(NotImplementedError):
        checks.check_names(stub)
    for check in (lambda: checks.check_sync(stub, world_sizes=(2,)), lambda: checks.check_stop(stub),
                  lambda: checks.check_accumulate(stub)):
        with pytest.raises(RankError, match="NotImplementedError"):
            check()


def test_the_solution_passes(monkeypatch, capsys):
    monkeypatch.setenv(grading.GRADE_WITH_ENV, "solutions")
    solution = grading.load_student(EXERCISE, refuse=checks.REFUSE)
    checks.check_names(solution)
    checks.check_sync(solution)
    checks.check_stop(solution)
    checks.check_accumulate(solution)
    out = capsys.readouterr().out
    assert out.count("PASS") == 1 + (4 + 6) + 6 + 2 * 4 and "FAIL" not in out


def test_the_answers_are_catalogue_names(monkeypatch):
    from course_lib.debugging import BUG_NAMES
    from course_lib.grading.stored import digest

    assert checks.BUG_NAMES == BUG_NAMES
    monkeypatch.setenv(grading.GRADE_WITH_ENV, "solutions")
    names = grading.load_student(EXERCISE, refuse=checks.REFUSE).name_the_bugs()
    assert digest(names) == checks.ANSWER and all(n in BUG_NAMES for n in names.values())
    # one digest for the three: no line of this module maps a single run to its name
    assert "ANSWERS" not in vars(checks) and len(checks.ANSWER) == 64


@pytest.mark.parametrize("line", [
    "from course_lib.demos.broken_run import main",
    "import course_lib.demos.broken_run as demo",
    "from course_lib.parallel.dp import DataParallel",
    "from course_lib.grading.ex14_debugging import ANSWERS",
    "from course_lib.grading import ex14_debugging\nex14_debugging.average_over_ranks(None)",
    "from torch.nn.parallel import DistributedDataParallel",
    "from course_lib.debugging import silent",
    "import course_lib.debugging",
    "from course_lib.debugging.catalogue import BUGS",
])
def test_a_module_importing_the_answer_is_refused(tmp_path, monkeypatch, line):
    with pytest.raises(grading.CheckFailed, match="already holds this exercise's answer"):
        _load(tmp_path, monkeypatch, SOLUTION + "\n" + line + "\n")


def test_what_the_exercise_may_use_is_allowed():
    source = "import torch\nimport torch.distributed as dist\nfrom course_lib.observe import flight_recorder\n"
    assert grading.refused_uses(source, checks.REFUSE) == []
    assert grading.refused_uses(SOLUTION, checks.REFUSE) == []


# Wrong answers: the solution with one definition replaced (appended definitions win).
WRONG_NAMES = '''
def name_the_bugs():
    return {"run 1": "sum_not_avg", "run 2": "nan_on_one_rank", "run 3": "never_sync"}
'''
NOT_A_NAME = '''
def name_the_bugs():
    return {"run 1": "sum instead of mean", "run 2": "skip_collective", "run 3": "never_sync"}
'''
SUM_NOT_AVG = '''
def average_gradients(model):
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
'''
DIVIDED_TWICE = SUM_NOT_AVG.replace("dist.all_reduce(flat)", "dist.all_reduce(flat)\n    flat /= dist.get_world_size() ** 2")
# the reduced buffer never copied back: torch.cat made a copy, p.grad keeps the rank's own gradient
NOT_COPIED_BACK = '''
def average_gradients(model):
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
'''
# run 1 mended the way the broken run was written: correct numbers, one call per parameter
ONE_CALL_PER_PARAMETER = '''
def average_gradients(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
'''
LOCAL_DECISION = '''
def should_stop(local_loss, target):
    return local_loss < target
'''
ANY_RANK_BELOW = '''
def should_stop(local_loss, target):
    t = torch.tensor([local_loss])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.item() < target
'''
RANK_0_DECIDES = '''
def should_stop(local_loss, target):
    flag = torch.tensor([float(local_loss < target)])
    dist.broadcast(flag, src=0)
    return bool(flag.item())
'''
NEVER_SYNC = '''
def accumulation_step(model, optimizer, micro_batches):
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        loss = model(x, y)[1] / len(micro_batches)
        loss.backward()
        total += loss.item()
        if i == len(micro_batches):
            average_gradients(model)
    optimizer.step()
    return total
'''
SYNC_EVERY_MICROBATCH = NEVER_SYNC.replace("if i == len(micro_batches):", "if True:")
NOT_DIVIDED = NEVER_SYNC.replace("model(x, y)[1] / len(micro_batches)", "model(x, y)[1]").replace(
    "if i == len(micro_batches):", "if i == len(micro_batches) - 1:")
# the loss it reports is divided, the one it backpropagates is not: gradients n x, and AdamW's update
# (a ratio of moments) is nearly the same, so the losses agree
BACKWARD_UNDIVIDED = NOT_DIVIDED.replace("total += loss.item()", "total += loss.item() / len(micro_batches)")
# divided by a constant 2 (right for the run's 2 micro-batches only)
DIVIDED_BY_TWO = NEVER_SYNC.replace("model(x, y)[1] / len(micro_batches)", "model(x, y)[1] / 2").replace(
    "if i == len(micro_batches):", "if i == len(micro_batches) - 1:")

WRONG = {"wrong names": WRONG_NAMES, "not a name": NOT_A_NAME, "sum not avg": SUM_NOT_AVG,
         "divided twice": DIVIDED_TWICE, "local decision": LOCAL_DECISION, "any rank below": ANY_RANK_BELOW,
         "rank 0 decides": RANK_0_DECIDES, "never sync": NEVER_SYNC, "sync every micro-batch": SYNC_EVERY_MICROBATCH,
         "micro-batch losses not divided": NOT_DIVIDED, "not copied back": NOT_COPIED_BACK,
         "one call per parameter": ONE_CALL_PER_PARAMETER, "backward undivided": BACKWARD_UNDIVIDED,
         "divided by two": DIVIDED_BY_TWO}


@pytest.mark.parametrize("wrong, check, match", [
    ("wrong names", "names", "At least one name does not explain its run's evidence"),
    ("not a name", "names", "is not a name from the catalogue"),
    ("sum not avg", "sync", r"your gradients differ \(norm 2 x .*a sum, not a mean"),
    ("divided twice", "sync", r"your gradients differ \(norm 0.5 x"),
    ("not copied back", "sync", r"your gradients differ \(norm .*never reached p.grad"),
    ("one call per parameter", "sync", "collective calls average_gradients makes in each of 3 steps"),
    ("local decision", "stop", "every rank's decision"),
    ("any rank below", "stop", "every rank's decision"),
    ("rank 0 decides", "stop", "every rank's decision"),
    ("never sync", "accumulate", "parameters differ from rank 0's"),
    ("sync every micro-batch", "accumulate", "bytes each rank all-reduces per step"),
    ("micro-batch losses not divided", "accumulate", r"2 micro-batches: the gradient step 1 applies .*norm 2 x"),
    ("backward undivided", "accumulate", r"2 micro-batches: the gradient step 1 applies .*went into backward undivided"),
    ("divided by two", "accumulate", r"4 micro-batches: the gradient step 1 applies .*norm 2 x"),
])
def test_a_wrong_answer_fails_its_check(tmp_path, monkeypatch, wrong, check, match):
    student = _load(tmp_path, monkeypatch, SOLUTION + WRONG[wrong])
    run = {"names": lambda: checks.check_names(student), "sync": lambda: checks.check_sync(student, world_sizes=(2,)),
           "stop": lambda: checks.check_stop(student), "accumulate": lambda: checks.check_accumulate(student)}[check]
    with pytest.raises(grading.CheckFailed, match=re.compile(match, re.DOTALL)):  # the hint is on its own line
        run()


def test_the_broken_runs_hang_or_differ_and_the_hang_is_named(tmp_path):
    """Run 2's broken rule hangs: the flight recorder names the rank left waiting and the call."""
    from course_lib.runtime import HangAnalysed, run_recorded

    with pytest.raises(HangAnalysed) as info:
        run_recorded(checks.train_until, checks.run_2_should_stop, world_size=2, backend="gloo", timeout_s=12,
                     stuck_after_s=4, dump_dir=tmp_path)
    assert info.value.analysis.splitlines()[0] == (
        "rank 0 never entered all_reduce #145 on group [0, 1] that rank 1 waits in "
        "(its last call: all_reduce #144 on group [0, 1], completed)")
