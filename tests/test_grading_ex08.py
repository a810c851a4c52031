"""Exercise 08's checkers (course_lib.grading.ex08_zero2_step) separate right from wrong code.

The plain stub fails, the reference solution passes, a student module that imports the course's
ZeRO (or torch's) is refused, and plausible wrong answers fail where they should, with a message
naming the mistake: the stage-1 step (reduce-scatter after the whole backward; right numbers, too
many bytes held) and its disguise (gradients stashed by the hooks), a step that forgets to divide
by N (AdamW hides a gradient scaled by N, the gradient check does not), shard bounds rounded
down, a full gradient kept beside its shard, and parameters never gathered back whole.
The checks run on 2 ranks here; the exercise notebook runs them on 2 and 4.
"""

import pathlib

import pytest

from course_lib import RankError, grading, run_on_ranks
from course_lib.grading import ex08_zero2_step as ex08

from _student import load_as_student

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOLUTION = (ROOT / "exercises" / "solutions" / "ex08_zero2_step.py").read_text()
HOOKS = "[p.register_post_accumulate_grad_hook(self._reduce_scatter) for p in self.params]"
STEP = "        shards = [m.grad if m.grad is not None"


def _variant(source: str, replacements) -> str:
    for old, new in replacements:
        assert old in source, old  # the solution still reads as this test expects
        source = source.replace(old, new)
    return source


# Stage 1: no hooks; step() reduce-scatters the gradients backward left on the parameters.
STAGE1 = _variant(SOLUTION, [(HOOKS, "[]"), (STEP, "        for p in self.params:\n"
                                                   "            self._reduce_scatter(p)\n" + STEP)])
# Stage 1 in disguise: the hooks take each full gradient off the parameter and keep it aside.
STASHED = _variant(SOLUTION, [
    (HOOKS, "[p.register_post_accumulate_grad_hook(self._stash) for p in self.params]\n        self.stash = []"),
    ("    def zero_grad(", "    def _stash(self, p):\n        self.stash.append((p, p.grad))\n        p.grad = None\n\n"
                          "    def zero_grad("),
    (STEP, "        for p, g in self.stash:\n            p.grad = g\n            self._reduce_scatter(p)\n"
           "        self.stash = []\n" + STEP)])
NO_MEAN = _variant(SOLUTION, [(".div(self.world_size)", "")])
# floor instead of ceiling: pieces too small whenever N does not divide the tensor
FLOOR = _variant(SOLUTION, [("size = -(-numel // world_size)", "size = numel // world_size")])
# the full gradient kept on the parameter after its shard is taken: the rank holds it all again
KEPT = _variant(SOLUTION, [("        p.grad = None  # the full gradient leaves now: only the shard stays\n", "")])
# only this rank's shard written back: the parameters are never brought back whole
NO_ALL_GATHER = _variant(SOLUTION, [(
    "            full = torch.empty(m.numel() * self.world_size, dtype=m.dtype, device=m.device)\n"
    "            all_gather_single(full, m, group=self.group)\n"
    "            p.copy_(full[:p.numel()].view_as(p))\n",
    "            start, stop = shard_bounds(p.numel(), self.world_size, self.rank)\n"
    "            flat = p.view(-1)\n"
    "            flat[start:min(stop, p.numel())] = m[:max(0, min(stop, p.numel()) - start)]\n")])


def _load(tmp_path, monkeypatch, source=None, refuse=()):
    """load_student on `source` written as the learner's student.py (None: the real stub)."""
    return load_as_student(tmp_path, monkeypatch, "ex08_zero2_step", source, refuse=refuse)


def _shards(student, n=2):
    return run_on_ranks(ex08.rank_gradient_shards, student.Zero2AdamW, world_size=n, **ex08.RANKS)


def test_the_plain_stub_fails(tmp_path, monkeypatch):
    student = _load(tmp_path, monkeypatch)
    with pytest.raises(NotImplementedError):
        ex08.check_shard_bounds(student.shard_bounds)
    with pytest.raises(RankError, match="NotImplementedError"):
        _shards(student)


def test_the_solution_passes(tmp_path, monkeypatch, capsys):
    student = _load(tmp_path, monkeypatch, SOLUTION, refuse=ex08.REFUSE)
    ex08.check_shard_bounds(student.shard_bounds)
    ex08.check_gradient_shards(_shards(student))
    out = ex08.run_training(student.Zero2AdamW, 2)
    for check in (ex08.check_same_as_one_process, ex08.check_state_after_step, ex08.check_peak_gradient_bytes,
                  ex08.check_collectives):
        check(out)
    printed = capsys.readouterr().out
    assert "FAIL" not in printed and printed.count("PASS") == 4 + 3 + 3 + 2 + 2 + 3, printed


