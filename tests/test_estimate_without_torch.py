"""course_lib.estimate imports and runs where torch cannot be imported (pure-Python formulas).

A child Python gets a sys.meta_path finder that raises ImportError for torch and every torch.*
module; it imports the estimator, runs the calculator and the planner on a small case, and prints
their results as JSON. The same script runs in a child with torch importable: the answers must
be equal, and only the first child must have run without torch in sys.modules."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

BLOCK_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is not installed here (blocked: {name})")
sys.meta_path.insert(0, NoTorch())
"""

RUN = """
import json, sys
from course_lib.comm.costmodel import LinkModel
from course_lib.dims import ParallelDims
from course_lib.estimate import GPT3_175B, param_count, per_gpu_memory
from course_lib.estimate.calculator import Settings, evaluate, summary_text
from course_lib.estimate.cluster import Cluster
from course_lib.estimate.planner import plan
from course_lib.estimate.step_time import step_time
from course_lib.model.config import GPTConfig

cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, d_model=32)
cluster = Cluster("test", 8, 8, peak_flops=2e9, achievable_flops=1e9, memory_bytes=1e9,
                  intra=LinkModel(alpha=1e-4, beta=1e8), inter=LinkModel(1e-3, 1e7), memory_bandwidth=1e9)
p = plan(cfg, cluster, 16, recipe="fp32")
r = evaluate(Settings(preset="GPT-3 175B", layout=ParallelDims(dp=8, tp=8, pp=16, zero=1)))
print(json.dumps({
    "torch_loaded": "torch" in sys.modules,
    "params": param_count(cfg), "gpt3_params": param_count(GPT3_175B),
    "memory": per_gpu_memory(cfg, 2, 32, "fp32", zero_stage=1, dp=2, attention="naive")["total"],
    "step": step_time(cfg, ParallelDims(dp=2, microbatches=2), cluster, 16, recipe="fp32")["total"],
    "best": p.best.label(), "explain": p.explain(), "ranked": len(p.ranked),
    "calculator": summary_text(r), "fits": r["fits"],
}))
"""


def run(block: bool) -> dict:
    code = (BLOCK_TORCH if block else "") + RUN
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_the_blocker_really_blocks_torch():
    done = subprocess.run([sys.executable, "-c", BLOCK_TORCH + "import course_lib.model.gpt"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode != 0 and "torch is not installed here (blocked: torch)" in done.stderr


def test_calculator_and_planner_run_without_torch_and_agree_with_a_run_with_it():
    without, with_torch = run(block=True), run(block=False)
    assert without["torch_loaded"] is False
    # The same Python formulas on the same inputs: every number and sentence equal, exactly.
    assert {**without, "torch_loaded": None} == {**with_torch, "torch_loaded": None}
    assert without["ranked"] > 0 and without["best"] and "best:" in without["explain"]
    assert without["params"] == 4 * (12 * 32 * 32 + 13 * 32) + 64 * 32 + 32 * 32 + 2 * 32  # gpt.py's count, tied head
