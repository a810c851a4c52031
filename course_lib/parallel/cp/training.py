"""The reference training loop (course_lib.train), context parallel, optionally with data
parallelism around it: dp * cp ranks.

    rank = dp_index * cp + cp_index        (cp innermost: a cp group's ranks are neighbours)

Every rank draws the reference's global batch with the same seeded generator (course_lib.loop
.train_loop), keeps its data-parallel rows (share_rows(dp_index, dp, B)) and, inside the step's
loss function, its cp shard of those rows' tokens: idx, targets and their absolute positions
(apply.shard_batch). The loss is the mean over the rank's local tokens (B/dp rows x T/cp tokens).
All dp*cp shards are equal in size, so the mean of the local means over the dp*cp ranks is the
mean over the whole batch, the single-process loss; its gradient is the mean of the local
gradients, an all-reduce over all dp*cp ranks (every rank holds the whole weights: cp replicas
are averaged exactly like dp replicas, apply_data_parallel over the world group). After it every
rank holds the reference's gradient, so torch's clip and a plain AdamW train the same model as
train_reference, up to the order of fp32 sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.data import CharDataset
from course_lib._validate import check_int
from course_lib.dims import ParallelDims, check_runner
from course_lib.model import GPT
from course_lib.observe.tracer import CommTracer
from course_lib.parallel.cp.apply import apply_context_parallel, check_apply, context_parallel_loss
from course_lib.parallel.dp.apply import apply_data_parallel
from course_lib.parallel.mesh import make_mesh
from course_lib.runtime import run_on_ranks
from course_lib.runtime.device import rank_device
from course_lib.techniques.accumulation import accumulate_gradients
from course_lib.train import TrainResult, flat_grads, flat_params, make_optimizer, share_rows, train_loop

AXES = ("cp", "dp", "cp_method", "cp_load_balance")  # the ParallelDims fields run_context_parallel runs


def check_run(config, train_cfg, cp: int, dp: int = 1, method: str = "ring", load_balance: bool = True) -> None:
    """Everything a run checks before any rank starts or waits: the context-parallel rules for
    the config's block_size, dp a positive int, and the batch split evenly over dp."""
    check_int("dp", dp)
    check_apply(config, cp, config.block_size, method, load_balance)
    share_rows(0, dp, train_cfg.batch_size)  # raises unless dp | batch_size


def cp_groups(cp: int, dp: int = 1):
    """(cp group, dp group, cp index, dp index) of this rank on dp * cp ranks (cp innermost): the
    groups of make_mesh(dp=dp, cp=cp). Collective: every rank calls it."""
    mesh = make_mesh(dp=dp, cp=cp)
    return mesh.group("cp"), mesh.group("dp"), mesh.coords["cp"], mesh.coords["dp"]


def train_context_parallel(config, train_cfg, cp: int, dp: int = 1, method: str = "ring", load_balance: bool = True,
                           trace: bool = False) -> TrainResult:
    """Rank code, on dp * cp ranks (the world): train_cfg.steps steps of the context-parallel GPT
    (the module docstring). method: "ring", "allgather" or "ulysses"; load_balance: the zig-zag
    layout. Returns a TrainResult: train_losses the global loss (the mean over the dp*cp ranks'
    local losses, one all-reduce per step; equal on every rank), step_seconds, final_params and
    final_grads (flat, GPT.parameters() order: every rank holds the whole model, so they compare
    directly with the reference's), comm_summary with trace (the CommTracer over the steps).
    """
    check_run(config, train_cfg, cp, dp, method, load_balance)
    if dist.get_world_size() != dp * cp:
        raise ValueError(f"dp*cp = {dp}*{cp} = {dp * cp} must equal the world size {dist.get_world_size()}")
    cp_group, _, _, dp_index = cp_groups(cp, dp)
    dev = rank_device()
    model = GPT(config, seed=train_cfg.seed).to(dev)
    apply_context_parallel(model, cp_group, method, load_balance)
    replicas = apply_data_parallel(model, None, "naive")  # gradients averaged over all dp*cp ranks
    optimizer = make_optimizer(model, train_cfg)
    dataset = CharDataset("train", block_size=config.block_size)
    world = dp * cp

    def global_loss(local: float) -> float:
        t = torch.tensor([local], dtype=torch.float64, device=dev)
        dist.all_reduce(t)
        return t.item() / world

    hooks = replicas.hooks(loss_fn=context_parallel_loss)  # the step's loss: this rank's shard
    result = TrainResult().set_step_work(config, train_cfg.batch_size, config.block_size)
    rows = share_rows(dp_index, dp, train_cfg.batch_size)  # this replica's rows; the cp ranks share them
    train_loop(replicas.module, optimizer, dataset, train_cfg, hooks, rows=rows, device=dev, result=result,
               tracer=CommTracer() if trace else None, report_loss=global_loss)
    result.final_params, result.final_grads = flat_params(model), flat_grads(model)
    return result


def traced_forward_backward(config, x: torch.Tensor, y: torch.Tensor, cp_group, method: str = "ring",
                            load_balance: bool = True, microbatches: int = 1) -> dict:
    """Rank code: CommTracer.summary() of one forward and backward of the context-parallel
    GPT(config, seed=0) on cp_group over the rows x, y (B, T) in `microbatches` micro-batches,
    without the gradient average: the attention's calls alone, what cp_traffic's records count."""
    model = apply_context_parallel(GPT(config, seed=0).to(rank_device()), cp_group, method, load_balance)
    with CommTracer() as tracer:
        accumulate_gradients(model, x.to(rank_device()), y.to(rank_device()), microbatches,
                             loss_fn=context_parallel_loss)
    return tracer.summary()


def torch_context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None) -> torch.Tensor:
    """PyTorch's own context parallelism, for comparison: inside
    torch.distributed.tensor.experimental.context_parallel, F.scaled_dot_product_attention(
    causal) on the whole q, k, v (B, H, T, hd) every rank of `group` holds; they are sharded in
    place along T (torch's head-tail load balancing) and this rank's output shard is returned.
    Built on the SDPA kernels' ring attention (flash, efficient, cuDNN: GPU kernels). On CPU in
    torch 2.13 it raises NotImplementedError: the CPU kernel
    aten._scaled_dot_product_flash_attention_for_cpu "does not have a sharding strategy
    registered" (forcing the math kernel instead fails on a plain tensor added to a DTensor), so
    the course compares its methods against its own all-gather method, torch's default rotation."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, rank_device().type)
    q, k, v = (t.detach().clone() for t in (q, k, v))
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def run_context_parallel(dims: ParallelDims, model_config, train_cfg, backend: str = "gloo", timeout_s: float = 120,
                         **kwargs) -> list[TrainResult]:
    """Parent side: dims runs cp, dp, cp_method and cp_load_balance only; check_run and the
    rule book's check_model (bad input raises here, before any rank starts), then
    train_context_parallel on dims.dp * dims.cp ranks."""
    check_runner(dims, "run_context_parallel", AXES)
    check_run(model_config, train_cfg, dims.cp, dims.dp, dims.cp_method, dims.cp_load_balance)
    dims.check_model(model_config, train_cfg.batch_size)
    return run_on_ranks(train_context_parallel, model_config, train_cfg, dims.cp, dims.dp, dims.cp_method,
                        dims.cp_load_balance, world_size=dims.world_size, backend=backend, timeout_s=timeout_s,
                        **kwargs)
