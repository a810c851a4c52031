"""The full training state, and saving / loading it in the course format at any layout.

Resuming "as if never interrupted" needs more than the weights:

    model          parameters                      sharded as the layout holds them (layouts.py)
    optimizer      Adam's exp_avg, exp_avg_sq, step  sharded like the parameters they belong to
    step           how many optimizer steps ran    replicated
    data position  the batch sampler's generator   replicated: every rank draws the same global
                   state (and batches drawn)        batch indices and keeps its share, so the
                                                    position does not depend on the world size
    RNG states     torch (CPU, CUDA), Python,       one per rank: dropout masks differ per rank
                   NumPy generators of EVERY rank

Forget the optimizer state and Adam restarts with m = v = 0 (a loss spike); forget the data
position and the run sees some batches twice and others never; forget a rank's RNG and its
dropout masks change. Each is a silent divergence, which is why the tests compare the resumed
loss curve bit for bit with an uninterrupted one.

At a different world size a rank r < old world size gets rank r's RNG back; new ranks keep
their own seed (LoadInfo.rng_restored says which) — their dropout masks cannot match a run
that never had them.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch

from course_lib.checkpoint.format import _world, save_sharded
from course_lib.checkpoint.layouts import describe_layout, materialize_state, model_pieces, state_pieces
from course_lib.checkpoint.reader import CheckpointReader
from course_lib.dims import ParallelDims


def capture_rng() -> dict:
    """This process's generators as tensors and plain values (loadable with weights_only=True)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    except ImportError:  # numpy is optional
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class LoadInfo:
    step: int
    saved_world_size: int
    rng_restored: bool  # this rank got its own RNG states back
    bytes_read: int  # bytes of shard files this rank read
    extra: dict
    saved_dims: dict | None = None  # the ParallelDims (course_lib.dims) of the run that saved, when it said

    def resume_text(self, dims) -> str:
        """'saved at dp2·tp2·pp2, loading at dp1·tp2·pp2': how the layout changed across the resume."""
        saved = ParallelDims(**self.saved_dims).label() if self.saved_dims else f"{self.saved_world_size} ranks"
        return f"saved at {saved}, loading at {dims.label()}"


def training_state_pieces(model, optimizer, layout: str = "replicated", for_load: bool = False,
                          with_state: bool = True):
    """(layout object, pieces) of the model and the optimizer state on this rank."""
    lay = describe_layout(model, optimizer, layout)
    params = model_pieces(lay.load_slots if for_load else lay.save_slots)
    return lay, params + (state_pieces(lay) if optimizer is not None and with_state else [])


def _objects(step, data_generator, extra):
    objects = {"step": int(step)}
    if data_generator is not None:
        objects["data/generator"] = data_generator.get_state()
    objects.update({f"extra/{k}": v for k, v in (extra or {}).items()})
    return objects


def save_training_state(path, step: int, model, optimizer, layout: str = "replicated", data_generator=None,
                        extra: dict | None = None, group=None, saver=None, dims=None):
    """Collective: save the full training state after `step` steps into directory `path`.
    extra: replicated plain values to keep (e.g. the loss history). With saver (an
    AsyncCheckpointer) only the copy to host memory blocks; returns the blocking seconds then,
    the path otherwise. dims: the run's ParallelDims, recorded so that a resume can name both layouts."""
    _, pieces = training_state_pieces(model, optimizer, layout)
    meta = {"step": int(step), "layout": layout, "world_size": _world(group)[1]}
    if dims is not None:
        meta["dims"] = asdict(dims)
    args = (path, pieces, _objects(step, data_generator, extra), {"rng": capture_rng()}, group, meta)
    if saver is not None:
        return saver.save(*args)
    return save_sharded(*args)


def load_training_state(path, model, optimizer, layout: str = "replicated", data_generator=None,
                        group=None, restore_rng_state: bool = True, restore_optimizer_state: bool = True) -> LoadInfo:
    """Load a checkpoint saved at any layout and world size into this rank's (model, optimizer,
    data generator, RNG). Not collective: each rank reads only the files its boxes overlap.
    data_generator None, restore_*=False: leave that part as it is (to see what it costs)."""
    reader = CheckpointReader(path)
    lay = describe_layout(model, optimizer, layout)
    with_state = optimizer is not None and restore_optimizer_state
    if with_state:
        materialize_state(lay, reader.tensors)
    _, pieces = training_state_pieces(model, optimizer, layout, for_load=True, with_state=with_state)
    reader.fill(pieces)
    if data_generator is not None:
        data_generator.set_state(reader.object("data/generator"))
    rank = _world(group)[0]
    restored = restore_rng_state and reader.has_object(f"rank{rank}/rng")
    if restored:
        restore_rng(reader.object(f"rank{rank}/rng"))
    extra = {k.removeprefix("extra/"): reader.object(k) for k in reader.meta["objects"] if k.startswith("extra/")}
    return LoadInfo(int(reader.object("step")), reader.world_size, restored, reader.bytes_read, extra,
                    reader.extra.get("dims"))


__all__ = ["capture_rng", "restore_rng", "save_training_state", "load_training_state", "LoadInfo",
           "training_state_pieces"]
