"""megatron-core's DDP buffers and bucket groups (``distributed.param_and_grad_buffer``,
``distributed_data_parallel``).

Why a module of its own: the quantized DDP (``quant/ddp.py``) pads the buckets and overrides the
bucket groups' syncs, and 0.16 has no padding hook, buffer-class hook or public bucket-group state.

Touch points (megatron-core name -- what we rely on -- who uses it):

* ``distributed.param_and_grad_buffer._ParamAndGradBuffer`` / ``_ParamAndGradBucketGroup`` /
  ``shard_buffer`` -- subclassed by the quantized DDP -- :data:`ParamAndGradBuffer`,
  :data:`ParamAndGradBucketGroup`, :func:`shard_buffer`, used by ``quant/ddp.py``.
* the bucket-padding closure of ``_ParamAndGradBuffer.__init__`` reads
  ``self.data_parallel_world_size`` at call time -- :class:`PaddedParamAndGradBuffer`.
* ``distributed_data_parallel._ParamAndGradBuffer`` -- ``DistributedDataParallel.__init__``
  looks the buffer class up as a module global -- :func:`ddp_buffer_class`.
* bucket-group internals: ``is_first_batch``, ``grad_reduce_handle``, ``param_gather_handle``,
  ``param_gather_dispatched``, ``check_grads``, ``cached_{grad,param}_buffer_shard_list``,
  ``intra_distributed_optimizer_instance_{group,size,rank}``; ``finish_grad_sync`` /
  ``finish_param_sync`` only call ``.wait()`` on the stored handle; the preambles of
  ``start_grad_sync`` / ``start_param_sync`` -- :func:`adopt_bucket_group`,
  :func:`grad_sync_preamble`, :func:`param_sync_preamble`, :func:`set_grad_reduce_handle`,
  :func:`set_param_gather_handle`, :func:`bucket_grad_shard`, :func:`bucket_param_shard`,
  :func:`dp_instance_group`, :func:`dp_instance_size`, :func:`dp_instance_rank`; quant/ddp.py.
* ``param_and_grad_buffer.dist_reduce_scatter_func`` / ``_coalescing_manager`` -- module globals
  the bucket group's collectives go through -- :func:`patch_bucket_collectives`, for
  ``bench/emulated_network/ring_volume_rs.py``.
* the DDP chunk's ``overlap_param_gather_with_optimizer_step`` attribute read by its forward
  pre-hooks; ``bucket_groups`` in reverse forward order -- :func:`dispatch_param_gathers_after_step`
  (called after :func:`.optimizer.wrap_step_with_ready_grads`' step),
  :func:`wait_param_gathers_in_flight`; ``integration.build_optimizer``
  (``--overlap-param-gather-with-optimizer-step`` with one model chunk),
  ``integration.wait_param_gathers_in_flight`` (end of training).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Optional

import torch
from megatron.core.distributed import distributed_data_parallel as _mcore_ddp_module
from megatron.core.distributed import param_and_grad_buffer as _mcore_pgb_module
from megatron.core.distributed.param_and_grad_buffer import (
    _ParamAndGradBucketGroup,
    _ParamAndGradBuffer,
    shard_buffer,
)

from . import Undo


# ================================================================================ DDP buffers
ParamAndGradBuffer = _ParamAndGradBuffer
"""megatron-core's ``_ParamAndGradBuffer`` (public name for our subclasses)."""
ParamAndGradBucketGroup = _ParamAndGradBucketGroup
"""megatron-core's ``_ParamAndGradBucketGroup`` (public name for our subclasses)."""


class PaddedParamAndGradBuffer(ParamAndGradBuffer):
    """``_ParamAndGradBuffer`` whose buckets are padded to a multiple of ``pad_multiple``.

    Why this way: megatron-core pads every bucket end to ``lcm(data_parallel_world_size, 128)``
    inside a closure of ``__init__`` that reads ``self.data_parallel_world_size`` at call time,
    and has no padding hook. During ``__init__`` this property returns ``lcm(P, pad_multiple)``,
    afterwards the real world size ``P``. A post-construction assertion catches a megatron-core
    change that would silently defeat this.
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
                        "data_parallel_world_size; update "
                        "mcore_compat.ddp_buckets.PaddedParamAndGradBuffer")

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
def ddp_buffer_class(pad_multiple: int) -> Iterator[None]:
    """Make ``DistributedDataParallel.__init__`` build :class:`PaddedParamAndGradBuffer`.

    Why: megatron-core has no buffer-class hook; it looks the class up as the module global
    ``_ParamAndGradBuffer`` of ``distributed_data_parallel``. We swap that name only while the
    caller's ``DistributedDataParallel.__init__`` runs (single-threaded construction)."""
    original = _mcore_ddp_module._ParamAndGradBuffer

    def factory(*args: Any, **kwargs: Any) -> PaddedParamAndGradBuffer:
        return PaddedParamAndGradBuffer(*args, pad_multiple=pad_multiple, **kwargs)

    _mcore_ddp_module._ParamAndGradBuffer = factory
    try:
        yield
    finally:
        _mcore_ddp_module._ParamAndGradBuffer = original


