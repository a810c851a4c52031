"""Per-GPU memory and time-to-train calculator (notebook 01), interactive and static.

    Settings(...)                 one point of the design space: model preset and shape, micro-batch,
                                  precision recipe, recomputation, ZeRO stage, dp/tp/pp/ep, offload
    evaluate(settings)            -> memory per GPU (estimate.per_gpu_memory), FLOPs, GPUs, time
    plot_scenarios([(label, s)])  stacked per-GPU bars (params/grads/optimizer/activations) vs 80 GB
    MemoryCalculator()            the same with ipywidgets controls (needs a live kernel)

Public calculators usually stop at data and tensor parallelism; this one also covers pipeline
parallelism (1F1B activations on the first stage, embedding and head on the end stages),
expert parallelism and optimizer offload. Expert parallelism needs experts: set n_experts > 1
and the model becomes an `estimate.MoEConfig` (each MLP becomes n_experts expert MLPs, top_k
per token), and ep divides the experts. Memory is in GB = 1e9 bytes; "80 GB" is the budget line.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, replace

from course_lib import estimate as E


@dataclass(frozen=True)
class GPU:
    name: str
    peak_bf16: float  # dense FLOP/s, tensor cores
    peak_tf32: float  # what an fp32 recipe gets (TF32 tensor cores)
    memory: float  # bytes


GPUS = {
    "A100 80GB": GPU("A100 80GB", 312e12, 156e12, 80e9),
    "H100 SXM 80GB": GPU("H100 SXM 80GB", 989e12, 495e12, 80e9),
}
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
    recompute: str = "none"
    attention: str = "fused"
    zero_stage: int = 0
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    offload: bool = False
    gpu: str = "A100 80GB"
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
    memory = E.per_gpu_memory(config, s.batch, seq, s.recipe, s.zero_stage, s.dp, s.tp, s.pp, s.ep,
                              s.recompute, "optimizer" if s.offload else "none", s.attention)
    gpu = GPUS[s.gpu]
    tokens = PRESET_TOKENS[s.preset] if s.tokens is None else s.tokens
    flops = E.flops_per_token(config, seq) * tokens
    # Recomputation re-runs forward work: full adds one forward (+1/3), selective only attention scores.
    if s.recompute == "full":
        flops *= 4 / 3
    peak = gpu.peak_tf32 if s.recipe == "fp32" else gpu.peak_bf16
    seconds = E.training_time(flops, memory["n_gpus"], peak, s.mfu)
    return {"settings": s, "config": config, "memory": memory, "gpu": gpu, "seq": seq, "tokens": tokens,
            "n_params": E.param_count(config), "active_params": E.param_count(config, active=True),
            "flops": flops, "seconds": seconds, "fits": memory["total"] <= gpu.memory}


def summary_text(r: dict) -> str:
    """A few plain lines describing an `evaluate` result (deterministic: no timing)."""
    s, m = r["settings"], r["memory"]
    params = f"{_count(r['n_params'])} parameters"
    if r["active_params"] != r["n_params"]:
        params += f" ({_count(r['active_params'])} active per token)"
    parts = ", ".join(f"{k} {E.fmt_bytes(m[k])}" for k in ("params", "grads", "optimizer", "activations"))
    verdict = "fits" if r["fits"] else "does NOT fit"
    lines = [
        f"{s.preset}: {params}; micro-batch {s.batch} x {r['seq']} tokens",
        f"per GPU (stage {m['stage']}): {parts} = {E.fmt_bytes(m['total'])} -> {verdict} in {E.fmt_bytes(r['gpu'].memory)}",
        f"mesh dp={s.dp} x ep={s.ep} x tp={s.tp} x pp={s.pp} = {_gpus(m['n_gpus'])}; "
        f"{s.recipe}, ZeRO-{s.zero_stage}, recompute={s.recompute}, attention={s.attention}"
        + (f"; optimizer offloaded to CPU: {E.fmt_bytes(m['cpu_offload'])}" if s.offload else ""),
        f"training: {r['flops']:.3g} FLOPs over {r['tokens']:.3g} tokens -> {E.fmt_duration(r['seconds'])} "
        f"on {_gpus(m['n_gpus'])} ({r['gpu'].name}) at MFU {s.mfu:.0%}",
    ]
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}e9" if n >= 1e9 else f"{n:,}"


def _gpus(n: int) -> str:
    return "1 GPU" if n == 1 else f"{n} GPUs"


COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52"}


def plot_scenarios(scenarios, fig=None):
    """Stacked per-GPU memory bars, one per (label, Settings), against the GPU's memory line.

    When some bar is far above the line the y axis is broken in two: the lower panel shows the
    range around the GPU's memory, the upper one the terabytes, so every bar keeps its layers."""
    import matplotlib.pyplot as plt

    results = [(label, evaluate(s)) for label, s in scenarios]
    limit = results[0][1]["gpu"].memory / 1e9
    tallest = max(r["memory"]["total"] for _, r in results) / 1e9
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
            h = r["memory"][part] / 1e9
            for a in axes:
                a.bar(i, h, bottom=bottom, color=color, width=0.6, label=part if i == 0 and a is axes[0] else None)
            bottom += h
        text_ax = axes[0] if broken and bottom > 1.5 * limit else ax
        text_ax.annotate(E.fmt_bytes(r["memory"]["total"]), (i, bottom), xytext=(0, 2),
                         textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.5 * limit)
    ax.axhline(limit, color="black", linestyle="--", linewidth=1)
    ax.text(len(results) - 0.5, limit, f"{limit:.0f} GB GPU", ha="right", va="bottom", fontsize=8)
    if broken:
        top_ax.set_ylim(1.5 * limit, tallest * 1.15)
        top_ax.spines["bottom"].set_visible(False)
        ax.spines["top"].set_visible(False)
        top_ax.tick_params(bottom=False)
        top_ax.set_title("(y axis broken at %.0f GB)" % (1.5 * limit), fontsize=8, loc="left")
    ax.set_xlim(-0.6, len(results) - 0.4)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels([f"{label}\n{_gpus(r['memory']['n_gpus'])}\n{E.fmt_duration(r['seconds'])}"
                        for label, r in results], fontsize=8)
    fig.supylabel("memory per GPU (GB)", fontsize=10)
    axes[0].legend(loc="upper right", fontsize=8)
    return fig


