"""What a ZeRO rank holds, measured from its tensors, beside notebook 01's formula.

    measure_state_bytes(model, optimizer) -> {"params", "grads", "optimizer", "host"}

params     numel * element size of model.parameters() (stage 3: this rank's shards). The
           flat buffers' padding (fewer than N elements per unit) is not a parameter.
grads      every .grad of those parameters + the gradient shards the optimizer keeps.
optimizer  the inner optimizer's per-element state (Adam's m, v; a 0-dim step is not
           per-parameter state) + fp32 master shards that are not the parameters themselves.
host       the same optimizer bytes when offloaded (then "optimizer" is 0 on the device).

`expected_state_bytes(unit_sizes, recipe, stage, dp)` is notebook 01's formula applied to every
flat unit and summed: each unit is padded and sharded on its own, so the rank's shard is
sum_u ceil(P_u / N), which is ceil(Psi / N) plus at most (units - 1) elements.
"""

from __future__ import annotations

import torch

from course_lib.estimate import model_state_bytes


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def measure_state_bytes(model, optimizer) -> dict[str, int]:
    params = list(model.parameters())
    out = {"params": sum(_nbytes(p) for p in params), "grads": sum(_nbytes(p.grad) for p in params)}
    own = {p.grad.data_ptr() for p in params if p.grad is not None}
    out["grads"] += sum(_nbytes(s.grad_shard) for s in optimizer.shards
                        if s.grad_shard is not None and s.grad_shard.data_ptr() not in own)
    state = sum(_nbytes(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    flat_ptrs = [(s.flat_param.data_ptr(), s.flat_param.data_ptr() + _nbytes(s.flat_param))
                 for s in optimizer.shards if getattr(s, "flat_param", None) is not None]
    param_ptrs = {p.data_ptr() for p in params}
    masters = sum(_nbytes(s.master) for s in optimizer.shards
                  if s.master.data_ptr() not in param_ptrs
                  and not any(lo <= s.master.data_ptr() < hi for lo, hi in flat_ptrs))
    opt_bytes = state + masters
    out["optimizer"], out["host"] = (0, opt_bytes) if optimizer.offload is not None else (opt_bytes, 0)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def expected_state_bytes(unit_sizes: list[int], recipe: str, stage: int, dp: int) -> dict[str, int]:
    """Sum over units of course_lib.estimate.model_state_bytes(P_u, recipe, stage, dp)."""
    out = {"params": 0, "grads": 0, "optimizer": 0, "total": 0}
    for n in unit_sizes:
        for k, v in model_state_bytes(n, recipe, stage, dp).items():
            out[k] += v
    return out
