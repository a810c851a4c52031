"""Exercise 05's checkers (course_lib.grading.ex05_tensor_parallel) separate right from wrong code.

The untouched stubs fail, the reference solution passes, a student module that imports the
library's tensor parallelism is refused before it runs, and plausible wrong answers (f or g
communicating in the wrong direction, a bias added before the sum, a contiguous cut of the
fused QKV rows) fail the check that should catch them.
"""

import pathlib

import pytest

from course_lib import RankError, grading
from course_lib.grading import ex05_tensor_parallel as checks
from course_lib.grading import ex05_uneven as uneven

from _student import assert_rejected, load_as_student, mutated

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXERCISE = "ex05_tensor_parallel"
SOLUTION = (ROOT / "exercises" / "solutions" / f"{EXERCISE}.py").read_text()


def _load(tmp_path, monkeypatch, source: str):
    """Load `source` as the learner's student.py, as the exercise notebook does (with its refusals)."""
    return load_as_student(tmp_path, monkeypatch, EXERCISE, source, refuse=checks.REFUSE)


def test_the_stubs_fail(monkeypatch):
    monkeypatch.delenv(grading.GRADE_WITH_ENV, raising=False)
    stub = grading.load_student(EXERCISE, refuse=checks.REFUSE)
    with pytest.raises(NotImplementedError):
        checks.check_qkv_rows(stub)
    with pytest.raises(RankError, match="NotImplementedError"):
        checks.check_f_and_g(stub, world_sizes=(2,))
    with pytest.raises(RankError, match="NotImplementedError"):
        checks.check_mlp(stub, world_sizes=(2,))
    with pytest.raises(RankError, match="NotImplementedError"):
        uneven.check_uneven_mlp(stub, cases=((2, 7),))


def test_the_solution_passes(monkeypatch, capsys):
    monkeypatch.setenv(grading.GRADE_WITH_ENV, "solutions")
    solution = grading.load_student(EXERCISE, refuse=checks.REFUSE)
    checks.check_f_and_g(solution)
    checks.check_qkv_rows(solution)
    checks.check_mlp(solution)
    checks.check_gpt(solution)
    uneven.check_uneven_mlp(solution)
    out = capsys.readouterr().out
    assert out.count("PASS") > 50 and "FAIL" not in out


@pytest.mark.parametrize("line", [
    "from course_lib.parallel.tp import qkv_rows",
    "from course_lib.parallel.tp import ColumnParallelLinear, RowParallelLinear",
    "from course_lib.parallel.tp.layers import ColumnParallelLinear",
    "from course_lib.parallel.tp.functions import enter_region, leave_region",
    "from course_lib.parallel.tp.apply import qkv_rows as rows",
    "import course_lib.parallel.tp as tp",
    "from course_lib.comm.autograd import copy_to_group as f, reduce_from_group as g",
    "from course_lib.comm import autograd\nCopyToGroup = autograd._CopyToGroup",
    "from torch.distributed.tensor.parallel import ColwiseParallel",
    "from course_lib.grading.ex05_tensor_parallel import _qkv_problems",
])
def test_a_module_importing_the_librarys_answer_is_refused(tmp_path, monkeypatch, line):
    with pytest.raises(grading.CheckFailed, match="already holds this exercise's answer"):
        _load(tmp_path, monkeypatch, SOLUTION + "\n" + line + "\n")


def test_what_the_exercise_may_use_is_allowed():
    source = ("import torch\nimport torch.distributed as dist\nimport torch.nn.functional as F\n"
              "from course_lib.comm.compat import all_gather_single\nfrom course_lib.model import GPT\n")
    assert grading.refused_uses(source, checks.REFUSE) == []
    assert grading.refused_uses(SOLUTION, checks.REFUSE) == []


# Wrong answers: the solution with one definition replaced (appended definitions win: the layers
# look f, g and the classes up when they run).
F_ALL_REDUCES_FORWARD = '''
class _F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _summed(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _summed(grad, ctx.group), None

def f(x, group=None):
    return _F.apply(x, group)
'''
F_BACKWARD_DOES_NOT_SUM = '''
class _F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None

def f(x, group=None):
    return _F.apply(x, group)
'''
G_BACKWARD_SUMS = '''
class _G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _summed(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _summed(grad, ctx.group), None

def g(x, group=None):
    return _G.apply(x, group)
'''
G_SUMS_IN_PLACE = '''
class _G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)  # sums into the caller's tensor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None

def g(x, group=None):
    return _G.apply(x, group)
'''
BIAS_BEFORE_THE_SUM = '''
_Row = RowParallelLinear

class RowParallelLinear(_Row):
    def forward(self, x):
        return g(F.linear(x, self.weight, self.bias), self.group)
'''
CONTIGUOUS_QKV = '''
def qkv_rows_for_rank(d_model, n_head, tp, rank):
    local = 3 * d_model // tp
    return list(range(rank * local, (rank + 1) * local))
'''
HEADS_DEALT_ROUND_ROBIN = '''
def qkv_rows_for_rank(d_model, n_head, tp, rank):
    d_head = d_model // n_head
    heads = range(rank, n_head, tp)  # rank 0 takes heads 0, tp, 2tp, ...
    return [part * d_model + h * d_head + i for part in range(3) for h in heads for i in range(d_head)]
'''

