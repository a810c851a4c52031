# %% [markdown]
# # 02 · Collectives and ring all-reduce
#
# Data parallelism (notebook 03) needs one thing from the network: after every backward pass,
# each of the `N` ranks must hold the **average gradient** $g = \frac{1}{N}\sum_i g_i$ of all
# ranks. That is an **all-reduce** (sum, then divide by `N`). How the bytes travel to make it
# happen decides whether adding GPUs speeds training up or just adds waiting.
#
# In this notebook we build the collectives ourselves, from nothing but point-to-point
# `send`/`recv`, in `course_lib/comm/collectives.py` (read it: every algorithm is a few lines):
#
# 1. the **parameter server**: everyone sends to one rank, it adds, it sends back;
# 2. the **ring all-reduce** (a reduce-scatter, then an all-gather), stepped through chunk by chunk;
# 3. **recursive doubling** (a tree-shaped all-reduce), for any number of ranks;
# 4. **bytes per rank** measured with the tracer, asserted against the formulas, and plotted
#    against `N`: the picture that explains why rings won;
# 5. the **α-β cost model**, fitted to ping-pong measured on this machine, checked against
#    the real collectives, then used to predict a real GPU cluster;
# 6. when a parameter server, a ring or a tree wins.
#
# Every implementation is checked against the `torch.distributed` built-in on real ranks.

# %%
%matplotlib inline
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

from course_lib import CommTracer, format_summary, merge_summaries, run_on_ranks
from course_lib import comm
from course_lib.comm import costmodel, ringviz

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
# its tensor, add them up there, send the sum back. It is the data-parallel recipe of the
# cluster-architecture article (workers send gradients to a master node, which averages them
# and sends the result back), and the design the source articles contrast with all-reduce.
# `comm.ps_all_reduce` does exactly that. Let us run it on 4 ranks, check it against `dist.all_reduce`, and count
# its bytes.

