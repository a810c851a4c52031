"""Communication: collectives built from send/recv, their cost, and differentiable collectives.

    p2p.py           chunking and the send-while-receiving exchange everything is built on
    collectives.py   ring and parameter-server (single, sharded) all-reduce, reduce-scatter,
                     all-gather, all-to-all; the bytes each algorithm sends
    trees.py         recursive doubling and Rabenseifner's halving-doubling all-reduce
    costmodel.py     the alpha-beta model: predict, fit from ping-pong, crossover sizes
    measured.py      a measured table of collective times (piecewise alpha-beta) and
                     collective_time, which costs a call on either kind of link
    ringviz.py       the ring all-reduce step by step (pictures, widget)
    compat.py        collective names that moved between torch versions
    process_groups.py  new_groups / own_group: where every group outside hsdp.py is created
    autograd.py      collectives as autograd Functions (tensor, sequence and expert parallelism)

`course_lib.comm.ring_all_reduce` and the other functions of collectives.py stay importable
from here, as the notebooks use them.
"""

from course_lib._lazy import lazy_exports

# collectives.py (torch) is imported on first use (PEP 562): costmodel.py and measured.py are
# imported by the estimator, which must import where torch is not installed.
__all__ = ["ALL_REDUCE_ALGORITHMS", "chunk_bounds", "ring_send_chunk", "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce",
           "tree_all_reduce", "rabenseifner_all_reduce", "ps_all_reduce", "sharded_ps_all_reduce",
           "pairwise_all_to_all", "theory_bytes_sent"]


__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(__all__, "course_lib.comm.collectives"), globals())
