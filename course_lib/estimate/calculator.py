"""Per-GPU memory and time-to-train calculator (notebook 01), interactive and static.

    Settings(...)                 one point of the design space: model preset and shape, micro-batch,
                                  precision recipe, attention, the layout (a course_lib.dims.ParallelDims:
                                  dp/tp/pp/ep, ZeRO stage, recomputation), offload, GPU
    evaluate(settings)            -> memory per GPU (estimate.per_gpu_memory), FLOPs, GPUs, time
    plot_scenarios([(label, s)])  stacked per-GPU bars (params/grads/optimizer/activations) vs the GPU
    calculator_widget.py          calculator_view(settings), the figure and summary as a static
                                  widgets.View, and MemoryCalculator(settings), the same with
                                  ipywidgets controls (that module needs ipywidgets; this one does not)
    parse_tokens("300B")          token counts as people type them (K/M/B/T), exactly; fmt_tokens back

Public calculators usually stop at data and tensor parallelism; this one also covers pipeline
parallelism (1F1B activations on the first stage, embedding and head on the end stages),
expert parallelism and optimizer offload. Expert parallelism needs experts: set n_experts > 1
and the model becomes an `estimate.MoEConfig` (each MLP becomes n_experts expert MLPs, top_k
per token), and ep divides the experts.

Units: memory is computed in bytes and printed in IEC units (GiB = 2**30 bytes). A GPU's
memory is quoted from its spec sheet in decimal GB (10**9 bytes) and converted explicitly:
an "80 GB" H100 holds 80e9 bytes = 74.5 GiB, which is the line the bars are held against.
The widget offers only valid layouts: heads that divide the hidden size, tp degrees that divide
the heads, KV heads and MLP width, pp degrees that divide the layers, ep degrees that divide
the experts; anything else that is invalid (a mistyped token count) greys the chart out.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace

from course_lib import estimate as E
from course_lib.dims import ParallelDims
from course_lib.estimate.params import model_shape
from course_lib.estimate.per_gpu import check_degrees, gpu_memory
from course_lib.estimate.step_time import fp8_flops_per_token
from course_lib.units import GB, GiB

@dataclass(frozen=True)
class GPU:
    name: str
    peak_bf16: float  # dense FLOP/s, tensor cores
    peak_tf32: float  # what an fp32 recipe gets (TF32 tensor cores)
    memory: float  # bytes
    peak_fp8: float = 0.0  # dense FP8 tensor-core FLOP/s; 0: none entered (A100 has no FP8 units)


def _gpu(name, spec_gb, peak_bf16, peak_fp32, peak_fp8=0.0):
    return GPU(f"{name} {spec_gb:g} GB", peak_bf16, peak_fp32, spec_gb * GB, peak_fp8)


# Spec-sheet figures: memory in the vendor's decimal GB; dense (no sparsity) tensor-core peaks
# in FLOP/s, bf16 and the rate an fp32 recipe gets (TF32 on NVIDIA, FP32 matrix on AMD), and
# FP8 where entered (the "fp8" recipe's linears): NVIDIA's sheets quote FP8 with sparsity, half
# of it dense: H100/H200 SXM 3,958 -> 1,979 TFLOP/s; HGX B200 9 -> 4.5 PFLOP/s; GB200 NVL72 720
# PFLOP/s per 72 GPUs -> 5 dense. Not entered (0): A100 (no FP8 units), and parts whose dense
# FP8 figure we did not check against a vendor sheet.
GPUS = {g.name: g for g in (
    _gpu("A100 SXM", 80, 312e12, 156e12),
    _gpu("H100 SXM", 80, 989e12, 495e12, 1979e12),
    _gpu("H200 SXM", 141, 989e12, 495e12, 1979e12),
    _gpu("B200", 180, 2.25e15, 1.1e15, 4.5e15),  # HGX B200: 180 GB usable of 192 GB of HBM3e
    # GB200 NVL72, per GPU (the rack's spec / 72): 13.4 TB of HBM3e, 360 PFLOP/s bf16 and 180
    # TF32 with sparsity, so 2.5 PFLOP/s and 1.25 dense
    _gpu("GB200", 186, 2.5e15, 1.25e15, 5e15),
    _gpu("MI300X", 192, 1307e12, 163e12),
    _gpu("B300", 288, 2.25e15, 1.1e15),
    _gpu("MI355X", 288, 2.5e15, 157e12),
)}


def gpu_label(gpu: GPU) -> str:
    """'H100 SXM: 80 GB = 74.5 GiB' (spec-sheet GB, and what the course's GiB make of it)."""
    name, spec = gpu.name.rsplit(" ", 2)[0], gpu.memory / GB
    return f"{name}: {spec:g} GB = {gpu.memory / GiB:.1f} GiB"


# Tokens each preset was (or, for the course GPT, is in this course) trained on.
PRESET_TOKENS = {"course GPT": 200 * 32 * 64, "GPT-3 175B": 300e9, "Llama-3 8B": 15e12,
                 "Llama-3 70B": 15e12, "Llama-3 405B": 15e12}


@dataclass(frozen=True)
class Settings:
    preset: str = "GPT-3 175B"
    batch: int = 1  # micro-batch per GPU
    seq: int | None = None  # None: the preset's context length
    d_model: int | None = None  # None: keep the preset's shape
    n_layer: int | None = None
    n_head: int | None = None
    vocab_size: int | None = None
    n_experts: int = 1
    top_k: int = 1
    recipe: str = "bf16_mixed"
    attention: str = "fused"
    # the runtime's layout object; the calculator reads dp, tp, pp, ep, zero, recompute and
    # sequence_parallel (the widget sets it whenever tp > 1, as Megatron does), at the steady
    # state of 1F1B (pp micro-batches in flight on stage 0)
    layout: ParallelDims = ParallelDims()
    offload: bool = False
    gpu: str = "A100 SXM 80 GB"
    mfu: float = 0.4
    tokens: float | None = None  # None: PRESET_TOKENS[preset]


def build_config(s: Settings):
    """The model config the settings describe (a preset with shape overrides, maybe MoE)."""
    if s.preset not in E.PRESETS:
        raise ValueError(f"preset={s.preset!r} must be one of {list(E.PRESETS)}")
    base = E.PRESETS[s.preset]
    shape = {k: getattr(s, k) for k in ("d_model", "n_layer", "n_head", "vocab_size") if getattr(s, k) is not None}
    if shape:
        if isinstance(base, E.LlamaLikeConfig) and "n_head" in shape and shape["n_head"] % base.n_kv_head:
            shape["n_kv_head"] = shape["n_head"]  # keep GQA valid: fall back to one KV head per head
        if isinstance(base, E.LlamaLikeConfig) and "d_model" in shape:  # keep the preset's d_ff / d_model ratio
            shape["d_ff"] = max(1, round(base.d_ff * shape["d_model"] / base.d_model))
        base = replace(base, **shape)
    return E.MoEConfig(base, s.n_experts, s.top_k) if s.n_experts > 1 else base


def evaluate(s: Settings) -> dict:
    """Memory on the busiest GPU plus the compute budget. Raises ValueError on invalid settings."""
    if s.gpu not in GPUS:
        raise ValueError(f"gpu={s.gpu!r} must be one of {list(GPUS)}")
    config = build_config(s)
    base = config.base if isinstance(config, E.MoEConfig) else config
    seq = base.block_size if s.seq is None else s.seq
    L = s.layout
    shape = model_shape(config)
    check_degrees(L, shape)
    memory = gpu_memory(L, shape, s.batch, seq, s.recipe, "optimizer" if s.offload else "none", s.attention)
    gpu = GPUS[s.gpu]
    tokens = PRESET_TOKENS[s.preset] if s.tokens is None else s.tokens
    flops = E.flops_per_token(config, seq) * tokens
    # Recomputation re-runs forward work: full adds one forward (+1/3), selective only attention scores.
    if s.layout.recompute == "full":
        flops *= 4 / 3
    peak = gpu.peak_tf32 if s.recipe == "fp32" else gpu.peak_bf16
    seconds = E.training_time(flops, memory["n_gpus"], peak, s.mfu)
    if s.recipe == "fp8":  # the blocks' linears at the FP8 peak, the rest at bf16's, the same MFU
        if not gpu.peak_fp8 > 0:
            raise ValueError(f"recipe='fp8' needs a GPU with an FP8 peak; {gpu.name} has none entered")
        f8 = fp8_flops_per_token(config) * tokens * (4 / 3 if s.layout.recompute == "full" else 1)
        seconds = (E.training_time(flops - f8, memory["n_gpus"], peak, s.mfu)
                   + E.training_time(f8, memory["n_gpus"], gpu.peak_fp8, s.mfu))
    return {"settings": s, "config": config, "memory": memory, "gpu": gpu, "seq": seq, "tokens": tokens,
            "n_params": E.param_count(config), "active_params": E.param_count(config, active=True),
            "flops": flops, "seconds": seconds, "fits": memory["total"] <= gpu.memory}


def summary_text(r: dict) -> str:
    """A few plain lines describing an `evaluate` result (deterministic: no timing)."""
    s, m, L = r["settings"], r["memory"], r["settings"].layout
    params = f"{_count(r['n_params'])} parameters"
    if r["active_params"] != r["n_params"]:
        params += f" ({_count(r['active_params'])} active per token)"
    parts = ", ".join(f"{k} {E.fmt_bytes(m[k])}" for k in ("params", "grads", "optimizer", "activations"))
    verdict = "fits" if r["fits"] else "does NOT fit"
    lines = [
        f"{s.preset}: {params}; micro-batch {s.batch} x {r['seq']} tokens",
        f"per GPU (stage {m['stage']}): {parts} = {E.fmt_bytes(m['total'])} -> {verdict} in {gpu_label(r['gpu'])}",
        f"mesh dp={L.dp} x ep={L.ep} x tp={L.tp} x pp={L.pp} = {_gpus(m['n_gpus'])}; "
        f"{s.recipe}, ZeRO-{L.zero}, recompute={L.recompute}, attention={s.attention}"
        + (f"; optimizer offloaded to CPU: {E.fmt_bytes(m['cpu_offload'])}" if s.offload else ""),
        f"training: {_sci(r['flops'])} FLOPs over {fmt_tokens(r['tokens'])} tokens -> {E.fmt_duration(r['seconds'])} "
        f"on {_gpus(m['n_gpus'])} at MFU {s.mfu:.0%}",
    ]
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _sci(x: float) -> str:
    """3.15e23 style (no '+' and no leading zero in the exponent)."""
    mantissa, exponent = f"{x:.3g}".split("e") if "e" in f"{x:.3g}" else (f"{x:.3g}", "0")
    return mantissa if exponent == "0" else f"{mantissa}e{int(exponent)}"


_SUFFIX = {"K": 3, "M": 6, "B": 9, "T": 12}
_TOKENS = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([KMBT]?)\s*$", re.IGNORECASE)


def parse_tokens(text: str) -> float:
    """'300B' -> 3e11, '15T' -> 1.5e13, '409.6K', '2e9': exactly the number typed (the decimal
    string is converted once, so 300B is 300e9, never a nearby slider stop)."""
    match = _TOKENS.match(str(text))
    if not match:
        raise ValueError(f"tokens={text!r} must be a number with an optional K, M, B or T suffix (e.g. 300B, 15T)")
    digits, exp, suffix = match.groups()
    value = float(f"{digits}e{int(exp or 0) + _SUFFIX.get(suffix.upper(), 0)}")
    if not value > 0:
        raise ValueError(f"tokens={text!r} must be more than zero")
    return value


def fmt_tokens(n: float) -> str:
    """The inverse of parse_tokens for display: 3e11 -> '300B', 409600 -> '409.6K'."""
    for suffix, exp in sorted(_SUFFIX.items(), key=lambda kv: -kv[1]):
        if n >= 10**exp:
            return f"{n / 10**exp:.12g}{suffix}"
    return f"{n:.12g}"


def _gpus(n: int) -> str:
    return "1 GPU" if n == 1 else f"{n} GPUs"


COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52"}


def plot_scenarios(scenarios, fig=None):
    """Stacked per-GPU memory bars, one per (label, Settings), against the GPU's memory line.

    When some bar is far above the line the y axis is broken in two: the lower panel shows the
    range around the GPU's memory, the upper one the terabytes, so every bar keeps its layers."""
    import matplotlib.pyplot as plt

    results = [(label, evaluate(s)) for label, s in scenarios]
    gpu = results[0][1]["gpu"]
    limit = gpu.memory / GiB
    tallest = max(r["memory"]["total"] for _, r in results) / GiB
    broken = tallest > 2 * limit
    if fig is None:
        fig = plt.figure(figsize=(max(4.5, 1.7 * len(results) + 1), 5))
    if broken:
        top_ax, ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 1.4], "hspace": 0.08})
        axes = (top_ax, ax)
    else:
        ax = fig.add_subplot()
        axes = (ax,)
    for i, (label, r) in enumerate(results):
        bottom = 0.0
        for part, color in COLORS.items():
            h = r["memory"][part] / GiB
            for a in axes:
                a.bar(i, h, bottom=bottom, color=color, width=0.6, label=part if i == 0 and a is axes[0] else None)
            bottom += h
        text_ax = axes[0] if broken and bottom > 1.5 * limit else ax
        text_ax.annotate(E.fmt_bytes(r["memory"]["total"]), (i, bottom), xytext=(0, 2),
                         textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.5 * limit)
    ax.axhline(limit, color="black", linestyle="--", linewidth=1)
    ax.text(len(results) - 0.5, limit, gpu_label(gpu), ha="right", va="bottom", fontsize=8)
    if broken:
        top_ax.set_ylim(1.5 * limit, tallest * 1.15)
        top_ax.spines["bottom"].set_visible(False)
        ax.spines["top"].set_visible(False)
        top_ax.tick_params(bottom=False)
        top_ax.set_title(f"(y axis broken at {1.5 * limit:.0f} GiB)", fontsize=8, loc="left")
    ax.set_xlim(-0.6, len(results) - 0.4)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels([f"{label}\n{_gpus(r['memory']['n_gpus'])}\n{E.fmt_duration(r['seconds'])}"
                        for label, r in results], fontsize=8)
    fig.supylabel("memory per GPU (GiB)", fontsize=10)
    axes[0].legend(loc="upper right", fontsize=8)
    return fig


def gpt3_ladder() -> list[tuple[str, Settings]]:
    """GPT-3 175B from one GPU to a 3D-parallel cluster, one memory-saving step per bar."""
    s = Settings(preset="GPT-3 175B", recipe="fp32", attention="naive")
    steps = [("1 GPU, fp32", s)]
    steps.append(("bf16 mixed,\nflash attention", s := replace(s, recipe="bf16_mixed", attention="fused")))
    steps.append(("+ full\nrecompute", s := replace(s, layout=ParallelDims(recompute="full"))))
    steps.append(("+ ZeRO-3\ndp=64", replace(s, layout=replace(s.layout, zero=3, dp=64))))
    steps.append(("tp=8 pp=8 dp=16\nZeRO-1, selective",
                  s := replace(s, layout=ParallelDims(tp=8, pp=8, dp=16, zero=1, recompute="selective",
                                                          sequence_parallel=True))))
    steps.append(("same\n+ optimizer offload", replace(s, offload=True)))
    return steps
