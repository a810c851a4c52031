"""Imbalance as time (notebook 07): under expert parallelism the busiest rank's experts set the pace.

    timed_moe_layer(config, skews, tokens)  rank code: one MoE layer forward per case (one router
                                            skew each), the cases interleaved round after round;
                                            per case: rows this rank's experts received, their CPU
                                            seconds in each round, the last round's Timeline events
    collapse_router(model)                  the extreme case on a whole GPT, in place: every token of
                                            every rank routed to experts 0 and 1 (rank 0's)

Rank s runs its experts on R_s = sum over ranks r of the rows r routed to s, so its expert time
is about R_s * (one row's expert FLOPs) / (its FLOP rate). The combine all-to-all cannot finish
before the slowest rank has computed, so every rank's layer takes at least

    max_s R_s * t_row   (balanced: k N_total / ep rows each; collapsed onto one rank: k N_total)

`skew` forces the imbalance: a selection bias (balance="bias", model/moe.py) of `skew` on rank
0's experts, so with a skew of a few units every token picks rank 0's experts and the other ranks
receive nothing. skew = 0 leaves the fresh router, balanced up to chance.

What is timed. Each rank runs one thread, and its experts' time is the CPU time of that thread
(time.thread_time) from the first local expert's forward to the last one's end: the matmuls of
its own rows, and nothing while the process waits or while the OS runs another process on its
core. Wall-clock spans (the Timeline, for the Gantt chart) stretch whenever ranks outnumber the
free cores: 8 ranks on 2 busy cores each get a quarter of a core or less, and a rank's wall time
then says more about the scheduler than about its rows. CPU time still grows with the rows.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from course_lib.model.moe import MoELayer
from course_lib.model.moe_config import MoEGPTConfig
from course_lib.observe.timeline import Timeline
from course_lib.observe.tracer import CommTracer
from course_lib.parallel.ep.apply import ExpertParallelExperts


def timed_moe_layer(config, skews: tuple[float, ...], tokens: int, rounds: int = 7, seed: int = 0):
    """Rank code. One MoE layer of `config` (its experts split over the world), `tokens` random rows
    per rank, one thread per rank. Each round runs one forward per skew (the order reversed every
    other round, so drift on a shared machine falls on every case alike), after one warm-up round.
    Returns one (rows this rank's experts received, [their CPU seconds per round], the last round's
    Timeline events) per skew, in the order of `skews`."""
    cfg = MoEGPTConfig.from_config(config, balance="bias", bias_rate=0.0)
    torch.manual_seed(seed)  # the same weights on every rank
    layer = MoELayer(cfg)
    layer.experts = ExpertParallelExperts(layer.experts)
    x = torch.randn(1, tokens, cfg.d_model, generator=torch.Generator().manual_seed(100 + dist.get_rank()))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per rank, as one GPU per rank: no rank borrows an idle rank's core
    try:
        return _timed(layer, x, skews, rounds)
    finally:
        torch.set_num_threads(threads)


def _cpu_clock(mlps):
    """Hooks on the local experts: clock[0] collects this thread's CPU seconds inside them."""
    clock = [0.0, 0.0]

    def pre(module, args):
        clock[1] = time.thread_time()

    def post(module, args, out):
        clock[0] += time.thread_time() - clock[1]

    handles = [h for m in mlps for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    return clock, handles


def _timed(layer, x, skews, rounds):
    per_rank = layer.n_experts // dist.get_world_size()
    clock, handles = _cpu_clock(layer.experts.mlps.values())
    results = [[0, [], None] for _ in skews]
    with torch.no_grad():
        for r in range(rounds + 1):  # round 0 warms up (allocator, caches) and is dropped
            order = range(len(skews)) if r % 2 else reversed(range(len(skews)))
            for case in order:
                layer.expert_bias[:per_rank] = skews[case]
                timeline, clock[0] = Timeline(), 0.0
                layer.experts.timeline = timeline
                dist.barrier()  # every rank starts the layer together
                with CommTracer(timeline=timeline):
                    layer(x)
                if r:
                    results[case][1].append(clock[0])
                results[case][0], results[case][2] = layer.experts.last_received, timeline.events
    for h in handles:
        h.remove()
    return [tuple(r) for r in results]


def collapse_router(model, boost: float = 3.0):
    """In place, returns `model`: every token's MLP input becomes one vector u = 1 (each ln2 outputs
    its bias alone) and experts 0 and 1 get `boost` on their router logit for u (their router rows
    += boost / d), against ~N(0, 0.11) for the others: with top_k <= 2 every token of every rank
    picks experts 0 and 1, rank 0's, and the other ranks receive no token at all."""
    with torch.no_grad():
        for block in model.blocks:
            block.ln2.weight.zero_()
            block.ln2.bias.fill_(1.0)
            block.mlp.router.weight[:2] += boost / block.mlp.router.weight.shape[1]
    return model
