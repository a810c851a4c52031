"""NCCL's point-to-point rules on gloo ranks (course_lib/observe/nccl_rules.py): each pattern that
hangs or mismatches on NCCL fails here with a message naming the ranks and calls, never a hang,
and the orders NCCL accepts pass with the data gloo delivers. Every tensor is made on the rank's
device, as NCCL needs (COURSE_NCCL_RULES=1 also turns on observe/device_rule.py)."""

import pytest
import torch
import torch.distributed as dist

from course_lib.observe.nccl_rules import NcclRuleError, _Rules, under_rules
from course_lib.runtime import RankError, run_on_ranks
from course_lib.runtime.device import rank_device


def _both_send_first(n):
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    mine, theirs = torch.full((n,), float(me), device=rank_device()), torch.empty(n, device=rank_device())
    dist.send(mine, peer)
    dist.recv(theirs, peer)
    return theirs[0].item()


def test_both_ranks_send_first_is_a_named_deadlock_not_a_hang():
    with pytest.raises(RankError) as e:
        run_on_ranks(under_rules(_both_send_first), 1 << 20, world_size=2, timeout_s=60)
    msg = str(e.value)
    assert "2 of 2 rank(s) failed" in msg and "deadlock" in msg and "both ranks send first" in msg
    for rank, peer in ((0, 1), (1, 0)):
        assert f"rank {rank} send #1 to rank {peer} (shape [1048576], float32, tag 0)" in msg


def _by_parity(n):
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    mine, theirs = torch.full((n,), float(me), device=rank_device()), torch.empty(n, device=rank_device())
    if me % 2 == 0:
        dist.send(mine, peer)
        dist.recv(theirs, peer)
    else:
        dist.recv(theirs, peer)
        dist.send(mine, peer)
    return theirs[0].item()


def test_the_same_swap_ordered_by_rank_parity_passes():
    assert run_on_ranks(under_rules(_by_parity), 1 << 20, world_size=2, timeout_s=60) == [1.0, 0.0]


def _receives_first(batched):
    """Both ranks post their receive, then their send (the pipeline runner's old prefetch)."""
    peer = 1 - dist.get_rank()
    mine, theirs = torch.full((4,), float(dist.get_rank()), device=rank_device()), torch.empty(4, device=rank_device())
    if batched:
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, theirs, peer), dist.P2POp(dist.isend, mine, peer)])
    else:
        works = [dist.irecv(theirs, peer), dist.isend(mine, peer)]
    for w in works:
        w.wait()
    return theirs[0].item()


def test_receive_posted_ahead_of_the_send_deadlocks_unless_batched():
    with pytest.raises(RankError) as e:
        run_on_ranks(under_rules(_receives_first), False, world_size=2, timeout_s=60)
    assert "deadlock" in str(e.value) and "rank 0 irecv #1 from rank 1" in str(e.value)
    # one batch: its calls progress independently, as NCCL's group does
    assert run_on_ranks(under_rules(_receives_first), True, world_size=2, timeout_s=60) == [1.0, 0.0]


def _tagged():
    """Rank 0 sends a (tag 1) then b (tag 2); rank 1 receives b first by its tag."""
    if dist.get_rank() == 0:
        a, b = torch.tensor([1.0], device=rank_device()), torch.tensor([2.0], device=rank_device())
        for w in [dist.isend(a, 1, tag=1), dist.isend(b, 1, tag=2)]:
            w.wait()
        return None
    b, a = torch.empty(1, device=rank_device()), torch.empty(1, device=rank_device())
    works = [dist.irecv(b, 0, tag=2), dist.irecv(a, 0, tag=1)]
    for w in works:
        w.wait()
    return a.item(), b.item()


