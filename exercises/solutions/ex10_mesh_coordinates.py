"""Exercise 10, reference solution: mesh coordinates, groups and links."""

import itertools

DIMS = ("pp", "dp", "ep", "tp")


def coordinates(rank: int, sizes: dict, order=DIMS) -> dict:
    """Un-flatten the rank, innermost (last in `order`) first."""
    out = {}
    for dim in reversed(order):
        out[dim] = rank % sizes[dim]
        rank //= sizes[dim]
    return {d: out[d] for d in DIMS}


def groups(sizes: dict, order=DIMS) -> dict:
    """Ranks sharing every coordinate but `dim`'s, grouped."""
    world = 1
    for d in DIMS:
        world *= sizes[d]
    out = {}
    for dim in DIMS:
        by_key = {}
        for rank in range(world):
            c = coordinates(rank, sizes, order)
            by_key.setdefault(tuple(c[d] for d in DIMS if d != dim), []).append(rank)
        out[dim] = sorted(by_key.values())
    return out


def link_of(dim: str, sizes: dict, gpus_per_node: int, order=DIMS) -> str:
    if sizes[dim] == 1:
        return "none"
    inside = all(len({r // gpus_per_node for r in g}) == 1 for g in groups(sizes, order)[dim])
    return "intra" if inside else "inter"


def inter_node_bytes(bytes_per_rank: dict, sizes: dict, gpus_per_node: int, order=DIMS) -> float:
    return sum(b for dim, b in bytes_per_rank.items() if link_of(dim, sizes, gpus_per_node, order) == "inter")


def best_order(sizes: dict, gpus_per_node: int, bytes_per_rank: dict) -> tuple:
    """Every order tried: 24 of them, each a few group listings."""
    return min(itertools.permutations(DIMS), key=lambda o: inter_node_bytes(bytes_per_rank, sizes, gpus_per_node, o))
