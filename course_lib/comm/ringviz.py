"""Step through a ring all-reduce: which chunk each rank holds, and whose data it contains.

The state is computed by a pure-Python simulation of the schedule in
`course_lib.comm.ring_send_chunk`, the same function the real ring uses, so the picture
and the code cannot disagree. `observe_ring_all_reduce` records the same thing from a real
run on real ranks (each rank contributes the bit 2**rank, so a chunk's value *is* the set
of ranks summed into it), and the notebook asserts the two are equal.

    states = simulate_ring(4)       # states[s][rank][chunk] = bitmask of contributors
    plot_ring_steps(4)              # every step in one static figure (works everywhere)
    ring_view(4, step=0)            # one step, as the widget shows it
    ring_widget(4)                  # a slider over the steps (show it with widgets.show_interactive)
"""

from __future__ import annotations

from course_lib._validate import check_int
from course_lib.comm import chunk_bounds, ring_all_reduce, ring_send_chunk
from course_lib.runtime.device import rank_device


def simulate_ring(world_size: int) -> list[list[list[int]]]:
    """states[s][r][c]: bitmask of the ranks whose chunk c is summed into rank r's copy of
    chunk c after s ring steps (s = 0 is the start: rank r holds only its own data, 1 << r).
    There are 2(N-1) steps: N-1 reduce-scatter steps (the receiver ORs, i.e. adds, the
    incoming contributions) then N-1 all-gather steps (the receiver overwrites)."""
    check_int("world_size", world_size, minimum=2, rule="an int >= 2 (a ring needs two ranks)")
    n = world_size
    state = [[1 << r for _ in range(n)] for r in range(n)]
    states = [[row[:] for row in state]]
    for step in range(2 * (n - 1)):
        sent = [state[r][ring_send_chunk(r, step, n)] for r in range(n)]  # everyone sends at once
        for r in range(n):
            left = (r - 1) % n
            c = ring_send_chunk(left, step, n)
            state[r][c] = (state[r][c] | sent[left]) if step < n - 1 else sent[left]
        states.append([row[:] for row in state])
    return states


def ring_transfers(world_size: int, step: int) -> list[tuple[int, int, int]]:
    """[(src, dst, chunk)] of the messages at `step` (0-based): every rank sends one chunk right."""
    n = world_size
    return [(r, (r + 1) % n, ring_send_chunk(r, step, n)) for r in range(n)]


