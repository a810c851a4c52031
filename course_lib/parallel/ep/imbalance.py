"""Imbalance as time (notebook 07): under expert parallelism the busiest rank's experts set the pace.

    timed_moe_layer(config, skew, tokens)   rank code: one MoE layer forward on every rank of the
                                            world, its all-to-alls and the local experts' compute
                                            on a Timeline; returns rows received, expert seconds, events
    collapse_router(model)                  the extreme case on a whole GPT, in place: every token of
                                            every rank routed to experts 0 and 1 (rank 0's)

Rank s runs its experts on R_s = sum over ranks r of the rows r routed to s, so its expert time
is about R_s * (one row's expert FLOPs) / (its FLOP rate). The combine all-to-all cannot finish
before the slowest rank has computed, so every rank's layer takes at least

    max_s R_s * t_row   (balanced: k N_total / ep rows each; collapsed onto one rank: k N_total)

`skew` forces the imbalance: a selection bias (balance="bias", model/moe.py) of `skew` on rank
0's experts, so with a skew of a few units every token picks rank 0's experts and the other ranks
receive nothing. skew = 0 leaves the fresh router, balanced up to chance.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.model.moe import MoELayer
from course_lib.model.moe_config import MoEGPTConfig
from course_lib.observe.timeline import Timeline
from course_lib.observe.tracer import CommTracer
from course_lib.parallel.ep.apply import ExpertParallelExperts


def timed_moe_layer(config, skew: float, tokens: int, repeats: int = 5, seed: int = 0):
    """Rank code. One MoE layer of `config` (its experts split over the world), `tokens` random
    rows per rank, forward `repeats` times (the first warms up), one thread per rank. Returns
    (rows this rank's experts received, its experts' seconds in the fastest repeat after the
    first, the last forward's Timeline events)."""
    cfg = MoEGPTConfig.from_config(config, balance="bias", bias_rate=0.0)
    torch.manual_seed(seed)  # the same weights on every rank
    layer = MoELayer(cfg)
    layer.experts = ExpertParallelExperts(layer.experts)
    per_rank = cfg.n_experts // dist.get_world_size()
    layer.expert_bias[:per_rank] = skew
    x = torch.randn(1, tokens, cfg.d_model, generator=torch.Generator().manual_seed(100 + dist.get_rank()))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per rank, as one GPU per rank: no rank borrows an idle rank's core
    try:
        return _timed(layer, x, repeats)
    finally:
        torch.set_num_threads(threads)


def _timed(layer, x, repeats):
    seconds = []
    with torch.no_grad():
        for _ in range(repeats):
            timeline = Timeline()
            layer.experts.timeline = timeline
            dist.barrier()  # every rank starts the layer together
            with CommTracer(timeline=timeline):
                layer(x)
            seconds.append(sum(end - start for name, start, end, _ in timeline.events if name == "experts"))
    # the fastest repeat after the first: the least disturbed by other work on shared cores
    return layer.experts.last_received, min(seconds[1:]), timeline.events


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