# %%
def traced_all_reduce(algorithm, numel=NUMEL):
    """Rank code: run one course all-reduce on a random float32 tensor, check it against
    the built-in, and return this rank's traced summary."""
    x = torch.randn(numel)
    expected = x.clone()
    dist.all_reduce(expected)
    with CommTracer() as tracer:
        comm.ALL_REDUCE_ALGORITHMS[algorithm](x)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)
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
# while the workers move S. With 64 workers and a 1 GB gradient, the server has to receive
# 63 GB and send 63 GB every step, all through its one network port, while the other ports
# idle. Adding workers makes the server's job longer: the parameter server does not scale.
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
    """Rank code: ring/tree/ps vs dist.all_reduce for several dtypes and sizes."""
    n, rows = dist.get_world_size(), []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        for numel in sizes:
            x = (torch.randint(-100, 100, (numel,)) if dtype == torch.int64 else torch.randn(numel)).to(dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            bound = x.abs().double()
            dist.all_reduce(bound)
            tol = 2 * (n - 1) * (torch.finfo(dtype).eps if dtype.is_floating_point else 0) * bound
            for name, fn in comm.ALL_REDUCE_ALGORITHMS.items():
                y = fn(x.clone())
                ok = bool(((y.double() - expected.double()).abs() <= tol).all())
                rows.append((str(dtype).replace("torch.", ""), numel, name, ok))
    return rows

results = run_on_ranks(check_dtypes, world_size=5)
assert all(ok for rows in results for *_, ok in rows)
print("N=5; sizes 3 (< N), 11 (N does not divide it), 40:")
for dtype in ("float32", "float64", "bfloat16", "int64"):
    print(f"  {dtype:<9} ring, tree, ps == dist.all_reduce on every rank: "
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
# rank *tends to 2S, whatever N is*. The tracer must agree to the byte:

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
# price: every message carries the *whole* tensor, S bytes, not S/N.
#
# When N is not a power of two, let p be the largest power of two below N. The N-p extra
# ranks first hand their tensor to a partner among the first p (which adds it), wait out the
# butterfly, and get the answer back at the end: two more steps. On 6 ranks (p = 4):

# %%
sent = totals(run_on_ranks(traced_all_reduce, "tree", world_size=6), "bytes_sent")
for r in range(6):
    role = "folds into a core rank, then waits" if r >= 4 else (
        "core rank, also serves extra rank " + str(r + 4) if r < 2 else "core rank")
    print(f"rank {r}: sent {sent[r]:>6,} B = {sent[r] // S}·S   ({role})")
assert sent == [comm.theory_bytes_sent("tree", S, 6, rank=r) for r in range(6)]
assert sent == [3 * S, 3 * S, 2 * S, 2 * S, S, S]  # log2(4) = 2 rounds, + S for the fold-in partners

# %% [markdown]
# ## 5. Why rings won: bytes per rank against N
#
# Now run all three all-reduces on every world size from 2 to 8, trace them, assert every
# rank's bytes equal the formula, and plot the busiest rank's traffic (dots: measured here;
# lines: the formulas, extended to 64 ranks).

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
print("  N  " + "".join(f"{name:>8}" for name in comm.ALL_REDUCE_ALGORITHMS))
for n in range(2, 9):
    print(f"{n:>3}  " + "".join(f"{measured[name, n] / S:>8.3f}" for name in comm.ALL_REDUCE_ALGORITHMS))

# %%
ns = list(range(2, 65))
fig, ax = plt.subplots(figsize=(7, 4))
styles = {"ring": ("tab:blue", "ring: 2(N-1)/N·S"), "tree": ("tab:green", "recursive doubling: ⌊log2 N⌋·S (+S)"),
          "ps": ("tab:red", "parameter server: (N-1)·S at the server")}
for name, (color, label) in styles.items():
    ax.plot(ns, [comm.theory_bytes_sent(name, 1, n) for n in ns], color=color, label=label)
    ax.plot(range(2, 9), [measured[name, n] / S for n in range(2, 9)], "o", color=color)
ax.set_yscale("log")
ax.set_xlabel("ranks N")
ax.set_ylabel("bytes sent by the busiest rank / S")
ax.set_title("Per-rank traffic of one all-reduce (dots: traced here, N = 2..8)")
ax.legend()
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# The ring line flattens at 2: a ring of 1,000 GPUs moves barely more bytes per GPU than a
# ring of 4. The parameter server's line climbs linearly, and recursive doubling's climbs
# with log N. Since large gradients are limited by bandwidth, not latency, this flat line is
# the reason Baidu's 2017 ring all-reduce, then Horovod (2018) and NCCL, replaced parameter
# servers for synchronous data-parallel training. (Ring all-reduce is *bandwidth-optimal*:
# any all-reduce must send at least $\frac{N-1}{N}S$ out of each rank for the reduction and
# as much again for the distribution.)

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
# classic model: one message of S bytes takes
#
# $$t(S) = \alpha + S\,\beta$$
#
# where **α** is the latency (the fixed cost of a message: software, wake-ups, the wire) and
# **β** the inverse bandwidth (seconds per byte). A collective is a schedule of messages, so
# its time is (messages one after another)·α + (bytes through the busiest link)·β:
#
# | algorithm | predicted time |
# |---|---|
# | ring all-reduce | $2(N-1)\,\alpha + \frac{2(N-1)}{N} S\beta$ |
# | reduce-scatter, all-gather | $(N-1)\,\alpha + \frac{N-1}{N} S\beta$ |
# | recursive doubling | $L(\alpha + S\beta)$, $L = \log_2 p + 2[N \ne p]$ |
# | parameter server | $2(N-1)(\alpha + S\beta)$: N-1 receives, then N-1 sends, through one link |
#
# (`course_lib.comm.costmodel.cost_terms`; the adds themselves are left out, on GPUs they hide
# under the transfers.) First we measure α and β on this machine with a **ping-pong**: two
# ranks bounce a message of each size back and forth, and half the fastest round trip is
# $t(S)$. Emulated ranks share this machine's few CPU cores, so we let every pair of ranks
# ping-pong at the same time (`all_pairs=True`): the link is measured under the load a
# collective puts on it. Then a least-squares fit (weighted by 1/t, so small messages pin α
# and large ones pin β).

# %% tags=["nbval-ignore-output"]
SIZES_PP = [8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24]
one_way = run_on_ranks(costmodel.ping_pong, SIZES_PP, all_pairs=True, world_size=4, check_collectives=False)[0]
link = costmodel.fit_alpha_beta(SIZES_PP, one_way, name="this machine (gloo, loopback)")
print(f"fitted: alpha = {link.alpha * 1e6:.0f} us per message, beta = 1/({link.bandwidth / 1e9:.2f} GB/s)")
for size, t in zip(SIZES_PP, one_way):
    print(f"  {size:>9,} B: measured {t * 1e6:9.1f} us, model {link.message_time(size) * 1e6:9.1f} us")

# %%
assert link.alpha >= 0 and link.beta > 0  # fit_alpha_beta raises if the data make no sense
fig, ax = plt.subplots(figsize=(6, 3.5))
xs = [2**k for k in range(3, 25)]
ax.loglog(SIZES_PP, [t * 1e6 for t in one_way], "o", label="ping-pong (one way)")
ax.loglog(xs, [link.message_time(x) * 1e6 for x in xs], "-", label="fit α + Sβ")
ax.axvline(link.alpha / link.beta, color="grey", ls=":", label="S = α/β: latency = transfer")
ax.set_xlabel("message size S (bytes)")
ax.set_ylabel("time (µs)")
ax.legend()
ax.grid(alpha=0.3, which="both")
plt.show()

# %% [markdown]
# Below $S = \alpha/\beta$ (the dotted line) a message costs about α whatever its size:
# that is the **latency-bound** regime. Above it, time grows with S: **bandwidth-bound**.
#
# Now time the three all-reduces (and gloo's own, for reference) on 4 ranks from 4 KB to
# 16 MB, and put the model's predictions next to them.

# %% tags=["nbval-ignore-output"]
SIZES = [1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24]
ALGOS = {**comm.ALL_REDUCE_ALGORITHMS, "gloo built-in": lambda t: dist.all_reduce(t)}

def time_all(sizes):
    return {(name, s): costmodel.time_collective(fn, s, iters=5) for s in sizes for name, fn in ALGOS.items()}

timed = run_on_ranks(time_all, SIZES, world_size=4, check_collectives=False)[0]
print(f"{'size':>10}" + "".join(f"{name:>22}" for name in comm.ALL_REDUCE_ALGORITHMS) + f"{'gloo built-in':>15}")
for s in SIZES:
    cells = "".join(f"{timed[name, s] * 1e3:9.2f} ms (x{timed[name, s] / costmodel.predict_time(name, s, 4, link):5.1f})"
                    for name in comm.ALL_REDUCE_ALGORITHMS)
    print(f"{s:>10,}" + cells + f"{timed['gloo built-in', s] * 1e3:12.2f} ms")
print("(x = measured / predicted)")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
grid = [2**k for k in range(10, 25)]
for name, (color, _) in styles.items():
    ax.loglog(grid, [costmodel.predict_time(name, s, 4, link) * 1e3 for s in grid], "-", color=color,
              label=f"{name}: model")
    ax.loglog(SIZES, [timed[name, s] * 1e3 for s in SIZES], "o", color=color, label=f"{name}: measured")
ax.loglog(SIZES, [timed["gloo built-in", s] * 1e3 for s in SIZES], "k^", label="gloo built-in")
ax.axvline(4 * link.alpha / link.beta, color="tab:blue", ls=":", label="ring: α terms = β terms")
ax.set_xlabel("tensor size S (bytes)")
ax.set_ylabel("time per all-reduce (ms)")
ax.set_title("4 ranks on this machine: α-β model (lines) vs measurement (markers)")
ax.legend(fontsize=7, ncol=2)
ax.grid(alpha=0.3, which="both")
plt.show()
# Loose sanity only (timings on a shared machine are noisy): every algorithm takes longer on
# 16 MB than on 4 KB, and at 16 MB the model is within about an order of magnitude.
for name in comm.ALL_REDUCE_ALGORITHMS:
    assert timed[name, SIZES[-1]] > timed[name, SIZES[0]], name
ratio = timed["ring", SIZES[-1]] / costmodel.predict_time("ring", SIZES[-1], 4, link)
assert 0.1 < ratio < 30, ratio

# %% [markdown]
# How to read it (your numbers vary with the machine and its load; the stored run had 4
# ranks on 2 shared CPU cores):
#
# * **The shape is right.** Every algorithm costs a roughly constant time for small tensors
#   (latency-bound) and a time growing with S for large ones (bandwidth-bound). For the ring
#   the two terms are equal at $S^* = N\alpha/\beta$ (dotted line): below it, cutting steps
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
print("N=4, in units of S:        " + "".join(f"{name:>7}" for name in total))
print("bytes sent by busiest rank " + "".join(f"{busiest[n]:>7.1f}" for n in total) + "   <- decides on a cluster")
print("bytes sent by all ranks    " + "".join(f"{total[n]:>7.1f}" for n in total) + "   <- decides on one shared machine")
assert total["ring"] == total["ps"] == 2 * (4 - 1) and total["tree"] == 4 * 2

# %% [markdown]
# ## 8. Predicting a real cluster
#
# Plug in published link figures (sources in `costmodel.CLUSTERS`'s comments): NVLink 3 on
# an A100 gives 600 GB/s in total, 300 GB/s each way; an HDR InfiniBand port carries
# 200 Gb/s = 25 GB/s each way; a collective step costs a few microseconds (NCCL's own tuning
# model charges 0.4–6.6 µs per ring step, by link and protocol). Take the gradient of a GPT-2-small
# sized model (124 M parameters, fp32: 496 MB):

# %%
GRAD = 124_000_000 * 4
for cluster, n in (("A100 NVLink 3 (intra-node)", 8), ("HDR InfiniBand 200 Gb/s (inter-node)", 64)):
    net = costmodel.CLUSTERS[cluster]
    times = {name: costmodel.predict_time(name, GRAD, n, net) for name in ("ring", "tree", "ps")}
    print(f"{cluster}, N={n}: " + ", ".join(f"{k} {v * 1e3:,.1f} ms" for k, v in times.items())
          + f"  -> ring is {times['ps'] / times['ring']:.0f}x faster than the parameter server")
    assert costmodel.regime("ring", GRAD, n, net) == "bandwidth-bound"
    assert times["ring"] < times["tree"] < times["ps"]

ib = costmodel.CLUSTERS["HDR InfiniBand 200 Gb/s (inter-node)"]
for n in (8, 64, 1024):
    s_star = costmodel.crossover_bytes("tree", "ring", n, ib)
    print(f"HDR IB, N={n:>4}: recursive doubling beats the ring below {s_star / 1e3:,.0f} KB, the ring wins above")
    assert costmodel.predict_time("tree", s_star / 2, n, ib) < costmodel.predict_time("ring", s_star / 2, n, ib)

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
sizes = [2.0**k for k in range(6, 33)]
for ax, (cluster, n) in zip(axes, (("A100 NVLink 3 (intra-node)", 8), ("HDR InfiniBand 200 Gb/s (inter-node)", 64))):
    net = costmodel.CLUSTERS[cluster]
    for name, (color, _) in styles.items():
        ax.loglog(sizes, [costmodel.predict_time(name, s, n, net) for s in sizes], color=color, label=name)
    s_star = costmodel.crossover_bytes("tree", "ring", n, net)
    ax.axvspan(sizes[0], s_star, color="tab:green", alpha=0.08)
    # x in data coordinates, y as a fraction of the axes: labels stay clear of the curves
    ax.annotate("latency-bound:\ntree wins", (sizes[1], 0.55), xycoords=("data", "axes fraction"), fontsize=8)
    ax.annotate("bandwidth-bound:\nring wins", (s_star * 2, 0.04), xycoords=("data", "axes fraction"), fontsize=8)
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
# The source articles set the parameter server (traditional, everything goes through one
# node) against all-reduce (every node takes an equal part, no single bottleneck), and list
# Horovod among the data-parallel frameworks: Horovod is what made the ring the default. The
# byte counts and the model above make the comparison precise:
#
# * **Ring** (Horovod, NCCL, PyTorch DDP): wins for **large tensors**, the bandwidth-bound
#   regime where gradients live. Per-rank traffic 2(N-1)/N·S is flat in N and optimal. Its
#   weakness is 2(N-1) sequential steps: latency grows linearly with N, and one slow link
#   slows the whole ring.
# * **Tree / recursive doubling** (MPI for small messages; NCCL's double binary trees across
#   nodes): wins for **small tensors or very many ranks**, the latency-bound regime, with
#   only ~log2 N steps. Full-size messages make it lose once bandwidth dominates.
# * **Parameter server**: in *synchronous* training with one server it never wins: same
#   number of steps as the ring and (N-1)·S through one link. It earns its place elsewhere:
#   *asynchronous* SGD (workers push and pull at their own pace, stragglers do not stall
#   anyone), *sparse* updates (a worker sends only the embedding rows it touched), and
#   heterogeneous or elastic clusters where workers come and go. A PS **sharded** across N
#   servers (each owns 1/N of the parameters) moves the same (N-1)/N·S per rank as a
#   reduce-scatter plus all-gather: the bottleneck was the single server, not the idea.
#
# Real libraries switch between algorithms by size and topology (NCCL picks ring or tree
# per call from a cost model like ours), and use rings *within* a node over NVLink and trees
# or rings of nodes *across* InfiniBand.

# %% [markdown]
# ## Summary
#
# * All-reduce = reduce-scatter + all-gather; every collective is a schedule of send/recv.
# * Bytes per rank, traced and asserted: ring 2(N-1)/N·S, reduce-scatter and all-gather
#   (N-1)/N·S each, parameter server (N-1)·S through the server, recursive doubling log2 N·S.
# * The α-β model: time = (sequential messages)·α + (bytes on the busiest link)·β. Small
#   tensors are latency-bound (fewer steps win: tree), large ones bandwidth-bound (fewer
#   bytes per link win: ring).
# * Next: **exercise 02** (`exercises/ex02_ring_all_reduce.ipynb`): write the ring yourself.
#   Then notebook 03 uses all-reduce for data parallelism, and later notebooks use
#   reduce-scatter/all-gather (ZeRO, FSDP) and all-to-all (experts).
