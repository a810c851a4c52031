"""Run one MLP step of every layout three ways (course, DTensor, JAX) and put the results side by side.

    data = make_data()                      the same seeded fp32 tensors for all three
    jax_answer = run_jax(data)              JAX in its own process on 8 emulated CPU devices
    modes_table(jax_answer)                 dp x tp three ways in JAX: automatic, manual, explicit
    run_jax(data2, shapes2, names=("sp",))  ... only some layouts' programs, at other sizes
    torch_answer = run_torch(data)          the course and DTensor on 4 gloo ranks
    compare_collectives(...), compare_numbers(...)

JAX runs in a subprocess (python course_lib/sharding/jax_program.py, JSON in and out) with
XLA_FLAGS=--xla_force_host_platform_device_count=8 set before jax is imported: the flag must be
there at start-up, and XLA's and torch's thread pools then never share a process.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import numpy as np

from course_lib.runtime.pool import run_on_ranks
from course_lib.sharding import hlo
from course_lib.sharding.layouts import HIDDEN, LAYOUTS, Shapes, check_layout, formula, totals
from course_lib.sharding.torch_side import OUTPUTS, course_step, dtensor_step, reference_step

PROGRAM = pathlib.Path(__file__).with_name("jax_program.py")
JAX_DEVICES = 8
# fp32 results of the same step computed in another order (a parallel sum adds the same
# terms in another order; XLA and ATen use different GELU and matmul kernels): a few ulps of
# each value's magnitude, so 1e-5 relative plus 1e-6 absolute (for values near 0) holds with room.
RTOL, ATOL = 1e-5, 1e-6
# the layout JAX also runs by hand (shard_map) and in explicit mode, beside tp's shard_map
EXPLICIT_LAYOUT = "dp_tp"


def make_data(shapes: Shapes = Shapes(), seed: int = 0) -> dict[str, np.ndarray]:
    """x, t ~ N(0, 1); fc, proj ~ N(0, 1/fan_in) (nn.Linear's scale), all fp32."""
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal(shapes.shape("x")).astype(np.float32),
            "t": rng.standard_normal(shapes.shape("t")).astype(np.float32),
            "fc": (rng.standard_normal(shapes.shape("fc")) / np.sqrt(shapes.d)).astype(np.float32),
            "proj": (rng.standard_normal(shapes.shape("proj")) / np.sqrt(shapes.f)).astype(np.float32)}


def programs(names=tuple(LAYOUTS)) -> dict[str, tuple[str, dict]]:
    """The jit programs run_jax compiles for these layouts: {program: (layout, annotations on
    intermediates)}. Each layout with its own annotations; for fsdp also none at all and h alone
    (batch-split); for sp also h pinned as Megatron holds it (HIDDEN), on top of its own."""
    out = {name: (name, LAYOUTS[name].use) for name in names}
    if "fsdp" in names:
        out["fsdp_unannotated"] = ("fsdp", {})
        out["fsdp_h"] = ("fsdp", {"h": HIDDEN["fsdp"]})
    if "sp" in names:
        out["sp_h"] = ("sp", {**LAYOUTS["sp"].use, "h": HIDDEN["sp"]})
    return out


def run_jax(data: dict, shapes: Shapes = Shapes(), names=tuple(LAYOUTS), timeout_s: float = 120) -> dict:
    """The JAX programs' answer: {"devices", "platform", "programs": {name: {"hlo", "out"}}} for
    programs(names) (plus <layout>_shard_map for tp and dp_tp), on data of the given shapes; with
    dp_tp also "explicit": {"programs": {variant: {"hlo", "out", "types"}}, "refused": {"error",
    "message"}}, or {"unavailable": why} on a jax without explicit mode."""
    for name in names:
        check_layout(name, shapes)
    got = {k: tuple(v.shape) for k, v in data.items()}
    if got != {k: shapes.shape(k) for k in data}:
        raise ValueError(f"data shapes {got} must be those of {shapes}")
    request = {"lr": shapes.lr, "data": {k: v.tolist() for k, v in data.items()},
               "layouts": {name: {"axes": [list(a) for a in L.axes], "specs": L.specs}
                           for name, L in LAYOUTS.items() if name in names},
               "programs": {p: {"layout": layout, "use": use} for p, (layout, use) in programs(names).items()},
               "shard_map": [name for name in ("tp", EXPLICIT_LAYOUT) if name in names],
               "explicit": EXPLICIT_LAYOUT if EXPLICIT_LAYOUT in names else None}
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={JAX_DEVICES}",
               JAX_PLATFORMS="cpu", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, str(PROGRAM)], input=json.dumps(request), capture_output=True,
                          text=True, env=env, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the JAX process failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    answer = json.loads(done.stdout)
    explicit = answer.get("explicit", {}).get("programs", {})
    for program in [*answer["programs"].values(), *explicit.values()]:
        program["out"] = {k: np.asarray(v, dtype=np.float32) for k, v in program["out"].items()}
        program["collectives"] = hlo.collectives(program["hlo"])
    return answer


