"""Read the collectives out of XLA's compiled HLO text (what the partitioner, GSPMD or Shardy, inserted), as formula records.

A compiled JAX function's `.as_text()` has one line per instruction, e.g.

    %all-reduce.1 = f32[4,8,16]{2,1,0} all-reduce(%bitcast.10), channel_id=2, replica_groups=...
    %all-reduce.3 = (f32[], f32[64,16]{1,0}) all-reduce(%a, %b), ...          XLA combined two into one
    %all-gather = f32[64,16]{1,0} all-gather(%param.1), ..., dimensions={0}, ...
    %reduce_scatter.14 = f32[4,2,16]{2,0,1} reduce-scatter(%x), replica_groups={{0,1,2,3}}, ...

The group size comes from replica_groups, written three ways: explicit lists {{0,1},{2,3}}, an
iota form [2,2]<=[4] (groups x group size), or a mesh form mesh['axis_0'=4,'axis_1'=1] {'axis_0'}
(the product of the named axes' sizes). Bytes follow the formula's convention (the full tensor):
an all-reduce's operand (each element of a combined tuple is one record), an all-gather's output,
a reduce-scatter's output times the group, an all-to-all's buffers summed.
"""

from __future__ import annotations

import re

KINDS = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
         "all-to-all": "all_to_all", "collective-permute": "collective_permute"}
BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s64": 8, "s8": 1, "u8": 1, "pred": 1}
_LINE = re.compile(r"=\s*(?P<shape>\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+"
                   r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def _sizes(shape: str) -> list[int]:
    """Bytes of each array in an HLO shape (one, or a tuple's elements)."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for dim in filter(None, dims.split(",")):
            n *= int(dim)
        out.append(n * BYTES[dtype])
    return out


def group_size(line: str) -> int:
    """The number of devices in each replica group of this instruction."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if mesh:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
        n = 1
        for axis in re.findall(r"'([^']+)'", mesh.group(2)):
            n *= sizes[axis]
        return n
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if iota:
        return int(iota.group(2))
    lists = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if lists:
        return len(lists.group(1).split(","))
    raise ValueError(f"no replica_groups in HLO line: {line[:160]!r}")


def collectives(hlo_text: str) -> list[tuple[str, int, int]]:
    """[(op, full bytes, group size)] for every collective in the HLO, in program order; a
    combined all-reduce gives one record per operand."""
    out = []
    for line in hlo_text.splitlines():
        match = _LINE.search(line)
        if not match or "-done(" in line:
            continue
        kind, sizes, n = KINDS[match.group("kind")], _sizes(match.group("shape")), group_size(line)
        if kind == "all_reduce":
            out += [(kind, s, n) for s in sizes]
        elif kind == "reduce_scatter":
            out += [(kind, s * n, n) for s in sizes]
        else:
            out.append((kind, sum(sizes), n))
    return out


def describe(hlo_text: str) -> list[str]:
    """One line per collective instruction: its kind, its shape without layout, its group size."""
    out = []
    for line in hlo_text.splitlines():
        match = _LINE.search(line)
        if match and "-done(" not in line:
            shape = re.sub(r"\{[^}]*\}", "", match.group("shape"))
            out.append(f"{match.group('kind'):<15} {shape:<40} over {group_size(line)} devices")
    return out


def calls(hlo_text: str) -> dict[str, int]:
    """{op: instructions} (a combined all-reduce is one call)."""
    out: dict[str, int] = {}
    for line in hlo_text.splitlines():
        match = _LINE.search(line)
        if match and "-done(" not in line:
            kind = KINDS[match.group("kind")]
            out[kind] = out.get(kind, 0) + 1
    return dict(sorted(out.items()))
