"""PaRO training engine: every partition strategy that megatron-core's DDP cannot express.

Spec: ../shared/research/paro.md; cost model and PaRO-CC collectives: :mod:`.paro`. NNG (ZeRO-1)
and NNN (DDP) keep running on megatron-core's ``DistributedDataParallel`` (+
``DistributedOptimizer``); this module trains the other twelve strategies -- and, for testing,
all fourteen -- with our own small data-parallel engine:

* :class:`ParoDataParallel` wraps one model chunk. It flattens the parameters into one buffer and
  keeps parameters, gradients and the optimizer's gradient input at the strategy's partition
  levels, issuing exactly the collectives of :func:`.paro.strategy_collectives`, and counts their
  bytes in a :class:`.paro.CommCounter` (so a step can be compared with
  :func:`.paro.communication_volume`).
* :class:`ParoOptimizer` is a flat fp32 AdamW / SGD over this rank's optimizer-state shard, with
  the interface the trainer's ``optimizer_step`` / ``train_step`` and megatron-core's
  ``OptimizerParamScheduler`` use.

Flat layout (why it looks like this). The parameters are grouped into *buckets*, the unit of
gather / release and of the per-micro-step gradient reduce-scatter (as FSDP / ZeRO-3): contiguous
runs of parameters in module order, one per unit module (:func:`_units`: the embedding, every
transformer layer, the final norm, the output layer; a unit above ``bucket_numel`` elements is
split into its children), and a bucket of its own for a parameter several modules use (the tied
word-embedding / output weight). The flat buffer is the concatenation of the buckets, each padded
to a multiple of the DP size ``n`` (and of the quantization unit when quantized);
``padded_numel`` = S is the sum. Inside a bucket of ``s`` elements the layout is local-major: the
I-shard of local index ``l`` is ``[l*s/m, (l+1)*s/m)`` and the G-shard of the rank in group ``k``
with local index ``l`` is sub-chunk ``k`` of it, ``[l*s/m + k*s/n, l*s/m + (k+1)*s/n)``. A rank's
shard at a level (what it keeps for p / g / os at I or G) is the concatenation of its shards of
the buckets, S/m or S/n elements. With this order every PaRO transition of a bucket is one plain
collective on a contiguous slice and nothing is reordered:

* full -> I: intra reduce-scatter; I -> G: inter reduce-scatter of the I slice;
* global reduce-scatter (full -> G) = intra RS + inter RS (PaRO-CC, spec §4);
* G -> I: inter all-gather; I -> full: intra all-gather; global all-gather = inter AG + intra AG;
* global all-reduce (NNN) = :func:`.paro.hierarchical_all_reduce` (whole buffer).

Byte totals do not depend on the bucketing (ring bytes are linear in the element count).

Parameters at level I / G live persistently only as their shard; each bucket has its own full
buffer whose storage exists only while the bucket is gathered (``untyped_storage().resize_(0)``
otherwise, as FSDP does; the parameters are views into it). A forward pre-hook on the bucket's
owner module gathers it, a forward hook releases it after the (last) owner's forward -- or at the
next owner's forward when the module returns the parameter to its caller (megatron's
``skip_bias_add`` bias) -- and a hook on the owner's output gradient gathers it again right before
its backward; it is released when all its parameters got their gradient. A bucket with several
owners (tied embeddings) therefore stays gathered from the embedding to the output layer in the
forward pass and from the output layer to the embedding in the backward pass (still one forward
and one backward gather per micro-step, as the cost model counts). Gradients arrive through
per-parameter post-accumulate-grad hooks: level N adds them into a resident flat buffer; levels I /
G into a temporary full gradient of the bucket, which is reduce-scattered into the persistent shard
accumulator and freed as soon as the bucket's last gradient arrived; a callback at the end of every
micro-step's backward finishes any bucket left (same order on every rank). So the *peak* is the
persistent figure plus about one bucket's full parameters and gradients (``peak_bytes``), and the
*persistent* memory follows the PaRO formula. ``finalize_model_grads`` (called by megatron-core's
schedule after the last micro-batch) moves the gradients from their level to the optimizer-state
level and averages them over DP, like megatron-core's DDP.

With a QuantizationConfig, SDP4Bit's collectives run inside the PaRO groups: gradient
reduce-scatters through ``collectives.two_level_reduce_scatter`` (one-hop paths for intra / inter,
TLq for global) and the post-step parameter sync as qWD with the codes forwarded hop by hop
(:func:`quantization_support_error` lists what is supported).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .paro import (CommCounter, Level, PaRoStrategy, _all_gather, _count, _reduce_scatter,
                   _size, hierarchical_all_reduce)
from .topology import TwoLevelGroups

__all__ = ["ParoDataParallel", "ParoOptimizer", "uses_paro_engine", "model_state_bytes",
           "quantization_support_error"]

logger = logging.getLogger(__name__)

ENGINE_UNNEEDED = ("NNN", "NNG")
"""Strategies the trainer runs on megatron-core's DDP / DistributedOptimizer instead."""


def uses_paro_engine(strategy: Optional[str]) -> bool:
    """True when the trainer must build this strategy with :class:`ParoDataParallel`."""
    return strategy is not None and strategy not in ENGINE_UNNEEDED


