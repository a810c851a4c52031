"""Exercise 13's checkers (course_lib.grading.ex13_diloco): the stub fails, the reference solution
passes, a student module that reaches the library's outer step is refused, and plausible wrong
answers fail with their mistake named."""

import pathlib

import pytest
import torch

from course_lib import grading
from course_lib.grading import ex13_diloco as grade
from course_lib.runtime.pool import RankError

from _student import assert_rejected, load_as_student, mutated

ROOT = pathlib.Path(__file__).resolve().parent.parent
EX = "ex13_diloco"
SOLUTION = (ROOT / "exercises" / "solutions" / f"{EX}.py").read_text()

STEP = "        a.sub_(outer_lr * (delta + mu * b))"
MOMENTUM = "        b.mul_(mu).add_(delta)"
# name -> (replacements made in the solution's source, a phrase of the message)
WRONG = {
    # LocalSGD: theta_0 <- mean theta_r (lr 1, no momentum)
    "parameters averaged": ([(STEP, "        a.sub_(delta)")], "LocalSGD's average"),
    "sign error": ([(STEP, "        a.add_(outer_lr * (delta + mu * b))")], "a sign error"),
    "plain momentum": ([(STEP, "        a.sub_(outer_lr * b)")], "plain \\(heavy-ball\\) momentum"),
    "momentum after the step": ([(MOMENTUM + "\n" + STEP, STEP + "\n" + MOMENTUM)], "updated after the step"),
    # b rebound to a new tensor: the caller's buffer stays zero
    "momentum not kept": ([(MOMENTUM, "        b = b * mu + delta")], "starts from zero every round"),
    "summed": ([(" / count", "")], "summed over the replicas, not averaged"),
    "divided by the group size": ([(" / count", " / dist.get_world_size(group)")], "divided by all the replicas"),
    "absent replica counted": ([("    if not present:\n        flat.zero_()\n", "")], "contributed its delta"),
    "theta_0 not written back": ([("        p.copy_(a)", "        pass")], "write theta_0 back"),
    # only the present replicas update their outer copy: the absent one falls out of step
    "absent replica keeps its outer state": ([(STEP, "        a.sub_(outer_lr * (delta + mu * b) if present else 0)")],
                                             r"replica 1 \(outside the quorum\) leaves the round with another"),
    # new tensors bound to the local name: the caller's theta_0 never moves
    "theta_0 rebound, not updated": ([(STEP, "        a = a - outer_lr * (delta + mu * b)")],
                                      "theta_0 did not change"),
}


def _load(tmp_path, monkeypatch, source=None):
    return load_as_student(tmp_path, monkeypatch, EX, source, refuse=grade.REFUSE)


def test_the_plain_stub_fails(tmp_path, monkeypatch):
    stub = _load(tmp_path, monkeypatch)
    with pytest.raises(RankError, match="NotImplementedError"):
        grade.check_made_up_rounds(stub)


def test_the_solution_passes(tmp_path, monkeypatch, capsys):
    student = _load(tmp_path, monkeypatch, SOLUTION)
    grade.check_made_up_rounds(student)
    grade.check_training(student)
    out = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("[rank")]
    assert out[0].startswith("grading ") and out[0].endswith(f"{EX}/student.py")
    assert len(out) == 6 and all(line.startswith("PASS  ") for line in out[1:]), out


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_plausible_wrong_answer_fails_with_its_mistake_named(tmp_path, monkeypatch, capsys, name):
    replacements, phrase = WRONG[name]
    assert_rejected(tmp_path, monkeypatch, capsys, EX, mutated(SOLUTION, replacements), grade.check_made_up_rounds,
                    phrase, refuse=grade.REFUSE)


def test_a_replica_that_skips_the_round_is_named(tmp_path, monkeypatch, capsys):
    """An absent replica that returns at once: its all-reduces pair with the others' of other
    rounds (same shapes), and it keeps its own parameters; the check names it."""
    monkeypatch.setitem(grade.RANKS, "timeout_s", 30)  # were the calls to hang instead, the check says so
    source = mutated(SOLUTION, [("    vote = ", "    if not present:\n        return\n    vote = ")])
    assert_rejected(tmp_path, monkeypatch, capsys, EX, source, grade.check_made_up_rounds,
                    "outside the quorum, does not leave the round at the new theta_0", refuse=grade.REFUSE)


def test_a_float32_buffer_is_not_a_mistake(tmp_path, monkeypatch, capsys):
    """The deltas carried in a float32 buffer round to ~1e-8 here: within the check's tolerance."""
    source = mutated(SOLUTION, [("    if not present:", "    flat = flat.float()\n    if not present:")])
    grade.check_made_up_rounds(_load(tmp_path, monkeypatch, source))
    assert capsys.readouterr().out.count("PASS") == 2


def test_the_training_check_rejects_localsgd(tmp_path, monkeypatch, capsys):
    """The check on real training fails by itself on a wrong step (not only the made-up rounds)."""
    source = mutated(SOLUTION, WRONG["parameters averaged"][0])
    assert_rejected(tmp_path, monkeypatch, capsys, EX, source, grade.check_training,
                    "differ from DiLoCo computed in one process", refuse=grade.REFUSE)


def test_the_replay_with_every_replica_present_is_simulate_diloco():
    """The in-grader reference of the quorum run, with a full quorum, is the library's simulation."""
    from course_lib.parallel.diloco import simulate_diloco
    config, cfg = grade.train_setup()
    want = simulate_diloco(config, cfg, 3, grade.H, grade.LR, grade.MU)[0].final_params
    # one process, the same operations in the same order but the replicas' sum: fp32 rounding only
    assert torch.allclose(grade.replay(config, cfg, 3, [(0, 1, 2)] * grade.ROUNDS), want, rtol=0, atol=1e-6)
    assert not torch.allclose(grade.replay(config, cfg, 3, [(0, 1, 2), (0, 2), (0, 1, 2)]), want, rtol=0, atol=1e-4)


def test_every_known_mistake_is_told_apart():
    """No two trajectories of the mistakes (nor the right one) coincide on the made-up rounds."""
    for n, quorums in grade.QUORUMS.items():
        trajectories = [grade._trajectory(n, quorums)] + [grade._trajectory(n, quorums, m) for m in grade.MISTAKES]
        for i, a in enumerate(trajectories):
            for b in trajectories[i + 1:]:
                assert max(grade._differs(x[0], y[0]) for x, y in zip(a, b)) > 1e-3


@pytest.mark.parametrize("source", [
    "from course_lib.parallel.diloco.outer import NesterovOuter\n",
    "from course_lib.parallel.diloco import NesterovOuter\n",  # the package's re-export
    "from course_lib.parallel.diloco.training import average\n",
    # indirect: a module alias used inside a function, and a helper module that reaches the answer
    "import course_lib.parallel.diloco as d\n\ndef helper(ps, lr, mu):\n    return d.NesterovOuter(ps, lr, mu)\n",
    "from course_lib.parallel.diloco.simulate import simulate_diloco\n",
])
def test_a_student_module_using_the_library_outer_step_is_refused(tmp_path, monkeypatch, source):
    with pytest.raises(grading.CheckFailed, match="already holds this exercise's answer"):
        _load(tmp_path, monkeypatch, source + SOLUTION)


def test_the_checker_holds_no_expected_values():
    source = pathlib.Path(grade.__file__).read_text()
    assert "momentum_buffer" in source  # the reference is torch's SGD, evaluated when the check runs
    assert "NesterovOuter" not in source.replace("(NesterovOuter)", "")
