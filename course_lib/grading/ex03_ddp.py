"""Checkers of exercise 03 (bucketed, overlapped DDP whose buckets are rebuilt after the first
step in the order the gradients really arrived, the same layout on every rank).

    check_build_buckets(student)   layouts of several orders, sizes and caps (stored as digests
                                   of the reference solution's answers, never as readable lists);
                                   an order that is not a permutation is refused with ValueError
    check_steps_on_ranks(student)  a small model whose layers run in a rank-dependent order
                                   (so the ranks' gradients arrive in different orders), trained
                                   3 steps on 2 and on 3 ranks with every all-reduce traced: rank
                                   0's parameters on every rank after construction; every call
                                   asynchronous and waited for only after backward returned; one
                                   call per bucket carrying every gradient once; each p.grad the
                                   average of the ranks' gradients; one bucket layout shared by
                                   every rank; from step 2 on every bucket launched during
                                   backward, and on rank 0 every bucket but the last launched
                                   before rank 0's last gradient arrived (the rebuilt order)

The comparison with torch's DistributedDataParallel on the course GPT stays in the notebook.
REFUSE names what already holds the answer: the library's DDP and torch's.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.grading import CheckFailed, check_equal, passed
from course_lib.grading.stored import check_digest
from course_lib.runtime.pool import RankError, RankTimeout, run_on_ranks

REFUSE = ("course_lib.parallel.dp.ddp",  # DDP, assign_buckets, broadcast_parameters (re-exported by course_lib.parallel)
          "torch.nn.parallel.DistributedDataParallel", "course_lib.grading.ex03_ddp")

# (order, sizes in bytes, cap in bytes) -> digest(reference build_buckets(order, sizes, cap)), computed
# once with exercises/solutions/ex03_ddp.py. The cases separate the plausible rules: a cap met exactly,
# a parameter larger than the cap, an order that is not reversed registration, a last unfilled bucket.
BUCKET_CASES = [
    (([3, 2, 1, 0], [2, 8, 2, 8], 10), "05eb2f212c212227a0bd0f3407b390886fd06f7b0120407bb0af487863a9eac5"),
    (([0, 2, 1, 3], [4, 100, 4, 4], 10), "aff5d51b1a57062679a8e4eac0f797e8b3b7c76a6c041c053b1805b38df74fb0"),
    (([2, 0, 1, 3], [16, 4, 4, 4], 8), "13abf8994b47788f03380fbfecc8f5c3c3bb6f4f1cf7000ce3ebc06176a543e6"),
    (([1, 0, 2], [1, 2, 3], 10**9), "469655a16ee091b8b65e3a2111fe28050e646de092153978fff103f1b7953591"),
    (([4, 3, 2, 1, 0], [256, 32, 256, 32, 100], 288.0), "fc862f8512fd552ad31bf19b2c4450ca4d3287debdcad38e6dd720976d13e61f"),
    (([], [], 8), "4f53cda18c2baa0c0354bb5f9a3ecbe5ed12ab4d8e11ba873c2f11161202b945"),
]
HINT = ("walk the indices in the order given; a bucket is closed as soon as it holds at least the cap "
        "(it may overshoot by its last parameter); a last, unfilled bucket is kept")


def check_build_buckets(student) -> None:
    for (order, sizes, cap), expected in BUCKET_CASES:
        got = student.build_buckets(list(order), list(sizes), cap)
        try:
            got = [[int(i) for i in b] for b in got]
        except (TypeError, ValueError):
            raise CheckFailed(f"build_buckets({order}, {sizes}, {cap}) returned {got!r}: expected a list of "
                              "lists of parameter indices (in student.py)") from None
        check_digest(f"build_buckets({order}, {sizes}, cap={cap})", got, expected, hint=HINT)
    for order, sizes in (([0, 0, 1], [4, 4, 4]), ([0, 1], [4, 4, 4]), ([0, 1, 3], [4, 4, 4])):
        try:
            student.build_buckets(order, sizes, 8)
        except ValueError:
            continue
        raise CheckFailed(f"build_buckets({order}, {sizes}, 8) must raise ValueError (in student.py): the order "
                          f"must name each of the {len(sizes)} parameters exactly once")
    passed("build_buckets refuses an order that does not name every parameter exactly once")


WIDTH, DEPTH = 8, 4
CAP_BYTES = (WIDTH * WIDTH + WIDTH) * 4  # one layer's weight and bias: about one layer per bucket


class Twisted(nn.Module):
    """DEPTH square layers, run last-registered first on even ranks and in registration order on
    odd ranks: the ranks' gradients arrive in opposite orders, and on rank 0 the reverse of the
    registration order is the reverse of the order the gradients really arrive in."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x):
        layers = list(self.layers)
        for layer in (reversed(layers) if dist.get_rank() % 2 == 0 else layers):
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