def test_tags_relied_on_are_a_mismatch_and_gloo_unchanged_without_the_rules():
    assert run_on_ranks(under_rules(_tagged, on=False), world_size=2, timeout_s=60)[1] == (1.0, 2.0)
    with pytest.raises(RankError) as e:
        run_on_ranks(under_rules(_tagged), world_size=2, timeout_s=60)
    msg = str(e.value)
    assert "tags differ" in msg
    assert ("rank 0 isend #1 to rank 1 (shape [1], float32, tag 1) is the message NCCL delivers into "
            "rank 1 irecv #1 from rank 0 (shape [1], float32, tag 2)") in msg


def _shapes():
    if dist.get_rank() == 0:
        dist.send(torch.zeros(2, 3, device=rank_device()), 1)
    else:
        dist.recv(torch.empty(3, 2, device=rank_device()), 0)


def test_shapes_that_differ_are_a_mismatch():
    with pytest.raises(RankError, match=r"NCCL needs the same dtype and count.*shape \[2, 3\].*shape \[3, 2\]"):
        run_on_ranks(under_rules(_shapes), world_size=2, timeout_s=60)


def _batch_in_order():
    """Each rank sends two tensors and receives two in one batch, sends listed first."""
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    out = [torch.full((3,), 10.0 * me + i, device=rank_device()) for i in range(2)]
    inp = [torch.empty(3, device=rank_device()), torch.empty(3, device=rank_device())]
    ops = [dist.P2POp(dist.isend, t, peer) for t in out] + [dist.P2POp(dist.irecv, t, peer) for t in inp]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return [t[0].item() for t in inp]


def test_a_batch_matched_in_order_passes_with_gloos_data():
    off = run_on_ranks(under_rules(_batch_in_order, on=False), world_size=2, timeout_s=60)
    assert run_on_ranks(under_rules(_batch_in_order), world_size=2, timeout_s=60) == off == [[10.0, 11.0], [0.0, 1.0]]


def _ring_of_blocking_sends():
    me, n = dist.get_rank(), dist.get_world_size()
    dist.send(torch.ones(8, device=rank_device()), (me + 1) % n)
    dist.recv(torch.empty(8, device=rank_device()), (me - 1) % n)


def test_a_ring_of_blocking_sends_is_a_named_cycle():
    with pytest.raises(RankError) as e:
        run_on_ranks(under_rules(_ring_of_blocking_sends), world_size=3, timeout_s=60)
    msg = str(e.value)
    assert "deadlock" in msg
    for r in range(3):
        assert f"rank {r}: rank {r} send #1 to rank {(r + 1) % 3}" in msg


def _gloo_only(which):
    if which == "monitored_barrier":
        dist.monitored_barrier()
    elif which == "any_source":
        if dist.get_rank() == 0:
            dist.send(torch.ones(1, device=rank_device()), 1)
        else:
            dist.recv(torch.empty(1, device=rank_device()))
    else:
        dist.all_reduce(torch.ones(1, dtype=torch.int64, device=rank_device()), op=dist.ReduceOp.BOR)


@pytest.mark.parametrize("which, says", [("monitored_barrier", "monitored_barrier is gloo-only"),
                                          ("any_source", "from any source"),
                                          ("bitwise", "NCCL has no bitwise reductions")])
def test_gloo_only_calls_are_refused(which, says):
    run_on_ranks(under_rules(_gloo_only, on=False), which, world_size=2, timeout_s=60)  # fine on gloo
    with pytest.raises(RankError, match=says):
        run_on_ranks(under_rules(_gloo_only), which, world_size=2, timeout_s=60)


def _calls(*spec):
    """[(kind, unit)] -> the model's call records, numbered per kind."""
    out, n = [], {"send": 0, "recv": 0}
    for kind, unit in spec:
        out.append({"kind": kind, "unit": unit, "n": n[kind]})
        n[kind] += 1
    return out