# ================================================================================ bucket groups
def adopt_bucket_group(group: Any, cls: type) -> Any:
    """Turn a bucket group megatron-core built into an instance of our subclass ``cls``.

    Why a ``__class__`` swap: DDP builds ``_ParamAndGradBucketGroup`` objects itself and keeps
    references to them (``param_to_bucket_group``, ``next_param_gather_bucket_group``);
    changing the class in place keeps all of megatron-core's bookkeeping valid."""
    if not isinstance(group, ParamAndGradBucketGroup):
        raise TypeError(f"expected megatron-core's _ParamAndGradBucketGroup, got {type(group)}")
    if not issubclass(cls, ParamAndGradBucketGroup):
        raise TypeError(f"{cls} is not a subclass of _ParamAndGradBucketGroup")
    group.__class__ = cls
    return group


def grad_sync_is_noop(group: Any) -> bool:
    """True when megatron-core's ``start_grad_sync`` would return at once (first batch, the
    collective already dispatched)."""
    return bool(group.is_first_batch and group.grad_reduce_handle is not None)


def grad_sync_preamble(group: Any) -> bool:
    """The start of megatron-core's ``start_grad_sync``, for an override that replaces the rest.

    Returns False when the caller must return at once (:func:`grad_sync_is_noop`). Otherwise:
    asserts no outstanding handle, runs ``check_grads`` when the DDP config asks, applies each
    bucket's ``gradient_scaling_factor`` (exactly where megatron-core applies it), returns True."""
    if grad_sync_is_noop(group):
        return False
    assert group.grad_reduce_handle is None, \
        "Should not have multiple communication calls outstanding at once"
    if group.ddp_config.check_for_nan_in_grad or group.ddp_config.check_for_large_grads:
        group.check_grads(check_for_nan_or_inf=group.ddp_config.check_for_nan_in_grad,
                          check_for_large=group.ddp_config.check_for_large_grads)
    for bucket in group.buckets:
        if bucket.gradient_scaling_factor != 1.0:
            bucket.grad_data *= bucket.gradient_scaling_factor
    return True


def param_sync_is_wait_only(group: Any, force_sync: bool) -> bool:
    """True when megatron-core's ``start_param_sync`` only waits on the pending gather."""
    return bool(force_sync and group.param_gather_handle is not None)


def param_sync_preamble(group: Any, force_sync: bool) -> bool:
    """The start of megatron-core's ``start_param_sync``, for an override that replaces the rest.

    ``force_sync`` with a pending gather: wait on it, clear it, return False (nothing more to
    do). Otherwise assert no outstanding handle (when not forced) and return True."""
    assert group.ddp_config.use_distributed_optimizer
    if force_sync:
        if group.param_gather_handle is not None:
            group.param_gather_handle.wait()
            group.param_gather_handle = None
            return False
    else:
        assert group.param_gather_handle is None
    return True


def set_grad_reduce_handle(group: Any, handle: Optional[Any]) -> None:
    """Store the handle megatron-core's ``finish_grad_sync`` will ``.wait()`` on (None: done)."""
    group.grad_reduce_handle = handle


def set_param_gather_handle(group: Any, handle: Optional[Any]) -> None:
    """Store the handle ``finish_param_sync`` will ``.wait()`` on (None: done) and mark the gather
    dispatched, as megatron-core's ``start_param_sync`` does."""
    group.param_gather_handle = handle
    group.param_gather_dispatched = True


def dp_instance_group(group: Any) -> Any:
    """The process group a bucket group's reduce-scatter / all-gather runs over."""
    return group.intra_distributed_optimizer_instance_group


def dp_instance_size(group: Any) -> int:
    """Ranks of :func:`dp_instance_group` (the number of shards of each bucket)."""
    return int(group.intra_distributed_optimizer_instance_size)


