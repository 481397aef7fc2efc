"""Quantized data-parallel collectives: two-level gradient reduce-scatter and weight all-gather.

Both are independent of megatron-core: they take flat buffers and process groups
(:class:`~megatron.distributed.quant.topology.TwoLevelGroups`) and can be wired into any bucketed
DDP. See ../shared/research/sdp4bit.md §3/§4 and zeropp.md (qgZ) for the algorithms.

Gradient reduce-scatter (TLq / TLq-HS, qgZ), for a bucket of N elements over P = M*D ranks
(DP rank r = node*D + local):

1. [Hadamard ->] quantize to ``bits_intra`` with ``group_size_intra`` and write destination
   partitions in the order [dest local l][dest node n] (slot l*M + n holds partition n*D + l);
2. all-to-all (codes, then scales) inside the node: local peer l receives slots l*M .. l*M+M-1;
3. dequantize, fp32-sum the D sources, requantize to ``bits_inter`` with ``group_size_inter``
   (the reference silently kept the intra group size here; we use the configured one);
4. all-to-all across nodes: inter peer n receives the piece for node n (codes and scales
   packed in one message: :func:`_exchange`);
5. dequantize, fp32-sum the M sources [-> inverse Hadamard] into the output shard.

The result is the exact SUM over ranks (the layout of ``dist.reduce_scatter_tensor``), not the
sum divided by the node count as in DeepSpeed's qgZ/LoCo path. Hadamard is applied once before
the first quantization and inverted once at the very end; the middle hop works in the
transformed domain.

Non-finite inputs, two contracts:

* ``check_finite=True`` (default, standalone use): every rank tests its own input, the verdict is
  agreed with a one-element all-reduce over the DP group, and then *all* ranks raise
  :class:`NonFiniteError` before any payload moves. Raising on one rank only would leave the others
  blocked inside the all-to-all. It costs an all-reduce and a host sync per call.
* ``nonfinite_flag=<int32 device tensor>`` (the trainer's path): no agreement and no host sync
  here; the first quantization adds the number of NaN/Inf inputs into the flag on the device (in
  the same pass on CUDA: the Triton kernel's fused count) and the payload moves anyway (a
  poisoned group dequantizes to NaN, never to finite values). The caller agrees on the flag once
  per training step and skips the step -- one host sync per step instead of one per bucket and
  hop, which would stall the CUDA stream and serialize the overlap.

Stochastic rounding uses the ``generator`` passed in (reproducible). Give each rank a different
seed (e.g. ``seed + global_rank``): identical draws on all ranks correlate the rounding errors
and stop them from averaging out.
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .accounting import CommAccounting
from .kernels import (NoiseIndex, NonFiniteError, QuantizedTensor, all_finite, dequantize,
                      dequantize_add, dequantize_sum, dequantize_sum_requantize, quantize,
                      quantize_difference, quantize_partitions)
from .streams import INLINE, CommStreams, CommTiming, Job, used_on_this_stage
from .topology import TwoLevelGroups

__all__ = [
    "two_level_reduce_scatter", "quantized_all_gather", "required_padding_multiple",
    "required_padding_multiple_from_config", "swizzle_order", "PendingCollective",
    "pipeline_bounds", "NonFiniteError",
]

GRAD_COLLECTIVE = "grad_reduce_scatter"
WEIGHT_COLLECTIVE = "weight_all_gather"


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


def required_padding_multiple(dp_size: int, intra_size: int, group_size_intra: int,
                              group_size_inter: int, *, quantized_gradients: bool = True,
                              weight_group_size: Optional[int] = None) -> int:
    """Smallest multiple every bucket size N must have for the quantized collectives.

    Gradients: each of the P destination shards must hold whole groups of every hop that runs:
    P*lcm(gs_intra, gs_inter) for two levels, P*gs_intra for intra-only (M == 1), P*gs_inter for
    inter-only (D == 1), 1 for P == 1. Weights (``weight_group_size``): P*wq_group_size so every
    shard holds whole weight groups. The result is the lcm of the active requirements.
    """
    if dp_size <= 0 or intra_size <= 0 or dp_size % intra_size:
        raise ValueError(f"DP size {dp_size} must be a positive multiple of the intra-node size {intra_size}")
    for name, gs in (("group_size_intra", group_size_intra), ("group_size_inter", group_size_inter)):
        if gs <= 0:
            raise ValueError(f"{name} must be positive, got {gs}")
    d, m = intra_size, dp_size // intra_size
    mult = 1
    if quantized_gradients and dp_size > 1:
        if d > 1 and m > 1:
            mult = dp_size * math.lcm(group_size_intra, group_size_inter)
        elif d > 1:
            mult = dp_size * group_size_intra
        else:
            mult = dp_size * group_size_inter
    if weight_group_size is not None:
        if weight_group_size <= 0:
            raise ValueError(f"weight_group_size must be positive, got {weight_group_size}")
        mult = math.lcm(mult, dp_size * weight_group_size)
    return mult


def required_padding_multiple_from_config(cfg, dp_size: int, intra_size: int) -> int:
    """:func:`required_padding_multiple` for a :class:`QuantizationConfig` (both paths it enables)."""
    return required_padding_multiple(
        dp_size, intra_size, cfg.gq_group_size_intra, cfg.gq_group_size_inter,
        quantized_gradients=cfg.quantized_gradients,
        weight_group_size=cfg.wq_group_size if cfg.quantized_weights else None)


# ------------------------------------------------------------------------------------------------
# small internals
# ------------------------------------------------------------------------------------------------

def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool = False):
    """Equal-size all-gather of flat tensors under torch's current name (``all_gather_single``;
    ``all_gather_into_tensor`` on a torch that predates it, which newer ones deprecate)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group: Any, op: Any = None,
                        async_op: bool = False):
    """Equal-size reduce-scatter of flat tensors under torch's current name
    (``reduce_scatter_single``; ``reduce_scatter_tensor`` before it)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, op=dist.ReduceOp.SUM if op is None else op, group=group,
              async_op=async_op)


def _agree_finite(x: torch.Tensor, group, what: str) -> None:
    """Raise NonFiniteError on every rank of ``group`` if any rank's ``x`` is non-finite."""
    bad = torch.zeros(1, dtype=torch.float32, device=x.device)
    if not all_finite(x):  # one fused pass on the C++ CPU backend (no N-byte bool temporary)
        bad.fill_(1.0)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if bad.item() > 0:
        raise NonFiniteError(f"{what}: a rank's input holds NaN/Inf; no data was exchanged (skip this step)")


