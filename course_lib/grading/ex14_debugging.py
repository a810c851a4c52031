"""Exercise 14: three broken data-parallel runs, their evidence, and the checks of the learner's fixes.

Every run trains the course GPT on N gloo ranks, each rank taking its 1/N share of the global
batch the single process draws (`share_rows`), so a correct run equals the single process:
the mean of the ranks' shard losses is the loss of the whole batch (equal shards, each loss a
mean), and so is the mean of their gradients. The harness (used by the exercise notebook to
make each broken run's evidence, and by the checks) runs a rank's loop around one piece of the
learner's code:

    train_with_sync(sync)                          sync(model) after backward (run 1)
    train_until(should_stop, target, max_steps)    stop when should_stop(loss, target) (run 2)
    train_accumulating(step, accum)                step(model, optimizer, micro_batches) (run 3)

The checks hold the learner's fixes to the single process (never to a library version):

    check_names       each run's bug named with the catalogue's name (the three names stored as
                      one digest: reading this module gives no run's answer)
    check_sync        one backward then sync on 2 and 4 ranks: every rank's gradients equal the
                      whole batch's gradient, the sync is ONE all-reduce of the whole gradient
                      per step; 3 AdamW steps: losses equal the single process's
    check_stop        should_stop on ranks holding different losses: every rank returns the same
                      decision, the global batch's (mean < target); then the early-stopped run
                      stops on every rank at the single process's step (a hang is a timeout)
    check_accumulate  3 steps of 2 and of 4 micro-batches on 2 ranks: the replicas stay bitwise
                      equal, step 1's gradient equals the whole batch's (AdamW would hide a
                      gradient n times too large in the losses), the losses equal the single
                      process's, and each step all-reduces one gradient's worth of bytes (4 bytes
                      a parameter), not one per micro-batch

`REFUSE` names what holds the answers: the catalogue of broken runs with their mended twins,
its torchrun demo, the course's data parallelism (its averaging) and this module.
(Two lines over 300: three runs' checks, each with its gradient comparison.)
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from course_lib.data import VOCAB_SIZE, CharDataset, collate, sample_indices
from course_lib.grading import CheckFailed, announce, check_close, check_equal, passed
from course_lib.grading.stored import check_digest
from course_lib.model import GPT, GPTConfig
from course_lib.observe.tracer import CommTracer
from course_lib.runtime.pool import run_on_ranks
from course_lib.tolerances import adamw_loss_atol
from course_lib.train import StepHooks, TrainConfig, flat_grads, flat_params, make_optimizer, share_rows, train_loop, \
    train_step

REFUSE = ("course_lib.debugging",  # the catalogue: each entry's bug and its mended twin
          "course_lib.demos.broken_run",
          "course_lib.parallel.dp",  # DataParallel's gradient averaging: run 1's answer
          "torch.nn.parallel",  # DistributedDataParallel and its no_sync
          "course_lib.grading.ex14_debugging")  # the checks and the stored answers
# The catalogue's names (course_lib.debugging.BUG_NAMES, in its order; a test keeps them equal), written
# out so that this module does not import the answers' own module.
BUG_NAMES = ("skip_collective", "reorder_collectives", "wrong_group", "microbatches_below_stages", "zero_token_expert",
             "sync_every_microbatch", "never_sync", "sum_not_avg", "unsynced_dropout", "overlapping_shards",
             "nan_on_one_rank", "uneven_oom")
RUNS = ("run 1", "run 2", "run 3")
# The answer: stored.digest of the reference solution's name_the_bugs() dict, all three names in one
# digest (a digest per run would decode by hashing the catalogue's twelve names).
ANSWER = "eda3c23d408c6809d1444013e0ec78315e8d03b3c0a335f6696952a2a58bfbb9"

CONFIG = GPTConfig.tiny(VOCAB_SIZE, n_layer=1, block_size=32)
TRAIN = TrainConfig(steps=3, batch_size=8, lr=3e-3, grad_clip=1.0, progress=False)
NO_CLIP = TrainConfig(steps=3, batch_size=8, lr=3e-3, grad_clip=0.0, progress=False)
RANKS = dict(backend="gloo", timeout_s=60)  # a rank waiting 60 s waits for a call nobody makes
# Run 2's early stopping: the loss of the global batch first falls below TARGET at step STOP_STEP of
# the single process (checked against the reference in `check_stop`, with a margin of MARGIN so the
# decision cannot flip on rounding: fp32 losses of ~3 differ by ~1e-6 between correct runs).
TARGET, MAX_STEPS, MARGIN = 3.3, 15, 2e-3


def _dataset():
    return CharDataset("train", block_size=CONFIG.block_size)


def _checksum(model) -> float:
    """A replica's fingerprint: the sum of its parameters in float64 (equal replicas, equal sums)."""
    return flat_params(model).double().sum().item()


