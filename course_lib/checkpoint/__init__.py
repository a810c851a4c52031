"""Checkpoints that survive failures (notebook 12): sharded save and load, resharding, atomicity,
async saves, the full training state, and elastic recovery.

    reshard.py     boxes of global tensors; a flat ZeRO range as boxes; copying overlaps
    slots.py       the records of what a rank holds: Slot, Piece, RankSlots
    layouts.py     what each rank holds (replicated, ZeRO flat shards, tensor parallel) as boxes
    hybrid.py      the same for composed dp x tp x pp layouts (course_lib.parallel.hybrid)
    format.py      the course's own format: one file per rank + metadata.json (global shapes, offsets)
    reader.py      loading it at any layout and world size; every corruption named (CheckpointError)
    atomic.py      temp directory + rename; the newest complete checkpoint
    async_save.py  the copy to host blocks, the write does not
    state.py       the full training state: model, optimizer, step, data position, every rank's RNG
    dcp.py         the same pieces through torch.distributed.checkpoint as the storage layer;
                   DCP on FSDP2's DTensor state dict, saved and resharded (notebook 12, section 7)
    per_param.py   the per-parameter stage 3 (course_lib.parallel.zero sharding="per_param") through
                   DCP: each rank's dim-0 rows a DTensor(Shard(0)), saved at N ranks, loaded at any M
    training.py    the training loop with periodic checkpoints, resumption and a kill on purpose
    interval.py    failures at scale and the Young/Daly checkpoint interval
    flat.py        ZeRO-3 flat shards saved as they are (exercise 12);  viz.py: notebook 12's figures
    live.py        live resharding trainer ranks -> generator ranks: the same boxes, sent by batch_isend_irecv
"""

from course_lib.checkpoint.async_save import AsyncCheckpointer
from course_lib.checkpoint.atomic import checkpoint_path, complete_checkpoints, latest_checkpoint, prune
from course_lib.checkpoint.format import CheckpointError, save_sharded
from course_lib.checkpoint.layouts import LAYOUTS, describe_layout
from course_lib.checkpoint.reader import CheckpointReader
from course_lib.checkpoint.reshard import Box, flat_range_boxes, index_runs, whole
from course_lib.checkpoint.slots import RankSlots, Piece, Slot
from course_lib.checkpoint.state import LoadInfo, capture_rng, load_training_state, restore_rng, save_training_state

__all__ = [
    "AsyncCheckpointer", "checkpoint_path", "complete_checkpoints", "latest_checkpoint", "prune",
    "CheckpointError", "save_sharded", "CheckpointReader", "LAYOUTS", "RankSlots", "Piece", "Slot",
    "describe_layout", "Box", "flat_range_boxes", "index_runs", "whole", "LoadInfo", "capture_rng",
    "load_training_state", "restore_rng", "save_training_state",
]
