"""A cluster: the devices and links the step-time model (step_time.py) and the planner cost a
layout on (notebook 11), with the rates and fixed costs course_lib.measure.calibrate measures.
The layout itself is course_lib.dims.ParallelDims, the one the runtime runs.

Cluster validates its fields on construction: a bad value is a ValueError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from course_lib._validate import check_int
from course_lib.comm.costmodel import LinkModel
from course_lib.dims import ParallelDims, fits_node, link_of


@dataclass(frozen=True)
class Cluster:
    """Devices and links. peak_flops: the spec sheet's dense rate (MFU's denominator);
    achievable_flops: what large matmuls really reach (measured: course_lib.measure.calibrate);
    memory_bytes: usable device memory; memory_bandwidth: bytes/s for the optimizer update;
    overlap: the fraction of backward that can hide gradient traffic (1 on GPUs with separate
    communication engines; less where communication and compute share the same cores).
    intra, inter: a LinkModel (alpha-beta) or a measured course_lib.comm.measured.CollectiveTable.
    layer_overhead: seconds of fixed cost per layer and micro-batch (forward + backward), paid
    whatever the layer's size: launching its ops (a GPU kernel launch costs microseconds; an
    eager CPU op tens of them); tensor_overhead: the same per parameter tensor in the optimizer
    update and gradient clipping (why fused and foreach optimizers exist). Both 0 for the
    published clusters, whose layers are large enough to bury them.
    shared_cores: 0 when each rank has its own device; else the number of CPU cores the ranks
    share (emulated ranks): an idle rank's core then runs the busy ones, so a pipeline's bubble
    costs time only while fewer ranks are busy than there are cores.
    recipe_rates: ((recipe, achievable_flops, layer_overhead), ...) measured in a precision
    recipe other than the one the two fields above hold (calibrate: bf16 autocast beside fp32,
    since on a CPU without bf16 matmul units the casts and the bf16 matmuls run at their own
    rates); rates(recipe) reads them."""

    name: str
    n_gpus: int
    gpus_per_node: int
    peak_flops: float
    achievable_flops: float
    memory_bytes: float
    intra: LinkModel
    inter: LinkModel
    memory_bandwidth: float = 2e12
    overlap: float = 1.0
    layer_overhead: float = 0.0
    tensor_overhead: float = 0.0
    shared_cores: int = 0
    recipe_rates: tuple = ()

    def __post_init__(self):
        check_int("n_gpus", self.n_gpus)
        check_int("gpus_per_node", self.gpus_per_node)
        for name in ("peak_flops", "achievable_flops", "memory_bytes", "memory_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap={self.overlap!r} must satisfy 0 <= overlap <= 1")
        for name in ("layer_overhead", "tensor_overhead"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0 seconds")
        check_int("shared_cores", self.shared_cores, minimum=0)
        for entry in self.recipe_rates:
            if not (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], str)
                    and entry[1] > 0 and entry[2] >= 0):
                raise ValueError(f"recipe_rates entry {entry!r} must be a tuple (recipe, achievable_flops > 0, "
                                 f"layer_overhead >= 0)")

    def rates(self, recipe: str) -> tuple[float, float]:
        """(achievable FLOP/s, fixed seconds per layer and micro-batch) of the forward and
        backward in `recipe`: its measured entry of recipe_rates, else the cluster's own."""
        for name, flops, overhead in self.recipe_rates:
            if name == recipe:
                return flops, overhead
        return self.achievable_flops, self.layer_overhead

    def link(self, size: int, stride: int) -> LinkModel:
        """The link a group of `size` ranks `stride` apart crosses: the node's when its span
        fits a node without straddling two (course_lib.dims.link_of's rule)."""
        span = size * stride
        return self.intra if fits_node(span, self.gpus_per_node) else self.inter

    def link_of(self, dim: str, dims: ParallelDims) -> LinkModel:
        """The link of mesh dimension `dim` of the layout `dims`, placed as make_mesh places it
        (course_lib.dims, TOPOLOGY_AWARE order: tp innermost)."""
        return self.inter if link_of(dim, dims.sizes(), self.gpus_per_node) == "inter" else self.intra

    def with_gpus(self, n_gpus: int) -> "Cluster":
        return replace(self, n_gpus=n_gpus)
