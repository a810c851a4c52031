"""Checkers of exercise 09: the log-sum-exp merge of partial attention results, and the zig-zag
assignment of sequence chunks to context-parallel ranks.

Nothing here calls the library's merge or its chunk assignment. Each check holds the learner's
code to what the exercise states:

    check_merge_by_hand   merge_partials on single rows worked out by hand: the notebook's
                          example, a part with no visible key (lse = -inf) on one side and on
                          both, scores large enough that exp() overflows fp32
    check_merge_blocks    one process: attention split into disjoint key sets (partials from
                          block_attention, the course's causal attention by absolute position),
                          merged, against attention over all keys at once (PyTorch's SDPA)
    check_zigzag          for cp = 1 ... 8: every rank holds two of the 2cp chunks, together
                          each chunk once, in position order; the causal (query, key) pairs are
                          counted pair by pair and must be equal on every rank; rank r's first
                          chunk is chunk r
    check_ring            cp = 2 and 3 real gloo ranks: each rank takes its queries by the
                          learner's chunks, K||V blocks travel round the ring (isend/irecv), each
                          block's partial is merged by the learner's merge in ring order; the rows
                          and their lse against single-process causal attention, and the pairs
                          each rank scored, counted on the ranks

`REFUSE` names what already holds the answer (and this module, which holds the checks): the
exercise notebook passes it to `load_student`, which refuses a student module that imports them.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.grading import CheckFailed, check_equal, passed
from course_lib.parallel.cp.blocks import block_attention  # infrastructure: one block's (out, lse)
from course_lib.runtime.pool import run_on_ranks

REFUSE = (
    # merge_partials (blocks.py), chunk_ids / shard_positions / attention_work (layout.py), the
    # ring (ring.py): the library's context parallelism holds both answers
    "course_lib.parallel.cp",
    # PyTorch's context_parallel: its _SDPAMerger is the merge, its head-tail load balancer the chunks
    "torch.distributed.tensor.experimental",
    "course_lib.grading.ex09_context_parallel",  # the checks themselves
)
RANKS = dict(backend="gloo", timeout_s=60)  # CPU ranks; a rank waiting 60 s waits for a message nobody sent
NEG_INF = float("-inf")
# fp32 attention computed block by block and merged: each merge rescales by exp(lse_i - lse),
# a few roundings of 2^-23 ≈ 1.2e-7 per row and merge, against SDPA's one pass (measured ~1e-7
# here, below 1e-6 at cp = 2 and 3). A wrong weight in the merge is off by 1e-2 and more.
RTOL, ATOL = 1e-5, 1e-5


def _module(name: str):
    """The learner's module on a rank (installed there by run_on_ranks, see course_lib.runtime.modules)."""
    return sys.modules[name]


def _merged(student, out_a, lse_a, out_b, lse_b, where: str):
    """The learner's merge, its result checked for form: a pair (out, lse) of the inputs' shapes."""
    res = student.merge_partials(out_a, lse_a, out_b, lse_b)
    if not (isinstance(res, (tuple, list)) and len(res) == 2 and all(isinstance(t, torch.Tensor) for t in res)):
        raise CheckFailed(f"{where}: merge_partials must return a pair of tensors (out, lse); got {type(res).__name__}")
    out, lse = res
    if tuple(out.shape) != tuple(out_a.shape) or tuple(lse.shape) != tuple(lse_a.shape):
        raise CheckFailed(f"{where}: merge_partials returned out of shape {tuple(out.shape)} and lse of shape "
                          f"{tuple(lse.shape)}; expected {tuple(out_a.shape)} (B, H, s, hd) and {tuple(lse_a.shape)} "
                          f"(B, H, s)")
    return out, lse


def _compare(label: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, rows=None):
    """PASS, or CheckFailed naming the worst element (and its query position when `rows` gives them)."""
    got, want = got.detach().to(torch.float64), want.detach().to(torch.float64)
    nan = torch.isnan(got)
    same_inf = torch.isinf(want) & (got == want)  # -inf where no key is visible: compared exactly
    diff = torch.where(same_inf, torch.zeros_like(got), (got - want).abs())
    bad = nan | ~(same_inf | (diff <= atol + rtol * want.abs()))
    if not bad.any():
        passed(f"{label}")
        return
    index = tuple(int(i) for i in (nan.nonzero() if nan.any() else bad.nonzero())[0])
    worst = "NaN" if nan.any() else f"{diff.masked_fill(same_inf, 0).max().item():.3g}"
    where = f" (index {index}" + (f", query position {int(rows[index[2]])}" if rows is not None else "") + ")"
    raise CheckFailed(f"{label}: largest difference {worst}; first bad element{where}: got {got[index].item():.6g}, "
                      f"expected {want[index].item():.6g}")


