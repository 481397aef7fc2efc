"""PaRO-CC communication: the PaRO groups, the engine's collectives and their byte counter.

Spec: ../shared/research/paro.md §4. :func:`build_paro_groups` builds the intra-group (m ranks, the
fast link) and inter-group (same local index) process groups; :func:`hierarchical_all_reduce` is
the two-hop all-reduce (NNN's boundary sync); ``_reduce_scatter`` / ``_all_gather`` / ``_count``
are the one-hop collectives the engine (:mod:`.engine`) issues per scope, each counted in a
:class:`CommCounter` with the cost model's convention (:func:`.cost.ring_bytes`), so a
measured step equals :func:`.cost.communication_volume` exactly.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..collectives.common import all_gather_flat, reduce_scatter_flat
from .cost import ring_bytes
from .strategy import resolve_group_size

__all__ = ["CommCounter", "build_paro_groups", "hierarchical_all_reduce"]


class CommCounter:
    """Bytes this rank sends, by link, counted with the cost model's convention.

    Each recorded collective of a logical tensor of ``numel`` elements among ``ranks`` ranks adds
    :func:`.cost.ring_bytes` to its link, so a measured step can be compared with
    :func:`.cost.communication_volume` exactly.
    """

    def __init__(self) -> None:
        self.bytes: Dict[str, float] = {"intra": 0.0, "inter": 0.0}
        self.calls: List[Tuple[str, str, int, int]] = []
        """(link, op, logical numel, ranks) per collective call, in order."""

    def record(self, link: str, op: str, numel: int, element_size: float, ranks: int) -> None:
        if link not in self.bytes:
            raise ValueError(f"link must be 'intra' or 'inter', got {link!r}")
        self.bytes[link] += ring_bytes(op, numel * element_size, ranks)
        self.calls.append((link, op, numel, ranks))

    def reset(self) -> None:
        self.bytes = {"intra": 0.0, "inter": 0.0}
        self.calls = []


def build_paro_groups(group_size: int, dp_ranks: Optional[Sequence[int]] = None,
                      backend: Optional[str] = None, timeout: Optional[timedelta] = None) -> Any:
    """Intra (one per group of m consecutive DP ranks) and inter (same local index) groups.

    Delegates to :func:`megatron.distributed.quant.topology.build_two_level_groups`, whose layout
    (DP rank r = group * m + local) is the one PaRO assumes. Collective over the whole world;
    returns a ``TwoLevelGroups`` (``intra_group`` / ``inter_group`` are None for a size-1 side).
    ``timeout``: the run's (every communicator created here takes it).
    """
    from ..topology import build_two_level_groups

    ranks = list(range(dist.get_world_size())) if dp_ranks is None else list(dp_ranks)
    resolve_group_size(len(ranks), group_size)
    return build_two_level_groups(ranks, group_size, backend=backend, timeout=timeout)


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any, op: Any) -> None:
    reduce_scatter_flat(out, inp, group, op=op)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    all_gather_flat(out, inp, group)


def _count(counter: Optional[CommCounter], link: str, op: str, numel: int, t: torch.Tensor,
           ranks: int) -> None:
    if counter is not None and ranks > 1:
        counter.record(link, op, numel, t.element_size(), ranks)


def hierarchical_all_reduce(tensor: torch.Tensor, intra_group: Any, inter_group: Any, *,
                            op: Any = dist.ReduceOp.SUM,
                            counter: Optional[CommCounter] = None) -> torch.Tensor:
    """In-place all-reduce as intra reduce-scatter -> inter all-reduce of the 1/m slice -> intra
    all-gather (spec §4).

    Only 1/m of the data crosses the slow inter-group link, and each of the m ranks of a group
    drives its own inter link in parallel. The tensor is padded to a multiple of m (the padding
    lives only in a scratch buffer and is dropped). ``None`` for a group means that
    side has one rank and its hop is skipped. Result equals ``dist.all_reduce`` up to summation
    order (exactly for integer-valued floats).
    """
    m, g = _size(intra_group), _size(inter_group)
    flat = tensor.reshape(-1)
    numel = flat.numel()
    padded_numel = -(-numel // m) * m
    if m > 1:
        buf = torch.zeros(padded_numel, dtype=tensor.dtype, device=tensor.device)
        buf[:numel].copy_(flat)
        shard = torch.empty(padded_numel // m, dtype=tensor.dtype, device=tensor.device)
        _reduce_scatter(shard, buf, intra_group, op)
        _count(counter, "intra", "reduce_scatter", padded_numel, buf, m)
    else:
        buf = flat.contiguous()  # a view of `tensor` when it is contiguous: reduced in place
        shard = buf
    if g > 1:
        dist.all_reduce(shard, op=op, group=inter_group)
        _count(counter, "inter", "all_reduce", shard.numel(), shard, g)
    if m > 1:
        _all_gather(buf, shard, intra_group)
        _count(counter, "intra", "all_gather", padded_numel, buf, m)
    if buf.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(buf[:numel].view(tensor.shape))
    return tensor