def observe_ring_all_reduce(chunk_elems: int = 2):
    """Rank code: run the real `ring_all_reduce` on an int64 tensor in which rank r holds
    1 << r everywhere, and return what this rank holds in each chunk after every step:
    a list over steps 0..2(N-1) of [value of chunk c]. Since the values are distinct bits,
    a sum is exactly the bitmask of the ranks summed in (compare with simulate_ring)."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    numel = chunk_elems * n + 1  # +1: a size N does not divide, so the chunks are uneven
    x = torch.full((numel,), 1 << rank, dtype=torch.int64, device=rank_device())  # NCCL: on the rank's GPU
    bounds = chunk_bounds(numel, n)

    def snapshot(flat):
        values = []
        for s, e in bounds:
            chunk = flat[s:e]
            if not bool((chunk == chunk[0]).all()):
                raise AssertionError(f"rank {rank}: chunk {s}:{e} holds mixed values {chunk.tolist()}")
            values.append(int(chunk[0]))
        return values

    seen = [snapshot(x)]
    ring_all_reduce(x, on_step=lambda step, flat: seen.append(snapshot(flat)))
    return seen


def _label(mask: int, n: int) -> str:
    if mask == (1 << n) - 1:
        return "Σ all"
    return "+".join(str(r) for r in range(n) if mask >> r & 1)


def draw_ring_state(ax, world_size: int, step: int, states=None):
    """Draw the state after `step` steps on `ax`: rows = ranks, columns = chunks, colour =
    how many ranks are summed in; the cells that just arrived are outlined (arrows name the
    message of this step)."""
    import matplotlib.patches as patches

    n = world_size
    states = states or simulate_ring(n)
    grid = states[step]
    cmap = __import__("matplotlib").colormaps["Blues"]
    arrived = {(dst, c) for _, dst, c in ring_transfers(n, step - 1)} if step > 0 else set()
    for r in range(n):
        for c in range(n):
            k = bin(grid[r][c]).count("1")
            ax.add_patch(patches.Rectangle((c, r), 1, 1, facecolor=cmap(0.15 + 0.75 * k / n),
                                           edgecolor="black" if (r, c) in arrived else "white",
                                           linewidth=2.5 if (r, c) in arrived else 1))
            ax.text(c + 0.5, r + 0.5, _label(grid[r][c], n), ha="center", va="center",
                    fontsize=max(6, 11 - n), color="white" if k > n / 2 else "black")
    ax.set_xlim(0, n)
    ax.set_ylim(n, 0)
    ax.set_xticks([c + 0.5 for c in range(n)], [f"chunk {c}" for c in range(n)], fontsize=7)
    ax.set_yticks([r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=7)
    ax.tick_params(length=0)
    if step == 0:
        title = "start: each rank has only its own data"
    else:
        phase = "reduce-scatter" if step - 1 < n - 1 else "all-gather"
        moves = ", ".join(f"{s}→{d}:c{c}" for s, d, c in ring_transfers(n, step - 1))
        title = f"after step {step} ({phase})\n{moves}"
    ax.set_title(title, fontsize=8)
    return ax


def plot_ring_steps(world_size: int = 4, cols: int = 4):
    """A static figure of every step of a ring all-reduce (the fallback for the widget)."""
    import matplotlib.pyplot as plt

    states = simulate_ring(world_size)
    total = len(states)
    rows = -(-total // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i < total:
            draw_ring_state(ax, world_size, i, states)
        else:
            ax.axis("off")
    fig.suptitle(f"Ring all-reduce on {world_size} ranks: {total - 1} steps "
                 f"(outlined: the chunk that just arrived)", fontsize=11)
    fig.tight_layout()
    return fig


RING_FIGSIZE = (4.6, 4.2)  # inches at widgets.DPI: the widget's figure never changes size


def _draw_ring_figure(fig, world_size: int, step: int) -> str:
    """widgets.render's draw function: the state after `step` steps, and a caption naming it."""
    n = world_size
    if not 0 <= step <= 2 * (n - 1):
        raise ValueError(f"step={step} must be between 0 and 2(N-1)={2 * (n - 1)}")
    draw_ring_state(fig.add_subplot(), n, step)
    fig.subplots_adjust(left=0.16, right=0.97, top=0.86, bottom=0.08)
    if step == 0:
        return f"step 0 of {2 * (n - 1)}: the start"
    phase = "reduce-scatter" if step - 1 < n - 1 else "all-gather"
    return f"step {step} of {2 * (n - 1)}: {phase}"


def ring_view(world_size: int = 4, step: int = 0):
    """One step as a static `widgets.View` (the widget's first state when step=0)."""
    from course_lib.widgets import render

    return render(_draw_ring_figure, RING_FIGSIZE, world_size=world_size, step=step)


def ring_widget(world_size: int = 4):
    """A slider over the 2(N-1) steps above a fixed-size picture of the current step.
    Show it with `widgets.show_interactive(lambda: ring_view(N), lambda: ring_widget(N))`."""
    import ipywidgets as W

    from course_lib.widgets import LiveFigure

    simulate_ring(world_size)  # validates world_size before any widget exists
    step = W.IntSlider(value=0, min=0, max=2 * (world_size - 1), description="step")
    return LiveFigure({"step": step}, _draw_ring_figure, RING_FIGSIZE, fixed={"world_size": world_size})