def _wire_message(q: QuantizedTensor, rows: int, a: int, b: int) -> torch.Tensor:
    """Codes and scales of elements ``[a, b)`` of each of ``rows`` equal rows of ``q`` as one
    uint8 message ``[rows, codes bytes | scale bytes]`` (row r is peer r's piece of an
    all-to-all, or the one row of an all-gather). The pipeline chunk's slice is part of the
    same copy. ``a`` and ``b`` are multiples of ``q.group_size``."""
    bits, gs = q.bits, q.group_size
    code_bytes = (b - a) * bits // 8
    scale_bytes = (b - a) // gs * q.scales.element_size()
    msg = torch.empty(rows, code_bytes + scale_bytes, dtype=torch.uint8, device=q.codes.device)
    msg[:, :code_bytes].copy_(q.codes.view(rows, -1)[:, a * bits // 8:b * bits // 8])
    msg[:, code_bytes:].copy_(q.scales.view(rows, -1)[:, a // gs:b // gs].view(torch.uint8))
    return msg


def _from_wire(msg: torch.Tensor, rows: int, row_numel: int, bits: int, group_size: int,
               scale_dtype: torch.dtype) -> QuantizedTensor:
    """The :class:`QuantizedTensor` of ``rows`` received :func:`_wire_message` rows of
    ``row_numel`` elements each (codes and scales copied out contiguous, as the kernels read
    them)."""
    msg = msg.view(rows, -1)
    code_bytes = row_numel * bits // 8
    codes = msg[:, :code_bytes].reshape(-1)
    scales = torch.empty(rows * (row_numel // group_size), dtype=scale_dtype, device=msg.device)
    scales.view(torch.uint8).view(rows, -1).copy_(msg[:, code_bytes:])
    return QuantizedTensor(codes, scales, bits, group_size, rows * row_numel)


def _exchange(q: QuantizedTensor, group, *, rows: int, a: int = 0, b: Optional[int] = None,
              one_message: bool) -> QuantizedTensor:
    """Equal-split all-to-all of elements ``[a, b)`` of each of ``q``'s ``rows`` rows (blocking:
    it runs on a stage of :mod:`.streams`, or inline).

    ``one_message`` (the hops that cross nodes, :func:`_one_message`): codes and scales travel
    as one packed message, so the hop pays one all-to-all latency, not two (review item 8;
    the latency dominates the inter-node hop at M >= 32). The price is a copy of the
    compressed bytes on each side (about 1/4 of the memory traffic of quantizing fp32 to 4 bits,
    a few % of sending those bytes over a 200 Gb/s link), which inside a node, where NVLink
    moves them almost as fast as the copy, would cost more than the second message saves: there
    codes and scales go as two all-to-alls.

    ``q`` may come from another stage (the middle hop's codes, made on ``intra`` and sent on
    ``inter``, whose last reference the caller drops once this job is enqueued): it is declared
    used on this stage so the allocator cannot hand its memory to the next intra job before
    this stage has read it."""
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


def _as_bytes(scales: torch.Tensor) -> torch.Tensor:
    """The scales as the bytes they are on the wire. A group holding NaN/Inf has a NaN scale by
    design (kernels/reference.py: the step is then skipped), and ``TORCH_NCCL_NAN_CHECK=1``
    traps any NaN in a floating-point collective's input: sent as fp32 the scales stopped the
    job where it should skip one step. Bytes are what the packed messages send anyway."""
    return scales.view(torch.uint8)


def _one_message(link: str) -> bool:
    """Whether a hop over ``link`` ('intra' / 'inter') sends codes and scales as one message
    (:func:`_exchange`): across nodes, where a message's latency costs more than copying the
    compressed bytes; not inside a node."""
    return link != "intra"


def _write_result(src_fp32: torch.Tensor, output: torch.Tensor) -> None:
    output.copy_(src_fp32.view(output.shape))


def _dequantize_in_input_order(q: QuantizedTensor, order: Optional[Sequence[int]],
                               hadamard: bool, hadamard_block: int) -> torch.Tensor:
    """``dequantize(q)`` put back from slot order into the input layout, without a slot-ordered
    copy (what ``index_select`` of the slots made): each slot is
    dequantized straight into its partition's place (one kernel call per slot; one in all for
    ``order`` None, the identity). Bit-identical: dequantizing is per element (per Hadamard
    block, and blocks never straddle a partition)."""
    if order is None:
        return dequantize(q, hadamard=hadamard, hadamard_block=hadamard_block)
    rows = len(order)
    out = torch.empty(q.numel, dtype=torch.float32, device=q.codes.device)
    part = out.view(rows, -1)
    code_bytes, groups = q.codes.numel() // rows, q.scales.numel() // rows
    for slot, partition in enumerate(order):
        piece = QuantizedTensor(q.codes[slot * code_bytes:(slot + 1) * code_bytes],
                                q.scales[slot * groups:(slot + 1) * groups], q.bits,
                                q.group_size, q.numel // rows)
        dequantize(piece, hadamard=hadamard, hadamard_block=hadamard_block, out=part[partition])
    return out


class PendingCollective:
    """Handle of asynchronous quantized collectives: :meth:`wait` returns once the outputs hold
    the results, re-raising a failure of any of their jobs; idempotent once it succeeded.

    One class for every pending quantized collective: one call's jobs (``async_op=True``), or
    several calls' (:meth:`combine`, a bucket group's buckets) with the time waited counted as
    exposed ``kind`` time by a :class:`~.streams.CommTiming` and an optional ``finish`` step run
    once after the last job (the AVG division of megatron-core's ``average_in_collective``).
    The inputs must stay untouched until then (the stages read them), and the outputs must not
    be read before: megatron-core's bucket handles guarantee both."""

    def __init__(self, jobs: Sequence[Job], *, timing: Optional[CommTiming] = None,
                 kind: str = "grad", finish: Optional[Callable[[], None]] = None) -> None:
        self.jobs = list(jobs)
        self._timing = timing
        self._kind = kind
        self._finish = finish
        self._done = False

    @classmethod
    def combine(cls, handles: Sequence[Optional["PendingCollective"]], *,
                timing: Optional[CommTiming] = None, kind: str = "grad",
                finish: Optional[Callable[[], None]] = None) -> "PendingCollective":
        """One handle for the jobs of several calls (None entries: calls that finished inline)."""
        return cls([j for h in handles if h is not None for j in h.jobs], timing=timing,
                   kind=kind, finish=finish)

    def wait(self) -> None:
        if self._done:
            return
        for job in self.jobs:
            if self._timing is not None:
                self._timing.wait(self._kind, job)
            else:
                job.wait()
        self._done = True
        if self._finish is not None:
            self._finish()

    def is_completed(self) -> bool:
        return self._done or all(job.is_completed() for job in self.jobs)


_ASYNC_STREAMS: dict = {}


def _runner(async_op: bool, streams: Optional[CommStreams], device: torch.device) -> CommStreams:
    """Inline without overlap; else the caller's streams (by default one process-wide set per
    device: worker threads for CPU, CUDA streams for a GPU)."""
    if not async_op:
        return INLINE
    if streams is not None:
        return streams
    key = str(device)
    if key not in _ASYNC_STREAMS:
        _ASYNC_STREAMS[key] = CommStreams.for_device(device)
    return _ASYNC_STREAMS[key]


def pipeline_bounds(shard_numel: int, unit: int, chunks: int) -> List[Tuple[int, int]]:
    """``[a, b)`` sub-ranges of a destination shard for ``--gradient-alltoall-pipeline``.

    ``min(chunks, shard_numel // unit)`` nearly equal runs of whole ``unit``s (the lcm of the
    hops' group sizes): every chunk holds whole quantization groups of every hop, so chunking
    never changes which elements share a group (nor, with :class:`NoiseIndex`, their rounding)."""
    units = shard_numel // unit
    k = max(1, min(int(chunks), units))
    edges = [unit * (y * units // k) for y in range(k + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _row_slice(q: QuantizedTensor, rows: int, a: int, b: int) -> QuantizedTensor:
    """Elements ``[a, b)`` of each of ``rows`` equal rows of ``q`` (a contiguous copy, or ``q``
    itself for whole rows); ``a`` and ``b`` are multiples of ``q.group_size``."""
    row = q.numel // rows
    if a == 0 and b == row:
        return q
    codes = q.codes.view(rows, -1)[:, a * q.bits // 8:b * q.bits // 8].contiguous().view(-1)
    scales = q.scales.view(rows, -1)[:, a // q.group_size:b // q.group_size].contiguous().view(-1)
    return QuantizedTensor(codes, scales, q.bits, q.group_size, rows * (b - a))


# ------------------------------------------------------------------------------------------------
# gradient reduce-scatter
# ------------------------------------------------------------------------------------------------

def two_level_reduce_scatter(input: torch.Tensor, output: torch.Tensor, groups: TwoLevelGroups, *,  # noqa: A002
                             bits_intra: int, group_size_intra: int, bits_inter: int,
                             group_size_inter: int, hadamard: bool = False, hadamard_block: int = 32,
                             generator: Optional[torch.Generator] = None, stochastic: bool = True,
                             accounting: Optional[CommAccounting] = None, error_feedback=None,
                             async_op: bool = False, check_finite: bool = True,
                             nonfinite_flag: Optional[torch.Tensor] = None, pipeline: int = 1,
                             streams: Optional[CommStreams] = None,
                             name: str = GRAD_COLLECTIVE,
                             label: Optional[str] = None) -> Optional[PendingCollective]:
    """Quantized reduce-scatter: ``output`` (N/P elements) = sum over DP ranks of ``input``'s
    shard ``dp_rank`` — the layout of ``dist.reduce_scatter_tensor(output, input, dp_group)``.

    Paths: D>1, M>1 two hops (intra bits, then inter bits); D>1, M==1 one intra hop with intra
    bits; D==1, M>1 one inter hop with inter bits; P==1 copy. ``error_feedback`` is a
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

    ``async_op`` runs the steps on ``streams`` (:mod:`.streams`: worker threads on CPU, CUDA
    streams on GPU; a process-wide set if None) and returns a :class:`PendingCollective`; else
    they run inline and None is returned. Same steps, same order: the result does not depend on it.

    ``generator`` lives on the host or on ``input``'s device (the stochastic rounding draws from
    it: ``torch.rand`` in the torch reference, one seed per kernel call in the C++ / Triton
    kernels; the trainer's are host generators, so a draw never syncs the device).
    ``check_finite`` costs a one-element all-reduce over the DP group (and a host sync) per call;
    it is what lets every rank raise :class:`NonFiniteError` together instead of deadlocking.
    ``nonfinite_flag`` replaces it with the deferred contract (module docstring): no check here,
    the flag records this rank's verdict for the caller's once-per-step agreement.
    ``label`` (default ``name``) says which buffer this is in the error every rank sees when a
    job of the call fails (:mod:`.failures`; the hop and pipeline chunk are added to it).
    """
    if not input.is_contiguous():
        raise ValueError("input must be a contiguous buffer (a flat gradient bucket)")
    x = input.reshape(-1)
    n = x.numel()
    p, d, m = groups.dp_size, groups.intra_size, groups.inter_size
    if output.numel() * p != n:
        raise ValueError(f"output has {output.numel()} elements; expected N/P = {n}/{p}")
    if hadamard:
        for flag, gs in (("group_size_intra", group_size_intra), ("group_size_inter", group_size_inter)):
            if gs % hadamard_block:
                raise ValueError(f"with Hadamard, {flag} ({gs}) must be a multiple of the Hadamard "
                                 f"block ({hadamard_block}) so blocks never straddle groups")
    mult = required_padding_multiple(p, d, group_size_intra, group_size_inter)
    if n % mult:
        raise ValueError(
            f"bucket of {n} elements is not divisible by {mult} (P={p} x group sizes "
            f"{group_size_intra}/{group_size_inter} for D={d}, M={m}); pad the bucket with "
            f"required_padding_multiple()")
    if int(pipeline) < 1:
        raise ValueError(f"pipeline must be >= 1, got {pipeline}")

    if p == 1:
        output.copy_(x.view(output.shape))
        return None

    if nonfinite_flag is None and check_finite:
        _agree_finite(x, groups.dp_group, "two_level_reduce_scatter")

    two_level = d > 1 and m > 1
    if d > 1:  # two-level or intra-only: the first (or only) hop is inside the node
        bits1, gs1, group1, size1 = bits_intra, group_size_intra, groups.intra_group, d
    else:
        bits1, gs1, group1, size1 = bits_inter, group_size_inter, groups.inter_group, m
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
        accounting.record_baseline(name, kind="grad", numel=n, elem_size=x.element_size(), dp_size=p,
                                   peers_intra=d - 1, peers_inter=p - d)
        accounting.record_all_to_all(name, kind="grad",
                                     total_bytes=QuantizedTensor.wire_bytes(n, bits1, gs1),
                                     total_elements=n, group_size=size1,
                                     peers_intra=size1 - 1 if d > 1 else 0,
                                     peers_inter=0 if d > 1 else size1 - 1)
        if two_level:
            accounting.record_all_to_all(
                name, kind="grad",
                total_bytes=QuantizedTensor.wire_bytes(n // d, bits_inter, group_size_inter),
                total_elements=n // d, group_size=m, peers_intra=0, peers_inter=m - 1)

    state: dict = {}

    def quantize_first() -> None:
        """[E1] -> [Hadamard] -> quantize into destination-major slots (whole bucket).

        With LoCo at most two bucket-sized fp32 buffers are alive at once: ``h`` and the
        dequantized codes (in the input layout, written slot by slot: no permuted copy), which
        become the residual ``h - sent`` in place; ``h`` is dropped before the stored error is
        read back for the update."""
        h = x if ef is None else ef.compensate("e1", x, group_size=gs1)
        q1 = quantize_partitions(h, p, order, bits1, gs1, stochastic=stochastic, generator=gen,
                                 hadamard=hadamard, hadamard_block=hadamard_block,
                                 check_finite=False, nonfinite_counter=nonfinite_flag)
        if ef is not None:
            residual = _dequantize_in_input_order(q1, order if two_level else None, hadamard,
                                                  hadamard_block)
            residual = torch.sub(h, residual, out=residual)
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
                recv1, d, bits_inter, group_size_out=group_size_inter, stochastic=stochastic,
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
        q2 = quantize(h2, bits_inter, group_size_inter, stochastic=stochastic, generator=gen,
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


# ------------------------------------------------------------------------------------------------
# weight all-gather (qWD / qW)
# ------------------------------------------------------------------------------------------------

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
                         output: torch.Tensor, group, *, mode: str = "diff", bits: int,
                         group_size: int, generator: Optional[torch.Generator] = None,
                         stochastic: bool = True, accounting: Optional[CommAccounting] = None,
                         link_of_peer: Optional[Callable[[int], str]] = None,
                         hop_links: Optional[Sequence[str]] = None,
                         check_finite: bool = True, nonfinite_flag: Optional[torch.Tensor] = None,
                         async_op: bool = False, streams: Optional[CommStreams] = None,
                         name: str = WEIGHT_COLLECTIVE, label: Optional[str] = None):
    """Quantized all-gather of parameter shards into ``output`` (P * shard elements).

    Non-finite shards: ``check_finite`` / ``nonfinite_flag`` as in :func:`two_level_reduce_scatter`.

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
    ``hop_links`` gives each hop's link ('intra' / 'inter') for the accounting; for one group,
    ``link_of_peer(group_rank) -> 'intra' | 'inter'`` classifies peers instead (e.g.
    ``TwoLevelGroups.link_of_peer`` when ``group`` is the DP group); without either every peer is
    counted as inter-node (conservative).

    Returns ``output``; with ``async_op`` a :class:`PendingCollective` instead: quantize,
    all-gather and dequantize[-add] run on the ``weights`` stage of ``streams`` while the caller
    computes (``--overlap-param-gather``), and ``shard``, ``full_reference`` and ``output`` must
    stay untouched until ``wait()``. ``label``: as in :func:`two_level_reduce_scatter`.
    """
    if mode not in ("diff", "direct"):
        raise ValueError(f"mode must be 'diff' or 'direct', got {mode!r}")
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
        else:
            n_intra = math.prod(k for k, link in zip(sizes, links) if link == "intra") - 1
        n_inter = world - 1 - n_intra
        accounting.record_baseline(name, kind="weight", numel=s * world, elem_size=output.element_size(),
                                   dp_size=world, peers_intra=n_intra, peers_inter=n_inter)
        if per_peer:
            accounting.record_all_gather(name, kind="weight",
                                         shard_bytes=QuantizedTensor.wire_bytes(s, bits, group_size),
                                         shard_elements=s, peers_intra=n_intra, peers_inter=n_inter)
        else:
            held = s
            for k, link in zip(sizes, links):  # hop h forwards what the earlier hops gathered
                accounting.record_all_gather(
                    name, kind="weight", shard_bytes=QuantizedTensor.wire_bytes(held, bits, group_size),
                    shard_elements=held, peers_intra=(k - 1) * (link == "intra"),
                    peers_inter=(k - 1) * (link != "intra"))
                held *= k

    def _gather_one_message(q: QuantizedTensor) -> QuantizedTensor:
        """Codes and scales forwarded hop by hop as one packed message (:func:`_exchange`)."""
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
