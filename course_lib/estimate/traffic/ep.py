"""Expert parallelism's all-to-alls and its average of the dense gradients (course_lib.estimate.traffic: the notation)."""

from __future__ import annotations

from course_lib.estimate.params import model_shape
from course_lib.estimate.traffic.records import Collective, _shape, dense_params, padded_vocab


def ep_traffic(config, dims, batch_size: int, seq: int | None = None, act_bytes: int = 4,
               grad_bytes: int | None = None) -> list[Collective]:
    """Expert parallelism's all-to-alls and its average of the dense gradients (module docstring)."""
    if dims.ep == 1:
        return []
    base, s, mb, l0 = _shape(config, dims, batch_size, seq)
    s //= dims.cp  # context parallelism: a rank's tokens of each sequence
    shape = model_shape(config)
    n_experts, top_k = shape.n_experts, shape.top_k
    L, m, n, R = base.n_layer, dims.microbatches, dims.ep, dims.replicas * dims.cp
    rows = mb * s * top_k * base.d_model * act_bytes  # one micro-batch's routed rows, every rank sends all
    dense = (dense_params(config) + (padded_vocab(config, dims.tp) * base.d_model
                                     if dims.pp > 1 and getattr(base, "tie_weights", False) else 0))
    g = act_bytes if grad_bytes is None else grad_bytes
    return [
        Collective("ep", "dispatch and combine, forward and backward", "all_to_all", rows, n, 4 * l0 * m,
                   R * 4 * L * m * rows),
        Collective("ep", "the routing counts", "all_to_all", n_experts * 8, n, l0 * m, R * L * m * n_experts * 8, 0,
                   "left out by the step-time model: E numbers"),
        Collective("ep", "the dense gradients averaged over ep", "all_reduce", dense * g / dims.pp, n, 1,
                   R * dense * g, 0, "priced by the step-time model with dp's, over dp*ep replicas"),
        Collective("ep", "the loss averaged over ep", "all_reduce", 8, n, 1, 8 * dims.world_size, report=True)]
