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

Per-parameter stage 3 (sharding="per_param"): measure_state_bytes reads its local shards, their
fp32 gradients and AdamW's m, v the same way (no flat buffer, no separate master), and
`watch_gathered(model.per_param)` records the gathered bytes (held_gathered) at every event of
its schedule; course_lib.estimate.per_param_memory is the formula for both.
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
    shards = getattr(optimizer, "shards", ())  # per-parameter design: none, its shards are the parameters
    out["grads"] += sum(_nbytes(s.grad_shard) for s in shards
                        if s.grad_shard is not None and s.grad_shard.data_ptr() not in own)
    state = sum(_nbytes(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    flat_ptrs = [(s.flat_param.data_ptr(), s.flat_param.data_ptr() + _nbytes(s.flat_param))
                 for s in shards if getattr(s, "flat_param", None) is not None]
    param_ptrs = {p.data_ptr() for p in params}
    masters = sum(_nbytes(s.master) for s in shards
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


def held_gathered(sharded) -> int:
    """Bytes a PerParamModel holds gathered now: every unit's padded tensors (a freed one's storage
    has 0 bytes), its all-gather output while one is in flight, and the 1/k piece that
    reshard_after_forward=k keeps between forward and backward."""
    total = 0
    for unit in sharded.units:
        total += sum(t.untyped_storage().nbytes() for t in unit.padded)
        total += _nbytes(getattr(unit, "buffer", None)) + _nbytes(unit.partial)
    return total


def watch_gathered(sharded) -> list[tuple[str, str, int]]:
    """[(event, unit name, held_gathered)] filled as the model runs: one entry at every event of the
    schedule (gather, forward, done, backward, reduce), read from the outside (the instance's log
    is wrapped; the runtime is unchanged). A gather logs after allocating its tensors and output,
    and what is allocated between events (the 1/k piece, cut just before a free) stays below the
    next gather's bytes, so the largest value is the step's peak of these tensors."""
    trace, log = [], sharded.log

    def logged(what, unit):
        log(what, unit)
        trace.append((what, unit.name, held_gathered(sharded)))

    sharded.log = logged
    return trace
