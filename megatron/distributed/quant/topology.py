"""Two-level (intra-node / inter-node) process groups for the quantized gradient collectives.

SDP4Bit/ZeRO++ reduce gradients in two hops: an all-to-all among the D data-parallel (DP) ranks of
one node (fast links, 8-bit), then an all-to-all among the M ranks that share a local index on
every node (slow links, 4-bit). This module builds those groups.

Rank layout: DP rank ``r = node * D + local`` (``D = intra_size``, ``M = P // D``). This is
Megatron's default order (TP fastest, then DP) when TP divides the GPUs per node and every
pipeline stage fills whole nodes.

``new_group`` is world-collective, so :func:`build_two_level_groups_for_all` creates the
sub-groups of every DP group on every rank (on NCCL one ``split_group`` per kind) and returns the
caller's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, List, Optional, Sequence

import torch.distributed as dist

__all__ = ["TwoLevelGroups", "build_two_level_groups", "build_two_level_groups_for_all",
           "expert_intra_node_size"]


@dataclass
class TwoLevelGroups:
    """The process groups and coordinates one rank needs for the two-level collectives.

    ``intra_group`` is None when ``intra_size == 1`` (one DP rank per node: no intra hop) and
    ``inter_group`` is None when ``inter_size == 1`` (the DP group lives on one node: no inter
    hop). Group ranks equal ``local`` inside ``intra_group`` and ``node`` inside ``inter_group``
    (new_group orders members by global rank and ``dp_ranks`` is ascending).

    Each stage has a communicator of its own, even where its ranks equal the DP group's: one
    communicator driven from several streams deadlocks when two ranks issue in different orders.
    ``weights_group`` None (scope views, hand-built groups) means ``dp_group``.
    """

    dp_group: Any
    intra_group: Optional[Any]
    inter_group: Optional[Any]
    dp_size: int
    dp_rank: int
    intra_size: int
    inter_size: int
    node: int
    local: int
    dp_ranks: List[int] = field(default_factory=list)
    """Global ranks of the DP group, indexed by DP rank."""
    weights_group: Optional[Any] = None
    """The quantized weight all-gather's communicator (the DP ranks); None: ``dp_group``."""

    @property
    def weights_communicator(self) -> Any:
        """The group the ``weights`` stage all-gathers over."""
        return self.dp_group if self.weights_group is None else self.weights_group

    @property
    def D(self) -> int:  # noqa: N802 - the papers' symbol
        """DP ranks per node."""
        return self.intra_size

    @property
    def M(self) -> int:  # noqa: N802 - the papers' symbol
        """Nodes the DP group spans."""
        return self.inter_size

    @property
    def P(self) -> int:  # noqa: N802 - the papers' symbol
        """DP group size."""
        return self.dp_size

    def same_node(self, peer_dp_rank: int) -> bool:
        """True if DP rank ``peer_dp_rank`` sits on this rank's node (uses the r = node*D + local layout)."""
        if not 0 <= peer_dp_rank < self.dp_size:
            raise ValueError(f"peer DP rank {peer_dp_rank} outside [0, {self.dp_size})")
        return peer_dp_rank // self.intra_size == self.node

    def link_of_peer(self, peer_dp_rank: int) -> str:
        """'intra' or 'inter': which kind of link traffic to ``peer_dp_rank`` crosses (for accounting)."""
        return "intra" if self.same_node(peer_dp_rank) else "inter"

    def scope(self, name: str) -> "TwoLevelGroups":
        """The groups of one communication scope, as a ``TwoLevelGroups`` of its own.

        ``'global'``: this object (the whole DP group, two hops). ``'intra'``: the node's ranks
        alone (D ranks, one intra hop); ``'inter'``: the ranks sharing this local index (M ranks,
        one inter hop). The quantized collectives take the one-hop path on the latter two, so a
        PaRO strategy's intra / inter reduce-scatter is the same code as SDP4Bit's global one.
        """
        if name == "global":
            return self
        if name == "intra":
            return TwoLevelGroups(
                dp_group=self.intra_group, intra_group=self.intra_group, inter_group=None,
                dp_size=self.intra_size, dp_rank=self.local, intra_size=self.intra_size,
                inter_size=1, node=0, local=self.local,
                dp_ranks=list(self.dp_ranks[self.node * self.intra_size:
                                            (self.node + 1) * self.intra_size]))
        if name == "inter":
            return TwoLevelGroups(
                dp_group=self.inter_group, intra_group=None, inter_group=self.inter_group,
                dp_size=self.inter_size, dp_rank=self.node, intra_size=1,
                inter_size=self.inter_size, node=self.node, local=0,
                dp_ranks=list(self.dp_ranks[self.local::self.intra_size]))
        raise ValueError(f"scope must be 'global', 'intra' or 'inter', got {name!r}")


