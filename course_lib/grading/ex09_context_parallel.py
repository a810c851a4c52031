"""Checkers of exercise 09: merging a partial attention result that holds only some of the query
rows into a running result, and the zig-zag layout of a sequence that 2cp does not divide.

Nothing here calls the library's merge or its chunk assignment, and no expected layout is stored:
each check holds the learner's code to what the exercise states.

    check_merge_by_hand   merge_rows on rows worked out by hand: the notebook's example, a partial
                          holding rows 1, 2 and 3 of four (one of them with no visible key), no
                          visible key on either side, scores large enough that exp() overflows fp32
    check_merge_blocks    one process: attention split into disjoint key sets, each set's partial
                          computed only for the query rows that see one of its keys (the course's
                          causal attention by absolute position), merged in turn from an empty
                          start, against attention over all keys at once (PyTorch's SDPA)
    check_layout          for cp = 1 ... 8 and T = 6cp, 6cp+1, 7cp+1, 8cp-1: every position held
                          once, at most two contiguous runs per rank, ranks in sequence order, token
                          counts within one, and causal (query, key) pairs, counted pair by pair,
                          within fewer than T of each other
    check_ring            cp = 2 and 3 real gloo ranks, T = 23 and 33: each rank takes its queries by
                          the learner's layout, K||V blocks (of different lengths) travel round the
                          ring, each block is attended by the rows that see one of its keys and
                          merged by the learner's merge_rows; the rows and their lse against
                          single-process causal attention, and the pairs each rank scored

`REFUSE` names what already holds the answer (and this module, which holds the checks): the
exercise notebook passes it to `load_student`, which refuses a student module that imports them.
(Over 300 lines: each check's failure names the mistake in the learner's terms, which takes a few
lines per mistake; splitting them from the checks would hide which check says what.)
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


def _merged(student, out, lse, part_out, part_lse, rows, where: str):
    """The learner's merge_rows, its result checked for form: a pair (out, lse) of the running
    result's shapes (every row, not only the partial's)."""
    rows = torch.as_tensor(rows, dtype=torch.long)
    res = student.merge_rows(out, lse, part_out, part_lse, rows)
    if not (isinstance(res, (tuple, list)) and len(res) == 2 and all(isinstance(t, torch.Tensor) for t in res)):
        raise CheckFailed(f"{where}: merge_rows must return a pair of tensors (out, lse); got {type(res).__name__}")
    new_out, new_lse = res
    if tuple(new_out.shape) != tuple(out.shape) or tuple(new_lse.shape) != tuple(lse.shape):
        raise CheckFailed(f"{where}: merge_rows returned out of shape {tuple(new_out.shape)} and lse of shape "
                          f"{tuple(new_lse.shape)}; the running result has shapes {tuple(out.shape)} and "
                          f"{tuple(lse.shape)}: return every row of it, the partial's {len(rows)} rows merged in "
                          f"and the others as they were")
    return new_out, new_lse


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
    """Rows whose answer follows by hand (hd = 1, fp32; a few roundings, 1e-6)."""
    # The notebook's example: block a has keys with scores 0, 0 and values 1, 3 -> out_a = 2,
    # lse_a = log 2; block b one key, score log 6, value 8 -> out_b = 8, lse_b = log 6. Over all
    # three keys the softmax weights are 1/8, 1/8, 6/8: out = (1 + 3 + 48)/8 = 6.5, lse = log 8.
    out, lse = _merged(student, _row(2.0), _row(math.log(2))[..., 0], _row(8.0), _row(math.log(6))[..., 0], [0],
                       "the worked example")
    _compare("the worked example: out over all three keys", out, _row(6.5), rtol=1e-6, atol=1e-6)
    _compare("the worked example: lse over all three keys", lse, _row(math.log(8))[..., 0], rtol=1e-6, atol=1e-6)
    out2, lse2 = _merged(student, _row(8.0), _row(math.log(6))[..., 0], _row(2.0), _row(math.log(2))[..., 0], [0],
                         "the worked example, parts swapped")
    _compare("the order of the two parts does not matter", torch.cat([out2.flatten(), lse2.flatten()]),
             torch.cat([out.flatten(), lse.flatten()]), rtol=1e-6, atol=1e-6)
    # A running result of four rows; the partial holds rows 1, 2, 3. Row 0: not in the partial,
    # unchanged. Row 1: nothing seen so far (lse = -inf), so the partial's row. Row 2: equal lse
    # on both sides, weights 1/2: out = (1 + 3)/2 = 2, lse = 1 + log 2. Row 3: the partial saw
    # no key there (lse = -inf), unchanged.
    run_out, run_lse = _row(3.0, 0.0, 1.0, 5.0), _row(0.5, NEG_INF, 1.0, 2.0)[..., 0]
    out, lse = _merged(student, run_out, run_lse, _row(-2.0, 3.0, 0.0), _row(-0.25, 1.0, NEG_INF)[..., 0],
                       [1, 2, 3], "a partial holding rows 1, 2, 3 of four")
    _compare("a partial holding rows 1, 2, 3 of four (row 0 not held, row 3 with no visible key): out", out,
             _row(3.0, -2.0, 2.0, 5.0), rtol=1e-6, atol=1e-6)
    _compare("a partial holding rows 1, 2, 3 of four (row 0 not held, row 3 with no visible key): lse", lse,
             _row(0.5, -0.25, 1.0 + math.log(2), 2.0)[..., 0], rtol=1e-6, atol=1e-6)
    # No visible key on either side (a query before every key seen so far): still nothing seen.
    out, lse = _merged(student, _row(0.0), _row(NEG_INF)[..., 0], _row(0.0), _row(NEG_INF)[..., 0], [0],
                       "no visible key on either side")
    if torch.isnan(out).any() or torch.isnan(lse).any() or out.item() != 0.0 or lse.item() != NEG_INF:
        raise CheckFailed(f"no visible key on either side (both lse = -inf, both out = 0): a row that has seen no "
                          f"key must stay out = 0 and lse = -inf, never NaN; got out = {out.item()}, "
                          f"lse = {lse.item()}")
    passed("no visible key on either side: out = 0, lse = -inf, no NaN")
    # Large scores: lse 100 and 101 (exp overflows fp32 above 88.7). lse = 101 + log(1 + e^-1);
    # weights e^-1/(1 + e^-1) on the running row, the rest on the partial's.
    out, lse = _merged(student, _row(1.0), _row(100.0)[..., 0], _row(0.0), _row(101.0)[..., 0], [0], "large scores")
    share = math.exp(-1) / (1 + math.exp(-1))
    _compare("large scores (lse 100 and 101: exp of them overflows fp32): out", out, _row(share), rtol=1e-6, atol=1e-6)
    _compare("large scores (lse 100 and 101: exp of them overflows fp32): lse", lse,
             _row(101 + math.log1p(math.exp(-1)))[..., 0], rtol=1e-6, atol=1e-6)


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


def _seeing_rows(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Indices of the query rows that see at least one of the keys (causal, by absolute position)."""
    return (k_pos[None, :] <= q_pos[:, None]).any(dim=1).nonzero().flatten()


