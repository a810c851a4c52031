"""Tensor (and sequence) parallelism's collectives of one step (course_lib.estimate.traffic: the notation)."""

from __future__ import annotations

from course_lib.dims import layers_per_rank
from course_lib.estimate.params import kv_copy_rows, model_shape, param_breakdown
from course_lib.estimate.traffic.records import Collective, _pipeline_rank, _shape


def tp_traffic(config, dims, batch_size: int, seq: int | None = None, act_bytes: int = 4,
               rank: int | None = None, param_bytes: int | None = None) -> list[Collective]:
    """Tensor (and sequence) parallelism's collectives (module docstring). Under bf16 autocast
    the row-parallel matmuls' outputs are bf16, and under SP so are the gradients flowing back
    into them and out of the column-parallel matmuls' (bf16) inputs: those messages are 2 bytes
    an element; the rest (norm outputs, the embedding, the loss) stays at act_bytes.
    rank: the calls of that pipeline rank as the course's runtime makes them (its own blocks,
    the end it holds, one all-reduce repeated per recomputed block), priced as made: the
    step-time model's reading on a measured table. None: rank 0's calls, priced as above.
    KV heads copied at tp > n_kv_head (the course's GPT, course_lib.parallel.tp.layers): per block
    and forward (again when recomputed) one all-reduce of every K and V row of qkv's weight
    (2 kv d elements, kv = n_kv_head d_head) and one of its bias (2 kv), from their first holders
    (the others add zeros), and one of each backward (every copy's gradient summed to the first
    holder): param_bytes an element (default act_bytes; the runtime's weights are fp32)."""
    if dims.tp == 1:
        return []
    base, s, mb, l0 = _shape(config, dims, batch_size, seq)
    if rank is not None:  # that rank's blocks and ends, priced as the runtime calls them
        held = layers_per_rank(base.n_layer, dims.pp, dims.virtual_stages)[_pipeline_rank(rank, dims.pp)]
        own = (held, int(rank == 0), int(rank == dims.pp - 1))
    s //= dims.cp  # context parallelism: a rank's tokens of each sequence
    R = dims.replicas * dims.cp  # every cp rank of a replica does this on its tokens
    L, m, n, full = base.n_layer, dims.microbatches, dims.tp, int(dims.recompute == "full")
    M = mb * s * base.d_model * act_bytes
    Mb = mb * s * base.d_model * 2 if dims.precision == "bf16" else M
    megatron = "full recomputation priced as Megatron's, both of a block's; the runtime's checkpoint repeats one" \
        if full else ""
    ends = "the busiest rank priced as holding both ends" if dims.pp > 1 else ""

    def rec(what, op, size, count, priced=None, why="", measured_only=False):
        """count(l, a, z): calls per micro-batch of a rank holding l blocks, the first stage (a)
        and the last (z). Rank 0 holds the first; the step-time model prices l0 blocks and both
        ends; the world's bytes sum one copy of the L blocks and both ends per replica and tp rank."""
        sent = size // n if op == "all_gather" else size  # SP: tp divides the sequence
        calls, model = m * count(l0, 1, int(dims.pp == 1)), m * (priced or count)(l0, 1, 1)
        if rank is not None:
            calls = model = m * count(*own)
        return Collective("tp", what, op, size, n, calls, R * n * m * count(L, 1, 1) * sent,
                          None if model == calls else model, "" if model == calls else why or ends,
                          measured_only=measured_only)

    loss = rec("the vocabulary-parallel loss: max, sum, target", "all_reduce", mb * s * 4, lambda l, a, z: 3 * z)
    b, shape = int(getattr(base, "bias", False)), model_shape(config)
    pb = act_bytes if param_bytes is None else param_bytes
    shared = 2 * shape.n_kv_head * (shape.d_model // shape.n_head) if kv_copy_rows(config, n) else 0  # K, V rows
    copies = [rec(f"copied KV heads: qkv's K and V {part} from their first holders (n_kv_head < tp)", "all_reduce",
                  shared * width * pb, lambda l, a, z: (2 + full) * l)
              for part, width in (("weight rows", base.d_model), ("biases", b)) if width and shared]
    if not dims.sequence_parallel:
        return copies + [
            rec("g after attn.proj and mlp.proj", "all_reduce", Mb, lambda l, a, z: (2 + full) * l,
                lambda l, a, z: (2 + 2 * full) * l, megatron),
            rec("f before qkv, fc and the head; g after the embedding", "all_reduce", M,
                lambda l, a, z: 2 * l + a + z),
            loss]
    # the gradients of replicated parameters that saw one shard, summed in one flat all-reduce
    # per backward pass (comm.autograd.copy_parameter_to_group): per block 2 norms (+ their
    # biases and the 2 row-parallel biases), the final norm, the position table (a GPT's)
    d_e = base.d_model * act_bytes
    pos = param_breakdown(base)["position"] * act_bytes
    flat0 = (l0 * (2 + 4 * b) + (1 + b) * (dims.pp == 1)) * d_e + pos
    if rank is not None:  # the final norm on the last stage, the position table on the first
        flat0 = (own[0] * (2 + 4 * b) + (1 + b) * own[2]) * d_e + pos * own[1]
    small_bytes = (L * (2 + 4 * b) + 1 + b) * d_e + pos
    return copies + [
        rec("all-gathers into qkv, fc and the head, and of the embedding's output gradient", "all_gather", M,
            lambda l, a, z: (2 + 2 * full) * l + a + z),
        rec("all-gathers of the gradients of attn.proj's and mlp.proj's reduce-scatters", "all_gather", Mb,
            lambda l, a, z: 2 * l),
        rec("re-gathers of the saved sequence shards in backward", "all_gather", M, lambda l, a, z: 2 * l + z,
            measured_only=True),
        rec("reduce-scatters out of attn.proj and mlp.proj", "reduce_scatter", Mb, lambda l, a, z: (2 + full) * l,
            lambda l, a, z: (2 + 2 * full) * l, megatron),
        rec("reduce-scatter out of the embedding", "reduce_scatter", M, lambda l, a, z: a),
        rec("reduce-scatters of the input gradients of qkv, fc and the head", "reduce_scatter", Mb,
            lambda l, a, z: 2 * l + z),
        Collective("tp", "gradients of the replicated norms, row-parallel biases and the position table, in one "
                   "flat call", "all_reduce", flat0, n, m * (flat0 > 0), R * n * m * small_bytes, measured_only=True),
        loss]
