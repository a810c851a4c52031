"""The trainer -> generator weight-sync demo (course_lib/demos/weight_sync.py): under torchrun with
--check (ZeRO-3 -> tp, an uneven ZeRO-3 over 3 -> tp over 2, tp -> per-parameter rows over 3), its
--check failing on a broken transfer plan (a dropped box, a wrong offset: tests/_weight_sync_mutant.py)
and on logits beyond the tolerance, and bad layouts refused before any rank waits."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from course_lib.demos import weight_sync as demo
from course_lib.model import GPT
from _demo_cli import run_main

ROOT = pathlib.Path(__file__).resolve().parent.parent


def torchrun(world, *argv, script=("-m", "course_lib.demos.weight_sync")):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *script, *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


@pytest.mark.parametrize("trainer, generator, world, steps", [
    ("zero3:dp2", "tp:2", 4, 2),
    ("zero3:dp3", "tp:2", 5, 2),  # 3 flat shards whose edges cut tensors; vocabulary 97 padded to 98
    ("tp:2", "fsdp:dp3", 5, 1),  # the reverse direction: whole heads -> dim-0 rows of 3 (97 = 33+33+31)
])
def test_under_torchrun_the_sync_is_exact(trainer, generator, world, steps):
    proc = torchrun(world, "--trainer", trainer, "--generator", generator, "--steps", str(steps), "--check")
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert f"trainer {trainer} " in out and f"-> generator {generator} " in out
    assert out.count("weights bit for bit: OK;") == steps
    assert out.count("file round trip equal: OK; bytes = formula: OK") == steps
    assert out.count("): OK;") == steps  # the logits within the tolerance
    assert out.rstrip().endswith("verdict: OK")


@pytest.mark.parametrize("mutant, words", [
    ("drop-box", "bytes = formula: MISMATCH"),  # fewer bytes, and the box stays zero on the generator
    ("wrong-offset", "bytes = formula: OK"),  # the same bytes, the wrong values
])
def test_check_fails_on_a_broken_plan(mutant, words):
    proc = torchrun(2, mutant, "--trainer", "zero3:dp1", "--generator", "tp:1", "--steps", "1", "--check",
                    script=("tests/_weight_sync_mutant.py",))
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    assert "weights bit for bit: MISMATCH in " in out and words in out, out[-3000:] + proc.stderr[-3000:]
    assert out.rstrip().endswith("verdict: MISMATCH")


@pytest.mark.parametrize("argv, world, words", [
    (["--trainer", "zero3:dp2", "--generator", "tp:2"], 3,
     "world_size=3: a layout of A=2 trainer ranks then B=2 generator ranks needs world_size = A + B = 4"),
    (["--trainer", "zero3:dp2", "--generator", "tp:3"], 5, "tp=3 must divide n_head=4"),
    (["--trainer", "tp:3", "--generator", "zero3:2"], 5, "tp=3 must divide n_head=4"),
    (["--trainer", "pp:2", "--generator", "tp:2"], 4,
     "--trainer='pp:2': the kind must be one of ('zero3', 'fsdp', 'tp')"),
    (["--trainer", "zero3:tp2", "--generator", "tp:2"], 4, "--trainer='zero3:tp2': the size must be dpN or N"),
    (["--trainer", "zero3:dp2", "--generator", "tp:0"], 2, "--generator size=0 must be a positive int"),
    (["--trainer", "zero3:dp2", "--generator", "tp:2", "--steps", "0"], 4, "--steps=0 must be a positive int"),
])
def test_bad_layouts_refused_before_any_rank_waits(argv, world, words):
    code, err = run_main("course_lib.demos.weight_sync", argv, env={"WORLD_SIZE": str(world), "RANK": "0"})
    assert code == 2 and words in err, err


def _records(built, logits_shift=0.0):
    """What the ranks send back from an exact sync (made here, in one process), the generator's
    logits moved by `logits_shift` of their largest size."""
    args, trainer, generator, config, plan = built
    full = {n: p.detach().clone() for n, p in GPT(config, seed=0).named_parameters()}
    prompt = torch.arange(2 * 8).view(2, 8) % config.vocab_size
    logits = GPT(config, seed=0)(prompt)[0].detach()
    logits = logits + logits_shift * logits.abs().max()
    a, b, formula = trainer.size, generator.size, plan.wanted_bytes()
    sent = {s: v for s, v in _per_rank(plan, 0).items()}
    got = {d: v for d, v in _per_rank(plan, 1).items()}
    everyone = []
    for rank in range(a + b):
        rec = {"step": 1, "live_s": 1e-3, "file_s": 2e-3}
        if rank < a:
            rec.update(loss=4.0, traffic={"bytes_sent": sent.get(rank, 0), "bytes_recv": 0})
        else:
            rec.update(loss=None, traffic={"bytes_sent": 0, "bytes_recv": got.get(rank - a, 0)}, file_equal=True,
                       logits=logits.clone())
        if rank in (0, a):
            rec["full"] = full
        everyone.append([rec])
    assert sum(sent.values()) == sum(got.values()) == formula
    return everyone, prompt


def _per_rank(plan, side):
    out = {}
    for pair, n in plan.pair_bytes().items():
        out[pair[side]] = out.get(pair[side], 0) + n
    return out


def test_the_verdict_fails_on_logits_beyond_the_tolerance(capsys):
    args = demo.parse(["--trainer", "zero3:dp2", "--generator", "tp:2", "--steps", "1", "--check"])
    built = demo.build(args, 4)
    assert demo.report(4, "gloo", built, _records(built)) == 0
    assert demo.report(4, "gloo", built, _records(built, 0.5 * demo.LOGITS_RTOL)) == 0
    assert demo.report(4, "gloo", built, _records(built, 2 * demo.LOGITS_RTOL)) == 1
    out = capsys.readouterr().out
    assert "weights bit for bit: OK; logits largest difference" in out and ": MISMATCH; file round trip" in out
