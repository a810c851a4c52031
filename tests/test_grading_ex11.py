"""Exercise 11's checkers: the stub fails, the reference solution passes, plausible wrong models
fail, and a student module that reaches for the course's step-time model is refused.

The checkers are called directly (no notebook, no ranks): each runs in well under a second.
"""

import pathlib
import math

import pytest

from course_lib import grading
from course_lib.estimate import GPT3_175B, LLAMA3_70B
from course_lib.estimate.clusters import gpu_cluster
from course_lib.dims import ParallelDims
from course_lib.estimate.step_time import step_time
from course_lib.grading import ex11_step_time as ex11

CHECKS = (ex11.check_no_pipeline, ex11.check_pipeline, ex11.check_exposed_dp, ex11.check_measured)


@pytest.fixture
def solution(monkeypatch):
    monkeypatch.setenv(grading.GRADE_WITH_ENV, "solutions")
    return grading.load_student("ex11_step_time", refuse=ex11.REFUSED).step_time_dp_tp


@pytest.fixture
def stub(monkeypatch):
    monkeypatch.delenv(grading.GRADE_WITH_ENV, raising=False)
    return grading.load_student("ex11_step_time", refuse=ex11.REFUSED).step_time_dp_tp


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_stub_fails(check, stub):
    with pytest.raises(NotImplementedError):
        check(stub)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_solution_passes(check, solution, capsys):
    check(solution)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "grading exercises/ex11_step_time/student.py"  # the file graded, then the checks
    assert out[1:] and all(line.startswith("PASS  ") for line in out[1:])


def _wrong(solution, change):
    """The solution with one term replaced by change(terms, layout), the total kept consistent."""
    def fn(config, cluster, dp, tp, micro_batch, m=1, pp=1, v=1, seq=None, recipe="bf16_mixed"):
        t = solution(config, cluster, dp, tp, micro_batch, m, pp, v, seq, recipe)
        t.update(change(t, dict(dp=dp, tp=tp, pp=pp, m=m, v=v, overlap=cluster.overlap)))
        t["total"] = t["compute"] + t["overhead"] + t["tp"] + t["dp_exposed"] + t["bubble"]
        return t
    return fn


def _busy(t):
    return t["compute"] + t["overhead"] + t["tp"]


WRONG = {
    # the bubble fraction f = (p-1)/(vm+p-1) taken as a share of the busy time, not of the step
    "bubble = busy * f": (lambda t, L: {"bubble": _busy(t) * (L["pp"] - 1) / (L["v"] * L["m"] + L["pp"] - 1)},
                          (ex11.check_pipeline,)),
    # the interleaved schedule's chunks forgotten
    "bubble without v": (lambda t, L: {"bubble": _busy(t) * (L["pp"] - 1) / L["m"]}, (ex11.check_pipeline,)),
    # nothing hidden: all of the data-parallel all-reduce on the critical path
    "all dp traffic exposed": (lambda t, L: {"dp_exposed": t["dp_total"]},
                               (ex11.check_no_pipeline, ex11.check_exposed_dp)),
    # hidden by the whole backward of the step, not the last micro-batch's
    "hidden by all of backward": (lambda t, L: {"dp_exposed": max(0.0, t["dp_total"] - L["overlap"] * 2 / 3 *
                                                                  t["compute"])},
                                  (ex11.check_no_pipeline, ex11.check_pipeline, ex11.check_exposed_dp)),
    # tensor parallelism's backward all-reduces forgotten
    "tp forward only": (lambda t, L: {"tp": t["tp"] / 2}, CHECKS),
}


@pytest.mark.parametrize("name", WRONG)
def test_plausible_wrong_models_fail(name, solution):
    change, checks = WRONG[name]
    for check in checks:
        with pytest.raises(grading.CheckFailed):
            check(_wrong(solution, change))


def test_a_total_that_is_not_the_sum_fails(solution):
    def fn(*args, **kw):
        t = solution(*args, **kw)
        t["total"] += t["dp_total"]  # the whole all-reduce added on top of its exposed part
        return t
    with pytest.raises(grading.CheckFailed, match="is not compute"):
        ex11.check_no_pipeline(fn)


@pytest.mark.parametrize("source", [
    "from course_lib.estimate.step_time import step_time\n",
    "from course_lib.estimate import step_time\n",  # the package's name for the module (or a re-export)
    "import course_lib.estimate.step_time as st\n",
    "from course_lib.estimate.planner import plan\n",
    "from course_lib.capstone.report import compare\nx = compare\n",  # a library helper that wraps step_time
    "from course_lib.measure.validation import compare\n",
    "import course_lib\nx = course_lib.estimate.step_time.step_time\n",
])
def test_a_module_reaching_for_the_step_time_model_is_refused(source, tmp_path, monkeypatch):
    (tmp_path / "ex11_step_time").mkdir()
    (tmp_path / "ex11_step_time" / "student.py").write_text(source + "def step_time_dp_tp(*a, **k):\n    pass\n")
    monkeypatch.setattr(grading, "EXERCISES_DIR", tmp_path)
    monkeypatch.delenv(grading.GRADE_WITH_ENV, raising=False)
    with pytest.raises(grading.CheckFailed, match="already holds this exercise's answer"):
        grading.load_student("ex11_step_time", refuse=ex11.REFUSED)


def test_the_stub_and_the_solution_are_not_refused():
    for path in ("exercises/ex11_step_time/student.py", "exercises/solutions/ex11_step_time.py"):
        source = (pathlib.Path(__file__).resolve().parents[1] / path).read_text()
        assert grading.refused_uses(source, ex11.REFUSED) == []


# The stored values against the course's full model (what EXPECTED's comment promises): compute
# equal to float64 rounding; tp and dp within 1%, since the full model also counts the
# embedding's, head's and loss's all-reduces (2 + 3 small ones per micro-batch beside 4 per
# layer) and sums the all-reduce's alpha terms per bucket or parameter group.
@pytest.mark.parametrize("key", list(ex11.EXPECTED))
def test_the_stored_values_agree_with_the_full_model(key):
    model, (gpu, n), seq, layout = key
    config, kw = {"GPT-3 175B": GPT3_175B, "Llama-3 70B": LLAMA3_70B}[model], dict(layout)
    batch = kw["dp"] * kw["m"] * kw["micro_batch"]
    ref = step_time(config, ParallelDims(dp=kw["dp"], tp=kw["tp"], microbatches=kw["m"]), gpu_cluster(gpu, n), batch, seq)
    stored = ex11.EXPECTED[key]
    assert math.isclose(stored["compute"], ref["compute"], rel_tol=1e-11)  # 12 significant digits stored
    for term in ("tp", "dp_total", "dp_exposed"):
        assert math.isclose(stored[term], ref[term], rel_tol=0.01), term
    assert stored["bubble"] == ref["bubble"] == 0.0


def test_the_stored_bubble_agrees_with_the_full_model():
    cluster = gpu_cluster(*ex11.A100_1024)
    for (m, v), stored in ex11.PIPELINE.items():
        dims = ParallelDims(dp=16, tp=8, pp=8, microbatches=m, virtual_stages=v,
                            schedule="interleaved_1f1b" if v > 1 else "1f1b")
        ref = step_time(GPT3_175B, dims, cluster, 16 * m, 2048)  # one sequence per micro-batch
        # the full model's busy time also holds the pipeline's sends (v times as many when
        # interleaved: 6% of the busy time at v = 2 here) and the extra tp calls: within 8%
        assert math.isclose(stored["bubble"], ref["bubble"], rel_tol=0.08), (m, v)
