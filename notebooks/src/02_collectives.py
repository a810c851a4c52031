# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/notebooks/02_collectives.ipynb)

# %% [markdown]
# # 02 · Collectives and ring all-reduce
#
# Data parallelism (notebook 03) needs one thing from the network: after every backward pass,
# each of the `N` ranks must hold the **average gradient** $g = \frac{1}{N}\sum_i g_i$ of all
# ranks. That is an **all-reduce** (sum, then divide by `N`). How the bytes travel to make it
# happen decides whether adding GPUs speeds training up or just adds waiting.
#
# In this notebook we build the collectives ourselves, from nothing but point-to-point
# `send`/`recv` (in `course_lib/comm/collectives.py` and `trees.py`: every algorithm is a few
# lines), and check every one against the `torch.distributed` built-in on real ranks.
#
# **After this notebook you can**
#
# * state what all-reduce, reduce-scatter, all-gather and all-to-all leave on each rank, and
#   why all-reduce = reduce-scatter + all-gather;
# * trace a ring all-reduce step by step and derive its $\frac{2(N-1)}{N}S$ bytes per rank;
# * compare the parameter server (single and sharded), the ring, recursive doubling and
#   Rabenseifner's halving-doubling by messages and bytes, and check the counts with a tracer;
# * fit the α-β model $T(S) = \alpha + S/\beta$ to measurements, and use it to predict a
#   collective's time on a real cluster;
# * explain why that model under-predicts ranks that share a machine's cores, and predict them
#   with an α-β-γ model whose every term you measure;
# * decide from α, β, $N$ and $S$ whether a tree or a ring is faster, and explain why NCCL
#   uses both.

# %%
# Google Colab only (elsewhere this cell does nothing): fetch the course at its pinned revision, set it up
import os, subprocess, sys
if "google.colab" in sys.modules:
    home = os.environ.get("COURSE_COLAB_HOME", "/content/course")
    if not os.path.isdir(home):
        subprocess.run(["git", "clone", "-q", os.environ.get("COURSE_COLAB_REPO", "https://github.com/OWNER/distributed-training-from-first-principles"), home], check=True)
        subprocess.run(["git", "-C", home, "checkout", "-q", "v0.1.0"], check=True)
    sys.path.insert(0, home); from course_lib.colab import arrive; arrive(home, "notebooks")

# %%
%matplotlib inline
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

from course_lib import CommTracer, format_summary, merge_summaries, run_on_ranks
from course_lib import comm
from course_lib.comm import costmodel, ringviz
from course_lib.units import fmt_bytes

torch.manual_seed(0)
NUMEL = 840  # = lcm(1..8): every world size used below divides it, so byte counts are exact

# %% [markdown]
# ## 1. The collectives
#
# A **collective** is a communication every rank of a group takes part in. The ones this
# course uses (S = bytes of the tensor on each rank, N = ranks):
#
# | collective | before | after | where it shows up |
# |---|---|---|---|
# | **all-reduce** | rank r has $x_r$ (S bytes) | every rank has $\sum_r x_r$ | DP gradients, TP layer outputs |
# | **reduce-scatter** | rank r has $x_r$ | rank r has chunk r of $\sum_r x_r$ (S/N bytes) | ZeRO / FSDP gradients |
# | **all-gather** | rank r has piece r (S/N bytes) | every rank has all pieces | ZeRO / FSDP parameters, TP |
# | **all-to-all** | rank r has one piece *for each* rank | rank r has the pieces meant for it | expert parallelism |
# | broadcast | one rank has x | every rank has x | initial weights |
#
# Two identities do most of the work in this notebook:
# **all-reduce = reduce-scatter + all-gather**, and a collective is only a *schedule of
# point-to-point messages*. `torch.distributed` gives us `send`, `recv` and their
# non-blocking twins `isend`/`irecv`; everything in `course_lib.comm` is built from those,
# so `CommTracer` sees (and counts) every real byte.

# %% [markdown]
# ## 2. The parameter server
#
# The most obvious all-reduce: pick one rank (the *server*), have every other rank send it
# its tensor, add them up there, send the sum back. It is how early distributed training
# averaged gradients (the *parameter server* of DistBelief, Dean et al. 2012, and Li et al.
# 2014): workers push gradients to a server, which averages them and sends back the result.
# `comm.ps_all_reduce` does exactly that. Let us run it on 4 ranks, check it against
# `dist.all_reduce`, and count its bytes.
#
# *Predict first:* each rank holds $S$ = 3,360 bytes (840 float32). How many bytes does the
# server send and receive, and how many does each worker?
#
# <details><summary>Answer</summary>
#
# The server receives 3 tensors and sends 3: $(N-1)S$ = 10,080 bytes each way. Each worker
# sends its $S$ and receives the sum, $S$.
# </details>

# %%
def sum_tolerance(x):
    """Rank code: how far two all-reduces of x, adding in different orders, may differ. Any order
    of N additions is within (N-1)·ε·Σ|x_r| of the exact sum (section 4), so two orders are
    within twice that; exact (0) for integers."""
    bound = x.abs().double()
    dist.all_reduce(bound)  # Σ over the ranks of |x_r|, element by element
    eps = torch.finfo(x.dtype).eps if x.dtype.is_floating_point else 0
    return 2 * (dist.get_world_size() - 1) * eps * bound

def traced_all_reduce(algorithm, numel=NUMEL):
    """Rank code: run one course all-reduce on a random float32 tensor, check it against
    the built-in, and return this rank's traced summary."""
    x = torch.randn(numel)
    expected, tol = x.clone(), sum_tolerance(x)
    dist.all_reduce(expected)
    with CommTracer() as tracer:
        comm.ALL_REDUCE_ALGORITHMS[algorithm](x)
    assert ((x.double() - expected.double()).abs() <= tol).all()  # equal up to the order of the additions
    return tracer.summary()

def totals(per_rank, field):
    """Per-rank sum of one byte field over every traced op."""
    return [sum(op[field] for op in summary.values()) for summary in per_rank]

N = 4
S = NUMEL * 4  # float32 bytes
per_rank = run_on_ranks(traced_all_reduce, "ps", world_size=N)
print(format_summary(merge_summaries(per_rank)))
sent, recv = totals(per_rank, "bytes_sent"), totals(per_rank, "bytes_recv")
assert sent[0] == recv[0] == (N - 1) * S          # the server: (N-1)·S in and (N-1)·S out
assert sent[1:] == recv[1:] == [S] * (N - 1)      # each worker: S out, S back
print(f"\nS = {S:,} bytes. Server (rank 0): {sent[0]:,} B sent, {recv[0]:,} B received = (N-1)·S each way;"
      f" every worker: S each way.")

