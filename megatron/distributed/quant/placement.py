"""Where the ranks sit: the data-parallel ranks per node (D), agreed by every rank, and a check
of the two-level layout against the hosts the ranks really run on.

Why: ranks that disagree on D build different groups and hang in group creation; gathering
every rank's D once turns that into one clear error. The same gather carries hostnames, to warn
when placement is not node-major (``r = node * D + local``) and the intra-node hop crosses hosts.
"""

from __future__ import annotations

import socket
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from .config import QuantizationConfig, TopologyUnknownError, ranks_per_node_from_hosts

__all__ = ["agree_intra_node_size", "agree_across_ranks", "placement_warning", "describe_ranks"]


def describe_ranks(ranks: Sequence[int]) -> str:
    """``0-3, 8, 10-11``: a rank list as runs."""
    out: List[str] = []
    for r in sorted(ranks):
        if out and out[-1][1] == r - 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))  # type: ignore[arg-type]
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)  # type: ignore[misc]


def _resolve(config: QuantizationConfig, dp_size: int, tp_size: int) -> Tuple[Optional[int], str]:
    """This rank's D (None: no flag and no launcher says it) and, if it cannot be had, why."""
    try:
        return config.intra_node_size(dp_size, tp_size), ""
    except TopologyUnknownError:
        return None, ""
    except ValueError as exc:
        return None, str(exc)


def agree_intra_node_size(config: QuantizationConfig, dp_group: object,
                          tp_size: int) -> Tuple[int, List[str]]:
    """(D, every world rank's hostname): D as :meth:`QuantizationConfig.intra_node_size`
    resolves it on each rank, the same on all ranks, or ``ValueError`` on every rank naming the
    ranks that disagree (or that could not resolve it). One ``all_gather_object`` over the world
    (collective: every rank calls it); ranks that no flag or launcher tells fall back to counting
    the DP group's ranks per host."""
    dp_size = dist.get_world_size(dp_group)
    d, error = _resolve(config, dp_size, tp_size)
    everyone: List[Optional[Tuple[Optional[int], str, str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (d, error, socket.gethostname()))
    hostnames = [h for _, _, h in everyone]  # type: ignore[misc]
    failed = [(r, e) for r, (_, e, _) in enumerate(everyone) if e]  # type: ignore[misc]
    if failed:
        rank, first = failed[0]
        raise ValueError(f"rank {rank}: {first}" + (
            f" (and on ranks {describe_ranks([r for r, _ in failed[1:]])})" if failed[1:] else ""))
    values: Dict[Optional[int], List[int]] = {}
    for rank, (value, _, _) in enumerate(everyone):  # type: ignore[misc]
        values.setdefault(value, []).append(rank)
    if set(values) == {None}:   # nobody knows: the hosts say it (the same on every rank)
        per_host = ranks_per_node_from_hosts(hostnames, dist.get_process_group_ranks(dp_group))
        return config.intra_node_size(dp_size, tp_size, dp_ranks_per_host=per_host), hostnames
    if len(values) > 1:
        said = "; ".join(f"ranks {describe_ranks(ranks)}: "
                         f"{'unknown (no launcher variable)' if v is None else v}"
                         for v, ranks in sorted(values.items(), key=lambda kv: min(kv[1])))
        raise ValueError(
            "the ranks disagree on how many data-parallel ranks share a node (from each rank's "
            f"launcher variables, e.g. LOCAL_WORLD_SIZE, or flag): {said}. The two-level "
            "collectives need the same number on every node: launch the same number of ranks "
            "per node, or pass the same --data-parallel-intra-node-size to every rank")
    return next(iter(values)), hostnames  # type: ignore[return-value]


def agree_across_ranks(value: object, what: str, flag: str) -> None:
    """Raise ``ValueError`` on every rank unless every rank of the world passes the same
    ``value`` (``what`` it is, ``flag`` the way to set it for all): one ``all_gather_object``,
    so a per-rank setting that differs (from each node's launcher variables) is an error at
    startup, not a hang in the world-collective group creation that follows."""
    everyone: List[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    values: Dict[str, List[int]] = {}
    for rank, v in enumerate(everyone):
        values.setdefault(repr(v), []).append(rank)
    if len(values) > 1:
        said = "; ".join(f"ranks {describe_ranks(r)}: {v}"
                         for v, r in sorted(values.items(), key=lambda kv: min(kv[1])))
        raise ValueError(f"the ranks disagree on {what}: {said}; pass the same {flag} to every "
                         "rank (or launch the same number of ranks per node)")


def placement_warning(hostnames: Sequence[str], dp_ranks: Sequence[int],
                      intra_size: int) -> Optional[str]:
    """The warning for a data-parallel group whose "nodes" (``intra_size`` consecutive DP ranks)
    span several hosts, or None. Several "nodes" on one host are fine (``--data-parallel-intra-
    node-size`` emulating nodes on one machine)."""
    spread = []
    for start in range(0, len(dp_ranks), intra_size):
        members = list(dp_ranks[start:start + intra_size])
        hosts = sorted({hostnames[r] for r in members})
        if len(hosts) > 1:
            spread.append(f"ranks {describe_ranks(members)} on {', '.join(hosts)}")
    if not spread:
        return None
    more = f" (and {len(spread) - 2} more)" if len(spread) > 2 else ""
    return ("the two-level collectives treat each run of "
            f"{intra_size} consecutive data-parallel ranks as one node, but {'; '.join(spread[:2])}"
            f"{more}: their 8-bit \"intra-node\" hop crosses the network (and is reported as "
            "intra-node). Place ranks node-major (torchrun's order, srun --distribution=block) "
            "or set --data-parallel-intra-node-size to the ranks per host")
