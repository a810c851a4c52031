"""The calculator's widget (notebook 01): controls beside the per-GPU bar and its summary.

    calculator_view(settings)     the static figure + summary (a widgets.View) of `settings`
    MemoryCalculator(settings)    the live version; its first state is calculator_view(settings)

Shown with `widgets.show_interactive(lambda: calculator_view(s), lambda: MemoryCalculator(s))`.
Only valid values are offered: the heads divide the hidden size; tp divides the heads, the KV
heads and the MLP width; pp divides the layers; ep divides the experts; top-k is at most the
experts. When one control narrows another's choices the other keeps its value if still valid,
else takes the nearest valid one. Token counts are typed (300B, 15T) and used exactly; a
mistyped one greys the chart out and says why.
"""

from __future__ import annotations

from dataclasses import asdict, replace

from course_lib import estimate as E
from course_lib.dims import ParallelDims, check_tp, copies_kv
from course_lib.estimate.params import model_shape
from course_lib.estimate.calculator import (GPUS, PRESET_TOKENS, Settings, build_config, evaluate, fmt_tokens,
                                            gpu_label, parse_tokens, plot_scenarios, summary_text)
from course_lib.widgets import LiveFigure, render

FIGSIZE = (4.2, 4.6)  # inches at widgets.DPI: the chart never changes size
START = Settings(preset="GPT-3 175B", layout=ParallelDims(dp=16, tp=8, pp=8, zero=1, recompute="selective",
                                                           sequence_parallel=True))
LAYOUT = ("dp", "tp", "pp", "ep", "zero", "recompute")  # the controls that set Settings.layout
SHAPE = ("d_model", "n_layer", "n_head", "vocab_size")
MFU = [p / 100 for p in range(5, 85, 5)]


def _divisors(n: int, at_most: int) -> list[int]:
    return [d for d in range(1, min(n, at_most) + 1) if n % d == 0]


def control_values(s: Settings) -> dict:
    """The controls' values for `s`: None fields filled from the preset, tokens as typed text."""
    cfg = E.PRESETS[s.preset]
    values = {k: v for k, v in asdict(s).items() if k != "layout"}
    values.update({k: getattr(s.layout, k) for k in LAYOUT})
    values["seq"] = s.seq or cfg.block_size
    values["tokens"] = fmt_tokens(PRESET_TOKENS[s.preset] if s.tokens is None else s.tokens)
    for k in SHAPE:
        values[k] = values[k] or getattr(cfg, k)
    return values


def settings_from_values(values: dict) -> Settings:
    """The inverse of control_values: shape fields equal to the preset's become None."""
    values = dict(values)
    cfg = E.PRESETS[values["preset"]]
    for k in SHAPE:
        if values[k] == getattr(cfg, k):
            values[k] = None
    values["tokens"] = parse_tokens(values["tokens"])
    degrees = {k: values.pop(k) for k in LAYOUT}
    layout = ParallelDims(**degrees, sequence_parallel=degrees["tp"] > 1)
    return Settings(**values, layout=layout)


def valid_options(values: dict) -> dict[str, list]:
    """The values each dependent control may take, given the others (see module docstring)."""
    s = settings_from_values({**values, "tokens": "1", "tp": 1, "pp": 1, "ep": 1, "n_head": None})
    base = E.PRESETS[s.preset]
    # any divisor of d_model: build_config gives a Llama model one KV head per head if GQA no longer fits
    options = {"n_head": _divisors(values["d_model"], 256), "top_k": list(range(1, min(8, values["n_experts"]) + 1)),
               "pp": _divisors(values["n_layer"], 128), "ep": _divisors(values["n_experts"], 64)}
    head = values["n_head"] if values["n_head"] in options["n_head"] else _nearest(options["n_head"], values["n_head"])
    config = build_config(replace(s, n_head=None if head == getattr(base, "n_head") else head))
    shape, tps = model_shape(config), []
    for tp in _divisors(head, 128):
        try:
            check_tp(tp, shape.n_head, shape.ff_dim, shape.n_kv_head, copies_kv(shape))
            tps.append(tp)
        except ValueError:
            pass
    options["tp"] = tps or [1]
    return options


def _nearest(options: list, value):
    return min(options, key=lambda o: (abs(o - value), o))


def _draw(fig, **values) -> str:
    """widgets.render's draw function: the current settings' bar; the summary is the caption."""
    s = settings_from_values(values)
    r = evaluate(s)
    plot_scenarios([("current settings", s)], fig=fig)
    fig.subplots_adjust(left=0.2, right=0.97, top=0.95, bottom=0.17)
    return summary_text(r)


