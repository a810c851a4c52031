"""The capstone (notebook 12): train a 3D layout, checkpoint it, lose ranks, resume at another
world size, and check the whole loss curve against the single process.

A run is described by a small TOML file, one key per degree (configs/capstone_tiny.toml):

    [model]   n_layer, n_head, d_model, seq_len          (the vocabulary is the dataset's)
    [train]   steps, batch_size, lr, grad_clip, seed, checkpoint_step
    [layout]  dp, tp, pp, zero, microbatches             the first run: dp*tp*pp ranks
    [resume]  dp, tp, pp, zero, microbatches             after losing ranks: another world size

    steps     1 .. checkpoint_step          | checkpoint_step+1 .. steps
    layout    [layout] on dp*tp*pp ranks    | [resume] on its own dp*tp*pp ranks
              saves the full training state | loads it, resharded by global offsets

load_config(path) checks every key (unknown, missing, wrong type, and each layout against the
model and the batch by ParallelDims.check) and raises ValueError naming the key, in the parent,
before any rank starts. train_segment is the rank code of one segment; run_capstone the parent.
"""

from __future__ import annotations

import contextlib
import pathlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEGREES = ("dp", "tp", "pp", "zero", "microbatches")
SCHEMA = {  # section -> {key: (type, default or REQUIRED)}
    "model": {"n_layer": (int, 2), "n_head": (int, 2), "d_model": (int, 16), "seq_len": (int, 16)},
    "train": {"steps": (int, None), "batch_size": (int, 8), "lr": (float, 1e-2), "grad_clip": (float, 1.0),
              "seed": (int, 0), "checkpoint_step": (int, None)},
    "layout": {"dp": (int, None), "tp": (int, None), "pp": (int, None), "zero": (int, 0), "microbatches": (int, 1)},
    "resume": {"dp": (int, None), "tp": (int, None), "pp": (int, None), "zero": (int, 0), "microbatches": (int, 1)},
}
MINIMUM = {"zero": 0, "seed": 0}


@dataclass(frozen=True)
class CapstoneConfig:
    model: object  # GPTConfig
    train: object  # TrainConfig
    checkpoint_step: int
    layout: object  # ParallelDims of steps 1..checkpoint_step
    resume: object  # ParallelDims of the steps after it


def read_toml(path) -> dict:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # Python 3.10: the same parser under its older name, if installed
        try:
            import tomli as tomllib
        except ModuleNotFoundError as err:
            raise ValueError("reading a TOML config needs Python >= 3.11 (tomllib) or the tomli package") from err
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"config file {str(path)!r} is not valid TOML: {err}") from err


