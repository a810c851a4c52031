"""The catalogue of broken runs as data: one `Bug` per name, each a small rank function holding
the one-line bug and its mended twin (`fixed=True`), the symptom a learner sees, the tool that
finds it, and the fix. A notebook prints `catalogue_table()`; `run_bug` (run.py) runs an entry.

    kind "hang"    the run never finishes: run_bug turns it into a timeout whose flight-recorder
                   analysis names the rank and the call where the ranks diverge
    kind "crash"   one rank raises; in a real job the others then wait for it forever
    kind "silent"  the run finishes; its numbers (or its traffic) differ from the single process
                   in the way `symptom` states, which `evidence` measures

Each entry's `evidence(results, expected, world, bad_rank)` compares the ranks' results with
the single process (or the values the mended twin must produce) and returns an `Evidence`:
`matches` (the mended twin must match) and a one-line text with the measured difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from course_lib._validate import check_int
from course_lib.debugging import hangs, silent
from course_lib.observe.parity import loss_parity

KINDS = ("hang", "crash", "silent")


@dataclass(frozen=True)
class Evidence:
    matches: bool  # the run equals the reference (what the mended twin must show)
    text: str  # the measured difference, one line


@dataclass(frozen=True)
class Bug:
    name: str
    kind: str  # one of KINDS
    world_size: int  # the ranks it runs on by default
    bad_rank: int | None  # the rank carrying the bug by default; None: every rank runs the same wrong line
    bug: str  # the one line, as written in the rank function
    fix: str  # its mended twin
    symptom: str  # what a learner sees
    tool: str  # what finds it
    cause: str  # why it happens, one sentence
    rank_fn: Callable  # (fixed, bad_rank) -> dict, on every rank
    expected: Callable  # (world, bad_rank) -> what the mended twin returns (dict, or one per rank), in one process
    evidence: Callable  # (results, expected, world, bad_rank) -> Evidence
    min_world: int = 2
    even_world: bool = False  # the world must be even (a 2-wide mesh dimension)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} must be one of {KINDS}")

    def row(self) -> tuple[str, str, str, str, str]:
        return self.name, self.kind, self.symptom, self.tool, self.fix


# ------------------------------------------------------------------ evidence
# The mended twins of hangs and crashes compute the same products as the one process, summed in at
# most another order: a few fp32 roundings (u = 2^-24 ~ 6e-8 relative) per value, far below 1e-5.
RTOL, ATOL = 1e-5, 1e-6


def _close(got, want) -> bool:
    if want is None or got is None:
        return got is want
    if isinstance(want, dict):
        return isinstance(got, dict) and all(k in got and _close(got[k], want[k]) for k in want)
    return torch.allclose(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                          rtol=RTOL, atol=ATOL)


def same_as_expected(results, expected, world, bad_rank) -> Evidence:
    """Every rank returned what the one process computes (expected: one dict, or one per rank)."""
    want = expected if isinstance(expected, list) else [expected] * world
    wrong = [r for r in range(world) if not _close(results[r], want[r])]
    if wrong:
        return Evidence(False, f"rank(s) {', '.join(map(str, wrong))} differ from the single process")
    return Evidence(True, f"all {world} ranks equal the single process (rtol {RTOL:g})")


def _parity(result, reference):
    return loss_parity(result, reference, precision="fp32", terms=silent.B)  # B rows summed per loss


def parity_only(results, reference, world, bad_rank) -> Evidence:
    report = _parity(results[0], reference)
    return Evidence(report.ok, f"against the single process: {report}")


def grad_norm_ratio(results, reference, world, bad_rank) -> Evidence:
    report = _parity(results[0], reference)
    ratio = results[0]["grad_norms"][0] / reference["grad_norms"][0]
    return Evidence(report.ok, f"step 1 gradient norm {ratio:.3f} x the single process's ({world} ranks); {report}")


def replicas_agree(results, reference, world, bad_rank) -> Evidence:
    report = _parity(results[0], reference)
    sums = [r["checksums"][0] for r in results]
    same = len(set(sums)) == 1
    where = "agree" if same else "differ"
    return Evidence(report.ok and same, f"step 1 gradient checksums per rank {sums} ({where}); {report}")


def calls_per_step(results, reference, world, bad_rank) -> Evidence:
    report = _parity(results[0], reference)
    n_params = len(list(silent.tiny_model().parameters()))
    calls = results[0]["all_reduce_calls"] / silent.STEPS
    once = n_params + 1  # one all-reduce a parameter, plus the loss's for the record
    return Evidence(report.ok and calls == once, f"{calls:g} all_reduce calls per step where one sync needs "
                                                 f"{once} ({n_params} gradients + the loss); {report}")


def shard_overlap(results, reference, world, bad_rank) -> Evidence:
    report = _parity(results[0], reference)
    rows = [tuple(r["rows"]) for r in results]
    shared = sorted({rw for rw in rows if rows.count(rw) > 1})
    text = "; ".join(f"ranks {[r for r in range(world) if rows[r] == rw]} read rows [{rw[0]}, {rw[1]})"
                     for rw in shared) or "every rank reads its own rows"
    return Evidence(report.ok and not shared, f"{text}; {report}")


def first_non_finite(results, reference, world, bad_rank) -> Evidence:
    report = _parity(results[0], reference)
    bad = [r for r in range(world) if not results[r]["finite_before_sync"][0]]
    text = (f"rank(s) {bad} hold a non-finite gradient before the all-reduce at step 1, every rank after it"
            if bad else "every rank's gradient is finite before the all-reduce")
    return Evidence(report.ok and not bad, f"{text}; {report}")


def dropout_replicas(results, reference, world, bad_rank) -> Evidence:
    sums = [r["bias_grad_checksum"] for r in results]
    reports = [_parity(r, reference) for r in results]
    off = [r for r in range(world) if not reports[r].ok]
    same = len(set(sums)) == 1
    text = (f"replicated bias gradient checksums per rank {sums} ({'agree' if same else 'differ'}); "
            + (f"rank(s) {off} depart from the single process's loss" if off else
               "every rank's loss equals the single process's"))
    return Evidence(same and not off, text)


# ------------------------------------------------------------------ the catalogue
FLIGHT_RECORDER = "flight recorder"  # python -m course_lib.observe.flight_recorder DIR
CHECKS = "collective checks"  # or TORCH_DISTRIBUTED_DEBUG=DETAIL: each call's op and shape compared first
PARITY = "loss parity"  # with the single process, course_lib.observe.parity
CHECKSUMS = "per-rank gradient checksums"

_ENTRIES = [
    Bug("skip_collective", "hang", 2, 1, "elif grad.any(): dist.all_reduce(grad)", "dist.all_reduce(grad)",
        "timeout: the others wait in all_reduce #3",
        FLIGHT_RECORDER + "; monitored_barrier",  # before the call: probe_s
        "a data-dependent branch (an all-padding batch) lets one rank skip a collective the others make",
        hangs.skip_collective, hangs.skip_collective_expected, same_as_expected),
    Bug("reorder_collectives", "hang", 2, 1, "calls.reverse()", "the same order on every rank",
        "timeout: two ranks in different calls, same number",
        CHECKS + " or TORCH_DISTRIBUTED_DEBUG=DETAIL; " + FLIGHT_RECORDER,
        "a group's members must issue its collectives in the same order; one rank walks its buckets backwards",
        hangs.reorder_collectives, hangs.reorder_collectives_expected, same_as_expected),
    Bug("wrong_group", "hang", 4, 2, "group = dp[rank % 2]", "group = tp[rank // 2]",
        "timeout: one rank waits on a group nobody else calls", FLIGHT_RECORDER,
        "the group of the other mesh dimension (as when MoE folding reuses the wrong data-parallel group)",
        hangs.wrong_group, hangs.wrong_group_expected, same_as_expected, min_world=4, even_world=True),
    Bug("microbatches_below_stages", "hang", 4, None, "drain = p - r - 1", "drain = warmup",
        "timeout: rank 0 waits for a gradient never sent", FLIGHT_RECORDER,
        "a hand 1F1B schedule assumes m >= p; with m = p - 2 rank 0 drains one backward too many",
        hangs.microbatches_below_stages, hangs.microbatches_below_stages_expected, same_as_expected, min_world=3),
    Bug("zero_token_expert", "hang", 2, 1, "if received.shape[0] == 0: return",
        "combine(expert(received), send, recv)",
        "timeout: the others wait in the all-to-all back", FLIGHT_RECORDER,
        "the router sends no token to one expert; its rank skips the step's last all-to-all",
        hangs.zero_token_expert, hangs.zero_token_expert_expected, same_as_expected),
    Bug("sync_every_microbatch", "silent", 2, None, "lambda j: True", "lambda j: j == ACCUM - 1",
        "right losses, ACCUM x the gradient all-reduces",
        "CommTracer: calls per step",
        "accumulation that forgot no_sync: every micro-batch all-reduces", silent.sync_every_microbatch,
        silent.reference, calls_per_step),
    Bug("never_sync", "silent", 2, None, "lambda j: j == ACCUM", "lambda j: j == ACCUM - 1",
        "replicas differ from step 1, the loss from step 2",
        CHECKSUMS + "; " + PARITY,
        "an off-by-one: the sync after the last micro-batch never runs, each rank steps on its own gradient",
        silent.never_sync, silent.reference, replicas_agree),
    Bug("sum_not_avg", "silent", 2, None, "dist.all_reduce(p.grad)", "p.grad /= world",
        "gradient norm N x the single process's", PARITY,
        "all_reduce sums by default (gloo has no AVG): the gradient is N times the mean",
        silent.sum_not_avg, silent.reference, grad_norm_ratio),
    Bug("unsynced_dropout", "silent", 2, None, "torch.manual_seed(SEED + rank)", "torch.manual_seed(SEED)",
        "ranks' losses and replicated gradients differ", CHECKSUMS,
        "dropout on a replicated activation draws a different mask on each rank",
        silent.unsynced_dropout, silent.reference_dropout, dropout_replicas),
    Bug("overlapping_shards", "silent", 4, None, "index = rank % per_node", "index = rank",
        "the loss is off from step 1; shards repeat",
        PARITY + "; the ranks' rows",
        "the shard is picked by LOCAL_RANK where RANK is meant", silent.overlapping_shards, silent.reference,
        shard_overlap),
    Bug("nan_on_one_rank", "silent", 2, 1, "loss = (err * mask).sum() / mask.sum()",
        "(err * mask).sum() / n_valid * world", "the loss is nan on every rank, no error",
        "per-rank finite checks",  # of the gradient, before the all-reduce
        "a rank whose rows are all padding divides 0 by 0; the all-reduce spreads the NaN",
        silent.nan_on_one_rank, silent.reference_masked, first_non_finite),
    Bug("uneven_oom", "crash", 4, None, "per = n_layer // p  (the last stage takes the rest)",
        "split_layers(n_layer, p)",
        "one rank out of memory (an emulated cap)",
        "per-rank memory accounting",
        "an uneven pipeline split piles the remainder on the last stage", hangs.uneven_oom,
        hangs.uneven_oom_expected, same_as_expected, min_world=3),
]
BUGS: dict[str, Bug] = {b.name: b for b in _ENTRIES}
BUG_NAMES = tuple(BUGS)


def check_bug(name: str, rank: int | None = None, world_size: int | None = None) -> tuple[Bug, int, int | None]:
    """(the entry, its world size, the rank carrying the bug), or ValueError naming the value and
    the rule: before any rank starts."""
    if name not in BUGS:
        raise ValueError(f"bug={name!r} must be one of {BUG_NAMES}")
    bug = BUGS[name]
    world = bug.world_size if world_size is None else world_size
    check_int("world_size", world, minimum=bug.min_world, rule=f"an int >= {bug.min_world} for {name}")
    if bug.even_world and world % 2:
        raise ValueError(f"world_size={world} must be even for {name} (a 2-wide tensor-parallel dimension)")
    if rank is None:
        return bug, world, bug.bad_rank
    if bug.bad_rank is None:
        raise ValueError(f"rank={rank!r}: {name} has no rank to choose (every rank runs the same wrong line)")
    check_int("rank", rank, minimum=0, maximum=world - 1, rule=f"an int in [0, {world}) (the world has {world} ranks)")
    return bug, world, rank


def catalogue_table() -> str:
    """The catalogue as a plain-text table: name, kind, symptom, tool, fix."""
    rows = [("bug", "kind", "symptom", "found with", "fix")] + [b.row() for b in _ENTRIES]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
