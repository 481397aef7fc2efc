"""How the two-level groups' communicators are created (issue 25, review item 8).

Why: every intra and inter group was its own world-collective ``new_group``, called one after
another: a job with G data-parallel groups of M nodes x D ranks ran G * (M + D + 1) of them at
startup. On NCCL with the default group bound to a device (the trainer's
``init_process_group(device_id=...)``) each kind of sub-group (intra, inter, weights) is now one
``split_group`` of the world; elsewhere (gloo) ``new_group`` per group as before. gloo cannot
split, so the NCCL side runs here against a recording ``torch.distributed`` that answers as each
rank of a 16-rank world would; the gloo side runs for real in
tests/test_collectives.py::test_build_for_all_dp_groups.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import pytest

from megatron.distributed.quant import topology


class _Group:
    def __init__(self, ranks: List[int], how: str) -> None:
        self.ranks, self.how = list(ranks), how


class RecordingDist:
    """The calls topology.py makes, answered for one rank of the world; ``split_group`` exists
    (NCCL) or not (an older torch)."""

    def __init__(self, rank: int, world: int, *, backend: str, bound: bool,
                 has_split: bool = True) -> None:
        self.rank, self.world, self.backend = rank, world, backend
        self.calls: List[Tuple[str, int]] = []
        world_group = _Group(list(range(world)), "world")
        world_group.bound_device_id = "cuda:0" if bound else None
        self.group = type("group", (), {"WORLD": world_group})
        if has_split:
            self.split_group = self._split_group

    def get_rank(self, group: Any = None) -> int:
        return self.rank

    def get_world_size(self, group: Any = None) -> int:
        return self.world

    def get_backend(self, group: Any = None) -> str:
        return self.backend

    def new_group(self, ranks: List[int], backend: Optional[str] = None) -> _Group:
        self.calls.append(("new_group", len(ranks)))
        return _Group(ranks, "new_group")

    def _split_group(self, parent_pg: Any = None, split_ranks: Optional[List[List[int]]] = None,
                     **kwargs: Any) -> Optional[_Group]:
        assert parent_pg is None and split_ranks
        seen = [r for ranks in split_ranks for r in ranks]
        assert len(seen) == len(set(seen)), "a split's lists must be disjoint"
        self.calls.append(("split_group", len(split_ranks)))
        return next((_Group(r, "split") for r in split_ranks if self.rank in r), None)


def _tp2_dp_groups(world: int) -> List[List[int]]:
    """Megatron's DP groups for TP = 2: ranks with the same TP rank."""
    return [list(range(tp, world, 2)) for tp in range(2)]


def _build(monkeypatch, rank: int, fake: RecordingDist, intra: int) -> topology.TwoLevelGroups:
    monkeypatch.setattr(topology, "dist", fake)
    all_dp = _tp2_dp_groups(fake.world)
    mine = next(r for r in all_dp if rank in r)
    dp_groups = [_Group(r, "megatron") if r is mine else None for r in all_dp]
    return topology.build_two_level_groups_for_all(all_dp, intra, dp_groups=dp_groups)


@pytest.mark.parametrize("rank", [0, 5, 14])
def test_nccl_creates_each_kind_of_group_with_one_split(monkeypatch, rank: int) -> None:
    """16 ranks, TP 2: two DP groups of 8 as 2 nodes x 4. Three splits (was 2 x (2 + 4 + 1) = 14
    new_group calls), and each rank gets exactly the members the new_group path gives it."""
    split = RecordingDist(rank, 16, backend="nccl", bound=True)
    g = _build(monkeypatch, rank, split, intra=4)
    assert split.calls == [("split_group", 4), ("split_group", 8), ("split_group", 2)]
    assert {x.how for x in (g.intra_group, g.inter_group, g.weights_group)} == {"split"}

    plain = RecordingDist(rank, 16, backend="gloo", bound=False)
    h = _build(monkeypatch, rank, plain, intra=4)
    assert plain.calls == [("new_group", 4)] * 4 + [("new_group", 2)] * 8 + [("new_group", 8)] * 2
    for a, b in ((g.intra_group, h.intra_group), (g.inter_group, h.inter_group),
                 (g.weights_group, h.weights_group)):
        assert a.ranks == b.ranks
    assert (g.dp_rank, g.node, g.local, g.dp_group.how) == (h.dp_rank, h.node, h.local, "megatron")
    assert g.intra_group.ranks == g.dp_ranks[g.node * 4:(g.node + 1) * 4]
    assert g.inter_group.ranks == g.dp_ranks[g.local::4]


@pytest.mark.parametrize("backend,bound,has_split", [
    ("gloo", True, True),            # gloo cannot split
    ("nccl", False, True),           # no device bound to the default group: not safe to split
    ("nccl", True, False),           # a torch without split_group
])
def test_new_group_where_splitting_is_unsupported(monkeypatch, backend: str, bound: bool,
                                                 has_split: bool) -> None:
    fake = RecordingDist(3, 16, backend=backend, bound=bound, has_split=has_split)
    _build(monkeypatch, 3, fake, intra=4)
    assert {call for call, _ in fake.calls} == {"new_group"} and len(fake.calls) == 14


def test_layouts_without_a_hop_create_no_group_for_it(monkeypatch) -> None:
    """M = 1 (one node): no inter split; D = 1: no intra split."""
    one_node = RecordingDist(0, 16, backend="nccl", bound=True)
    g = _build(monkeypatch, 0, one_node, intra=8)
    assert one_node.calls == [("split_group", 2), ("split_group", 2)] and g.inter_group is None
    per_node = RecordingDist(0, 16, backend="nccl", bound=True)
    g = _build(monkeypatch, 0, per_node, intra=1)
    assert per_node.calls == [("split_group", 2), ("split_group", 2)] and g.intra_group is None
