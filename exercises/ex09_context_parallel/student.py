"""Exercise 09: the two pieces of arithmetic a context-parallel ring rests on. Fill in the two
functions, then run the check cells of ex09_context_parallel.ipynb. Each check prints PASS
when your code is right.

The set-up (notebook 09):
  * attention of queries against a set of keys, with a causal mask by absolute position (a key
    is visible to a query when its position is <= the query's), gives per query row a pair
    (out, lse): the softmax-weighted values and the log-sum-exp of the visible keys' scaled
    scores. A query with no visible key in the set has lse = -inf and out = 0;
  * in ring attention a rank receives the keys and values block by block; a block whose keys
    some of the rank's queries cannot see is attended by the other queries only, so its partial
    result holds only those query rows;
  * each of the cp ranks holds a part of the sequence's T positions.
"""

import math  # noqa: F401  (you may need these)

import torch


def merge_rows(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor,
               rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The running result (out, lse) of a rank's s query rows, with the partial result of some of
    those rows over a new, disjoint set of keys merged in.

    out (B, H, s, hd), lse (B, H, s): attention over the keys seen so far (a row that has seen no
    key yet: lse = -inf, out = 0). part_out (B, H, k, hd), part_lse (B, H, k): attention of the
    rows `rows` over the new keys; rows (k,) is a LongTensor of distinct indices into the s rows,
    in increasing order. Returns (out, lse), shapes (B, H, s, hd) and (B, H, s): every row of the
    running result, now over all the keys seen. Rows not in `rows` are unchanged.
    Example (s = k = 1, hd = 1): running (out 2, lse log 2), partial (out 8, lse log 6) ->
    (6.5, log 8): notebook 09's worked example.
    Requirements: exact for any lse (lse = 100 must work in fp32); a row with no visible key on
    one side takes the other side's values; a row with no visible key on either side stays
    out = 0, lse = -inf, never NaN.
    """
    raise NotImplementedError("exercise 09: write merge_rows")


def zigzag_positions(T: int, cp: int, rank: int) -> list[int]:
    """The sequence positions (0 ... T-1) that `rank` of `cp` holds, in increasing order, for ANY
    T >= 2cp (2cp need not divide T).

    Requirements: every position is held by exactly one rank; a rank's positions form at most
    two contiguous runs; rank r's first run comes before rank r+1's; every rank holds T//cp
    tokens or one more; under a causal mask (the query at position p scores the p + 1 keys
    0 ... p) the busiest rank scores fewer than T more (query, key) pairs than the least busy.
    Example: T = 6, cp = 1 -> [0, 1, 2, 3, 4, 5].
    """
    raise NotImplementedError("exercise 09: write zigzag_positions")
