# %% [markdown]
# [**Open in Colab**](https://colab.research.google.com/github/OWNER/distributed-training-from-first-principles/blob/v0.1.0/exercises/ex09_context_parallel.ipynb)

# %% [markdown]
# # Exercise 09: merging partial attention, and balancing causal work
#
# **Goal.** Write the two pieces of arithmetic that context parallelism rests on, in
# `exercises/ex09_context_parallel/student.py` (notebook `09_context_parallelism` explains the
# ideas; re-read its sections on the online-softmax merge and on the causal imbalance):
#
# 1. `merge_rows(out, lse, part_out, part_lse, rows)`: in ring attention a rank's queries meet
#    the keys one block at a time, as the blocks arrive round the ring. Each block gives a
#    *partial* result: the attention output over that block's keys and the log-sum-exp `lse`
#    of their scores. Under a causal mask some of the rank's queries see none of a block's keys,
#    so a ring that wastes no work attends the block with the other queries only: the partial
#    holds only some of the rank's rows. You merge it into the rank's running result, so that
#    after the last block the rank holds exact attention over the whole sequence, without ever
#    holding all the keys.
# 2. `zigzag_positions(T, cp, rank)`: which positions of a sequence of T tokens a rank holds,
#    for any T, also one that does not split into 2cp equal chunks (a 1000-token document on
#    cp = 6). Under a causal mask a query late in the sequence scores more keys than an early
#    one, so cutting the sequence into cp contiguous pieces gives the last rank far more work
#    than the first, and every ring step waits for the slowest rank.
#
# The stubs' docstrings state the requirements; how you meet them is up to you.

# %% [markdown]
# ## A worked example: two blocks by hand
#
# One query, three keys. Block a holds two keys with scaled scores 0 and 0 and values 1 and 3;
# block b holds one key with score ln 6 and value 8. Each block alone gives a partial result:
# `out_a = 2` (the mean of 1 and 3) with `lse_a = ln(e⁰ + e⁰) = ln 2`, and `out_b = 8` with
# `lse_b = ln 6`.
#
# **Predict** attention over all three keys: its output and its lse. What does the average of
# `out_a` and `out_b` give instead, and which weight does each block really deserve?
#
# <details><summary>Answer</summary>
#
# The softmax weights over the three keys are 1/8, 1/8 and 6/8 (e⁰, e⁰, 6 over their sum 8),
# so `out = (1 + 3 + 6·8)/8 = 6.5` and `lse = ln 8 ≈ 2.079`. The average gives 5: it weighs
# block b's single key like block a's two. Block a's share of the whole softmax denominator
# is 2/8, block b's 6/8: each block's `exp(lse)` is its part of the denominator.
# </details>

# %%
# Google Colab only (elsewhere this cell does nothing): fetch the course at its pinned revision, set it up
import os, subprocess, sys
if "google.colab" in sys.modules:
    home = os.environ.get("COURSE_COLAB_HOME", "/content/course")
    if not os.path.isdir(home):
        subprocess.run(["git", "clone", "-q", os.environ.get("COURSE_COLAB_REPO", "https://github.com/OWNER/distributed-training-from-first-principles"), home], check=True)
        subprocess.run(["git", "-C", home, "checkout", "-q", "v0.1.0"], check=True)
    sys.path.insert(0, home); from course_lib.colab import arrive; arrive(home, "exercises")

# %%
import torch

from course_lib.grading import ex09_context_parallel as checks
from course_lib.grading import load_student

# Your module may not import the library's context parallelism (checks.REFUSE lists it):
# the checks must pass on your own code.
student = load_student("ex09_context_parallel", refuse=checks.REFUSE)

scores = torch.tensor([0.0, 0.0, torch.log(torch.tensor(6.0)).item()])
values = torch.tensor([1.0, 3.0, 8.0])
weights = torch.softmax(scores, dim=0)
print("softmax weights over all three keys:", [round(w, 4) for w in weights.tolist()])
print(f"attention over all three keys: out = {(weights @ values).item():.4f}, "
      f"lse = {torch.logsumexp(scores, dim=0).item():.4f}")
for name, keys in (("a", [0, 1]), ("b", [2])):
    w = torch.softmax(scores[keys], dim=0)
    print(f"block {name} alone: out_{name} = {(w @ values[keys]).item():.4f}, "
          f"lse_{name} = {torch.logsumexp(scores[keys], dim=0).item():.4f}")

# %% [markdown]
# ## A worked example: the causal work of contiguous chunks
#
# A sequence of T = 16 tokens on cp = 4 ranks, cut into 4 contiguous pieces: rank r holds
# positions 4r ... 4r+3. Under the causal mask the query at position p scores the p + 1 keys
# at positions 0 ... p.
#
# **Predict** how many (query, key) pairs each rank scores, and how many each rank would score
# if the work were shared equally.
#
# <details><summary>Answer</summary>
#
# Rank r's queries score (4r+1) + (4r+2) + (4r+3) + (4r+4) = 16r + 10 pairs: 10, 26, 42 and 58.
# The whole causal triangle has 16·17/2 = 136 pairs, so an equal share is 34 per rank. The last
# rank does 5.8 times the first rank's work, and in a ring every step waits for it.
# </details>

