"""Eight-bit floating point (FP8) training: the formats, scaled casts, an FP8 linear layer.

The two formats (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; the OCP 8-bit
floating point specification, 2023), as torch stores them::

    e4m3  torch.float8_e4m3fn  1/4/3 bits, bias 7    max 448   = 1.75 * 2^8    normal >= 2^-6,  subnormal >= 2^-9
    e5m2  torch.float8_e5m2    1/5/2 bits, bias 15   max 57344 = 1.75 * 2^15   normal >= 2^-14, subnormal >= 2^-16

e4m3 ("E4M3FN": finite) has no infinities and two NaNs, S.1111.111 with either sign, which frees the
other top-exponent patterns to reach 448; e5m2 keeps IEEE's inf and NaN (OCP OFP8 spec, Table 2).
Next to 1.0 e4m3's numbers are 2^-3 apart (rounding error up to 2^-4 relative), e5m2's 2^-2.

Scaled cast. A tensor's values rarely sit in [2^-9, 448], so each group of elements gets a
scale s that maps the group's largest magnitude (amax) onto the format's max:

    s = amax / max          q = round(clamp(x / s, -max, max))          x ~ q * s   (dequantize)

The clamp is the OCP spec's saturating conversion: past max a value becomes +-max, not NaN or
inf (torch's own casts differ: e4m3fn saturates, e5m2 overflows to inf, so we clamp first).
A group of zeros (amax = 0) gets s = 1, never 0/0. The groups (`granularity`), on the tensor
viewed as (rows, K) with K its last dim:

    "tensor"    one scale                          (per-tensor; Micikevicius et al. 2022)
    "row"       one per row (token or output channel)
    "tile128"   one per 1x128 tile of a row        (DeepSeek-AI 2024, V3 report §3.3: activations)
    "block128"  one per 128x128 block              (the same report: weights)
    "mx32"      one per 32 elements of a row, a power of two stored in 8 bits (e8m0):
                s = 2^(floor(log2 amax) - emax), emax = 8 for e4m3, 15 for e5m2 (OCP Microscaling
                Formats (MX) v1.0, 2023). x/s can reach just under 2^(emax+1) > max: it saturates.

fmt "mxfp8" is e4m3 elements with "mx32" scales (MXFP8); "mx32" also takes e5m2 elements.
Four bits: `quantize(x, "mxfp4", "mx32")` and `quantize(x, "nvfp4", "nv16")` (e2m1 elements in
32-element blocks with e8m0 scales, or 16-element blocks with e4m3 scales and an fp32 tensor scale)
go to course_lib.techniques.fp4, and so does `dequantize` for "nv16"; RECIPES "mxfp4" and "nvfp4"
run FP8Linear's matmuls on those formats (the same regrouping in backward).
Which format where: the per-tensor recipes are "hybrid", e4m3 forward and e5m2 for gradients (one
scale must span a gradient's range); the fine-grained ones use e4m3 for every tensor, their small
groups giving the range (DeepSeek-AI 2024, V3 report §3.3.2; Transformer Engine's Float8BlockScaling
and MXFP8BlockScaling default to E4M3, its per-tensor recipes to HYBRID).
Current scaling takes s from this step's amax; delayed scaling (`AmaxHistory`) from the largest
amax of the last few steps, which a GPU can compute before the tensor exists, at the risk of
saturating a value that outgrows the history.

`FP8Linear` runs the three matmuls of a linear layer on scaled FP8 inputs: forward x W^T on e4m3
x and W; backward dX = dY W and dW = dY^T X with dY in the recipe's backward format and the e4m3
x and W saved by forward (1 byte each: the activation saving), products accumulated in fp32.
A kernel's groups run along its contraction dim, and backward contracts over other dims (dX over
W's output rows, dW over the tokens): groups along a row ("row", "tile128", "mx32") are remade as
the kernels do, the saved x and W dequantized, transposed and quantized again (DeepSeek-V3 §3.5.2:
1x128 tiles become 128x1), dY quantized both ways from its high-precision value. One scale per
tensor, or square 128x128 blocks, are the same groups either way. On CPU the matmuls run in fp32
on the exact dequantized values: the numerics are the lesson, the speed is the GPU's. On CUDA, per-tensor or row-wise scales go
through torch._scaled_mm for the forward (the hardware FP8 path, fp8_hardware.py) on GPUs of
compute capability 8.9 or newer; an older GPU falls back to the emulation and warns once. `all_gather_fp8` gathers FP8 shards and their scales (ZeRO-3/FSDP's
parameter all-gather at half of bf16's bytes) and dequantizes them; ZeRO-3 does the same inside
its unit gathers with apply_zero(..., stage=3, gather_dtype="fp8") (course_lib.parallel.zero.fp8_gather).
(A little over 300 lines: the casts, the layer and the gather share one set of scale rules.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from course_lib._validate import check_int
from course_lib.comm.compat import all_gather_single
from course_lib.techniques import fp4
from course_lib.techniques.fp8_hardware import scaled_mm_forward

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FMT_NAMES = ("e4m3", "e5m2", "mxfp8")
GRANULARITIES = ("tensor", "row", "tile128", "block128", "mx32")
BLOCKS = {"tensor": None, "row": None, "tile128": (1, 128), "block128": (128, 128), "mx32": (1, 32), "nv16": (1, 16)}
ALONG_ROWS = ("row", "tile128", "mx32", "nv16")  # groups that lie along a row: transposing changes them
EMAX = {"e4m3": 8, "e5m2": 15}  # exponent of each format's largest power of two (448 = 1.75 * 2^8)
E8M0 = getattr(torch, "float8_e8m0fnu", None)  # MX scale dtype (torch 2.7+); else float32 powers of two


def fmt_max(fmt: str) -> float:
    """Largest finite value: 448 for e4m3, 57344 for e5m2 (mxfp8: its e4m3 elements)."""
    return float(torch.finfo(FORMATS[_element(fmt)]).max)


def _element(fmt: str, granularity: str | None = None) -> str:
    """The element format's name; ValueError for an unknown fmt, or mxfp8 without its mx32 scales."""
    if fmt not in FMT_NAMES:
        raise ValueError(f"fmt={fmt!r} must be one of {FMT_NAMES}")
    if fmt == "mxfp8" and granularity not in (None, "mx32"):
        raise ValueError(f"fmt='mxfp8' needs granularity='mx32' (32-element blocks with power-of-two "
                         f"scales), got granularity={granularity!r}")
    return "e4m3" if fmt == "mxfp8" else fmt


