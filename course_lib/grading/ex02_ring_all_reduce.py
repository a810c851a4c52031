"""Checkers of exercise 02 (ring reduce-scatter and all-gather in either direction, and an
all-reduce that sends half of the elements each way around the ring), on real ranks, against
torch.distributed's built-ins.

    check_reduce_scatter(student)   N = 3, 4, 5, sizes N does not divide and smaller than N, both
                                    directions: rank r's chunk r is the sum, a view of the
                                    tensor; only point-to-point calls, to and from the right
                                    neighbours for the direction
    check_all_gather(student)       the same sizes and directions: every rank ends with every piece
    check_all_reduce(student)       N = 2, 3, 4; 1, 10, 64 elements; float64 and int64: equal to
                                    dist.all_reduce, in place, bit-identical on every rank
    check_bytes(student)            N = 4, 1,024 float32: each phase sends (N-1)/N of the bytes to
                                    one neighbour; the all-reduce sends (N-1)/N to EACH neighbour

REFUSE names the library's rings (and their schedule), which already hold the answer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.grading import CheckFailed, passed
from course_lib.observe.tracer import CommTracer
from course_lib.runtime.pool import RankError, RankTimeout, run_on_ranks

REFUSE = ("course_lib.comm.collectives", "course_lib.comm.ringviz", "course_lib.grading.ex02_ring_all_reduce")
P2P_OPS = {"send", "recv", "isend", "irecv"}
WAY = {1: "to the right (direction=+1)", -1: "to the left (direction=-1)"}


def _reference_sum(x):
    expected = x.clone()
    dist.all_reduce(expected)
    return expected


def _traffic(tracer):
    """(ops used, {peer: bytes sent}, {peer: bytes received})."""
    sent, recv = {}, {}
    for r in tracer.records:
        if r.bytes_sent:
            sent[r.peer] = sent.get(r.peer, 0) + r.bytes_sent
        if r.bytes_recv:
            recv[r.peer] = recv.get(r.peer, 0) + r.bytes_recv
    return {r.op for r in tracer.records}, sent, recv


def _peers_ok(ops, sent, recv, rank, n, direction):
    return ops <= P2P_OPS and set(sent) <= {(rank + direction) % n} and set(recv) <= {(rank - direction) % n}


def _rs_on_rank(reduce_scatter, numel, direction):
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.randn(numel, dtype=torch.float64)
    expected = torch.tensor_split(_reference_sum(x), n)[rank]
    with CommTracer() as tracer:
        mine = reduce_scatter(x, direction)
    is_view = mine.numel() == 0 or mine.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    # float64 sums in another order: within 2(N-1)·ε·Σ|x_r| ≈ 1e-14 here (notebook 02, ε = 2.2e-16)
    right = mine.shape == expected.shape and torch.allclose(mine, expected, rtol=1e-12, atol=1e-12)
    return right, is_view, _peers_ok(*_traffic(tracer), rank, n, direction)


# What gloo says (or how a rank dies) when a message arrives that is not the size its receiver posted.
_MISMATCH = ("Received data size doesn't match", "Connection reset by peer", "exited unexpectedly")


def _ranks(label, fn, *args, world_size):
    try:
        return run_on_ranks(fn, *args, world_size=world_size, timeout_s=60)
    except RankTimeout:
        raise CheckFailed(f"{label}: the ranks hung (in student.py): does every rank receive from the neighbour "
                          "that sends to it, at every step?") from None
    except RankError as error:
        if "NotImplementedError" in str(error) or not any(m in str(error) for m in _MISMATCH):
            raise  # the learner's own error, shown with its line in student.py
        raise CheckFailed(f"{label}: a rank received a message of another size than the buffer it posted, and the "
                          "ranks stopped (in student.py). At every step, the chunk a rank receives into must be the "
                          "chunk its neighbour sends: which chunk does each rank send, and which does it expect?") from None


def check_reduce_scatter(student) -> None:
    for n, numel, direction in ((3, 10, 1), (3, 10, -1), (4, 3, -1), (5, 12, -1)):
        label = f"ring_reduce_scatter, N={n}, {numel} elements, {WAY[direction]}"
        rows = _ranks(label, _rs_on_rank, student.ring_reduce_scatter, numel, direction, world_size=n)
        wrong = [r for r, row in enumerate(rows) if not row[0]]
        if wrong:
            raise CheckFailed(f"{label}: on rank(s) {wrong} the returned chunk is not chunk r of the sum (in student.py). "
                              f"Which chunk must rank r send at step k so that chunk r is the one completed on rank r, "
                              "and which chunk arrives?")
        if not all(row[1] for row in rows):
            raise CheckFailed(f"{label}: return chunk r of `tensor` itself (a view), not a copy (in student.py)")
        if not all(row[2] for row in rows):
            raise CheckFailed(f"{label}: use only send/recv, sending {WAY[direction].split(' (')[0]} and receiving "
                              "from the other neighbour (in student.py)")
        passed(f"{label}: chunk r of the sum, a view, point-to-point only")


def _ag_on_rank(all_gather, numel, direction):
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.zeros(numel, dtype=torch.int64)
    torch.tensor_split(x, n)[rank].fill_(rank + 1)
    pieces = [torch.zeros(numel, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(pieces, x)  # built-in: everyone's tensor; the expected answer is their sum
    expected = torch.stack(pieces).sum(0)
    with CommTracer() as tracer:
        returned = all_gather(x, direction)
    return torch.equal(x, expected), returned is x, _peers_ok(*_traffic(tracer), rank, n, direction)


def check_all_gather(student) -> None:
    for n, numel, direction in ((3, 10, 1), (5, 7, -1), (4, 9, -1)):
        label = f"ring_all_gather, N={n}, {numel} elements, {WAY[direction]}"
        rows = _ranks(label, _ag_on_rank, student.ring_all_gather, numel, direction, world_size=n)
        wrong = [r for r, row in enumerate(rows) if not row[0]]
        if wrong:
            raise CheckFailed(f"{label}: rank(s) {wrong} do not hold every rank's piece (in student.py). Which chunk "
                              "does rank r send first, and where does the chunk it receives belong?")
        if not all(row[1] for row in rows):
            raise CheckFailed(f"{label}: work in place and return `tensor` itself (in student.py)")
        if not all(row[2] for row in rows):
            raise CheckFailed(f"{label}: use only send/recv, sending {WAY[direction].split(' (')[0]} and receiving "
                              "from the other neighbour (in student.py)")
        passed(f"{label}: every rank holds every piece, point-to-point only")


def _ar_on_rank(all_reduce, sizes):
    n, rows = dist.get_world_size(), []
    for dtype in (torch.float64, torch.int64):
        for numel in sizes:
            x = torch.randn(numel, dtype=torch.float64).mul(100).to(dtype)
            expected = _reference_sum(x)
            with CommTracer() as tracer:
                returned = all_reduce(x)
            everyone = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(everyone, x)
            # float64 sums of values ~100 in another order: within 2(N-1)·ε·Σ|x_r| ≈ 1e-12; integers exactly
            close = torch.allclose(x, expected, rtol=1e-12, atol=1e-9) if dtype.is_floating_point else torch.equal(x, expected)
            rows.append((f"{str(dtype).replace('torch.', '')}, {numel} element(s)", close, returned is x,
                         all(torch.equal(e, x) for e in everyone), {r.op for r in tracer.records} <= P2P_OPS))
    return rows


def check_all_reduce(student) -> None:
    for n in (2, 3, 4):
        results = _ranks(f"ring_all_reduce, N={n}", _ar_on_rank, student.ring_all_reduce, (1, 10, 64), world_size=n)
        for i, (label, *_) in enumerate(results[0]):
            if not all(r[i][1] for r in results):
                raise CheckFailed(f"ring_all_reduce, N={n}, {label}: not the sum over the ranks on every rank "
                                  "(in student.py)")
        if not all(row[4] for r in results for row in r):
            raise CheckFailed(f"ring_all_reduce, N={n}: use only send/recv (in student.py)")
        if not all(row[2] for r in results for row in r):
            raise CheckFailed(f"ring_all_reduce, N={n}: work in place and return `tensor` itself (in student.py)")
        if not all(row[3] for r in results for row in r):
            raise CheckFailed(f"ring_all_reduce, N={n}: the ranks' results differ in their last bits (in student.py): "
                              "in a ring each chunk is summed once, on one rank, then copied")
        passed(f"ring_all_reduce, N={n}, float64 and int64, 1, 10, 64 elements: equals dist.all_reduce, in place, "
               "bit-identical on every rank")


def _bytes_on_rank(student):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, direction in (("ring_reduce_scatter", 1), ("ring_reduce_scatter", -1), ("ring_all_gather", 1),
                            ("ring_all_gather", -1), ("ring_all_reduce", None)):
        x = torch.randn(1024)
        with CommTracer() as tracer:
            getattr(student, name)(x) if direction is None else getattr(student, name)(x, direction)
        ops, sent, recv = _traffic(tracer)
        right, left = (rank + 1) % n, (rank - 1) % n
        out[(name, direction)] = (ops <= P2P_OPS, sent.get(right, 0), sent.get(left, 0), recv.get(right, 0),
                                  recv.get(left, 0), sum(sent.values()))
    return out


def check_bytes(student) -> None:
    n, size = 4, 1024 * 4  # 1,024 float32 values on 4 ranks
    results = _ranks("bytes", _bytes_on_rank, student, world_size=n)
    part = (n - 1) * size // n
    for (name, direction), _ in results[0].items():
        label = f"{name}, N={n}, {size:,} bytes" + (f", {WAY[direction]}" if direction else "")
        rows = [r[(name, direction)] for r in results]
        if not all(row[0] for row in rows):
            raise CheckFailed(f"{label}: use only send/recv (in student.py)")
        if direction is None:
            if any(row[1:5] != (part, part, part, part) for row in rows):
                got = [dict(zip(("to right", "to left", "from right", "from left"), row[1:5])) for row in rows]
                raise CheckFailed(f"{label}: each rank must send (N-1)/N of the bytes to EACH neighbour and receive as "
                                  f"much from each, half the elements going each way (in student.py); your ranks: {got}")
        else:
            sends = [row[1] if direction == 1 else row[2] for row in rows]
            if any(row[5] != part for row in rows) or any(s != part for s in sends):
                raise CheckFailed(f"{label}: each rank sent {[row[5] for row in rows]} bytes in all, "
                                  f"{sends} of them {WAY[direction].split(' (')[0]} (in student.py): a ring phase sends "
                                  "(N-1)/N of the bytes, all to one neighbour")
        passed(f"{label}: " + ("(N-1)/N of the bytes to each neighbour" if direction is None
                               else "(N-1)/N of the bytes, to the neighbour in that direction"))
