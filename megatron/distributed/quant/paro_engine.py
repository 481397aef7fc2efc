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

Flat layout (why it looks like this). The buffer of ``S`` elements (the parameter count padded to
a multiple of the DP size ``n``) is cut into ``m`` I-shards; the I-shard of local index ``l`` is
``[l*S/m, (l+1)*S/m)``. The G-shard of the rank in group ``k`` with local index ``l`` is sub-chunk
``k`` of that I-shard, ``[l*S/m + k*S/n, l*S/m + (k+1)*S/n)``. With this (local-major) order
every PaRO transition is one plain collective on a contiguous slice and nothing is reordered:

* full -> I: intra reduce-scatter; I -> G: inter reduce-scatter of the I slice;
* global reduce-scatter (full -> G) = intra RS + inter RS (PaRO-CC, spec §4);
* G -> I: inter all-gather; I -> full: intra all-gather; global all-gather = inter AG + intra AG;
* global all-reduce (NNN) = :func:`.paro.hierarchical_all_reduce`.

Parameters at level I / G live persistently only as their shard; the full buffer is gathered
before the forward pass and again before the backward pass (a hook on the model output) and its
storage is released (``untyped_storage().resize_(0)``, as FSDP does) after each. The gather is
whole-model, so the *peak* holds one full parameter copy; the *persistent* memory follows the PaRO
formula. Gradients arrive through per-parameter post-accumulate-grad hooks into a flat buffer:
level N keeps it and accumulates locally; levels I / G reduce-scatter it at the end of every
micro-step's backward (a callback queued on the autograd engine) into a persistent shard
accumulator and free it. ``finalize_model_grads`` (called by megatron-core's schedule after the
last micro-batch) moves the gradients from their level to the optimizer-state level and averages
them over DP, like megatron-core's DDP.

