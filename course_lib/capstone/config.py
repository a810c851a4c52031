"""The capstone's config file: a small TOML, one key per degree, every key checked in the parent.

    [model]   n_layer, n_head, d_model, seq_len, n_experts, top_k   (the vocabulary is the dataset's)
    [train]   steps, batch_size, lr, grad_clip, seed, checkpoint_step, precision, recompute
              (activation_checkpointing = true / false, its old name, still loads as "full" /
              "none" with a FutureWarning; a config giving both is refused)
    [layout]  the fields of course_lib.dims.ParallelDims (dp, tp, pp required; ep, zero,
              virtual_stages, microbatches, schedule, sequence_parallel, cp, cp_method,
              cp_load_balance with its defaults) except the two of [train]: the first run, on
              dp*tp*pp*ep*cp ranks (cp: context parallelism, each rank T/cp tokens of every
              sequence; cp_method "ring", "allgather" or "ulysses"; cp_load_balance the zig-zag
              chunks, which need 2cp | seq_len)
    [resume]  the same keys: after losing ranks, another world size

load_config(path) checks every key (unknown, missing, wrong type or value, and each layout
against the model and the batch by ParallelDims.check) and raises ValueError naming the key,
before any rank starts. precision "bf16" = torch.autocast around forward and backward with the
parameters (the optimizer's master weights) in fp32; recompute "full" = every block
recomputes its forward in backward ("none": none does). Both apply to every layout and to the single-process twin.

An MoE model (n_experts > 0) trains without auxiliary losses (aux_loss_coef = z_loss_coef = 0)
and without capacity limit, so that every layout, pipelined or not, optimises the same
objective as the single process (the pipeline's last stage computes the cross-entropy only).
"""

from __future__ import annotations

import pathlib
import warnings
from dataclasses import MISSING, dataclass, fields

from course_lib._validate import check_int
from course_lib.data import CharDataset
from course_lib.dims import CP_METHODS, PRECISIONS, RECOMPUTE, SCHEDULES, ParallelDims
from course_lib.model import GPTConfig
from course_lib.train import TrainConfig

BOOL, TEXT = "bool", "text"  # kinds besides int and float
TRAIN_WIDE = ("precision", "recompute")  # ParallelDims fields set once, in [train], for both runs
REQUIRED = ("dp", "tp", "pp")  # the degrees a config must name; the other fields default as ParallelDims does


def layout_schema() -> dict:
    """[layout]'s keys: the ParallelDims fields (course_lib.dims), not a list kept by hand."""
    kinds = {"int": int, "bool": BOOL, "str": TEXT}
    out = {}
    for f in fields(ParallelDims):
        if f.name not in TRAIN_WIDE:
            default = None if f.name in REQUIRED or f.default is MISSING else f.default
            out[f.name] = (kinds[str(f.type)], default)
    return out


SCHEMA = {  # section -> {key: (kind, default or None = required)}
    "model": {"n_layer": (int, 2), "n_head": (int, 2), "d_model": (int, 16), "seq_len": (int, 16),
              "n_experts": (int, 0), "top_k": (int, 1)},
    "train": {"steps": (int, None), "batch_size": (int, 8), "lr": (float, 1e-2), "grad_clip": (float, 1.0),
              "seed": (int, 0), "checkpoint_step": (int, None), "precision": (TEXT, "fp32"),
              "recompute": (TEXT, "none")},
    "layout": layout_schema(),
    "resume": layout_schema(),
}
MINIMUM = {"zero": 0, "seed": 0, "n_experts": 0}
CHOICES = {"precision": PRECISIONS, "schedule": SCHEDULES, "recompute": RECOMPUTE, "cp_method": CP_METHODS}
# |loss - single process| allowed for a whole curve. fp32: only the order of sums differs
# (~1e-6). bf16: a tensor-parallel matmul rounds each rank's partial sum to bf16 before the
# all-reduce (one process rounds the full sum once), pipeline and expert layouts sum in other
# orders, and bf16 keeps 8 significant bits: ~1e-3 on these runs, allowed 1e-2.
TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2}


@dataclass(frozen=True)
class CapstoneConfig:
    model: object  # GPTConfig
    train: object  # TrainConfig
    checkpoint_step: int
    layout: object  # ParallelDims of steps 1..checkpoint_step (precision, recomputation included)
    resume: object  # ParallelDims of the steps after it

    @property
    def precision(self) -> str:
        return self.layout.precision

    @property
    def recompute(self) -> str:
        return self.layout.recompute

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.precision]


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


