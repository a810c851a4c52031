"""Checkers of exercise 15 (the capstone's layout: choose it, say what binds, reject one).

The learner writes three functions of the stated problem (`PROBLEM`: a model, a cluster of 8
ranks with tight memory, a global batch, a precision recipe and a throughput budget):

    choose_layout(...)       a ParallelDims the course's 3D trainer runs, that fits and is fast enough
    binding_constraint(...)  (name, number): what stops any layout from being faster than the
                             fastest one that fits, and the number at which it would stop binding
    rejected_layout(...)     (ParallelDims, reason, number): a layout of the problem that fails, why
                             ("memory" or "throughput") and by how much

The three functions are called on the stated problem and on VARIANTS of it (a larger batch on
more memory; devices with ample memory, where a group of step-time terms binds instead of
memory), so an answer read off this module's `facts` for the stated problem, or off a stored
output, and typed into student.py fails on the others.

Everything is graded against the course's estimator (course_lib.estimate.step_time:
memory_per_rank and step_time, notebook 11's formulas), over the layouts the 3D trainer
composes (`runnable_layouts`, enumerated here, never with the planner), and the chosen layout
is trained for real on 8 ranks against the single process. The planner holds the answer, so
REFUSE keeps it out of the learner's module, and `ask` runs the learner's functions with the
planner's entry points replaced by a refusal (a call that reaches them by a route the syntax
tree does not show raises while the checks run).

The definitions the checks apply:

* fits: memory_per_rank(...)["total"] <= cluster.memory_bytes;
* fast enough: best_time / its step time >= PROBLEM.fraction, best = the fastest fitting layout;
* binding: if the fastest runnable layout (memory ignored) does not fit, "memory", with that
  layout's bytes per rank (below them memory binds); else the largest group of step-time terms
  of the best layout (GROUPS: "compute", "overhead", "communication", "bubble", "optimizer"),
  with its seconds per step;
* a rejection for "memory": the layout's bytes per rank minus the device's; for "throughput":
  it fits, and best_time / its time (< fraction) is the number.

Each check prints `PASS  ...`; a failure raises CheckFailed naming the rule, never the answer.
(Over 300 lines: the two variants of the problem are checked by the same functions, each with its
own messages.)
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, replace

from course_lib.data import CharDataset
from course_lib.estimate import planner, planner_figures
from course_lib.dims import ParallelDims
from course_lib.estimate.cluster import Cluster
from course_lib.estimate.step_time import memory_per_rank, step_time
from course_lib.grading import CheckFailed, check_close, passed
from course_lib.measure.validation import load_validation
from course_lib.model import GPTConfig
from course_lib.parallel.hybrid import run_hybrid, train_single
from course_lib.tolerances import adamw_loss_atol
from course_lib.train import TrainConfig

# The planner and the widget of notebook 11: where they live; their re-exports and any helper
# that wraps them are refused by derivation (course_lib/grading/refusal.py).
# This module is refused too: facts() computes the answers the checks compare with.
REFUSE = ("course_lib.estimate.planner", "course_lib.estimate.planner_figures", "course_lib.grading.ex15_capstone")

# Step-time terms (course_lib.estimate.step_time.TERMS) grouped by what a layout can trade
GROUPS = {"compute": ("compute", "recompute"), "overhead": ("overhead",),
          "communication": ("tp", "pp", "ep", "dp_exposed"), "bubble": ("bubble",), "optimizer": ("optimizer",)}
REASONS = ("memory", "throughput")
# Numbers the learner may have read off printed output: fmt_bytes prints 0.1 KiB (a rounding
# of up to 51 bytes), a fraction printed as a percentage is read to 0.5%.
BYTES_ATOL = 64
FRACTION_ATOL = 0.005
SECONDS_RTOL = 0.01  # a time printed to 3 significant figures


@dataclass(frozen=True)
class Problem:
    config: object  # a course GPTConfig
    cluster: Cluster
    global_batch: int
    seq: int
    recipe: str
    fraction: float  # the throughput budget: at least this share of the best fitting layout's

    def args(self) -> tuple:
        return self.config, self.cluster, self.global_batch, self.seq, self.recipe

    def describe(self) -> str:
        c, k = self.config, self.cluster
        return (f"model: the course GPT, {c.n_layer} layers, d_model {c.d_model}, {c.n_head} heads, "
                f"vocabulary {c.vocab_size}\n"
                f"cluster: {k.name}, calibrated in notebook 11; {k.n_gpus} devices of "
                f"{k.memory_bytes / 1024:g} KiB each\n"
                f"budget: a global batch of {self.global_batch} sequences of {self.seq} tokens, recipe "
                f"{self.recipe!r}; at least {self.fraction:.0%} of the best fitting layout's predicted throughput")


def variants(p: Problem) -> list[tuple[str, Problem]]:
    """The problems every function is asked: the stated one first, then two of the same family
    whose answers differ from it (another layout, threshold or binding group)."""
    return [("the stated problem", p),
            (f"a global batch of {2 * p.global_batch} on 160 KiB devices",
             replace(p, global_batch=2 * p.global_batch, cluster=replace(p.cluster, memory_bytes=160 * 1024))),
            ("devices of 1 GiB", replace(p, cluster=replace(p.cluster, memory_bytes=1 << 30)))]


def stated_problem() -> Problem:
    """The exercise's problem: notebook 11's measured 8-rank cluster with 120 KiB per device."""
    seq = 16
    model = GPTConfig(vocab_size=CharDataset("train", seq).vocab_size, block_size=seq, n_layer=2, n_head=2,
                      d_model=16)
    cluster = replace(load_validation()["cluster"], memory_bytes=120 * 1024)
    return Problem(model, cluster, global_batch=16, seq=seq, recipe="fp32", fraction=0.75)


# ------------------------------------------------------------------ what the 3D trainer runs
def why_not_runnable(layout, p: Problem) -> str | None:
    """The first rule of course_lib.parallel.hybrid (and of the problem) that `layout` breaks, or None."""
    if not isinstance(layout, ParallelDims):
        return f"{layout!r} is not a course_lib.dims.ParallelDims"
    if (layout.ep, layout.virtual_stages, layout.schedule, layout.sequence_parallel) != (1, 1, "1f1b", False):
        return ("this problem asks for ep=1, virtual_stages=1, schedule '1f1b', no sequence parallelism; got "
                f"ep={layout.ep}, virtual_stages={layout.virtual_stages}, schedule={layout.schedule!r}, "
                f"sequence_parallel={layout.sequence_parallel}")
    if layout.zero > 1:  # the problem's choice: the 3D trainer composes stages 2 and 3 too
        return f"zero={layout.zero}: this problem asks for ZeRO 0 or 1"
    if layout.precision != "fp32":
        return f"precision={layout.precision!r}: this problem's recipe is fp32"
    if layout.world_size != p.cluster.n_gpus:
        return f"dp*tp*pp = {layout.world_size} must use all {p.cluster.n_gpus} devices"
    if layout.microbatches < layout.pp:  # the problem's choice, not the rule book's: the trainer runs m < pp too
        return (f"microbatches={layout.microbatches} < pp={layout.pp}: this problem asks for at least one "
                f"micro-batch per stage")
    try:
        layout.check(p.cluster.n_gpus, p.config, p.global_batch)  # the rule book and what the trainer composes
        memory_per_rank(p.config, layout, p.global_batch, p.seq, p.recipe)  # and the estimator costs it
    except ValueError as err:
        return str(err)
    return None


def runnable_layouts(p: Problem) -> list[ParallelDims]:
    """Every layout of the problem the 3D trainer runs: all degrees and micro-batch counts that
    split the global batch, ZeRO 0 or 1, recomputation of whole blocks or none."""
    n, out = p.cluster.n_gpus, []
    for dp, tp, m, zero, rc in itertools.product(range(1, n + 1), range(1, n + 1), range(1, p.global_batch + 1),
                                                 (0, 1), ("none", "full")):
        if n % (dp * tp) or p.global_batch % (dp * m) or (zero and dp == 1):
            continue
        lay = ParallelDims(dp=dp, tp=tp, pp=n // (dp * tp), microbatches=m, zero=zero, recompute=rc)
        if why_not_runnable(lay, p) is None:
            out.append(lay)
    return out


def predicted(p: Problem, layout: ParallelDims) -> tuple[float, int]:
    """(step seconds, bytes per rank) by the estimator."""
    return (step_time(p.config, layout, p.cluster, p.global_batch, p.seq, p.recipe)["total"],
            memory_per_rank(p.config, layout, p.global_batch, p.seq, p.recipe)["total"])


def facts(p: Problem) -> dict:
    """What the checks compare with, by the estimator: {"best_time": the fastest fitting layout's
    step seconds, "binding": (name, number) as the module docstring defines it}."""
    rows = [(lay, *predicted(p, lay)) for lay in runnable_layouts(p)]
    fastest = min(rows, key=lambda r: r[1])
    fitting = [r for r in rows if r[2] <= p.cluster.memory_bytes]
    if not fitting:
        raise ValueError(f"no runnable layout fits {p.cluster.memory_bytes} bytes per device: "
                         f"the problem has no answer")
    best = min(fitting, key=lambda r: r[1])
    if fastest[2] > p.cluster.memory_bytes:
        binding = ("memory", fastest[2])
    else:
        t = step_time(p.config, best[0], p.cluster, p.global_batch, p.seq, p.recipe)
        name = max(GROUPS, key=lambda g: sum(t[k] for k in GROUPS[g]))
        binding = (name, sum(t[k] for k in GROUPS[name]))
    return {"best_time": best[1], "binding": binding}


# ------------------------------------------------------------------ asking the learner
@contextlib.contextmanager
def planner_unavailable():
    """The planner's entry points raise while the learner's functions run."""
    def refused(*args, **kwargs):
        raise CheckFailed("the planner is not available in this exercise: choose with the estimator's formulas "
                          "(memory_per_rank, step_time), then compare with plan(...) afterwards")

    saved = (planner.plan, planner.search, planner_figures.plan)
    planner.plan = planner.search = planner_figures.plan = refused
    try:
        yield
    finally:
        planner.plan, planner.search, planner_figures.plan = saved


def ask(function, p: Problem):
    """Call one of the learner's functions on the problem, with the planner unavailable."""
    with planner_unavailable():
        return function(*p.args())