def calculator_view(settings: Settings = START):
    """What the calculator shows for `settings`, as a static widgets.View."""
    values = control_values(settings)
    values.update(_fit_to_options(values))
    return render(_draw, FIGSIZE, **values)


def _fit_to_options(values: dict) -> dict:
    """Dependent values moved to the nearest valid option (unchanged when already valid)."""
    out = dict(values)
    for name, options in valid_options(out).items():  # n_head first: tp's options depend on it
        if out[name] not in options:
            out[name] = _nearest(options, out[name])
    return out


class MemoryCalculator(LiveFigure):
    """Controls on the left, the stacked bar of the current settings and a summary on the right."""

    def __init__(self, settings: Settings = START):
        import ipywidgets as W

        values = _fit_to_options(control_values(settings))
        options = valid_options(values)

        def slider(name, opts, description):
            return W.SelectionSlider(options=opts, value=values[name], description=description)

        controls = {
            "preset": W.Dropdown(options=list(E.PRESETS), value=values["preset"], description="preset"),
            "gpu": W.Dropdown(options=[(gpu_label(g), name) for name, g in GPUS.items()], value=values["gpu"],
                              description="GPU"),
            "tokens": W.Text(value=values["tokens"], continuous_update=False, description="tokens",
                             placeholder="e.g. 300B or 15T"),
            "mfu": W.SelectionSlider(options=[(f"{m:.0%}", m) for m in MFU], value=values["mfu"], description="MFU"),
            "batch": W.IntSlider(min=1, max=64, value=values["batch"], description="micro-batch"),
            "seq": slider("seq", [2**i for i in range(4, 18)], "sequence"),
            "d_model": W.IntSlider(min=64, max=32768, step=64, value=values["d_model"], description="hidden d"),
            "n_layer": W.IntSlider(min=1, max=200, value=values["n_layer"], description="layers"),
            "n_head": slider("n_head", options["n_head"], "heads"),
            "vocab_size": W.BoundedIntText(min=1, max=10**6, value=values["vocab_size"], description="vocab"),
            "n_experts": W.IntSlider(min=1, max=64, value=values["n_experts"], description="experts (MoE)"),
            "top_k": slider("top_k", options["top_k"], "top-k"),
            "recipe": W.Dropdown(options=list(E.RECIPES), value=values["recipe"], description="precision"),
            "recompute": W.ToggleButtons(options=list(E.RECOMPUTE), value=values["recompute"], description="recompute"),
            "attention": W.ToggleButtons(options=list(E.ATTENTION), value=values["attention"], description="attention"),
            "zero": W.ToggleButtons(options=list(E.ZERO_STAGES), value=values["zero"],
                                          description="ZeRO stage"),
            "dp": slider("dp", [2**i for i in range(13)], "dp"),
            "tp": slider("tp", options["tp"], "tp"),
            "pp": slider("pp", options["pp"], "pp"),
            "ep": slider("ep", options["ep"], "ep"),
            "offload": W.Checkbox(value=values["offload"], description="offload optimizer to CPU"),
        }
        for c in controls.values():
            c.layout.width = "430px"
            if isinstance(c, W.ToggleButtons):
                c.style.button_width = "74px"
        super().__init__(controls, _draw, FIGSIZE, beside=True, controls_width="440px")
        self.summary = self.caption  # the summary lines under the chart

    def __repr__(self):  # the notebook's text/plain output: stable, unlike the widget's model id
        return f"MemoryCalculator(preset={self.controls['preset'].value!r})"

    @property
    def settings(self) -> Settings:
        return settings_from_values(self.values())

    def on_change(self, name: str) -> None:
        values = self.values()
        if name == "preset":  # a new preset brings its own shape, context length and token count
            cfg = E.PRESETS[values["preset"]]
            fresh = {"seq": cfg.block_size, "tokens": fmt_tokens(PRESET_TOKENS[values["preset"]]),
                     **{k: getattr(cfg, k) for k in SHAPE}}
            for k, v in fresh.items():
                if k != "n_head":  # its options change first (below)
                    self.controls[k].value = v
            values.update(fresh)
        for dep, options in valid_options(values).items():  # n_head before tp, whose options depend on it
            keep = values[dep] if values[dep] in options else _nearest(options, values[dep])
            self.set_options(self.controls[dep], options, keep)  # one message: no stale index echoes back
            values[dep] = keep
