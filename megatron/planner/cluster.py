"""The cluster's links, and what each collective algorithm costs on them (latency + bytes / bandwidth).

Why these formulas: they are the textbook alpha-beta costs of the algorithms NCCL (and gloo) run,
so a user can check a prediction by hand. Where ``--measure`` timed a collective on the run's
group, its measured curve replaces the formula (:class:`MeasuredCollective`): the transport's own
algorithm choice is something no formula knows. Also docs/planner.md.
"""
# See [Note: planner collective costs] in docs/architecture.md

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Tuple

__all__ = ["Link", "Cluster", "MeasuredCollective", "COLLECTIVES", "GBIT", "ring_time",
           "all_reduce_time", "all_to_all_time", "p2p_time"]

COLLECTIVES = {
    "reduce_scatter": "the gradient reduce-scatter of an unquantized bucket on the data-parallel "
                      "group (megatron-core's call); bytes: the whole bucket",
    "all_gather": "the parameter all-gather on the data-parallel group (megatron-core's, and the "
                  "quantized layer's of codes); bytes: the whole gathered tensor",
    "all_to_all_intra": "the quantized gradients' all-to-all among a node's ranks; bytes: one "
                        "rank's input",
    "all_to_all_inter": "the quantized gradients' all-to-all across nodes (ranks of the same local "
                        "rank); bytes: one rank's input",
}
"""The collectives ``--measure`` times, by the name :meth:`Cluster.measured_time` takes."""

GBIT = 1e9 / 8
"""Bytes per second in one Gbit/s."""


@dataclass(frozen=True)
class Link:
    """One kind of link: latency per message and bandwidth per direction."""

    bandwidth: float
    """Bytes per second, one direction (intra: one GPU's port; inter: one node's NICs together)."""
    latency: float
    """Seconds per message (per step of a ring)."""

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency < 0:
            raise ValueError(f"a link needs a positive bandwidth and a non-negative latency, got "
                             f"{self.bandwidth} B/s, {self.latency} s")

    def describe(self) -> str:
        if math.isinf(self.bandwidth):
            return "none (not measured: one node)"
        gbit = self.bandwidth / GBIT
        rate = f"{gbit:.3g} Gbit/s" if gbit < 1000 else f"{self.bandwidth / 1e9:.3g} GB/s"
        return f"{rate}, {self.latency * 1e6:.3g} us"


