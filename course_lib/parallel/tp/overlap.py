"""What asynchronous TP overlaps, measured on real ranks (notebook 05): one tensor-parallel MLP
(fc column-parallel, GELU, proj row-parallel) under sequence parallelism, forward and backward,
with the plain collectives or their decomposed rings (course_lib.parallel.tp.async_tp).

Each rank's events share one clock (perf_counter, course_lib.observe.timeline), on two lanes:

    "rank r"       what the rank's thread does: "comm" while it is blocked in a collective or in a
                   ring step's wait (the EXPOSED communication), "compute" the rest of the step;
    "rank r link"  "send/recv": a ring step's exchange, from its post to the end of its last wait
                   (the transfer was done by then; on this clock it cannot end earlier).

A patching layer (course_lib.observe.patching, the engine the tracer uses) times the calls;
the library's code runs unchanged.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from course_lib.model import GPT, GPTConfig
from course_lib.observe import patching
from course_lib.observe.timeline import Timeline, plot_gantt
from course_lib.observe.tracer import CommTracer
from course_lib.parallel.tp.apply import apply_tensor_parallel
from course_lib.runtime.device import rank_device

RING_OPS = frozenset({"batch_isend_irecv"})


class _Waited:
    """A work handle whose wait() is timed as exposed communication; the batch's last one to
    finish closes the batch's send/recv span."""

    def __init__(self, work, batch):
        self.work, self.batch = work, batch

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.work.wait(*args, **kwargs)
        end = time.perf_counter()
        self.batch["timer"].main.add("wait", start, end, "comm")
        self.batch["left"] -= 1
        if self.batch["left"] == 0:
            self.batch["timer"].link.add("send/recv", self.batch["posted"], end, "send/recv")
        return out

    def __getattr__(self, name):
        return getattr(self.work, name)


class CommTimer:
    """Context manager (rank side): every blocking torch.distributed call is a "comm" span on
    `main`; every batch_isend_irecv a "send/recv" span on `link` and its waits "comm" on `main`."""

    ops = frozenset(patching.PATCHABLE_OPS)

    def __init__(self):
        self.main, self.link = Timeline(), Timeline()

    def around(self, name, args, call):
        start = time.perf_counter()
        result = call()
        if name in RING_OPS:
            batch = {"timer": self, "posted": start, "left": len(result)}
            return [_Waited(work, batch) for work in result]
        self.main.add(name, start, time.perf_counter(), "comm")
        return result

    def __enter__(self):
        patching.add_layer(self)
        return self

    def __exit__(self, *exc):
        patching.remove_layer(self)
        return False


def lanes(main: list, link: list, start: float, end: float) -> tuple[list, list]:
    """The main lane with its gaps between start and end filled as "compute", and the link lane."""
    filled, t = [], start
    for event in sorted(main, key=lambda e: e[1]):
        if event[1] > t:
            filled.append(("compute", t, event[1], "compute"))
        filled.append(event)
        t = max(t, event[2])
    if end > t:
        filled.append(("compute", t, end, "compute"))
    return filled, list(link)


def mlp_on_rank(async_tp: bool, batch: int, seq: int, d_model: int, repeats: int = 3, seed: int = 0) -> dict:
    """Rank side: the first block's MLP of a one-layer GPT made tensor parallel (sequence
    parallel, async_tp as given), forward and backward on this rank's sequence chunk of a seeded
    input, 1 + repeats times. The first run is traced (CommTracer) and warms up; each repeat
    starts at a barrier and is timed. Returns {"traffic": the tracer's summary, "output" and
    "grads" of the first run (fc's and proj's weight gradients), "exposed" and "step" (seconds
    per repeat), "lanes": the last repeat's (main, link) events}."""
    config = GPTConfig.tiny(n_layer=1, d_model=d_model, block_size=seq)  # the vocabulary plays no part here
    dev = rank_device()  # NCCL communicates tensors on the rank's GPU only (the CPU on gloo ranks)
    mlp = apply_tensor_parallel(GPT(config, seed=seed).to(dev), None, sequence_parallel=True,
                                async_tp=async_tp).blocks[0].mlp
    gen = torch.Generator().manual_seed(seed)  # drawn on the CPU (the same numbers everywhere), then moved
    x, g = (torch.randn(batch, seq, d_model, generator=gen).to(dev),
            torch.randn(batch, seq, d_model, generator=gen).to(dev))
    p, r = dist.get_world_size(), dist.get_rank()
    x, g = x.chunk(p, dim=1)[r].contiguous().requires_grad_(True), g.chunk(p, dim=1)[r]

    def step():
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        y = mlp(x)
        (y * g).sum().backward()
        return y.detach()

    with CommTracer() as tracer:
        y = step()
    out = {"traffic": tracer.summary(), "output": y, "exposed": [], "step": [], "lanes": None,
           "grads": (mlp.fc.weight.grad.clone(), mlp.proj.weight.grad.clone(), x.grad.clone())}
    for _ in range(repeats):
        dist.barrier()
        with CommTimer() as timer:
            start = time.perf_counter()
            step()
            end = time.perf_counter()
        out["exposed"].append(sum(e[2] - e[1] for e in timer.main.events))
        out["step"].append(end - start)
        out["lanes"] = lanes(timer.main.events, timer.link.events, start, end)
    return out


def plot_lanes(per_rank: list[dict], ax, title: str):
    """Two rows per rank (its thread, its link) from mlp_on_rank's results, on one time axis."""
    rows = [lane for res in per_rank for lane in res["lanes"]]
    plot_gantt(rows, ax=ax, title=title, label_min_width=1.0)
    ax.set_yticks(range(len(rows)), [f"rank {i // 2}" + (" link" if i % 2 else "") for i in range(len(rows))])
    return ax


def plot_ring_steps(ax, p: int = 4):
    """all_gather_matmul's schedule on p ranks: at step t rank r multiplies the chunk it holds,
    x_c with c = (r - t) mod p, while x_c travels on to rank r+1 and x_(c-1) arrives from r-1."""
    for r in range(p):
        for t in range(p):
            c = (r - t) % p
            ax.barh(2 * r, 0.9, left=t, height=0.8, color="tab:blue", edgecolor="black", linewidth=0.3)
            ax.text(t + 0.45, 2 * r, f"x{c} @ W{r}ᵀ", ha="center", va="center", fontsize=8, color="white")
            if t < p - 1:
                ax.barh(2 * r + 0.85, 0.9, left=t, height=0.6, color="tab:purple", edgecolor="black", linewidth=0.3)
                ax.text(t + 0.45, 2 * r + 0.85, f"x{c} → {(r + 1) % p},  x{(c - 1) % p} ←", ha="center",
                        va="center", fontsize=7, color="white")
    ax.set_yticks([2 * r + o for r in range(p) for o in (0, 0.85)],
                  [f"rank {r}" + (" link" if o else "") for r in range(p) for o in (0, 1)], fontsize=8)
    ax.set_xticks([t + 0.45 for t in range(p)], [f"step {t}" for t in range(p)])
    ax.invert_yaxis()
    ax.set_title(f"all_gather_matmul on {p} ranks: multiply the chunk held while the next one arrives", fontsize=9)
    return ax