def _value(name: str, key: str, kind, value):
    """One value checked against its kind; errors read [section] key=..."""
    if kind is BOOL:
        if not isinstance(value, bool):
            raise ValueError(f"[{name}] {key}={value!r} must be true or false")
    elif kind is TEXT:
        if value not in CHOICES[key]:
            raise ValueError(f"[{name}] {key}={value!r} must be one of {CHOICES[key]}")
    elif kind is int:
        try:
            check_int(key, value, minimum=MINIMUM.get(key, 1))
        except ValueError as err:
            raise ValueError(f"[{name}] {err}") from None
    else:
        if isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, float) or value <= 0:
            raise ValueError(f"[{name}] {key}={value!r} must be a positive number")
    return value


def _section(raw: dict, name: str) -> dict:
    """{key: value} of one section, every key checked against SCHEMA."""
    given = raw.get(name)
    if not isinstance(given, dict):
        raise ValueError(f"[{name}] is missing: the config needs the sections {tuple(SCHEMA)}")
    for key in given:
        if key not in SCHEMA[name]:
            raise ValueError(f"[{name}] {key}: unknown key; [{name}] takes {tuple(SCHEMA[name])}")
    out = {}
    for key, (kind, default) in SCHEMA[name].items():
        if key not in given:
            if default is None:
                raise ValueError(f"[{name}] {key} is missing (required)")
            out[key] = default
        else:
            out[key] = _value(name, key, kind, given[key])
    return out


# [train] keys renamed: old name -> (new name, old value -> new value). A saved config with the
# old name still loads (FutureWarning naming the new key); one that gives both is refused.
RENAMED = {"activation_checkpointing": ("recompute", {True: "full", False: "none"})}


def _renamed(train: dict) -> dict:
    """[train] with every old key replaced by its new one (RENAMED)."""
    for old, (new, values) in RENAMED.items():
        if old not in train:
            continue
        if new in train:
            raise ValueError(f"[train] gives both {old} (the old name) and {new}: keep {new} only "
                             f"({'; '.join(f'{old} = {str(a).lower()} is {new} = {b!r}' for a, b in values.items())})")
        value = train[old]
        if not isinstance(value, bool):
            raise ValueError(f"[train] {old}={value!r} must be true or false (the old name of {new})")
        warnings.warn(f"[train] {old} is deprecated: write {new} = {values[value]!r} instead", FutureWarning,
                      stacklevel=3)
        train = {k: v for k, v in train.items() if k != old} | {new: values[value]}
    return train


def config_from_dict(raw: dict) -> CapstoneConfig:
    """CapstoneConfig from the parsed TOML; ValueError naming the key otherwise. An old key
    (RENAMED) loads as its new one, with a FutureWarning."""
    if isinstance(raw.get("train"), dict):
        raw = raw | {"train": _renamed(raw["train"])}
    for name in raw:
        if name not in SCHEMA:
            raise ValueError(f"[{name}]: unknown section; the config takes {tuple(SCHEMA)}")
    m, t = _section(raw, "model"), _section(raw, "train")
    if m["d_model"] % m["n_head"]:
        raise ValueError(f"[model] n_head={m['n_head']} must divide d_model={m['d_model']}")
    if m["n_experts"] and not m["top_k"] <= m["n_experts"]:
        raise ValueError(f"[model] top_k={m['top_k']} must be <= n_experts={m['n_experts']}")
    vocab = CharDataset("train", m["seq_len"]).vocab_size
    moe = dict(n_experts=m["n_experts"], top_k=m["top_k"], aux_loss_coef=0.0, z_loss_coef=0.0) \
        if m["n_experts"] else {}
    model = GPTConfig(vocab_size=vocab, block_size=m["seq_len"], n_layer=m["n_layer"], n_head=m["n_head"],
                      d_model=m["d_model"], **moe)
    if not 1 <= t["checkpoint_step"] < t["steps"]:
        raise ValueError(f"[train] checkpoint_step={t['checkpoint_step']} must be in [1, steps={t['steps']}): "
                         f"the resumed run needs at least one step of its own")
    train = TrainConfig(steps=t["steps"], batch_size=t["batch_size"], lr=t["lr"], grad_clip=t["grad_clip"],
                        seed=t["seed"], progress=False)
    layouts = {}
    for name in ("layout", "resume"):
        dims = ParallelDims(**_section(raw, name), precision=t["precision"],
                            recompute=t["recompute"])
        try:
            dims.check(None, model, train.batch_size)
        except ValueError as err:
            raise ValueError(f"[{name}] {err}") from None
        layouts[name] = dims
    return CapstoneConfig(model, train, t["checkpoint_step"], layouts["layout"], layouts["resume"])


def load_config(path) -> CapstoneConfig:
    return config_from_dict(read_toml(path))