def check_merge_blocks(student):
    """Causal attention of T = 11 queries, the keys split into disjoint sets (not contiguous); each
    set's partial holds only the query rows that see one of its keys; merged in turn by the
    learner from an empty start, they equal attention over all keys."""
    t = 11
    q, k, v = _qkv(2, 3, t, 8)
    want_out, want_lse = _reference(q, k, v)
    pos = torch.arange(t)
    for label, sets in (("two key sets", [[2, 3, 4, 6, 7, 9, 10], [0, 1, 5, 8]]),
                        ("three key sets (latest first)", [[6, 7, 8, 9, 10], [3, 4, 5], [0, 1, 2]])):
        out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], NEG_INF)  # no key seen yet
        for s in map(torch.tensor, sets):
            rows = _seeing_rows(pos, pos[s])
            part = block_attention(q[:, :, rows], k[:, :, s], v[:, :, s], pos[rows], pos[s])
            out, lse = _merged(student, out, lse, *part, rows, label)
        _compare(f"{label}, each partial on the rows that see its keys, merged in turn: out equals attention over "
                 f"all keys", out, want_out, RTOL, ATOL, rows=pos)
        _compare(f"{label}, merged in turn: lse equals the log-sum-exp over all keys", lse, want_lse, RTOL, ATOL,
                 rows=pos)