def _both(name, data):
    return {"course": course_step(name, data), "dtensor": dtensor_step(name, data)}


def run_torch(data: dict, names=tuple(LAYOUTS), world_size: int = 4, timeout_s: float = 120) -> dict:
    """{layout: {"course": per-rank results, "dtensor": per-rank results}} on gloo ranks."""
    for name in names:
        check_layout(name)
        if LAYOUTS[name].world != world_size:
            raise ValueError(f"layout {name!r} needs {LAYOUTS[name].world} ranks, world_size={world_size}")

    def all_layouts(data):
        return {name: _both(name, data) for name in names}

    per_rank = run_on_ranks(all_layouts, data, world_size=world_size, timeout_s=timeout_s)
    return {name: {who: [r[name][who] for r in per_rank] for who in ("course", "dtensor")} for name in names}


def assemble(name: str, per_rank: list[dict]) -> dict[str, np.ndarray]:
    """The full tensors from the ranks' pieces, each placed by its tensor's spec."""
    layout, shapes = LAYOUTS[name], Shapes()
    sizes = dict(layout.axes)
    out = {"loss": np.float32(per_rank[0]["loss"])}
    for key in OUTPUTS[1:]:
        tensor = key[2:] if key.startswith("g_") else key
        full = np.zeros(shapes.shape(tensor), np.float32)
        for rank, result in enumerate(per_rank):
            coords, left = {}, rank
            for axis, size in reversed(layout.axes):
                coords[axis], left = left % size, left // size
            index = tuple(slice(None) if axis is None else
                          slice(coords[axis] * full.shape[d] // sizes[axis], (coords[axis] + 1) * full.shape[d] // sizes[axis])
                          for d, axis in enumerate(layout.specs[tensor]))
            full[index] = result[key]
        out[key] = full
    return out


def collective_table(name: str, torch_answer: dict, jax_answer: dict) -> dict:
    """{source: {(op, group): bytes on rank 0}} for the formula (with and without re-gathers),
    the course, DTensor, and JAX (jit with shardings; for tp also shard_map)."""
    rows = {"formula (no re-gather)": totals(formula(name)),
            "formula (with re-gather)": totals(formula(name), regather=True),
            "course": totals(torch_answer[name]["course"][0]["collectives"]),
            "DTensor": totals(torch_answer[name]["dtensor"][0]["collectives"]),
            "JAX jit": totals(jax_answer["programs"][name]["collectives"])}
    if name == "tp":
        rows["JAX shard_map"] = totals(jax_answer["programs"]["tp_shard_map"]["collectives"])
    return rows


def max_rel_error(a: dict, b: dict) -> float:
    """max over OUTPUTS of max |a - b| / (ATOL / RTOL + |b|): <= RTOL means within tolerance."""
    return max(float(np.max(np.abs(np.asarray(a[k]) - np.asarray(b[k])) / (ATOL / RTOL + np.abs(np.asarray(b[k])))))
               for k in OUTPUTS)


def numbers_table(torch_answer: dict, jax_answer: dict, data: dict) -> dict:
    """{layout: {who: the full results}} with the single process under "reference"."""
    ref = reference_step(data)
    out = {}
    for name in torch_answer:
        out[name] = {"course": assemble(name, torch_answer[name]["course"]),
                     "DTensor": assemble(name, torch_answer[name]["dtensor"]),
                     "JAX": jax_answer["programs"][name]["out"], "reference": ref}
    out["tp"]["JAX shard_map"] = jax_answer["programs"]["tp_shard_map"]["out"]
    return out


def format_table(rows: dict) -> str:
    """rows {source: {(op, group): bytes}} as a fixed-width table, one column per (op, group)."""
    keys = sorted({k for row in rows.values() for k in row})
    heads = [f"{op} /{group}" for op, group in keys]
    width = max(len(s) for s in rows) + 2
    lines = [" " * width + "".join(f"{h:>20}" for h in heads)]
    for source, row in rows.items():
        lines.append(f"{source:<{width}}" + "".join(f"{row.get(k, 0):>20,}" for k in keys))
    return "\n".join(lines)


def source_of(function: str) -> str:
    """The source of a function in jax_program.py, read as text (this process never imports jax)."""
    text = PROGRAM.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return ast.get_source_segment(text, node)
    raise ValueError(f"no function {function!r} in {PROGRAM.name}")


def modes_table(jax_answer: dict, name: str = EXPLICIT_LAYOUT) -> dict:
    """{source: {(op, group): bytes}} for the formula and the layout's step in JAX's three modes:
    automatic (jit with shardings), manual (shard_map), explicit (typed arrays, y's type said)."""
    return {"formula": totals(formula(name)),
            "automatic (jit + shardings)": totals(jax_answer["programs"][name]["collectives"]),
            "manual (shard_map)": totals(jax_answer["programs"][f"{name}_shard_map"]["collectives"]),
            "explicit (sharding in types)": totals(jax_answer["explicit"]["programs"]["all_reduce"]["collectives"])}