def _blocks(shape, granularity: str) -> tuple[int, int, int, int]:
    """(rows, K, block rows, block cols) of the (rows, K) view; ValueError when a dim does not divide."""
    if granularity not in BLOCKS:  # GRANULARITIES and FP4's "nv16"
        raise ValueError(f"granularity={granularity!r} must be one of {GRANULARITIES} (or 'nv16' for nvfp4)")
    if len(shape) == 0:
        raise ValueError("a 0-d tensor has no rows to scale: give x at least one dimension")
    k = shape[-1]
    rows = 1
    for s in shape[:-1]:
        rows *= s
    br, bc = BLOCKS[granularity] or {"tensor": (rows, k), "row": (1, k)}[granularity]
    if k % bc:
        raise ValueError(f"granularity={granularity!r} needs the last dim K={k} divisible by {bc} "
                         f"(groups of {bc} along each row); got shape {tuple(shape)}")
    if rows % br:
        raise ValueError(f"granularity={granularity!r} needs the rows ({rows} = product of the leading dims) "
                         f"divisible by {br} ({br}x{bc} blocks); got shape {tuple(shape)}")
    return rows, k, br, bc


def amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """Largest |x| of each group: shape (rows / block rows, K / block cols), fp32."""
    rows, k, br, bc = _blocks(x.shape, granularity)
    return x.detach().float().reshape(rows // br, br, k // bc, bc).abs().amax(dim=(1, 3))


def scales_from_amax(a: torch.Tensor, fmt: str, granularity: str) -> torch.Tensor:
    """The dequantization scales for group maxima `a` (module docstring's formulas)."""
    el = _element(fmt, granularity)
    if granularity == "mx32":
        _, e = torch.frexp(a)  # a = m * 2^e with m in [0.5, 1): floor(log2 a) = e - 1, exactly
        exp = torch.where(a > 0, e - 1 - EMAX[el], torch.zeros_like(e)).clamp(-127, 127)
        s = torch.pow(2.0, exp.float())  # exact: a power of two in e8m0's range
        return s.to(E8M0) if E8M0 is not None else s
    return torch.where(a > 0, a / fmt_max(el), torch.ones_like(a))


def quantize(x: torch.Tensor, fmt: str = "e4m3", granularity: str = "tensor",
             scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): q = saturate(round(x / s)) in x's shape and the format's torch dtype; scales of
    shape (rows / block rows, K / block cols). Pass `scales` to use given ones (delayed scaling).
    fmt "mxfp4" or "nvfp4": course_lib.techniques.fp4.quantize (q float32 on the e2m1 grid)."""
    if fmt in fp4.FORMATS:
        return fp4.quantize(x, fmt, granularity, scales)
    if granularity == "nv16":
        raise ValueError(f"granularity='nv16' is NVFP4's (fmt='nvfp4'), got fmt={fmt!r}")
    rows, k, br, bc = _blocks(x.shape, granularity)
    el = _element(fmt, granularity)
    if scales is None:
        scales = scales_from_amax(amax(x, granularity), fmt, granularity)
    grid = (rows // br, k // bc)
    if tuple(scales.shape) != grid:
        raise ValueError(f"scales of shape {tuple(scales.shape)} must have shape {grid} for x of shape "
                         f"{tuple(x.shape)} with granularity={granularity!r}")
    m = fmt_max(el)
    blocks = x.detach().float().reshape(grid[0], br, grid[1], bc)
    y = (blocks / scales.float()[:, None, :, None]).clamp(-m, m)  # clamp keeps NaN: it stays visible
    return y.to(FORMATS[el]).reshape(x.shape), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, granularity: str, shape=None) -> torch.Tensor:
    """fp32 q * s of `shape` (default q's). q may come flat (after a gather); `shape` says the layout."""
    if granularity == "nv16":  # NVFP4's two-level scales
        return fp4.dequantize(q, scales, granularity, shape)
    shape = tuple(q.shape if shape is None else shape)
    rows, k, br, bc = _blocks(shape, granularity)
    if q.numel() != rows * k:
        raise ValueError(f"q has {q.numel()} elements, shape={shape} needs {rows * k}")
    blocks = q.float().reshape(rows // br, br, k // bc, bc)
    return (blocks * scales.float()[:, None, :, None]).reshape(shape)


class AmaxHistory:
    """Delayed per-tensor scaling: the scale for this step is max(last `length` amaxes) / max, then
    this step's amax joins the history (the first step uses its own: nothing to delay yet)."""

    def __init__(self, length: int = 16):
        check_int("length", length, rule="an int >= 1 (steps of amax history)")
        self.length, self.history = length, []

    def scales(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        now = amax(x, "tensor")
        past = torch.stack(self.history).amax(dim=0) if self.history else now
        self.history = (self.history + [now])[-self.length:]
        return scales_from_amax(past, fmt, "tensor")


@dataclass(frozen=True)
class FP8Recipe:
    """Granularity of each matmul input and the formats of forward and backward."""

    activation: str = "tensor"
    weight: str = "tensor"
    grad: str = "tensor"
    forward_fmt: str = "e4m3"
    backward_fmt: str = "e5m2"
    history: int = 0  # > 0: delayed scaling with an amax history of this many steps (tensor only)


RECIPES = {
    "tensorwise": FP8Recipe(),  # current per-tensor scales (torchao's "tensorwise")
    "delayed": FP8Recipe(history=16),  # per-tensor scales from an amax history (Transformer Engine's default)
    "rowwise": FP8Recipe("row", "row", "row"),  # one scale per token / output channel (torchao's "rowwise")
    "blockwise": FP8Recipe("tile128", "block128", "tile128", "e4m3", "e4m3"),  # DeepSeek-V3: e4m3 everywhere
    "mxfp8": FP8Recipe("mx32", "mx32", "mx32", "mxfp8", "mxfp8"),  # OCP MX: 32-element power-of-two blocks, e4m3 everywhere
    "mxfp4": FP8Recipe("mx32", "mx32", "mx32", "mxfp4", "mxfp4"),  # the same blocks, e2m1 elements
    "nvfp4": FP8Recipe("nv16", "nv16", "nv16", "nvfp4", "nvfp4"),  # 16-element e2m1 blocks, e4m3 + fp32 tensor scales
}


def _cast(x, fmt, granularity, history):
    return quantize(x, fmt, granularity, history.scales(x, fmt) if history is not None else None)


def _regrouped(q, s, fmt, granularity):
    """Dequantized q, its groups moved to run along the columns (dequantize, transpose, quantize, as
    DeepSeek-V3's kernels do for the weight-gradient matmul); unchanged for tensor or block scales."""
    dq = dequantize(q, s, granularity)
    return dequantize(*quantize(dq.t(), fmt, granularity), granularity).t() if granularity in ALONG_ROWS else dq


def _flat(scales) -> tuple:
    return tuple(scales) if isinstance(scales, fp4.NVScales) else (scales,)


class _FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module):
        r, k = module.recipe, x.shape[-1]
        x2 = x.reshape(-1, k)
        for gran, width in (("tile128", 128), ("mx32", 32), ("nv16", 16)):  # dW regroups x and dY along the tokens
            if gran in (r.activation, r.grad) and x2.shape[0] % width:
                raise ValueError(f"granularity={gran!r}: dW groups x and dY along the tokens, so the "
                                 f"{x2.shape[0]} tokens must divide into groups of {width}")
        qx, sx = _cast(x2, r.forward_fmt, r.activation, module.histories.get("input"))
        qw, sw = _cast(weight, r.forward_fmt, r.weight, module.histories.get("weight"))
        out = scaled_mm_forward(qx, sx, qw, sw, r)  # fp8_hardware.py: None unless a GPU with FP8 matmuls
        if out is None:  # fp32 matmul on the exact dequantized values
            out = dequantize(qx, sx, r.activation) @ dequantize(qw, sw, r.weight).t()
        if bias is not None:
            out = out + bias.float()
        ctx.nv = isinstance(sx, fp4.NVScales), isinstance(sw, fp4.NVScales)  # NVFP4: two scale tensors each
        ctx.save_for_backward(qx, *_flat(sx), qw, *_flat(sw))  # FP8 copies: 1 byte per element, the scales besides
        ctx.module, ctx.x_shape, ctx.x_dtype, ctx.has_bias = module, x.shape, x.dtype, bias is not None
        return out.reshape(*x.shape[:-1], -1).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        saved = list(ctx.saved_tensors)
        qx, sx = saved.pop(0), fp4.NVScales(saved.pop(0), saved.pop(0)) if ctx.nv[0] else saved.pop(0)
        qw, sw = saved.pop(0), fp4.NVScales(saved.pop(0), saved.pop(0)) if ctx.nv[1] else saved.pop(0)
        r = ctx.module.recipe
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        qg, sg = _cast(g2, r.backward_fmt, r.grad, ctx.module.histories.get("grad_output"))
        g = dequantize(qg, sg, r.grad)  # grouped along the output features: dX contracts over them
        grad_x = (g @ _regrouped(qw, sw, r.forward_fmt, r.weight)).reshape(ctx.x_shape).to(ctx.x_dtype)
        if r.grad in ALONG_ROWS:  # dW contracts over the tokens: dY grouped along them, from its fp32 value
            g = dequantize(*quantize(g2.t(), r.backward_fmt, r.grad), r.grad).t()
        grad_w = g.t() @ _regrouped(qx, sx, r.forward_fmt, r.activation)
        grad_b = g2.float().sum(0) if ctx.has_bias else None  # from the unquantized gradient (cheap, exact)
        return grad_x, grad_w, grad_b, None


def _recipe(recipe) -> FP8Recipe:
    if isinstance(recipe, FP8Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} must be an FP8Recipe or one of {tuple(RECIPES)}")
    return RECIPES[recipe]


class FP8Linear(nn.Linear):
    """nn.Linear whose forward and backward matmuls take scaled FP8 inputs (module docstring).

    The parameters stay as they are (fp32 masters for the optimizer); FP8 copies are made per step.
    `FP8Linear.from_linear(linear, recipe)` shares the linear's Parameter objects."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe="tensorwise", **kw):
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.recipe = _recipe(recipe)
        for name, gran, dim in (("activation", self.recipe.activation, in_features),
                                ("weight", self.recipe.weight, in_features),
                                ("grad", self.recipe.grad, out_features)):
            rows = out_features if name == "weight" else (128 if gran == "block128" else 1)
            _blocks((rows, dim), gran)
        if self.recipe.weight in ALONG_ROWS:  # dX = dY W regroups W along its output rows
            _blocks((in_features, out_features), self.recipe.weight)
        if self.recipe.history and {self.recipe.activation, self.recipe.weight, self.recipe.grad} != {"tensor"}:
            raise ValueError(f"delayed scaling (history={self.recipe.history}) is per-tensor: every granularity must be 'tensor'")
        h = self.recipe.history
        self.histories = {n: AmaxHistory(h) for n in ("input", "weight", "grad_output")} if h else {}

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe="tensorwise") -> "FP8Linear":
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe, device="meta")
        new.weight, new.bias = linear.weight, linear.bias  # the same Parameters: ties and optimizers carry over
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FP8Matmul.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", recipe={self.recipe}"


def apply_fp8(model: nn.Module, recipe="tensorwise", skip=("head",)) -> nn.Module:
    """Swap every nn.Linear (not those named in `skip`: the output head stays high precision, as in
    DeepSeek-V3 §3.3) for an FP8Linear sharing its parameters. Checks every layer before swapping any."""
    recipe = _recipe(recipe)
    targets = [(name, mod) for name, mod in model.named_modules()
               if type(mod) is nn.Linear and name.rsplit(".", 1)[-1] not in skip]
    swaps = []
    for name, mod in targets:
        try:
            swaps.append((name, FP8Linear.from_linear(mod, recipe)))
        except ValueError as e:
            raise ValueError(f"{name} ({mod.in_features} -> {mod.out_features}): {e}") from None
    for name, new in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model


def all_gather_fp8(shard: torch.Tensor, group=None, fmt: str = "e4m3",
                   granularity: str = "tensor") -> tuple[torch.Tensor, dict[str, int]]:
    """All-gather a 1-D parameter shard as FP8 plus its scales, then dequantize: (full fp32 tensor,
    {"elements": bytes, "scales": bytes} this rank received). Each shard is quantized as one row,
    so it carries its own scales. FP8 travels as uint8 (same bytes; gloo has no float8 type)."""
    if shard.dim() != 1:
        raise ValueError(f"shard must be 1-D (a flat parameter shard), got shape {tuple(shard.shape)}")
    _blocks((1, shard.numel()), granularity)  # bad input fails here, on every rank, before the collective
    _element(fmt, granularity)
    n = torch.distributed.get_world_size(group)
    q, s = quantize(shard.reshape(1, -1), fmt, granularity)
    qs = torch.empty(n * q.numel(), dtype=torch.uint8, device=shard.device)  # the shard's device: NCCL's
    all_gather_single(qs, q.reshape(-1).view(torch.uint8).contiguous(), group=group)
    flat_s = s.reshape(-1).contiguous()
    wire_s = flat_s.view(torch.uint8) if flat_s.dtype == E8M0 else flat_s  # e8m0 scales: 1 byte each
    ss = torch.empty(n * wire_s.numel(), dtype=wire_s.dtype, device=shard.device)
    all_gather_single(ss, wire_s, group=group)
    ss = ss.view(s.dtype)
    k, m = q.numel(), flat_s.numel()
    parts = [dequantize(qs[i * k:(i + 1) * k].view(q.dtype), ss[i * m:(i + 1) * m].reshape(s.shape),
                        granularity, (1, k)).reshape(-1) for i in range(n)]
    return torch.cat(parts), {"elements": qs.numel() * qs.element_size(), "scales": ss.numel() * ss.element_size()}