# ------------------------------------------------------------------------ the zig-zag layout

LAYOUTS = [(t, cp) for cp in range(1, 9) for t in sorted({6 * cp, 6 * cp + 1, 7 * cp + 1, 8 * cp - 1})]


def _layout(student, t: int, cp: int) -> list[list[int]]:
    """Every rank's positions, checked for form: a list of ints per rank."""
    out = []
    for r in range(cp):
        got = student.zigzag_positions(t, cp, r)
        if isinstance(got, torch.Tensor):
            got = got.tolist()
        if not isinstance(got, (list, tuple)) or not all(isinstance(i, int) for i in got):
            raise CheckFailed(f"zigzag_positions({t}, {cp}, {r}) must return a list of ints; got {got!r}")
        out.append(list(got))
    return out


def _runs(ids: list[int]) -> int:
    return sum(1 for i, p in enumerate(ids) if i == 0 or p != ids[i - 1] + 1)


def _causal_pairs(q_pos: list[int], k_pos: list[int]) -> int:
    """(query, key) pairs a causal mask keeps, counted one by one: key position <= query position."""
    return sum(1 for qp in q_pos for kp in k_pos if kp <= qp)


def _layout_problem(t: int, cp: int, layout: list[list[int]]) -> str | None:
    """Why this layout is not a partition of the T positions into at most two runs per rank, in order."""
    for r, ids in enumerate(layout):
        outside = [p for p in ids if not 0 <= p < t]
        if outside:
            return f"rank {r} got position(s) {outside[:3]}: the sequence has positions 0 ... {t - 1}"
        if ids != sorted(set(ids)):
            return f"rank {r} got {ids}: list its positions in increasing order, each once"
    holders = {p: [r for r, ids in enumerate(layout) if p in ids] for p in range(t)}
    wrong = {p: rs for p, rs in holders.items() if len(rs) != 1}
    if wrong:
        return "every position must be held by exactly one rank; " + ", ".join(
            f"position {p} is held by {'no rank' if not rs else 'ranks ' + str(rs)}" for p, rs in list(wrong.items())[:4])
    for r, ids in enumerate(layout):
        if ids and _runs(ids) > 2:
            return (f"rank {r} holds {_runs(ids)} separate runs of positions {ids}: at most two (the ring passes a "
                    f"rank's keys as one block cut from two chunks)")
    firsts = [ids[0] if ids else t for ids in layout]
    if firsts != sorted(firsts):
        return (f"the ranks' first positions, in rank order, are {firsts}: rank r's first run must come before rank "
                f"r+1's (the ranks in sequence order)")
    return None


def check_layout(student, layouts=LAYOUTS):
    """Properties of the layout, exact, on sequences 2cp divides and ones it does not."""
    got = {(t, cp): _layout(student, t, cp) for t, cp in layouts}
    for (t, cp), layout in got.items():
        problem = _layout_problem(t, cp, layout)
        if problem:
            raise CheckFailed(f"T={t}, cp={cp}: {problem}; got {layout}")
    cps = sorted({cp for _, cp in layouts})
    passed(f"{len(layouts)} layout{'s' if len(layouts) > 1 else ''} (cp = {cps[0]} ... {cps[-1]}, T a multiple of "
           f"2cp or not): every position held once, at most two runs per rank, ranks in sequence order")
    for (t, cp), layout in got.items():
        tokens = [len(ids) for ids in layout]
        if max(tokens) - min(tokens) > 1:
            raise CheckFailed(f"T={t}, cp={cp}: the ranks hold {tokens} tokens; each must hold T//cp = {t // cp} or "
                              f"one more (a rank's activations and its ring block grow with its tokens): where did "
                              f"the T mod 2cp tokens that do not fill a whole chunk go? Layout {layout}")
    passed("every rank holds T//cp tokens or one more")
    for (t, cp), layout in got.items():
        work = [_causal_pairs(ids, list(range(t))) for ids in layout]
        if max(work) - min(work) >= t:
            raise CheckFailed(f"T={t}, cp={cp}: causal (query, key) pairs per rank {work}: the busiest rank scores "
                              f"{max(work) - min(work)} more than the least busy; it must be fewer than T = {t} "
                              f"(what one token at the end of the sequence costs). Every ring step waits for the "
                              f"busiest rank: pair each rank's early positions with late ones, and spread the "
                              f"leftover tokens so that no rank collects the late ones. Layout {layout}")
    passed("the busiest rank scores fewer than T more causal (query, key) pairs than the least busy")