@dataclass(frozen=True)
class MeasuredCollective:
    """Seconds of one collective on its group at several sizes, all of the run's groups running it
    at once (``--measure``); between two sizes the time is interpolated linearly, beyond the ends
    the end segment is extended (never below zero). A larger message never takes less time: each
    size's time is read as at most any larger size's (a small size's median can catch a
    descheduled rank)."""

    ranks: int
    """The group's size it was measured on; it describes only a group of that size ..."""
    ranks_per_node: int
    """... with as many of its ranks on each node (a group of 4 inside a node and one across two
    nodes are different collectives)."""
    points: Tuple[Tuple[float, float], ...]
    """(bytes, seconds), bytes as :data:`COLLECTIVES` defines them, at two or more sizes."""

    def __post_init__(self) -> None:
        if self.ranks < 2 or not 1 <= self.ranks_per_node <= self.ranks:
            raise ValueError(f"a measured collective needs a group of 2 or more ranks with 1 to all "
                             f"of them per node, got {self.ranks} ranks, {self.ranks_per_node} per node")
        pts = tuple(sorted((float(b), float(t)) for b, t in self.points))
        if len(pts) < 2 or len({b for b, _ in pts}) != len(pts) or any(b <= 0 or t < 0 for b, t in pts):
            raise ValueError(f"a measured collective needs two or more distinct positive sizes "
                             f"with non-negative times, got {self.points}")
        object.__setattr__(self, "points", pts)

    def seconds(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        pts, slowest = [], math.inf
        for b, t in reversed(self.points):   # the lower envelope from the largest size down
            slowest = min(slowest, t)
            pts.append((b, slowest))
        pts.reverse()
        k = 1
        while k < len(pts) - 1 and nbytes > pts[k][0]:
            k += 1
        (b0, t0), (b1, t1) = pts[k - 1], pts[k]
        return max(0.0, t0 + (nbytes - b0) * (t1 - t0) / (b1 - b0))


@dataclass(frozen=True)
class Cluster:
    """Nodes of ``gpus_per_node`` ranks joined by ``inter``; ranks of a node joined by ``intra``."""

    nodes: int
    """Number of nodes."""
    gpus_per_node: int
    """Ranks (GPUs) per node."""
    intra: Link
    """A GPU's port to the other GPUs of its node (NVLink / NVSwitch; loopback for CPU ranks)."""
    inter: Link
    """A node's NICs together, per direction."""
    name: str = ""
    """What the figures describe, printed with the prediction."""
    measured: Mapping[str, MeasuredCollective] = field(default_factory=dict)
    """Collectives ``--measure`` timed on this layout (names: :data:`COLLECTIVES`); they replace
    the formulas for a group of the size measured. Empty for stated links."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"nodes ({self.nodes}) and GPUs per node ({self.gpus_per_node}) must be "
                             f">= 1")
        unknown = set(self.measured) - set(COLLECTIVES)
        if unknown:
            raise ValueError(f"unknown measured collective(s) {sorted(unknown)}; known: "
                             f"{sorted(COLLECTIVES)}")

    def measured_time(self, collective: str, nbytes: float, ranks: int,
                      ranks_per_node: int) -> Optional[float]:
        """Seconds of ``collective`` (:data:`COLLECTIVES`) on ``nbytes`` over a group of ``ranks``,
        ``ranks_per_node`` of them on each node, from this layout's measurement, or None where
        none was measured on such a group (then the formula applies)."""
        curve = self.measured.get(collective)
        if curve is None or (curve.ranks, curve.ranks_per_node) != (ranks, ranks_per_node):
            return None
        return curve.seconds(nbytes)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        head = f"{self.nodes} node(s) x {self.gpus_per_node} GPU(s)"
        return (f"{head}{' (' + self.name + ')' if self.name else ''}; intra-node "
                f"{self.intra.describe()} per GPU; inter-node {self.inter.describe()} per node")


def ring_time(total_bytes: float, ranks: int, nodes_spanned: int, groups_per_node: int,
              cluster: Cluster) -> float:
    """Seconds of a ring reduce-scatter or all-gather of a ``total_bytes`` tensor over ``ranks``
    ranks spread over ``nodes_spanned`` nodes, while ``groups_per_node`` such groups of each node
    run the same collective at once (they share its NICs)."""
    if ranks <= 1 or total_bytes <= 0:
        return 0.0
    moved = (ranks - 1) / ranks * total_bytes
    if nodes_spanned > 1:
        bandwidth = min(cluster.intra.bandwidth, cluster.inter.bandwidth / max(1, groups_per_node))
        latency = cluster.inter.latency
    else:
        bandwidth, latency = cluster.intra.bandwidth, cluster.intra.latency
    return (ranks - 1) * latency + moved / bandwidth


def all_reduce_time(total_bytes: float, ranks: int, nodes_spanned: int, groups_per_node: int,
                    cluster: Cluster) -> float:
    """Seconds of an all-reduce: the faster of ring (reduce-scatter + all-gather) and tree."""
    if ranks <= 1 or total_bytes <= 0:
        return 0.0
    ring = 2 * ring_time(total_bytes, ranks, nodes_spanned, groups_per_node, cluster)
    if nodes_spanned > 1:
        bandwidth = min(cluster.intra.bandwidth, cluster.inter.bandwidth / max(1, groups_per_node))
        latency = cluster.inter.latency
    else:
        bandwidth, latency = cluster.intra.bandwidth, cluster.intra.latency
    tree = 2 * math.ceil(math.log2(ranks)) * latency + 2 * total_bytes / bandwidth
    return min(ring, tree)


def all_to_all_time(bytes_sent_per_rank: float, link: Link, concurrent_senders: int = 1) -> float:
    """Seconds of an equal-split all-to-all in which each rank sends ``bytes_sent_per_rank`` to its
    peers over ``link``, ``concurrent_senders`` ranks sharing that link's bandwidth."""
    if bytes_sent_per_rank <= 0:
        return 0.0
    return link.latency + bytes_sent_per_rank * max(1, concurrent_senders) / link.bandwidth


def p2p_time(nbytes: float, link: Link, concurrent_senders: int = 1) -> float:
    """Seconds of one point-to-point transfer (pipeline-parallel activations)."""
    return all_to_all_time(nbytes, link, concurrent_senders)
