"""Quantized communication wired into megatron-core 0.16.1's DDP (subclasses, no fork).

Overridden (all else is megatron-core's code, touched only through :mod:`.mcore_compat`):
bucket padding (whole quantization groups per DP shard), :class:`QuantizedBucketGroup`'s
``start_grad_sync`` / ``start_param_sync`` (falling back to ``super()`` when the quantized path does
not apply), and two optimizer hooks (:func:`install_optimizer_hooks`). The communication itself is
the model's :class:`~.runtime.QuantizationRuntime`; this module decides when, on which buffers.
See "Inside megatron-core's DDP (ddp.py)" in docs/architecture.md.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig

from megatron.distributed.mcore_compat import ddp_buckets
from megatron.distributed.mcore_compat.optimizer import (leaf_optimizers, wrap_copy_main_params_to_model_params,
                                     wrap_prepare_grads, writes_model_params_in_step)
from .collectives.common import PendingCollective, required_padding_multiple_from_config
from .config import QuantizationConfig
from .runtime import QuantizationRuntime, build_runtime

__all__ = ["QuantizedBucketGroup", "QuantizedDistributedDataParallel", "install_optimizer_hooks"]

GRAD_EXACT = "grad_reduce_scatter_exact"
WEIGHT_EXACT = "weight_all_gather_exact"

_CHUNK_BUCKET_STRIDE = 10_000
_EXPERT_BUCKET_OFFSET = 5_000
"""Expert buckets' indices start here within a chunk's stride (their seeds differ from the
dense buckets')."""


# ------------------------------------------------------------------------------------------------
# bucket group: quantized reduce-scatter / all-gather
# ------------------------------------------------------------------------------------------------

class QuantizedBucketGroup(ddp_buckets.ParamAndGradBucketGroup):
    """Bucket group whose collectives go through the quantized path when it applies.

    Instances are created by megatron-core and converted with :meth:`convert`
    (:func:`~.mcore_compat.ddp_buckets.adopt_bucket_group` + extra attributes): megatron-core's
    bookkeeping (ready counts, handles, ``next_param_gather_bucket_group``) stays untouched. Each
    bucket is one buffer of the model's :class:`~.runtime.QuantizationRuntime`, which does the
    communication; this class only decides when, on which tensors, and stores the handle.
    """

    runtime: QuantizationRuntime

    @classmethod
    def convert(cls, group: ddp_buckets.ParamAndGradBucketGroup, runtime: QuantizationRuntime,
                key_prefix: str, bucket_index_base: int) -> "QuantizedBucketGroup":
        if group.ddp_config.num_distributed_optimizer_instances != 1:
            raise ValueError("quantized communication supports num_distributed_optimizer_instances=1")
        members = list(dist.get_process_group_ranks(ddp_buckets.dp_instance_group(group)))
        if members != list(runtime.groups.dp_ranks):
            raise ValueError(f"bucket group's DP group {members} does not match the two-level "
                             f"groups' {runtime.groups.dp_ranks}")
        ddp_buckets.adopt_bucket_group(group, cls)
        group.runtime = runtime
        group._key_prefix = key_prefix
        group._bucket_index_base = bucket_index_base
        group._reference_hook_installed = False
        for idx in range(len(group.buckets)):
            runtime.register(group._bucket_key(idx), group._bucket_index(idx),
                             group.buckets[idx].grad_data.numel())
        return group

    # -- helpers ------------------------------------------------------------------------------
    def _bucket_key(self, idx: int) -> str:
        return f"{self._key_prefix}/bucket{self._bucket_index_base + idx}"

    def _bucket_index(self, idx: int) -> int:
        return self._bucket_index_base + idx

    def _grad_shard(self, idx: int) -> torch.Tensor:
        return ddp_buckets.bucket_grad_shard(self, idx)

    def _param_shard(self, idx: int) -> torch.Tensor:
        return ddp_buckets.bucket_param_shard(self, idx)

    # -- gradients ----------------------------------------------------------------------------
    def start_grad_sync(self, force_all_reduce: Optional[bool] = False) -> None:
        """Quantized two-level reduce-scatter of every bucket (TLq[-HS], LoCo), else mcore's."""
        rt = self.runtime
        if force_all_reduce or not rt.quantize_gradients_now:
            if ddp_buckets.grad_sync_is_noop(self):
                return
            if not force_all_reduce:
                for bucket in self.buckets:
                    rt.record_exact(GRAD_EXACT, "grad", bucket.grad_data.numel(),
                                    bucket.grad_data.element_size())
            super().start_grad_sync(force_all_reduce=force_all_reduce)
            return

        if not ddp_buckets.grad_sync_preamble(self):  # megatron-core's checks and pre-scaling
            return

        overlap = bool(self.ddp_config.overlap_grad_reduce)
        # Overlap, or a pipelined bucket (its intra and inter hops overlap each other), runs on
        # the stages of runtime.overlap_streams; otherwise every step runs inline, here.
        streams = rt.streams(self.buckets[0].grad_data.device,
                             overlap or rt.config.gradient_alltoall_pipeline > 1)
        # NaN/Inf: noted on the device, agreed once per step in prepare_grads (no host sync
        # per bucket); a poisoned group reaches the shard as NaN, never as finite values.
        pending = [rt.reduce_scatter(bucket.grad_data, self._grad_shard(idx),
                                     key=self._bucket_key(idx), index=self._bucket_index(idx),
                                     streams=streams)
                   for idx, bucket in enumerate(self.buckets)]

        average = bool(self.ddp_config.average_in_collective)

        def finish() -> None:
            if average:  # megatron-core uses ReduceOp.AVG; the quantized collective returns SUM
                for idx in range(len(self.buckets)):
                    self._grad_shard(idx).div_(ddp_buckets.dp_instance_size(self))

        handle = PendingCollective.combine(pending, timing=rt.timing, kind="grad", finish=finish)
        if not overlap:
            handle.wait()
        # finish_grad_sync waits
        ddp_buckets.set_grad_reduce_handle(self, handle if overlap else None)

    # -- weights ------------------------------------------------------------------------------
    def snapshot_reference_shards(self) -> None:
        """Mark the buckets as updated and, for qWD, keep this rank's shard of the reconstructed
        weights before the optimizer overwrites it (:meth:`QuantizationRuntime.note_weights_updated`).

        Called right before ``DistributedOptimizer._copy_main_params_to_model_params``."""
        self._reference_hook_installed = True
        if not self.runtime.quantize_weights:
            return
        for idx in range(len(self.buckets)):
            self.runtime.note_weights_updated(self._bucket_key(idx), self._param_shard(idx))

    def start_param_sync(self, force_sync: bool = False) -> None:
        """Quantized all-gather (qWD / qW) of every bucket, else megatron-core's exact one."""
        rt = self.runtime
        if not rt.quantize_weights:
            if not ddp_buckets.param_sync_is_wait_only(self, force_sync):
                for bucket in self.buckets:
                    rt.record_exact(WEIGHT_EXACT, "weight", bucket.param_data.numel(),
                                    bucket.param_data.element_size())
            super().start_param_sync(force_sync=force_sync)
            return

        if not ddp_buckets.param_sync_preamble(self, force_sync):  # a forced sync that only waited
            return

        if rt.weights_as_difference and not self._reference_hook_installed:
            raise RuntimeError("qWD needs the optimizer hook: call integration.on_optimizer_built "
                               "(install_optimizer_hooks) after building the optimizer")
        overlap = self.ddp_config.overlap_param_gather and not force_sync
        # Overlapped: quantize, all-gather and dequantize-add run on the weights stage while the
        # forward of the previous bucket group computes; megatron-core's finish_param_sync
        # waits on the handle right before this group's first layer runs.
        streams = rt.streams(self.buckets[0].param_data.device, overlap)
        pending: List[Any] = []
        for idx, bucket in enumerate(self.buckets):
            key = self._bucket_key(idx)
            updated, ref = rt.take_update(key)
            if not updated:
                # No optimizer update reached this bucket since its last gather (first forward,
                # skipped step, forced re-sync): every replica already holds the same
                # reconstructed weights, and re-quantizing them would only add noise. The
                # condition follows the global training flow, so all ranks skip together.
                continue
            shard = self._param_shard(idx)
            new = shard.detach().clone()
            if ref is not None:
                shard.copy_(ref)  # the buffer is now W~_old on every rank
            # Non-finite master weights reach every replica as NaN, as megatron-core's exact
            # gather would spread them; noted on the device, reported at the next agreement.
            pending.append(rt.all_gather(new, bucket.param_data, key=key,
                                         index=self._bucket_index(idx),
                                         reference=bucket.param_data, streams=streams))

        # megatron-core's finish_param_sync only dispatches the next bucket group's gather after
        # waiting on a handle, so an overlapped sync always leaves one (possibly with no work).
        handle = PendingCollective.combine(pending, timing=rt.timing, kind="weight")
        if not overlap:
            handle.wait()
        ddp_buckets.set_param_gather_handle(self, handle if overlap else None)


# ------------------------------------------------------------------------------------------------
# DDP subclass
# ------------------------------------------------------------------------------------------------

def weight_quantization_dtype_error(quant_config: QuantizationConfig,
                                    params_dtype: Optional[torch.dtype]) -> Optional[str]:
    """Why quantized weights cannot run on megatron-core's distributed optimizer with
    ``params_dtype`` parameters, or None when they can: with fp32 parameters the optimizer's master
    shard is the parameter buffer the gather overwrites."""
    # See [Note: quantized weights need separate masters] in docs/architecture.md
    if quant_config.quantized_weights and params_dtype == torch.float32:
        return ("--quantized-weights needs --bf16 (or --fp16) on megatron-core's distributed "
                "optimizer: with fp32 parameters the optimizer updates the parameter buffer in "
                "place (no separate fp32 master copy), and the quantized weight gather would "
                "overwrite the master weights. Add --bf16, or use a PaRO engine strategy "
                "(--paro-strategy), which keeps its own fp32 master")
    return None


class QuantizedDistributedDataParallel(DistributedDataParallel):
    """megatron-core DDP whose bucket groups communicate quantized (see module docstring).

    Expert-parallel buffers (MoE, expert parallelism > 1) go through ``expert_runtime``: the
    same collectives over megatron-core's expert-data-parallel group and its own two levels;
    without one (that group has one rank: nothing to send) they keep megatron-core's.
    """

    def __init__(self, config: TransformerConfig, ddp_config: DistributedDataParallelConfig,
                 module: torch.nn.Module, quant_config: QuantizationConfig,
                 disable_bucketing: bool = False, runtime: Optional[QuantizationRuntime] = None,
                 chunk_id: int = 0, expert_runtime: Optional[QuantizationRuntime] = None,
                 **kwargs: Any) -> None:
        if not ddp_config.use_distributed_optimizer:
            raise ValueError("quantized communication (--quantized-weights / --quantized-gradients) "
                             "requires --use-distributed-optimizer")
        # any fp32 parameter lands in the optimizer's in-place fp32 group
        dtypes = {p.dtype for p in module.parameters() if p.requires_grad}
        dtype_error = weight_quantization_dtype_error(
            quant_config, torch.float32 if torch.float32 in dtypes else next(iter(dtypes), None))
        if dtype_error is not None:
            raise ValueError(dtype_error)
        if runtime is None:
            runtime = build_runtime(quant_config)
        pad = required_padding_multiple_from_config(runtime.config, runtime.groups.dp_size,
                                                    runtime.groups.intra_size)
        with ddp_buckets.ddp_buffer_class(pad):
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
        # Kept also on a pipeline stage without MoE layers: every rank then has the same
        # runtimes, and their per-step agreements (collectives) match across ranks.
        self.expert_quant_runtime = expert_runtime
        if expert_runtime is not None and self.expert_parallel_bucket_groups:
            base = chunk_id * _CHUNK_BUCKET_STRIDE + _EXPERT_BUCKET_OFFSET
            converted = []
            for bg in self.expert_parallel_bucket_groups:
                converted.append(QuantizedBucketGroup.convert(
                    bg, self.expert_quant_runtime, f"chunk{chunk_id}/expert", base))
                base += len(bg.buckets)
            self.expert_parallel_bucket_groups = converted
        # param_to_bucket_group holds the same objects (class swapped in place): nothing to remap.

    def quantized_bucket_groups(self) -> List[QuantizedBucketGroup]:
        """Every bucket group on the quantized path, dense ones then expert ones."""
        return [bg for bg in self.bucket_groups + self.expert_parallel_bucket_groups
                if isinstance(bg, QuantizedBucketGroup)]

    def quant_runtimes(self) -> List[QuantizationRuntime]:
        """The dense runtime, then the expert one (when the chunk has quantized expert buffers)."""
        return [self.quant_runtime] + ([self.expert_quant_runtime]
                                       if self.expert_quant_runtime is not None else [])


# ------------------------------------------------------------------------------------------------
# optimizer hooks
# ------------------------------------------------------------------------------------------------

def install_optimizer_hooks(optimizer: Any, model_chunks: Sequence[torch.nn.Module]) -> None:
    """Attach the quantized path to a megatron-core optimizer (idempotent).

    * every leaf optimizer's copy of main params into the model params: snapshot the qWD
      reference shard of every quantized bucket first;
    * the top-level ``prepare_grads``: OR in the device-side non-finite flag of the quantized
      collectives, agreed over all ranks (one scalar all-reduce and the one host sync of the
      quantized path per step), so megatron-core skips the step (``step()`` returns
      ``(False, None, None)``).
    """
    qddps = [c for c in model_chunks if isinstance(c, QuantizedDistributedDataParallel)]
    if not qddps:
        return
    groups = [bg for m in qddps for bg in m.quantized_bucket_groups()]
    runtimes = list({id(rt): rt for m in qddps for rt in m.quant_runtimes()}.values())

    for bg in groups:
        bg._reference_hook_installed = True

    def snapshot() -> None:
        for bg in groups:
            bg.snapshot_reference_shards()

    for opt in leaf_optimizers(optimizer):
        if writes_model_params_in_step(opt) and any(
                rt.quantize_weights and rt.weights_as_difference for rt in runtimes):
            # That optimizer writes the model params itself inside step(), before our snapshot.
            raise ValueError("qWD (--quantized-weights, mode diff) does not support megatron-core's "
                             "precision-aware optimizer")
        wrap_copy_main_params_to_model_params(opt, snapshot)

    if groups:
        device = groups[0].buckets[0].grad_data.device
        # One agreement (and host sync) per runtime, every one of them (a list, not any()).
        wrap_prepare_grads(optimizer, lambda: any([rt.agree_nonfinite(device)
                                                   for rt in runtimes]))
