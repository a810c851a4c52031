"""torch.compile on data-parallel ranks: compile each block, then wrap (notebook 03, section 13).

    compile_unavailable()      None where Inductor can compile on this CPU, else one sentence why not
    apply_compile(model)       model.blocks[i].compile() for every block, in place (regional compile)
    compiled_vs_eager(...)     rank code: one SGD step of a compiled and an eager model, both under
                               torch's DDP or FSDP2 (fully_shard), from the same weights and rows
    run_compiled_vs_eager(...) the parent side: a fresh, empty Inductor cache, the ranks, the results

Regional compilation. `apply_compile` compiles each transformer block on its own, as torchtitan does,
not the whole model: the blocks are the same code with the same shapes, so Dynamo traces and Inductor
compiles one block's forward and backward once and reuses them for every block (its guards check
shapes and dtypes, not which module's parameters come in). Compilation is lazy: `.compile()` only
marks the module, and the first forward traces it, inside whatever wraps it by then.

The order rule (torchtitan's parallelize functions): tensor parallelism, then activation
checkpointing, then compile, then FSDP (or DDP).

    TP first          it swaps the block's Linear weights for shards and adds its collectives to the
                      block's forward: the compiled block must be the split one.
    then AC           the checkpoint wrapper goes inside the compiled region, so the compiler sees
                      which activations are recomputed and plans its saved tensors around them;
                      compiled first, the checkpoint would only re-run an opaque compiled call.
    then compile      on each (TP-split, checkpointed) block, the unit that repeats.
    then FSDP / DDP   fully_shard(block) puts its all-gather before the block's forward and its
                      reduce-scatter after its backward as hooks that Dynamo does not trace (FSDP2
                      marks them dynamo-disabled): the collectives stay outside the compiled graph,
                      overlapping with it as in eager, one FSDP unit per compiled block. DDP reduces
                      gradients from autograd hooks on the parameters, also outside the graph.

Why compiled and eager are not bit-equal: Inductor fuses element-wise operations into loops of its
own and may reorder float arithmetic (a LayerNorm's mean and variance in one pass, sums in another
order, a GELU's formula evaluated in its own order), so gradients differ in the last bits of fp32.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.data import CharDataset, collate, sample_indices
from course_lib.model import GPT
from course_lib.runtime.device import rank_device
from course_lib.runtime.pool import run_on_ranks

KINDS = ("ddp", "fsdp2")

# How far a compiled gradient may be from the eager one, relative to the largest gradient: both add
# the same fp32 terms (up to ~1000 per element here: 4 x 64 positions, 256-wide dot products) in
# another order, which moves a sum by up to ~n * 2^-24 of its largest partial sum: 1e-4 (the fp32
# bound of course_lib.tolerances.FIRST_GRAD_NORM_RTOL). One SGD step turns it into lr times that on
# the parameters, plus the rounding of the update itself (half an fp32 spacing, 2^-24 relative).
GRAD_RTOL = 1e-4

# Inductor's settings for these runs, which change how fast the kernels are built, not what they compute:
#   compile_threads=1     one compile process per rank: the ranks already fill the cores, and a pool of
#                         compile workers per rank would only add processes competing for them;
#   cpp.vec_isa_ok=False  scalar C++ loops instead of SIMD ones (at::vec): g++ builds a block's
#                         forward and backward kernels in about half the time (9 s against 19 s of
#                         g++ CPU time measured here, 18 s against 26 s for the whole first step).
#                         The lesson is the order and the equality, not the CPU kernels' speed.
BUILD_OPTIONS = {"compile_threads": 1, "cpp.vec_isa_ok": False}


def compile_unavailable() -> str | None:
    """None when torch.compile's default backend (Inductor) can build CPU kernels here, else why not.
    Inductor writes C++ for the CPU and builds it with the compiler named by $CXX (g++ by default)."""
    if not hasattr(nn.Module, "compile"):
        return f"torch {torch.__version__} has no nn.Module.compile (added in torch 2.2)"
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        return (f"torch.compile's Inductor backend needs a C++ compiler to build CPU kernels, and "
                f"{cxx!r} (from $CXX, else g++) is not on the PATH: install g++ (the course's set-up does)")
    return None


def apply_compile(model: nn.Module, **compile_kwargs) -> nn.Module:
    """Compile every block of model.blocks in place (nn.Module.compile), torchtitan's per-block
    compile; the embeddings, final LayerNorm, head and loss stay eager. Returns the model."""
    for block in model.blocks:
        block.compile(**compile_kwargs)
    return model


@dataclass(frozen=True)
class CompiledStep:
    """One rank's comparison. Differences are max |compiled - eager| over every element of every
    parameter (full, gathered tensors), after one SGD step and of the gradients before it."""
    kind: str
    loss_eager: float
    loss_compiled: float
    max_grad_diff: float
    max_param_diff: float
    max_param_diff_unaveraged: float  # the eager step taken on this rank's own gradient: what a missing average moves
    grad_atol: float  # GRAD_RTOL x the largest eager gradient
    param_atol: float  # lr x grad_atol + half the fp32 spacing of the largest parameter
    graphs: int  # graphs Dynamo compiled during the compiled step (one block's, reused by the other)
    compiled_step_s: float  # first compiled step: tracing and compiling included
    eager_step_s: float
    params: torch.Tensor  # compiled model's full parameters after the step (replicas compare these)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _flat(model: nn.Module, grads: bool = False) -> torch.Tensor:
    return torch.cat([_full(p.grad if grads else p).detach().reshape(-1) for p in model.parameters()])


def _wrap(model: nn.Module, kind: str) -> nn.Module:
    if kind == "ddp":
        dev = rank_device()
        return nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    for block in model.blocks:  # after apply_compile: one FSDP unit per compiled block
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _one_step(model: nn.Module, wrapped: nn.Module, x, y, lr: float):
    t0 = time.perf_counter()
    _, loss = wrapped(x, y)
    loss.backward()
    grads = _flat(model, grads=True)
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return loss.item(), grads, _flat(model), time.perf_counter() - t0


def _graph_count() -> int:
    from torch._dynamo.utils import counters  # private, but present from torch 2.0 to 2.13 at least

    return int(counters["stats"]["unique_graphs"])


def compiled_vs_eager(config, kinds=KINDS, batch_size: int = 8, lr: float = 0.1, seed: int = 0,
                      cache_dir: str | None = None) -> list[CompiledStep]:
    """Rank code: for each kind in `kinds` ("ddp": torch DistributedDataParallel; "fsdp2": fully_shard
    on every block, then the root), one SGD step of GPT(config, seed) eager, and of the same model
    after apply_compile (compile, then wrap: the order rule), on this rank's rows of one global
    batch. `cache_dir` becomes TORCHINDUCTOR_CACHE_DIR for the call (an empty folder: a cold cache)."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    rank, n = dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    data = CharDataset("train", block_size=config.block_size)
    rows = sample_indices(len(data), batch_size, torch.Generator().manual_seed(seed))
    x, y = (t.to(dev) for t in collate(data, rows.view(n, -1)[rank]))
    old_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache_dir is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    torch._dynamo.reset()
    out = []
    try:
        with inductor_config.patch(BUILD_OPTIONS):
            for kind in kinds:
                if kind not in KINDS:
                    raise ValueError(f"kind={kind!r} must be one of {KINDS}")
                eager = GPT(config, seed=seed).to(dev)
                loss_e, grads_e, params_e, t_e = _one_step(eager, _wrap(eager, kind), x, y, lr)
                alone = GPT(config, seed=seed).to(dev)  # no average: this rank's own gradient
                _, _, params_alone, _ = _one_step(alone, alone, x, y, lr)
                torch._dynamo.reset()  # each wrapper traces its own graphs, whatever this torch would reuse
                compiled = apply_compile(GPT(config, seed=seed).to(dev))
                before = _graph_count()
                loss_c, grads_c, params_c, t_c = _one_step(compiled, _wrap(compiled, kind), x, y, lr)
                grad_atol = GRAD_RTOL * grads_e.abs().max().item()
                out.append(CompiledStep(kind, loss_e, loss_c, (grads_c - grads_e).abs().max().item(),
                                        (params_c - params_e).abs().max().item(),
                                        (params_alone - params_e).abs().max().item(), grad_atol,
                                        lr * grad_atol + 2.0**-24 * params_e.abs().max().item(),
                                        _graph_count() - before, t_c, t_e, params_c))
    finally:
        torch._dynamo.reset()
        if old_dir is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old_dir
    return out


def run_compiled_vs_eager(config, world_size: int = 2, kinds=KINDS, **ranks) -> list[list[CompiledStep]]:
    """compiled_vs_eager on `world_size` ranks with a fresh, empty Inductor cache folder (removed
    afterwards): every kernel is generated and built with the C++ compiler, as on a first run.
    Raises RuntimeError(compile_unavailable()) here, before any rank starts, where it cannot run."""
    reason = compile_unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} must be one of {KINDS}")
    cache = tempfile.mkdtemp(prefix="inductor-cold-")
    try:
        return run_on_ranks(compiled_vs_eager, config, tuple(kinds), cache_dir=cache,
                            world_size=world_size, **{"timeout_s": 600, **ranks})
    finally:
        shutil.rmtree(cache, ignore_errors=True)