@pytest.mark.parametrize("source", [
    "from course_lib.parallel.zero import ShardedOptimizer\n",
    "from course_lib.parallel.zero.stage2 import GradientBuckets\n",
    "import course_lib.parallel.zero as z\n",
    "from torch.distributed.optim import ZeroRedundancyOptimizer\n",
    "import torch.distributed as dist\nopt = dist.optim.ZeroRedundancyOptimizer\n",
    "from torch.distributed.fsdp import fully_shard\n",
])
def test_a_module_using_the_library_zero_is_refused(tmp_path, monkeypatch, source):
    with pytest.raises(grading.CheckFailed, match="already holds this exercise's answer"):
        _load(tmp_path, monkeypatch, "raise RuntimeError('ran')\n" + source, refuse=ex08.REFUSE)


@pytest.mark.parametrize("source", [STAGE1, STASHED], ids=["stage1", "stashed"])
def test_a_stage1_step_fails_on_the_peak_gradient_bytes(tmp_path, monkeypatch, source):
    student = _load(tmp_path, monkeypatch, source, refuse=ex08.REFUSE)
    ex08.check_gradient_shards(_shards(student))  # its numbers are right ...
    out = ex08.run_training(student.Zero2AdamW, 2)
    ex08.check_same_as_one_process(out)
    ex08.check_state_after_step(out)
    ex08.check_collectives(out)
    with pytest.raises(grading.CheckFailed, match="Stage 1 holds them all"):  # ... its memory is not
        ex08.check_peak_gradient_bytes(out)
    assert max(out[0]["peak"]) == ex08.formulas(2)["stage1"]  # every gradient, at the end of backward


def test_a_step_without_the_division_by_n_fails(tmp_path, monkeypatch):
    student = _load(tmp_path, monkeypatch, NO_MEAN, refuse=ex08.REFUSE)
    with pytest.raises(grading.CheckFailed, match="the whole batch's gradient"):
        ex08.check_gradient_shards(_shards(student))


def test_a_floor_division_fails_the_bounds_with_a_hint(tmp_path, monkeypatch):
    student = _load(tmp_path, monkeypatch, FLOOR, refuse=ex08.REFUSE)
    with pytest.raises(grading.CheckFailed, match=r"which is not the answer\.\n every rank's piece has the same "
                                                  r"size S = ceil\(numel / N\)"):
        ex08.check_shard_bounds(student.shard_bounds)


def test_a_step_that_keeps_the_full_gradient_fails(tmp_path, monkeypatch):
    student = _load(tmp_path, monkeypatch, KEPT, refuse=ex08.REFUSE)
    out = ex08.run_training(student.Zero2AdamW, 2)
    with pytest.raises(grading.CheckFailed, match=r"bytes held after each step\(\)"):
        ex08.check_state_after_step(out)
    with pytest.raises(grading.CheckFailed, match="Stage 1 holds them all"):
        ex08.check_peak_gradient_bytes(out)


def test_a_step_without_the_all_gather_fails_on_the_parameters(tmp_path, monkeypatch):
    student = _load(tmp_path, monkeypatch, NO_ALL_GATHER, refuse=ex08.REFUSE)
    out = ex08.run_training(student.Zero2AdamW, 2)
    with pytest.raises(grading.CheckFailed, match="every rank must hold every parameter whole and updated"):
        ex08.check_same_as_one_process(out)


def test_the_sum_instead_of_the_mean_is_named(tmp_path, monkeypatch):
    student = _load(tmp_path, monkeypatch, NO_MEAN, refuse=ex08.REFUSE)
    with pytest.raises(grading.CheckFailed, match="your shards are 2 times the mean gradient") as failure:
        ex08.check_gradient_shards(_shards(student))
    assert "expected" not in str(failure.value)  # the learner's difference and a hint, not the answer


def test_the_checker_holds_no_readable_bounds():
    source = (ROOT / "course_lib" / "grading" / "ex08_zero2_step.py").read_text()
    assert "(96, 128)" not in source and "(9, 12)" not in source


def test_the_formulas():
    f = ex08.formulas(4)
    assert (f["params"], f["P"], f["S"], f["largest"]) == (40, 108_413, 27_104, 12_288)
    assert (f["stage1"], f["stage2_bound"], f["after_step"]) == (433_652, 157_568, 325_248)
    assert ex08.formulas(2)["stage2_bound"] < ex08.formulas(2)["stage1"]  # the check has a margin at N = 2 too


def test_a_world_size_that_does_not_divide_the_batch_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="n=5 ranks must divide the batch of 12"):
        ex08.run_training(object, 5)