SHARD_IS_A_VIEW = '''
_Row = RowParallelLinear

class RowParallelLinear(_Row):
    def __init__(self, full, group=None):
        super().__init__(full, group)
        local = full.in_features // dist.get_world_size(group)
        r = dist.get_rank(group)
        self.weight = nn.Parameter(full.weight.detach()[:, r * local:(r + 1) * local])  # a view: no copy
'''


WRONG = {"shard is a view": SHARD_IS_A_VIEW, "f all-reduces forward": F_ALL_REDUCES_FORWARD, "f backward does not sum": F_BACKWARD_DOES_NOT_SUM,
         "g backward sums": G_BACKWARD_SUMS, "g sums in place": G_SUMS_IN_PLACE,
         "bias before the sum": BIAS_BEFORE_THE_SUM, "contiguous qkv": CONTIGUOUS_QKV,
         "heads dealt round robin": HEADS_DEALT_ROUND_ROBIN}


@pytest.mark.parametrize("wrong, check, match", [
    ("f all-reduces forward", "f_and_g", "f forward gives the rank its own x"),
    ("f backward does not sum", "f_and_g", "f backward gives x the gradient summed"),
    ("f backward does not sum", "mlp", "input gradient equals the single process's"),
    ("g backward sums", "f_and_g", "g backward gives the rank its own gradient"),
    ("g backward sums", "mlp", "input gradient equals the single process's"),
    ("g sums in place", "f_and_g", "g leaves its input unchanged"),
    ("bias before the sum", "mlp", "output equals the single process's"),
    ("contiguous qkv", "qkv_rows", "must come from the K part"),
    ("contiguous qkv", "gpt", "loss equals the single process's"),
    ("heads dealt round robin", "qkv_rows", "reads the outputs of heads"),
    ("shard is a view", "mlp", r"the full layers unchanged by an SGD step on the shards \(a shard is a copy, not a view\)"),
])
def test_a_wrong_answer_fails_its_check(tmp_path, monkeypatch, wrong, check, match):
    student = _load(tmp_path, monkeypatch, SOLUTION + WRONG[wrong])
    run = {"f_and_g": lambda: checks.check_f_and_g(student, world_sizes=(2,)),
           "mlp": lambda: checks.check_mlp(student, world_sizes=(2,)),
           "qkv_rows": lambda: checks.check_qkv_rows(student),
           "gpt": lambda: checks.check_gpt(student)}[check]
    with pytest.raises(grading.CheckFailed, match=match):
        run()


# uneven_mlp (a hidden width tp does not divide): each wrong answer is the solution with its
# fragments replaced (every old fragment must occur in the solution), graded on the case that
# separates it from the right answer.
SHARE = ("    start = rank * base + min(rank, extra)\n"
         "    return list(range(start, start + base + (rank < extra)))")
UNEVEN_WRONG = {
    # hidden // tp features per rank: the remainder is dropped
    "floor share drops the remainder": ([(SHARE, "    return list(range(rank * base, (rank + 1) * base))")],
                                        (2, 7), "computed on no rank"),
    # equal blocks, and the last rank takes what is left over (2, 2, 2, 4 for 10 on 4)
    "last rank takes the remainder": ([(SHARE, "    start = rank * base\n"
                                               "    return list(range(start, start + base + (extra if rank == tp - 1 else 0)))")],
                                      (4, 10), "differ by more than one"),
    # blocks of ceil(H / tp), the last one cut short (3, 3, 3, 1 for 10 on 4)
    "ceil blocks": ([(SHARE, "    size = -(-hidden // tp)\n"
                             "    return list(range(min(rank * size, hidden), min((rank + 1) * size, hidden)))")],
                    (4, 10), "differ by more than one"),
    # proj split as if tp divided H: the library-style equal blocks of in_features // tp
    "proj split evenly": ([("        self.proj = _RowShard(proj, mine, group)",
                            "        self.proj = RowParallelLinear(proj, group)")],
                          (2, 7), "proj's columns are not the hidden features its fc computes"),
    # the proj bias added on every rank before the sum
    "proj bias on every rank": ([("        y = g(F.linear(h, self.weight), self.group)\n"
                                  "        return y + self.bias if self.bias is not None else y",
                                  "        return g(F.linear(h, self.weight, self.bias), self.group)")],
                                (4, 10), "proj bias is counted 4 times"),
    # fc's shard applied without f: x's gradient is only this rank's part
    "fc without f": ([("        return self.proj(F.gelu(self.fc(x)))",
                       "        return self.proj(F.gelu(F.linear(x, self.fc.weight, self.fc.bias)))")],
                     (2, 7), "input gradient equals the single process's"),
}


@pytest.mark.parametrize("wrong", list(UNEVEN_WRONG))
def test_a_wrong_uneven_mlp_fails_with_its_message(tmp_path, monkeypatch, capsys, wrong):
    replacements, case, phrase = UNEVEN_WRONG[wrong]
    assert_rejected(tmp_path, monkeypatch, capsys, EXERCISE, mutated(SOLUTION, replacements),
                    lambda student: uneven.check_uneven_mlp(student, cases=(case,)), phrase, refuse=checks.REFUSE)