# ------------------------------------------------------------------------------- merge by hand

def _row(*values) -> torch.Tensor:
    """A (B=1, H=1, s=len, hd=1) out or, via [..., 0], an lse of one value per row (fp32)."""
    return torch.tensor(values, dtype=torch.float32).view(1, 1, -1, 1)


def check_merge_by_hand(student):
    """Single rows whose answer follows by hand (hd = 1, fp32; a few roundings, 1e-6)."""
    # The notebook's example: block a has keys with scores 0, 0 and values 1, 3 -> out_a = 2,
    # lse_a = log 2; block b one key, score log 6, value 8 -> out_b = 8, lse_b = log 6. Over all
    # three keys the softmax weights are 1/8, 1/8, 6/8: out = (1 + 3 + 48)/8 = 6.5, lse = log 8.
    out, lse = _merged(student, _row(2.0), _row(math.log(2))[..., 0], _row(8.0), _row(math.log(6))[..., 0],
                       "the worked example")
    _compare("the worked example: out over all three keys", out, _row(6.5), rtol=1e-6, atol=1e-6)
    _compare("the worked example: lse over all three keys", lse, _row(math.log(8))[..., 0], rtol=1e-6, atol=1e-6)
    out2, lse2 = _merged(student, _row(8.0), _row(math.log(6))[..., 0], _row(2.0), _row(math.log(2))[..., 0],
                         "the worked example, parts swapped")
    _compare("the order of the two parts does not matter", torch.cat([out2.flatten(), lse2.flatten()]),
             torch.cat([out.flatten(), lse.flatten()]), rtol=1e-6, atol=1e-6)
    # Three rows: part b sees no key in row 0 (lse_b = -inf, out_b = 0: nothing to add), part a
    # none in row 1; row 2 sees keys in both. Rows 0 and 1 come back as the other part, unchanged.
    lse_a, lse_b = _row(0.5, NEG_INF, 1.0)[..., 0], _row(NEG_INF, -0.25, 1.0)[..., 0]
    out, lse = _merged(student, _row(3.0, 0.0, 1.0), lse_a, _row(0.0, -2.0, 3.0), lse_b,
                       "a part with no visible key")
    # row 2: equal lse, so equal weights 1/2: out = 2, lse = 1 + log 2
    _compare("a part with no visible key (lse = -inf) leaves the other part's row unchanged (out)", out,
             _row(3.0, -2.0, 2.0), rtol=1e-6, atol=1e-6)
    _compare("a part with no visible key (lse = -inf) leaves the other part's row unchanged (lse)", lse,
             _row(0.5, -0.25, 1.0 + math.log(2))[..., 0], rtol=1e-6, atol=1e-6)
    # No visible key in either part (a query before every key seen so far): still nothing seen.
    out, lse = _merged(student, _row(0.0), _row(NEG_INF)[..., 0], _row(0.0), _row(NEG_INF)[..., 0],
                       "no visible key in either part")
    if torch.isnan(out).any() or torch.isnan(lse).any() or out.item() != 0.0 or lse.item() != NEG_INF:
        raise CheckFailed(f"no visible key in either part (lse_a = lse_b = -inf, out_a = out_b = 0): expected "
                          f"out = 0 and lse = -inf (still nothing seen), got out = {out.item()}, lse = {lse.item()}")
    passed("no visible key in either part: out = 0, lse = -inf, no NaN")
    # Large scores: lse 100 and 101 (exp overflows fp32 above 88.7). lse = 101 + log(1 + e^-1)
    # = 101.31326168751822; weights e^-1/(1 + e^-1) = 0.2689414213699951 on a, the rest on b.
    out, lse = _merged(student, _row(1.0), _row(100.0)[..., 0], _row(0.0), _row(101.0)[..., 0], "large scores")
    _compare("large scores (lse 100 and 101: exp of them overflows fp32): out", out, _row(0.2689414213699951),
             rtol=1e-6, atol=1e-6)
    _compare("large scores (lse 100 and 101: exp of them overflows fp32): lse", lse, _row(101.31326168751822)[..., 0],
             rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------- merge against full attention

def _qkv(b: int, h: int, t: int, hd: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, t, hd, generator=g) for _ in range(3))


