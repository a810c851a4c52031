"""What the capstone reports: predicted against measured, the live loss plot, and the text the
trained model writes.

    estimate_inputs(config)        -> (estimator model config, recipe) for course_lib.estimate
    compare(run, cluster)          -> predicted / measured step time, tokens/s, memory per rank
    outside_calibration(dims, cluster) -> where a layout leaves what the calibration measured
    traffic_formula(config, dims)  -> bytes per step of each mesh dimension, by formula
    report_text(run, cluster)      -> the report cell's lines
    LiveLossPlot(config)           -> run_capstone(..., on_loss=plot.update): the curve while it trains
    generate_text(config, params, prompt, n)

MFU = model FLOPs per second / (ranks * peak FLOP/s of one device), against the hardware the
ranks ran on, not the machine the notebook runs on. A peak is a GPU's spec sheet figure, quoted
only for ranks that computed on that GPU; a CPU core has no comparable one, so on CPU ranks
(run_capstone's: run_on_ranks' default gloo ranks, even on a machine with a GPU) the report
gives the same ratio against the calibrated rate of the stored 8-rank cluster (what these ranks
reached on large matmuls) and says so.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import replace

from course_lib.capstone.run import CHECKED_COLLECTIVES
from course_lib.comm.measured import CollectiveTable
from course_lib.data import CharDataset
from course_lib.estimate.calculator import GPUS
from course_lib.estimate.params import MoEConfig
from course_lib.estimate.step_time import memory_per_rank, step_time
from course_lib.measure.memory import estimated_per_rank
from course_lib.model import GPT
from course_lib.parallel import topology
from course_lib.units import fmt_bytes

RECIPE = {"fp32": "fp32", "bf16": "bf16_autocast"}  # precision -> course_lib.estimate recipe


def estimate_inputs(config):
    """(model config for course_lib.estimate, recipe) of the capstone's model and precision; the
    layouts themselves (config.layout, config.resume) are costed as they are: ParallelDims."""
    model = config.model
    if model.n_experts:
        model = MoEConfig(replace(model, n_experts=0), n_experts=model.n_experts, top_k=model.top_k)
    return model, RECIPE[config.precision]


# where run_capstone's ranks compute: run_on_ranks' default backend is gloo, whose ranks use the CPU
RANKS_DEVICE = "cpu"


def gpu_peak_flops(precision: str, device="cuda") -> float | None:
    """The spec-sheet peak (bf16, or the fp32 recipe's TF32) of the GPU `device` names, if known;
    None when the ranks computed on anything but a GPU (a GPU's peak says nothing of CPU ranks,
    even on a machine that has one) or the GPU is not in the calculator's table."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None

    name = torch.cuda.get_device_name(device)
    for gpu in GPUS.values():  # the model as a whole word: "NVIDIA GB200" is not a B200
        if re.search(rf"\b{re.escape(gpu.name.split()[0])}\b", name):
            return gpu.peak_bf16 if precision == "bf16" else gpu.peak_tf32
    return None


def compare(run, cluster, device=RANKS_DEVICE) -> dict:
    """Predicted and measured figures of the first segment's layout (the 8-rank one):
    step seconds (measured: the median over its steps after the first), tokens/s, model FLOP/s,
    MFU against the peak of `device`, where the ranks computed (a GPU's spec sheet, else the
    cluster's calibrated CPU rate), and per rank: model state and activations (estimated vs
    measured) and the peak RSS."""
    c, dims = run.config, run.config.layout
    model, recipe = estimate_inputs(c)
    batch = c.train.batch_size
    predicted = step_time(model, dims, cluster.with_gpus(dims.world_size), batch, c.model.block_size, recipe,
                          checked_collectives=CHECKED_COLLECTIVES)  # as run_capstone runs it
    memory = memory_per_rank(model, dims, batch, c.model.block_size, recipe)
    seconds = run.first.step_seconds[1:] or run.first.step_seconds
    measured = statistics.median(seconds)
    tokens = c.train.batch_size * c.model.block_size

    estimated = estimated_per_rank(model, dims, batch, c.model.block_size)  # fp32 state = bf16 autocast's
    per_rank = [{"state": r.memory["total"], "activations": r.memory["activations"], "rss": r.memory["peak_rss"],
                 "state_estimated": e["params"] + e["grads"] + e["optimizer"]}
                for r, e in zip(run.first_ranks, estimated)]
    peak = gpu_peak_flops(c.precision, device)
    rate = peak or cluster.achievable_flops
    return {"predicted_s": predicted["total"], "predicted_checks_s": predicted["checks"], "measured_s": measured,
            "measured_steps": len(seconds), "outside_calibration": outside_calibration(dims, cluster), "tokens_per_s": tokens / measured,
            "predicted_tokens_per_s": tokens / predicted["total"], "flops": predicted["flops"],
            "mfu": predicted["flops"] / measured / (dims.world_size * rate), "mfu_against": "gpu peak" if peak
            else "calibrated CPU rate", "memory_predicted": memory, "memory_measured": per_rank,
            "dims": dims, "recipe": recipe}


def outside_calibration(dims, cluster) -> list[str]:
    """Where a layout leaves what a measured cluster (course_lib.measure.calibrate) measured, each
    with the way it moves the prediction: a group size the table lacks is priced as the next
    measured one up (more ring hops: high; above the largest: low), and a world of fewer ranks
    than the calibration's on the same shared cores gives each rank more of a core than the
    calibration's ranks had (every term high; more ranks: low). [] on a published cluster."""
    table = cluster.intra
    if not isinstance(table, CollectiveTable) or "all_reduce" not in table.entries:
        return []
    measured = sorted(int(g) for g in table.entries["all_reduce"])
    notes = []
    groups = {"tp groups": dims.tp, "cp groups": dims.cp, "ep groups": dims.ep,
              "dp groups": dims.dp * dims.ep * dims.cp, "the world's all-reduce": dims.world_size}
    for name, g in groups.items():
        if g > 1 and g not in measured:
            larger = [m for m in measured if m >= g]
            priced = larger[0] if larger else measured[-1]
            notes.append(f"{name} of {g} ranks priced as the measured {priced} ({'high' if priced > g else 'low'})")
    if cluster.shared_cores and dims.world_size != cluster.n_gpus:
        notes.append(f"{dims.world_size} ranks on the {cluster.shared_cores} cores where the calibration ran "
                     f"{cluster.n_gpus} ({'high' if dims.world_size < cluster.n_gpus else 'low'})")
    return notes


def traffic_formula(config, dims) -> dict:
    """{dim: bytes sent per step, summed over the ranks} of a dense layout: notebook 10's traffic
    model (course_lib.parallel.topology.traffic_per_step, which reads each axis's records in
    course_lib.estimate.traffic) at fp32 on the wire, with what this run changes there: under
    bf16 the row-parallel matmuls' outputs carry bf16, and full recomputation repeats each
    block's attention all-reduce (torch's checkpoint stops before the MLP's)."""
    if config.model.n_experts:
        raise ValueError("traffic_formula covers dense layouts (n_experts=0)")
    return {d: row["bytes_sent"] for d, row in topology.traffic_per_step(config.model, dims,
                                                                          config.train.batch_size).items()}


def report_text(run, cluster, device=RANKS_DEVICE) -> str:
    c, k = run.config, compare(run, cluster, device)
    mp, mm = k["memory_predicted"], k["memory_measured"]
    traffic = run.traffic[0]
    mfu = (f"MFU {k['mfu']:.1%} of the GPU's peak" if k["mfu_against"] == "gpu peak" else
           f"MFU not defined on CPU ranks (no spec-sheet peak); against the calibrated rate of "
           f"{cluster.achievable_flops / 1e9:.2f} GFLOP/s per rank: {k['mfu']:.2%}")
    rows = [
        "capstone report",
        f"  layout           {c.layout.describe()} -> {c.resume.describe()} after step {c.checkpoint_step}",
        f"  step time        predicted {k['predicted_s'] * 1e3:.3g} ms ({k['predicted_checks_s'] * 1e3:.3g} ms of it "
        f"the collective checks), measured {k['measured_s'] * 1e3:.3g} ms (median of {k['measured_steps']} steps; "
        f"{k['measured_s'] / k['predicted_s']:.2f} x)",
    ] + ([f"  model's range    outside the calibration: {'; '.join(k['outside_calibration'])}"]
         if k["outside_calibration"] else []) + [
        f"  tokens/s         {k['tokens_per_s']:,.0f} measured, {k['predicted_tokens_per_s']:,.0f} predicted",
        f"  utilisation      {mfu}",
        f"  state per rank   predicted {' '.join(fmt_bytes(m['state_estimated']) for m in mm)}",
        f"                   measured  {' '.join(fmt_bytes(m['state']) for m in mm)}"
        f" ({'equal on every rank' if all(m['state'] == m['state_estimated'] for m in mm) else 'DIFFERENT'})",
        f"  activations      predicted {fmt_bytes(mp['activations'])}, measured "
        f"{fmt_bytes(min(m['activations'] for m in mm))} .. {fmt_bytes(max(m['activations'] for m in mm))}",
        f"  peak RSS         {fmt_bytes(max(m['rss'] for m in mm))} on the largest rank (the whole process: "
        f"torch, the pool, every earlier run)",
        "  bytes per dim    " + ", ".join(f"{d} {fmt_bytes(t['bytes_sent'] / c.checkpoint_step)}"
                                          for d, t in traffic.items()) + " per step, sent by rank 0",
        f"  loss             {run.losses[-1]:.4f} after {len(run.losses)} steps (single process "
        f"{run.single_losses[-1]:.4f}, largest difference {run.max_difference:.1e}, tolerance {c.tolerance:.0e})",
    ]
    return "\n".join(rows)


class LiveLossPlot:
    """The loss curve redrawn in place while run_capstone trains (one display, updated at most
    every `every_s` seconds, and at most 1/SHARE of the time): run_capstone(config, dir,
    on_loss=plot.update); plot.close(). The second limit: a redraw costs the notebook's process
    about 0.12 s of CPU here, taken from the cores the ranks share, so redrawing every 0.5 s
    slowed the steps that the report compares with the prediction."""

    FIGSIZE = (6.4, 3.2)
    SHARE = 20  # wait at least SHARE times the last redraw's seconds before the next

    def __init__(self, config, every_s: float = 0.5):
        from IPython.display import display

        self.config, self.every_s = config, every_s
        self.points = {"first": [], "resumed": [], "single": []}
        self._last, self._render_s = 0.0, 0.0
        self.handle = display(self._image(), display_id=True)

    def draw(self, fig, points=None) -> str:
        c, points = self.config, points or self.points
        ax = fig.add_subplot(1, 1, 1)
        styles = {"single": ("k-", "single process", dict(lw=3, alpha=0.3)),
                  "first": ("o-", c.layout.describe(), {}), "resumed": ("s-", c.resume.describe(), {})}
        for name, (fmt, label, kw) in styles.items():
            if points[name]:
                ax.plot(*zip(*points[name]), fmt, label=label, **kw)
        ax.axvline(c.checkpoint_step + 0.5, color="gray", ls=":")
        ax.set_xlim(0.5, c.train.steps + 0.5)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        if any(points.values()):
            ax.legend(fontsize=8, loc="upper right")
        fig.subplots_adjust(left=0.12, right=0.97, top=0.95, bottom=0.15)
        done = sum(len(v) for v in points.values())
        return f"{done} of {2 * c.train.steps} steps"

    def _image(self):
        from IPython.display import Image

        from course_lib.widgets import render

        return Image(render(self.draw, self.FIGSIZE).png)

    def update(self, segment: str, step: int, loss: float) -> None:
        self.points[segment].append((step, loss))
        if time.monotonic() - self._last >= max(self.every_s, self.SHARE * self._render_s):
            start = time.monotonic()
            self.handle.update(self._image())
            self._last = time.monotonic()
            self._render_s = self._last - start

    def close(self) -> None:
        self.handle.update(self._image())


def generate_text(config, params: dict, prompt: str, n: int, temperature: float = 0.0, seed: int = 0) -> str:
    """Load the gathered parameters into one GPT and continue `prompt` by n characters, decoded
    with the dataset's alphabet (temperature 0: greedy)."""
    import torch

    model = GPT(config.model, seed=config.train.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(params[name])
    tokenizer = CharDataset("train", config.model.block_size).tokenizer
    out = model.generate(torch.tensor([tokenizer.encode(prompt)]), n, temperature=temperature,
                         generator=torch.Generator().manual_seed(seed))
    return tokenizer.decode(out[0].tolist())
