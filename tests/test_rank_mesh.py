"""The one rank mesh (course_lib.parallel.mesh.RankMesh): every axis always present, the derived
groups named once (course_lib.dims.DERIVED_GROUPS) and computed by one pure function, their
communicators on real gloo ranks, this rank's rows and the loss's mean."""

from __future__ import annotations

import itertools
import math

import pytest

from course_lib import dims as D
from course_lib.parallel.mesh import make_mesh, mesh_layout
from course_lib.runtime import run_on_ranks
from course_lib.train import share_rows


def factorisations(world: int):
    """Every (pp, dp, ep, cp, tp) of positive ints whose product is `world`."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for combo in itertools.product(divisors, repeat=len(D.MESH_ORDER)):
        if math.prod(combo) == world:
            yield dict(zip(D.MESH_ORDER, combo))


GRID = [D.ParallelDims(**sizes) for world in range(1, 9) for sizes in factorisations(world)]


def test_the_grid_covers_every_factorisation():
    assert len(GRID) == sum(len(list(factorisations(w))) for w in range(1, 9))
    assert {d.world_size for d in GRID} == set(range(1, 9))
    assert len({tuple(d.sizes().values()) for d in GRID}) == len(GRID)


@pytest.mark.parametrize("dims", GRID, ids=lambda d: "x".join(f"{a}{n}" for a, n in d.sizes().items()))
def test_every_group_partitions_the_ranks_by_its_axes(dims):
    sizes, world = dims.sizes(), dims.world_size
    assert list(sizes) == list(D.MESH_ORDER)  # every axis present, size 1 included
    layout = mesh_layout(dims)
    assert set(layout) == set(D.MESH_ORDER) | set(D.DERIVED_GROUPS)
    coords = [D.coordinates(r, sizes) for r in range(world)]
    for r, c in enumerate(coords):
        assert D.rank_of(c, sizes) == r  # the coordinates round-trip
    for name, axes in D.GROUPS.items():
        size = math.prod(sizes[a] for a in axes)
        groups = layout[name]
        assert all(len(g) == size for g in groups), (name, groups)
        assert sorted(r for g in groups for r in g) == list(range(world)), (name, groups)  # a partition
        for g in groups:
            # members agree on every other axis; a member's index is its coordinates along the axes
            assert len({tuple(v for a, v in coords[r].items() if a not in axes) for r in g}) == 1, (name, g)
            for i, r in enumerate(g):
                index = 0
                for a in axes:
                    index = index * sizes[a] + coords[r][a]
                assert index == i, (name, g, r)


def test_a_derived_group_is_named_by_axes_of_the_mesh():
    assert all(set(axes) <= set(D.MESH_ORDER) and len(axes) > 1 for axes in D.DERIVED_GROUPS.values())
    sizes = D.ParallelDims(dp=2, ep=2, cp=2).sizes()  # 8 ranks: (dp, ep, cp) indices, cp fastest
    layout = mesh_layout(sizes)
    assert layout["dp_cp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout["replica"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout["loss"] == [list(range(8))]


def test_the_four_axis_geometry_of_the_notebooks_is_unchanged():
    """Sizes without cp (notebooks 00 and 10's four axes) give the four axes' groups, as before."""
    from course_lib.parallel.mesh import mesh_groups

    assert set(mesh_groups(8, dp=2, tp=2, pp=2)) == set(D.MESH_DIMS)
    assert mesh_groups(8, dp=2, tp=2, pp=2) == D.groups(dict(pp=2, dp=2, ep=1, tp=2))
    with_cp = mesh_groups(8, dp=2, tp=2, pp=2, cp=1)
    assert set(with_cp) == set(D.MESH_ORDER) and all(len(g) == 1 for g in with_cp["cp"])
    assert {d: with_cp[d] for d in D.MESH_DIMS} == mesh_groups(8, dp=2, tp=2, pp=2)


def _mesh_facts(layouts):
    """Rank code: for each layout, what the RankMesh built on this rank says."""
    import torch.distributed as dist

    out = []
    for dims in layouts:
        mesh = make_mesh(dims)
        groups = {name: mesh.group(name) for name in D.GROUPS}
        out.append({
            "coords": dict(mesh.coords),
            "sizes": {name: g.size() for name, g in groups.items()},
            "ranks": {name: sorted(dist.get_process_group_ranks(g)) for name, g in groups.items()},
            "axis_index": {a: dist.get_rank(groups[a]) for a in D.MESH_ORDER},
            "same_object": {name: [a for a in axes if groups[name] is groups[a]]
                            for name, axes in D.DERIVED_GROUPS.items()},
            "rows": mesh.rows(16),
            "loss": mesh.mean_loss(float(dist.get_rank() + 1)),  # rank r's loss: r + 1
            "device_mesh_axes": tuple(mesh.mesh_dim_names),
            "tp_submesh": sorted(dist.get_process_group_ranks(mesh["tp"].get_group())),
        })
    return out


LAYOUTS = {4: [D.ParallelDims(dp=2, cp=2), D.ParallelDims(dp=2, ep=2), D.ParallelDims(cp=2, tp=2),
               D.ParallelDims(pp=2, dp=2), D.ParallelDims(dp=4)],
           8: [D.ParallelDims(dp=2, cp=2, tp=2), D.ParallelDims(pp=2, dp=2, ep=2), D.ParallelDims(dp=2, ep=2, cp=2),
               D.ParallelDims(pp=2, cp=4)]}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_rank_mesh_groups_on_real_ranks(world):
    facts = run_on_ranks(_mesh_facts, LAYOUTS[world], world_size=world, timeout_s=180)
    for i, dims in enumerate(LAYOUTS[world]):
        sizes, layout = dims.sizes(), mesh_layout(dims)
        for rank in range(world):
            f = facts[rank][i]
            assert f["device_mesh_axes"] == D.MESH_ORDER  # five axes, size 1 included
            assert f["coords"] == D.coordinates(rank, sizes)
            assert f["axis_index"] == f["coords"]
            assert f["tp_submesh"] == f["ranks"]["tp"]
            for name, axes in D.GROUPS.items():
                assert f["sizes"][name] == math.prod(sizes[a] for a in axes), (dims, name)
                mine = next(g for g in layout[name] if rank in g)
                assert f["ranks"][name] == mine, (dims, name, rank)
            for name, axes in D.DERIVED_GROUPS.items():
                equal = [a for a in axes if layout[a] == layout[name]]
                if equal:  # the same ranks as one of its axes: that axis's communicator itself
                    assert f["same_object"][name] and set(f["same_object"][name]) <= set(equal), (dims, name)
                else:
                    assert f["same_object"][name] == [], (dims, name)
            replica = dims.replicas
            index = f["coords"]["dp"] * dims.ep + f["coords"]["ep"]
            assert f["rows"] == share_rows(index, replica, 16)
            members = next(g for g in layout["loss"] if rank in g)
            # exact: losses are small integers, groups of a power of two ranks (dyadic sums)
            assert f["loss"] == sum(r + 1 for r in members) / len(members), (dims, rank)


def test_a_layout_with_both_dp_and_cp_builds_a_new_dp_cp_group():
    """The layouts above include derived groups equal to no axis (dp_cp at dp2 x cp2): checked by
    the real-rank test's 'same_object == []' branch, which must be reached."""
    reached = [(dims, name) for dims_list in LAYOUTS.values() for dims in dims_list
               for name, axes in D.DERIVED_GROUPS.items()
               if not any(mesh_layout(dims)[a] == mesh_layout(dims)[name] for a in axes)]
    assert {name for _, name in reached} == set(D.DERIVED_GROUPS)


@pytest.mark.parametrize("method", D.CP_METHODS)
def test_topology_counts_context_parallel_traffic_from_the_estimators_records(method):
    from course_lib.estimate.traffic import cp_traffic
    from course_lib.model import GPTConfig
    from course_lib.parallel import topology

    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, d_model=32)
    dims = D.ParallelDims(dp=2, cp=4, tp=2, cp_method=method)
    t = topology.traffic_per_step(cfg, dims, 8)
    assert t["cp"]["bytes_sent"] == sum(c.world_bytes for c in cp_traffic(cfg, dims, 8)) > 0
    assert "cp" not in topology.traffic_per_step(cfg, D.ParallelDims(dp=2, tp=2), 8)
    wide = D.ParallelDims(pp=2, dp=4, cp=2, cp_method=method)  # 16 ranks on nodes of 8
    for order, link in ((topology.TOPOLOGY_AWARE, "intra"), (topology.NAIVE, "inter")):  # cp 1 or 8 ranks apart
        rows = {r["dim"]: r for r in topology.placement(cfg, wide, 8, topology.DGX_H100, order, seq=32)}
        assert rows["cp"]["link"] == D.link_of("cp", wide.sizes(), 8, order) == link
        assert rows["cp"]["seconds"] > 0


def test_the_node_rule_is_one_function_both_sides_read():
    from course_lib.estimate.cluster import Cluster

    for gpus in (1, 2, 4, 8):
        cluster = Cluster.__new__(Cluster)  # only gpus_per_node, intra and inter are read by link()
        object.__setattr__(cluster, "gpus_per_node", gpus)
        object.__setattr__(cluster, "intra", "intra")
        object.__setattr__(cluster, "inter", "inter")
        for size in (1, 2, 4, 8):
            for stride in (1, 2, 4):
                want = "intra" if D.fits_node(size * stride, gpus) else "inter"
                assert cluster.link(size, stride) == want
                sizes = {"pp": 1, "dp": size, "ep": 1, "cp": stride, "tp": 1}  # dp's stride is cp's size
                if size > 1:
                    assert D.link_of("dp", sizes, gpus) == want
