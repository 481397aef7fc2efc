"""Collectives between the PaRO partition levels of one engine's flat buffers.

:class:`LevelCollectives` is an object the engine owns and hands to what communicates
(:mod:`.gather`, :mod:`.grad_reduce`): exact all-gather / reduce-scatter / all-reduce at the
'intra' or 'inter' scope, counted in the cost model's convention (:class:`~.comm.CommCounter`),
the PaRO-CC global ones built from them (spec §4), the level transitions of a whole shard-space
tensor bucket by bucket, and -- with ``--quantized-gradients`` -- the model's
:class:`~..runtime.QuantizationRuntime` in place of the exact reduce-scatter (its bytes, as its
accounting measured them, added to the same counter). It holds only what it communicates with:
the groups, the shard geometry, the buckets, the counter and the runtime.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..runtime import QuantizationRuntime
from .comm import CommCounter, _all_gather, _count, _reduce_scatter, hierarchical_all_reduce
from .layout import Bucket, ShardGeometry
from .strategy import Level

__all__ = ["LevelCollectives", "bucket_key"]


def bucket_key(b: Bucket) -> str:
    """The quantization runtime's key of bucket ``b`` (its LoCo state, generators, accounting)."""
    return f"paro/bucket{b.index}"


class LevelCollectives:
    """Level-transition collectives of one engine (see the module docstring).

    ``groups``: the engine's :class:`~..topology.TwoLevelGroups` (``intra_group`` /
    ``inter_group``), what the calls run on unless given another set of the same layout;
    ``geometry``: its shard geometry; ``buckets``: its buckets, in flat order; ``counter``: where
    every call is counted; ``quant_runtime``: the model's quantized communication, or None.
    """

    def __init__(self, groups: Any, geometry: ShardGeometry, buckets: Sequence[Bucket],
                 counter: CommCounter, quant_runtime: Optional[QuantizationRuntime]) -> None:
        self.groups = groups
        self.geometry = geometry
        self.buckets = buckets
        self.counter = counter
        self.quant_runtime = quant_runtime

    def _scope(self, scope: str, groups: Any = None) -> Tuple[Any, int]:
        """(process group, its size) of the 'intra' or 'inter' scope; of ``groups`` (a set of the
        same layout, e.g. the engine's ``grad_groups``) instead of the engine's own if given."""
        owner = self.groups if groups is None else groups
        if scope == "intra":
            return owner.intra_group, self.geometry.intra_size
        return owner.inter_group, self.geometry.inter_size

    def _gather_hop(self, out: torch.Tensor, inp: torch.Tensor, scope: str,
                    groups: Any = None) -> None:
        """One all-gather at 'intra' / 'inter' scope on ``groups`` (see :meth:`_scope`; a copy
        when the scope has one rank), not counted: :meth:`all_gather` and :meth:`exact_gather`."""
        group, k = self._scope(scope, groups)
        if k == 1:
            out.copy_(inp)
        else:
            _all_gather(out, inp.contiguous(), group)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, scope: str) -> None:
        """All-gather at 'intra' / 'inter' scope ('inter' works on the 1/m slice), counted."""
        self._gather_hop(out, inp, scope)
        _count(self.counter, scope, "all_gather", out.numel(), out, self._scope(scope)[1])

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, scope: str, b: Bucket) -> None:
        """Reduce-scatter of bucket ``b``'s gradients at 'intra' / 'inter' scope (SUM), counted;
        the runtime's one-hop quantized path with --quantized-gradients (from its start
        iteration on)."""
        k = self._scope(scope)[1]
        if k > 1 and self.quantize_gradients_now():
            self.quantized_reduce_scatter(out, inp, scope, b)
            return
        self._reduce_hop(out, inp, scope)
        _count(self.counter, scope, "reduce_scatter", inp.numel(), inp, k)

    def _reduce_hop(self, out: torch.Tensor, inp: torch.Tensor, scope: str,
                    groups: Any = None) -> None:
        """One exact SUM reduce-scatter at 'intra' / 'inter' scope on ``groups`` (see
        :meth:`_scope`; a copy when the scope has one rank), not counted: :meth:`reduce_scatter`
        and :meth:`exact_reduce`."""
        group, k = self._scope(scope, groups)
        if k == 1:
            out.copy_(inp)
        else:
            _reduce_scatter(out, inp.contiguous(), group, dist.ReduceOp.SUM)

    def exact_reduce(self, out: torch.Tensor, full: torch.Tensor, scope: str,
                     groups: Any = None) -> None:
        """Exact SUM reduce-scatter of a full bucket buffer to this rank's shard at 'intra' (intra
        RS) or 'global' (intra RS, then inter RS of the 1/m slice), on ``groups`` (see
        :meth:`_scope`). Not counted (:meth:`count_exact_reduce`): the overlapped engine counts
        in the hook's thread and sends on a communication stage."""
        hops = ("intra",) if scope == "intra" else ("intra", "inter")
        x = full
        for i, hop in enumerate(hops):
            k = self._scope(hop, groups)[1]
            y = out if i == len(hops) - 1 else torch.empty(x.numel() // k, dtype=x.dtype,
                                                           device=x.device)
            self._reduce_hop(y, x, hop, groups)
            x = y

    def count_exact_reduce(self, full: torch.Tensor, scope: str) -> None:
        """What :meth:`reduce_scatter` counts for the hops of :meth:`exact_reduce`."""
        m, g = self.geometry.intra_size, self.geometry.inter_size
        _count(self.counter, "intra", "reduce_scatter", full.numel(), full, m)
        if scope != "intra":
            _count(self.counter, "inter", "reduce_scatter", full.numel() // m, full, g)

    def exact_gather(self, full: torch.Tensor, shard: torch.Tensor, scope: str,
                     groups: Any = None) -> None:
        """Exact all-gather of this rank's shard into a full bucket buffer at 'intra' (intra AG)
        or 'global' (inter AG into the 1/m slice, then intra AG), on
        ``groups`` (see :meth:`_scope`). Not counted (:meth:`count_exact_gather`): the
        overlapped gathers count in the hook's thread and run on a communication stage."""
        src = shard
        m = self.geometry.intra_size
        hops = (("inter", torch.empty(full.numel() // m, dtype=full.dtype,
                                      device=full.device)),) if scope == "global" else ()
        for hop, out in hops + (("intra", full),):
            self._gather_hop(out, src, hop, groups)
            src = out

    def count_exact_gather(self, full: torch.Tensor, scope: str) -> None:
        """What :meth:`all_gather` counts for the hops of :meth:`exact_gather`."""
        m, g = self.geometry.intra_size, self.geometry.inter_size
        if scope != "intra":
            _count(self.counter, "inter", "all_gather", full.numel() // m, full, g)
        _count(self.counter, "intra", "all_gather", full.numel(), full, m)

    def all_reduce(self, t: torch.Tensor, scope: str) -> None:
        """In-place SUM all-reduce of ``t`` at 'intra' / 'inter' scope, counted (nothing when the
        scope has one rank)."""
        group, k = self._scope(scope)
        if k == 1:
            return
        dist.all_reduce(t, group=group)
        _count(self.counter, scope, "all_reduce", t.numel(), t, k)

    def global_all_reduce(self, t: torch.Tensor) -> None:
        """In-place SUM all-reduce of ``t`` over the whole DP group, hierarchically (intra RS,
        inter AR, intra AG: :func:`.comm.hierarchical_all_reduce`), counted."""
        hierarchical_all_reduce(t, self.groups.intra_group, self.groups.inter_group,
                                counter=self.counter)

    # -- quantized (SDP4Bit) versions: the runtime's collectives, on this engine's buckets
    def quantize_gradients_now(self) -> bool:
        """Whether gradient reduce-scatters go through the quantization runtime now (quantized
        gradients configured and past their start iteration)."""
        return self.quant_runtime is not None and self.quant_runtime.quantize_gradients_now

    def count_quantized(self, kind: str, scope: str, op: str, numel: int, ranks: int,
                        before: Dict[str, int]) -> None:
        """Add what the runtime's accounting measured for one call (its link bytes now minus
        ``before``) to the cost-model counter."""
        after = self.quant_runtime.accounting.link_bytes(kind)
        for link in ("intra", "inter"):
            self.counter.bytes[link] += float(after[link] - before[link])
        self.counter.calls.append((scope, op, numel, ranks))

    def quantized_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, scope: str,
                                 b: Bucket, streams: Any = None) -> Tuple[Any, torch.Tensor]:
        """Quantized SUM reduce-scatter of bucket ``b`` at ``scope`` (TLq / TLq-HS, LoCo; the
        runtime's :meth:`~..runtime.QuantizationRuntime.reduce_scatter`), bytes from its
        accounting.
        Returns (the runtime's handle: None unless ``streams`` overlap it, the input it reads,
        which must stay alive until the handle is waited for).

        For 'global' the local-major buffer is first permuted into DP-rank order (chunk of rank
        k*m + l = our chunk (l, k)): one local copy, the layout the runtime expects.

        NaN / Inf is noted on the device and agreed once per step by
        :meth:`.optimizer.ParoOptimizer.prepare_grads`.
        """
        # See [Note: non-finite contracts] in docs/architecture.md
        rt = self.quant_runtime
        x = inp.reshape(-1)
        if scope == "global":
            m, g = self.geometry.intra_size, self.geometry.inter_size
            x = x.view(m, g, -1).transpose(0, 1).contiguous().view(-1)
        x = x.contiguous()
        before = rt.accounting.link_bytes("grad")
        # Inline (no ``streams``): on the runtime's timed inline stage, waited for here, so its
        # time counts as exposed and an error is raised here, not left in an unwaited handle.
        handle = rt.reduce_scatter(x, out, key=bucket_key(b), index=b.index, scope=scope,
                                   streams=streams if streams is not None else rt.timing.inline)
        self.count_quantized("grad", scope, "quantized_reduce_scatter", x.numel(),
                             rt.scope_groups(scope).dp_size, before)
        if streams is None and handle is not None:
            rt.timing.wait("grad", handle)
            handle = None
        return handle, x

    def global_reduce_scatter(self, full: torch.Tensor, b: Bucket) -> torch.Tensor:
        """PaRO-CC reduce-scatter of bucket ``b``'s full buffer to this rank's G shard (intra RS,
        inter RS; quantized: the runtime's two-level TLq in one call)."""
        n = self.geometry.dp_size
        if self.quantize_gradients_now():
            g_shard = torch.empty(full.numel() // n, dtype=full.dtype, device=full.device)
            self.quantized_reduce_scatter(g_shard, full, "global", b)
            return g_shard
        g_shard = torch.empty(full.numel() // n, dtype=full.dtype, device=full.device)
        self.exact_reduce(g_shard, full, "global")
        self.count_exact_reduce(full, "global")
        return g_shard

    def global_all_gather(self, full: torch.Tensor, g_shard: torch.Tensor) -> None:
        """PaRO-CC all-gather of G shards into the full buffer (inter AG, intra AG), counted."""
        self.exact_gather(full, g_shard, "global")
        self.count_exact_gather(full, "global")

    # ------------------------------------------------------------------ level transitions
    def reduce_to(self, src: torch.Tensor, frm: Level, to: Level) -> torch.Tensor:
        """Reduce-scatter a shard-space tensor at level ``frm`` to level ``to``, bucket by bucket
        (N -> I: intra RS; I -> G: inter RS; N -> G: PaRO-CC global RS)."""
        kf, kt = self.geometry.level_ranks(frm), self.geometry.level_ranks(to)
        out = torch.empty(src.numel() * kf // kt, dtype=src.dtype, device=src.device)
        for b in self.buckets:
            x = b.shard(src, kf)
            y = b.shard(out, kt)
            if (frm, to) == (Level.N, Level.G):
                y.copy_(self.global_reduce_scatter(x, b))
            else:
                self.reduce_scatter(y, x, "intra" if frm == Level.N else "inter", b)
        return out

    def gather_to(self, dst: torch.Tensor, src: torch.Tensor, frm: Level, to: Level) -> None:
        """All-gather a shard-space tensor at level ``frm`` into ``dst`` at level ``to``, bucket by
        bucket (G -> I: inter AG; I -> N: intra AG; G -> N: PaRO-CC global AG)."""
        kf, kt = self.geometry.level_ranks(frm), self.geometry.level_ranks(to)
        for b in self.buckets:
            x = b.shard(src, kf)
            y = b.shard(dst, kt)
            if (frm, to) == (Level.G, Level.N):
                self.global_all_gather(y, x)
            else:
                self.all_gather(y, x, "inter" if frm == Level.G else "intra")