# %% [markdown]
# The result is right, and the cost is lopsided: rank 0 moves **(N-1)·S** in each direction
# while the workers move S. With 64 workers and a 1 GiB gradient, the server has to receive
# 63 GiB and send 63 GiB every step, all through its one network port, while the other ports
# idle. Adding workers makes the server's job longer: a single parameter server does not scale.
#
# (It also adds the N-1 tensors one after the other in rank order, so its result does not
# depend on who arrives first: every rank ends with bit-identical values. All algorithms here
# keep that property; it is what lets data-parallel replicas stay identical.)

# %% [markdown]
# ## 3. The ring all-reduce
#
# Arrange the ranks in a ring (rank r sends only to r+1, receives only from r-1) and cut each
# tensor into **N chunks**. Then:
#
# * **Reduce-scatter phase, N-1 steps.** At step k every rank sends one chunk to its right
#   neighbour and adds the chunk arriving from its left into its own copy. Each chunk travels
#   around the ring collecting one more contribution per hop; after N-1 hops rank r holds the
#   complete sum of chunk r.
# * **All-gather phase, N-1 steps.** The completed chunks travel around the ring once more,
#   this time overwriting, until every rank has every summed chunk.
#
# This schedule is *bandwidth-optimal*: Patarasuk & Yuan (2009, "Bandwidth optimal all-reduce
# algorithms for clusters of workstations") proved no all-reduce can send fewer bytes per
# rank, and gave this ring for MPI; Baidu (Gibiansky 2017) and Horovod (Sergeev & Del Balso
# 2018) later made it the standard way to average gradients in deep learning.
#
# Which chunk moves when is one line, `comm.ring_send_chunk(rank, step, N)`: at step k rank r
# sends chunk $(r - k - 1) \bmod N$, in both phases, and receives whatever its left neighbour
# sends. The real ring and the pure-Python simulation that draws the pictures below both call
# it, so the pictures cannot drift from the code.

# %%
print("N = 4: chunk sent by each rank at each step")
for step in range(2 * (N - 1)):
    phase = "reduce-scatter" if step < N - 1 else "all-gather    "
    print(f"  step {step} ({phase}): " + "  ".join(f"rank {r} -> chunk {comm.ring_send_chunk(r, step, N)}" for r in range(N)))

# %% [markdown]
# Step through it with the slider (the picture below the slider shows every step at once,
# for viewers that cannot run widgets). Each cell is one rank's copy of one chunk, labelled
# with the ranks whose data it contains; darker = more ranks summed in; outlined = the chunk
# that just arrived.

# %% tags=["nbval-ignore-output"]
from course_lib.widgets import show_interactive

show_interactive(lambda: ringviz.ring_view(4), lambda: ringviz.ring_widget(4))

# %%
ringviz.plot_ring_steps(4)
plt.show()

# %% [markdown]
# **The picture is checked against a real run.** `ringviz.observe_ring_all_reduce` runs the
# real `comm.ring_all_reduce` on an int64 tensor where rank r holds $2^r$ everywhere, and
# records each rank's chunks after every step. A sum of distinct powers of two *is* the set of
# ranks summed in, so the real run can be compared with the simulation exactly (here on 4
# and on 5 ranks, with a tensor size that 4 and 5 do not divide).

# %%
for n in (4, 5):
    real = run_on_ranks(ringviz.observe_ring_all_reduce, world_size=n)
    simulated = ringviz.simulate_ring(n)
    real_states = [[real[r][step] for r in range(n)] for step in range(len(simulated))]
    assert real_states == simulated
    print(f"N={n}: the real ring matches the simulation at all {len(simulated) - 1} steps")

# %% [markdown]
# **Correct for every dtype and awkward sizes.** Chunks follow `torch.tensor_split`: when N
# does not divide the size, the first chunks are one element longer, and when the tensor is
# smaller than N some chunks are empty (they send nothing). A common bug is to compute
# `chunk = numel // N` and silently drop the last `numel % N` elements, which is why we test
# sizes like 11 on 5 ranks. Floats are compared with a tolerance: the ring adds in a
# different order from gloo, and float addition is not associative. Any order of N additions
# is within $(N-1)\,\varepsilon \sum_r |x_r|$ of the exact sum, so two orders are within
# twice that. Integers must match exactly.

# %%
def check_dtypes(sizes=(3, 11, 40)):
    """Rank code: every course all-reduce vs dist.all_reduce for several dtypes and sizes."""
    rows = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        for numel in sizes:
            x = (torch.randint(-100, 100, (numel,)) if dtype == torch.int64 else torch.randn(numel)).to(dtype)
            expected, tol = x.clone(), sum_tolerance(x)
            dist.all_reduce(expected)
            for name, fn in comm.ALL_REDUCE_ALGORITHMS.items():
                y = fn(x.clone())
                ok = bool(((y.double() - expected.double()).abs() <= tol).all())
                rows.append((str(dtype).replace("torch.", ""), numel, name, ok))
    return rows

results = run_on_ranks(check_dtypes, world_size=5)
assert all(ok for rows in results for *_, ok in rows)
print("N=5; sizes 3 (< N), 11 (N does not divide it), 40:")
for dtype in ("float32", "float64", "bfloat16", "int64"):
    print(f"  {dtype:<9} {', '.join(comm.ALL_REDUCE_ALGORITHMS)} == dist.all_reduce on every rank: "
          f"{all(ok for rows in results for d, _, _, ok in rows if d == dtype)}")

# %% [markdown]
# ### Bytes per rank: the point of the ring
#
# Count what each rank sends. Per step it sends one chunk, S/N bytes; there are 2(N-1) steps:
#
# $$\text{ring all-reduce: } \frac{2(N-1)}{N}\,S \text{ per rank}
#   \qquad \text{reduce-scatter, all-gather: } \frac{N-1}{N}\,S \text{ each}$$
#
# Every rank sends the same amount, every link is busy at every step, and the amount per
# rank *tends to 2S, whatever N is*.
#
# *Predict first:* for $S$ = 3,360 bytes, how many bytes does each rank send in a ring
# all-reduce on 4 ranks? On 5?
#
# <details><summary>Answer</summary>
#
# $\frac{2 \cdot 3}{4} S = 1.5\,S$ = 5,040 bytes on 4 ranks; $\frac{2 \cdot 4}{5} S = 1.6\,S$
# = 5,376 bytes on 5 (each half, reduce-scatter and all-gather, sends half of that).
# </details>
#
# The tracer must agree to the byte:

# %%
def traced_halves(numel=NUMEL):
    """Rank code: trace a ring reduce-scatter, an all-gather and a full all-reduce."""
    x = torch.randn(numel)
    out = {}
    for name, fn in (("reduce_scatter", comm.ring_reduce_scatter), ("all_gather", comm.ring_all_gather),
                     ("ring", comm.ring_all_reduce)):
        with CommTracer() as tracer:
            fn(x.clone())
        out[name] = tracer.total_bytes()
    return out

