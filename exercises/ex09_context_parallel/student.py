"""Exercise 09: the two pieces of arithmetic context parallelism rests on. Fill in the parts
marked TODO, then run the check cells of ex09_context_parallel.ipynb. Each check prints PASS
when your code is right.

The set-up (notebook 09):
  * attention of queries against a set of keys, with a causal mask by absolute position (a key
    is visible to a query when its position is <= the query's), gives per query row
      lse = log sum_j exp(s_j)              over the visible keys' scaled scores s_j
      out = sum_j exp(s_j - lse) v_j        the softmax-weighted values
    A query with no visible key in the set has lse = -inf and out = 0;
  * in ring attention a rank receives the keys and values block by block, so it holds such a
    *partial* (out, lse) per block and must combine them into attention over all keys;
  * the sequence of T tokens is cut into 2cp equal chunks, numbered 0 ... 2cp-1 in position order,
    and each of the cp ranks holds two of them.
"""

import math  # noqa: F401  (you may need these)

import torch


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of attention over the keys of a and b together, from the partials of two
    disjoint key sets.

    out_a, out_b: (B, H, s, hd); lse_a, lse_b: (B, H, s). Returns out (B, H, s, hd), lse (B, H, s).
    Example (one query, hd = 1): a = (out 2, lse log 2), b = (out 8, lse log 6) -> (6.5, log 8).
    Requirements: exact for any lse (no exp of a large number: lse = 100 must work in fp32);
    a part with no visible key (lse = -inf, out = 0) leaves the other unchanged; when neither
    part has a visible key the result is out = 0, lse = -inf, never NaN.
    """
    # TODO 1: lse of the union. What is exp(lse) for one part? Add those, in log space, without
    #         overflow (factor out the larger one).
    # TODO 2: out of the union: a weighted sum of out_a and out_b. Which share of the union's
    #         softmax denominator belongs to each part's keys?
    # TODO 3: the rows where both lse are -inf.
    raise NotImplementedError("exercise 09: write merge_partials")


def zigzag_chunks(cp: int, rank: int) -> list[int]:
    """The two chunks (of the 2cp) that rank holds, in increasing order.

    Requirements: every chunk is held by exactly one rank; rank r's first chunk is chunk r (the
    ranks in sequence order); under a causal mask every rank scores the same number of
    (query, key) pairs. Example: cp = 1 -> [0, 1].
    """
    # TODO: a query at position p scores p + 1 keys. Which second chunk evens out rank r's work?
    raise NotImplementedError("exercise 09: write zigzag_chunks")
