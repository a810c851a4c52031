"""Checkers of exercise 06: pipeline schedules written by the learner, as per-rank action lists.

Graded by properties, never against the library's own schedules:

  * valid       every F and B of every micro-batch exactly once per rank, and no deadlock when
                each rank runs its list in order (the course's simulator, schedules.simulate);
  * memory      at most p - r micro-batches in flight on rank r (1F1B), or caps[r] (the variant);
  * time        on the idealised machine (a forward 1 unit, a backward 2) the step ends no later
                than (m + p - 1)(t_F + t_B), GPipe's and 1F1B's, or exactly at the time of
                the 1F1B pattern under the same caps (STEP_UNDER_CAPS, kept as digests);
  * training    the lists drive a real pipelined training on 4 ranks whose losses, gradients and
                parameters equal the single-process training;
  * placement   the follow-up: v chunks per rank, stage 0 on rank 0, every pass of the forward
                over all p ranks, every activation sent at most one rank away
                (check_snake_placement; only the snake meets all of them).

STEP_UNDER_CAPS holds digests (course_lib.grading.stored) of step times of the simulator, not
schedules: each is the time of the 1F1B pattern (warm-up forwards, then one forward and one backward
in turn, then the drain) with the most warm-up forwards the caps allow without a deadlock.
"""

from __future__ import annotations

from course_lib.data import CharDataset
from course_lib.dims import ParallelDims
from course_lib.grading import CheckFailed, check_close, check_equal, passed
from course_lib.grading.stored import digest
from course_lib.model import GPTConfig
from course_lib.parallel.pp import run_pipeline, stage_tensors
from course_lib.parallel.pp.schedules import Action, Schedule, ScheduleError, check_schedule, in_flight, simulate
from course_lib.train import TrainConfig, train_reference

# The student module may not reach for the library's schedules (they hold the answer): the
# generators, and every module that builds a Schedule from a name.
# Where they live is named here; what imports or wraps them (the runner, training, viz, hybrid,
# make_schedule's re-export) is refused by derivation (course_lib/grading/refusal.py).
REFUSE = ("course_lib.parallel.pp.schedules", "course_lib.parallel.pp.v_schedules",
          "course_lib.parallel.pp.actions.stage_of", "course_lib.parallel.pp.actions.rank_of")

T_F, T_B = 1.0, 2.0  # simulate(..., t_forward=1, t_backward=1, t_weight=1): a backward without W takes 2

# (p, m, caps) -> digest(step time) (course_lib.grading.stored): the time, in units of one forward,
# of the 1F1B pattern under those caps with the most warm-up forwards they allow without a deadlock,
# computed once from the reference solution with step_time (the value itself is not kept here)
STEP_UNDER_CAPS = {
    (4, 8, (2, 2, 2, 2)): "fd148d566a79f62cec65da5844dd972a79d758509b7207e911f2b7181463bc84",
    (4, 8, (2, 3, 2, 1)): "fd148d566a79f62cec65da5844dd972a79d758509b7207e911f2b7181463bc84",
    (4, 8, (4, 1, 4, 4)): "9b9d5f3714eeb8c9ab6447e74c891947b53b43f1eaf66427899873c69d80cc22",
    (4, 8, (1, 1, 1, 1)): "b07bd093a5f79d4a356357cc202c0bac28b26efd843c0c60735c8f241acb46a1",
    (4, 8, (3, 9, 9, 9)): "29eb64a97515aec986e05b5787480e0bb3a928eabe2cdb954b72342218c82ee2",
    (4, 8, (4, 3, 2, 1)): "4ebc9004c02d6c756d0bc4397437f60f363fc98618c59d8e7a59911dc64faf12",
    (3, 5, (2, 2, 2)): "a549533c444591cd2417c9ff1ae2f2b8bf46a874630024caa15a136e728bfd87",
    (3, 7, (5, 1, 2)): "1b59740e895ff20917da69f534ef40878874bbeb82f9e11d57ec4f1032b25701",
    (4, 2, (3, 3, 3, 3)): "cec6339db52356fdaecff6da942f37e2847bd826627c53a0a79efcee440758ca",
    (2, 6, (1, 2)): "5cb05565cc4dae5c24fd9de9e031acc77042af615a1ced9c00b1690fa70b0a77",
}