for n in (4, 5):
    per_rank = run_on_ranks(traced_halves, world_size=n)
    for name in ("reduce_scatter", "all_gather", "ring"):
        theory = comm.theory_bytes_sent(name, S, n)
        assert all(r[name]["bytes_sent"] == r[name]["bytes_recv"] == theory for r in per_rank), name
        print(f"N={n} {name:<15} every rank sent and received {int(theory):>6,} B "
              f"= {theory / S:.3f}·S   (formula {'2' if name == 'ring' else ''}(N-1)/N·S)")
    assert all(r["reduce_scatter"]["bytes_sent"] + r["all_gather"]["bytes_sent"] == r["ring"]["bytes_sent"]
               for r in per_rank)
print("reduce-scatter + all-gather = all-reduce, byte for byte")

# %% [markdown]
# ## 4. Recursive doubling: a tree-shaped all-reduce
#
# The ring needs 2(N-1) steps one after the other; for a tiny tensor those steps are pure
# latency. **Recursive doubling** needs only $\log_2 N$: in round j, rank r swaps its whole
# partial sum with rank $r \oplus 2^j$ (XOR) and adds. After round 0 pairs hold pair sums,
# after round 1 groups of four, ..., after $\log_2 N$ rounds everyone has everything. The
# price: every round carries the *whole* tensor, S bytes, not S/N. (The course's code sends a
# large tensor in pieces of 2 MiB, as the ring does its chunks: the same bytes, a bounded scratch
# buffer.)
#
# When N is not a power of two, let p be the largest power of two below N. The N-p extra
# ranks first hand their tensor to a partner among the first p (which adds it), wait out the
# butterfly, and get the answer back at the end: two more steps. On 6 ranks (p = 4):
#
# *Predict first:* on 6 ranks, how many bytes does each rank send, in units of $S$? Which
# ranks send the most?
#
# <details><summary>Answer</summary>
#
# Ranks 4 and 5 send $S$ (their tensor, handed to ranks 0 and 1), then wait. Ranks 2 and 3 send
# $2S$: one full tensor in each of the $\log_2 4 = 2$ butterfly rounds. Ranks 0 and 1 send
# $3S$: the two rounds, plus the answer sent back to their extra partner. Unlike the ring,
# the load is uneven.
# </details>

# %%
sent = totals(run_on_ranks(traced_all_reduce, "tree", world_size=6), "bytes_sent")
for r in range(6):
    role = "folds into a core rank, then waits" if r >= 4 else (
        "core rank, also serves extra rank " + str(r + 4) if r < 2 else "core rank")
    print(f"rank {r}: sent {sent[r]:>6,} B = {sent[r] // S}·S   ({role})")
assert sent == [comm.theory_bytes_sent("tree", S, 6, rank=r) for r in range(6)]
assert sent == [3 * S, 3 * S, 2 * S, 2 * S, S, S]  # log2(4) = 2 rounds, + S for the fold-in partners

# %% [markdown]
# ### Rabenseifner: the ring's bytes in log N rounds
#
# Recursive doubling pays for its few rounds with full-size messages. **Rabenseifner's
# algorithm** (Rabenseifner 2004; Thakur, Rabenseifner & Gropp 2005) keeps the rounds and
# shrinks the messages, by doing what the ring does, reduce-scatter then all-gather, with
# butterfly partners:
#
# * **reduce-scatter by recursive halving**: in round 1, rank r and r ⊕ N/2 each keep one half
#   of the tensor, send the other half to the partner and add what arrives ($S/2$); in round 2
#   partners at distance N/4 split that half ($S/4$); after $\log_2 N$ rounds rank r holds the
#   complete sum of chunk r;
# * **all-gather by recursive doubling**: the same partners in reverse order swap what they
#   hold ($S/N$, then $2S/N$, ...) until everyone has everything.
#
# Bytes per rank: $2(S/2 + S/4 + \dots + S/N) = \frac{2(N-1)}{N}S$, the ring's, in
# $2\log_2 N$ messages instead of $2(N-1)$. On 8 ranks (one call, 8 ranks reused later):

# %%
def halving_doubling_messages(numel=NUMEL):
    """Rank code: the size of every message Rabenseifner's all-reduce sends, in order."""
    x = torch.randn(numel)
    expected, tol = x.clone(), sum_tolerance(x)
    dist.all_reduce(expected)
    with CommTracer() as tracer:
        comm.rabenseifner_all_reduce(x)
    assert ((x.double() - expected.double()).abs() <= tol).all()  # equal up to the order of the additions
    return [record.bytes_sent for record in tracer.records if record.op == "isend"]

messages = run_on_ranks(halving_doubling_messages, world_size=8)
print(f"N=8, S = {S:,} B; rank 0 sends {len(messages[0])} messages: {messages[0]} B")
assert all(sum(m) == comm.theory_bytes_sent("rabenseifner", S, 8) == comm.theory_bytes_sent("ring", S, 8)
           for m in messages)
