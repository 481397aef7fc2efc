"""Where each gradient goes, from the backward pass to the optimizer-state level.

:class:`GradReduction` decides the engine's gradient path. Per micro-step: level N adds every
parameter's gradient into a resident flat buffer; levels I / G into a temporary full gradient of
its bucket, which is reduce-scattered into the persistent shard accumulator and freed as soon as
the bucket's last gradient arrived -- inline, or (``grad_groups``, ``--overlap-grad-reduce``) on
the communication stages while the backward goes on, at most :data:`GRAD_REDUCES_IN_FLIGHT` at
once so the temporaries stay bounded. At the accumulation boundary
(:meth:`~GradReduction.to_optimizer_level`) the accumulated gradients move from their level to
the optimizer-state level and are averaged over DP (spec §3 phase 3). The collectives themselves
are the engine's level collectives (:class:`~.transitions.LevelCollectives`), counted there.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

from ..runtime import QuantizationRuntime
from ..streams import CommStreams, used_on_this_stage
from .gather import ParamGathers
from .layout import Bucket, ShardGeometry, Slot
from .strategy import Level, PaRoStrategy
from .transitions import LevelCollectives

__all__ = ["GradReduction", "GRAD_REDUCES_IN_FLIGHT"]

GRAD_REDUCES_IN_FLIGHT = 2
"""Overlapped gradient reduce-scatters (``grad_groups``) started and not yet waited for: the hook
that starts another first finishes the oldest, so at most this many temporary full bucket
gradients (g = I / G) are alive beside the one being accumulated."""


class GradReduction:
    """Gradient accumulation and reduction of one engine (see the module docstring).

    ``strategy``: the engine's partition levels; ``geometry``: where this rank's shard of a
    bucket lies; ``collectives``: what reduces and counts; ``grad_buffer``: the resident full
    gradient (g = N, else None); ``grad_shard``: the persistent shard accumulator (g = I / G,
    else None); ``grad_dtype``: the dtype of accumulation and reduction; ``grad_groups``: the
    communicators of the overlapped reduce-scatters (None: inline); ``quant_runtime``: the
    model's quantized communication, or None; ``param_gathers``: releases a bucket's parameters
    once its backward is over; ``note_allocation``: called after every allocation of a
    temporary gradient, so the engine can track its peak.
    """

    def __init__(self, strategy: PaRoStrategy, geometry: ShardGeometry,
                 collectives: LevelCollectives, grad_buffer: Optional[torch.Tensor],
                 grad_shard: Optional[torch.Tensor], grad_dtype: torch.dtype, grad_groups: Any,
                 quant_runtime: Optional[QuantizationRuntime], param_gathers: ParamGathers,
                 note_allocation: Callable[[], None]) -> None:
        self.strategy = strategy
        self.geometry = geometry
        self.collectives = collectives
        self.grad_buffer = grad_buffer
        self.grad_shard = grad_shard
        self.grad_dtype = grad_dtype
        self.grad_groups = grad_groups
        self.quant_runtime = quant_runtime
        self.param_gathers = param_gathers
        self.note_allocation = note_allocation
        self.stages: Optional[CommStreams] = None
        """The stages of the overlapped reduce-scatters (made at the first one)."""
        self.pending: List[Tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        """(handle, reduced shard, accumulator slice, input kept alive) per reduce in flight."""

    def add(self, slot: Slot, b: Bucket, param: torch.Tensor) -> None:
        """Add ``param.grad`` (the parameter at ``slot`` in bucket ``b``) at the gradient level:
        into the resident buffer (g = N) or this backward's full gradient of the bucket
        (g = I / G)."""
        if self.grad_buffer is not None:
            self.grad_buffer[slot.offset:slot.offset + slot.numel].view(slot.shape).add_(
                param.grad)
        else:
            if b.tmp_grad is None:  # g = I / G: this bucket's full gradient, this backward
                b.tmp_grad = torch.zeros(b.size, dtype=self.grad_dtype, device=param.device)
                self.note_allocation()
            o = slot.offset - b.start
            b.tmp_grad[o:o + slot.numel].view(slot.shape).add_(param.grad)

    @torch.no_grad()
    def finish_bucket(self, b: Bucket) -> None:
        """All of ``b``'s gradients of this micro-step are in: reduce-scatter them (g = I / G)
        into the shard accumulator, free the temporary and release the parameters (p = I / G).
        With ``grad_groups`` the reduce-scatter is only started here (:meth:`start`)."""
        if b.reduced:
            return
        b.reduced = True
        if self.grad_shard is not None:
            full = b.tmp_grad
            if full is None:  # no gradient arrived (unused parameters): contribute zeros
                full = torch.zeros(b.size, dtype=self.grad_dtype, device=self.grad_shard.device)
            b.tmp_grad = None
            k = self.geometry.level_ranks(self.strategy.grads)
            acc = b.shard(self.grad_shard, k)
            if self.grad_groups is not None:
                self.start(b, full, acc)
            else:
                if self.strategy.grads == Level.I:
                    shard = torch.empty_like(acc)
                    self.collectives.reduce_scatter(shard, full, "intra", b)
                else:
                    shard = self.collectives.global_reduce_scatter(full, b)
                del full
                acc.add_(shard)
        self.param_gathers.release(b)

    def start(self, b: Bucket, full: torch.Tensor, acc: torch.Tensor) -> None:
        """Start bucket ``b``'s gradient reduce-scatter on the stages (``grad_groups``); the sum
        lands in ``acc`` when :meth:`finish_all` waits for it. Counted here, in the hook's
        thread, as the inline path counts it."""
        rt = self.quant_runtime
        collectives = self.collectives
        if self.stages is None:   # the runtime's, when it has one: its timing sees them
            self.stages = (rt.overlap_streams(full.device) if rt is not None
                           else CommStreams.for_device(full.device))
        shard = torch.empty_like(acc)
        scope = "intra" if self.strategy.grads == Level.I else "global"
        if collectives.quantize_gradients_now():
            handle, keep = collectives.quantized_reduce_scatter(shard, full, scope, b,
                                                                streams=self.stages)
        else:
            # counted here, in the hook's thread, as reduce_scatter counts
            collectives.count_exact_reduce(full, scope)
            grad_groups = self.grad_groups

            def reduce() -> None:
                used_on_this_stage(full)
                collectives.exact_reduce(shard, full, scope, grad_groups)
            handle = self.stages.submit("intra", reduce)
            keep = full
        self.pending.append((handle, shard, acc, keep))
        self.note_allocation()   # the reduced shard and the kept input count while in flight
        while len(self.pending) > GRAD_REDUCES_IN_FLIGHT:
            self.finish_oldest()

    def finish_oldest(self) -> None:
        """Wait for the oldest reduce-scatter in flight and add it to its accumulator."""
        handle, shard, acc, _ = self.pending.pop(0)
        if handle is not None:
            if self.quant_runtime is not None:   # the wait is the runtime's exposed time
                self.quant_runtime.timing.wait("grad", handle)
            else:
                handle.wait()
        acc.add_(shard)

    def finish_all(self) -> None:
        """Wait for every gradient reduce-scatter in flight and add it to its accumulator."""
        while self.pending:
            self.finish_oldest()

    @torch.no_grad()
    def to_optimizer_level(self) -> torch.Tensor:
        """Gradient sync at the accumulation boundary, g level -> os level (spec §3 phase 3),
        then the DP average (sum / n, as megatron-core's DDP with per-sample losses): the fp32
        gradient the optimizer reads (the engine's ``main_grad``)."""
        collectives = self.collectives
        g, o = self.strategy.grads, self.strategy.optim
        src = self.grad_buffer if self.grad_buffer is not None else self.grad_shard
        if (g, o) == (Level.N, Level.N):
            out = src.clone()
            collectives.global_all_reduce(out)
        elif (g, o) == (Level.N, Level.I):
            out = collectives.reduce_to(src, Level.N, Level.I)
            collectives.all_reduce(out, "inter")
        elif (g, o) == (Level.N, Level.G):
            out = collectives.reduce_to(src, Level.N, Level.G)
        elif (g, o) == (Level.I, Level.I):
            out = src.clone()
            collectives.all_reduce(out, "inter")
        elif (g, o) == (Level.I, Level.G):
            out = collectives.reduce_to(src, Level.I, Level.G)
        else:  # G -> G: already reduced every micro-step
            out = src.clone()
        out = out.float()
        out.mul_(1.0 / self.geometry.dp_size)
        return out
