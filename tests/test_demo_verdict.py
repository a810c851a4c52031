"""The torchrun demos' shared verdict (course_lib/demos/verdict.py): what --check prints and returns."""

import math

from course_lib.demos.verdict import compare_losses, refuse


def test_within_tolerance_is_ok_and_steps_count_from_one(capsys):
    assert compare_losses([2.0, 1.5], [2.0, 1.5 + 1e-6], tolerance=1e-5) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 1  loss 2.000000  single process 2.000000")
    assert out[-1] == "largest difference 1.00e-06 (tolerance 1.0e-05): OK"


def test_beyond_tolerance_is_a_mismatch(capsys):
    assert compare_losses([2.0, 1.5], [2.0, 1.6], tolerance=1e-3) == 1
    assert capsys.readouterr().out.splitlines()[-1].endswith("(tolerance 1.0e-03): MISMATCH")


def test_a_nan_loss_is_a_mismatch_not_ignored(capsys):
    # max(0.0, nan) is 0.0 in Python: a loop of max() would call a diverged run OK
    assert compare_losses([2.0, math.nan, 1.0], [2.0, 1.5, 1.0], tolerance=1.0) == 1
    assert "largest difference nan" in capsys.readouterr().out


def test_refuse_speaks_on_rank_0_only(capsys):
    assert refuse("demo", ValueError("--dp=3 must divide 4"), rank=1) == 2
    assert capsys.readouterr().err == ""
    assert refuse("demo", ValueError("--dp=3 must divide 4"), rank=0) == 2
    assert capsys.readouterr().err == "demo: bad layout: --dp=3 must divide 4\n"


def test_losses_or_check_prints_steps_from_one_or_the_verdict(capsys):
    from types import SimpleNamespace

    from course_lib.demos.verdict import losses_or_check

    plain = SimpleNamespace(check=False, lr=1e-3, tolerance=None)
    assert losses_or_check(plain, [2.0, 1.5], lambda: 1 / 0) == 0  # no reference trained without --check
    assert capsys.readouterr().out.splitlines() == ["step 1  loss 2.000000", "step 2  loss 1.500000"]
    checked = SimpleNamespace(check=True, lr=1e-3, tolerance=1e-3)
    assert losses_or_check(checked, [2.0, 1.5], lambda: SimpleNamespace(train_losses=[2.0, 1.6])) == 1
    assert capsys.readouterr().out.splitlines()[-1].endswith("(tolerance 1.0e-03): MISMATCH")


def test_run_demo_refuses_before_the_process_group_starts(capsys, monkeypatch):
    from course_lib.demos import verdict

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(verdict, "init_from_env", lambda: 1 / 0)  # would start the process group

    def build(args, world):
        raise ValueError(f"--dp=3 must divide {world}")

    assert verdict.run_demo("demo", None, build, None, None) == 2
    assert capsys.readouterr().err == "demo: bad layout: --dp=3 must divide 4\n"
