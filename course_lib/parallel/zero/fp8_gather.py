"""ZeRO-3's parameter all-gather in FP8: `apply_zero(..., stage=3, gather_dtype="fp8")`.

Stage 3 (stage3.py) all-gathers every unit's flat parameters before forward and again before
backward. With gather_dtype="fp8" each rank quantizes its fp32 shard of S elements to e4m3 with
one per-tensor scale (course_lib.techniques.fp8: s = amax / 448, q = round(x / s)), and the
ranks all-gather ONE uint8 message per rank: the S payload bytes followed by the scale's 4
bytes (fp32 viewed as bytes; packing them keeps one collective per gather, as in bf16). Every
rank then dequantizes rank r's chunk with rank r's scale into the unit's buffer (compute_dtype).
Per gather a rank's output holds

    N * (S + 4) bytes            against N * S * 2 for a bf16 gather (N * S * 4 for fp32)

so the gather moves half of bf16's bytes plus 4 bytes per rank. Only the gather changes: the
gradient's reduce-scatter stays in the gradient dtype, the optimizer updates the fp32 shards.

The error is e4m3's rounding after scaling: an element x of a shard with scale s comes back as
dequantize(quantize(x)), |x - x'| <= 2^-4 |x| while |x| / s >= 2^-6 (e4m3's normal range: 3
mantissa bits, half a spacing of 2^-3), and <= 2^-10 s below it (half the subnormal spacing
2^-9); a bf16 buffer adds bf16's own rounding (2^-9 relative) on top. The gathered buffer is
exactly the concatenation of the ranks' dequantize(quantize(shard)), which the tests check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.comm.compat import all_gather_single
from course_lib.techniques.fp8 import dequantize, quantize

GATHER_DTYPES = (None, "fp8")  # None: the compute_dtype's own bytes
SCALE_BYTES = 4  # one fp32 scale per rank's shard, sent with it


def check_gather_dtype(gather_dtype, stage, sharding: str = "flat") -> None:
    """ValueError naming the value and the rule; called before any collective."""
    if gather_dtype not in GATHER_DTYPES:
        raise ValueError(f"gather_dtype={gather_dtype!r} must be one of {GATHER_DTYPES} (None gathers in the "
                         f"compute dtype)")
    if gather_dtype is None:
        return
    if isinstance(stage, bool) or stage != 3:
        raise ValueError(f"gather_dtype={gather_dtype!r} needs stage=3: only stage 3 all-gathers the parameters "
                         f"before using them (stages 1-2 gather updated weights that stay), got stage={stage!r}")
    if sharding != "flat":
        raise ValueError(f"gather_dtype={gather_dtype!r} is built for sharding='flat' (one buffer per unit), "
                         f"got sharding={sharding!r}")


def gather_bytes(padded_numel: int, world_size: int, gather_dtype=None, element_size: int = 2) -> int:
    """Bytes of one unit's gathered output on a rank (the tracer's bytes_recv): N (S + 4) for
    fp8, padded_numel * element_size otherwise (S = padded_numel / N)."""
    if gather_dtype == "fp8":
        return padded_numel + world_size * SCALE_BYTES
    return padded_numel * element_size


def pack_shard(shard: torch.Tensor) -> torch.Tensor:
    """The uint8 message of a 1-D fp32 shard: S e4m3 bytes then its fp32 scale's 4 bytes."""
    q, s = quantize(shard.reshape(1, -1), "e4m3", "tensor")
    return torch.cat([q.reshape(-1).view(torch.uint8), s.reshape(1).float().view(torch.uint8)])


def unpack_into(out: torch.Tensor, gathered: torch.Tensor, world_size: int) -> None:
    """Dequantize the N gathered messages into `out` (N * S elements, any float dtype)."""
    k = gathered.numel() // world_size - SCALE_BYTES  # S
    for r, msg in enumerate(gathered.view(world_size, k + SCALE_BYTES)):
        q = msg[:k].view(torch.float8_e4m3fn)
        s = msg[k:].clone().view(torch.float32).reshape(1, 1)  # clone: a 4-byte-aligned copy
        out[r * k:(r + 1) * k].copy_(dequantize(q, s, "tensor", (1, k)).reshape(-1))


class FP8Gather:
    """An async FP8 all-gather into `out`: wait() finishes the collective and dequantizes
    (stage3.py's wait_gather calls it like the work handle of a plain all-gather)."""

    def __init__(self, out: torch.Tensor, shard: torch.Tensor, group=None):
        self.out, self.n = out, dist.get_world_size(group)
        msg = pack_shard(shard.detach().float())
        self.gathered = torch.empty(self.n * msg.numel(), dtype=torch.uint8, device=msg.device)
        self.work = all_gather_single(self.gathered, msg, group=group, async_op=True)

    def wait(self) -> None:
        self.work.wait()
        with torch.no_grad():
            unpack_into(self.out, self.gathered, self.n)
        self.gathered = None
