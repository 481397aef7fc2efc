"""PaRO training engine: every partition strategy that megatron-core's DDP cannot express.

Spec: ../shared/research/paro.md; cost model: :mod:`.cost`; PaRO-CC collectives: :mod:`.comm`.
NNG (ZeRO-1) and NNN (DDP) keep running on megatron-core's ``DistributedDataParallel``
(+ ``DistributedOptimizer``); the engine trains the other twelve strategies -- and, for testing,
all fourteen. This module decides what one model chunk's engine *holds*:
:class:`ParoDataParallel` flattens the parameters into buckets (:mod:`.layout`), keeps
parameters, gradients and the optimizer's gradient input at the strategy's partition levels,
says where this rank's shard of each level lies, syncs the parameters after the optimizer step
and accounts its memory. What it *does* during a step lives beside it, one concern per module,
composed here:

* :mod:`.gather` -- when a bucket's full parameters exist (gathers, prefetch, release);
* :mod:`.grad_reduce` -- the gradients' way from the backward pass to the optimizer-state level;
* :mod:`.hooks` -- the forward / backward hooks that decide when those two act;
* :mod:`.state` -- the weights to and from a host state dict, for checkpoints;
* :mod:`.transitions` -- the counted collectives between levels.

Those modules never import this one; the engine builds each from what it needs (as FSDP2's
parameter groups). Every collective is counted in a :class:`.comm.CommCounter`, comparable with
:func:`.cost.communication_volume`; peak memory is the PaRO formula plus about one bucket. With a
QuantizationConfig SDP4Bit runs inside the PaRO groups through the model's
:class:`~..runtime.QuantizationRuntime` (supported: :func:`.strategy.quantization_support_error`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..runtime import QuantizationRuntime
from .comm import CommCounter, _size
from .gather import ParamGathers
from .grad_reduce import GradReduction
from .hooks import MicroStepHooks
from .layout import ShardGeometry, plan_buckets
from .state import host_state_dict, load_host_state_dict
from .strategy import Level, PaRoStrategy, quantization_support_error
from .transitions import LevelCollectives, bucket_key

__all__ = ["ParoDataParallel"]


class ParoDataParallel(torch.nn.Module):
    """Data parallelism with PaRO partition levels for parameters, gradients and optimizer input.

    ``module`` is one model chunk (GPTModel or its Float16Module); ``groups`` a
    :class:`~megatron.distributed.quant.topology.TwoLevelGroups` from
    :func:`.comm.build_paro_groups` (DP rank r = group * m + local). ``grad_dtype`` is the dtype of
    gradient accumulation and reduction (fp32 for bf16 training, like megatron-core's
    ``grad_reduce_in_fp32``). ``bucket_numel`` caps a bucket: a unit module larger than that is
    split into its children (default: one bucket per unit module, see :func:`.layout._units`). The object
    mimics what megatron-core's schedule and our trainer read from a DDP chunk: ``module``,
    ``config``, ``no_sync``, ``zero_grad_buffer`` and ``finalize_model_grads`` (to be set as
    ``config.finalize_model_grads_func``).

    ``grad_groups`` (``--overlap-grad-reduce``) and ``param_groups`` (``--overlap-param-gather``,
    p = I / G): further sets of the same groups, communicators of their own (one per stream), over
    which the per-bucket gradient reduce-scatters / parameter gathers run on the communication
    stages while compute goes on; bit for bit the numbers of the inline path.
    """

    def __init__(self, config: Any, module: torch.nn.Module, strategy: PaRoStrategy, groups: Any,
                 grad_dtype: Optional[torch.dtype] = None, quant_config: Any = None,
                 bucket_numel: Optional[int] = None, grad_groups: Any = None,
                 param_groups: Any = None) -> None:
        super().__init__()
        self.config = config
        self.module = module
        self.strategy = strategy
        self.groups = groups
        self.intra_group = groups.intra_group
        self.inter_group = groups.inter_group
        self.geometry = ShardGeometry(intra_size=_size(self.intra_group),
                                      inter_size=_size(self.inter_group), local=groups.local,
                                      group_index=groups.node)
        """Which shard of every bucket this rank holds at each level."""
        if self.n != groups.dp_size:
            raise ValueError(f"groups cover {self.n} ranks but the DP group has {groups.dp_size}")
        self.counter = CommCounter()

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
            from ..collectives.common import required_padding_multiple_from_config

            unit = math.lcm(unit, required_padding_multiple_from_config(self.quant, self.n, self.m))
        if grad_groups is not None and (grad_groups.dp_size, grad_groups.intra_size) != (
                groups.dp_size, groups.intra_size):
            raise ValueError("grad_groups must have the layout of groups")
        self.grad_groups = grad_groups
        """Communicators of the overlapped gradient reduce-scatters (None: inline, on
        ``groups``)."""
        if param_groups is not None and (param_groups.dp_size, param_groups.intra_size) != (
                groups.dp_size, groups.intra_size):
            raise ValueError("param_groups must have the layout of groups")
        if param_groups is not None and strategy.params == Level.N:
            raise ValueError(f"{strategy.name} keeps full parameters (p = N): no gathers to "
                             f"overlap, so no param_groups")
        self.param_groups = param_groups
        """Communicators of the overlapped parameter gathers (None: inline in the hooks, on
        ``groups``)."""
        self.quant_runtime: Optional[QuantizationRuntime] = (
            QuantizationRuntime(self.quant, groups if grad_groups is None else grad_groups)
            if self.quant is not None else None)
        """The model's quantized communication (the same object megatron-core's bucket groups
        use): generators, LoCo, accounting, start iteration, NaN/Inf agreement; the trainer's
        hooks (integration.set_iteration, checkpoints, reports) find it under this name."""
        self.padding_unit = unit

        # Buckets: unit modules in module order; a parameter used by several units (or passed to
        # a module at call time, tied embeddings) gets a bucket of its own owned by all of them.
        self.layout = plan_buckets(module, bucket_numel, unit)
        """The parameters, their slots and buckets (:class:`~.layout.FlatLayout`)."""
        self.params, self.slots, self.buckets = (self.layout.params, self.layout.slots,
                                                 self.layout.buckets)
        self.num_params = sum(s.numel for s in self.slots)
        self.padded_numel = self.layout.padded_numel
        """Sum of the padded bucket sizes: what the engine allocates and sends."""
        S = self.padded_numel
        if self.quant_runtime is not None:
            for b in self.buckets:
                self.quant_runtime.register(bucket_key(b), b.index, b.size)
        self.collectives = LevelCollectives(groups, self.geometry, self.buckets, self.counter,
                                            self.quant_runtime)
        """The counted collectives between partition levels, on ``groups``."""

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
        self.param_gathers = ParamGathers(self.buckets, p_level, self.param_shard, self.geometry,
                                          self.collectives, param_groups, self._track_peak)
        """Gathers, prefetch and release of the buckets' full parameters (p = I / G)."""
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
                    a, e = self.geometry.local_range(b, p_level)
                    k = self.level_ranks(p_level)
                    b.shard(self.param_shard, k).copy_(b.full[a:e])
        self.param_gathers.release_all()

        # Gradients: persistent full buffer (g = N) or persistent shard accumulator (g = I / G).
        self.grad_buffer: Optional[torch.Tensor] = None
        self.grad_shard: Optional[torch.Tensor] = None
        if strategy.grads == Level.N:
            self.grad_buffer = torch.zeros(S, dtype=self.grad_dtype, device=device)
        else:
            self.grad_shard = torch.zeros(S // self.level_ranks(strategy.grads),
                                          dtype=self.grad_dtype, device=device)
        self.grad_reduction = GradReduction(strategy, self.geometry, self.collectives,
                                            self.grad_buffer, self.grad_shard, self.grad_dtype,
                                            grad_groups, self.quant_runtime, self.param_gathers,
                                            self._track_peak)
        """Gradient accumulation, the per-bucket reduce-scatters and the boundary sync."""
        self.hooks = MicroStepHooks(self.layout, p_level, self.param_gathers,
                                    self.grad_reduction)
        """The forward / backward hooks (registered at the end of the constructor)."""
        self.peak_bytes = 0
        """Largest parameter + gradient bytes resident at once (gathered buckets and the temporary
        full gradients of g = I / G raise it above the persistent figure)."""
        self._track_peak()
        self.main_grad: Optional[torch.Tensor] = None
        """fp32 gradient at the optimizer-state level, DP-averaged (set by finalize_model_grads)."""
        self.hooks.register()

    # ------------------------------------------------------------------ layout
    @property
    def m(self) -> int:
        """Ranks of one PaRO group (the 'intra' scope)."""
        return self.geometry.intra_size

    @property
    def n(self) -> int:
        """DP size, m * g."""
        return self.geometry.dp_size

    def level_ranks(self, level: Level) -> int:
        """Ranks sharing one element's state at ``level`` (1, m or n)."""
        return self.geometry.level_ranks(level)

    def level_indices(self, level: Level) -> torch.Tensor:
        """Flat-buffer indices of this rank's shard at ``level``, in shard order (the buckets'
        shards one after another).

        int64, 8 bytes per shard element on the host: for tests and debugging only. The engine
        keeps no index tensors (contiguous ranges per bucket,
        :meth:`.layout.ShardGeometry.local_range`, say the same), so its host memory does not
        grow with the model."""
        parts = []
        for b in self.buckets:
            a, e = self.geometry.local_range(b, level)
            parts.append(torch.arange(b.start + a, b.start + e))
        return torch.cat(parts)

    def _pieces(self, coarse: Level, fine: Level) -> Iterator[Tuple[int, int, int]]:
        """Per bucket: (offset in the coarse-level shard, offset in the fine-level shard, length)
        of the fine shard, fine at least as partitioned as coarse."""
        kc, kf = self.level_ranks(coarse), self.level_ranks(fine)
        for b in self.buckets:
            ca, _ = self.geometry.local_range(b, coarse)
            fa, fe = self.geometry.local_range(b, fine)
            yield b.shard_offset(kc) + fa - ca, b.shard_offset(kf), fe - fa

    @staticmethod
    def _decays(name: str, shape: torch.Size) -> bool:
        """megatron-core's default parameter groups: no weight decay for biases and 1-D
        parameters (norm weights)."""
        return not (len(shape) == 1 or name.endswith(".bias"))

    def weight_decay_mask(self, level: Level = Level.N,
                          device: Optional[torch.device] = None) -> torch.Tensor:
        """Per element of this rank's shard at ``level``, in shard order (level N: the whole flat
        buffer): True where weight decay applies (megatron-core's default parameter groups, see
        :meth:`_decays`); padding is excluded too.

        Built at the shard's size directly on ``device`` (default: CPU), one slice fill per
        decayed parameter piece: 1 byte per shard element and no model-sized index tensors.
        """
        k = self.level_ranks(level)
        mask = torch.zeros(self.padded_numel // k, dtype=torch.bool, device=device)
        for b in self.buckets:
            a, e = self.geometry.local_range(b, level)
            base = b.shard_offset(k) - a  # bucket offset x -> shard index base + x
            for i in b.params:
                slot = self.slots[i]
                if not self._decays(slot.name, slot.shape):
                    continue
                lo = max(slot.offset - b.start, a)
                hi = min(slot.offset - b.start + slot.numel, e)
                if lo < hi:
                    mask[base + lo:base + hi] = True
        return mask

    # ------------------------------------------------------------------ parameters
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
        if o != p and self.quant_runtime is not None and self.quant_runtime.quantize_weights:
            # qWD (or qW): each bucket's updated shard quantized once against the last synced
            # weights (``target``, identical on every rank) and its codes forwarded hop by hop
            # (inter, then intra for a global gather: the local-major layout).
            rt = self.quant_runtime
            hops = {(Level.G, Level.I): ["inter"], (Level.G, Level.N): ["inter", "intra"],
                    (Level.I, Level.N): ["intra"]}[(o, p)]
            ko, kp = self.level_ranks(o), self.level_ranks(p)
            target_all = self.param_level_storage()
            for b in self.buckets:
                src = b.shard(os_params, ko)
                target = b.shard(target_all, kp)
                before = rt.accounting.link_bytes("weight")
                handle = rt.all_gather(src, target, key=bucket_key(b), index=b.index,
                                       reference=target, hops=hops, streams=rt.timing.inline)
                if handle is not None:   # ran inline: timed as exposed, its error raised here
                    rt.timing.wait("weight", handle)
                self.collectives.count_quantized("weight", "+".join(hops), "quantized_all_gather",
                                                 target.numel(), ko // kp, before)
            return
        src = os_params.to(self.param_dtype)
        if o == p:
            self.param_level_storage().copy_(src)
        elif (o, p) in ((Level.G, Level.I), (Level.G, Level.N), (Level.I, Level.N)):
            self.collectives.gather_to(self.param_level_storage(), src, o, p)
        else:  # pragma: no cover - excluded by the validity rule
            raise AssertionError(f"os level {o.name} coarser than p level {p.name}")

    @contextlib.contextmanager
    def full_params(self, writeback: bool = False) -> Iterator[None]:
        """Full parameters inside the block (collective); with ``writeback`` the block's changes
        (e.g. ``load_state_dict``) are copied back into this rank's shard before releasing."""
        self.param_gathers.gather_all()
        try:
            yield
        finally:
            if writeback and self.param_shard is not None:
                p = self.strategy.params
                k = self.level_ranks(p)
                for b in self.buckets:
                    a, e = self.geometry.local_range(b, p)
                    b.shard(self.param_shard, k).copy_(b.full[a:e])
            self.param_gathers.release_all()

    def host_state_dict(self, keep: bool = True) -> Optional[Dict[str, Any]]:
        """``self.module.state_dict()`` on the host, at most one bucket gathered at a time
        (collective for p = I / G; ``keep=False``: take part, return None):
        :func:`.state.host_state_dict`."""
        return host_state_dict(self.module, self.layout, self.param_gathers, keep)

    def load_host_state_dict(self, sd: Dict[str, Any]) -> None:
        """``self.module.load_state_dict(sd, strict=True)`` written straight into this rank's
        parameter shard, no collective: :func:`.state.load_host_state_dict`."""
        load_host_state_dict(self.module, sd, self.layout, self.geometry, self.strategy.params,
                             self.param_shard, self.param_gathers)

    # ------------------------------------------------------------------ forward / backward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The buckets are gathered and released by the owner modules' forward hooks; the hook on
        the model output marks the start of this chunk's backward (:mod:`.hooks`)."""
        out = self.module(*args, **kwargs)
        self.hooks.after_forward(out)
        return out

    def start_grad_sync(self, *unused: Any) -> None:
        """megatron-core's ``grad_sync_func`` (set with ``--overlap-grad-reduce``): nothing to
        start, the hooks start each bucket's reduce-scatter as soon as its gradients are in."""

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
        then the DP average (sum / n, as megatron-core's DDP with per-sample losses):
        :meth:`~.grad_reduce.GradReduction.to_optimizer_level`, kept as ``main_grad``."""
        if num_tokens is not None:
            raise NotImplementedError("the PaRO engine does not support calculate_per_token_loss")
        self.main_grad = self.grad_reduction.to_optimizer_level()

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
        in_flight = [t for _, shard, _, kept in self.grad_reduction.pending
                     for t in (shard, kept)]
        temporaries = [b.tmp_grad for b in self.buckets] + in_flight
        for t in [self.grad_buffer, self.grad_shard] + temporaries:
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