def _validate(dp_ranks: Sequence[int], intra_size: int) -> List[int]:
    ranks = [int(r) for r in dp_ranks]
    if not ranks:
        raise ValueError("dp_ranks is empty")
    if any(b <= a for a, b in zip(ranks, ranks[1:])):
        raise ValueError(f"dp_ranks must be strictly ascending (group rank = DP rank), got {ranks}")
    if intra_size <= 0:
        raise ValueError(f"intra_size must be positive, got {intra_size}")
    if len(ranks) % intra_size:
        raise ValueError(f"DP size {len(ranks)} is not divisible by the intra-node size {intra_size}: "
                         "every node must hold the same number of DP ranks")
    return ranks


def _new_group(ranks: List[int], backend: Optional[str], timeout: Optional[timedelta]) -> Any:
    """``dist.new_group`` with the run's timeout: torch gives a new group its backend's default
    (10 minutes for NCCL, 30 for gloo), not the default group's ``--distributed-timeout-minutes``."""
    kwargs: dict = {} if timeout is None else {"timeout": timeout}
    if backend is not None:
        kwargs["backend"] = backend
    return dist.new_group(ranks=ranks, **kwargs)


def _splits_communicators(backend: Optional[str]) -> bool:
    """Whether :func:`_partition_groups` can create a partition's communicators with one
    ``dist.split_group`` (one ``ncclCommSplit``): NCCL whose default group is bound to a device
    (the trainer's ``init_process_group(device_id=...)``), the only case torch supports."""
    world = dist.group.WORLD
    if getattr(dist, "split_group", None) is None or world is None:
        return False
    if getattr(world, "bound_device_id", None) is None:
        return False
    # a split inherits the parent's backends: the default group must be NCCL itself
    return str(dist.get_backend()) == "nccl" and backend in (None, "nccl")


def _partition_groups(partition: List[List[int]], backend: Optional[str],
                      timeout: Optional[timedelta]) -> Optional[Any]:
    """Create the communicators of ``partition`` (disjoint lists of global ranks; every rank of
    the world calls this with the same lists) and return the caller's, or None.

    On NCCL one ``split_group`` creates them all (instead of G * (M + D + 1) world-collective
    ``new_group`` calls at startup); elsewhere one ``new_group`` per list, in order."""
    if not partition:
        return None
    if _splits_communicators(backend):
        return dist.split_group(split_ranks=partition, timeout=timeout)
    me = dist.get_rank()
    mine = None
    for ranks in partition:
        group = _new_group(ranks, backend, timeout)
        if me in ranks:
            mine = group
    return mine


