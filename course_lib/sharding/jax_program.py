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
    <layout>_shard_map Megatron written by hand per device (jax.shard_map, one psum), like the
                       course's ColumnParallelLinear / RowParallelLinear, for each layout in
                       "shard_map" (tp; dp_tp adds the batch split over dp)
    dp_tp_explicit     the dp_tp layout in explicit mode (when "explicit" is set): the mesh's axes are
                       AxisType.Explicit, each array's sharding is part of its type (jax.typeof, e.g.
                       float32[4@dp,8,16]); the answer adds the types at each step, and "explicit"
                       says what explicit mode refused and the variants (EXPLICIT_Y)
"""

from __future__ import annotations

import inspect
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
    transpose JAX derives for the replicated input x. On a dp x tp mesh each device also holds
    its rows of the batch: its loss is their mean, averaged over dp (pmean), whose transpose sums
    the weight gradients over dp."""
    mesh = mesh_of(layout["axes"])
    batch = tuple(axis for axis, _ in layout["axes"] if axis != "tp")
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # jax < 0.7
        from jax.experimental.shard_map import shard_map

    def local_loss(fc_r, proj_r, x, t):
        h = jax.nn.gelu(x @ fc_r.T, approximate=False)
        y = jax.lax.psum(h @ proj_r.T, "tp")
        loss = jnp.mean((y - t) ** 2)
        return jax.lax.pmean(loss, batch) if batch else loss

    in_specs = tuple(spec(layout["specs"][k]) for k in ("fc", "proj", "x", "t"))
    loss = shard_map(local_loss, mesh=mesh, in_specs=in_specs, out_specs=P())

    def step(fc, proj, x, t):
        value, (g_fc, g_proj, g_x) = jax.value_and_grad(loss, argnums=(0, 1, 2))(fc, proj, x, t)
        return {"loss": value, "g_fc": g_fc, "g_proj": g_proj, "g_x": g_x, "fc": fc - lr * g_fc, "proj": proj - lr * g_proj}

    step = jax.jit(step)
    args = [jnp.asarray(data[k]) for k in ("fc", "proj", "x", "t")]
    return step.lower(*args).compile().as_text(), step(*args)


# The row-parallel matmul y = h proj^T in explicit mode, four ways: its contracting dim (the hidden
# features) is split over tp in both operands, so each device holds a partial sum of y, and what y
# becomes must be said. "refused": nothing said; "all_reduce": y whole over tp (Megatron's g, the
# layout's own annotation on y); "reduce_scatter": y split along the sequence over tp (sequence
# parallelism's reduce-scatter); "auto_axes": this one matmul handed back to the compiler.
EXPLICIT_Y = {"refused": None, "all_reduce": ("dp", None, None), "reduce_scatter": ("dp", "tp", None),
              "auto_axes": ("dp", None, None)}


def explicit_available():
    """None, or why this jax has no explicit sharding mode."""
    axis_type = getattr(jax.sharding, "AxisType", None)
    needs = (hasattr(axis_type, "Explicit"), hasattr(jax, "typeof"), hasattr(jax, "set_mesh"),
             hasattr(jax.sharding, "auto_axes"), "out_sharding" in inspect.signature(jnp.matmul).parameters)
    if not all(needs):
        return (f"jax {jax.__version__} has no explicit sharding mode as used here (jax.sharding.AxisType.Explicit, "
                "jax.typeof, jax.set_mesh, jax.sharding.auto_axes, jnp.matmul(..., out_sharding=))")
    return None


def explicit_loss(fc, proj, x, t, how, types):
    """loss_fn in explicit mode; types[name] = jax.typeof(value) as text, at trace time."""
    for name, value in (("x", x), ("fc", fc), ("proj", proj)):
        types[name] = str(jax.typeof(value))
    h = jax.nn.gelu(x @ fc.T, approximate=False)
    types["h"] = str(jax.typeof(h))
    y_spec = None if EXPLICIT_Y[how] is None else P(*EXPLICIT_Y[how])
    if how == "auto_axes":
        y = jax.sharding.auto_axes(lambda a, b: a @ b.T, out_sharding=y_spec)(h, proj)
    else:
        y = jnp.matmul(h, proj.T, out_sharding=y_spec)  # the one line: the type of y
    types["y"] = str(jax.typeof(y))
    loss = jnp.mean((y - t) ** 2)
    types["loss"] = str(jax.typeof(loss))
    return loss


def run_explicit(layout, data, lr, how):
    """One step of the layout with every mesh axis Explicit: the inputs' types come from
    device_put, jit needs no shardings. (hlo, step's numbers, {value: type}); a refused program
    raises at trace time (jax's ShardingTypeError)."""
    from jax.sharding import AxisType
    names = tuple(name for name, _ in layout["axes"])
    shape = tuple(size for _, size in layout["axes"])
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names),
                         devices=jax.devices()[:int(np.prod(shape))])
    types = {}

    def step(fc, proj, x, t):
        loss, (g_fc, g_proj, g_x) = jax.value_and_grad(explicit_loss, argnums=(0, 1, 2))(fc, proj, x, t, how, types)
        for name, value in (("g_fc", g_fc), ("g_proj", g_proj), ("g_x", g_x)):
            types[name] = str(jax.typeof(value))
        return {"loss": loss, "g_fc": g_fc, "g_proj": g_proj, "g_x": g_x, "fc": fc - lr * g_fc, "proj": proj - lr * g_proj}

    with jax.set_mesh(mesh):
        args = [jax.device_put(data[k], P(*layout["specs"][k])) for k in ("fc", "proj", "x", "t")]
        step = jax.jit(step)
        hlo = step.lower(*args).compile().as_text()
        return hlo, step(*args), types


def explicit_programs(layout, data, lr):
    """{"programs": {variant: {hlo, out, types}}, "refused": the error's class and message} for
    every variant of EXPLICIT_Y, or {"unavailable": why}."""
    why = explicit_available()
    if why:
        return {"unavailable": why}
    answer = {"programs": {}}
    for how in EXPLICIT_Y:
        try:
            hlo, out, types = run_explicit(layout, data, lr, how)
        except Exception as error:  # noqa: BLE001 - the refusal is the answer; any other variant re-raises
            if how != "refused":
                raise
            answer["refused"] = {"error": type(error).__name__, "message": str(error).split("\n")[0]}
            continue
        if how == "refused":
            raise RuntimeError("explicit mode accepted the row-parallel matmul without out_sharding")
        answer["programs"][how] = {"hlo": hlo, "out": {k: np.asarray(v).tolist() for k, v in out.items()}, "types": types}
    return answer


def main() -> None:
    request = json.load(sys.stdin)
    data = {k: np.asarray(v, dtype=np.float32) for k, v in request["data"].items()}
    lr, layouts = request["lr"], request["layouts"]
    answer = {"devices": len(jax.devices()), "platform": jax.devices()[0].platform, "programs": {}}
    for name, program in request["programs"].items():
        hlo, out = run_gspmd(layouts[program["layout"]], data, lr, program["use"])
        answer["programs"][name] = {"hlo": hlo, "out": {k: np.asarray(v).tolist() for k, v in out.items()}}
    for name in request["shard_map"]:
        hlo, out = run_shard_map(layouts[name], data, lr)
        answer["programs"][f"{name}_shard_map"] = {"hlo": hlo, "out": {k: np.asarray(v).tolist() for k, v in out.items()}}
    if request["explicit"]:
        answer["explicit"] = explicit_programs(layouts[request["explicit"]], data, lr)
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
