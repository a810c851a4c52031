"""Four-bit floating point (FP4): the e2m1 element grid and its two block-scaled formats.

e2m1 (OCP Microscaling Formats (MX) Specification v1.0, 2023, FP4 E2M1): 1 sign, 2 exponent and
1 mantissa bit, exponent bias 1, no infinities or NaN. Its magnitudes are eight numbers::

    code  000  001  010  011  100  101  110  111
    value 0    0.5  1    1.5  2    3    4    6        (0.5 is subnormal; max 6 = 1.5 * 2^2, emax 2)

Next to 1 the values are 0.5 apart, next to 4 two apart: one mantissa bit, rounding error up to a
quarter of a value's power of two. Round to nearest, ties to even (the code whose last bit is 0:
0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 2.5 -> 2, 5 -> 4); past 6 a value saturates to +-6.

Eight numbers cannot hold a tensor: every block of consecutive elements along a row gets a scale
s, q = round(clamp(x / s, -6, 6)) and x ~ q * s. The two formats differ in the block and the scale:

    "mxfp4", granularity "mx32"   32 elements, s = 2^(floor(log2 amax) - 2) stored in e8m0 (a power of
                                  two, 1 byte: OCP MX v1.0 §6.3, emax of e2m1 = 2). amax lands in
                                  [4, 8) * s: a block whose amax lies in (6, 8) * s saturates it to 6.
    "nvfp4", granularity "nv16"   16 elements, s = e4m3 block scale * fp32 tensor scale (NVIDIA 2025,
                                  "Pretraining Large Language Models with NVFP4", arXiv:2509.25149, §2
                                  and App. B). The tensor's encode scale g = 6 * 448 / amax(tensor) maps
                                  the largest block scale onto e4m3's max; each block stores
                                  e4m3(amax_b / 6 * g) and decodes with that e4m3 number / g.

A block of zeros gets s = 1 (MX) or block scale 0 (NV): its elements quantize to 0, never 0/0.
On CPU, q is a float32 tensor holding e2m1 values exactly (`encode`/`decode` give the 4-bit codes);
torch's float4_e2m1fn_x2 is not used. `course_lib.techniques.fp8.quantize`/`dequantize` dispatch
here for fmt "mxfp4"/"nvfp4".

The NVFP4 training recipe's helpers: `round_e2m1(..., stochastic=True)` rounds up with probability
equal to the distance from the lower neighbour (unbiased: E[q] = y), and `random_hadamard(16)` is
the 16x16 random Hadamard transform H diag(+-1) / 4 that spreads an outlier over its block (an
orthogonal matrix, so its transpose undoes it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of codes 0b000 .. 0b111
E2M1_MAX = 6.0
E2M1_EMAX = 2  # 6 = 1.5 * 2^2: exponent of the largest power of two, the MX scale rule's emax_elem
E4M3_MAX = 448.0
FORMATS = {"mxfp4": "mx32", "nvfp4": "nv16"}  # each format's granularity
BLOCK = {"mx32": 32, "nv16": 16}
E8M0 = getattr(torch, "float8_e8m0fnu", None)  # MX scale dtype (torch 2.7+); else float32 powers of two


class NVScales(NamedTuple):
    """NVFP4's two scales: `block` e4m3 of shape (rows, K / 16), `tensor` the fp32 decode scale 1 / g."""

    block: torch.Tensor
    tensor: torch.Tensor


def _step(a: torch.Tensor) -> torch.Tensor:
    """Spacing of the e2m1 grid at magnitude a in [0, 6]: 0.5 below 2, 1 below 4, then 2."""
    return torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))


