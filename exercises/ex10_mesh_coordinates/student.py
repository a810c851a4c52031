"""Exercise 10: mesh coordinates, groups and links. Fill in the parts marked TODO, then run the
check cells of ex10_mesh_coordinates.ipynb. Each check prints PASS when your code is right.

The set-up (notebook 10, sections 1, 2 and 6):
  * sizes = {"pp": ..., "dp": ..., "ep": ..., "tp": ...}, world size = their product;
  * order lists the four dimensions from outermost to innermost: the LAST one varies fastest as
    the rank grows (make_mesh's order is ("pp", "dp", "ep", "tp"));
  * ranks are numbered node by node: ranks 0 .. G-1 on node 0, G .. 2G-1 on node 1, ...
"""

DIMS = ("pp", "dp", "ep", "tp")


def coordinates(rank: int, sizes: dict, order=DIMS) -> dict:
    """{"pp": i, "dp": j, "ep": k, "tp": l}: the index of `rank` along each dimension.
    Example: sizes pp 2, dp 2, ep 1, tp 2, make_mesh's order: rank 5 -> pp 1, dp 0, ep 0, tp 1."""
    raise NotImplementedError("exercise 10: write coordinates")


def groups(sizes: dict, order=DIMS) -> dict:
    """{dim: list of groups}: a group of `dim` is the sorted list of ranks whose coordinates
    differ only along `dim`; list the groups in order of their smallest rank.
    Example (sizes as above): groups(...)["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]."""
    raise NotImplementedError("exercise 10: write groups")


def link_of(dim: str, sizes: dict, gpus_per_node: int, order=DIMS) -> str:
    """"none" if sizes[dim] == 1; "intra" if every group of `dim` lies inside one node (all its
    ranks r have the same r // gpus_per_node); else "inter" (the group crosses the network)."""
    raise NotImplementedError("exercise 10: write link_of")


def inter_node_bytes(bytes_per_rank: dict, sizes: dict, gpus_per_node: int, order=DIMS) -> float:
    """Bytes per rank and step that cross the network: the sum of bytes_per_rank[dim] over the
    dimensions whose link is "inter" (bytes_per_rank has an entry for each dim that sends)."""
    raise NotImplementedError("exercise 10: write inter_node_bytes")


def best_order(sizes: dict, gpus_per_node: int, bytes_per_rank: dict) -> tuple:
    """An order of the four dimensions (a tuple, outermost first) in which this layout sends the
    fewest bytes per rank over the network, for these bytes per dimension (as inter_node_bytes
    counts them). When several orders tie, any of them."""
    raise NotImplementedError("exercise 10: write best_order")