# ----------------------------------------------------------------------- the ring on real ranks

def _ring_on_rank(name: str, positions: list[list[int]], shape: tuple):
    """Ring attention forward with the learner's merge. Every rank draws the same full q, k, v
    (same seed) and keeps its rows; K||V blocks travel to rank r+1 while the rank attends to the
    block it holds: at step t it holds rank (r - t) mod cp's block. Only the query rows that see
    one of the block's keys attend to it."""
    student, r, cp = _module(name), dist.get_rank(), dist.get_world_size()
    q, k, v = _qkv(*shape)
    q_pos = torch.tensor(positions[r])
    q = q[:, :, q_pos]
    kv = torch.stack([k[:, :, q_pos], v[:, :, q_pos]]).contiguous()
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], NEG_INF)  # nothing seen yet
    pairs = 0
    for step in range(cp):
        if step < cp - 1:  # post the exchange first: the block travels while this one is computed
            src = (r - step - 1) % cp  # whose block arrives: its length is that rank's token count
            nxt = kv.new_empty(kv.shape[:3] + (len(positions[src]), kv.shape[-1]))
            # one batch: with cp = 2 both ranks send to and receive from the same peer, which
            # NCCL (it runs a pair's calls in issue order) only progresses as one group
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (r + 1) % cp),
                                           dist.P2POp(dist.irecv, nxt, (r - 1) % cp)])
        k_pos = torch.tensor(positions[(r - step) % cp])
        rows = _seeing_rows(q_pos, k_pos)
        if len(rows):
            part = block_attention(q[:, :, rows], kv[0], kv[1], q_pos[rows], k_pos)
            pairs += int((k_pos[None, :] <= q_pos[:, None]).sum())
            out, lse = _merged(student, out, lse, *part, rows, f"rank {r}, ring step {step}")
        if step < cp - 1:
            for req in reqs:
                req.wait()
            kv = nxt
    return out, lse, pairs


def check_ring(student, cases=((23, 2), (33, 3))):
    """Ring attention on cp real ranks (T = 23 and 33: 2cp divides neither), the learner's layout
    and merge, against single-process causal attention on the rank's rows."""
    for t, cp in cases:
        positions = _layout(student, t, cp)
        problem = _layout_problem(t, cp, positions)
        if problem:  # before any rank starts
            raise CheckFailed(f"T={t}, cp={cp}: fix zigzag_positions first (check 3): {problem}")
        shape = (2, 2, t, 8)
        results = run_on_ranks(_ring_on_rank, student.__name__, positions, shape, world_size=cp, **RANKS)
        want_out, want_lse = _reference(*_qkv(*shape))
        rows = torch.tensor([p for pos in positions for p in pos])
        got_out, got_lse = (torch.cat([res[i] for res in results], dim=2) for i in (0, 1))
        _compare(f"cp={cp}, T={t}: every rank's output rows equal single-process causal attention", got_out,
                 want_out[:, :, rows], RTOL, ATOL, rows=rows)
        _compare(f"cp={cp}, T={t}: every rank's lse equals the single process's", got_lse, want_lse[:, :, rows],
                 RTOL, ATOL, rows=rows)
        work = [res[2] for res in results]
        check_equal(f"cp={cp}, T={t}: the ranks together scored the whole causal triangle, T(T+1)/2 pairs",
                    sum(work), t * (t + 1) // 2)
        if max(work) - min(work) >= t:
            raise CheckFailed(f"cp={cp}, T={t}: pairs each rank scored in the ring {work}: the spread must be fewer "
                              f"than T = {t}")
        passed(f"cp={cp}, T={t}: the pairs each rank scored in the ring differ by fewer than T")