def _student(name: str):
    """The learner's module on a rank (installed there by run_on_ranks, see course_lib.runtime.modules)."""
    return sys.modules[name]


# ----------------------------------------------------------------------------------- the harness
def train_with_sync(sync, cfg: TrainConfig = TRAIN) -> dict:
    """Rank code: cfg.steps steps of data parallelism with `sync(model)` after backward (None: on
    one process, the whole batch). Returns losses, gradient norms, checksum, step-1 gradient."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = GPT(CONFIG, seed=cfg.seed)
    first = {}

    def sync_and_keep():
        if sync is not None:
            with CommTracer() as tracer:
                sync(model)
            calls.append({op: s["calls"] for op, s in tracer.summary().items()})
        first.setdefault("grad", flat_grads(model))

    calls = []

    hooks = StepHooks(sync_gradients=sync_and_keep)
    result = train_loop(model, make_optimizer(model, cfg), _dataset(), cfg, hooks,
                        rows=share_rows(rank, world, cfg.batch_size), record_grad_norms=True)
    return {"losses": result.train_losses, "grad_norms": result.grad_norms, "checksum": _checksum(model),
            "first_grad": first["grad"], "sync_calls": calls}


def average_over_ranks(model):
    """The harness's own correct sync (runs 2 and 3 must not depend on the learner's run 1)."""
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def train_until(should_stop, target: float = TARGET, max_steps: int = MAX_STEPS) -> dict:
    """Rank code: train until should_stop(loss, target) is true (at most max_steps steps);
    should_stop=None: one process, stopping when the whole batch's loss < target."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    cfg = TrainConfig(steps=max_steps, batch_size=TRAIN.batch_size, lr=TRAIN.lr, progress=False)
    model, dataset = GPT(CONFIG, seed=cfg.seed), _dataset()
    optimizer, gen = make_optimizer(model, cfg), torch.Generator().manual_seed(cfg.seed)
    rows, losses = share_rows(rank, world, cfg.batch_size), []
    for step in range(1, max_steps + 1):
        x, y = collate(dataset, sample_indices(len(dataset), cfg.batch_size, gen)[rows])
        sync = (lambda: average_over_ranks(model)) if world > 1 else None
        losses.append(train_step(model, optimizer, x, y, cfg.grad_clip, sync_gradients=sync))
        stop = losses[-1] < target if should_stop is None else should_stop(losses[-1], target)
        if stop:
            break
    return {"stopped_at": step, "losses": losses}


