"""A named DeviceMesh for the parallel degrees: pipeline, data, expert, context, tensor.

Ranks are laid out with tensor parallelism innermost (neighbouring ranks: on a real
cluster they share a node and its fast NVLink), then context, expert, data, and pipeline
outermost (course_lib.dims.MESH_ORDER):

    world_size = pp * dp * ep * cp * tp
    rank = (((pp_index * dp + dp_index) * ep + ep_index) * cp + cp_index) * tp + tp_index

e.g. dp=2, tp=2 on 4 ranks: tp groups {0,1} {2,3}; dp groups {0,2} {1,3}. With cp = 1 (the
default) the mesh has the four dimensions MESH_DIMS = ("pp", "dp", "ep", "tp") and no "cp"
key anywhere: every rank's coordinates and every group are those of before cp existed.
"""

from __future__ import annotations

from course_lib._validate import check_int
from course_lib.dims import MESH_DIMS, MESH_ORDER, ParallelDims


def check_mesh(world_size: int, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1) -> dict[str, int]:
    """Validate the degrees (call it in the parent, before any process starts). Returns {dim: size}
    in mesh order: MESH_DIMS, or MESH_ORDER (with "cp") when cp > 1."""
    check_int("cp", cp)
    dims = MESH_ORDER if cp > 1 else MESH_DIMS
    degrees = {d: {"pp": pp, "dp": dp, "ep": ep, "cp": cp, "tp": tp}[d] for d in dims}
    for name, d in degrees.items():
        check_int(name, d)
    product = pp * dp * ep * cp * tp
    if product != world_size:
        raise ValueError(f"{'*'.join(dims)} = {'*'.join(str(v) for v in degrees.values())} = {product} "
                         f"must equal world_size={world_size}")
    return degrees


def mesh_groups(world_size: int, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1,
                cp: int = 1) -> dict[str, list[list[int]]]:
    """For each dim, the lists of ranks that form one group along it (pure Python, no processes)."""
    sizes = check_mesh(world_size, dp=dp, tp=tp, pp=pp, ep=ep, cp=cp)
    dims = tuple(sizes)
    shape = [sizes[d] for d in dims]
    groups = {}
    for axis, dim in enumerate(dims):
        seen = {}
        for rank in range(world_size):
            coords, rest = [], rank
            for size in reversed(shape):  # un-flatten rank into (pp, dp, ep[, cp], tp) coordinates
                coords.append(rest % size)
                rest //= size
            coords = coords[::-1]
            key = tuple(c for i, c in enumerate(coords) if i != axis)
            seen.setdefault(key, []).append(rank)
        groups[dim] = list(seen.values())
    return groups


def make_mesh(dp=1, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, device_type: str | None = None):
    """Inside rank code: a DeviceMesh with dims ("pp", "dp", "ep", "tp") (cp > 1: ("pp", "dp",
    "ep", "cp", "tp")), from the degrees or from a whole layout: make_mesh(dims) with a
    course_lib.dims.ParallelDims.

    `mesh["tp"].get_group()` is this rank's tensor-parallel process group, and so on.
    device_type defaults to "cuda" with the NCCL backend, else "cpu".
    """
    if isinstance(dp, ParallelDims):
        return make_mesh(**dp.sizes(), device_type=device_type)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("make_mesh needs an initialised process group: call it inside run_on_ranks or torchrun")
    sizes = check_mesh(dist.get_world_size(), dp=dp, tp=tp, pp=pp, ep=ep, cp=cp)
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
