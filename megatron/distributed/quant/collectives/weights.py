"""The weight path of the quantized collectives: the qWD / qW all-gather of parameter shards.

Why a module of its own: the weight all-gather (SDP4Bit's qWD, ZeRO++'s qwZ) is a different
algorithm from the gradient reduce-scatter -- one quantization per shard, its codes forwarded
over one group or over PaRO's hops, then a dequantize[-add] on every rank -- and shares with it
only what :mod:`.common` holds.
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..accounting import CommAccounting
from ..config import HopSpec
from ..kernels.dispatch import (QuantizedTensor, dequantize, dequantize_add, quantize,
                                quantize_difference)
from ..streams import CommStreams
from .common import (PendingCollective, _agree_finite, _as_bytes, _from_wire, _one_message,
                     _runner, _wire_message, all_gather_flat)

__all__ = ["gather_layout", "quantized_all_gather", "WEIGHT_COLLECTIVE"]

WEIGHT_COLLECTIVE = "weight_all_gather"


def gather_layout(hops: Sequence[Any]) -> Tuple[List[int], int]:
    """(size of each hop's group, position of this rank's shard in the gathered output) of an
    all-gather whose codes are forwarded over ``hops`` in order: the first hop's pieces are
    innermost, so the position is the sum of rank_h * prod(sizes before h)."""
    sizes = [dist.get_world_size(g) for g in hops]
    me, stride = 0, 1
    for g, k in zip(hops, sizes):
        me += dist.get_rank(g) * stride
        stride *= k
    return sizes, me


def quantized_all_gather(shard: torch.Tensor, full_reference: Optional[torch.Tensor],
                         output: torch.Tensor, group, *, mode: str = "diff", spec: HopSpec,
                         generator: Optional[torch.Generator] = None,
                         accounting: Optional[CommAccounting] = None,
                         link_of_peer: Optional[Callable[[int], str]] = None,
                         hop_links: Optional[Sequence[str]] = None,
                         check_finite: bool = True, nonfinite_flag: Optional[torch.Tensor] = None,
                         async_op: bool = False, streams: Optional[CommStreams] = None,
                         name: str = WEIGHT_COLLECTIVE, label: Optional[str] = None):
    """Quantized all-gather of parameter shards into ``output`` (P * shard elements).

    ``spec`` says how the shard is quantized (bits, group size, rounding; no Hadamard transform
    on this path). Non-finite shards: ``check_finite`` / ``nonfinite_flag`` as in
    :func:`.gradients.two_level_reduce_scatter` (the contracts: :mod:`..collectives`).

    ``mode='diff'`` (qWD, SDP4Bit): send Q(reference.dtype(shard) - full_reference[my shard]) and
    rebuild ``output = full_reference + deQ(all differences)`` on every rank, the owner included,
    so all replicas stay bit-identical and quantization error never accumulates (the next
    difference is taken against the reconstructed weights). ``full_reference`` must be identical
    on all ranks (the previous reconstructed weights); ``output`` may alias it.

    ``mode='direct'`` (qW / ZeRO++ qwZ): send Q(shard) and dequantize; ``full_reference`` unused.

    ``group`` is one process group (output in group-rank order), or a sequence of groups, the
    *hops* (PaRO's hierarchical gathers): the shard is quantized once and its codes are forwarded
    hop by hop, so the first hop's pieces are innermost in ``output`` (position of this rank's
    shard = sum of rank_h * prod(sizes before h)) and nothing is quantized twice.
    ``hop_links`` (per hop) or ``link_of_peer`` (one group) classify links for the accounting;
    without either every peer counts as inter-node.

    Returns ``output``; with ``async_op`` a :class:`PendingCollective` instead: quantize,
    all-gather and dequantize[-add] run on the ``weights`` stage of ``streams`` while the caller
    computes (``--overlap-param-gather``), and ``shard``, ``full_reference`` and ``output`` must
    stay untouched until ``wait()``. ``label``: as in :func:`.gradients.two_level_reduce_scatter`.
    """
    if mode not in ("diff", "direct"):
        raise ValueError(f"mode must be 'diff' or 'direct', got {mode!r}")
    if spec.hadamard:
        raise ValueError("the weight all-gather has no Hadamard transform")
    bits, group_size, stochastic = spec.bits, spec.group_size, spec.stochastic
    hops = list(group) if isinstance(group, (list, tuple)) else [group]
    if hop_links is not None and len(hop_links) != len(hops):
        raise ValueError(f"{len(hop_links)} hop_links for {len(hops)} hops")
    sizes, me = gather_layout(hops)
    world = math.prod(sizes)
    s = shard.numel()
    if output.numel() != s * world:
        raise ValueError(f"output has {output.numel()} elements; expected {world} x shard {s}")
    if s % group_size:
        raise ValueError(f"shard of {s} elements is not divisible by the weight group size {group_size}; "
                         f"pad buckets to a multiple of P*group_size ({world * group_size})")
    if mode == "diff":
        if full_reference is None or full_reference.numel() != output.numel():
            raise ValueError("mode='diff' needs full_reference with as many elements as output")
        if output.dtype != full_reference.dtype:
            raise ValueError(f"output dtype {output.dtype} must match full_reference dtype "
                             f"{full_reference.dtype} (the reconstruction is done in that dtype)")
    if nonfinite_flag is None and check_finite:
        for g in hops:
            _agree_finite(shard, g, "quantized_all_gather")

    per_peer = len(hops) == 1 and hop_links is None
    if per_peer:   # one group: the link of each peer
        links = [link_of_peer(r) if link_of_peer is not None else "inter"
                 for r in range(world) if r != me]
    else:          # hops: the link of each hop
        links = list(hop_links) if hop_links is not None else ["inter"] * len(hops)
    one_message = any(_one_message(link) for link in links)

    if accounting is not None:  # sizes are known now: record in the caller's thread
        if per_peer:
            n_intra = sum(1 for link in links if link == "intra")
            hops_peers = [(n_intra, world - 1 - n_intra)]
        else:   # hop h forwards what the earlier hops gathered
            hops_peers = [((k - 1) * (link == "intra"), (k - 1) * (link != "intra"))
                          for k, link in zip(sizes, links)]
        accounting.record_quantized_all_gather(name, shard_numel=s, elem_size=output.element_size(),
                                               spec=spec, hops=hops_peers)

    def _gather_one_message(q: QuantizedTensor) -> QuantizedTensor:
        """Codes and scales forwarded hop by hop as one packed message (as
        :func:`.gradients._exchange` sends them)."""
        msg = _wire_message(q, 1, 0, s)
        for g, k in zip(hops, sizes):
            if k > 1:
                gathered = torch.empty(msg.numel() * k, dtype=msg.dtype, device=msg.device)
                all_gather_flat(gathered, msg.view(-1), g)
                msg = gathered
        return _from_wire(msg, world, s, bits, group_size, q.scales.dtype)

    def run() -> None:
        if mode == "diff":
            ref_flat = full_reference.reshape(-1)
            q = quantize_difference(shard.reshape(-1), ref_flat[me * s:(me + 1) * s], bits,
                                    group_size, stochastic=stochastic, generator=generator,
                                    check_finite=False, nonfinite_counter=nonfinite_flag)
        else:
            q = quantize(shard.reshape(-1), bits, group_size, stochastic=stochastic,
                         generator=generator, check_finite=False,
                         nonfinite_counter=nonfinite_flag)
        if one_message:
            full = _gather_one_message(q)
        else:
            codes, scales = q.codes, q.scales
            for g, k in zip(hops, sizes):
                if k == 1:
                    continue
                c2 = torch.empty(codes.numel() * k, dtype=codes.dtype, device=codes.device)
                s2 = torch.empty(scales.numel() * k, dtype=scales.dtype, device=scales.device)
                all_gather_flat(c2, codes, g)
                all_gather_flat(_as_bytes(s2), _as_bytes(scales), g)
                codes, scales = c2, s2
            full = QuantizedTensor(codes, scales, bits, group_size, s * world)
        if mode == "diff":
            if output.is_contiguous():
                dequantize_add(full, full_reference.reshape(-1), out=output.view(-1))
            else:
                output.copy_(dequantize_add(full, full_reference.reshape(-1)).view(output.shape))
        elif output.is_contiguous():
            dequantize(full, out=output.reshape(-1))
        else:
            output.copy_(dequantize(full, out_dtype=output.dtype).view(output.shape))

    handle = PendingCollective([_runner(async_op, streams, shard.device).submit(
        "weights", run, label=label or name)])
    if async_op:
        return handle
    handle.wait()
    return output