def _section(raw: dict, name: str) -> dict:
    """{key: value} of one section, every key checked against SCHEMA; errors read [section] key=..."""
    given = raw.get(name)
    if not isinstance(given, dict):
        raise ValueError(f"[{name}] is missing: the config needs the sections {tuple(SCHEMA)}")
    out = {}
    for key in given:
        if key not in SCHEMA[name]:
            raise ValueError(f"[{name}] {key}: unknown key; [{name}] takes {tuple(SCHEMA[name])}")
    for key, (kind, default) in SCHEMA[name].items():
        if key not in given:
            if default is None:
                raise ValueError(f"[{name}] {key} is missing (required)")
            out[key] = default
            continue
        value = given[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int:
            from course_lib._validate import check_int

            try:
                check_int(key, value, minimum=MINIMUM.get(key, 1))
            except ValueError as err:
                raise ValueError(f"[{name}] {err}") from None
        elif not isinstance(value, float) or value <= 0:
            raise ValueError(f"[{name}] {key}={value!r} must be a positive number")
        out[key] = value
    return out


def config_from_dict(raw: dict) -> CapstoneConfig:
    """CapstoneConfig from the parsed TOML; ValueError naming the key otherwise."""
    from course_lib.data import CharDataset
    from course_lib.model import GPTConfig
    from course_lib.parallel.hybrid import ParallelDims
    from course_lib.train import TrainConfig

    for name in raw:
        if name not in SCHEMA:
            raise ValueError(f"[{name}]: unknown section; the config takes {tuple(SCHEMA)}")
    m, t = _section(raw, "model"), _section(raw, "train")
    vocab = CharDataset("train", m["seq_len"]).vocab_size
    model = GPTConfig(vocab_size=vocab, block_size=m["seq_len"], n_layer=m["n_layer"], n_head=m["n_head"],
                      d_model=m["d_model"])
    if m["d_model"] % m["n_head"]:
        raise ValueError(f"[model] n_head={m['n_head']} must divide d_model={m['d_model']}")
    if not 1 <= t["checkpoint_step"] < t["steps"]:
        raise ValueError(f"[train] checkpoint_step={t['checkpoint_step']} must be in [1, steps={t['steps']}): "
                         f"the resumed run needs at least one step of its own")
    train = TrainConfig(steps=t["steps"], batch_size=t["batch_size"], lr=t["lr"], grad_clip=t["grad_clip"],
                        seed=t["seed"], progress=False)
    layouts = {}
    for name in ("layout", "resume"):
        dims = ParallelDims(**_section(raw, name))
        try:
            dims.check(None, model, train.batch_size)
        except ValueError as err:
            raise ValueError(f"[{name}] {err}") from None
        layouts[name] = dims
    return CapstoneConfig(model, train, t["checkpoint_step"], layouts["layout"], layouts["resume"])


def load_config(path) -> CapstoneConfig:
    return config_from_dict(read_toml(path))


def layout_text(dims) -> str:
    return f"dp{dims.dp} x tp{dims.tp} x pp{dims.pp} ({dims.world_size} ranks, ZeRO-{dims.zero})"


def train_segment(dims, model_config, train_cfg, checkpoint_dir, first: int, last: int,
                  trace: bool = False, progress: bool = False):
    """Rank code: steps first..last (1-based) of the composed model at layout dims. first > 1
    loads the checkpoint of step first-1 from checkpoint_dir (saved at any layout); the state
    after step `last` is saved there. Returns a HybridResult: the global loss of every step
    1..last (those before `first` from the checkpoint), the seconds of each step run, the traffic of each mesh dimension (trace=True) and the parameters this rank owns."""
    from course_lib.checkpoint import checkpoint_path, load_training_state, save_training_state
    from course_lib.data import CharDataset, get_batch
    from course_lib.observe.tracer import CommTracer
    from course_lib.parallel.hybrid import (HybridResult, build_hybrid, clip_grad_norm_hybrid,
                                            make_forward_backward, make_hybrid_optimizer, owned_params,
                                            traffic_by_dimension, trained_module)
    from course_lib.runtime.device import rank_device
    from course_lib.train import train_step

    world = dist.get_world_size()
    dims.check(world, model_config, train_cfg.batch_size)
    dev = rank_device()
    parts = build_hybrid(dims, model_config, seed=train_cfg.seed, device=dev)
    optimizer = make_hybrid_optimizer(parts, train_cfg)
    dataset = CharDataset("train", block_size=model_config.block_size)
    gen = torch.Generator().manual_seed(train_cfg.seed)  # the data position: saved and restored
    root = pathlib.Path(checkpoint_dir)
    result = HybridResult(coords=dict(parts.coords))
    if first > 1:
        info = load_training_state(checkpoint_path(root, first - 1), parts, optimizer, "hybrid", gen)
        if info.step != first - 1:
            raise ValueError(f"checkpoint of step {info.step} found where step {first - 1} was expected")
        result.train_losses = list(info.extra["losses"])  # the curve so far, whatever layout ran it
    replica, share = parts.coords["dp"], train_cfg.batch_size // dims.dp

    forward_backward = make_forward_backward(parts, dims)

    steps = range(first, last + 1)
    if progress and dist.get_rank() == 0:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc=f"{layout_text(dims)}", leave=True)
    tracer = CommTracer() if trace else contextlib.nullcontext()
    with tracer:
        for _ in steps:
            x, y = get_batch(dataset, train_cfg.batch_size, gen)
            rows = slice(replica * share, (replica + 1) * share)
            start = time.perf_counter()
            loss = train_step(trained_module(parts), optimizer, x[rows].to(dev), y[rows].to(dev),
                              train_cfg.grad_clip, forward_backward=forward_backward,
                              clip_grad_norm=lambda c: clip_grad_norm_hybrid(parts, c))
            result.step_seconds.append(time.perf_counter() - start)
            mean = torch.tensor(loss / dims.dp, dtype=torch.float64, device=dev)
            if dims.dp > 1:  # the global loss: the mean over the replicas
                dist.all_reduce(mean, group=parts.groups["dp"])
            result.train_losses.append(float(mean))
    if trace:
        result.comm_summary = tracer.summary()
        result.traffic = traffic_by_dimension(tracer.records, dims, world)
    save_training_state(checkpoint_path(root, last), last, parts, optimizer, "hybrid", gen,
                        extra={"losses": list(result.train_losses)})
    result.named_params = owned_params(parts)
    return result