# ------------------------------------------------------------------ the checks
def _fail_unless(ok: bool, label: str, message: str):
    if not ok:
        raise CheckFailed(f"{label}: {message}")
    passed(f"{label}")


def _at(where: str) -> str:
    return f"{where}: " if where else ""


def check_runnable(layout, p: Problem, where: str = ""):
    reason = why_not_runnable(layout, p)
    _fail_unless(reason is None, f"{_at(where)}the 3D trainer runs your layout on all devices with the global batch",
                 f"choose_layout in student.py returned {layout!r}: {reason}")


def check_fits(layout, p: Problem, where: str = ""):
    _, memory = predicted(p, layout)
    _fail_unless(memory <= p.cluster.memory_bytes,
                 f"{_at(where)}it fits: the estimator's bytes per rank <= the device's memory",
                 f"your layout needs {memory} bytes per rank, the device holds {p.cluster.memory_bytes:g}")


def check_fast(layout, p: Problem, where: str = ""):
    share = facts(p)["best_time"] / predicted(p, layout)[0]
    _fail_unless(share >= p.fraction - 1e-12,  # 1e-12: float rounding of a ratio that sits on the budget
                 f"{_at(where)}it reaches at least {p.fraction:.0%} of the best fitting layout's predicted throughput",
                 f"your layout reaches {share:.1%}: a faster layout fits")


