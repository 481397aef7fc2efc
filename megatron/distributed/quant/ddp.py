"""Quantized communication wired into megatron-core 0.16.1's DDP (subclasses, no fork).

What is overridden, and why (everything else is megatron-core's own code):

* :class:`QuantizedParamAndGradBuffer` (subclass of ``_ParamAndGradBuffer``) only changes bucket
  *padding*. megatron-core pads every bucket end to ``lcm(data_parallel_world_size, 128)`` inside a
  closure of ``__init__`` that reads ``self.data_parallel_world_size`` at call time. While the
  layout is computed we report ``P * m`` there (``m`` = the quantizers' group-size requirement),
  so every bucket holds whole quantization groups per DP shard; afterwards the attribute is the
  real ``P`` again. A post-construction assertion catches a megatron-core change that would
  silently defeat this.
* :class:`QuantizedBucketGroup` (subclass of ``_ParamAndGradBucketGroup``; existing instances get
  their ``__class__`` swapped after ``DistributedDataParallel.__init__``) overrides
  ``start_grad_sync`` (quantized two-level reduce-scatter, TLq/TLq-HS, LoCo) and
  ``start_param_sync`` (qWD / qW all-gather). Each override first decides whether the quantized
  path applies; if not it calls ``super()`` unchanged. ``finish_grad_sync`` /
  ``finish_param_sync`` are megatron-core's: they only call ``.wait()`` on the handle we store.
  With ``--overlap-grad-reduce`` / ``--overlap-param-gather`` (or ``--gradient-alltoall-pipeline``
  > 1) the collectives run on the runtime's communication stages (:mod:`.streams`) behind that
  handle; otherwise inline.
* :class:`QuantizedDistributedDataParallel` (subclass of ``DistributedDataParallel``) builds the
  buffers through the subclass above (megatron-core has no buffer-class hook, so the module-level
  name ``_ParamAndGradBuffer`` of ``distributed_data_parallel`` is swapped for the duration of
  ``super().__init__`` only), then swaps the bucket-group class and attaches the runtime.
* :func:`install_optimizer_hooks` wraps two methods of the megatron-core optimizer instance:
  ``DistributedOptimizer._copy_main_params_to_model_params`` (take a copy of this rank's shard of
  the reconstructed weights before it is overwritten: in megatron-core 0.16 model params *are*
  views of the param buffer, so qWD's reference for the own shard would otherwise be lost) and
  ``prepare_grads`` of the top-level optimizer (report non-finite quantized gradients as
  ``found_inf`` so the step is skipped even for bf16 runs without a grad scaler).

The state the bucket groups of a model share (config, two-level groups, generators, LoCo,
accounting, timing, the NaN/Inf agreement) is :class:`~.runtime.QuantizationRuntime`.

Gradient pre-scaling (``gradient_scaling_factor``) is applied exactly as megatron-core does it,
before quantization; with ``average_in_collective`` (megatron-core uses ``ReduceOp.AVG``) the
quantized SUM is divided by P afterwards.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import distributed_data_parallel as _mcore_ddp_module
from megatron.core.distributed.param_and_grad_buffer import (
    _ParamAndGradBuffer,
    _ParamAndGradBucketGroup,
    shard_buffer,
)
from megatron.core.transformer import TransformerConfig

from .collectives import (
    quantized_all_gather,
    required_padding_multiple_from_config,
    two_level_reduce_scatter,
)
from .config import QuantizationConfig
from .runtime import QuantizationRuntime, build_runtime
from .streams import CommTiming

__all__ = [
    "QuantizationRuntime", "QuantizedParamAndGradBuffer", "QuantizedBucketGroup",
    "QuantizedDistributedDataParallel", "install_optimizer_hooks", "build_runtime",
]

GRAD_EXACT = "grad_reduce_scatter_exact"
WEIGHT_EXACT = "weight_all_gather_exact"

# Seed offsets: one generator per (rank, bucket, direction) so that the rounding stream of a
# bucket does not depend on the order in which buckets happen to be reduced (overlap vs. no
# overlap give identical numerics) nor on whether the other direction is quantized.
_SEED_RANK_STRIDE = 1_000_003
_SEED_BUCKET_STRIDE = 7_919
_SEED_WEIGHT_OFFSET = 104_729
_CHUNK_BUCKET_STRIDE = 10_000


# ------------------------------------------------------------------------------------------------
# buffer: quantization-aware padding only
# ------------------------------------------------------------------------------------------------

class QuantizedParamAndGradBuffer(_ParamAndGradBuffer):
    """``_ParamAndGradBuffer`` whose buckets are padded to a multiple of ``P * m``.

    ``m`` (``pad_multiple // P``) comes from :func:`required_padding_multiple_from_config`.
    Implementation: megatron-core's padding closure uses ``self.data_parallel_world_size`` as the
    sharding granularity; during ``__init__`` this property returns the padded granularity, after
    it the real world size (see module docstring).
    """

    _layout_granularity: int = 1

    def __init__(self, *args: Any, pad_multiple: int, **kwargs: Any) -> None:
        self._pad_multiple = int(pad_multiple)
        self._in_layout = True
        try:
            super().__init__(*args, **kwargs)
        finally:
            self._in_layout = False
        if self.ddp_config.use_distributed_optimizer:
            for bucket in self.buckets:
                n = bucket.grad_data.numel()
                if n % self._pad_multiple:
                    raise RuntimeError(
                        f"bucket {bucket.bucket_id} has {n} elements, not a multiple of "
                        f"{self._pad_multiple}: megatron-core's padding no longer goes through "
                        "data_parallel_world_size; update QuantizedParamAndGradBuffer")

    @property
    def data_parallel_world_size(self) -> int:  # type: ignore[override]
        real = self.__dict__["_real_dp_world_size"]
        if self.__dict__.get("_in_layout", False):
            return math.lcm(real, self._pad_multiple)
        return real

    @data_parallel_world_size.setter
    def data_parallel_world_size(self, value: int) -> None:
        self.__dict__["_real_dp_world_size"] = int(value)


@contextlib.contextmanager
def _buffer_class(pad_multiple: int) -> Iterator[None]:
    """Make ``DistributedDataParallel.__init__`` build :class:`QuantizedParamAndGradBuffer`.

    megatron-core looks the class up as a module global of ``distributed_data_parallel``; we swap
    that name only while our own ``super().__init__`` runs (single-threaded construction).
    """
    original = _mcore_ddp_module._ParamAndGradBuffer

    def factory(*args: Any, **kwargs: Any) -> QuantizedParamAndGradBuffer:
        return QuantizedParamAndGradBuffer(*args, pad_multiple=pad_multiple, **kwargs)

    _mcore_ddp_module._ParamAndGradBuffer = factory
    try:
        yield
    finally:
        _mcore_ddp_module._ParamAndGradBuffer = original


# ------------------------------------------------------------------------------------------------
# bucket group: quantized reduce-scatter / all-gather
# ------------------------------------------------------------------------------------------------

class _PendingBuckets:
    """The handle megatron-core's ``finish_grad_sync`` / ``finish_param_sync`` wait on: the
    quantized collectives of one bucket group (their time waited counts as exposed), then an
    optional post-processing step (the AVG division). Idempotent."""

    def __init__(self, pending: List[Any], timing: CommTiming, kind: str,
                 finish: Optional[Callable[[], None]] = None) -> None:
        self._pending = pending
        self._timing = timing
        self._kind = kind
        self._finish = finish
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        for h in self._pending:
            self._timing.wait(self._kind, h)
        self._done = True
        if self._finish is not None:
            self._finish()


class QuantizedBucketGroup(_ParamAndGradBucketGroup):
    """Bucket group whose collectives go through the quantized path when it applies.

    Instances are created by megatron-core as ``_ParamAndGradBucketGroup`` and converted with
    :meth:`convert` (``__class__`` swap + extra attributes): megatron-core's bookkeeping
    (ready counts, handles, ``next_param_gather_bucket_group``) stays untouched.
    """

    runtime: QuantizationRuntime
    _reference_shards: List[Optional[torch.Tensor]]

    @classmethod
    def convert(cls, group: _ParamAndGradBucketGroup, runtime: QuantizationRuntime,
                key_prefix: str, bucket_index_base: int) -> "QuantizedBucketGroup":
        if not group.ddp_config.use_distributed_optimizer:
            raise ValueError("quantized communication needs --use-distributed-optimizer "
                             "(reduce-scatter + all-gather buckets)")
        if group.ddp_config.num_distributed_optimizer_instances != 1:
            raise ValueError("quantized communication supports num_distributed_optimizer_instances=1")
        members = list(dist.get_process_group_ranks(group.intra_distributed_optimizer_instance_group))
        if members != list(runtime.groups.dp_ranks):
            raise ValueError(f"bucket group's DP group {members} does not match the two-level "
                             f"groups' {runtime.groups.dp_ranks}")
        group.__class__ = cls
        group.runtime = runtime
        group._key_prefix = key_prefix
        group._bucket_index_base = bucket_index_base
        group._reference_shards = [None] * len(group.buckets)
        group._updated = [False] * len(group.buckets)
        group._reference_hook_installed = False
        runtime.bucket_groups.append(group)
        # Create the generators now so that checkpoint loading finds them before first use.
        for idx in range(len(group.buckets)):
            group._grad_generator(idx)
            group._weight_generator(idx)
        return group

    # -- helpers ------------------------------------------------------------------------------
    def _bucket_key(self, idx: int) -> str:
        return f"{self._key_prefix}/bucket{self._bucket_index_base + idx}"

    def _seed(self, idx: int) -> int:
        rt = self.runtime
        return (rt.config.seed + _SEED_RANK_STRIDE * rt.groups.dp_rank
                + _SEED_BUCKET_STRIDE * (self._bucket_index_base + idx + 1))

    def _grad_generator(self, idx: int) -> torch.Generator:
        return self.runtime.generator("grad/" + self._bucket_key(idx), self._seed(idx))

    def _weight_generator(self, idx: int) -> torch.Generator:
        return self.runtime.generator("weight/" + self._bucket_key(idx),
                                      self._seed(idx) + _SEED_WEIGHT_OFFSET)

    def _grad_shard(self, idx: int) -> torch.Tensor:
        if self.cached_grad_buffer_shard_list[idx] is None:
            self.cached_grad_buffer_shard_list[idx] = shard_buffer(
                self.buckets[idx].grad_data, self.intra_distributed_optimizer_instance_size)
        return self.cached_grad_buffer_shard_list[idx][self.intra_distributed_optimizer_instance_rank]

    def _param_shard(self, idx: int) -> torch.Tensor:
        if self.cached_param_buffer_shard_list[idx] is None:
            self.cached_param_buffer_shard_list[idx] = shard_buffer(
                self.buckets[idx].param_data, self.intra_distributed_optimizer_instance_size)
        return self.cached_param_buffer_shard_list[idx][self.intra_distributed_optimizer_instance_rank]

    # -- gradients ----------------------------------------------------------------------------
    def start_grad_sync(self, force_all_reduce: Optional[bool] = False) -> None:
        """Quantized two-level reduce-scatter of every bucket (TLq[-HS], LoCo), else mcore's."""
        rt = self.runtime
        if force_all_reduce or not rt.quantize_gradients_now:
            if self.is_first_batch and self.grad_reduce_handle is not None:
                return
            if not force_all_reduce:
                for bucket in self.buckets:
                    rt.record_exact(GRAD_EXACT, "grad", bucket.grad_data.numel(),
                                    bucket.grad_data.element_size())
            super().start_grad_sync(force_all_reduce=force_all_reduce)
            return

        # --- same preamble as megatron-core's start_grad_sync ---------------------------------
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return
        assert self.grad_reduce_handle is None, \
            "Should not have multiple communication calls outstanding at once"
        if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
            self.check_grads(check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,
                             check_for_large=self.ddp_config.check_for_large_grads)
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
        # -------------------------------------------------------------------------------------

        cfg = rt.config
        overlap = bool(self.ddp_config.overlap_grad_reduce)
        pipelined = cfg.gradient_alltoall_pipeline > 1
        # Overlap, or a pipelined bucket (its intra and inter hops overlap each other), runs on
        # the stages of runtime.overlap_streams; otherwise every step runs inline, here.
        streams = (rt.overlap_streams(self.buckets[0].grad_data.device)
                   if overlap or pipelined else rt.timing.inline)
        pending: List[Any] = []
        for idx, bucket in enumerate(self.buckets):
            shard = self._grad_shard(idx)
            ef = rt.loco.bucket(self._bucket_key(idx)) if rt.loco is not None else None
            # NaN/Inf: noted on the device, agreed once per step in prepare_grads (no host sync
            # per bucket); a poisoned group reaches the shard as NaN, never as finite values.
            handle = two_level_reduce_scatter(
                bucket.grad_data, shard, rt.groups,
                bits_intra=cfg.gradient_quantization_bits_intra,
                group_size_intra=cfg.gq_group_size_intra,
                bits_inter=cfg.gradient_quantization_bits_inter,
                group_size_inter=cfg.gq_group_size_inter,
                hadamard=cfg.hadamard_transform, hadamard_block=cfg.hadamard_block_size,
                generator=self._grad_generator(idx), stochastic=cfg.stochastic_rounding,
                accounting=rt.accounting, error_feedback=ef, async_op=True,
                nonfinite_flag=rt.nonfinite_flag(bucket.grad_data.device),
                pipeline=cfg.gradient_alltoall_pipeline, streams=streams)
            if handle is not None:
                pending.append(handle)

        average = bool(self.ddp_config.average_in_collective)

        def finish() -> None:
            if average:  # megatron-core uses ReduceOp.AVG; the quantized collective returns SUM
                for idx in range(len(self.buckets)):
                    self._grad_shard(idx).div_(self.intra_distributed_optimizer_instance_size)

        handle = _PendingBuckets(pending, rt.timing, "grad", finish)
        if overlap:
            self.grad_reduce_handle = handle    # megatron-core's finish_grad_sync waits on it
        else:
            handle.wait()
            self.grad_reduce_handle = None

    # -- weights ------------------------------------------------------------------------------
    def snapshot_reference_shards(self) -> None:
        """Mark the buckets as updated and, for qWD, keep this rank's shard of the reconstructed
        weights before the optimizer overwrites it.

        Called right before ``DistributedOptimizer._copy_main_params_to_model_params``. A snapshot
        that was not consumed yet (no gather since) is kept: it is still the true reference."""
        self._reference_hook_installed = True
        if not self.runtime.quantize_weights:
            return
        diff = self.runtime.config.weight_quantization_mode == "diff"
        for idx in range(len(self.buckets)):
            if diff and self._reference_shards[idx] is None:
                self._reference_shards[idx] = self._param_shard(idx).detach().clone()
            self._updated[idx] = True

    def start_param_sync(self, force_sync: bool = False) -> None:
        """Quantized all-gather (qWD / qW) of every bucket, else megatron-core's exact one."""
        rt = self.runtime
        if not rt.quantize_weights:
            if not (force_sync and self.param_gather_handle is not None):
                for bucket in self.buckets:
                    rt.record_exact(WEIGHT_EXACT, "weight", bucket.param_data.numel(),
                                    bucket.param_data.element_size())
            super().start_param_sync(force_sync=force_sync)
            return

        assert self.ddp_config.use_distributed_optimizer
        if force_sync:
            if self.param_gather_handle is not None:
                self.param_gather_handle.wait()
                self.param_gather_handle = None
                return
        else:
            assert self.param_gather_handle is None

        cfg = rt.config
        diff = cfg.weight_quantization_mode == "diff"
        if diff and not self._reference_hook_installed:
            raise RuntimeError("qWD needs the optimizer hook: call integration.on_optimizer_built "
                               "(install_optimizer_hooks) after building the optimizer")
        group = self.intra_distributed_optimizer_instance_group
        overlap = self.ddp_config.overlap_param_gather and not force_sync
        # Overlapped: quantize, all-gather and dequantize-add run on the weights stage while the
        # forward of the previous bucket group computes; megatron-core's finish_param_sync
        # waits on the handle right before this group's first layer runs.
        streams = (rt.overlap_streams(self.buckets[0].param_data.device) if overlap
                   else rt.timing.inline)
        pending: List[Any] = []
        for idx, bucket in enumerate(self.buckets):
            if not self._updated[idx]:
                # No optimizer update reached this bucket since its last gather (first forward,
                # skipped step, forced re-sync): every replica already holds the same
                # reconstructed weights, and re-quantizing them would only add noise. The
                # condition follows the global training flow, so all ranks skip together.
                continue
            shard = self._param_shard(idx)
            new = shard.detach().clone()
            ref = self._reference_shards[idx]
            if diff and ref is not None:
                shard.copy_(ref)  # the buffer is now W~_old on every rank
            # Non-finite master weights reach every replica as NaN, as megatron-core's exact
            # gather would spread them; noted on the device, reported at the next agreement.
            pending.append(quantized_all_gather(
                new, bucket.param_data if diff else None, bucket.param_data, group,
                mode=cfg.weight_quantization_mode, bits=cfg.weight_quantization_bits,
                group_size=cfg.wq_group_size, generator=self._weight_generator(idx),
                stochastic=cfg.stochastic_rounding, accounting=rt.accounting,
                link_of_peer=rt.groups.link_of_peer,
                nonfinite_flag=rt.nonfinite_flag(bucket.param_data.device),
                async_op=True, streams=streams))
            self._reference_shards[idx] = None
            self._updated[idx] = False

        # megatron-core's finish_param_sync only dispatches the next bucket group's gather after
        # waiting on a handle, so an overlapped sync always leaves one (possibly with no work).
        handle = _PendingBuckets(pending, rt.timing, "weight")
        if not overlap:
            handle.wait()
        self.param_gather_handle = handle if overlap else None
        self.param_gather_dispatched = True


# ------------------------------------------------------------------------------------------------
# DDP subclass
# ------------------------------------------------------------------------------------------------

class QuantizedDistributedDataParallel(DistributedDataParallel):
    """megatron-core DDP whose dense bucket groups communicate quantized (see module docstring).

    Expert-parallel buffers (MoE) keep megatron-core's exact collectives.
    """

    def __init__(self, config: TransformerConfig, ddp_config: DistributedDataParallelConfig,
                 module: torch.nn.Module, quant_config: QuantizationConfig,
                 disable_bucketing: bool = False, runtime: Optional[QuantizationRuntime] = None,
                 chunk_id: int = 0, **kwargs: Any) -> None:
        if not ddp_config.use_distributed_optimizer:
            raise ValueError("quantized communication (--quantized-weights / --quantized-gradients) "
                             "requires --use-distributed-optimizer")
        if runtime is None:
            runtime = build_runtime(quant_config)
        pad = required_padding_multiple_from_config(runtime.config, runtime.groups.dp_size,
                                                    runtime.groups.intra_size)
        with _buffer_class(pad):
            super().__init__(config=config, ddp_config=ddp_config, module=module,
                             disable_bucketing=disable_bucketing, **kwargs)
        self.quant_runtime = runtime
        self.quant_chunk_id = chunk_id
        base = chunk_id * _CHUNK_BUCKET_STRIDE  # bucket indices unique across chunks (seeds, keys)
        converted = []
        for gi, bg in enumerate(self.bucket_groups):
            converted.append(QuantizedBucketGroup.convert(bg, runtime, f"chunk{chunk_id}", base))
            base += len(bg.buckets)
        self.bucket_groups = converted
        # param_to_bucket_group holds the same objects (class swapped in place): nothing to remap.

    def quantized_bucket_groups(self) -> List[QuantizedBucketGroup]:
        return [bg for bg in self.bucket_groups if isinstance(bg, QuantizedBucketGroup)]


# ------------------------------------------------------------------------------------------------
# optimizer hooks
# ------------------------------------------------------------------------------------------------

def _leaf_optimizers(optimizer: Any) -> List[Any]:
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return [optimizer]
    out: List[Any] = []
    for opt in chained:
        out.extend(_leaf_optimizers(opt))
    return out


def install_optimizer_hooks(optimizer: Any, model_chunks: Sequence[torch.nn.Module]) -> None:
    """Attach the quantized path to a megatron-core optimizer (idempotent).

    * every leaf optimizer's ``_copy_main_params_to_model_params``: snapshot the qWD reference
      shard of every quantized bucket first;
    * the top-level ``prepare_grads``: OR in the device-side non-finite flag of the quantized
      collectives, agreed over all ranks (one scalar all-reduce and the one host sync of the
      quantized path per step), so megatron-core skips the step (``step()`` returns
      ``(False, None, None)``).
    """
    qddps = [c for c in model_chunks if isinstance(c, QuantizedDistributedDataParallel)]
    if not qddps:
        return
    groups = [bg for m in qddps for bg in m.quantized_bucket_groups()]
    runtimes = list({id(m.quant_runtime): m.quant_runtime for m in qddps}.values())

    for bg in groups:
        bg._reference_hook_installed = True
    for opt in _leaf_optimizers(optimizer):
        cfg = getattr(opt, "config", None)
        if (cfg is not None and getattr(cfg, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
                and any(rt.quantize_weights and rt.config.weight_quantization_mode == "diff"
                        for rt in runtimes)):
            # That optimizer writes the model params itself inside step(), before our snapshot.
            raise ValueError("qWD (--quantized-weights, mode diff) does not support megatron-core's "
                             "precision-aware optimizer")
        orig = getattr(opt, "_copy_main_params_to_model_params", None)
        if orig is None or getattr(orig, "_quant_hook", False):
            continue

        def copy_with_snapshot(_orig: Callable[[], None] = orig) -> None:
            for bg in groups:
                bg.snapshot_reference_shards()
            _orig()

        copy_with_snapshot._quant_hook = True  # type: ignore[attr-defined]
        opt._copy_main_params_to_model_params = copy_with_snapshot

    if groups:
        orig_prepare = optimizer.prepare_grads
        if not getattr(orig_prepare, "_quant_hook", False):

            device = groups[0].buckets[0].grad_data.device

            def prepare_grads_with_nonfinite() -> bool:
                found_inf = bool(orig_prepare())
                nonfinite = [rt.agree_nonfinite(device) for rt in runtimes]  # one sync each
                return found_inf or any(nonfinite)

            prepare_grads_with_nonfinite._quant_hook = True  # type: ignore[attr-defined]
            optimizer.prepare_grads = prepare_grads_with_nonfinite