def _reference(q, k, v):
    """Single-process causal attention over the whole sequence: out from SDPA, lse of the
    scaled visible scores (fp64, so it adds no error of its own)."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    t = q.shape[-2]
    s = (q.double() @ k.double().transpose(-2, -1)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), NEG_INF)
    return out, torch.logsumexp(s, dim=-1)


def check_merge_blocks(student):
    """Causal attention of T = 11 queries, the keys split into disjoint sets (not contiguous):
    the partials of each set merged by the learner equal attention over all keys. Early queries
    see no key of the later sets (lse = -inf on one side)."""
    t = 11
    q, k, v = _qkv(2, 3, t, 8)
    want_out, want_lse = _reference(q, k, v)
    pos = torch.arange(t)
    sets = [torch.tensor([0, 1, 5, 8]), torch.tensor([2, 3, 4, 6, 7, 9, 10])]
    parts = [block_attention(q, k[:, :, s], v[:, :, s], pos, pos[s]) for s in sets]
    out, lse = _merged(student, *parts[0], *parts[1], "two key sets")
    _compare("two key sets, merged: out equals attention over all keys", out, want_out, RTOL, ATOL, rows=pos)
    _compare("two key sets, merged: lse equals the log-sum-exp over all keys", lse, want_lse, RTOL, ATOL, rows=pos)
    # Three sets, merged one after the other as a ring does; the first merge starts from an
    # empty accumulator (out = 0, lse = -inf: no key seen yet)
    sets = [torch.tensor([6, 7, 8, 9, 10]), torch.tensor([3, 4, 5]), torch.tensor([0, 1, 2])]
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], NEG_INF)
    for s in sets:
        out, lse = _merged(student, out, lse, *block_attention(q, k[:, :, s], v[:, :, s], pos, pos[s]),
                           "three key sets")
    _compare("three key sets (latest first), merged in turn from an empty start: out", out, want_out, RTOL, ATOL,
             rows=pos)
    _compare("three key sets (latest first), merged in turn from an empty start: lse", lse, want_lse, RTOL, ATOL,
             rows=pos)


# ---------------------------------------------------------------------------- zig-zag chunks

def _assignment(student, cp: int) -> list[list[int]]:
    """Every rank's chunks, checked for form: a list of ints per rank."""
    out = []
    for r in range(cp):
        chunks = student.zigzag_chunks(cp, r)
        if isinstance(chunks, torch.Tensor):
            chunks = chunks.tolist()
        if not isinstance(chunks, (list, tuple)) or not all(isinstance(i, int) for i in chunks):
            raise CheckFailed(f"zigzag_chunks({cp}, {r}) must return a list of ints; got {chunks!r}")
        out.append(list(chunks))
    return out


def _partition_problem(cp: int, chunks: list[list[int]]) -> str | None:
    """Why these chunk lists are not two of the 2cp chunks per rank, each chunk once, in order."""
    n = 2 * cp
    for r, ids in enumerate(chunks):
        if any(not 0 <= i < n for i in ids):
            return f"rank {r} got chunks {ids}: the sequence has 2cp = {n} chunks, numbered 0 ... {n - 1}"
        if len(ids) != 2:
            return (f"rank {r} got {len(ids)} chunk(s) {ids}: every rank holds T/cp tokens, two of the 2cp = {n} "
                    f"chunks")
        if ids != sorted(ids) or len(set(ids)) != len(ids):
            return f"rank {r} got {ids}: list its chunks in position order (increasing), each once"
    holders = {i: [r for r, ids in enumerate(chunks) if i in ids] for i in range(n)}
    wrong = {i: rs for i, rs in holders.items() if len(rs) != 1}
    if wrong:
        return "each chunk must be held by exactly one rank; " + ", ".join(
            f"chunk {i} is held by {'no rank' if not rs else 'ranks ' + str(rs)}" for i, rs in wrong.items())
    return None


def _positions(chunks: list[int], c: int) -> list[int]:
    return [i * c + j for i in chunks for j in range(c)]


def _causal_pairs(q_pos: list[int], k_pos: list[int]) -> int:
    """(query, key) pairs a causal mask keeps, counted one by one: key position <= query position."""
    return sum(1 for qp in q_pos for kp in k_pos if kp <= qp)


