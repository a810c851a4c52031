"""The MLP step in JAX, on emulated CPU devices: run as its own process, never imported by torch code.

    python course_lib/sharding/jax_program.py < request.json > answer.json

(course_lib.sharding.run.run_jax starts it with XLA_FLAGS=--xla_force_host_platform_device_count=8.)
It imports only jax, numpy and the standard library, so torch's and XLA's thread pools never
share a process. The request holds the data (whose shapes are the step's), the layouts
(course_lib.sharding.layouts, as JSON) and the programs to compile, each a layout and its
annotations on intermediates (course_lib.sharding.run.programs chooses them); the answer, for each
program, the compiled HLO text and the step's numbers:

    <layout>           jax.jit(step, in_shardings=..., out_shardings=...): the partitioner places the
                       collectives from the NamedShardings alone (pjit's modern spelling)
    fsdp_unannotated   the fsdp layout without the annotation that says the weights are used whole
    fsdp_h             ... with an annotation on the hidden activation h instead (batch-split)
    sp_h               the sp layout with h pinned as Megatron holds it (split by hidden features)
    tp_shard_map       Megatron written by hand per device (jax.shard_map, one psum), like the
                       course's ColumnParallelLinear / RowParallelLinear (when "shard_map" is set)
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def loss_fn(fc, proj, x, t, constrain):
    """mean((gelu(x fc^T) proj^T - t)^2), exact (erf) GELU as torch's default; constrain(name, v)
    may pin an intermediate's sharding."""
    x, fc, proj = constrain("x", x), constrain("fc", fc), constrain("proj", proj)
    h = constrain("h", jax.nn.gelu(x @ fc.T, approximate=False))
    y = constrain("y", h @ proj.T)
    return jnp.mean((y - t) ** 2)


def make_step(lr, constrain):
    def step(fc, proj, x, t):
        loss, (g_fc, g_proj, g_x) = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(fc, proj, x, t, constrain)
        return {"loss": loss, "g_fc": g_fc, "g_proj": g_proj, "g_x": g_x, "fc": fc - lr * g_fc, "proj": proj - lr * g_proj}
    return step


def mesh_of(axes):
    shape = tuple(size for _, size in axes)
    devices = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, tuple(name for name, _ in axes))


def spec(entries):
    return P(*entries)


def run_gspmd(layout, data, lr, constraints):
    mesh = mesh_of(layout["axes"])
    specs = {k: NamedSharding(mesh, spec(v)) for k, v in layout["specs"].items()}
    pinned = {k: NamedSharding(mesh, spec(v)) for k, v in constraints.items()}

    def constrain(name, v):
        return jax.lax.with_sharding_constraint(v, pinned[name]) if name in pinned else v

    out_shardings = {"loss": NamedSharding(mesh, P()), "g_fc": specs["fc"], "g_proj": specs["proj"],
                     "g_x": specs["x"], "fc": specs["fc"], "proj": specs["proj"]}
    step = jax.jit(make_step(lr, constrain), in_shardings=tuple(specs[k] for k in ("fc", "proj", "x", "t")),
                   out_shardings=out_shardings)
    args = [jax.device_put(data[k], specs[k]) for k in ("fc", "proj", "x", "t")]
    hlo = step.lower(*args).compile().as_text()
    return hlo, step(*args)


def run_shard_map(layout, data, lr):
    """Megatron by hand: each device holds fc's rows and proj's columns of its slice of the hidden
    features, computes a partial y and sums it (psum = g); dL/dx's sum over devices (f) is the
    transpose JAX derives for the replicated input x."""
    mesh = mesh_of(layout["axes"])
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # jax < 0.7
        from jax.experimental.shard_map import shard_map

    def local_loss(fc_r, proj_r, x, t):
        h = jax.nn.gelu(x @ fc_r.T, approximate=False)
        y = jax.lax.psum(h @ proj_r.T, "tp")
        return jnp.mean((y - t) ** 2)

    loss = shard_map(local_loss, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"), P(), P()), out_specs=P())

    def step(fc, proj, x, t):
        value, (g_fc, g_proj, g_x) = jax.value_and_grad(loss, argnums=(0, 1, 2))(fc, proj, x, t)
        return {"loss": value, "g_fc": g_fc, "g_proj": g_proj, "g_x": g_x, "fc": fc - lr * g_fc, "proj": proj - lr * g_proj}

    step = jax.jit(step)
    args = [jnp.asarray(data[k]) for k in ("fc", "proj", "x", "t")]
    return step.lower(*args).compile().as_text(), step(*args)


def main() -> None:
    request = json.load(sys.stdin)
    data = {k: np.asarray(v, dtype=np.float32) for k, v in request["data"].items()}
    lr, layouts = request["lr"], request["layouts"]
    answer = {"devices": len(jax.devices()), "platform": jax.devices()[0].platform, "programs": {}}
    for name, program in request["programs"].items():
        hlo, out = run_gspmd(layouts[program["layout"]], data, lr, program["use"])
        answer["programs"][name] = {"hlo": hlo, "out": {k: np.asarray(v).tolist() for k, v in out.items()}}
    if request["shard_map"]:
        hlo, out = run_shard_map(layouts["tp"], data, lr)
        answer["programs"]["tp_shard_map"] = {"hlo": hlo, "out": {k: np.asarray(v).tolist() for k, v in out.items()}}
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