def train_accumulating(step_fn, accum: int = 2, cfg: TrainConfig = NO_CLIP, traced: bool = False) -> dict:
    """Rank code: cfg.steps steps, each `step_fn(model, optimizer, micro_batches)` on the rank's
    share of the global batch cut into `accum` micro-batches (step_fn=None: one process, the whole
    batch in one piece, no accumulation). Returns losses, checksum after each step, all-reduce bytes."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model, dataset = GPT(CONFIG, seed=cfg.seed), _dataset()
    optimizer, gen = make_optimizer(model, cfg), torch.Generator().manual_seed(cfg.seed)
    rows, losses, checksums, reduced = share_rows(rank, world, cfg.batch_size), [], [], []
    first_grad = None
    for _ in range(cfg.steps):
        x, y = collate(dataset, sample_indices(len(dataset), cfg.batch_size, gen)[rows])
        if step_fn is None:
            losses.append(train_step(model, optimizer, x, y))
        else:
            with CommTracer() as tracer:
                losses.append(float(step_fn(model, optimizer, list(zip(x.chunk(accum), y.chunk(accum))))))
            reduced.append(tracer.summary().get("all_reduce", {}).get("bytes_sent", 0))
        checksums.append(_checksum(model))
        if first_grad is None and traced:
            first_grad = flat_grads(model)  # the gradient step 1 applied (zeroed only at the next step)
    return {"losses": losses, "checksums": checksums, "all_reduce_bytes": reduced,
            "params": flat_params(model) if traced else None, "first_grad": first_grad}


def rank_mean(results: list[dict], key: str = "losses") -> list[float]:
    """The global batch's value per step: the mean over the ranks' shard values."""
    return [sum(r[key][i] for r in results) / len(results) for i in range(len(results[0][key]))]


# ------------------------------------------------------------------------- the three broken runs
# What ran in each broken run (the exercise notebook prints them after their evidence).
def run_1_sync(model):
    """Run 1, after backward: combine the ranks' gradients."""
    for p in model.parameters():
        dist.all_reduce(p.grad)


def run_2_should_stop(local_loss, target):
    """Run 2, after each step: early stopping, leave the loop once the loss is below the target."""
    return local_loss < target


def run_3_step(model, optimizer, micro_batches):
    """Run 3, one optimizer step with gradient accumulation over the micro-batches."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        loss = model(x, y)[1] / len(micro_batches)
        loss.backward()
        total += loss.item()
        if i == len(micro_batches):  # after the last micro-batch: average the gradients over the ranks
            average_over_ranks(model)  # (a correct average: not the bug)
    optimizer.step()
    return total


# ------------------------------------------------------------------------------------ the checks
def check_names(student):
    names = student.name_the_bugs()
    if not isinstance(names, dict) or sorted(names) != list(RUNS):
        raise CheckFailed(f"name_the_bugs() in student.py must return a dict with the keys {list(RUNS)}, got {names!r}")
    for run in RUNS:
        if names[run] not in BUG_NAMES:
            raise CheckFailed(f"{run}: {names[run]!r} is not a name from the catalogue: one of {', '.join(BUG_NAMES)}")
    check_digest("the three runs' bugs, named", names, ANSWER,
                 hint="At least one name does not explain its run's evidence. For each run ask what the evidence "
                      "rules out: does it hang or finish, do the replicas agree, by what factor is the gradient "
                      "norm off, which calls did the flight recorder see on each rank?")


def _check_gradient(label: str, got: torch.Tensor, want: torch.Tensor, hint: str) -> None:
    """got equals want (flat gradients) to fp32 rounding; a failure shows the ratio of the norms and
    the worst element's gap, never the expected values."""
    announce()
    # one backward each: the same per-token gradients summed in another order (fp32 ~1e-7); the
    # mistakes are off by a factor (n, 1/n, 2) or by the other ranks' shards, far outside
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-6):
        ratio = got.double().norm().item() / want.double().norm().item()
        worst = (got.double() - want.double()).abs().max().item()
        raise CheckFailed(f"{label}: your gradients differ (norm {ratio:.4g} x the whole batch's, largest gap "
                          f"{worst:.3g}).\n {hint}")
    passed(label)


def _sync_on_rank(name: str, cfg: TrainConfig):
    return train_with_sync(_student(name).average_gradients, cfg)


def check_sync(student, world_sizes=(2, 4)):
    """Run 1's fix: average_gradients(model) after backward, against the whole batch's gradient."""
    ref = train_with_sync(None)
    for n in world_sizes:
        res = run_on_ranks(_sync_on_rank, student.__name__, TRAIN, world_size=n, **RANKS)
        for r, got in enumerate(res):
            _check_gradient(f"{n} ranks, rank {r}: gradients after average_gradients equal the whole batch's",
                            got["first_grad"], ref["first_grad"],
                            hint="A norm n times the whole batch's is a sum, not a mean; 1 x with a gap: the "
                                 "averaged values never reached p.grad, or reached the wrong parameters.")
        calls = res[0]["sync_calls"]
        check_equal(f"{n} ranks: collective calls average_gradients makes in each of {TRAIN.steps} steps "
                    "(one all_reduce of the whole gradient)", calls, [{"all_reduce": 1}] * TRAIN.steps)
        check_close(f"{n} ranks: losses of {TRAIN.steps} steps (mean over the ranks) equal the single process's",
                    rank_mean(res), ref["losses"], rtol=0, atol=adamw_loss_atol(TRAIN.lr))  # tolerances.py: why