def test_the_pair_model():
    progress = _Rules.progress
    # a sends then receives, b receives then sends: both complete
    assert progress(_calls(("send", 0), ("recv", 1)), _calls(("recv", 0), ("send", 1))) == (2, 2)
    # both send first: nothing completes
    assert progress(_calls(("send", 0), ("recv", 1)), _calls(("send", 0), ("recv", 1))) == (0, 0)
    # ... unless each side's two calls are one batch
    assert progress(_calls(("send", 0), ("recv", 0)), _calls(("send", 0), ("recv", 0))) == (2, 2)
    # a send whose receive is not posted yet waits
    assert progress(_calls(("send", 0)), []) == (0, 0)
    # the 1F1B order without batching: a sends twice then receives, b receives, sends, receives
    assert progress(_calls(("send", 0), ("send", 1), ("recv", 2)),
                    _calls(("recv", 0), ("send", 1), ("recv", 2))) == (1, 1)


def _one_f_one_b_unbatched():
    """PipeDream-2BW's old order on 2 ranks: rank 0 sends activations 0 and 1 before it receives
    gradient 0; rank 1 sends gradient 0 before it receives activation 1."""
    x = torch.ones(4, device=rank_device())
    if dist.get_rank() == 0:
        works = [dist.isend(x, 1), dist.isend(x, 1)]
        dist.recv(torch.empty(4, device=rank_device()), 1)
        for w in works:
            w.wait()
    else:
        dist.recv(torch.empty(4, device=rank_device()), 0)
        work = dist.isend(x, 0)
        dist.recv(torch.empty(4, device=rank_device()), 0)
        work.wait()


def test_1f1b_without_batches_deadlocks():
    with pytest.raises(RankError) as e:
        run_on_ranks(under_rules(_one_f_one_b_unbatched), world_size=2, timeout_s=60)
    msg = str(e.value)
    assert "deadlock" in msg and "both ranks send first" not in msg
    assert ("rank 0: rank 0 recv #1 from rank 1 (shape [4], float32, tag 0), queued behind rank 0 isend #2 to "
            "rank 1 (shape [4], float32, tag 0), waits for rank 1's matching send") in msg
    assert "rank 1: rank 1 recv #2 from rank 0 (shape [4], float32, tag 0), queued behind rank 1 isend #1 to rank 0" in msg


# ---------------------------------------------------------------- the course's own orders, under the rules

def _course_p2p():
    """Every fixed order of the course on these ranks: the pipeline
    runner's schedules (and the tied embedding's gradient swap at their end), and the
    send/recv all-reduces of comm (exchange with one peer both ways)."""
    from course_lib import comm
    from course_lib.model import GPT, GPTConfig
    from course_lib.parallel.pp import build_stage, run_schedule

    out = {}
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=4, n_head=2, d_model=8)
    idx = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(0))
    for name, m, v, placement in (("gpipe", 1, 1, "loop"), ("1f1b", 4, 1, "loop"), ("zero_bubble", 4, 1, "loop"),
                                  ("interleaved_1f1b", 2, 2, "loop"), ("zbv", 2, 2, "v"), ("dualpipev", 4, 2, "v")):
        stage = build_stage(GPT(cfg, seed=0), None, v, placement)
        loss = run_schedule(stage, idx, idx, name, m)
        out[name] = (loss, [p.grad.clone() for p in stage.parameters()])
    for algorithm in ("ring", "tree", "rabenseifner"):
        x = torch.arange(6.0, device=rank_device()) * (dist.get_rank() + 1)
        comm.ALL_REDUCE_ALGORITHMS[algorithm](x)
        out[algorithm] = x
    return out


def test_the_course_orders_pass_under_the_rules_with_the_same_numbers():
    off = run_on_ranks(under_rules(_course_p2p, on=False), world_size=2, timeout_s=120)
    on = run_on_ranks(under_rules(_course_p2p), world_size=2, timeout_s=120)
    for a, b in zip(off, on):
        assert a.keys() == b.keys()
        for k in a:  # the same messages into the same buffers: exactly equal
            if isinstance(a[k], tuple):
                assert a[k][0] == b[k][0] and all(torch.equal(x, y) for x, y in zip(a[k][1], b[k][1])), k
            else:
                assert torch.equal(a[k], b[k]), k
