"""The tensor-parallel demo's --check (course_lib/demos/tensor_parallel.py): the comparison with the
single process printed either way, a verdict only with --check, which fails on a broken shard."""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from course_lib import run_on_ranks
from course_lib.demos import tensor_parallel as demo

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file


def _losses(argv, broken: bool):
    """Rank code: the demo's own build and train on this world, optionally with a broken shard:
    every rank's first MLP column shard replaced by rank 0's (as if its row table named rank 0's
    rows everywhere)."""
    import course_lib.parallel.tp.training as training

    apply = training.apply_tensor_parallel

    def apply_then_break(model, group, *a, **k):
        apply(model, group, *a, **k)
        with torch.no_grad():
            dist.broadcast(model.blocks[0].mlp.fc.weight, src=0, group=group)
        return model

    built = demo.build(demo.parse(argv), dist.get_world_size())
    training.apply_tensor_parallel = apply_then_break if broken else apply
    try:
        return demo.train(*built).train_losses
    finally:
        training.apply_tensor_parallel = apply


@pytest.mark.parametrize("argv", [["--steps", "3", "--sequence-parallel", "--async-tp", "--n-head", "4",
                                   "--n-kv-head", "1", "--seq-len", "32"]], ids=["sp-async-gqa"])
def test_check_passes_on_the_real_run_and_fails_on_a_broken_shard(argv, capsys):
    world = 2
    good, bad = run_on_ranks(lambda: (_losses(argv, False), _losses(argv, True)), world_size=world, timeout_s=120)[0]
    args = demo.parse([*argv, "--check"])
    built = demo.build(args, world)
    result = type("R", (), {})()
    result.train_losses = good
    assert demo.report(args, world, "gloo", built, result) == 0
    out = capsys.readouterr().out
    assert "async TP (overlapped)" in out and out.splitlines()[-1].endswith(": OK"), out
    result.train_losses = bad
    assert demo.report(args, world, "gloo", built, result) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1].endswith(": MISMATCH"), out
    # without --check the same comparison is printed and the status is 0
    plain = demo.parse(argv)
    assert demo.report(plain, world, "gloo", built, result) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(": MISMATCH")


def test_a_bad_tolerance_is_refused():
    from _demo_cli import run_main

    code, err = run_main("course_lib.demos.tensor_parallel", ["--tolerance", "nan"], env={"WORLD_SIZE": "2"})
    assert code == 2 and "--tolerance=nan must be >= 0" in err, err