# %%
T, CP = 16, 4
pieces = [list(range(r * T // CP, (r + 1) * T // CP)) for r in range(CP)]
pairs = [sum(1 for q in queries for k in range(T) if k <= q) for queries in pieces]  # counted one by one
print("contiguous pieces:", pieces)
print("causal (query, key) pairs per rank:", pairs, "| equal share:", T * (T + 1) // 2 // CP)
assert pairs == [16 * r + 10 for r in range(CP)]  # the formula of the answer above

# %% [markdown]
# ## The tasks
#
# **Task 1: `merge_rows`.** The running result `out` (B, H, s, hd), `lse` (B, H, s) holds one
# row per query of the rank; the partial `part_out` (B, H, k, hd), `part_lse` (B, H, k) holds
# the k rows whose indices `rows` lists. Return the whole running result with the partial
# merged in. The docstring in `student.py` states what must hold; think about what a row the
# partial does not hold, or a row in which one side has seen no key yet, should give.
#
# **Task 2: `zigzag_positions`.** Every position held once, at most two contiguous runs per
# rank, the ranks in sequence order, token counts within one of each other, and causal work
# within less than one late token's worth (T pairs) of each other. When 2cp divides T the
# answer is notebook 09's; when it does not, you decide where the leftover tokens go. The
# second worked example tells you how much work each position costs.
#
# **How grading works.** Each check cell prints `PASS  ...` when your code is right and raises
# `CheckFailed` (or your own error) when it is not. Your merge is checked on rows worked out by
# hand, then on attention split into key sets and compared with attention over all keys in one
# go; your layout is checked for every cp from 1 to 8 on several lengths by counting each rank's
# work; finally both run together on 2 and 3 real ranks, which pass their key and value blocks
# round a ring and merge with your function, against single-process causal attention. Edit
# `student.py`, then *Kernel → Restart and run all*.

# %% [markdown]
# ## Check 1: the merge, by hand
# The worked example (and the same two parts in the other order); a running result of four
# rows and a partial that holds rows 1, 2 and 3, where row 1 has seen no key yet, row 2 has
# equal lse on both sides (predict its answer) and the partial saw no key for row 3; a row where
# neither side has seen a key; and lse values of 100 and 101.

# %%
checks.check_merge_by_hand(student)

# %% [markdown]
# ## Check 2: merged blocks equal attention over all keys
# Causal attention of 11 queries (2 sequences, 3 heads), the keys split into two sets that are
# not contiguous, then into three sets, each merged in turn from an empty start (`out = 0`,
# `lse = -inf`), latest keys first. Each set's partial holds only the queries that see one of
# its keys. Both must equal attention over all keys computed in one go.

# %%
checks.check_merge_blocks(student)

# %% [markdown]
# ## Check 3: the layout
# For cp = 1 ... 8 and T = 6cp, 6cp + 1, 7cp + 1 and 8cp - 1: every position held once, at
# most two runs per rank, in rank order; the tokens per rank; each rank's causal
# (query, key) pairs, counted one by one.

# %%
checks.check_layout(student)

# %% [markdown]
# ## Check 4: ring attention on real ranks
# cp = 2 and cp = 3 ranks, sequences of 23 and 33 tokens (2 sequences, 2 heads). Each rank
# keeps the queries, keys and values of your positions. At each of cp steps it sends the key
# and value block it holds to the next rank while the queries that see one of that block's
# keys attend to it, and merges the partial into its running result with your `merge_rows`.
# Compared: every rank's output rows and lse against single-process causal attention, and the
# pairs each rank scored, counted on the ranks.

# %%
checks.check_ring(student)

# %% [markdown]
# All checks passed? Then you have written the arithmetic of ring attention (Liu et al. 2023)
# and the load balancing Llama 3 uses for context parallelism (Dubey et al. 2024, §3.3.2).
# Having written it, compare with the library's version in `course_lib/parallel/cp/`:
# `merge_partials` and `block_attention` in `blocks.py`, `chunk_ids` and `attention_work` (the
# work per rank in closed form) in `layout.py`, and `ring.py`, whose forward is the loop of
# check 4 and whose backward is a second ring. The library asks for sequences that 2cp divides;
# yours need not. Notebook 09 times that ring and sets it beside all-gather and Ulysses.
#
# Two questions to take back to notebook 09:
#
# * When 2cp divides T, zig-zag chunks give every rank the same number of pairs over the whole
#   ring. Does each ring *step* also cost the same on every rank, counting only the visible
#   pairs of the block it holds? Try rank 0 and rank 1 at step 1 of cp = 2.
# * Your merge is exact in any order. Why does the ring still merge its own block first?
#
# <details><summary>Answers</summary>
#
# * Yes (c tokens per chunk): at step 0 every rank scores c² + c(c+1) pairs of its own block, and
#   at every later step half of the block it holds, 2c² of its (2c)² pairs. At cp = 2, step 1, rank 0's chunk 0 sees none of rank 1's keys (chunks 1
#   and 2) and its chunk 3 sees all of them; rank 1's two chunks see all of chunk 0 and none of
#   chunk 3. In general, a block from an earlier rank s < r is visible through its chunk s to both
#   of rank r's chunks; one from a later rank is visible whole to rank r's late chunk only. A ring
#   that skips the masked part of each block (the library's does) stays balanced step by step.
# * It needs no communication: the rank computes its own block while the first exchange is in
#   flight, so the send of step 1 overlaps the compute of step 0.
# </details>
#
# ## References
#
# * Milakov, M. and Gimelshein, N. (2018). *Online normalizer calculation for softmax.*
# * Dao, T. et al. (2022). *FlashAttention: fast and memory-efficient exact attention with IO-awareness.*
# * Liu, H., Zaharia, M. and Abbeel, P. (2023). *Ring attention with blockwise transformers for near-infinite context.*
# * Dubey, A. et al. (2024). *The Llama 3 herd of models*, §3.3.2 (context parallelism, 2·cp chunks).
