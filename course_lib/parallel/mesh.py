"""One rank's mesh: the five axes pipeline, data, expert, context, tensor, and the groups across them.

Ranks are laid out with tensor parallelism innermost (neighbouring ranks: on a real
cluster they share a node and its fast NVLink), then context, expert, data, and pipeline
outermost (course_lib.dims.MESH_ORDER):

    world_size = pp * dp * ep * cp * tp
    rank = (((pp_index * dp + dp_index) * ep + ep_index) * cp + cp_index) * tp + tp_index

e.g. dp=2, tp=2 on 4 ranks: tp groups {0,1} {2,3}; dp groups {0,2} {1,3}.

`make_mesh(dims)` builds a RankMesh once per rank: all five axes, size 1 included (a
DeviceMesh of shape (pp, dp, ep, cp, tp), `mesh["tp"]` its tensor-parallel sub-mesh), and the
groups spanning several axes that course_lib.dims.DERIVED_GROUPS names (dp_cp, replica,
loss). Every group's rank lists come from one pure function, course_lib.dims.groups; a
derived group whose ranks are one axis's (the other axes of size 1) IS that axis's
communicator, and only the others are created (course_lib.comm.process_groups.own_group, where
every group outside parallel/zero/hsdp.py is made).
"""

from __future__ import annotations

import math

import torch

from course_lib._validate import check_int
from course_lib.comm.process_groups import own_group
from course_lib.dims import DERIVED_GROUPS, GROUPS, MESH_ORDER, ParallelDims, coordinates, groups, product_text
from course_lib.loop import share_rows
from course_lib.runtime.device import rank_device


def check_mesh(world_size: int, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1,
               cp: int | None = None) -> dict[str, int]:
    """Validate the degrees (call it in the parent, before any process starts). Returns {axis:
    size} in MESH_ORDER for the axes named: cp only when given (the four-axis mesh of notebooks
    00 and 10 leaves it out: one rank)."""
    degrees = {d: n for d, n in {"pp": pp, "dp": dp, "ep": ep, "cp": cp, "tp": tp}.items() if n is not None}
    for name, n in degrees.items():
        check_int(name, n)
    if math.prod(degrees.values()) != world_size:
        raise ValueError(f"{product_text(degrees)} must equal world_size={world_size}")
    return degrees


def mesh_groups(world_size: int, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1,
                cp: int | None = None) -> dict[str, list[list[int]]]:
    """For each axis named (cp when given), the lists of ranks that form one group along it (pure
    Python, no processes): course_lib.dims.groups of check_mesh's sizes."""
    return groups(check_mesh(world_size, dp=dp, tp=tp, pp=pp, ep=ep, cp=cp))


def mesh_layout(dims: ParallelDims | dict) -> dict[str, list[list[int]]]:
    """{group name: its rank lists} of every group a RankMesh holds (course_lib.dims.GROUPS: the
    five axes and the derived groups), from the layout's sizes alone (no processes)."""
    sizes = dims.sizes() if isinstance(dims, ParallelDims) else {d: dims.get(d, 1) for d in MESH_ORDER}
    return groups(sizes, names=GROUPS)


class RankMesh:
    """This rank's groups on the five-axis mesh (module docstring); built once, by make_mesh.

    sizes {axis: degree}; coords {axis: this rank's index}; layout {name: rank lists} (pure);
    group(name) the process group of an axis or of a derived group; mesh["tp"] and the other
    DeviceMesh attributes are the DeviceMesh's (`device_mesh`)."""

    def __init__(self, sizes: dict[str, int], device_type: str):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.sizes = {d: sizes[d] for d in MESH_ORDER}
        self.rank = dist.get_rank()
        self.coords = coordinates(self.rank, self.sizes)
        self.layout = mesh_layout(self.sizes)
        self.device_mesh = init_device_mesh(device_type, tuple(self.sizes.values()), mesh_dim_names=MESH_ORDER)
        self.groups = {d: self.device_mesh[d].get_group() for d in MESH_ORDER}
        for name, axes in DERIVED_GROUPS.items():
            same = [self.groups[a] for a in axes if self.layout[a] == self.layout[name]]
            same += [self.groups[n] for n in self.groups if self.layout[n] == self.layout[name]]
            if same:  # one axis's ranks (or an earlier derived group's): its communicator
                self.groups[name] = same[0]
                continue
            self.groups[name] = own_group(self.layout[name], self.rank)  # collective: every rank, every group

    def group(self, name: str):
        """The process group of `name` (an axis of MESH_ORDER or a name of DERIVED_GROUPS)."""
        if name not in self.groups:
            raise ValueError(f"group {name!r} must be one of {tuple(self.groups)}")
        return self.groups[name]

    def size(self, name: str) -> int:
        """How many ranks the group `name` has: the product of its axes' degrees."""
        return len(self.layout[name][0])

    def index(self, name: str) -> int:
        """This rank's index in the group `name` (its coordinates along the group's axes as one number)."""
        return next(g.index(self.rank) for g in self.layout[name] if self.rank in g)

    def rows(self, batch):
        """This rank's replica's rows of a global batch: share `index("replica")` of `size("replica")`
        (= dp_index * ep + ep_index of dp * ep; tp, pp and cp ranks of a replica read the same rows).
        batch: the global batch size (the slice is returned) or a tensor of rows (its rows)."""
        if isinstance(batch, torch.Tensor):
            return batch[share_rows(self.index("replica"), self.size("replica"), batch.shape[0])]
        return share_rows(self.index("replica"), self.size("replica"), batch)

    def mean_loss(self, loss) -> float:
        """The mean of `loss` (a float or a one-element tensor) over the loss group (dp * ep
        replicas x cp equal sequence shards), the same on every rank: float64, one all-reduce (sum)
        per axis of the group that has more than one rank (a tracer files each under its axis)."""
        import torch.distributed as dist

        mean = torch.tensor(float(loss) / self.size("loss"), dtype=torch.float64, device=rank_device())
        for axis in DERIVED_GROUPS["loss"]:
            if self.sizes[axis] > 1:
                dist.all_reduce(mean, group=self.groups[axis])
        return float(mean)

    def __getitem__(self, axis: str):
        return self.device_mesh[axis]

    def __getattr__(self, name: str):  # mesh_dim_names, get_coordinate, ...: the DeviceMesh's
        if name == "device_mesh":
            raise AttributeError(name)
        return getattr(self.device_mesh, name)


def make_mesh(dp=1, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, device_type: str | None = None) -> RankMesh:
    """Inside rank code: this rank's RankMesh, from the degrees or from a whole layout:
    make_mesh(dims) with a course_lib.dims.ParallelDims. Collective: every rank calls it.

    `mesh["tp"].get_group()` (or `mesh.group("tp")`) is this rank's tensor-parallel process group,
    and so on. device_type defaults to "cuda" with the NCCL backend, else "cpu".
    """
    if isinstance(dp, ParallelDims):
        return make_mesh(**dp.sizes(), device_type=device_type)
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("make_mesh needs an initialised process group: call it inside run_on_ranks or torchrun")
    sizes = check_mesh(dist.get_world_size(), dp=dp, tp=tp, pp=pp, ep=ep, cp=cp)
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return RankMesh(sizes, device_type)