def dp_instance_rank(group: Any) -> int:
    """This rank's index in :func:`dp_instance_group` (which shard of each bucket it owns)."""
    return int(group.intra_distributed_optimizer_instance_rank)


def bucket_grad_shard(group: Any, idx: int) -> torch.Tensor:
    """This rank's shard of bucket ``idx``'s gradient buffer (megatron-core's cached views, so it
    is the very tensor megatron-core's own reduce-scatter writes)."""
    if group.cached_grad_buffer_shard_list[idx] is None:
        group.cached_grad_buffer_shard_list[idx] = shard_buffer(
            group.buckets[idx].grad_data, group.intra_distributed_optimizer_instance_size)
    shards = group.cached_grad_buffer_shard_list[idx]
    return shards[group.intra_distributed_optimizer_instance_rank]


def bucket_param_shard(group: Any, idx: int) -> torch.Tensor:
    """This rank's shard of bucket ``idx``'s param buffer (megatron-core's cached views)."""
    if group.cached_param_buffer_shard_list[idx] is None:
        group.cached_param_buffer_shard_list[idx] = shard_buffer(
            group.buckets[idx].param_data, group.intra_distributed_optimizer_instance_size)
    shards = group.cached_param_buffer_shard_list[idx]
    return shards[group.intra_distributed_optimizer_instance_rank]


def patch_bucket_collectives(reduce_scatter: Optional[Callable[..., Any]] = None,
                             coalescing_manager: Optional[Callable[..., Any]] = None) -> Undo:
    """Route the bucket groups' reduce-scatter / coalescing manager through other functions.

    Why: ``param_and_grad_buffer`` binds ``dist_reduce_scatter_func`` and ``_coalescing_manager``
    as module globals at import, so patching ``torch.distributed`` alone does not reach them
    (the emulated-network benchmark). None leaves that name alone. Returns the undo."""
    saved = {"dist_reduce_scatter_func": _mcore_pgb_module.dist_reduce_scatter_func,
             "_coalescing_manager": _mcore_pgb_module._coalescing_manager}
    if reduce_scatter is not None:
        _mcore_pgb_module.dist_reduce_scatter_func = reduce_scatter
    if coalescing_manager is not None:
        _mcore_pgb_module._coalescing_manager = coalescing_manager

    def undo() -> None:
        for name, value in saved.items():
            setattr(_mcore_pgb_module, name, value)

    return undo


# ================================================================================ weight gathers
def dispatch_param_gathers_after_step(ddp_chunk: Any) -> None:
    """Start every bucket group's weight all-gather of ``ddp_chunk`` now -- dense groups in
    forward order, then the expert-parallel ones (also in forward order) -- and tell its forward
    pre-hooks not to chain-dispatch them again.

    Why: megatron-core's ``start_param_sync(force_dispatch=True)`` walks ``bucket_groups`` in
    buffer order, the *reverse* of forward order, so the first layer would wait for every other
    gather. The pre-hooks read the chunk's ``overlap_param_gather_with_optimizer_step``, which
    megatron-core sets only for the interleaved case."""
    ddp_chunk.overlap_param_gather_with_optimizer_step = True
    groups = (list(reversed(ddp_chunk.bucket_groups)) +
              list(reversed(getattr(ddp_chunk, "expert_parallel_bucket_groups", []))))
    for group in groups:
        if not group.param_gather_dispatched:
            group.start_param_sync()


def wait_param_gathers_in_flight(ddp_chunk: Any) -> None:
    """Wait for every weight all-gather of ``ddp_chunk`` still in flight (``param_gather_handle``
    of its bucket groups), starting none; the handles are cleared as ``finish_param_sync`` does."""
    for group in (list(ddp_chunk.bucket_groups) +
                  list(getattr(ddp_chunk, "expert_parallel_bucket_groups", []))):
        if group.param_gather_handle is not None:
            group.param_gather_handle.wait()
            group.param_gather_handle = None



__all__ = [
    "ParamAndGradBuffer", "ParamAndGradBucketGroup", "shard_buffer", "PaddedParamAndGradBuffer",
    "ddp_buffer_class", "adopt_bucket_group", "grad_sync_is_noop", "grad_sync_preamble",
    "param_sync_is_wait_only", "param_sync_preamble", "set_grad_reduce_handle",
    "set_param_gather_handle", "dp_instance_group", "dp_instance_size", "dp_instance_rank",
    "bucket_grad_shard", "bucket_param_shard", "patch_bucket_collectives",
    "dispatch_param_gathers_after_step", "wait_param_gathers_in_flight",
]