def quantization_support_error(strategy: str, quant_config: Any) -> Optional[str]:
    """Why the engine cannot run ``strategy`` with these quantization flags, or None.

    Supported (SDP4Bit's collectives inside the PaRO groups):

    * ``--quantized-gradients``: every gradient reduce-scatter -- intra (8-bit), inter (4-bit) and
      global (two-level TLq, ``collectives.two_level_reduce_scatter``) -- so strategies whose
      optimizer states are partitioned globally (os = G). Gradient all-reduces (os = N / I) have
      no quantized collective.
    * ``--quantized-weights``: the post-step parameter sync (qWD: difference to the last synced
      weights; or 'direct'), on whatever hops it has (intra, inter or both). 'direct' mode also
      quantizes the per-micro-step gathers in the cost model, which the engine does not do, so it
      is refused when parameters are partitioned.
    """
    q = quant_config
    if q is None or not q.enabled:
        return None
    s = PaRoStrategy.from_string(strategy)
    what = f"--paro-strategy {s.name} (PaRO engine)"
    if q.quantized_gradients and s.optim != Level.G:
        return (f"{what} with --quantized-gradients: the gradient sync of a strategy with "
                f"optimizer states at level {s.optim.name} is an all-reduce, which has no quantized "
                f"collective; quantized gradients work with os = G (NIG, NGG, ING, IIG, IGG, GNG, "
                f"GIG, GGG)")
    if q.quantized_gradients and q.loco:
        return f"{what} does not support --loco (error feedback) yet"
    if q.quantized_gradients and q.gradients_quantization_start_iteration:
        return f"{what} does not support --gradients-quantization-start-iteration yet"
    if q.quantized_weights and q.weight_quantization_mode == "direct" and s.params != Level.N:
        return (f"{what} with --weight-quantization-mode direct: the per-micro-step parameter "
                f"gathers are not quantized by the engine; use diff (qWD)")
    return None


@dataclass(frozen=True)
class _Slot:
    """Where one parameter lives in the flat buffer."""

    name: str
    offset: int
    numel: int
    shape: torch.Size


