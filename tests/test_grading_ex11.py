"""Exercise 11's checkers: the stub fails, the reference solution passes, plausible wrong models
fail, and a student module that reaches for the course's step-time model is refused.

The checkers are called directly (no notebook, no ranks): each runs in well under a second.
"""

import importlib.util
import math
import pathlib
import re

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


SOLUTION = (pathlib.Path(__file__).resolve().parents[1] / "exercises" / "solutions" / "ex11_step_time.py").read_text()


def _module(tmp_path, source, name="wrong_ex11"):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Plausible wrong models, each one change to the reference solution's source:
# (old fragment, new fragment, the check that must reject it, a phrase its message must hold)
WRONG = {
    "dp group of adjacent ranks": ("cluster.link(dp, tp)", "cluster.link(dp, 1)", ex11.check_no_pipeline,
                                   "crosses the link of a group of adjacent ranks"),
    "tp group dp apart": ("cluster.link(tp, 1)", "cluster.link(tp, dp)", ex11.check_no_pipeline,
                          "crosses the link of ranks dp apart"),
    "fixed cost once per step": ("overhead = (layers + 1) * m * cluster.layer_overhead",
                                 "overhead = (layers + 1) * cluster.layer_overhead", ex11.check_no_pipeline,
                                 "counted once per step"),
    "fixed cost on every layer of the model": ("overhead = (layers + 1) * m * cluster.layer_overhead",
                                               "overhead = (config.n_layer + 1) * m * cluster.layer_overhead",
                                               ex11.check_pipeline, "counts every layer of the model"),
    "embedding and head left out": ("overhead = (layers + 1) * m * cluster.layer_overhead",
                                    "overhead = layers * m * cluster.layer_overhead", ex11.check_no_pipeline,
                                    "leaves out the embedding, head and loss"),
    "tp forward only": ("tp_time = 4 * layers", "tp_time = 2 * layers", ex11.check_no_pipeline,
                        "two all-reduces per layer"),
    "hidden by all of backward": ("last_backward = (2 / 3) * compute / m", "last_backward = (2 / 3) * compute",
                                  ex11.check_no_pipeline, "hides behind the whole step's backward"),
    "all dp traffic exposed": ("dp_exposed = max(0.0, dp_total - cluster.overlap * last_backward)",
                               "dp_exposed = dp_total", ex11.check_no_pipeline, "is all exposed"),
    "bubble = busy * f": ("bubble = busy * (pp - 1) / (v * m)", "bubble = busy * (pp - 1) / (v * m + pp - 1)",
                          ex11.check_pipeline, "fraction of the busy time"),
    "bubble without v": ("bubble = busy * (pp - 1) / (v * m)", "bubble = busy * (pp - 1) / m", ex11.check_pipeline,
                         "ignores the interleaved schedule's v chunks"),
    "activations always 4 bytes": ('e = 4 if recipe == "fp32" else 2', "e = 4", ex11.check_no_pipeline,
                                   "your tp = .* of how many bytes"),
    "backward half the FLOPs": ("last_backward = (2 / 3)", "last_backward = (1 / 2)", ex11.check_no_pipeline,
                                "your dp_exposed = .*which backward work runs after the gradients are final"),
}


@pytest.mark.parametrize("name", WRONG)
def test_plausible_wrong_models_fail(name, tmp_path):
    old, new, check, phrase = WRONG[name]
    assert old in SOLUTION  # the mutant really changes the solution
    wrong = _module(tmp_path, SOLUTION.replace(old, new))
    with pytest.raises(grading.CheckFailed, match=re.compile(phrase, re.DOTALL)) as info:
        check(wrong.step_time_dp_tp)
    assert "in student.py" in str(info.value)


def test_no_expected_value_is_stored():
    """Every expected term is evaluated at check time: the module holds no float of seconds."""
    source = pathlib.Path(ex11.__file__).read_text()
    floats = re.findall(r"\b\d+\.\d{4,}", source)
    assert floats == []
    assert not any(isinstance(v, dict) and v and all(isinstance(x, float) for x in v.values())
                   for v in vars(ex11).values())


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
    "from course_lib.grading.ex11_step_time import expected_terms\n",  # the checker evaluates the answer
    "from course_lib.grading import ex11_step_time as g\nf = g.expected_terms\n",
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


# The check-time expectations against the course's full model: compute equal to float64
# rounding; tp and dp within 1%, since the full model also counts the embedding's, head's and
# loss's all-reduces (2 + 3 small ones per micro-batch beside 4 per layer) and sums the
# all-reduce's alpha terms per bucket or parameter group.
@pytest.mark.parametrize("case", ex11.NO_PIPELINE[:4], ids=str)
def test_the_expectations_agree_with_the_full_model(case):
    model, (gpu, n), seq, kw = case
    config = {"GPT-3 175B": GPT3_175B, "Llama-3 70B": LLAMA3_70B}[model]
    batch = kw["dp"] * kw["m"] * kw["micro_batch"]
    ref = step_time(config, ParallelDims(dp=kw["dp"], tp=kw["tp"], microbatches=kw["m"]), gpu_cluster(gpu, n), batch, seq)
    want = ex11.expected_terms(config, gpu_cluster(gpu, n), kw["dp"], kw["tp"], kw["micro_batch"], kw["m"], seq=seq)
    assert math.isclose(want["compute"], ref["compute"], rel_tol=1e-12)  # the same formula: float64 rounding
    for term in ("tp", "dp_total", "dp_exposed"):
        assert math.isclose(want[term], ref[term], rel_tol=0.01), term
    assert want["bubble"] == ref["bubble"] == 0.0


def test_the_expected_bubble_agrees_with_the_full_model():
    cluster = gpu_cluster(*ex11.A100_1024)
    for m, v in ex11.PIPELINE:
        dims = ParallelDims(dp=16, tp=8, pp=8, microbatches=m, virtual_stages=v,
                            schedule="interleaved_1f1b" if v > 1 else "1f1b")
        ref = step_time(GPT3_175B, dims, cluster, 16 * m, 2048)  # one sequence per micro-batch
        want = ex11.expected_terms(GPT3_175B, cluster, 16, 8, 1, m, 8, v, seq=2048)
        # the full model's busy time also holds the pipeline's sends (v times as many when
        # interleaved: 6% of the busy time at v = 2 here) and the extra tp calls: within 8%
        assert math.isclose(want["bubble"], ref["bubble"], rel_tol=0.08), (m, v)


def test_the_two_node_layouts_separate_the_group_strides():
    """On two nodes the data-parallel group crosses InfiniBand and the tensor-parallel one does not,
    so a model with either stride wrong gets another link (on 512 or 1024 GPUs both links are the same)."""
    for _, (gpu, n), _, kw in ex11.NO_PIPELINE[4:]:
        cluster = gpu_cluster(gpu, n)
        assert cluster.link(kw["dp"], kw["tp"]) != cluster.link(kw["dp"], 1)
        assert cluster.link(kw["tp"], 1) != cluster.link(kw["tp"], kw["dp"])
