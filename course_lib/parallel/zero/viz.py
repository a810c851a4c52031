"""Notebook 08's figures: the ZeRO paper's table, memory by stage, stage 3's memory over a step,
the offload time model, and the widget (model size, dp, stage -> per-rank memory and traffic).

    paper_table(n_params, dp)                 per-GPU model state, stages 0-3, bf16 + fp32 Adam (K = 12)
    traffic_per_step(n_params, dp, stage)     bytes one rank sends on a ring per step (2-byte weights)
    plot_memory_by_stage(ax, measured, formula)      bars (measured) and ticks (formula) per part
    plot_gathered_over_time(ax, traces, persistent)  stage 3: bytes held over one step, per rank
    plot_offload_time(ax, n_params, dp, ...)  step time parts vs tokens per GPU
    zero_view(...) / zero_widget(...)         the widget (show with course_lib.widgets.show_interactive)
    plot_prefetch_gantt(ax, per_rank_events)  per-parameter stage 3: compute and all-gather lanes per rank
"""

from __future__ import annotations

from course_lib.estimate import PRESETS, model_state_bytes, param_count, per_gpu_memory
from course_lib.observe.timeline import plot_gantt
from course_lib.parallel.zero.offload import PCIE_GEN4_X16, host_step_seconds, pcie_seconds
from course_lib.units import GB, GiB

PARTS = ("params", "grads", "optimizer")
COLORS = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green"}
MODELS = {"ZeRO paper 7.5B": 7_500_000_000,  # Rajbhandari et al. 2020, Figure 1
          **{name: param_count(PRESETS[name]) for name in ("Llama-3 8B", "Llama-3 70B", "GPT-3 175B")}}
DP_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
H100_BYTES = 80 * GB  # spec sheet: 80 GB = 74.5 GiB
FIGSIZE = (9.0, 3.4)


def paper_table(n_params: int, dp: int, recipe: str = "bf16_mixed") -> dict[int, dict[str, int]]:
    """{stage: model_state_bytes(n_params, recipe, stage, dp)} for stages 0-3."""
    return {s: model_state_bytes(n_params, recipe, s, dp) for s in range(4)}


def traffic_per_step(n_params: int, dp: int, stage: int, dtype_bytes: int = 2) -> float:
    """Per rank, ring algorithms: stages 0-2 2 (N-1)/N * Psi * b (all-reduce, or reduce-scatter +
    all-gather), stage 3 3 (N-1)/N * Psi * b (two all-gathers + one reduce-scatter)."""
    if stage not in range(4):
        raise ValueError(f"stage={stage!r} must be one of 0, 1, 2, 3")
    return (3 if stage == 3 else 2) * (dp - 1) / dp * n_params * dtype_bytes


def plot_memory_by_stage(ax, measured: dict[int, dict], formula: dict[int, dict], unit: float = 2**10,
                         unit_name: str = "KiB"):
    """Stacked bars of the measured bytes per part for each stage; a black tick per part where
    the formula puts its top."""
    for stage in sorted(measured):
        bottom = bottom_f = 0.0
        for part in PARTS:
            m, f = measured[stage][part] / unit, formula[stage][part] / unit
            ax.bar(stage, m, bottom=bottom, color=COLORS[part], width=0.6, label=part if stage == 0 else None)
            ax.plot([stage - 0.35, stage + 0.35], [bottom_f + f] * 2, color="black", linewidth=1.2,
                    label="formula" if stage == 0 and part == PARTS[-1] else None)
            bottom, bottom_f = bottom + m, bottom_f + f
    ax.set_xticks(sorted(measured), [f"stage {s}" for s in sorted(measured)])
    ax.set_ylabel(f"{unit_name} per rank")
    ax.legend(fontsize=8)


def plot_gathered_over_time(ax, traces: list[list[tuple]], persistent: list[int], unit: float = 2**10,
                            unit_name: str = "KiB"):
    """One step line per rank: persistent shard bytes + gathered full buffers, over the step's time."""
    for rank, (trace, base) in enumerate(zip(traces, persistent)):
        t = [0.0] + [e[0] * 1e3 for e in trace]
        b = [base / unit] + [(base + e[2]) / unit for e in trace]
        ax.step(t, b, where="post", label=f"rank {rank}")
    for time_s, event, held in traces[0]:
        if event.startswith("gather"):
            ax.annotate(event.split()[1], (time_s * 1e3, (persistent[0] + held) / unit), fontsize=7,
                        textcoords="offset points", xytext=(2, 3))
    ax.set_xlabel("time since the step began (ms)")
    ax.set_ylabel(f"{unit_name} held (shards + gathered)")
    ax.legend(fontsize=8)