class _Traced:
    """The work of an async all-reduce, noting when it is first waited for."""

    def __init__(self, work, record):
        self._work, self._record = work, record

    def wait(self, *args, **kwargs):
        if self._record["waited"] is None:
            self._record["waited"] = time.perf_counter()
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _steps_on_rank(simple_ddp, steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, reference = Twisted(), Twisted()
    reference.load_state_dict(model.state_dict())  # rank 0's values (rank 0 adds 0 below)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank)  # replicas differ until they are made equal
    arrived = []
    for p in model.parameters():  # registered before the learner's hooks: fires first for each parameter
        p.register_post_accumulate_grad_hook(lambda p: arrived.append(time.perf_counter()))
    calls, real = [], dist.all_reduce

    def traced(tensor, *args, **kwargs):
        is_async = kwargs.get("async_op", args[2] if len(args) > 2 else False)
        record = {"numel": tensor.numel(), "async": bool(is_async), "launch": time.perf_counter(), "waited": None}
        calls.append(record)
        work = real(tensor, *args, **kwargs)
        if not is_async:
            record["waited"] = record["launch"]
            return work
        return _Traced(work, record)

    index = {p: i for i, p in enumerate(model.parameters())}
    out = {"steps": []}
    dist.all_reduce = traced
    try:
        ddp = simple_ddp(model, bucket_cap_mb=CAP_BYTES / 2**20)
        out["broadcast"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
        for step in range(steps):
            x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))
            arrived.clear()
            calls.clear()
            ddp(x).backward()
            done = time.perf_counter()
            ddp.finish_gradient_synchronization()
            record = {"calls": [dict(c) for c in calls], "done": done, "last_grad": max(arrived),
                      "layout": [[index[p] for p in b] for b in ddp.buckets]}
            reference.zero_grad(set_to_none=True)
            reference(x).backward()
            errors = []
            for p, q in zip(model.parameters(), reference.parameters()):
                g = q.grad / world
                real(g)  # the average, one parameter at a time
                errors.append(((p.grad - g).norm() / g.norm()).item() if p.grad is not None else float("inf"))
            record["grad_error"] = max(errors)
            with torch.no_grad():  # the same SGD step on both, from the learner's averaged gradient
                for p, q in zip(model.parameters(), reference.parameters()):
                    p.sub_(0.1 * p.grad)
                    q.copy_(p)
            model.zero_grad(set_to_none=True)
            out["steps"].append(record)
    finally:
        dist.all_reduce = real
    return out


def _fail(world, step, what):
    raise CheckFailed(f"{world} ranks, step {step + 1}: {what} (in student.py)")


def check_steps_on_ranks(student, steps: int = 3) -> None:
    for world in (2, 3):
        try:
            results = run_on_ranks(_steps_on_rank, student.SimpleDDP, steps, world_size=world, timeout_s=60)
        except RankTimeout:
            raise CheckFailed(f"{world} ranks: your SimpleDDP hung (in student.py). Do all ranks launch the same "
                              "buckets in the same order, and every bucket in every step?") from None
        except RankError as error:
            raise CheckFailed(f"{world} ranks: your SimpleDDP raised on a rank (in student.py):\n{error}\n Do all "
                              "ranks hold the same buckets, launched in the same order?") from None
        if not all(r["broadcast"] for r in results):
            raise CheckFailed(f"{world} ranks: after SimpleDDP(...) the ranks' parameters differ from rank 0's "
                              "(in student.py): every replica must start from rank 0's values")
        for step in range(steps):
            rows = [r["steps"][step] for r in results]
            for rank, row in enumerate(rows):
                calls = row["calls"]
                if any(not c["async"] for c in calls):
                    _fail(world, step, f"rank {rank} called dist.all_reduce without async_op=True: a blocking "
                          "call stops backward until the bucket has travelled")
                if any(c["waited"] is not None and c["waited"] < row["done"] for c in calls):
                    _fail(world, step, f"rank {rank} waited for an all-reduce before backward returned: waiting "
                          "inside the gradient hook stops backward until the bucket has travelled")
                if len(calls) != len(row["layout"]):
                    _fail(world, step, f"rank {rank} made {len(calls)} all-reduce calls for {len(row['layout'])} "
                          "buckets: one call per bucket, in every step (is the bookkeeping of the previous step reset?)")
                n_params = sum(p.numel() for p in Twisted().parameters())
                if sum(c["numel"] for c in calls) != n_params:
                    _fail(world, step, f"rank {rank} all-reduced {sum(c['numel'] for c in calls)} elements for "
                          f"{n_params} parameters' elements: every gradient once")
            # float32: the flat bucket and one parameter's all-reduce may add the ranks' terms in another
            # order (~1e-7 relative); a gradient not divided by N, or summed with another bucket, is off by O(1)
            worst = max(row["grad_error"] for row in rows)
            if worst > 1e-5:
                _fail(world, step, f"p.grad after finish_gradient_synchronization() is not the average of the ranks' "
                      f"gradients (relative error {worst:.2g}): divided by N? each rank's bucket summed with the "
                      "same bucket of the others?")
            if any(row["layout"] != rows[0]["layout"] for row in rows):
                _fail(world, step, "the ranks hold different bucket layouts: collectives are matched by the order "
                      "they are issued, so every rank must bucket its parameters the same way. A rank's observed "
                      "order is its own")
            if step == 0:
                continue
            for rank, row in enumerate(rows):
                late = sum(c["launch"] >= row["done"] for c in row["calls"])
                if late:
                    _fail(world, step, f"rank {rank} launched {late} of {len(row['calls'])} buckets after backward "
                          "returned: is the bookkeeping of the previous step reset?")
            row = rows[0]
            early = sum(c["launch"] < row["last_grad"] for c in row["calls"])
            if early != len(row["calls"]) - 1:
                _fail(world, step, f"rank 0 launched {early} of {len(row['calls'])} buckets before its last gradient "
                      "arrived: from step 2 on, the buckets should follow the order the gradients really "
                      "arrived in during step 1, so that all but the last leave during backward")
        passed(f"{world} ranks, {steps} steps: replicas start equal; one async all-reduce per bucket, waited for "
               "after backward; averaged gradients; one layout on every rank; rebuilt buckets leave during backward")