def check_choices(choose, p: Problem):
    """choose_layout on the variants after the stated problem: runnable, fits, fast enough."""
    for where, q in variants(p)[1:]:
        layout = ask(choose, q)
        check_runnable(layout, q, where)
        check_fits(layout, q, where)
        check_fast(layout, q, where)


def _close_enough(label: str, number: float, expected: float, tol: float):
    """Pass when |number - expected| <= tol; a failure says which side, not the value."""
    _fail_unless(abs(number - expected) <= tol, label, f"{number:g} is {'above' if number > expected else 'below'} "
                 f"the estimator's by more than {tol:g}")


def _number(label: str, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckFailed(f"{label}: {value!r} must be a number")
    return float(value)


def check_binding(answer, p: Problem, where: str = ""):
    """answer = (name, number); see the module docstring for what binds. The PASS lines name
    neither the constraint nor its unit (a stored output must not give the answer)."""
    if not (isinstance(answer, tuple) and len(answer) == 2):
        raise CheckFailed(f"{_at(where)}binding_constraint in student.py must return (name, number), got {answer!r}")
    name, number = answer
    names = ("memory", *GROUPS)
    if name not in names:
        raise CheckFailed(f"{_at(where)}binding constraint {name!r} must be one of {names}")
    expected_name, expected = facts(p)["binding"]
    _fail_unless(name == expected_name, f"{_at(where)}the binding constraint",
                 f"{name!r} is not what stops a faster layout, by the estimator: look again at the fastest "
                 f"layout the 3D trainer could run, memory ignored")
    number = _number("the binding number", number)
    tol = BYTES_ATOL if name == "memory" else SECONDS_RTOL * expected
    _close_enough(f"{_at(where)}the number at which it would stop binding", number, expected, tol)


def check_bindings(binding, p: Problem):
    """binding_constraint on the stated problem and its variants."""
    for where, q in variants(p):
        check_binding(ask(binding, q), q, where)


def check_rejections(rejected, choose, p: Problem):
    """rejected_layout on the stated problem and its variants, against choose_layout's choice."""
    for where, q in variants(p):
        check_rejected(ask(rejected, q), ask(choose, q), q, where)


def check_rejected(answer, chosen, p: Problem, where: str = ""):
    """answer = (layout, reason, number): a runnable layout of the problem that fails for `reason`."""
    w = _at(where)
    if not (isinstance(answer, tuple) and len(answer) == 3):
        raise CheckFailed(f"{w}rejected_layout in student.py must return (layout, reason, number), got {answer!r}")
    layout, reason, number = answer
    why = why_not_runnable(layout, p)
    if why is not None:
        raise CheckFailed(f"{w}the rejected layout must be one the 3D trainer could run for this problem: {why}")
    if layout == chosen:
        raise CheckFailed(f"{w}the rejected layout is the one you chose")
    if reason not in REASONS:
        raise CheckFailed(f"{w}reason {reason!r} must be one of {REASONS}")
    number = _number("the rejection's number", number)
    seconds, memory = predicted(p, layout)
    excess = memory - p.cluster.memory_bytes
    if reason == "memory":
        _fail_unless(excess > 0, f"{w}the rejected layout exceeds the device's memory",
                     "by the estimator it fits: pick one that does not, or another reason")
        _close_enough(f"{w}by how many bytes per rank it exceeds it", number, excess, BYTES_ATOL)
    else:
        share = facts(p)["best_time"] / seconds
        _fail_unless(excess <= 0 and share < p.fraction, f"{w}the rejected layout fits but misses the throughput budget",
                     "by the estimator it " + ("does not fit (reason 'memory')" if excess > 0 else
                                               f"reaches at least {p.fraction:.0%} of the best"))
        _close_enough(f"{w}the share of the best throughput it reaches", number, share, FRACTION_ATOL)


def check_trains(layout, p: Problem, steps: int = 2, timeout_s: float = 240):
    """Train `steps` steps of the chosen layout on real ranks, against the single process."""
    dims = layout
    train = TrainConfig(steps=steps, batch_size=p.global_batch, lr=1e-2, progress=False)
    ranks = run_hybrid(dims, p.config, train, timeout_s=timeout_s)
    single = train_single(p.config, train, recompute=dims.recompute)
    check_close(f"losses of {steps} steps on {dims.world_size} ranks = the single process's", ranks[0].train_losses,
                single.train_losses, rtol=0, atol=adamw_loss_atol(train.lr))
    # fp32 sums in another order (~1e-6), but after an AdamW step a parameter whose gradient is
    # near zero may move by about lr either way: course_lib.tolerances explains the bound