def check_zigzag(student, cps=range(1, 9), chunk_len: int = 3):
    """Properties of the assignment, exact: a partition, two chunks per rank in position order;
    equal causal work per rank (pairs counted over the whole sequence's keys); rank r starts at r."""
    assignments = {cp: _assignment(student, cp) for cp in cps}
    for cp, chunks in assignments.items():
        problem = _partition_problem(cp, chunks)
        if problem:
            raise CheckFailed(f"cp={cp}: {problem}; got {chunks}")
    passed(f"cp = {min(cps)} ... {max(cps)}: each rank holds two of the 2cp chunks, every chunk exactly once")
    for cp, chunks in assignments.items():
        t = 2 * cp * chunk_len
        work = [_causal_pairs(_positions(ids, chunk_len), list(range(t))) for ids in chunks]
        if len(set(work)) != 1:
            raise CheckFailed(f"cp={cp}, chunks of {chunk_len} tokens, chunks {chunks}: causal (query, key) pairs per "
                              f"rank {work}, the busiest rank {max(work) / min(work):.2f}x the least busy; under a "
                              f"causal mask every rank must score the same number of pairs")
    passed(f"cp = {min(cps)} ... {max(cps)}: every rank scores the same number of causal (query, key) pairs")
    for cp, chunks in assignments.items():
        firsts = [ids[0] for ids in chunks]
        if firsts != list(range(cp)):
            raise CheckFailed(f"cp={cp}: the first chunk of each rank, in rank order, must be {list(range(cp))} "
                              f"(rank r starts at chunk r: the ranks in sequence order); got {firsts}")
    passed(f"cp = {min(cps)} ... {max(cps)}: rank r's first chunk is chunk r")


# ----------------------------------------------------------------------- the ring on real ranks

def _ring_on_rank(name: str, positions: list[list[int]], shape: tuple):
    """Ring attention forward with the learner's merge. Every rank draws the same full q, k, v
    (same seed) and keeps its rows; K||V blocks travel to rank r+1 while the rank attends to the
    block it holds: at step t it holds rank (r - t) mod cp's block."""
    student, r, cp = _module(name), dist.get_rank(), dist.get_world_size()
    q, k, v = _qkv(*shape)
    q_pos = torch.tensor(positions[r])
    q = q[:, :, q_pos]
    kv = torch.stack([k[:, :, q_pos], v[:, :, q_pos]]).contiguous()
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], NEG_INF)  # nothing seen yet
    pairs = 0
    for step in range(cp):
        if step < cp - 1:  # post the exchange first: the block travels while this one is computed
            nxt = torch.empty_like(kv)
            # one batch: with cp = 2 both ranks send to and receive from the same peer, which
            # NCCL (it runs a pair's calls in issue order) only progresses as one group
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (r + 1) % cp),
                                           dist.P2POp(dist.irecv, nxt, (r - 1) % cp)])
        k_pos = torch.tensor(positions[(r - step) % cp])
        part_out, part_lse = block_attention(q, kv[0], kv[1], q_pos, k_pos)
        pairs += int((k_pos[None, :] <= q_pos[:, None]).sum())
        out, lse = _merged(student, out, lse, part_out, part_lse, f"rank {r}, ring step {step}")
        if step < cp - 1:
            for req in reqs:
                req.wait()
            kv = nxt
    return out, lse, pairs


def check_ring(student, cps=(2, 3), chunk_len: int = 5):
    """Ring attention on cp real ranks (T = 2cp·5 = 20 and 30 tokens, not powers of two), the
    learner's chunks and merge, against single-process causal attention on the rank's rows."""
    for cp in cps:
        chunks = _assignment(student, cp)
        problem = _partition_problem(cp, chunks)
        if problem:  # before any rank starts
            raise CheckFailed(f"cp={cp}: fix zigzag_chunks first (check 3): {problem}")
        positions = [_positions(ids, chunk_len) for ids in chunks]
        t = 2 * cp * chunk_len
        shape = (2, 2, t, 8)
        results = run_on_ranks(_ring_on_rank, student.__name__, positions, shape, world_size=cp, **RANKS)
        want_out, want_lse = _reference(*_qkv(*shape))
        rows = torch.tensor([p for pos in positions for p in pos])
        got_out, got_lse = (torch.cat([res[i] for res in results], dim=2) for i in (0, 1))
        _compare(f"cp={cp}, T={t}: every rank's output rows equal single-process causal attention", got_out,
                 want_out[:, :, rows], RTOL, ATOL, rows=rows)
        _compare(f"cp={cp}, T={t}: every rank's lse equals the single process's", got_lse, want_lse[:, :, rows],
                 RTOL, ATOL, rows=rows)
        # T(T+1)/2 pairs in the causal triangle, shared equally: c(T+1) per rank (T = 2cp·c)
        check_equal(f"cp={cp}, T={t}: causal (query, key) pairs each rank scored in the ring (equal work)",
                    [res[2] for res in results], [chunk_len * (t + 1)] * cp)
