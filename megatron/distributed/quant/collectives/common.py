"""What the gradient and the weight paths of the quantized collectives share.

Why a module of its own: both paths pad buckets to one multiple, pack codes and scales into the
same wire messages, agree on non-finite inputs the same way, and hand back the same
:class:`PendingCollective`, whose jobs run on one process-wide set of stages per device;
torch's flat collectives under their current names are here too (the PaRO engine sends through
them).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..kernels.dispatch import NonFiniteError, QuantizedTensor, all_finite
from ..streams import INLINE, CommStreams, CommTiming, Job

__all__ = [
    "required_padding_multiple", "required_padding_multiple_from_config", "all_gather_flat",
    "reduce_scatter_flat", "PendingCollective", "NonFiniteError",
]


# ------------------------------------------------------------------------------------------------
# bucket padding
# ------------------------------------------------------------------------------------------------

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
# torch's flat collectives, the NaN/Inf agreement, the wire format
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


def _as_bytes(scales: torch.Tensor) -> torch.Tensor:
    """The scales as the bytes they are on the wire. A group holding NaN/Inf has a NaN scale by
    design (kernels/reference.py: the step is then skipped), and ``TORCH_NCCL_NAN_CHECK=1``
    traps any NaN in a floating-point collective's input: sent as fp32 the scales stopped the
    job where it should skip one step. Bytes are what the packed messages send anyway."""
    return scales.view(torch.uint8)


def _one_message(link: str) -> bool:
    """Whether a hop over ``link`` ('intra' / 'inter') sends codes and scales as one message
    (:func:`.gradients._exchange`, :func:`.weights.quantized_all_gather`): across nodes, where
    a message's latency costs more than copying the compressed bytes; not inside a node."""
    return link != "intra"


# ------------------------------------------------------------------------------------------------
# pending collectives and where their jobs run
# ------------------------------------------------------------------------------------------------

class PendingCollective:
    """Handle of asynchronous quantized collectives: :meth:`wait` returns once the outputs hold
    the results, re-raising a failure of any of their jobs; idempotent once it succeeded.

    One class for every pending quantized collective: one call's jobs (``async_op=True``), or
    several calls' (:meth:`combine`, a bucket group's buckets) with the time waited counted as
    exposed ``kind`` time by a :class:`~..streams.CommTiming` and an optional ``finish`` step run
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