def _stop_on_rank(name: str, losses: list[float], target: float):
    return _student(name).should_stop(losses[dist.get_rank()], target)


STOP_CASES = (  # per-rank losses (exact in binary), target, the global decision: mean < target
    ([2.0, 3.0], 2.75, True), ([2.0, 3.0], 2.25, False), ([3.5, 1.0, 2.0, 2.5], 2.5, True),
    ([3.5, 1.0, 2.0, 2.5], 2.0, False), ([2.5, 2.5], 2.5, False))


def check_stop(student):
    """Run 2's fix: every rank takes the same decision, the one for the global batch."""
    for losses, target, want in STOP_CASES:
        got = run_on_ranks(_stop_on_rank, student.__name__, losses, target, world_size=len(losses), **RANKS)
        check_equal(f"ranks holding losses {losses}, target {target}: every rank's decision", [bool(g) for g in got],
                    [want] * len(losses))
    ref = train_until(None)
    closest = min(abs(loss - TARGET) for loss in ref["losses"])
    assert closest > MARGIN, f"the reference's losses come within {closest:.2g} of TARGET: choose another target"
    res = run_on_ranks(_train_until_on_rank, student.__name__, world_size=2, **RANKS)
    check_equal("the early-stopped run on 2 ranks: the step each rank stops at", [r["stopped_at"] for r in res],
                [ref["stopped_at"]] * 2)


def _train_until_on_rank(name: str):
    return train_until(_student(name).should_stop)


def _accumulate_on_rank(name: str, accum: int = 2):
    return train_accumulating(_student(name).accumulation_step, accum, traced=True)


def check_accumulate(student, world_size: int = 2, accums=(2, 4)):
    """Run 3's fix: accumulation_step with one sync after the last micro-batch, for 2 and 4
    micro-batches (a rank's share of 4 rows cut into rows of 2, then of 1)."""
    ref = train_accumulating(None, traced=True)
    n_params = sum(p.numel() for p in GPT(CONFIG).parameters())
    for accum in accums:
        res = run_on_ranks(_accumulate_on_rank, student.__name__, accum, world_size=world_size, **RANKS)
        for r, got in enumerate(res):
            if not torch.equal(got["params"], res[0]["params"]):
                raise CheckFailed(f"{accum} micro-batches: rank {r}'s parameters differ from rank 0's after "
                                  f"{NO_CLIP.steps} steps (checksums {[round(c, 6) for c in got['checksums']]} "
                                  f"against {[round(c, 6) for c in res[0]['checksums']]}): the replicas must apply "
                                  "the same averaged gradient")
        passed(f"{world_size} ranks, {accum} micro-batches: the replicas' parameters stay bitwise equal")
        _check_gradient(f"{world_size} ranks, {accum} micro-batches: the gradient step 1 applies equals the whole "
                        "batch's", res[0]["first_grad"], ref["first_grad"],
                        hint=f"A norm {accum} x the whole batch's: each micro-batch's loss went into backward "
                             f"undivided (AdamW hides it in the losses); 1/{accum} x: divided twice.")
        check_close(f"{world_size} ranks, {accum} micro-batches: losses of {NO_CLIP.steps} steps (what accumulation_"
                    "step returns, mean over the ranks) equal the single process's", rank_mean(res), ref["losses"],
                    rtol=0, atol=adamw_loss_atol(NO_CLIP.lr))  # tolerances.py: why
        check_equal(f"{accum} micro-batches: bytes each rank all-reduces per step (one gradient's worth: 4 bytes "
                    "a parameter, whatever the number of micro-batches)",
                    [b // (4 * n_params) if b % (4 * n_params) == 0 else b / (4 * n_params)
                     for b in res[0]["all_reduce_bytes"]], [1] * NO_CLIP.steps)
