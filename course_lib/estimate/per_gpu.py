"""Per-GPU memory of one layout: everything of memory.py on the busiest GPU of a
dp x ep x tp x pp mesh (notebook 01, section 6; the calculator draws it)."""

from __future__ import annotations

from course_lib.estimate.memory import RECIPES, activation_bytes, model_state_bytes
from course_lib.estimate.params import LlamaLikeConfig, cdiv, ff_dim, param_breakdown, positive_int, unpack


def per_gpu_memory(config, batch: int = 1, seq: int | None = None, recipe: str = "bf16_mixed", zero_stage: int = 0,
                   dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, recompute: str = "none",
                   offload: str = "none", attention: str | None = None, sequence_parallel: bool | None = None) -> dict:
    """Bytes on the busiest GPU: {"params", "grads", "optimizer", "activations", "total",
    "cpu_offload", "params_on_gpu", "n_gpus", "stage"}. `batch` is the micro-batch per GPU.

    The mesh is course_lib.parallel.mesh's: n_gpus = dp * ep * tp * pp. tp splits attention heads, MLP
    columns, embedding and head rows (norms stay replicated); pp gives each stage n_layer/pp
    layers, the embedding to the first stage and the head to the last (a tied head keeps a
    copy there); ep splits MoE experts (each ep rank holds n_experts/ep of them). The ranks of
    an ep group read different data, so dense weights are replicated over dp*ep ranks (ZeRO
    shards them over dp*ep) and expert weights over dp (ZeRO shards them over dp).
    Activations follow the 1F1B schedule: stage 0 holds pp micro-batches of its n_layer/pp
    layers (Korthikanti et al.: as much as one micro-batch through all layers, / tp).
    sequence_parallel defaults to tp > 1. offload="optimizer" moves the optimizer state
    (fp32 master, m, v) to CPU memory (ZeRO-Offload), reported as "cpu_offload".
    """
    base, n_experts, _ = unpack(config)
    dp, tp, pp, ep = (positive_int(name, v) for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("ep", ep)))
    batch = positive_int("batch", batch)
    if base.n_head % tp:
        raise ValueError(f"tp={tp} must divide n_head={base.n_head}")
    if isinstance(base, LlamaLikeConfig) and base.n_kv_head % tp:
        raise ValueError(f"tp={tp} must divide n_kv_head={base.n_kv_head}")
    if ff_dim(base) % tp:
        raise ValueError(f"tp={tp} must divide d_ff={ff_dim(base)}")
    if base.n_layer % pp:
        raise ValueError(f"pp={pp} must divide n_layer={base.n_layer}")
    if ep > 1 and n_experts == 1:
        raise ValueError(f"ep={ep} needs a mixture-of-experts model (this one is dense): wrap it in MoEConfig")
    if n_experts % ep:
        raise ValueError(f"ep={ep} must divide n_experts={n_experts}")
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} must be one of {sorted(RECIPES)}")
    if offload not in ("none", "optimizer"):
        raise ValueError(f"offload={offload!r} must be 'none' or 'optimizer'")
    sp = tp > 1 if sequence_parallel is None else sequence_parallel
    p = param_breakdown(config)
    layers = base.n_layer // pp
    dense_layer = layers * (p["attention"] // tp + p["norms"] + p["router"])
    expert_layer = layers * (n_experts // ep) * (p["mlp"] // tp)
    first = cdiv(p["embedding"], tp) + p["position"]
    last = p["final_norm"] + cdiv(p["head"] or (p["embedding"] if pp > 1 else 0), tp)
    dtype = 4 if recipe == "fp32" else 2
    act = activation_bytes(config, batch, seq, dtype, recompute, attention, tp, sp)

    # 1F1B: stage 0 has pp micro-batches in flight through its n_layer/pp layers, the last stage one.
    stages = {0: (dense_layer + first + (last if pp == 1 else 0),
                  act["layers"] + act["recompute_buffer"] + pp * act["input_side"]
                  + (act["output_side"] if pp == 1 else 0))}
    if pp > 1:
        stages[pp - 1] = (dense_layer + last,
                          act["per_layer"] * layers + act["recompute_buffer"] + act["output_side"])
    best = None
    for stage, (dense, activations) in stages.items():
        state = model_state_bytes(dense, recipe, zero_stage, dp * ep)
        if expert_layer:
            expert = model_state_bytes(expert_layer, recipe, zero_stage, dp)
            state = {k: state[k] + expert[k] for k in state}
        out = {"params": state["params"], "grads": state["grads"], "optimizer": state["optimizer"],
               "activations": activations, "cpu_offload": 0}
        if offload == "optimizer":
            out["cpu_offload"], out["optimizer"] = out["optimizer"], 0
        out["total"] = out["params"] + out["grads"] + out["optimizer"] + out["activations"]
        out.update(params_on_gpu=dense + expert_layer, n_gpus=dp * ep * tp * pp, stage=stage)
        if best is None or out["total"] > best["total"]:
            best = out
    return best