def as_schedule(lists, p: int, m: int, name: str) -> Schedule:
    """The learner's lists as a Schedule, or CheckFailed saying what shape was expected."""
    if not isinstance(lists, (list, tuple)) or len(lists) != p:
        raise CheckFailed(f"{name}(p={p}, m={m}) must return a list of {p} lists (one per rank), got {lists!r:.200}")
    for r, acts in enumerate(lists):
        if not isinstance(acts, (list, tuple)) or not all(isinstance(a, Action) for a in acts):
            raise CheckFailed(f"{name}(p={p}, m={m}): rank {r}'s entry must be a list of Action, got {acts!r:.200}")
    return Schedule(name, p, m, 1, [list(acts) for acts in lists])


def step_time(sched: Schedule) -> float:
    """When the last rank finishes, on the idealised machine (F 1 unit, B 2 units, no messages)."""
    return max((end for rank in simulate(sched) for *_, end in rank), default=0.0)


def _valid(build, cases) -> dict:
    problems = {}
    for args in cases:
        try:
            check_schedule(build(*args))
        except ScheduleError as err:
            problems[", ".join(f"{k}={v}" for k, v in zip(("p", "m", "caps"), args))] = str(err)
    return problems


def check_one_f_one_b(one_f_one_b) -> None:
    """Every property of the 1F1B schedule, for the learner's one_f_one_b(p, m)."""
    def build(p, m):
        return as_schedule(one_f_one_b(p, m), p, m, "one_f_one_b")

    cases = [(p, m) for p in (2, 3, 4) for m in range(1, 10)]
    check_equal("one_f_one_b, p = 2..4, m = 1..9: lists with a missing or repeated action, or a deadlock",
                _valid(build, cases), {})
    over = {f"p={p}, m={m}": in_flight(build(p, m)) for p, m in cases
            if any(k > p - r for r, k in enumerate(in_flight(build(p, m))))}
    check_equal("one_f_one_b: ranks holding more than p - r micro-batches in flight (in flight per rank)", over, {})
    slow = {f"p={p}, m={m}": f"{step_time(build(p, m)):g} units, at most {(m + p - 1) * (T_F + T_B):g}"
            for p, m in cases if step_time(build(p, m)) > (m + p - 1) * (T_F + T_B)}
    check_equal("one_f_one_b: steps longer than (m + p - 1)(t_F + t_B), the bubble (p-1)/(m+p-1)", slow, {})


def check_capped(capped_1f1b) -> None:
    """Bad caps refused; then, per stored case, valid lists, in flight within the caps, and a step
    no longer than the 1F1B pattern's under the same caps."""
    for caps, rule in (([2, 0, 1, 1], "an entry below 1"), ([2, 2], "2 caps for 4 ranks"),
                       ([2, 1.5, 1, 1], "an entry that is not an int")):
        try:
            capped_1f1b(4, 8, caps)
        except ValueError:
            passed(f"capped_1f1b(4, 8, {caps}) raises ValueError ({rule})")
        else:
            raise CheckFailed(f"capped_1f1b(4, 8, {caps}) must raise ValueError: {rule} cannot be a memory cap")

    def build(p, m, caps):
        return as_schedule(capped_1f1b(p, m, list(caps)), p, m, "capped_1f1b")

    check_equal("capped_1f1b: lists with a missing or repeated action, or a deadlock",
                _valid(build, list(STEP_UNDER_CAPS)), {})
    over, off = {}, {}
    for (p, m, caps), best in STEP_UNDER_CAPS.items():
        sched, key = build(p, m, caps), f"p={p}, m={m}, caps={list(caps)}"
        if any(k > c for k, c in zip(in_flight(sched), caps)):
            over[key] = in_flight(sched)
        t = step_time(sched)
        if t != int(t) or digest(int(t)) != best:
            off[key] = f"{t:g} units"
    check_equal("capped_1f1b: ranks holding more micro-batches in flight than their cap (in flight per rank)", over, {})
    if off:
        raise CheckFailed(f"capped_1f1b: step times that are not the 1F1B pattern's best under the same caps "
                          f"(yours: {off}). Compare each rank's warm-up with what its own cap and the ranks before "
                          f"it allow: a rank that warms up less waits with memory to spare, one that plans more "
                          f"forwards than the ranks before it can feed waits for them")
    passed("capped_1f1b: every step as short as the 1F1B pattern allows under the same caps")