def round_e2m1(y: torch.Tensor, stochastic: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
    """y saturated to [-6, 6] and rounded onto the e2m1 grid (float32): to nearest, ties to even, or
    stochastically (up with probability (|y| - lower) / spacing). NaN stays NaN."""
    a = y.float().abs().clamp(max=E2M1_MAX)
    step = _step(a)
    if stochastic:
        lower = torch.floor(a / step) * step  # the grid point at or below a (the grid is k * step there)
        u = torch.rand(a.shape, generator=generator, device=a.device)
        m = lower + step * (u < (a - lower) / step)
    else:
        m = torch.round(a / step) * step  # torch.round: half to even; an even multiple is a code ending in 0
    return torch.where(y.isnan(), y.float(), m.copysign(y.float()))


def encode(q: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes (uint8 0..15: sign << 3 | magnitude code) of e2m1 values q."""
    grid = torch.tensor(E2M1_GRID, device=q.device)
    mag = (q.abs().unsqueeze(-1) == grid).float().argmax(-1)
    if not torch.equal(grid[mag], q.abs()):
        raise ValueError("q holds values off the e2m1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} (quantize first)")
    return (mag + 8 * q.signbit()).to(torch.uint8)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 values (float32) of 4-bit codes."""
    grid = torch.tensor(E2M1_GRID, device=codes.device)
    c = codes.long()
    return torch.where(c >= 8, -grid[c % 8], grid[c % 8])


def _rows(shape, granularity: str) -> tuple[int, int, int]:
    """(rows, K, block) of the (rows, K) view; ValueError when K does not divide into blocks."""
    if granularity not in BLOCK:
        raise ValueError(f"granularity={granularity!r} must be one of {tuple(BLOCK)} for FP4")
    if len(shape) == 0:
        raise ValueError("a 0-d tensor has no rows to scale: give x at least one dimension")
    k, rows, b = shape[-1], 1, BLOCK[granularity]
    for s in shape[:-1]:
        rows *= s
    if k % b:
        raise ValueError(f"granularity={granularity!r} needs the last dim K={k} divisible by {b} "
                         f"(blocks of {b} along each row); got shape {tuple(shape)}")
    return rows, k, b


def _check(fmt: str, granularity: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r} must be one of {tuple(FORMATS)} for FP4")
    if granularity != FORMATS[fmt]:
        raise ValueError(f"fmt={fmt!r} needs granularity={FORMATS[fmt]!r} "
                         f"({BLOCK[FORMATS[fmt]]}-element blocks), got granularity={granularity!r}")


def mx_scales(block_amax: torch.Tensor) -> torch.Tensor:
    """MX scales 2^(floor(log2 amax) - 2) in e8m0 (exponent clamped to e8m0's [-127, 127]); 1 for amax 0."""
    _, e = torch.frexp(block_amax)  # amax = m * 2^e with m in [0.5, 1): floor(log2 amax) = e - 1, exactly
    exp = torch.where(block_amax > 0, e - 1 - E2M1_EMAX, torch.zeros_like(e)).clamp(-127, 127)
    s = torch.pow(2.0, exp.float())
    return s.to(E8M0) if E8M0 is not None else s


def nv_scales(block_amax: torch.Tensor, tensor_amax: torch.Tensor) -> NVScales:
    """NVFP4's scales: g = 6 * 448 / tensor amax (1 for a zero tensor), block scales e4m3(amax_b / 6 * g)."""
    t = tensor_amax.float().reshape(())
    g = torch.where(t > 0, (E2M1_MAX * E4M3_MAX) / t, torch.ones_like(t))
    block = (block_amax.float() / E2M1_MAX * g).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    return NVScales(block, 1.0 / g)


def _decode_scale(scales, granularity: str) -> torch.Tensor:
    """Each block's fp32 decode scale s, shape (rows, K / block)."""
    if granularity == "nv16":
        if not isinstance(scales, NVScales):
            raise ValueError("granularity='nv16' needs NVScales(block, tensor) (NVFP4's two scales)")
        return scales.block.float() * scales.tensor.float()
    return scales.float()


def quantize(x: torch.Tensor, fmt: str, granularity: str, scales=None, stochastic: bool = False,
             generator: torch.Generator | None = None):
    """(q, scales): q = round_e2m1(x / s) in x's shape (float32 e2m1 values); scales of shape
    (rows, K / block): e8m0 for mxfp4, NVScales for nvfp4. Pass `scales` to use given ones."""
    _check(fmt, granularity)
    rows, k, b = _rows(x.shape, granularity)
    blocks = x.detach().float().reshape(rows, k // b, b)
    if scales is None:
        a = blocks.abs().amax(dim=-1)
        scales = mx_scales(a) if fmt == "mxfp4" else nv_scales(a, a.amax() if a.numel() else torch.zeros(()))
    s = _decode_scale(scales, granularity)
    if tuple(s.shape) != (rows, k // b):
        raise ValueError(f"scales of shape {tuple(s.shape)} must have shape {(rows, k // b)} for x of shape "
                         f"{tuple(x.shape)} with granularity={granularity!r}")
    s = s[:, :, None]
    y = torch.where(s > 0, blocks / torch.where(s > 0, s, 1.0), 0.0)  # a zero block scale: the block is 0
    return round_e2m1(y, stochastic, generator).reshape(x.shape), scales


def dequantize(q: torch.Tensor, scales, granularity: str, shape=None) -> torch.Tensor:
    """fp32 q * s of `shape` (default q's)."""
    shape = tuple(q.shape if shape is None else shape)
    rows, k, b = _rows(shape, granularity)
    if q.numel() != rows * k:
        raise ValueError(f"q has {q.numel()} elements, shape={shape} needs {rows * k}")
    s = _decode_scale(scales, granularity)
    return (q.float().reshape(rows, k // b, b) * s[:, :, None]).reshape(shape)


def bits_per_element(fmt: str) -> float:
    """Storage per element with the scales: 4 + 8/32 = 4.25 (mxfp4), 4 + 8/16 = 4.5 (nvfp4, + 4 B per tensor)."""
    _check(fmt, FORMATS.get(fmt, ""))
    return 4 + 8 / BLOCK[FORMATS[fmt]]


def hadamard(n: int) -> torch.Tensor:
    """Sylvester's n x n Hadamard matrix of +-1 (n a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"n={n} must be a power of two (Sylvester's construction)")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def random_hadamard(n: int = 16, generator: torch.Generator | None = None) -> torch.Tensor:
    """diag(random signs) H / sqrt(n): orthogonal (its transpose is its inverse); rows of x @ it mix
    each n-element group, so one large entry becomes n entries of 1/sqrt(n) its size."""
    signs = torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1
    return signs[:, None] * hadamard(n) / n**0.5


def blockwise(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x with every group of m.shape[0] consecutive elements along the last dim multiplied by m."""
    n = m.shape[0]
    if x.shape[-1] % n:
        raise ValueError(f"the last dim {x.shape[-1]} must divide into groups of {n}")
    return (x.reshape(*x.shape[:-1], -1, n) @ m).reshape(x.shape)