@dataclass
class _Bucket:
    """A contiguous, separately padded piece of the flat buffer: the unit of gather / release and
    of the per-micro-step gradient reduce-scatter.

    ``start`` / ``size``: its range in the flat (level-N) buffer; ``size`` is a multiple of the
    padding unit (n, or the quantization unit), so each of its I / G shards is whole.
    ``params``: indices into ``ParoDataParallel.params``. ``owners``: the modules that use its
    parameters, in forward order (gathered before the first one's forward, released after the last
    one's; several owners for tied / shared weights).
    """

    index: int
    start: int
    size: int
    params: List[int]
    owners: List[torch.nn.Module]
    numel: int = 0
    full: Optional[torch.Tensor] = None  # full parameters of this bucket (own storage for p = I / G)
    gathered: bool = True
    tmp_grad: Optional[torch.Tensor] = None  # g = I / G: this micro-step's full gradient
    pending: int = 0  # parameters whose gradient has not arrived yet in this backward
    reduced: bool = False  # gradients of this micro-step already reduce-scattered

    def shard_offset(self, k: int) -> int:
        """Offset of this bucket's piece in a shard-space tensor with k ranks per element."""
        return self.start // k

    def shard(self, t: torch.Tensor, k: int) -> torch.Tensor:
        """This bucket's piece (a view) of ``t``, a shard-space tensor with k ranks per element."""
        return t[self.start // k:(self.start + self.size) // k]


def _has_module_list(mod: torch.nn.Module) -> bool:
    return any(isinstance(x, torch.nn.ModuleList) for x in mod.modules())


def _units(mod: torch.nn.Module, cap: Optional[int], child_of_list: bool = False
           ) -> List[Tuple[torch.nn.Module, List[torch.nn.Parameter]]]:
    """Owner modules and the parameters of each, in module order (FSDP-style wrap policy).

    A module is one unit unless it contains a ``ModuleList`` (then its children -- e.g. the
    embedding, every transformer layer, the final norm, the output layer -- are considered in
    turn, and the children of the ModuleList are units) or it holds more than ``cap`` elements and
    has children to split into. Parameters held directly by a split module form their own unit.
    """
    params = list(mod.parameters())
    if not params:
        return []
    total = sum(p.numel() for p in params)
    has_children = any(True for c in mod.children() if any(True for _ in c.parameters()))
    split = has_children and ((not child_of_list and _has_module_list(mod))
                              or (cap is not None and total > cap))
    if not split:
        return [(mod, params)]
    out = []
    direct = list(mod.parameters(recurse=False))
    if direct:
        out.append((mod, direct))
    is_list = isinstance(mod, torch.nn.ModuleList)
    for child in mod.children():
        out += _units(child, cap, child_of_list=is_list)
    return out


def _tied_output_users(module: torch.nn.Module) -> Dict[int, List[torch.nn.Module]]:
    """id(weight) -> modules that use it without registering it: megatron-core's GPT with tied
    embeddings passes the word-embedding weight to ``output_layer`` at call time."""
    out: Dict[int, List[torch.nn.Module]] = {}
    for mod in module.modules():
        if getattr(mod, "share_embeddings_and_output_weights", False) and \
                getattr(mod, "post_process", True) and hasattr(mod, "output_layer") and \
                hasattr(mod, "shared_embedding_or_output_weight"):
            w = mod.shared_embedding_or_output_weight()
            if w is not None:
                out.setdefault(id(w), []).append(mod.output_layer)
    return out


class ParoDataParallel(torch.nn.Module):
    """Data parallelism with PaRO partition levels for parameters, gradients and optimizer input.

    ``module`` is one model chunk (GPTModel or its Float16Module); ``groups`` a
    :class:`~megatron.distributed.quant.topology.TwoLevelGroups` from
    :func:`.paro.build_paro_groups` (DP rank r = group * m + local). ``grad_dtype`` is the dtype of
    gradient accumulation and reduction (fp32 for bf16 training, like megatron-core's
    ``grad_reduce_in_fp32``). ``bucket_numel`` caps a bucket: a unit module larger than that is
    split into its children (default: one bucket per unit module, see :func:`_units`). The object
    mimics what megatron-core's schedule and our trainer read from a DDP chunk: ``module``,
    ``config``, ``no_sync``, ``zero_grad_buffer`` and ``finalize_model_grads`` (to be set as
    ``config.finalize_model_grads_func``).
    """

    def __init__(self, config: Any, module: torch.nn.Module, strategy: PaRoStrategy, groups: Any,
                 grad_dtype: Optional[torch.dtype] = None, quant_config: Any = None,
                 seed: int = 1234, bucket_numel: Optional[int] = None) -> None:
        super().__init__()
        self.config = config
        self.module = module
        self.strategy = strategy
        self.groups = groups
        self.intra_group = groups.intra_group
        self.inter_group = groups.inter_group
        self.m = _size(self.intra_group)
        self.g = _size(self.inter_group)
        self.n = self.m * self.g
        if self.n != groups.dp_size:
            raise ValueError(f"groups cover {self.n} ranks but the DP group has {groups.dp_size}")
        self.local, self.group_index = groups.local, groups.node
        self.counter = CommCounter()
        self.nonfinite_events = 0
        """Quantized gradient reduce-scatters of this rank that met NaN/Inf (and wrote NaN)."""

        named = [(name, p) for name, p in module.named_parameters()]
        frozen = [name for name, p in named if not p.requires_grad]
        if frozen:
            raise NotImplementedError(
                f"the PaRO engine trains every parameter; frozen parameters are not supported yet "
                f"({frozen[:3]}...)")
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise NotImplementedError(f"the PaRO engine needs one parameter dtype, got {dtypes}")
        self.param_dtype = dtypes.pop()
        self.grad_dtype = grad_dtype or self.param_dtype
        device = named[0][1].device
        self.quant = quant_config if (quant_config is not None and quant_config.enabled) else None
        unit = self.n
        if self.quant is not None:
            err = quantization_support_error(strategy.name, self.quant)
            if err:
                raise NotImplementedError(err)
            from .collectives import required_padding_multiple_from_config

            unit = math.lcm(unit, required_padding_multiple_from_config(self.quant, self.n, self.m))
            self._tl_groups = self._single_level_groups()
            self.quant_generator = torch.Generator(device=device).manual_seed(
                seed * 1009 + groups.dp_rank)  # own stream per rank: rounding errors decorrelate
        self.padding_unit = unit

        # Buckets: unit modules in module order; a parameter used by several units (or passed to
        # a module at call time, tied embeddings) gets a bucket of its own owned by all of them.
        names = {id(p): name for name, p in named}
        units = _units(module, bucket_numel)
        extra_users = _tied_output_users(module)
        users: Dict[int, List[torch.nn.Module]] = {}
        for mod, ps in units:
            for p in ps:
                users.setdefault(id(p), []).append(mod)
        for pid, mods in extra_users.items():
            users.setdefault(pid, []).extend(mods)
        groups_of_params: List[Tuple[List[torch.nn.Module], List[torch.nn.Parameter]]] = []
        placed = set()
        for mod, ps in units:
            own = []
            for p in ps:
                if id(p) in placed:
                    continue
                placed.add(id(p))
                if len(users[id(p)]) > 1:
                    groups_of_params.append((list(users[id(p)]), [p]))
                else:
                    own.append(p)
            if own:
                groups_of_params.append(([mod], own))
        assert len(placed) == len(named), "every parameter belongs to one bucket"
        self.params: List[torch.nn.Parameter] = []
        self.slots: List[_Slot] = []
        self.buckets: List[_Bucket] = []
        start = 0
        for owners, ps in groups_of_params:
            idx, offset = [], start
            for p in ps:
                idx.append(len(self.params))
                self.params.append(p)
                self.slots.append(_Slot(names[id(p)], offset, p.numel(), p.shape))
                offset += p.numel()
            numel = offset - start
            size = -(-numel // unit) * unit
            self.buckets.append(_Bucket(len(self.buckets), start, size, idx, owners, numel=numel))
            start += size
        self.num_params = sum(s.numel for s in self.slots)
        self.padded_numel = start
        """Sum of the padded bucket sizes: what the engine allocates and sends."""
        S = self.padded_numel
        self._bucket_of = [0] * len(self.params)
        for b in self.buckets:
            for i in b.params:
                self._bucket_of[i] = b.index

        # Parameters: p = N: one persistent flat buffer, the buckets are views of it;
        # p = I / G: the persistent shard (concatenation of the buckets' shards) plus, per bucket,
        # a full buffer with its own storage that exists only while the bucket is gathered.
        p_level = strategy.params
        self.param_buffer: Optional[torch.Tensor] = None
        if p_level == Level.N:
            self.param_buffer = torch.zeros(S, dtype=self.param_dtype, device=device)
        self.param_shard: Optional[torch.Tensor] = None
        if p_level != Level.N:
            self.param_shard = torch.zeros(S // self.level_ranks(p_level), dtype=self.param_dtype,
                                           device=device)
        with torch.no_grad():
            for b in self.buckets:
                if self.param_buffer is not None:
                    b.full = self.param_buffer[b.start:b.start + b.size]
                else:
                    b.full = torch.zeros(b.size, dtype=self.param_dtype, device=device)
                for i in b.params:
                    slot, p = self.slots[i], self.params[i]
                    view = b.full[slot.offset - b.start:slot.offset - b.start + slot.numel]
                    view = view.view(slot.shape)
                    view.copy_(p.data)
                    p.data = view
                if self.param_shard is not None:
                    a, e = self._local_range(b, p_level)
                    k = self.level_ranks(p_level)
                    b.shard(self.param_shard, k).copy_(b.full[a:e])
        self.release_params()

        # Gradients: persistent full buffer (g = N) or persistent shard accumulator (g = I / G).
        self.grad_buffer: Optional[torch.Tensor] = None
        self.grad_shard: Optional[torch.Tensor] = None
        if strategy.grads == Level.N:
            self.grad_buffer = torch.zeros(S, dtype=self.grad_dtype, device=device)
        else:
            self.grad_shard = torch.zeros(S // self.level_ranks(strategy.grads),
                                          dtype=self.grad_dtype, device=device)
        self.peak_bytes = 0
        """Largest parameter + gradient bytes resident at once (gathered buckets and the temporary
        full gradients of g = I / G raise it above the persistent figure)."""
        self._track_peak()
        self.main_grad: Optional[torch.Tensor] = None
        """fp32 gradient at the optimizer-state level, DP-averaged (set by finalize_model_grads)."""
        self._in_backward = False
        self._pre_backward_done = False
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._make_grad_hook(i))
        self._hook_handles = []
        self._deferred: List[_Bucket] = []
        if p_level != Level.N:
            owned: Dict[int, Tuple[torch.nn.Module, List[_Bucket]]] = {}
            for b in self.buckets:
                for mod in b.owners:
                    owned.setdefault(id(mod), (mod, []))[1].append(b)
            for mod, bs in owned.values():
                self._hook_handles.append(mod.register_forward_pre_hook(self._make_pre_hook(bs)))
                self._hook_handles.append(mod.register_forward_hook(self._make_post_hook(mod, bs)))

    # ------------------------------------------------------------------ layout
    def level_ranks(self, level: Level) -> int:
        """Ranks sharing one element's state at ``level`` (1, m or n)."""
        return {Level.N: 1, Level.I: self.m, Level.G: self.n}[level]

    def _local_range(self, b: _Bucket, level: Level) -> Tuple[int, int]:
        """[start, end) of this rank's shard at ``level`` inside bucket ``b`` (local-major:
        I-shard l, and within it G sub-chunk k)."""
        if level == Level.N:
            return 0, b.size
        i_start = self.local * (b.size // self.m)
        if level == Level.I:
            return i_start, i_start + b.size // self.m
        g_start = i_start + self.group_index * (b.size // self.n)
        return g_start, g_start + b.size // self.n

    def level_indices(self, level: Level) -> torch.Tensor:
        """Flat-buffer indices of this rank's shard at ``level``, in shard order (the buckets'
        shards one after another)."""
        parts = []
        for b in self.buckets:
            a, e = self._local_range(b, level)
            parts.append(torch.arange(b.start + a, b.start + e))
        return torch.cat(parts)

    def _pieces(self, coarse: Level, fine: Level) -> Iterator[Tuple[int, int, int]]:
        """Per bucket: (offset in the coarse-level shard, offset in the fine-level shard, length)
        of the fine shard, fine at least as partitioned as coarse."""
        kc, kf = self.level_ranks(coarse), self.level_ranks(fine)
        for b in self.buckets:
            ca, _ = self._local_range(b, coarse)
            fa, fe = self._local_range(b, fine)
            yield b.shard_offset(kc) + fa - ca, b.shard_offset(kf), fe - fa

    def weight_decay_mask(self) -> torch.Tensor:
        """Per element of the flat buffer: True where weight decay applies.

        megatron-core's default parameter groups: no weight decay for biases and 1-D parameters
        (norm weights); padding is excluded too.
        """
        mask = torch.zeros(self.padded_numel, dtype=torch.bool)
        for slot in self.slots:
            if not (len(slot.shape) == 1 or slot.name.endswith(".bias")):
                mask[slot.offset:slot.offset + slot.numel] = True
        return mask

    # ------------------------------------------------------------------ collectives
    def _scope(self, scope: str) -> Tuple[Any, int]:
        """(process group, its size) of the 'intra' or 'inter' scope."""
        return (self.intra_group, self.m) if scope == "intra" else (self.inter_group, self.g)

    def _ag(self, out: torch.Tensor, inp: torch.Tensor, scope: str) -> None:
        """All-gather at 'intra' / 'inter' scope ('inter' works on the 1/m slice), counted."""
        group, k = self._scope(scope)
        if k == 1:
            out.copy_(inp)
            return
        _all_gather(out, inp.contiguous(), group)
        _count(self.counter, scope, "all_gather", out.numel(), out, k)

    def _rs(self, out: torch.Tensor, inp: torch.Tensor, scope: str) -> None:
        """Reduce-scatter of gradients at 'intra' / 'inter' scope (SUM), counted; TLq's one-hop
        path with --quantized-gradients."""
        group, k = self._scope(scope)
        if k == 1:
            out.copy_(inp)
            return
        if self.quant is not None and self.quant.quantized_gradients:
            self._quantized_rs(out, inp, scope)
            return
        _reduce_scatter(out, inp.contiguous(), group, dist.ReduceOp.SUM)
        _count(self.counter, scope, "reduce_scatter", inp.numel(), inp, k)

    def _ar(self, t: torch.Tensor, scope: str) -> None:
        group, k = self._scope(scope)
        if k == 1:
            return
        dist.all_reduce(t, group=group)
        _count(self.counter, scope, "all_reduce", t.numel(), t, k)

    # -- quantized (SDP4Bit) versions, used when the QuantizationConfig asks for them
    def _single_level_groups(self) -> Dict[str, TwoLevelGroups]:
        """TwoLevelGroups views of the intra group alone and the inter group alone (so
        ``two_level_reduce_scatter`` runs its one-hop paths there) and of the whole DP group."""
        gr, m, g = self.groups, self.m, self.g
        k, l = self.group_index, self.local
        return {
            "global": gr,
            "intra": TwoLevelGroups(dp_group=self.intra_group, intra_group=self.intra_group,
                                    inter_group=None, dp_size=m, dp_rank=l, intra_size=m,
                                    inter_size=1, node=0, local=l,
                                    dp_ranks=list(gr.dp_ranks[k * m:(k + 1) * m])),
            "inter": TwoLevelGroups(dp_group=self.inter_group, intra_group=None,
                                    inter_group=self.inter_group, dp_size=g, dp_rank=k,
                                    intra_size=1, inter_size=g, node=k, local=0,
                                    dp_ranks=list(gr.dp_ranks[l::m])),
        }

    def _quantized_rs(self, out: torch.Tensor, inp: torch.Tensor, scope: str) -> None:
        """TLq reduce-scatter (exact SUM semantics) at ``scope``; bytes from its accounting.

        For 'global' the local-major buffer is first permuted into DP-rank order (chunk of rank
        k*m + l = our chunk (l, k)): one local copy, the layout two_level_reduce_scatter expects.

        A NaN / Inf in any member's input: every member of the scope's group agrees on it before
        any payload moves and raises :class:`~.collectives.NonFiniteError`; we write NaN into
        ``out`` instead of letting it escape the backward pass (it used to kill the ranks of one
        group while the others waited for them in the next hop). The NaN then travels like an
        exact sum would carry it: the next hop's members agree on it in turn, every
        optimizer-state shard ends up NaN, the global grad norm is NaN on every rank, and the
        trainer skips the step everywhere (counted as a nan iteration).
        """
        from .accounting import CommAccounting
        from .collectives import NonFiniteError, two_level_reduce_scatter

        q = self.quant
        groups = self._tl_groups[scope]
        if groups.dp_size == 1:
            out.copy_(inp)
            return
        x = inp.reshape(-1)
        if scope == "global":
            x = x.view(self.m, self.g, -1).transpose(0, 1).contiguous().view(-1)
        acc = CommAccounting()
        try:
            two_level_reduce_scatter(
                x.contiguous(), out, groups, bits_intra=q.gradient_quantization_bits_intra,
                group_size_intra=q.gq_group_size_intra,
                bits_inter=q.gradient_quantization_bits_inter,
                group_size_inter=q.gq_group_size_inter, hadamard=q.hadamard_transform,
                hadamard_block=q.hadamard_block_size, generator=self.quant_generator,
                stochastic=q.stochastic_rounding, accounting=acc,
                pipeline=q.gradient_alltoall_pipeline)
        except NonFiniteError as exc:
            out.fill_(float("nan"))
            self.nonfinite_events += 1
            logger.warning("PaRO engine: quantized %s gradient reduce-scatter met non-finite "
                           "values (%s); the step will be skipped", scope, exc)
            return
        rep = acc.interval_report()["grad"]
        for link in ("intra", "inter"):
            self.counter.bytes[link] += float(rep[link]["bytes"])
        self.counter.calls.append((scope, "quantized_reduce_scatter", x.numel(), groups.dp_size))

    def _quantized_param_sync(self, src: torch.Tensor, target: torch.Tensor, offset: int,
                              hops: Sequence[str]) -> None:
        """qWD (or direct) all-gather of this rank's updated shard into ``target``.

        The shard is quantized once (against the last synced weights at ``target[offset:]``) and
        the codes are forwarded hop by hop (inter, then intra for a global gather), so there is no
        second quantization and every replica reconstructs ``target`` identically. Bytes per hop
        are the real code + scale payloads.
        """
        from .kernels import QuantizedTensor, dequantize, dequantize_add, quantize, quantize_difference

        q = self.quant
        bits, gs = q.weight_quantization_bits, q.wq_group_size
        numel = src.numel()
        if q.weight_quantization_mode == "diff":
            qt = quantize_difference(src, target[offset:offset + numel], bits, gs,
                                     stochastic=q.stochastic_rounding,
                                     generator=self.quant_generator, check_finite=False)
        else:
            qt = quantize(src, bits, gs, stochastic=q.stochastic_rounding,
                          generator=self.quant_generator, check_finite=False)
        per_element = qt.nbytes / numel
        codes, scales = qt.codes, qt.scales
        for scope in hops:
            group, k = self._scope(scope)
            if k == 1:
                continue
            c2 = torch.empty(codes.numel() * k, dtype=codes.dtype, device=codes.device)
            s2 = torch.empty(scales.numel() * k, dtype=scales.dtype, device=scales.device)
            _all_gather(c2, codes, group)
            _all_gather(s2, scales, group)
            numel *= k
            self.counter.record(scope, "all_gather", numel, per_element, k)
            codes, scales = c2, s2
        full = QuantizedTensor(codes, scales, bits, gs, numel)
        if q.weight_quantization_mode == "diff":
            dequantize_add(full, target, out=target)
        else:
            dequantize(full, out=target)

    def _global_rs(self, full: torch.Tensor) -> torch.Tensor:
        """PaRO-CC reduce-scatter of the full buffer to this rank's G shard (intra RS, inter RS)."""
        if self.quant is not None and self.quant.quantized_gradients:
            g_shard = torch.empty(full.numel() // self.n, dtype=full.dtype, device=full.device)
            self._quantized_rs(g_shard, full, "global")
            return g_shard
        i_slice = torch.empty(full.numel() // self.m, dtype=full.dtype, device=full.device)
        self._rs(i_slice, full, "intra")
        g_shard = torch.empty(full.numel() // self.n, dtype=full.dtype, device=full.device)
        self._rs(g_shard, i_slice, "inter")
        return g_shard

    def _global_ag(self, full: torch.Tensor, g_shard: torch.Tensor) -> None:
        """PaRO-CC all-gather of G shards into the full buffer (inter AG, intra AG)."""
        i_slice = torch.empty(full.numel() // self.m, dtype=full.dtype, device=full.device)
        self._ag(i_slice, g_shard, "inter")
        self._ag(full, i_slice, "intra")

    # ------------------------------------------------------------------ level transitions
    def _reduce_to(self, src: torch.Tensor, frm: Level, to: Level) -> torch.Tensor:
        """Reduce-scatter a shard-space tensor at level ``frm`` to level ``to``, bucket by bucket
        (N -> I: intra RS; I -> G: inter RS; N -> G: PaRO-CC global RS)."""
        kf, kt = self.level_ranks(frm), self.level_ranks(to)
        out = torch.empty(src.numel() * kf // kt, dtype=src.dtype, device=src.device)
        for b in self.buckets:
            x = b.shard(src, kf)
            y = b.shard(out, kt)
            if (frm, to) == (Level.N, Level.G):
                y.copy_(self._global_rs(x))
            else:
                self._rs(y, x, "intra" if frm == Level.N else "inter")
        return out

    def _gather_to(self, dst: torch.Tensor, src: torch.Tensor, frm: Level, to: Level) -> None:
        """All-gather a shard-space tensor at level ``frm`` into ``dst`` at level ``to``, bucket by
        bucket (G -> I: inter AG; I -> N: intra AG; G -> N: PaRO-CC global AG)."""
        kf, kt = self.level_ranks(frm), self.level_ranks(to)
        for b in self.buckets:
            x = b.shard(src, kf)
            y = b.shard(dst, kt)
            if (frm, to) == (Level.G, Level.N):
                self._global_ag(y, x)
            else:
                self._ag(y, x, "inter" if frm == Level.G else "intra")

    # ------------------------------------------------------------------ parameters
    @torch.no_grad()
    def _gather_bucket(self, b: _Bucket) -> None:
        """Rebuild bucket ``b``'s full parameters from the shards (collective; p = I / G)."""
        if b.gathered:
            return
        storage = b.full.untyped_storage()
        need = b.size * b.full.element_size()
        if storage.nbytes() != need:
            storage.resize_(need)
        p = self.strategy.params
        k = self.level_ranks(p)
        shard = b.shard(self.param_shard, k)
        if p == Level.I:
            self._ag(b.full, shard, "intra")
        else:
            self._global_ag(b.full, shard)
        b.gathered = True
        self._track_peak()

    def _release_bucket(self, b: _Bucket) -> None:
        """Free bucket ``b``'s full parameter storage (p = I / G); the views stay valid."""
        if self.strategy.params == Level.N or not b.gathered:
            return
        b.full.untyped_storage().resize_(0)
        b.gathered = False

    def gather_params(self) -> None:
        """Gather every bucket (collective; no-op for p = N)."""
        for b in self.buckets:
            self._gather_bucket(b)

    def release_params(self) -> None:
        """Release every bucket (p = I / G)."""
        for b in self.buckets:
            self._release_bucket(b)

    def _release_deferred(self, keep: Sequence[_Bucket] = ()) -> None:
        still = []
        for b in self._deferred:
            if any(b is k for k in keep):
                still.append(b)
            else:
                self._release_bucket(b)
        self._deferred = still

    def _make_pre_hook(self, buckets: List[_Bucket]):
        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            self._release_deferred(keep=buckets)
            for b in buckets:
                self._gather_bucket(b)
        return pre_hook

    def _make_post_hook(self, module: torch.nn.Module, buckets: List[_Bucket]):
        def post_hook(mod: torch.nn.Module, args: Any, output: Any) -> None:
            outs = list(_tensors(output))
            if torch.is_grad_enabled():  # regather right before this module's backward
                tensors = [t for t in outs if t.requires_grad and t.grad_fn is not None]
                if not tensors:  # no handle on its backward: keep its buckets until then
                    return
                hook = self._make_output_grad_hook(buckets)
                for t in tensors:
                    t.register_hook(hook)
            if self._in_backward:  # re-run forward (activation recomputation) inside backward
                return
            # A parameter returned for the caller to apply (megatron's skip_bias_add: linear_proj /
            # linear_fc2 return their bias): release at the next owner's forward instead.
            returned = {t.untyped_storage().data_ptr() for t in outs}
            for b in buckets:
                if b.owners[-1] is module:
                    if b.full.untyped_storage().data_ptr() in returned:
                        self._deferred.append(b)
                    else:
                        self._release_bucket(b)
        return post_hook

    def _make_output_grad_hook(self, buckets: List[_Bucket]):
        def hook(grad: torch.Tensor) -> None:
            self._begin_backward()
            for b in buckets:
                if not b.reduced:
                    self._gather_bucket(b)
        return hook

    @contextlib.contextmanager
    def full_params(self, writeback: bool = False) -> Iterator[None]:
        """Full parameters inside the block (collective); with ``writeback`` the block's changes
        (e.g. ``load_state_dict``) are copied back into this rank's shard before releasing."""
        self.gather_params()
        try:
            yield
        finally:
            if writeback and self.param_shard is not None:
                p = self.strategy.params
                k = self.level_ranks(p)
                for b in self.buckets:
                    a, e = self._local_range(b, p)
                    b.shard(self.param_shard, k).copy_(b.full[a:e])
            self.release_params()

    def param_level_storage(self) -> torch.Tensor:
        """The persistent parameter tensor at the p level (full buffer for N, else the shard)."""
        return self.param_buffer if self.param_shard is None else self.param_shard

    def params_at_level(self, level: Level) -> torch.Tensor:
        """This rank's parameters at ``level`` >= p, in shard order (a copy, no communication)."""
        src = self.param_level_storage()
        out = torch.empty(self.padded_numel // self.level_ranks(level), dtype=src.dtype,
                          device=src.device)
        for c, f, length in self._pieces(self.strategy.params, level):
            out[f:f + length].copy_(src[c:c + length])
        return out

    @torch.no_grad()
    def sync_params(self, os_params: torch.Tensor) -> None:
        """After the optimizer step: spread the updated os-level shard to the p level (spec §3,
        phase 4 -- copy, inter AG, intra AG or global AG), bucket by bucket."""
        o, p = self.strategy.optim, self.strategy.params
        if o != p and self.quant is not None and self.quant.quantized_weights:
            hops = {(Level.G, Level.I): ["inter"], (Level.G, Level.N): ["inter", "intra"],
                    (Level.I, Level.N): ["intra"]}[(o, p)]
            ko, kp = self.level_ranks(o), self.level_ranks(p)
            target_all = self.param_level_storage()
            for b in self.buckets:
                src = b.shard(os_params, ko)
                target = b.shard(target_all, kp)
                offset = self._local_range(b, o)[0] - self._local_range(b, p)[0]
                self._quantized_param_sync(src, target, offset, hops)
            return
        src = os_params.to(self.param_dtype)
        if o == p:
            self.param_level_storage().copy_(src)
        elif (o, p) in ((Level.G, Level.I), (Level.G, Level.N), (Level.I, Level.N)):
            self._gather_to(self.param_level_storage(), src, o, p)
        else:  # pragma: no cover - excluded by the validity rule
            raise AssertionError(f"os level {o.name} coarser than p level {p.name}")

    # ------------------------------------------------------------------ forward / backward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The buckets are gathered and released by the owner modules' forward hooks; the hook on
        the model output marks the start of this chunk's backward."""
        out = self.module(*args, **kwargs)
        self._release_deferred()
        if torch.is_grad_enabled():
            self._pre_backward_done = False
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(self._pre_backward_hook)
        return out

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        """Gradient of the model output arrived: the backward of this chunk starts now."""
        if not self._pre_backward_done:
            self._pre_backward_done = True
            self._begin_backward()

    def _begin_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        for b in self.buckets:
            b.pending, b.reduced = len(b.params), False
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _make_grad_hook(self, index: int):
        slot = self.slots[index]
        b = self.buckets[self._bucket_of[index]]

        def hook(param: torch.Tensor) -> None:
            if param.grad is None:
                return
            self._begin_backward()
            if self.grad_buffer is not None:
                self.grad_buffer[slot.offset:slot.offset + slot.numel].view(slot.shape).add_(
                    param.grad)
            else:
                if b.tmp_grad is None:  # g = I / G: this bucket's full gradient, this backward
                    b.tmp_grad = torch.zeros(b.size, dtype=self.grad_dtype, device=param.device)
                    self._track_peak()
                o = slot.offset - b.start
                b.tmp_grad[o:o + slot.numel].view(slot.shape).add_(param.grad)
            param.grad = None
            b.pending -= 1
            if b.pending == 0:  # the bucket's backward is over
                self._finish_bucket(b)

        return hook

    @torch.no_grad()
    def _finish_bucket(self, b: _Bucket) -> None:
        """All of ``b``'s gradients of this micro-step are in: reduce-scatter them (g = I / G)
        into the shard accumulator, free the temporary and release the parameters (p = I / G)."""
        if b.reduced:
            return
        b.reduced = True
        if self.grad_shard is not None:
            full = b.tmp_grad
            if full is None:  # no gradient arrived (unused parameters): contribute zeros
                full = torch.zeros(b.size, dtype=self.grad_dtype, device=self.grad_shard.device)
            b.tmp_grad = None
            k = self.level_ranks(self.strategy.grads)
            acc = b.shard(self.grad_shard, k)
            if self.strategy.grads == Level.I:
                shard = torch.empty_like(acc)
                self._rs(shard, full, "intra")
            else:
                shard = self._global_rs(full)
            del full
            acc.add_(shard)
        self._release_bucket(b)

    @torch.no_grad()
    def _end_backward(self) -> None:
        """End of one micro-step's backward (safety net): every bucket not finished yet is reduced
        and released, in bucket order, so every rank issues the same collectives."""
        for b in self.buckets:
            self._finish_bucket(b)
        self.release_params()
        self._in_backward = False

    def no_sync(self) -> contextlib.AbstractContextManager:
        """megatron-core's schedule wraps all but the last micro-batch in this; the engine's
        per-micro-step reductions are part of the strategy, so there is nothing to defer."""
        return contextlib.nullcontext()

    def zero_grad_buffer(self) -> None:
        """Start of a global step: clear the gradient accumulators."""
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
        else:
            self.grad_shard.zero_()
        self.main_grad = None

    @torch.no_grad()
    def finalize_model_grads(self, model: Sequence[torch.nn.Module] = (), num_tokens: Any = None,
                             pg_collection: Any = None, force_all_reduce: bool = False) -> None:
        """Gradient sync at the accumulation boundary, g level -> os level (spec §3 phase 3),
        then the DP average (sum / n, as megatron-core's DDP with per-sample losses)."""
        if num_tokens is not None:
            raise NotImplementedError("the PaRO engine does not support calculate_per_token_loss")
        g, o = self.strategy.grads, self.strategy.optim
        src = self.grad_buffer if self.grad_buffer is not None else self.grad_shard
        if (g, o) == (Level.N, Level.N):
            out = src.clone()
            hierarchical_all_reduce(out, self.intra_group, self.inter_group, counter=self.counter)
        elif (g, o) == (Level.N, Level.I):
            out = self._reduce_to(src, Level.N, Level.I)
            self._ar(out, "inter")
        elif (g, o) == (Level.N, Level.G):
            out = self._reduce_to(src, Level.N, Level.G)
        elif (g, o) == (Level.I, Level.I):
            out = src.clone()
            self._ar(out, "inter")
        elif (g, o) == (Level.I, Level.G):
            out = self._reduce_to(src, Level.I, Level.G)
        else:  # G -> G: already reduced every micro-step
            out = src.clone()
        out = out.float()
        out.mul_(1.0 / self.n)
        self.main_grad = out

    # ------------------------------------------------------------------ accounting
    def _track_peak(self) -> None:
        b = self.model_state_bytes()
        self.peak_bytes = max(self.peak_bytes, b["params"] + b["grads"])

    def model_state_bytes(self) -> Dict[str, int]:
        """Bytes of the parameter and gradient tensors resident right now (storage sizes)."""
        params = 0
        for t in (self.param_buffer, self.param_shard):
            if t is not None:
                params += t.untyped_storage().nbytes()
        if self.param_buffer is None:  # p = I / G: the gathered buckets
            params += sum(b.full.untyped_storage().nbytes() for b in self.buckets)
        grads = 0
        for t in [self.grad_buffer, self.grad_shard] + [b.tmp_grad for b in self.buckets]:
            if t is not None:
                grads += t.untyped_storage().nbytes()
        return {"params": params, "grads": grads}

    def bucket_bytes(self) -> List[Dict[str, int]]:
        """Per bucket: elements (padded), owner modules, and the parameter / gradient bytes it adds
        above the persistent figure while it is in use (full parameters for p = I / G, a full
        temporary gradient for g = I / G)."""
        pe = torch.empty(0, dtype=self.param_dtype).element_size()
        ge = torch.empty(0, dtype=self.grad_dtype).element_size()
        return [{"size": b.size, "owners": len(b.owners),
                 "params": b.size * pe * (self.strategy.params != Level.N),
                 "grads": b.size * ge * (self.strategy.grads != Level.N)} for b in self.buckets]


class ParoOptimizer:
    """fp32 AdamW (or SGD with momentum) on this rank's optimizer-state shard of a
    :class:`ParoDataParallel` chunk.

    State per rank: fp32 master parameters, and for Adam the two moments, all at the os level
    (K = 12 bytes per element, as the cost model assumes; fp32 training keeps the master copy too).
    The update reproduces ``torch.optim.AdamW`` (what megatron-core uses without Apex/TE) with
    megatron-core's default parameter groups (no weight decay for biases and 1-D parameters), so
    every strategy follows the same trajectory as ZeRO-1 up to summation order. Exposes what the
    trainer and ``OptimizerParamScheduler`` use: ``param_groups``, ``config``, ``prepare_grads``,
    ``get_grad_norm``, ``get_parameters`` (for megatron-core's clip), ``step_with_ready_grads``,
    ``zero_grad``, ``scale_loss``, ``get_loss_scale``, ``state_dict``, ``load_state_dict``,
    ``reload_model_params``.
    """

    def __init__(self, engine: ParoDataParallel, config: Any) -> None:
        if getattr(config, "fp16", False):
            raise NotImplementedError("PaRO engine strategies support bf16 and fp32, not fp16 "
                                      "(no loss scaling); use --bf16")
        if config.optimizer not in ("adam", "sgd"):
            raise NotImplementedError(f"optimizer {config.optimizer!r} is not supported by the PaRO engine")
        self.engine = engine
        self.config = config
        self.is_stub_optimizer = False
        o = engine.strategy.optim
        self.master = torch.nn.Parameter(engine.params_at_level(o).detach().float().clone())
        self.decay_mask = engine.weight_decay_mask()[engine.level_indices(o)].to(self.master.device)
        if config.optimizer == "adam":
            self.exp_avg = torch.zeros_like(self.master.data)
            self.exp_avg_sq = torch.zeros_like(self.master.data)
        else:
            self.exp_avg = torch.zeros_like(self.master.data)  # momentum buffer
            self.exp_avg_sq = None
        self.step_count = 0
        common = {"params": [], "lr": config.lr, "lr_mult": 1.0, "default_config": True,
                  "is_expert_parallel": False, "is_decoupled_lr": False}
        self.param_groups: List[Dict[str, Any]] = [
            dict(common, weight_decay=config.weight_decay, wd_mult=1.0),
            dict(common, weight_decay=0.0, wd_mult=0.0),
        ]
        # Scope over which the os shards partition the model: the grad norm sums over it.
        self._norm_group = {Level.N: None, Level.I: engine.intra_group,
                            Level.G: engine.groups.dp_group}[o]
        self._norm_ranks = {Level.N: 1, Level.I: engine.m, Level.G: engine.n}[o]

    # -- trainer interface
    def get_parameters(self) -> List[torch.Tensor]:
        """The tensor whose ``.grad`` megatron-core's ``clip_grad_by_total_norm_fp32`` scales."""
        self.master.grad = self.engine.main_grad
        return [self.master]

    def prepare_grads(self) -> bool:
        """No loss scaling: nothing overflows here (non-finite norms are caught by the caller)."""
        if self.engine.main_grad is None:
            raise RuntimeError("finalize_model_grads was not called before the optimizer step")
        self.master.grad = self.engine.main_grad
        return False

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """L2 norm of the DP-averaged gradient; shards summed over the scope that splits them
        (replicas counted once)."""
        sq = torch.sum(self.engine.main_grad.double() ** 2).reshape(1)
        if self._norm_ranks > 1:
            dist.all_reduce(sq, group=self._norm_group)
        return float(sq.item()) ** 0.5

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        grad = self.engine.main_grad
        lr = self.param_groups[0]["lr"]
        wd = self.param_groups[0]["weight_decay"]
        wd_nodecay = self.param_groups[1]["weight_decay"]
        p = self.master.data
        self.step_count += 1
        if self.config.optimizer == "adam":
            p.mul_(torch.where(self.decay_mask, 1 - lr * wd, 1 - lr * wd_nodecay).to(p.dtype))
            b1, b2 = self.config.adam_beta1, self.config.adam_beta2
            self.exp_avg.lerp_(grad, 1 - b1)
            self.exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            bc1 = 1 - b1 ** self.step_count
            bc2 = 1 - b2 ** self.step_count
            denom = (self.exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(self.config.adam_eps)
            p.addcdiv_(self.exp_avg, denom, value=-(lr / bc1))
        else:  # torch.optim.SGD with momentum and coupled weight decay
            d = grad + torch.where(self.decay_mask, wd, wd_nodecay).to(p.dtype) * p
            mom = self.config.sgd_momentum
            if self.step_count == 1:
                self.exp_avg.copy_(d)
            else:
                self.exp_avg.mul_(mom).add_(d)
            p.add_(self.exp_avg if mom else d, alpha=-lr)
        self.engine.sync_params(p)
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.master.grad = None
        self.engine.zero_grad_buffer()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def get_loss_scale(self) -> torch.Tensor:
        return torch.tensor(1.0)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Re-derive the fp32 master shard from the model's parameters (after loading weights)."""
        self.master.data.copy_(self.engine.params_at_level(self.engine.strategy.optim).float())

    # -- checkpoint
    def state_dict(self) -> Dict[str, Any]:
        """Everything for an exact resume of this rank: master shard, moments, step, groups."""
        return {"paro_strategy": self.engine.strategy.name,
                "padded_numel": self.engine.padded_numel,
                "master": self.master.detach().clone(),
                "exp_avg": self.exp_avg.clone(),
                "exp_avg_sq": None if self.exp_avg_sq is None else self.exp_avg_sq.clone(),
                "step": self.step_count,
                "quant_generator": (self.engine.quant_generator.get_state()
                                    if self.engine.quant is not None else None),
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.param_groups]}

    @torch.no_grad()
    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if sd.get("paro_strategy") != self.engine.strategy.name or \
                sd.get("padded_numel") != self.engine.padded_numel:
            raise RuntimeError(
                f"checkpoint optimizer state is for PaRO strategy {sd.get('paro_strategy')} "
                f"({sd.get('padded_numel')} elements), this run uses {self.engine.strategy.name} "
                f"({self.engine.padded_numel}): resume with the same strategy and layout")
        self.master.data.copy_(sd["master"])
        self.exp_avg.copy_(sd["exp_avg"])
        if self.exp_avg_sq is not None:
            self.exp_avg_sq.copy_(sd["exp_avg_sq"])
        self.step_count = int(sd["step"])
        if self.engine.quant is not None and sd.get("quant_generator") is not None:
            self.engine.quant_generator.set_state(sd["quant_generator"])
        for group, saved in zip(self.param_groups, sd["param_groups"]):
            group.update(saved)

    def state_bytes(self) -> int:
        """Bytes of the optimizer state resident on this rank (storage sizes)."""
        tensors = [self.master.data, self.exp_avg, self.exp_avg_sq]
        return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)


def model_state_bytes(engine: ParoDataParallel, optimizer: ParoOptimizer) -> Dict[str, int]:
    """Measured persistent model-state bytes of this rank, by state (compare with
    :func:`.paro.model_state_memory`)."""
    out = engine.model_state_bytes()
    out["optimizer_states"] = optimizer.state_bytes()
    out["total"] = out["params"] + out["grads"] + out["optimizer_states"]
    return out

def _tensors(x: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module output (tensor, or tuples / lists / dicts of them)."""
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)