def offload_times(n_params: int, dp: int, tokens_per_gpu, peak_flops: float = 989e12, mfu: float = 0.4,
                  pcie: float = PCIE_GEN4_X16, host_bandwidth: float = 100e9) -> dict[str, list[float]]:
    """Seconds per step of GPU compute (6 Psi tokens / (peak * mfu)), the PCIe transfers of one
    bf16 gradient shard down and one bf16 parameter shard up (full duplex), and Adam on the host."""
    shard = -(-n_params // dp)
    link = pcie_seconds(2 * shard, 2 * shard, pcie)
    host = host_step_seconds(shard, host_bandwidth)
    return {"compute": [6 * n_params * t / (peak_flops * mfu) for t in tokens_per_gpu],
            "pcie": [link] * len(tokens_per_gpu), "host step": [host] * len(tokens_per_gpu)}


def plot_offload_time(ax, n_params: int, dp: int, tokens_per_gpu, **kw):
    times = offload_times(n_params, dp, tokens_per_gpu, **kw)
    for name, ys in times.items():
        ax.plot(tokens_per_gpu, ys, label=name, marker="o" if name == "compute" else None)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per GPU per step")
    ax.set_ylabel("seconds per step")
    ax.legend(fontsize=8)
    return times


# ------------------------------------------------------------------ the widget
def _draw(fig, model: str, dp: int, stage: int) -> str:
    if model not in MODELS or dp not in DP_CHOICES or stage not in range(4):
        raise ValueError(f"model={model!r}, dp={dp!r}, stage={stage!r}: pick from the controls")
    n = MODELS[model]
    table = paper_table(n, dp)
    ax = fig.add_subplot()
    for s in range(4):
        bottom = 0.0
        for part in PARTS:
            v = table[s][part] / GiB
            ax.bar(s, v, bottom=bottom, color=COLORS[part], alpha=1.0 if s == stage else 0.35,
                   edgecolor="black" if s == stage else "none", label=part if s == stage else None)
            bottom += v
        ax.text(s, bottom, f"{bottom:,.1f} GiB", ha="center", va="bottom", fontsize=8)
    ax.axhline(H100_BYTES / GiB, color="red", linestyle="--", linewidth=1, label="H100 80 GB")
    ax.set_ylim(0, max(max(t["total"] for t in table.values()), H100_BYTES) / GiB * 1.15)
    ax.set_xticks(range(4), [f"stage {s}" for s in range(4)])
    ax.set_ylabel("GiB per GPU (model state)")
    ax.set_title(f"{model}: {n / 1e9:.1f}B parameters, bf16 + fp32 AdamW, dp = {dp}", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.subplots_adjust(left=0.1, right=0.98, top=0.88, bottom=0.1)
    t = table[stage]
    traffic = traffic_per_step(n, dp, stage)
    fits = "fits" if t["total"] <= H100_BYTES else "does not fit"
    return (f"stage {stage}, dp = {dp}: {t['total'] / GiB:,.1f} GiB per GPU (params {t['params'] / GiB:,.1f}, "
            f"grads {t['grads'] / GiB:,.1f}, optimizer {t['optimizer'] / GiB:,.1f}); model state {fits} in "
            f"an 80 GB H100 before activations.\nPer step each GPU sends {traffic / GiB:,.1f} GiB on a ring "
            f"({'3' if stage == 3 else '2'}(N-1)/N x 2 bytes x parameters).")


def zero_view(model: str = "ZeRO paper 7.5B", dp: int = 64, stage: int = 3):
    from course_lib.widgets import render

    return render(_draw, FIGSIZE, model=model, dp=dp, stage=stage)


def zero_widget(model: str = "ZeRO paper 7.5B", dp: int = 64, stage: int = 3):
    """Controls: model (a dropdown), dp (powers of two), stage (0-3)."""
    import ipywidgets as W

    from course_lib.widgets import LiveFigure

    controls = {"model": W.Dropdown(options=list(MODELS), value=model, description="model"),
                "dp": W.SelectionSlider(options=list(DP_CHOICES), value=dp, description="dp ranks"),
                "stage": W.ToggleButtons(options=[0, 1, 2, 3], value=stage, description="ZeRO stage")}
    return LiveFigure(controls, _draw, FIGSIZE)


# ------------------------------------------------------------------ ZeRO against TP and PP
def layout_comparison(config, gpus: int = 8, seq: int = 4096, sequences: int = 8) -> list[dict]:
    """One step of `sequences` sequences of `seq` tokens on `gpus` GPUs, bf16 + fp32 AdamW, no
    recomputation, laid out four ways. Per GPU: bytes held (course_lib.estimate.per_gpu_memory)
    and bytes sent per step on ring collectives / point-to-point (b = 2 bytes, h = d_model):
        DDP / ZeRO-3 (dp = gpus, one sequence each)  2 (N-1)/N Psi b  /  3 (N-1)/N Psi b
        TP (tp = gpus, all sequences)   4 all-reduces of sequences*seq*h*b per layer (2 forward, 2 backward)
        PP (pp = gpus, micro-batches of 1 sequence)  one activation forward + its gradient back per micro-batch
    """
    n, h, b = param_count(config), config.d_model, 2
    ring = (gpus - 1) / gpus
    act = sequences * seq * h * b
    rows = [("DDP (ZeRO-0)", dict(dp=gpus, zero_stage=0, batch=sequences // gpus), 2 * ring * n * b),
            ("ZeRO-3 / FSDP", dict(dp=gpus, zero_stage=3, batch=sequences // gpus), 3 * ring * n * b),
            ("tensor parallel", dict(tp=gpus, batch=sequences), config.n_layer * 4 * 2 * ring * act),
            ("pipeline parallel", dict(pp=gpus, batch=1), 2 * act)]
    out = []
    for name, kw, sent in rows:
        mem = per_gpu_memory(config, seq=seq, **kw)
        out.append({"layout": name, "model_state": mem["params"] + mem["grads"] + mem["optimizer"],
                    "activations": mem["activations"], "total": mem["total"], "sent_per_step": sent})
    return out


def plot_prefetch_gantt(ax, per_rank_events, title=None):
    """Per-parameter stage 3 in time: for each rank a compute lane (train_loop's forward / backward /
    optimizer spans) and a communication lane (the units' all-gathers, issue to wait, and gradient
    reductions: category "comm"), from train_zero(..., record_timeline=True).timeline_events."""
    lanes, labels = [], []
    for r, events in enumerate(per_rank_events):
        lanes += [[e for e in events if e[3] != "comm"], [e for e in events if e[3] == "comm"]]
        labels += [f"rank {r} compute", f"rank {r} comm"]
    ax = plot_gantt(lanes, ax=ax, title=title, label_min_width=0.08)
    ax.set_yticks(range(len(lanes)), labels)
    return ax
