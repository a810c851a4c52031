"""Process groups are created in one place: course_lib.comm.process_groups (and the HSDP mesh's
own shard and replica groups). A call to torch.distributed's new_group anywhere else in
course_lib fails here, read from the source by AST (a call by any spelling: dist.new_group(...),
torch.distributed.new_group(...), or a bare new_group(...) after `from ... import new_group`)."""

from __future__ import annotations

import ast
import pathlib

import torch.distributed as dist

from course_lib.comm.process_groups import new_groups, own_group
from course_lib.runtime import run_on_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALLOWED = {"course_lib/comm/process_groups.py", "course_lib/parallel/zero/hsdp.py"}


def new_group_calls(source: str) -> list[int]:
    """The lines of every call to a function named new_group in `source`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name == "new_group":
                lines.append(node.lineno)
    return lines


def test_new_group_is_called_only_where_groups_are_made():
    found = {}
    for path in sorted((ROOT / "course_lib").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if lines := new_group_calls(path.read_text()):
            found[rel] = lines
    stray = {rel: lines for rel, lines in found.items() if rel not in ALLOWED}
    assert not stray, ("create process groups with course_lib.comm.process_groups.new_groups / own_group, "
                       f"not torch.distributed.new_group: {stray}")
    assert "course_lib/comm/process_groups.py" in found  # the scan does see the one real call


def test_the_scan_finds_every_spelling():
    src = ("import torch.distributed as dist\nimport torch\nfrom torch.distributed import new_group\n"
           "a = dist.new_group([0, 1])\nb = torch.distributed.new_group(ranks=[0])\nc = new_group([1])\n"
           "d = new_groups([[0]])  # the course's own: not a match\n")
    assert new_group_calls(src) == [4, 5, 6]


def _made(lists):
    rank = dist.get_rank()
    mine = own_group(lists, rank)
    every = new_groups(lists)
    member = [rank in ranks for ranks in lists]
    return {"own": None if mine is None else dist.get_process_group_ranks(mine),
            "every": [dist.get_process_group_ranks(g) if m else None for g, m in zip(every, member)]}


def test_own_group_is_the_ranks_group_and_new_groups_makes_every_one():
    lists = [[0, 2], [1, 3]]
    out = run_on_ranks(_made, lists, world_size=4, timeout_s=60)
    assert [o["own"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [o["every"] for o in out] == [[[0, 2], None], [None, [1, 3]], [[0, 2], None], [None, [1, 3]]]


def test_a_rank_in_no_list_gets_none():
    out = run_on_ranks(_made, [[0, 1]], world_size=4, timeout_s=60)
    assert [o["own"] for o in out] == [[0, 1], [0, 1], None, None]