def check_training(lists, m: int, label: str, timeout_s: float = 90) -> None:
    """The lists (for 4 ranks, m micro-batches) run the pipelined training of a 5-block GPT
    (blocks split 2-1-1-1, tied embeddings) for 3 AdamW steps: equal to the single process."""
    import torch

    config = GPTConfig.tiny(CharDataset("train").vocab_size, n_layer=5, d_model=32, n_head=2, block_size=16)
    cfg = TrainConfig(steps=3, batch_size=16, grad_clip=0.0, eval_every=10**6, eval_batches=1, progress=False)
    ref = train_reference(config, cfg)
    ref_params = {n: p.detach() for n, p in ref.model.named_parameters()}
    ref_grads = {n: p.grad for n, p in ref.model.named_parameters()}
    results = run_pipeline(ParallelDims(pp=4, microbatches=m), config, cfg, as_schedule(lists, 4, m, label),
                           timeout_s=timeout_s)
    # losses: fp32 sums in another order (the micro-batches), ~1e-7 apart
    check_close(f"{label}: losses of the 3 steps", results[0].train_losses, ref.train_losses, rtol=1e-5, atol=1e-5)
    grads, params = stage_tensors(results, "final_grads"), stage_tensors(results, "final_params")
    # Gradients and parameters after 3 AdamW steps, compared in norm: AdamW magnifies the rounding of gradients
    # near zero (notebook 04) and can move a single parameter by up to ~lr, which a wrong schedule does to most.
    for name in ("tok_emb.weight", "blocks.0.attn.qkv.weight", "blocks.4.mlp.proj.weight", "ln_f.weight"):
        rel = ((grads[name] - ref_grads[name]).norm() / ref_grads[name].norm()).item()
        check_close(f"{label}: gradient of {name} (|difference| / |gradient|)", rel, 0.0, rtol=0, atol=1e-4)
    diff = torch.cat([(params[n] - ref_params[n]).flatten() for n in ref_params])
    check_close(f"{label}: parameters after 3 steps (RMS of the difference)", diff.pow(2).mean().sqrt().item(), 0.0,
                rtol=0, atol=cfg.lr / 100)


PLACEMENTS = [(p, v) for p in range(1, 7) for v in range(1, 5)]


def _placement_problem(p: int, v: int, got) -> str | None:
    """Which rule of the snake the placement breaks, in the learner's terms (None: all hold)."""
    if not isinstance(got, (list, tuple)) or len(got) != p or not all(
            isinstance(c, (list, tuple)) and all(isinstance(s, int) for s in c) for c in got):
        return f"must return {p} lists of stage numbers (one per rank)"
    n = v * p
    if sorted(s for c in got for s in c) != list(range(n)):
        return f"every stage 0 ... {n - 1} must be on exactly one rank"
    counts = [len(c) for c in got]
    if set(counts) != {v}:
        return f"each rank must hold v = {v} stages; the ranks hold {counts}"
    rank = {s: r for r, c in enumerate(got) for s in c}
    if rank[0] != 0:
        return f"stage 0 (the embedding) is on rank {rank[0]}, not rank 0"
    for k in range(v):
        ranks = [rank[k * p + i] for i in range(p)]
        if len(set(ranks)) != p:
            return (f"pass {k} (stages {k * p} ... {k * p + p - 1}) runs on ranks {ranks}: each pass of the forward "
                    f"must go through every rank once, or the ranks idle in turn")
    far = [s for s in range(n - 1) if abs(rank[s] - rank[s + 1]) > 1]
    if far:
        s = far[0]
        return f"stage {s} -> {s + 1} jumps from rank {rank[s]} to rank {rank[s + 1]}: an activation may travel one rank"
    return None


def check_snake_placement(snake_placement) -> None:
    """The follow-up: snake_placement(p, v) -> per rank its stages, for p = 1..6 and v = 1..4,
    checked as properties (no placement is stored): v stages per rank, each stage once, stage 0
    on rank 0, each pass over all ranks, and stages s and s+1 on the same or neighbouring ranks."""
    for p, v in PLACEMENTS:
        got = snake_placement(p, v)
        problem = _placement_problem(p, v, got)
        if problem:
            raise CheckFailed(f"snake_placement({p}, {v}): {problem}; got {got!r:.200}")
        if any(list(c) != sorted(c) for c in got):
            raise CheckFailed(f"snake_placement({p}, {v}): list each rank's stages in increasing order; got {got}")
    passed(f"snake_placement, p = 1..6, v = 1..4: v stages per rank, stage 0 on rank 0, every pass over every rank, "
           f"each activation one rank at most")
