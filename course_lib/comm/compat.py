"""Names that moved between torch versions (the course supports torch 2.8 and newer).

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` and deprecated the old names. These helpers call whichever exists,
looked up at call time (so `CommTracer`, which swaps the functions while active, sees them).
torch.distributed is imported at call time too: comm.measured imports this module, and the
estimator imports comm.measured where torch need not be installed.
"""


def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
    """Gather every rank's equal-sized `input_tensor` into `output_tensor` (concatenated along dim 0)."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=None, group=None, async_op=False):
    """Reduce `input` across ranks (op: a dist.ReduceOp, SUM when None) and leave chunk `rank`
    (dim 0) of the result in `output`."""
    import torch.distributed as dist

    op = dist.ReduceOp.SUM if op is None else op
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)