def gpt3_ladder() -> list[tuple[str, Settings]]:
    """GPT-3 175B from one GPU to a 3D-parallel cluster, one memory-saving step per bar."""
    s = Settings(preset="GPT-3 175B", recipe="fp32", attention="naive")
    steps = [("1 GPU, fp32", s)]
    steps.append(("bf16 mixed,\nflash attention", s := replace(s, recipe="bf16_mixed", attention="fused")))
    steps.append(("+ full\nrecompute", s := replace(s, recompute="full")))
    steps.append(("+ ZeRO-3\ndp=64", replace(s, zero_stage=3, dp=64)))
    steps.append(("tp=8 pp=8 dp=16\nZeRO-1, selective", s := replace(s, tp=8, pp=8, dp=16, zero_stage=1,
                                                                     recompute="selective")))
    steps.append(("same\n+ optimizer offload", replace(s, offload=True)))
    return steps


try:  # the widget needs ipywidgets (a course dependency); the functions above do not
    import ipywidgets as widgets
except ImportError:  # pragma: no cover
    widgets = None

_POW2 = [2**i for i in range(13)]


class MemoryCalculator(widgets.VBox if widgets else object):
    """Controls on the left, the stacked bar of the current settings and a summary on the right.
    Invalid combinations (e.g. tp=3 with 96 heads) show the ValueError's message in red."""

    def __init__(self, settings: Settings = Settings(preset="GPT-3 175B", recompute="selective", zero_stage=1,
                                                     dp=16, tp=8, pp=8)):
        if widgets is None:
            raise ImportError("MemoryCalculator needs ipywidgets; use plot_scenarios for a static figure")
        W, style = widgets, {"description_width": "110px"}
        self._busy = False
        c = self.controls = {
            "preset": W.Dropdown(options=list(E.PRESETS), description="preset"),
            "batch": W.IntSlider(min=1, max=64, description="micro-batch"),
            "seq": W.SelectionSlider(options=[2**i for i in range(4, 18)], description="sequence"),
            "d_model": W.IntSlider(min=64, max=32768, step=64, description="hidden d"),
            "n_layer": W.IntSlider(min=1, max=200, description="layers"),
            "n_head": W.IntSlider(min=1, max=256, description="heads"),
            "vocab_size": W.BoundedIntText(min=1, max=10**6, description="vocab"),
            "n_experts": W.IntSlider(min=1, max=64, description="experts (MoE)"),
            "top_k": W.IntSlider(min=1, max=8, description="top-k"),
            "recipe": W.Dropdown(options=list(E.RECIPES), description="precision"),
            "recompute": W.ToggleButtons(options=list(E.RECOMPUTE), description="recompute"),
            "attention": W.ToggleButtons(options=list(E.ATTENTION), description="attention"),
            "zero_stage": W.ToggleButtons(options=list(E.ZERO_STAGES), description="ZeRO stage"),
            "dp": W.SelectionSlider(options=_POW2, description="dp"),
            "tp": W.SelectionSlider(options=_POW2[:8], description="tp"),
            "pp": W.IntSlider(min=1, max=128, description="pp"),
            "ep": W.SelectionSlider(options=_POW2[:7], description="ep"),
            "offload": W.Checkbox(description="offload optimizer to CPU"),
            "gpu": W.Dropdown(options=list(GPUS), description="GPU"),
            "mfu": W.FloatSlider(min=0.05, max=0.8, step=0.05, description="MFU"),
            "tokens": W.FloatLogSlider(min=5, max=14, description="tokens"),
        }
        for w in c.values():
            w.style = style
        self.image = W.Image(format="png")
        self.summary = W.HTML()
        self._set(settings)
        for name, w in c.items():
            w.observe(self._on_preset if name == "preset" else self._on_change, names="value")
        left = W.VBox(list(c.values()), layout=W.Layout(width="420px"))
        super().__init__([W.HBox([left, W.VBox([self.image, self.summary])])])
        self._on_change()

    def __repr__(self):  # the notebook's text/plain output: stable, unlike the widget's model id
        return f"MemoryCalculator(preset={self.controls['preset'].value!r})"

    def _set(self, s: Settings) -> None:
        """Write settings into the controls, filling None with the preset's own values."""
        cfg = E.PRESETS[s.preset]
        filled = {**asdict(s), "seq": s.seq or cfg.block_size, "tokens": s.tokens or PRESET_TOKENS[s.preset]}
        for k in ("d_model", "n_layer", "n_head", "vocab_size"):
            filled[k] = filled[k] or getattr(cfg, k)
        self._busy = True
        try:
            for name, w in self.controls.items():
                w.value = filled[name]
        finally:
            self._busy = False

    @property
    def settings(self) -> Settings:
        values = {name: w.value for name, w in self.controls.items()}
        cfg = E.PRESETS[values["preset"]]
        for k in ("d_model", "n_layer", "n_head", "vocab_size"):  # unchanged shape: use the preset as is
            if values[k] == getattr(cfg, k):
                values[k] = None
        return Settings(**values)

    def _on_preset(self, change) -> None:
        if not self._busy:
            self._set(replace(self.settings, preset=change["new"], seq=None, tokens=None, d_model=None,
                              n_layer=None, n_head=None, vocab_size=None))
            self._on_change()

    def _on_change(self, change=None) -> None:
        if self._busy:
            return
        try:
            r = evaluate(self.settings)
        except ValueError as err:
            self.summary.value = f"<pre style='color:#b00'>invalid settings: {err}</pre>"
            return
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(3.6, 4.4))
        FigureCanvasAgg(fig)
        plot_scenarios([("current settings", r["settings"])], fig=fig)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
        self.image.value = buf.getvalue()
        self.summary.value = f"<pre>{summary_text(r)}</pre>"
