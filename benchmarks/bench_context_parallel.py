"""Context-parallel step time and bytes: ring attention, all-gather K/V and Ulysses against the
single process, at two sequence lengths, side by side in one run.

    .venv/bin/python benchmarks/bench_context_parallel.py [--cp 2] [--seq-lens 256 1024] [--steps 5] [--rounds 3] [--quick]

cp gloo ranks train the course GPT (d_model 128, 2 layers, 4 heads, naive attention: the
explicit s x s scores, as the context-parallel blocks compute them) on a global batch of 2
sequences of S tokens, zig-zag load balanced; the single process trains the same model on one
of the same ranks (one rank's share of the cores) while the others wait. Every context-parallel
rank computes 1/cp of the causal score pairs and 1/cp of everything else, and adds the
attention's messages and the gradient all-reduce over cp, so the ratio to the single process
falls with S as attention's s^2 comes to dominate the step: on 2 CPU cores the context-parallel
step is slower than the single process's at S = 256 (per-call overheads dominate) and faster at
S = 1024.

PyTorch's own context parallelism (torch.distributed.tensor.experimental.context_parallel) is
built on the GPU SDPA kernels and raises on CPU (the error is printed); its default K/V rotation
is an all-gather, so the course's all-gather method stands in for it: "ring / allgather".

Bytes per step (summed over the ranks): the attention's, measured by the CommTracer on one
forward and backward and printed beside course_lib.estimate.traffic.cp_traffic's records, and
the gradient all-reduce's (every parameter, fp32, on every rank). Method as
bench_data_parallel.py: a step's time is the slowest rank's, a run's the median of its steps
after WARMUP; each round runs every variant on the same warm ranks in a rotated order; ratios are
paired per round, reported as the median with the interquartile spread, recorded with
benchmarks/summary.py.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from rounds import WARMUP, report, run_rounds  # noqa: E402  (benchmarks/ is not a package)
from summary import QUICK_ROUNDS, add_quick, quick_mode  # noqa: E402

from course_lib import run_on_ranks  # noqa: E402
from course_lib.data import CharDataset, get_batch  # noqa: E402
from course_lib.dims import CP_METHODS, ParallelDims  # noqa: E402
from course_lib.estimate.traffic import cp_traffic  # noqa: E402
from course_lib.model import GPT, GPTConfig  # noqa: E402
from course_lib.parallel.cp.training import (cp_groups, torch_context_parallel_attention,  # noqa: E402
                                             traced_forward_backward, train_context_parallel)
from course_lib.train import TrainConfig, train_reference  # noqa: E402

SINGLE = "single process"
BATCH = 2  # sequences per step
# Targets. The ring moves 4/3 of the all-gather's bytes at cp = 2 and computes block by block,
# with a hand-written backward that recomputes each block's softmax and passes dK||dV round the
# ring: its price for never holding more than two K/V blocks, at most half a step more.
RING_VS_ALLGATHER = 1.5
# At the long sequence two ranks each do half of the step's work plus the messages and the
# gradient all-reduce: the ring should take at most 0.9 of the single process's step.
RING_VS_SINGLE_LONG = 0.9


def config_for(seq_len: int) -> GPTConfig:
    return GPTConfig(vocab_size=CharDataset("train").vocab_size, block_size=seq_len, n_layer=2, n_head=4, d_model=128)


def name(variant: str, seq_len: int) -> str:
    return f"{variant} S={seq_len}"


def one_round(seq_lens, cfg, order):
    """Rank code: every variant of `order` in turn; step seconds per variant (the single process
    runs on rank 0, the other ranks report zeros: the slowest rank's step is rank 0's)."""
    rank, cp = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for variant_s in order:
        variant, s = variant_s.rsplit(" S=", 1)
        config = config_for(int(s))
        if variant == SINGLE:
            out[variant_s] = train_reference(config, cfg).step_seconds if rank == 0 else [0.0] * cfg.steps
            torch.distributed.barrier()
        else:
            out[variant_s] = train_context_parallel(config, cfg, cp, 1, variant, True).step_seconds
    return out


def attention_bytes(seq_lens):
    """Rank code: {(method, S): tracer summary of one forward and backward} and torch's CP error."""
    cp_group, _, _, _ = cp_groups(torch.distributed.get_world_size())
    out = {}
    for s in seq_lens:
        x, y = get_batch(CharDataset("train", s), BATCH, torch.Generator().manual_seed(0))
        for method in CP_METHODS:
            out[(method, s)] = traced_forward_backward(config_for(s), x, y, cp_group, method, True)
    q, k, v = (torch.randn(1, 4, 16, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    try:
        torch_context_parallel_attention(q, k, v)
        out["torch"] = None
    except Exception as e:  # noqa: BLE001 - the error is what is reported
        out["torch"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return out


def print_bytes(per_rank, seq_lens, cp):
    print(f"\nbytes per step, summed over the {cp} ranks (global batch {BATCH}):")
    print(f"{'method':<12}{'S':>6}{'attention (tracer)':>20}{'cp_traffic':>14}{'gradient all-reduce':>22}")
    for s in seq_lens:
        grads = cp * GPT(config_for(s)).num_params() * 4  # every rank all-reduces every fp32 gradient
        for method in CP_METHODS:
            measured = sum(sum(row["bytes_sent"] for row in rank[(method, s)].values()) for rank in per_rank)
            dims = ParallelDims(cp=cp, cp_method=method)
            formula = sum(r.world_bytes for r in cp_traffic(config_for(s), dims, BATCH))
            print(f"{method:<12}{s:>6}{measured / 2**20:>16.2f} MiB{formula / 2**20:>10.2f} MiB{grads / 2**20:>18.2f} MiB")
    error = per_rank[0]["torch"]
    print("\ntorch.distributed.tensor.experimental.context_parallel on these ranks: "
          + ("runs" if error is None else f"does not run ({error}); compared through the all-gather method"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--seq-lens", type=int, nargs=2, default=[256, 1024])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-record", action="store_true", help="do not add the ratios to benchmarks/results")
    add_quick(parser, argv, steps=WARMUP + 1, rounds=QUICK_ROUNDS, seq_lens=[32, 64])
    args = parser.parse_args(argv)
    if args.steps <= WARMUP or args.rounds < 1 or args.cp not in (2, 4):
        parser.error(f"need --steps > {WARMUP}, --rounds >= 1, --cp in (2, 4)")
    for s in args.seq_lens:
        if s < 1 or s % (2 * args.cp):
            parser.error(f"--seq-lens {s}: each must be a positive multiple of 2*cp = {2 * args.cp} (zig-zag chunks)")
    quick_mode(args)

    short, long = args.seq_lens
    cfg = TrainConfig(steps=args.steps, batch_size=BATCH, eval_every=10**9, eval_batches=1, progress=False)
    print(f"cp={args.cp} gloo ranks on {os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f}), "
          f"torch {torch.__version__}; GPT d_model 128, 2 layers, 4 heads: {GPT(config_for(long)).num_params() / 1e6:.2f}M "
          f"params; {BATCH} sequences of S = {short} and {long} tokens per step, zig-zag; {args.rounds} rounds")
    names = [name(v, s) for s in args.seq_lens for v in (SINGLE, *CP_METHODS)]
    ratios = {f"{m} / single process, S={s}": (name(m, s), name(SINGLE, s), None, "lower")
              for s in args.seq_lens for m in CP_METHODS}
    ratios[f"ring / single process, S={long}"] = (name("ring", long), name(SINGLE, long), RING_VS_SINGLE_LONG, "lower")
    ratios[f"ring / allgather, S={long}"] = (name("ring", long), name("allgather", long), RING_VS_ALLGATHER, "lower")
    ratios[f"ulysses / allgather, S={long}"] = (name("ulysses", long), name("allgather", long), None, "lower")
    # Timing runs: no collective checks (their extra all-gathers would be timed too); the tests
    # run the same code with them on.
    kw = dict(world_size=args.cp, timeout_s=600, check_collectives=False)
    start = time.perf_counter()
    print_bytes(run_on_ranks(attention_bytes, args.seq_lens, **kw), args.seq_lens, args.cp)
    warm = TrainConfig(steps=1, batch_size=BATCH, eval_every=10**9, eval_batches=1, progress=False)
    per_round = run_rounds(one_round, names, args.rounds, (args.seq_lens, cfg),
                           None if args.quick else (args.seq_lens, warm), **kw)  # --quick: no warm-up call
    report("bench_context_parallel", per_round, ratios, save=not args.no_record, started=start)


if __name__ == "__main__":
    main()