assert messages[0] == [S // 2, S // 4, S // 8, S // 8, S // 4, S // 2]
print(f"total per rank {sum(messages[0]):,} B = 2(N-1)/N·S, the ring's bytes, in 2·log2(8) = 6 messages "
      f"(the ring needs 2(N-1) = 14)")

# %% [markdown]
# ## 5. Why rings won: bytes per rank against N
#
# Now run every all-reduce of this notebook on every world size from 2 to 8, trace them,
# assert every rank's bytes equal the formula, and plot the busiest rank's traffic (dots:
# measured here; lines: the formulas, extended to 64 ranks). The list includes one more
# design, the **sharded parameter server**: every rank is also the server of $1/N$ of the
# tensor, so workers push each server its chunk, and pull the summed chunks back.
#
# *Predict first:* as $N$ grows from 2 to 64, how does the busiest rank's traffic grow for
# the single parameter server, recursive doubling, the ring, Rabenseifner and the sharded
# parameter server?
#
# <details><summary>Answer</summary>
#
# Single server: linearly, $(N-1)S$. Recursive doubling: with $\log_2 N$, $S$ per round.
# The other three stay below $2S$ whatever $N$: each moves $\frac{2(N-1)}{N}S$ per rank
# (plus one $S$ on the ranks that fold in a partner when $N$ is not a power of two, for
# Rabenseifner). A sharded parameter server's push is a reduce-scatter and its pull an
# all-gather: it moves exactly the ring's bytes.
# </details>

# %%
def traffic(numel=NUMEL):
    """Rank code: {algorithm: bytes this rank sent} for ring, tree and ps (each checked)."""
    return {name: totals([traced_all_reduce(name, numel)], "bytes_sent")[0] for name in comm.ALL_REDUCE_ALGORITHMS}

measured = {}
for n in (4, 5, 6, 2, 3, 7, 8):  # the ranks of 4, 5 and 6 are still running: reuse them first
    per_rank = run_on_ranks(traffic, world_size=n)
    for name in comm.ALL_REDUCE_ALGORITHMS:
        assert [r[name] for r in per_rank] == [comm.theory_bytes_sent(name, S, n, rank=r) for r in range(n)], (n, name)
        measured[name, n] = max(r[name] for r in per_rank)
print("busiest rank's bytes sent, in units of S (measured = formula on every rank):")
print("  N  " + "".join(f"{name:>13}" for name in comm.ALL_REDUCE_ALGORITHMS))
for n in range(2, 9):
    print(f"{n:>3}  " + "".join(f"{measured[name, n] / S:>13.3f}" for name in comm.ALL_REDUCE_ALGORITHMS))

# %%
ns = list(range(2, 65))
fig, ax = plt.subplots(figsize=(7, 4))
styles = {"ring": ("tab:blue", "ring: 2(N-1)/N·S"), "tree": ("tab:green", "recursive doubling: ⌊log2 N⌋·S (+S)"),
          "rabenseifner": ("tab:purple", "Rabenseifner: 2(p-1)/p·S (+S)"),
          "ps": ("tab:red", "parameter server: (N-1)·S at the server"),
          "sharded_ps": ("tab:orange", "sharded parameter server: 2(N-1)/N·S")}
for name, (color, label) in styles.items():
    dashed = "--" if name in ("rabenseifner", "sharded_ps") else "-"  # they share the ring's line
    ax.plot(ns, [comm.theory_bytes_sent(name, 1, n) for n in ns], dashed, color=color, label=label)
    ax.plot(range(2, 9), [measured[name, n] / S for n in range(2, 9)], "o", color=color, markersize=4)
ax.set_yscale("log")
ax.set_xlabel("ranks N")
ax.set_ylabel("bytes sent by the busiest rank / S")
ax.set_title("Per-rank traffic of one all-reduce (dots: traced here, N = 2..8)")
ax.legend()
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# The ring line flattens at 2: a ring of 1,000 GPUs moves barely more bytes per GPU than a
# ring of 4. The single parameter server's line climbs linearly, and recursive doubling's
# climbs with log N. No all-reduce can do better than the flat line: every rank must send
# out at least $\frac{N-1}{N}S$ for the reduction (all but its own share of the sum is
# computed elsewhere) and receive as much again for the distribution (Patarasuk & Yuan 2009).
# Large gradients are limited by bandwidth, not latency, so this is why the ring (Baidu
# 2017, Horovod 2018, NCCL) replaced the single parameter server for synchronous
# data-parallel training, and why a parameter server, when used, is sharded.

# %% [markdown]
# ## 6. Other patterns: all-to-all
#
# Expert parallelism (notebook on MoE) routes each token to the rank holding its expert: every
# rank has a different piece *for every* other rank. `comm.pairwise_all_to_all` does it in
# N-1 rounds; in round k rank r sends to r+k and receives from r-k, so every rank sends and
# receives in every round and each pair talks exactly once: (N-1)/N·S per rank.

# %%
def all_to_all_demo():
    rank, n = dist.get_rank(), dist.get_world_size()
    inputs = [torch.full((2,), 10 * rank + dst) for dst in range(n)]  # piece "rank -> dst"
    outputs = [torch.empty(2, dtype=torch.int64) for _ in range(n)]
    with CommTracer() as tracer:
        comm.pairwise_all_to_all(outputs, inputs)
    expected = torch.empty(2 * n, dtype=torch.int64)
    dist.all_to_all_single(expected, torch.cat(inputs))  # the built-in, for comparison
    assert torch.equal(torch.cat(outputs), expected)
    return [int(o[0]) for o in outputs], tracer.total_bytes()["bytes_sent"]

for rank, (got, nbytes) in enumerate(run_on_ranks(all_to_all_demo, world_size=4)):
    assert got == [10 * src + rank for src in range(4)] and nbytes == 3 / 4 * (4 * 2 * 8)
    print(f"rank {rank} received pieces {got} (10·src + dst), sent {nbytes} B = (N-1)/N·S")

# %% [markdown]
# ## 7. The α-β cost model
#
# Bytes are half the story; the other half is how many messages wait for each other. The
# classic model (Hockney 1994): one message of S bytes takes
#
# $$T(S) = \alpha + \frac{S}{\beta}$$
#
# where **α** is the latency (the fixed cost of a message: software, wake-ups, the wire) and
# **β** the bandwidth (bytes per second). A collective is a schedule of messages, so its time
# is (messages one after another)·α + (bytes through the busiest link)/β:
#
# | algorithm | predicted time |
# |---|---|
# | ring all-reduce | $2(N-1)\,\alpha + \frac{2(N-1)}{N} \frac{S}{\beta}$ |
# | reduce-scatter, all-gather | $(N-1)\,\alpha + \frac{N-1}{N} \frac{S}{\beta}$ |
# | recursive doubling | $L(\alpha + \frac{S}{\beta})$, $L = \log_2 p + 2[N \ne p]$ |
# | Rabenseifner (N a power of two) | $2\log_2 N\,\alpha + \frac{2(N-1)}{N} \frac{S}{\beta}$ |
# | parameter server | $2(N-1)(\alpha + \frac{S}{\beta})$: N-1 receives, then N-1 sends, through one link |
# | sharded parameter server | $2(N-1)\,\alpha + \frac{2(N-1)}{N} \frac{S}{\beta}$, the ring's |
#
# (`course_lib.comm.costmodel.cost_terms`; the adds themselves are left out, on GPUs they hide
# under the transfers.) First we measure α and β on this machine with a **ping-pong**: two
# ranks bounce a message of each size back and forth, and half the fastest round trip is
# $T(S)$. Emulated ranks share this machine's few CPU cores, so we let every pair of ranks
# ping-pong at the same time (`all_pairs=True`): the link is measured under the load a
# collective puts on it. Each size is timed in 5 passes over all sizes, 3 round trips each,
# so a burst of load elsewhere on the machine slows one pass of every size instead of every
# try of one size. Then a least-squares fit (weighted by 1/T, so small messages pin α and
# large ones pin β).
#
# *Predict first:* is α on this machine closer to 1 µs (a GPU interconnect) or to 100 µs?
# And β: closer to 1 GB/s or 100 GB/s?
#
# <details><summary>Answer</summary>
#
# α is tens of microseconds or more: each message goes through the operating system's
# loopback network stack and wakes up another process, often on a busy core. β is around a
# few GB/s: bytes are copied by the CPU through kernel buffers. An NVLink step costs a few
# µs at hundreds of GB/s.
# </details>

# %% tags=["nbval-ignore-output"]
SIZES_PP = [8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24]
one_way = run_on_ranks(costmodel.ping_pong, SIZES_PP, rounds=5, iters=3, all_pairs=True, world_size=4,
                      check_collectives=False)[0]
link = costmodel.fit_alpha_beta(SIZES_PP, one_way, name="this machine (gloo, loopback)")
print(f"fitted: alpha = {link.alpha * 1e6:.0f} us per message, beta = {link.beta / 1e9:.2f} GB/s")
off = []
for size, t in zip(SIZES_PP, one_way):
    ratio = t / link.message_time(size)
    off += [size] if not 0.5 < ratio < 2 else []
    print(f"  {fmt_bytes(size):>10}: measured {t * 1e6:9.1f} us, model {link.message_time(size) * 1e6:9.1f} us"
          f"  (x{ratio:.2f})")
print("sizes more than 2x off the fit:", [fmt_bytes(s) for s in off] or "none")

# %%
# (fit_alpha_beta raises if the data make no sense: times that do not grow with size)
fig, ax = plt.subplots(figsize=(6, 3.5))
xs = [2**k for k in range(3, 25)]
ax.loglog(SIZES_PP, [t * 1e6 for t in one_way], "o", label="ping-pong (one way)")
ax.loglog(xs, [link.message_time(x) * 1e6 for x in xs], "-", label="fit α + S/β")
ax.axvline(link.alpha * link.beta, color="grey", ls=":", label="S = αβ: latency = transfer")
ax.set_xlabel("message size S (bytes)")
ax.set_ylabel("time (µs)")
ax.legend()
ax.grid(alpha=0.3, which="both")
plt.show()

# %% [markdown]
# Below $S = \alpha\beta$ (the dotted line) a message costs about α whatever its size:
# that is the **latency-bound** regime. Above it, time grows with S: **bandwidth-bound**.
#
# The points do not sit exactly on the line, and on a shared machine one size can land far
# off it in one run and on it in the next (the cell above lists any size more than 2× off).
# A point far *above* the line is a size whose every try was slowed by something else
# running; a straight line through all sizes is still the best summary of the link.
#
# Now time the all-reduces (and gloo's own, for reference) on 4 ranks from 4 KiB to
# 16 MiB, and put the model's predictions next to them. (On 4 ranks Rabenseifner and the
# sharded parameter server are left out of the timing: their byte counts are checked above.)

# %% tags=["nbval-ignore-output"]
SIZES = [1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24]
TIMED = ("ring", "tree", "ps")
ALGOS = {**{name: comm.ALL_REDUCE_ALGORITHMS[name] for name in TIMED}, "gloo built-in": lambda t: dist.all_reduce(t)}

def time_all(sizes):
    return {(name, s): costmodel.time_collective(fn, s, iters=5) for s in sizes for name, fn in ALGOS.items()}

timed = run_on_ranks(time_all, SIZES, world_size=4, check_collectives=False)[0]
print(f"{'size':>10}" + "".join(f"{name:>22}" for name in TIMED) + f"{'gloo built-in':>15}")
for s in SIZES:
    cells = "".join(f"{timed[name, s] * 1e3:9.2f} ms (x{timed[name, s] / costmodel.predict_time(name, s, 4, link):5.1f})"
                    for name in TIMED)
    print(f"{fmt_bytes(s):>10}" + cells + f"{timed['gloo built-in', s] * 1e3:12.2f} ms")
print("(x = measured / predicted)")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
grid = [2**k for k in range(10, 25)]
for name in TIMED:
    color = styles[name][0]
    ax.loglog(grid, [costmodel.predict_time(name, s, 4, link) * 1e3 for s in grid], "-", color=color,
              label=f"{name}: model")
    ax.loglog(SIZES, [timed[name, s] * 1e3 for s in SIZES], "o", color=color, label=f"{name}: measured")
ax.loglog(SIZES, [timed["gloo built-in", s] * 1e3 for s in SIZES], "k^", label="gloo built-in")
ax.axvline(4 * link.alpha * link.beta, color="tab:blue", ls=":", label="ring: α terms = S/β terms")
ax.set_xlabel("tensor size S (bytes)")
ax.set_ylabel("time per all-reduce (ms)")
ax.set_title("4 ranks on this machine: α-β model (lines) vs measurement (markers)")
ax.legend(fontsize=7, ncol=2)
ax.grid(alpha=0.3, which="both")
plt.show()

# %% [markdown]
# How to read it (your numbers vary with the machine and its load; the stored run had 4
# ranks on 2 shared CPU cores):
#
# * **The shape is right.** Every algorithm costs a roughly constant time for small tensors
#   (latency-bound) and a time growing with S for large ones (bandwidth-bound). For the ring
#   the two terms are equal at $S^* = N\alpha\beta$ (dotted line): below it, cutting steps
#   pays (tree); above it, cutting bytes per link pays (ring).
# * **Latency-bound regime (left): measured above the model, usually the ring worst.** The
#   ring makes 6 steps here, each waiting for the previous one, and each step needs four
#   processes to wake up and be scheduled on fewer cores than ranks. A ping-pong pair sees
#   much less of that, so its α is too small for a 4-rank collective. (The parameter server's
#   N-1 incoming messages are all in flight at once, so it pays less than its 2(N-1)α.)
# * **Bandwidth-bound regime (right): do not expect the ring to beat the parameter server on
#   this machine.** The
#   model assumes *every rank has its own link*, so the busiest link's bytes decide. Emulated
#   ranks have no links of their own: every byte is copied by the kernel on the same few cores,
#   one shared medium. Then what decides is the bytes moved by *all ranks together*, and the
#   next cell shows the ring and the parameter server move the same total. On a cluster every
#   GPU has its own NVLink and network ports working in parallel, and the per-link model is
#   the right one: the next section uses it.

# %%
total = {name: sum(comm.theory_bytes_sent(name, S, 4, rank=r) for r in range(4)) / S
         for name in comm.ALL_REDUCE_ALGORITHMS}
busiest = {name: comm.theory_bytes_sent(name, S, 4) / S for name in comm.ALL_REDUCE_ALGORITHMS}
print("N=4, in units of S:        " + "".join(f"{name:>13}" for name in total))
print("bytes sent by busiest rank " + "".join(f"{busiest[n]:>13.1f}" for n in total) + "   <- decides on a cluster")
print("bytes sent by all ranks    " + "".join(f"{total[n]:>13.1f}" for n in total) + "   <- decides on one shared machine")
assert total["ring"] == total["ps"] == 2 * (4 - 1) and total["tree"] == 4 * 2

# %% [markdown]
# ### A model for ranks that share cores: α-β-γ
#
# The α-β model describes a cluster, where every rank has its own link. Emulated ranks break
# three of its assumptions, and each broken assumption can be measured, in the same run as the
# collectives it is to predict (`course_lib.measure.emulated_fit`), and added back
# (`course_lib.estimate.emulated`; the γ term is the one of Thakur, Rabenseifner & Gropp 2005 and
# Chan et al. 2007):
#
# $$T = s\,t_0 + \sum_{m\ \in\ \text{busiest rank's messages}} x(m)\ \text{or}\ x^+(m) + r\,S\,\gamma\,\sigma + k$$
#
# * **x(m)**, one step as a collective takes it: every rank sends $m$ bytes to its right
#   neighbour while receiving $m$ from its left, all ranks at once, measured at sizes from
#   64 KiB to 64 MiB and interpolated between them, back to back. With more ranks than cores
#   a second table, **x⁺(m)**, prices the steps that follow an add (the ring's reduce-scatter
#   steps, recursive doubling's rounds; not the all-gather's or the all-to-all's): each step
#   measured after an add of what the step before brought, the add's own time taken off. A
#   rank that computed must get a core again before its next message moves, and its partners
#   wait for it; back to back, the ranks run in step and skip that wait.
#   Not a ping-pong of one awake pair, and not
#   one line: a message far larger than the kernel's socket buffers crosses in many refills,
#   each waiting for a process to get a core, so the cost per byte changes with $m$ and with
#   the number of ranks. (This is why the course's ring sends its chunks in pieces of 2 MiB.)
# * **γ**, seconds per byte *added*, and **r**, the bytes the busiest rank adds per byte of
#   $S$: ring $(N-1)/N$, recursive doubling $\log_2 N$, all-to-all 0. On a GPU the addition
#   hides under the transfer; on a CPU the cores that copy the bytes also add them.
# * **σ**, the cores' shared memory: with more ranks than cores the additions of all ranks take
#   turns on the same cores and memory channels. σ = one rank's copy rate with as many ranks
#   copying as there are cores, over its rate with all $N$ copying (1 when $N \le$ cores).
# * **k**, the all-to-all's own part: $S/N$ bytes copied from a rank's input to its output,
#   not sent, at one rank's copy rate while every rank copies (0 for the ring and the tree,
#   which work in place).
# * **t₀**, a wait for a partner that reaches a step on its own time: one step of a 4-byte
#   ring, timed as the collectives are (from a barrier to the slowest rank's end). And **s**,
#   how many such waits the busiest rank meets one after another. With more ranks than cores,
#   every new partner is one: it arrives from wherever its own previous step left it, and may
#   be waiting for a core. The ring keeps its two neighbours throughout (s = 1); the
#   all-to-all meets a new partner every step (s = N-1); recursive doubling one per round
#   (s = log₂ N). With a core per rank, nobody waits for a core, and a new partner is already
#   running: the waits are the exchanges that follow an add, since the partner is adding too
#   and arrives when its add is done (the ring's reduce-scatter pieces, every piece of
#   recursive doubling but the last, none for the all-to-all).
#
# *Predict first:* at 16 MiB on 4 ranks, which term of the ring's time is largest: the
# exchanges, the additions or the waits? And for the all-to-all?
#
# <details><summary>Answer</summary>
#
# The exchanges, for both: the ring's busiest rank sends $2(N-1)/N \cdot S$ = 24 MiB in
# 2 MiB pieces, each piece a step that every rank must be scheduled for, and adds only
# $(N-1)/N \cdot S$ = 12 MiB (γ is a memory-speed add). The all-to-all adds nothing at all, so
# its time is its $N-1$ exchanges, each with a new partner and so, with more ranks than
# cores, each with a wait $t_0$. The table below shows the split measured here.
# </details>

# %% tags=["nbval-ignore-output"]
from course_lib.comm.collectives import PIECE_BYTES
from course_lib.estimate import emulated
from course_lib.measure import emulated_fit
from course_lib.platform import usable_cores

CORES, MODEL_MB, MODEL_ALGOS = usable_cores(), [1, 16], ("ring", "tree", "all_to_all")
# x(m) only up to the largest tensor here, not to 64 MiB: less memory per rank
X_SIZES = tuple(m for m in emulated_fit.EXCHANGE_SIZES if m <= max(MODEL_MB) * 2**20)
# the micro-benchmarks and the collectives alternate, round by round: both see the same machine
raw = run_on_ranks(emulated_fit.interleaved, CORES, MODEL_MB, MODEL_ALGOS, 3, sizes=X_SIZES, world_size=4,
                   timeout_s=120, check_collectives=False)
fit = emulated_fit.fit_constants(raw, CORES, sizes=X_SIZES)
print(f"4 ranks on {CORES} cores: t0 = {fit.start * 1e3:.2f} ms, gamma = 1 / ({1 / fit.gamma / 1e9:.1f} GB/s), "
      f"sigma = {emulated.sharing(4, fit):.2f}")
print(f"{'':>17}{'measured':>10}{'alpha-beta-gamma':>18}{'= waits + x(m) sum + adds, copy':>34}{'cluster alpha-beta':>20}")
errors = {}
for name in MODEL_ALGOS:
    for mb in MODEL_MB:
        t, nbytes = raw[0]["measured"][name][mb], mb * 2**20
        parts = emulated.terms(name, nbytes, 4, fit, PIECE_BYTES if name in ("ring", "tree") else None)
        abg, ab = sum(parts.values()), costmodel.predict_time(name, nbytes, 4, link)
        errors[name, mb] = ((abg - t) / t, (ab - t) / t)
        print(f"{name:>10} {mb:>2} MiB{t * 1e3:>8.1f} ms{abg * 1e3:>9.1f} ms ({errors[name, mb][0]:+4.0%})"
              f"{parts['start'] * 1e3:>8.2f} +{parts['messages'] * 1e3:>6.1f} +{(parts['gamma'] + parts['sharing'] + parts['copy']) * 1e3:>8.1f} ms"
              f"{ab * 1e3:>10.1f} ms ({errors[name, mb][1]:+4.0%})")
better = sum(abs(e[0]) < abs(e[1]) for e in errors.values())
print(f"(error = (model - measured) / measured) alpha-beta-gamma is the closer model in {better} of {len(errors)} cases")

# %% [markdown]
# How to read it: both models use constants measured seconds earlier in the same processes,
# so their errors compare fairly; the last line counts the cases each wins in this run. Your
# numbers move with the machine and its load, and a model of emulated ranks is never exact:
# a load burst during a collective is in its measurement and not in the model's inputs, and
# some costs are in no term (a tree adds each piece only once its send has left, where a ring
# step adds while the send goes on). What the columns show
# on any machine with fewer cores than ranks: the exchanges are the bulk of the time, and they
# cost more per byte than the ping-pong's β says, which is why the cluster model falls short.
#
# **What changes on a real network.** Each GPU has its own links, so $x(m)$ is one line, the
# link's $\alpha + m/\beta$; the addition runs on the GPU, overlapped with the next transfer, so
# γ all but disappears; nothing is shared, so σ = 1 and $x^+ = x$ (no rank waits for a core);
# and a call starts with a kernel launch, not a process wake-up. The α-β-γ model collapses into the α-β model of the table above, which is
# why the next section predicts a cluster with α-β alone.
#
# **Which model serves what in this course.** The α-β model predicts a cluster from its links'
# α and β (section 8 and the estimators of notebooks 05-11). The α-β-γ model explains, term by
# term, the collectives on this machine's emulated ranks. The planner of notebook 11 uses
# neither for the ranks it measures: it looks up a table of collective times measured on them,
# which needs no model of where the time goes.

# %% [markdown]
# ## 8. Predicting a real cluster
#
# Plug in published link figures (sources in `costmodel.CLUSTERS`'s comments): NVLink 3 on
# an A100 gives 600 GB/s in total, 300 GB/s each way; an HDR InfiniBand port carries
# 200 Gb/s = 25 GB/s each way; a collective step costs a few microseconds (NCCL's own tuning
# model charges 0.4–6.6 µs per ring step, by link and protocol). Bandwidths are the vendors'
# decimal GB/s (10⁹ bytes/s). Take the gradient of a GPT-2-small sized model (124 M
# parameters, fp32):
#
# *Predict first:* on 64 nodes over InfiniBand, roughly how much faster than a single
# parameter server is the ring for this gradient: 2×, 10× or 60×?
#
# <details><summary>Answer</summary>
#
# About 60×: both are bandwidth-bound here, and the server's link carries $2(N-1)S$ = 126 S
# against the ring's $\frac{2(N-1)}{N}S \approx 2S$: a ratio of $N = 64$, less a little for the
# ring's extra latency.
# </details>

# %%
GRAD = 124_000_000 * 4
print(f"gradient: {fmt_bytes(GRAD)}")
for cluster, n in (("A100 NVLink 3 (intra-node)", 8), ("HDR InfiniBand 200 Gb/s (inter-node)", 64)):
    net = costmodel.CLUSTERS[cluster]
    times = {name: costmodel.predict_time(name, GRAD, n, net) for name in ("ring", "rabenseifner", "tree", "ps")}
    print(f"{cluster}, N={n}: " + ", ".join(f"{k} {v * 1e3:,.1f} ms" for k, v in times.items())
          + f"  -> ring is {times['ps'] / times['ring']:.0f}x faster than the parameter server")
    assert costmodel.regime("ring", GRAD, n, net) == "bandwidth-bound"
    assert times["rabenseifner"] <= times["ring"] < times["tree"] < times["ps"]

ib = costmodel.CLUSTERS["HDR InfiniBand 200 Gb/s (inter-node)"]
for n in (8, 64, 1024):
    s_star = costmodel.crossover_bytes("tree", "ring", n, ib)
    print(f"HDR IB, N={n:>4}: recursive doubling beats the ring below {fmt_bytes(s_star)}, the ring wins above")
    assert costmodel.predict_time("tree", s_star / 2, n, ib) < costmodel.predict_time("ring", s_star / 2, n, ib)

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
sizes = [2.0**k for k in range(6, 33)]
for ax, (cluster, n) in zip(axes, (("A100 NVLink 3 (intra-node)", 8), ("HDR InfiniBand 200 Gb/s (inter-node)", 64))):
    net = costmodel.CLUSTERS[cluster]
    for name in ("ring", "tree", "rabenseifner", "ps"):  # the sharded PS would sit on the ring's line
        color, dashed = styles[name][0], "--" if name == "rabenseifner" else "-"
        ax.loglog(sizes, [costmodel.predict_time(name, s, n, net) for s in sizes], dashed, color=color, label=name)
    s_star = costmodel.crossover_bytes("tree", "ring", n, net)
    ax.axvspan(sizes[0], s_star, color="tab:green", alpha=0.08)
    # x in data coordinates, y as a fraction of the axes: labels stay clear of the curves
    ax.annotate("latency-bound:\ntree beats ring", (sizes[1], 0.55), xycoords=("data", "axes fraction"), fontsize=8)
    ax.annotate("bandwidth-bound:\nring beats tree", (s_star * 2, 0.04), xycoords=("data", "axes fraction"), fontsize=8)
    ax.axvline(GRAD, color="grey", ls="--", lw=0.8)
    ax.annotate("GPT-2 small\ngradient", (GRAD * 1.2, 0.25), xycoords=("data", "axes fraction"), fontsize=7,
                color="grey")
    ax.set_title(f"{cluster}, N = {n}", fontsize=9)
    ax.set_xlabel("bytes per rank S")
    ax.set_ylabel("predicted seconds")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 9. Parameter server, ring or tree: when each wins
#
# In the figures, recursive doubling wins the shaded latency-bound region against the ring,
# and Rabenseifner (dashed) is as fast as the ring for large tensors and far faster for small
# ones. The byte counts and the model make the comparison precise:
#
# * **Ring** (Patarasuk & Yuan 2009; Horovod, NCCL, PyTorch DDP): wins for **large tensors**,
#   the bandwidth-bound regime where gradients live. Per-rank traffic 2(N-1)/N·S is flat in N
#   and optimal. Its weakness is 2(N-1) sequential steps: latency grows linearly with N, and
#   one slow link slows the whole ring.
# * **Recursive doubling** (MPI libraries use it for small messages): only $\log_2 N$ steps,
#   but each carries the whole tensor. With $L = \log_2 N$ ($N$ a power of two) it beats the
#   ring when $L\alpha + LS/\beta < 2(N-1)\alpha + \frac{2(N-1)}{N}S/\beta$, that is below
#
#   $$S^* = \frac{(2(N-1) - L)\,\alpha\beta}{L - 2(N-1)/N},$$
#
#   which grows with $N$ and with $\alpha\beta$: many ranks and slow-to-start links favour it.
# * **Rabenseifner** (recursive halving, then doubling): the ring's bytes in $2\log_2 N$ steps
#   when $N$ is a power of two, so in the α-β model it is then never slower than the ring
#   (for other $N$ the fold-in adds $2S$ to a rank's traffic). Real rings still win often, because
#   the model gives every pair of ranks its own full-speed link: halving and doubling talk to
#   partners N/2, N/4, … ranks away, whose traffic shares links on a real network, while a
#   ring only ever uses neighbour links, which every topology has.
# * **NCCL's trees** are neither of these. Since version 2.4 NCCL can run an all-reduce over
#   **double binary trees** (Sanders, Speck & Träff 2009): two binary trees over the ranks,
#   built so that a rank that is an inner node in one tree is a leaf in the other. Each tree
#   reduces half of the data towards its root and broadcasts the result back down, in many
#   small pipelined chunks, so every rank sends and receives about as much as in a ring while
#   the latency grows with $\log_2 N$ instead of $N$. NCCL estimates each algorithm's time
#   per call with a model like ours (latency plus bytes over bandwidth, per algorithm and
#   protocol) and takes the fastest: trees across many nodes at small and medium sizes,
#   rings for large tensors.
# * **Parameter server**: in *synchronous* training a single server never wins: the same
#   number of steps as the ring and (N-1)·S through one link. A **sharded** parameter server
#   fixes that: with a server shard on each of the N ranks, every worker pushes each shard
#   its 1/N of the gradient and pulls the summed piece back, $\frac{2(N-1)}{N}S$ per worker,
#   the ring's traffic (measured in section 5): push is a reduce-scatter, pull an all-gather.
#   Parameter servers earn their place in *asynchronous* SGD (workers push and pull at their
#   own pace, stragglers do not stall anyone), *sparse* updates (a worker sends only the
#   embedding rows it touched), and elastic clusters where workers come and go.

# ## Summary
#
# * All-reduce = reduce-scatter + all-gather; every collective is a schedule of send/recv.
# * Bytes per rank, traced and asserted: ring, Rabenseifner and sharded parameter server
#   2(N-1)/N·S, reduce-scatter and all-gather (N-1)/N·S each, single parameter server (N-1)·S
#   through the server, recursive doubling log2 N·S.
# * The α-β model: T = (sequential messages)·α + (bytes on the busiest link)/β. Small
#   tensors are latency-bound (fewer steps win: tree), large ones bandwidth-bound (fewer
#   bytes per link win: ring).
# * Ranks sharing a machine's cores are not a cluster: each step costs a measured exchange
#   $x(m)$ (dearer after an add, $x^+(m)$, when ranks share cores), every byte added costs γ,
#   more ranks than cores share the memory (σ), and a rank waits $t_0$ for a partner that
#   arrives on its own time: each new partner when ranks share cores, each exchange after an
#   add when they do not. The α-β-γ model adds these up; on a
#   real network it falls back to α-β.
#
# ## Self-check
#
# 1. 16 ranks all-reduce a 1 GiB gradient with a ring. How many bytes does each rank send,
#    and how many sequential messages are on the critical path?
# 2. Why does a ring all-reduce of a tensor smaller than N elements still work, and which
#    ranks send nothing in some steps?
# 3. α = 5 µs, β = 25 GB/s, N = 64. Below which size does recursive doubling beat the ring?
# 4. A sharded parameter server and a ring move the same bytes. Name one thing the parameter
#    server design can do that a ring cannot.
# 5. In the α-β model, for N a power of two, Rabenseifner is never slower than the ring. Give
#    one reason NCCL still uses rings.
# 6. On 4 emulated ranks sharing 2 cores, which term of the α-β-γ model would you expect to
#    vanish if each rank had a core of its own, and which would stay?
#
# <details><summary>Answers</summary>
#
# 1. $\frac{2 \cdot 15}{16}$ GiB = 1.875 GiB, in $2 \cdot 15 = 30$ sequential steps.
# 2. Chunks follow `tensor_split`: the first chunks hold one element each and the rest are
#    empty; a rank whose chunk for that step is empty sends nothing (and its neighbour expects
#    nothing).
# 3. $L = 6$: $S^* = (126 - 6) \cdot 5\,\mu s \cdot 25\cdot10^9\,\text{B/s} / (6 - 126/64)$
#    ≈ 3.7·10⁶ bytes, about 3.5 MiB (section 8 prints it).
# 4. Asynchronous updates (workers do not wait for each other), sparse pushes of only the
#    rows a worker touched, workers joining and leaving.
# 5. The model gives every pair of ranks its own full-speed link; halving-doubling sends to
#    distant ranks whose messages share links on a real network, while a ring uses only
#    neighbour links.
# 6. σ becomes 1 (no rank waits for another's copies on a shared core), and a new partner no
#    longer costs a wait (it is running, not waiting for a core). The exchanges $x(m)$, γ and
#    the waits $t_0$ after adds stay, though smaller: the bytes still cross the kernel's socket
#    buffers and are still added by the CPU, and a partner that is adding still arrives when
#    its add is done.
# </details>

# %% [markdown]
# ## References
#
# What this notebook relies on:
#
# * Dean et al. (2012). *Large Scale Distributed Deep Networks*, NeurIPS 2012, and Li et al.
#   (2014). *Scaling Distributed Machine Learning with the Parameter Server*, OSDI 2014: the
#   parameter server of section 2 and its uses (asynchronous and sparse updates, section 9).
# * Patarasuk & Yuan (2009). *Bandwidth optimal all-reduce algorithms for clusters of
#   workstations*, Journal of Parallel and Distributed Computing 69(2): the lower bound of
#   section 5 and the ring that meets it.
# * Gibiansky (2017). *Bringing HPC Techniques to Deep Learning*, Baidu Research blog, and
#   Sergeev & Del Balso (2018). *Horovod: fast and easy distributed deep learning in
#   TensorFlow*, arXiv:1802.05799: the ring all-reduce brought to gradient averaging.
# * Rabenseifner (2004). *Optimization of Collective Reduction Operations*, ICCS 2004 (LNCS
#   3036), and Thakur, Rabenseifner & Gropp (2005). *Optimization of Collective Communication
#   Operations in MPICH*, International Journal of High Performance Computing Applications
#   19(1): recursive halving and doubling, recursive doubling with the fold-in for $N$ not a
#   power of two, and their α-β costs (sections 4 and 7).
# * Hockney (1994). *The communication challenge for MPP: Intel Paragon and Meiko CS-2*,
#   Parallel Computing 20(3): the model $T(S) = \alpha + S/\beta$ of section 7.
# * Thakur, Rabenseifner & Gropp (2005), above, and Chan, Heimlich, Purkayastha & van de Geijn
#   (2007), below: the γ per reduced byte of section 7's α-β-γ model.
# * Sanders, Speck & Träff (2009). *Two-tree algorithms for full bandwidth broadcast, reduction
#   and scan*, Parallel Computing, and Jeaugey (2019). *Massively Scale Your Deep Learning
#   Training with NCCL 2.4*, NVIDIA Technical Blog: the double binary trees of section 9.
#
# Further reading:
#
# * Chan, Heimlich, Purkayastha & van de Geijn (2007). *Collective communication: theory,
#   practice, and experience*, Concurrency and Computation: Practice and Experience 19(13):
#   lower bounds and costs for every collective in the α-β model plus a γ per reduced byte,
#   and how to combine algorithms; the place to go after this notebook.
# * Thakur, Rabenseifner & Gropp (2005): short and practical, which algorithm a real MPI
#   library picks at which message size, and why.
# * NVIDIA, [nccl-tests, *doc/PERFORMANCE.md*](https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
#   how to read the algorithm and bus bandwidths of a collective benchmark on a real cluster.
#
# **Next: exercise 02** (`exercises/ex02_ring_all_reduce.ipynb`): write the ring yourself.
# Then notebook 03 uses all-reduce for data parallelism, and later notebooks use
# reduce-scatter/all-gather (ZeRO, FSDP) and all-to-all (experts).