@dataclass
class CapstoneRun:
    """What run_capstone measured: rank 0's result of each segment (global losses), the single
    process's losses, and the largest |difference| between the two curves."""

    config: CapstoneConfig
    first: object  # HybridResult of rank 0, steps 1..checkpoint_step
    resumed: object  # HybridResult of rank 0: losses of steps 1..steps, seconds of the steps after the save
    traffic: list  # per rank of the first segment: {dim: {calls, bytes_sent, bytes_recv}}
    single_losses: list
    max_difference: float
    params: dict  # {single-process name: full tensor} after the last step, from every rank

    @property
    def losses(self) -> list[float]:
        """The whole curve, steps 1..steps (the resumed run carries the first segment's losses)."""
        return self.resumed.train_losses


def run_capstone(config: CapstoneConfig, checkpoint_dir, timeout_s: float = 300, progress: bool = False) -> CapstoneRun:
    """Parent side: both segments on their own ranks, then the single process on the same batches;
    progress: a bar over the 2 * steps steps (both segments, then the single process)."""
    from course_lib.parallel.hybrid import merged_params, train_single
    from course_lib.runtime import run_on_ranks

    from tqdm.auto import tqdm

    c = config
    # The ranks' own output reaches the parent only after they finish, so the bar counts steps here
    bar = tqdm(total=2 * c.train.steps, desc="capstone", unit="step", disable=not progress)
    bar.set_postfix_str(f"{layout_text(c.layout)}, steps 1..{c.checkpoint_step}")
    first = run_on_ranks(train_segment, c.layout, c.model, c.train, str(checkpoint_dir), 1, c.checkpoint_step,
                         trace=True, world_size=c.layout.world_size, timeout_s=timeout_s)
    bar.update(c.checkpoint_step)
    bar.set_postfix_str(f"resumed at {layout_text(c.resume)}")
    resumed = run_on_ranks(train_segment, c.resume, c.model, c.train, str(checkpoint_dir), c.checkpoint_step + 1,
                           c.train.steps, world_size=c.resume.world_size, timeout_s=timeout_s)
    bar.update(c.train.steps - c.checkpoint_step)
    bar.set_postfix_str("single process")
    single = train_single(c.model, c.train).train_losses
    bar.update(c.train.steps)
    bar.close()
    losses = resumed[0].train_losses
    diff = max(abs(a - b) for a, b in zip(losses, single))
    return CapstoneRun(c, first[0], resumed[0], [r.traffic for r in first], single, diff, merged_params(resumed))


__all__ = ["CapstoneConfig", "load_config", "config_from_dict", "layout_text", "train_segment", "run_capstone",
           "CapstoneRun", "SCHEMA"]