With a QuantizationConfig, SDP4Bit's collectives run inside the PaRO groups: gradient
reduce-scatters through ``collectives.two_level_reduce_scatter`` (one-hop paths for intra / inter,
TLq for global) and the post-step parameter sync as qWD with the codes forwarded hop by hop
(:func:`quantization_support_error` lists what is supported).
"""

from __future__ import annotations

import contextlib
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


class ParoDataParallel(torch.nn.Module):
    """Data parallelism with PaRO partition levels for parameters, gradients and optimizer input.

    ``module`` is one model chunk (GPTModel or its Float16Module); ``groups`` a
    :class:`~megatron.distributed.quant.topology.TwoLevelGroups` from
    :func:`.paro.build_paro_groups` (DP rank r = group * m + local). ``grad_dtype`` is the dtype of
    gradient accumulation and reduction (fp32 for bf16 training, like megatron-core's
    ``grad_reduce_in_fp32``). The object mimics what megatron-core's schedule and our trainer read
    from a DDP chunk: ``module``, ``config``, ``no_sync``, ``zero_grad_buffer`` and
    ``finalize_model_grads`` (to be set as ``config.finalize_model_grads_func``).
    """

    def __init__(self, config: Any, module: torch.nn.Module, strategy: PaRoStrategy, groups: Any,
                 grad_dtype: Optional[torch.dtype] = None, quant_config: Any = None,
                 seed: int = 1234) -> None:
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
        self.params: List[torch.nn.Parameter] = [p for _, p in named]
        slots, offset = [], 0
        for name, p in named:
            slots.append(_Slot(name, offset, p.numel(), p.shape))
            offset += p.numel()
        self.slots: List[_Slot] = slots
        self.num_params = offset
        device = self.params[0].device
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
        self.padded_numel = -(-offset // unit) * unit
        S = self.padded_numel

        # Full flat parameter buffer; the parameters become views into it.
        self.param_buffer = torch.zeros(S, dtype=self.param_dtype, device=device)
        with torch.no_grad():
            for slot, p in zip(slots, self.params):
                view = self.param_buffer[slot.offset:slot.offset + slot.numel].view(slot.shape)
                view.copy_(p.data)
                p.data = view
        p_level = strategy.params
        self.param_shard: Optional[torch.Tensor] = None
        if p_level != Level.N:
            a, b = self.level_range(p_level)
            self.param_shard = self.param_buffer[a:b].clone()
        self._gathered = True
        self.release_params()

        # Gradients: persistent full buffer (g = N) or persistent shard accumulator (g = I / G).
        self.grad_buffer: Optional[torch.Tensor] = None
        self.grad_shard: Optional[torch.Tensor] = None
        if strategy.grads == Level.N:
            self.grad_buffer = torch.zeros(S, dtype=self.grad_dtype, device=device)
        else:
            a, b = self.level_range(strategy.grads)
            self.grad_shard = torch.zeros(b - a, dtype=self.grad_dtype, device=device)
        self._tmp_grad: Optional[torch.Tensor] = None
        self.peak_bytes = 0
        """Largest parameter + gradient bytes resident at once (whole-model gathers and the
        temporary full gradient of g = I / G raise it above the persistent figure)."""
        self._track_peak()
        self.main_grad: Optional[torch.Tensor] = None
        """fp32 gradient at the optimizer-state level, DP-averaged (set by finalize_model_grads)."""
        self._in_backward = False
        self._pre_backward_done = False
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._make_grad_hook(i))

    # ------------------------------------------------------------------ layout
    def level_range(self, level: Level) -> Tuple[int, int]:
        """[start, end) of this rank's shard at ``level`` in the flat buffer."""
        S = self.padded_numel
        if level == Level.N:
            return 0, S
        i_start = self.local * (S // self.m)
        if level == Level.I:
            return i_start, i_start + S // self.m
        g_start = i_start + self.group_index * (S // self.n)
        return g_start, g_start + S // self.n

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
    def _ag(self, out: torch.Tensor, inp: torch.Tensor, scope: str) -> None:
        """All-gather at 'intra' / 'inter' scope ('inter' works on the 1/m slice), counted."""
        group, k = (self.intra_group, self.m) if scope == "intra" else (self.inter_group, self.g)
        if k == 1:
            out.copy_(inp)
            return
        _all_gather(out, inp.contiguous(), group)
        _count(self.counter, scope, "all_gather", out.numel(), out, k)

    def _rs(self, out: torch.Tensor, inp: torch.Tensor, scope: str) -> None:
        """Reduce-scatter of gradients at 'intra' / 'inter' scope (SUM), counted; TLq's one-hop
        path with --quantized-gradients."""
        group, k = (self.intra_group, self.m) if scope == "intra" else (self.inter_group, self.g)
        if k == 1:
            out.copy_(inp)
            return
        if self.quant is not None and self.quant.quantized_gradients:
            self._quantized_rs(out, inp, scope)
            return
        _reduce_scatter(out, inp.contiguous(), group, dist.ReduceOp.SUM)
        _count(self.counter, scope, "reduce_scatter", inp.numel(), inp, k)

    def _ar(self, t: torch.Tensor, scope: str) -> None:
        group, k = (self.intra_group, self.m) if scope == "intra" else (self.inter_group, self.g)
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
        """
        from .accounting import CommAccounting
        from .collectives import two_level_reduce_scatter

        q = self.quant
        groups = self._tl_groups[scope]
        if groups.dp_size == 1:
            out.copy_(inp)
            return
        x = inp.reshape(-1)
        if scope == "global":
            x = x.view(self.m, self.g, -1).transpose(0, 1).contiguous().view(-1)
        acc = CommAccounting()
        two_level_reduce_scatter(
            x.contiguous(), out, groups, bits_intra=q.gradient_quantization_bits_intra,
            group_size_intra=q.gq_group_size_intra, bits_inter=q.gradient_quantization_bits_inter,
            group_size_inter=q.gq_group_size_inter, hadamard=q.hadamard_transform,
            hadamard_block=q.hadamard_block_size, generator=self.quant_generator,
            stochastic=q.stochastic_rounding, accounting=acc)
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
            group, k = (self.intra_group, self.m) if scope == "intra" else (self.inter_group, self.g)
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

    # ------------------------------------------------------------------ parameters
    def _materialize(self) -> None:
        storage = self.param_buffer.untyped_storage()
        need = self.padded_numel * self.param_buffer.element_size()
        if storage.nbytes() != need:
            storage.resize_(need)

    @torch.no_grad()
    def gather_params(self) -> None:
        """Rebuild the full parameter buffer from the shards (collective; no-op for p = N)."""
        if self._gathered:
            return
        self._materialize()
        if self.strategy.params == Level.I:
            self._ag(self.param_buffer, self.param_shard, "intra")
        else:
            self._global_ag(self.param_buffer, self.param_shard)
        self._gathered = True
        self._track_peak()

    def release_params(self) -> None:
        """Free the full parameter buffer's storage (p = I / G); the views stay valid."""
        if self.strategy.params == Level.N or not self._gathered:
            return
        self.param_buffer.untyped_storage().resize_(0)
        self._gathered = False

    @contextlib.contextmanager
    def full_params(self, writeback: bool = False) -> Iterator[None]:
        """Full parameters inside the block (collective); with ``writeback`` the block's changes
        (e.g. ``load_state_dict``) are copied back into this rank's shard before releasing."""
        self.gather_params()
        try:
            yield
        finally:
            if writeback and self.param_shard is not None:
                a, b = self.level_range(self.strategy.params)
                self.param_shard.copy_(self.param_buffer[a:b])
            self.release_params()

    def param_level_storage(self) -> torch.Tensor:
        """The persistent parameter tensor at the p level (full buffer for N, else the shard)."""
        return self.param_buffer if self.param_shard is None else self.param_shard

    def params_at_level(self, level: Level) -> torch.Tensor:
        """This rank's parameters at ``level`` >= p (a view, no communication)."""
        a, b = self.level_range(level)
        pa, _ = self.level_range(self.strategy.params)
        return self.param_level_storage()[a - pa:b - pa]

    @torch.no_grad()
    def sync_params(self, os_params: torch.Tensor) -> None:
        """After the optimizer step: spread the updated os-level shard to the p level (spec §3,
        phase 4 -- copy, inter AG, intra AG or global AG)."""
        o, p = self.strategy.optim, self.strategy.params
        if o != p and self.quant is not None and self.quant.quantized_weights:
            hops, target, offset = {
                (Level.G, Level.I): (["inter"], self.param_shard, self.group_index * (self.padded_numel // self.n)),
                (Level.G, Level.N): (["inter", "intra"], self.param_buffer, self.level_range(Level.G)[0]),
                (Level.I, Level.N): (["intra"], self.param_buffer, self.level_range(Level.I)[0]),
            }[(o, p)]
            self._quantized_param_sync(os_params, target, offset, hops)
            return
        src = os_params.to(self.param_dtype)
        if o == p:
            self.param_level_storage().copy_(src)
        elif (o, p) == (Level.G, Level.I):
            self._ag(self.param_shard, src, "inter")
        elif (o, p) == (Level.G, Level.N):
            self._global_ag(self.param_buffer, src)
        elif (o, p) == (Level.I, Level.N):
            self._ag(self.param_buffer, src, "intra")
        else:  # pragma: no cover - excluded by the validity rule
            raise AssertionError(f"os level {o.name} coarser than p level {p.name}")

    # ------------------------------------------------------------------ forward / backward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.gather_params()
        out = self.module(*args, **kwargs)
        if self.strategy.params != Level.N and torch.is_grad_enabled():
            self._pre_backward_done = False
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self._pre_backward_hook)
        self.release_params()
        return out

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        """Gradient of the model output arrived: the backward of this chunk starts now."""
        if not self._pre_backward_done:
            self._pre_backward_done = True
            self._begin_backward()
            self.gather_params()

    def _begin_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        if self.grad_buffer is None:  # g = I / G: full gradients only for this backward
            self._tmp_grad = torch.zeros(self.padded_numel, dtype=self.grad_dtype,
                                         device=self.param_buffer.device)
            self._track_peak()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _make_grad_hook(self, index: int):
        slot = self.slots[index]

        def hook(param: torch.Tensor) -> None:
            if param.grad is None:
                return
            self._begin_backward()
            full = self.grad_buffer if self.grad_buffer is not None else self._tmp_grad
            full[slot.offset:slot.offset + slot.numel].view(slot.shape).add_(param.grad)
            param.grad = None

        return hook

    @torch.no_grad()
    def _end_backward(self) -> None:
        """End of one micro-step's backward: reduce-scatter g = I / G gradients, free buffers."""
        if self.grad_buffer is None:
            full = self._tmp_grad
            self._tmp_grad = None
            if self.strategy.grads == Level.I:
                shard = torch.empty_like(self.grad_shard)
                self._rs(shard, full, "intra")
            else:
                shard = self._global_rs(full)
            del full
            self.grad_shard.add_(shard)
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
            out = torch.empty(src.numel() // self.m, dtype=src.dtype, device=src.device)
            self._rs(out, src, "intra")
            self._ar(out, "inter")
        elif (g, o) == (Level.N, Level.G):
            out = self._global_rs(src)
        elif (g, o) == (Level.I, Level.I):
            out = src.clone()
            self._ar(out, "inter")
        elif (g, o) == (Level.I, Level.G):
            out = torch.empty(src.numel() // self.g, dtype=src.dtype, device=src.device)
            self._rs(out, src, "inter")
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
        params = self.param_buffer.untyped_storage().nbytes()
        if self.param_shard is not None:
            params += self.param_shard.untyped_storage().nbytes()
        grads = 0
        for t in (self.grad_buffer, self.grad_shard, getattr(self, "_tmp_grad", None)):
            if t is not None:
                grads += t.untyped_storage().nbytes()
        return {"params": params, "grads": grads}


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
        a, b = engine.level_range(o)
        self.master = torch.nn.Parameter(engine.params_at_level(o).detach().float().clone())
        self.decay_mask = engine.weight_decay_mask()[a:b].to(self.master.device)
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
