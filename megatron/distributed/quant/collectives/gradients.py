"""The gradient path of the quantized collectives: the two-level reduce-scatter (TLq / TLq-HS, qgZ).

Why a module of its own: the gradient reduce-scatter is its own algorithm -- destination-major
slots, two all-to-all hops with a requantization between them, pipeline chunks, LoCo's error
feedback -- and shares with the weight path (:mod:`.weights`) only what :mod:`.common` holds.

For a bucket of N elements over P = M*D ranks (DP rank r = node*D + local):

1. [Hadamard ->] quantize as the ``intra`` :class:`HopSpec` says and write destination
   partitions in the order [dest local l][dest node n] (slot l*M + n holds partition n*D + l);
2. all-to-all (codes, then scales) inside the node: local peer l receives slots l*M .. l*M+M-1;
3. dequantize, fp32-sum the D sources, requantize as the ``inter`` :class:`HopSpec` says
   (with its own group size);
4. all-to-all across nodes: inter peer n receives the piece for node n (codes and scales
   packed in one message: :func:`_exchange`);
5. dequantize, fp32-sum the M sources [-> inverse Hadamard] into the output shard.

The result is the exact SUM over ranks (the layout of ``dist.reduce_scatter_tensor``). Hadamard
is applied once before the first quantization and inverted at the very end. Non-finite inputs and
stochastic rounding: the contracts of :mod:`..collectives`.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..accounting import CommAccounting
from ..config import HopSpec
from ..kernels.dispatch import (NoiseIndex, QuantizedTensor, dequantize, dequantize_partitions,
                                dequantize_sum, dequantize_sum_requantize, quantize,
                                quantize_partitions)
from ..streams import CommStreams, Job, used_on_this_stage
from ..topology import TwoLevelGroups
from .common import (PendingCollective, _agree_finite, _as_bytes, _from_wire, _one_message,
                     _runner, _wire_message, required_padding_multiple)

__all__ = ["two_level_reduce_scatter", "swizzle_order", "pipeline_bounds", "GRAD_COLLECTIVE"]

GRAD_COLLECTIVE = "grad_reduce_scatter"


# ------------------------------------------------------------------------------------------------
# layout helpers
# ------------------------------------------------------------------------------------------------

def swizzle_order(intra_size: int, inter_size: int) -> List[int]:
    """Partition held by each output slot: slot j = l*M + n holds DP rank n*D + l's partition.

    Grouping the slots by destination local index makes the intra all-to-all's piece l exactly
    what local peer l forwards to its M inter-node peers. D == 1 or M == 1 gives the identity.
    """
    d, m = intra_size, inter_size
    return [(j % m) * d + j // m for j in range(d * m)]




def pipeline_bounds(shard_numel: int, unit: int, chunks: int) -> List[Tuple[int, int]]:
    """``[a, b)`` sub-ranges of a destination shard for ``--gradient-alltoall-pipeline``.

    ``min(chunks, shard_numel // unit)`` nearly equal runs of whole ``unit``s (the lcm of the
    hops' group sizes): every chunk holds whole quantization groups of every hop, so chunking
    never changes which elements share a group (nor, with :class:`NoiseIndex`, their rounding)."""
    units = shard_numel // unit
    k = max(1, min(int(chunks), units))
    edges = [unit * (y * units // k) for y in range(k + 1)]
    return list(zip(edges[:-1], edges[1:]))


# ------------------------------------------------------------------------------------------------
# small internals
# ------------------------------------------------------------------------------------------------

def _exchange(q: QuantizedTensor, group, *, rows: int, a: int = 0, b: Optional[int] = None,
              one_message: bool) -> QuantizedTensor:
    """Equal-split all-to-all of elements ``[a, b)`` of each of ``q``'s ``rows`` rows (blocking:
    it runs on a stage of :mod:`..streams`, or inline).

    ``one_message`` (hops that cross nodes): codes and scales travel as one packed message, one
    latency instead of two. ``q`` may come from another stage; it is declared used on this one."""
    # See [Note: one packed message across nodes] in docs/architecture.md
    # See [Note: cross-stream buffer lifetimes] in docs/architecture.md
    used_on_this_stage(q.codes, q.scales)
    row = q.numel // rows
    b = row if b is None else b
    if one_message:
        msg = _wire_message(q, rows, a, b)
        recv = torch.empty_like(msg)
        dist.all_to_all_single(recv, msg, group=group)
        return _from_wire(recv, rows, b - a, q.bits, q.group_size, q.scales.dtype)
    q = _row_slice(q, rows, a, b)
    codes = torch.empty_like(q.codes)
    scales = torch.empty_like(q.scales)
    dist.all_to_all_single(codes, q.codes, group=group)
    dist.all_to_all_single(_as_bytes(scales), _as_bytes(q.scales), group=group)
    return QuantizedTensor(codes, scales, q.bits, q.group_size, q.numel)




def _row_slice(q: QuantizedTensor, rows: int, a: int, b: int) -> QuantizedTensor:
    """Elements ``[a, b)`` of each of ``rows`` equal rows of ``q`` (a contiguous copy, or ``q``
    itself for whole rows); ``a`` and ``b`` are multiples of ``q.group_size``."""
    row = q.numel // rows
    if a == 0 and b == row:
        return q
    codes = q.codes.view(rows, -1)[:, a * q.bits // 8:b * q.bits // 8].contiguous().view(-1)
    scales = q.scales.view(rows, -1)[:, a // q.group_size:b // q.group_size].contiguous().view(-1)
    return QuantizedTensor(codes, scales, q.bits, q.group_size, rows * (b - a))


def _write_result(src_fp32: torch.Tensor, output: torch.Tensor) -> None:
    output.copy_(src_fp32.view(output.shape))


# ------------------------------------------------------------------------------------------------
# gradient reduce-scatter
# ------------------------------------------------------------------------------------------------

def _check_call(n: int, output: torch.Tensor, groups: TwoLevelGroups, intra: HopSpec,
                inter: HopSpec, pipeline: int) -> None:
    """Raise ValueError, before anything is sent, for a call
    :func:`two_level_reduce_scatter` cannot run: an output that is not N/P elements, hops that
    disagree on the Hadamard transform or whose groups a Hadamard block straddles, a bucket
    that is not a multiple of :func:`.common.required_padding_multiple`, ``pipeline`` < 1."""
    p, d, m = groups.dp_size, groups.intra_size, groups.inter_size
    if output.numel() * p != n:
        raise ValueError(f"output has {output.numel()} elements; expected N/P = {n}/{p}")
    if inter.hadamard != intra.hadamard or (
            intra.hadamard and inter.hadamard_block != intra.hadamard_block):
        raise ValueError(f"the hops disagree on the Hadamard transform (intra {intra}, inter "
                         f"{inter}): it is applied once before the first hop and inverted after "
                         f"the last")
    if intra.hadamard:
        for hop, spec in (("intra", intra), ("inter", inter)):
            if spec.group_size % spec.hadamard_block:
                raise ValueError(f"with Hadamard, the {hop} group_size ({spec.group_size}) must "
                                 f"be a multiple of the Hadamard block ({spec.hadamard_block}) "
                                 f"so blocks never straddle groups")
    mult = required_padding_multiple(p, d, intra.group_size, inter.group_size)
    if n % mult:
        raise ValueError(
            f"bucket of {n} elements is not divisible by {mult} (P={p} x group sizes "
            f"{intra.group_size}/{inter.group_size} for D={d}, M={m}); pad the bucket with "
            f"required_padding_multiple()")
    if int(pipeline) < 1:
        raise ValueError(f"pipeline must be >= 1, got {pipeline}")


def two_level_reduce_scatter(input: torch.Tensor, output: torch.Tensor, groups: TwoLevelGroups, *,  # noqa: A002
                             intra: HopSpec, inter: HopSpec,
                             generator: Optional[torch.Generator] = None,
                             accounting: Optional[CommAccounting] = None, error_feedback=None,
                             async_op: bool = False, check_finite: bool = True,
                             nonfinite_flag: Optional[torch.Tensor] = None, pipeline: int = 1,
                             streams: Optional[CommStreams] = None,
                             name: str = GRAD_COLLECTIVE,
                             label: Optional[str] = None) -> Optional[PendingCollective]:
    """Quantized reduce-scatter: ``output`` (N/P elements) = sum over DP ranks of ``input``'s
    shard ``dp_rank`` — the layout of ``dist.reduce_scatter_tensor(output, input, dp_group)``.

    Paths: D>1, M>1 two hops (``intra``, then ``inter``); D>1, M==1 one hop as ``intra``;
    D==1, M>1 one hop as ``inter``; P==1 copy. The Hadamard transform (TLq-HS) is applied once
    before the first hop and inverted after the last, so ``intra`` and ``inter`` must agree on
    it; each hop rounds as its own spec says. ``error_feedback`` is a
    :class:`~megatron.distributed.quant.loco.LoCoBucketErrors` (E1 before the first quantization,
    E2 before the inter requantization; single-hop paths use E1 only). ``output`` may alias the
    caller's own shard of ``input`` (SDP4Bit writes in place into the grad bucket): the input is
    fully consumed by the first quantization before anything is written.

    ``pipeline`` (``--gradient-alltoall-pipeline``): the exchanges run in that many chunks
    (:func:`pipeline_bounds` of every destination shard), so the intra hop of chunk y+1 overlaps
    the inter hop of chunk y. The first quantization is one call for the whole bucket and every
    chunk of the middle requantization rounds as the whole call would (:class:`NoiseIndex`, the
    generator state restored per chunk): the result is bit-identical for every ``pipeline``.
    With LoCo the middle hop needs the whole intra sum (E2 is one buffer), so only the inter hop
    is chunked.

    ``async_op`` runs the steps on ``streams`` (:mod:`..streams`: worker threads on CPU, CUDA
    streams on GPU; a process-wide set if None) and returns a :class:`PendingCollective`; else
    they run inline and None is returned. Same steps, same order: the result does not depend on it.

    ``generator`` (host or ``input``'s device) feeds the stochastic rounding; host generators never
    sync the device. ``check_finite`` / ``nonfinite_flag``: the contracts of :mod:`..collectives`.
    ``label`` (default ``name``) says which buffer this is in the error every rank sees when a
    job of the call fails (:mod:`..failures`; the hop and pipeline chunk are added to it).
    """
    # See [Note: non-finite contracts] in docs/architecture.md
    if not input.is_contiguous():
        raise ValueError("input must be a contiguous buffer (a flat gradient bucket)")
    x = input.reshape(-1)
    n = x.numel()
    p, d, m = groups.dp_size, groups.intra_size, groups.inter_size
    _check_call(n, output, groups, intra, inter, pipeline)
    hadamard, hadamard_block = intra.hadamard, intra.hadamard_block
    group_size_inter = inter.group_size

    if p == 1:
        output.copy_(x.view(output.shape))
        return None

    if nonfinite_flag is None and check_finite:
        _agree_finite(x, groups.dp_group, "two_level_reduce_scatter")

    two_level = d > 1 and m > 1
    if d > 1:  # two-level or intra-only: the first (or only) hop is inside the node
        hop1, group1, size1 = intra, groups.intra_group, d
    else:
        hop1, group1, size1 = inter, groups.inter_group, m
    bits1, gs1 = hop1.bits, hop1.group_size
    one_message1 = _one_message("intra" if d > 1 else "inter")
    one_message2 = _one_message("inter")
    order = swizzle_order(d, m)
    shard = n // p
    bounds = pipeline_bounds(shard, math.lcm(gs1, group_size_inter) if two_level else gs1,
                             pipeline)
    if len(bounds) > 1 and not output.is_contiguous():
        raise ValueError("a pipelined reduce-scatter needs a contiguous output shard")
    out_flat = output.view(-1) if output.is_contiguous() else None
    ef = error_feedback
    gen = generator if generator is not None else torch.default_generator

    if accounting is not None:  # sizes are known now: record in the caller's thread
        accounting.record_two_level_reduce_scatter(
            name, numel=n, elem_size=x.element_size(), dp_size=p, intra_size=d,
            intra=intra, inter=inter)

    state: dict = {}

    def quantize_first() -> None:
        """[E1] -> [Hadamard] -> quantize into destination-major slots (whole bucket).

        With LoCo at most two bucket-sized fp32 buffers are alive at once: ``h`` (a new tensor
        of compensate()'s), which one :func:`dequantize_partitions` call over the slot table turns
        into the residual ``h - sent`` in place, and the stored error read back for the update."""
        h = x if ef is None else ef.compensate("e1", x, group_size=gs1)
        q1 = quantize_partitions(h, p, order, bits1, gs1, stochastic=hop1.stochastic,
                                 generator=gen, hadamard=hadamard, hadamard_block=hadamard_block,
                                 check_finite=False, nonfinite_counter=nonfinite_flag)
        if ef is not None:
            residual = dequantize_partitions(q1, p, order, hadamard=hadamard,
                                             hadamard_block=hadamard_block, subtract_from=h,
                                             out=h)
            del h
            ef.update_residual("e1", residual)
            del residual
        state["q1"] = q1
        if len(bounds) > 1:
            state["gen"] = gen.get_state()     # where every middle chunk starts drawing

    def final(recv: QuantizedTensor, sources: int, a: int, b: int) -> None:
        """Dequantize + fp32 sum of the sources [-> inverse Hadamard] into output[a:b]."""
        if out_flat is not None and output.dtype == torch.float32:
            dequantize_sum(recv, sources, hadamard=hadamard, hadamard_block=hadamard_block,
                           out=out_flat[a:b])
            return
        res = dequantize_sum(recv, sources, hadamard=hadamard, hadamard_block=hadamard_block)
        if out_flat is not None:
            out_flat[a:b].copy_(res)
        else:
            _write_result(res, output)

    def first_hop(y: int, a: int, b: int) -> Callable[[], None]:
        def run() -> None:
            if y == 0:
                quantize_first()
            q1 = state["q1"] if y < len(bounds) - 1 else state.pop("q1")
            recv1 = _exchange(q1, group1, rows=p, a=a, b=b, one_message=one_message1)
            del q1   # the bucket's first-hop codes: kept only while a chunk still sends them
            if not two_level:
                final(recv1, size1, a, b)
                return
            # middle: dequantize + sum D sources -> requantize to inter bits/group
            noise = None
            if len(bounds) > 1:
                gen.set_state(state["gen"])
                noise = NoiseIndex(part_len=b - a, part_stride=shard, base=a, total=m * shard)
            state["q2", y] = (dequantize_sum_requantize(
                recv1, d, inter.bits, group_size_out=group_size_inter, stochastic=inter.stochastic,
                generator=gen, noise_index=noise), 0, b - a)
        return run

    def first_hop_loco() -> None:
        """LoCo (two-level): whole intra hop, then the middle with E2 on the whole intra sum."""
        quantize_first()
        recv1 = _exchange(state.pop("q1"), group1, rows=p, one_message=one_message1)
        s = dequantize_sum(recv1, d)  # transformed domain with Hadamard
        del recv1
        h2 = ef.compensate("e2", s, group_size=group_size_inter)
        del s
        q2 = quantize(h2, inter.bits, group_size_inter, stochastic=inter.stochastic, generator=gen,
                      check_finite=False)
        residual = dequantize(q2)
        residual = torch.sub(h2, residual, out=residual)   # as in quantize_first
        del h2
        ef.update_residual("e2", residual)
        del residual
        for y, (a, b) in enumerate(bounds):
            state["q2", y] = (q2, a, b)      # sliced by the inter stage's message copy

    def second_hop(y: int, a: int, b: int) -> Callable[[], None]:
        def run() -> None:
            q2, lo, hi = state.pop(("q2", y))
            final(_exchange(q2, groups.inter_group, rows=m, a=lo, b=hi, one_message=one_message2),
                  m, a, b)
        return run

    runner = _runner(async_op, streams, x.device)
    first_stage = "intra" if d > 1 else "inter"
    first_link = "intra-node" if d > 1 else "inter-node"

    what = label or name

    def job_label(hop: str, y: int) -> str:   # what the error every rank sees names
        return f"{what}, {hop}" + (f" (pipeline chunk {y + 1}/{len(bounds)})"
                                   if len(bounds) > 1 else "")
    jobs: List[Job] = []
    if two_level and ef is not None:
        middle = runner.submit("intra", first_hop_loco,
                               label=f"{what}, intra-node hop and LoCo requantization")
        jobs = [runner.submit("inter", second_hop(y, a, b), after=[middle],
                              label=job_label("inter-node hop", y))
                for y, (a, b) in enumerate(bounds)]
    else:
        for y, (a, b) in enumerate(bounds):
            hop = runner.submit(first_stage, first_hop(y, a, b),
                                label=job_label(f"{first_link} hop", y))
            jobs.append(runner.submit("inter", second_hop(y, a, b), after=[hop],
                                      label=job_label("inter-node hop", y))
                        if two_level else hop)
    handle = PendingCollective(jobs)
    if async_op:
        return handle
    handle.wait()
    return None
