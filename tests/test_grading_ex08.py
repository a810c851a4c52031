"""Exercise 08's checkers (course_lib.grading.ex08_zero2_step) separate right from wrong code.

The plain stub fails, the reference solution passes, a student module that imports the course's
ZeRO (or torch's) is refused, and plausible wrong answers fail where they should, with a message
naming the mistake: the stage-1 step (reduce-scatter after the whole backward; right numbers, too
many bytes held) and its disguise (gradients stashed by the hooks), a step that forgets to divide
by N (AdamW hides a gradient scaled by N, the gradient check does not), shard bounds rounded
down, a full gradient kept beside its shard, and parameters never gathered back whole.
The checks run on 2 ranks here; the exercise notebook runs them on 2 and 4.

Part 2 (Muon's owner step): the stub fails, the solution passes on 2 and 3 ranks, the course's
sharded Muon is refused, and six wrong answers fail with a message naming the mistake: each rank
orthogonalising its own block, every rank gathering and orthogonalising every matrix (right
numbers, too many bytes), owners dealt out in turn regardless of size, the update scattered to
the wrong rows, the update without Muon's sqrt(d0/d1) scale, and the momentum forgotten.
"""

import pathlib

import pytest

from course_lib import RankError, grading, run_on_ranks
from course_lib.grading import ex08_muon
from course_lib.grading import ex08_zero2_step as ex08

from _student import assert_rejected, load_as_student, mutated

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


# ---------------------------------------------------------------- part 2: Muon's owner step
OWNER_BRANCH = """        if rank == owner:
            pieces = [torch.empty_like(u) for _ in range(n)]"""
NON_OWNER_BRANCH = """        else:
            dist.gather(u.contiguous(), gather_list=None, dst=root, group=group)
            dist.scatter(block, scatter_list=None, src=root, group=group)
"""
SCATTER_LIST = "scatter_list=[piece.contiguous() for piece in o.chunk(n)]"
MUON_MUTANTS = {
    # each rank runs Newton-Schulz on its own block: a different (wrong) update
    "own_block": (mutated(SOLUTION, [(OWNER_BRANCH, "        block = newton_schulz(u, ns_steps)\n        if False:\n"
                                                     "            pieces = None"), (NON_OWNER_BRANCH, "")]),
                  "same_as_one_process", "not of its own block"),
    # the "gather" method: every rank assembles and orthogonalises every matrix; right numbers
    "everywhere": (mutated(SOLUTION, [(OWNER_BRANCH, "        full = torch.empty(n * c, d1)\n"
                                                     "        all_gather_single(full, u.contiguous(), group=group)\n"
                                                     "        o = torch.nn.functional.pad(newton_schulz(full[:d0],"
                                                     " ns_steps), (0, 0, 0, n * c - d0))\n"
                                                     "        block = o[rank * c:(rank + 1) * c]\n        if False:\n"
                                                     "            pieces = None"), (NON_OWNER_BRANCH, "")]),
                   "bytes", "only a matrix's owner may gather it whole"),
    "round_robin": (mutated(SOLUTION, [("    load, owners = [0] * world_size, [0] * len(shapes)\n",
                                        "    return [i % world_size for i in range(len(shapes))]\n")]),
                    "owners", "can pile the big ones on one rank"),
    "wrong_rows": (mutated(SOLUTION, [(SCATTER_LIST, "scatter_list=[p.contiguous() for p in reversed(o.chunk(n))]")]),
                   "same_as_one_process", r"rank r's rows must be rows r\*c"),
    "unscaled": (mutated(SOLUTION, [("alpha=-lr * math.sqrt(max(1, d0 / d1))", "alpha=-lr")]),
                 "same_as_one_process",
                 r"your update is 0.577 times Muon's: Muon scales it by sqrt\(max\(1, d0/d1\)\)"),
    "no_momentum": (mutated(SOLUTION, [("        b.lerp_(g, 1 - momentum)", "        pass"),
                                       ("u = g.lerp(b, momentum) if nesterov else b", "u = g")]),
                    "same_as_one_process", r"momentum rows must follow B <- mu B \+ \(1 - mu\) G"),
}


def _muon_check(kind):
    if kind == "owners":
        return lambda student: ex08_muon.check_assign_owners(student.assign_owners)
    check = ex08_muon.check_muon_same_as_one_process if kind == "same_as_one_process" else ex08_muon.check_muon_bytes
    return lambda student: check(ex08_muon.run_muon(student.muon_owner_step, 2))


def test_part2_the_plain_stub_fails(tmp_path, monkeypatch):
    student = _load(tmp_path, monkeypatch)
    with pytest.raises(NotImplementedError):
        ex08_muon.check_assign_owners(student.assign_owners)
    with pytest.raises(RankError, match="NotImplementedError"):
        ex08_muon.run_muon(student.muon_owner_step, 2)


def test_part2_the_solution_passes_on_2_and_3_ranks(tmp_path, monkeypatch, capsys):
    student = _load(tmp_path, monkeypatch, SOLUTION, refuse=ex08.REFUSE)
    ex08_muon.check_assign_owners(student.assign_owners)
    for n in ex08_muon.MUON_WORLD_SIZES:
        out = ex08_muon.run_muon(student.muon_owner_step, n)
        ex08_muon.check_muon_same_as_one_process(out)
        ex08_muon.check_muon_bytes(out)
        # a rank that owns nothing receives its rows of each update in bf16 (the check allows fp32)
        assert out[0]["last rank owns all"]["recv"] == [2 * sum(-(-d0 // n) * d1 for d0, d1 in ex08_muon.MUON_SHAPES)] * 3
    printed = capsys.readouterr().out
    cases, shapes = len(ex08_muon.OWNER_CASES), len(ex08_muon.MUON_SHAPES)
    assert "FAIL" not in printed and printed.count("PASS") == 2 * cases + 2 * (2 * shapes * 2) + 1 + 2, printed


@pytest.mark.parametrize("source", ["from course_lib.parallel.zero.muon import ShardedMuon\n",
                                    "from course_lib.estimate.muon import assign_owners\n",
                                    "import course_lib.estimate.muon as m\n"])
def test_part2_the_course_sharded_muon_is_refused(tmp_path, monkeypatch, source):
    with pytest.raises(grading.CheckFailed, match="already holds this exercise's answer"):
        _load(tmp_path, monkeypatch, "raise RuntimeError('ran')\n" + source, refuse=ex08.REFUSE)


@pytest.mark.parametrize("name", sorted(MUON_MUTANTS))
def test_part2_a_wrong_answer_fails_with_its_mistake_named(tmp_path, monkeypatch, capsys, name):
    source, kind, phrase = MUON_MUTANTS[name]
    assert_rejected(tmp_path, monkeypatch, capsys, "ex08_zero2_step", source, _muon_check(kind), phrase,
                    refuse=ex08.REFUSE)


def test_part2_gathering_everywhere_gets_the_numbers_right(tmp_path, monkeypatch):
    """So only the bytes can tell it from owner-compute."""
    student = _load(tmp_path, monkeypatch, MUON_MUTANTS["everywhere"][0], refuse=ex08.REFUSE)
    ex08_muon.check_muon_same_as_one_process(ex08_muon.run_muon(student.muon_owner_step, 2))


def test_part2_round_robin_fails_only_on_the_balance():
    owners = [i % 2 for i in range(12)]  # what the mutant returns on the first case: valid, unbalanced
    work = [ex08_muon.ns_work(s) for s in ex08_muon.OWNER_CASES[0][1]]
    assert 2 * max(sum(w for w, o in zip(work, owners) if o == r) for r in range(2)) > sum(work) + max(work)