def _build(all_dp_ranks: Sequence[Sequence[int]], intra_size: int,
           dp_groups: Sequence[Optional[Any]], backend: Optional[str],
           timeout: Optional[timedelta]) -> Optional[TwoLevelGroups]:
    """Create (collectively, on every rank) the sub-groups of every DP group; return mine or None.

    A ``dp_groups`` entry None means "create it" (every rank then calls new_group for it; WORLD is
    reused when the DP group is the whole world). The intra groups of all DP groups (one per
    node), then their inter groups (one per local index), then their weights groups are created
    as three partitions of the world, whatever the caller: all ranks make the same calls.
    """
    all_ranks = [_validate(r, intra_size) for r in all_dp_ranks]
    d = intra_size
    me = dist.get_rank()
    dp_group, mine = None, None
    for ranks, given in zip(all_ranks, dp_groups):
        if given is None:
            if ranks == list(range(dist.get_world_size())):
                given = dist.group.WORLD
            else:
                given = _new_group(ranks, backend, timeout)
        if me in ranks:
            dp_group, mine = given, ranks
    # Each is its own communicator, also where its ranks are the DP group's (M = 1 or D = 1):
    # one communicator per stream (see TwoLevelGroups).
    intra_group = _partition_groups(
        [r[n * d:(n + 1) * d] for r in all_ranks if d > 1 for n in range(len(r) // d)], backend,
        timeout)
    inter_group = _partition_groups(
        [r[local::d] for r in all_ranks if len(r) > d for local in range(d)], backend, timeout)
    weights_group = _partition_groups([r for r in all_ranks if len(r) > 1], backend, timeout)
    if mine is None:
        return None
    p = len(mine)
    dp_rank = mine.index(me)
    node, local = divmod(dp_rank, d)
    return TwoLevelGroups(
        dp_group=dp_group, intra_group=intra_group, inter_group=inter_group,
        dp_size=p, dp_rank=dp_rank, intra_size=d, inter_size=p // d, node=node, local=local,
        dp_ranks=mine, weights_group=weights_group,
    )


_NOT_A_MEMBER = object()
"""Placeholder DP group for DP groups the caller is not in (never used for communication)."""


def build_two_level_groups(dp_ranks: Sequence[int], intra_size: int, *, dp_group: Optional[Any] = None,
                           backend: Optional[str] = None,
                           timeout: Optional[timedelta] = None) -> Optional[TwoLevelGroups]:
    """Build the intra/inter groups of ONE DP group.

    Must be called by every process of the world (``new_group`` is world-collective). Returns the
    groups if the caller belongs to ``dp_ranks``, else None. Pass ``dp_group`` to reuse an
    existing DP communicator (e.g. megatron-core's); otherwise one is created (or WORLD reused).
    Use :func:`build_two_level_groups_for_all` when the world holds several DP groups.
    ``timeout``: every communicator created here waits that long in a collective (the run's
    ``--distributed-timeout-minutes``; None: torch's default for the backend).
    """
    return _build([dp_ranks], intra_size, [dp_group], backend, timeout)


def build_two_level_groups_for_all(all_dp_ranks: Sequence[Sequence[int]], intra_size: int, *,
                                   dp_groups: Optional[Sequence[Any]] = None,
                                   backend: Optional[str] = None,
                                   timeout: Optional[timedelta] = None) -> TwoLevelGroups:
    """Create the two-level groups of every DP group (same order on all ranks); return mine.

    ``all_dp_ranks`` lists every DP group's global ranks (each ascending; together a partition of
    the participating ranks). ``dp_groups`` optionally gives the existing communicator of each DP
    group (same order); entries for groups the caller is not in are ignored and may be None.
    ``timeout`` as in :func:`build_two_level_groups`.
    """
    if dp_groups is not None and len(dp_groups) != len(all_dp_ranks):
        raise ValueError(f"dp_groups has {len(dp_groups)} entries but all_dp_ranks has {len(all_dp_ranks)}")
    seen: set = set()
    for ranks in all_dp_ranks:
        overlap = seen.intersection(ranks)
        if overlap:
            raise ValueError(f"ranks {sorted(overlap)} appear in more than one DP group")
        seen.update(ranks)
    me = dist.get_rank()
    existing: List[Optional[Any]] = [None] * len(all_dp_ranks)
    if dp_groups is not None:
        for i, (ranks, group) in enumerate(zip(all_dp_ranks, dp_groups)):
            if group is None and me in ranks:
                raise ValueError(f"dp_groups[{i}] is None but rank {me} belongs to it")
            existing[i] = _NOT_A_MEMBER if group is None else group
    mine = _build(all_dp_ranks, intra_size, existing, backend, timeout)
    if mine is None:
        raise ValueError(f"rank {me} is in none of the DP groups {[list(r) for r in all_dp_ranks]}")
    return mine


def expert_intra_node_size(dense: TwoLevelGroups, expert_dp_ranks: Sequence[int]) -> int:
    """Expert-data-parallel ranks per node, from the dense groups' nodes (``dense``: this rank's
    DP group, ``intra_size`` ranks a node; ``expert_dp_ranks``: this rank's expert-DP group).

    megatron-core takes expert parallelism out of the DP ranks (EP fastest), so with the expert
    tensor-parallel size equal to TP the expert-DP group is every EP-th rank of the dense DP
    group: D / EP of them share a node when EP divides D, one when D divides EP. ValueError for
    a layout whose nodes hold different numbers of them, or that is not node-major."""
    members = [int(r) for r in expert_dp_ranks]
    outside = [r for r in members if r not in dense.dp_ranks]
    if outside:
        raise ValueError(f"expert-data-parallel ranks {outside} are not in this rank's data-"
                         f"parallel group {dense.dp_ranks}: the quantized expert collectives "
                         "need --expert-tensor-parallel-size equal to --tensor-model-parallel-size")
    nodes = [dense.dp_ranks.index(r) // dense.intra_size for r in members]
    per_node = {n: nodes.count(n) for n in nodes}
    if len(set(per_node.values())) != 1 or nodes != sorted(nodes):
        raise ValueError(
            f"the expert-data-parallel group {members} spreads unevenly over the nodes "
            f"({dense.intra_size} data-parallel ranks each): --expert-model-parallel-size must "
            f"divide the data-parallel ranks per node ({dense.intra_size}) or be a multiple of it")
    return next(iter(per_node.values()))
