"""The one seam to megatron-core's private names and private behaviour (megatron-core 0.16.x).

Why this module exists: megatron-core has no public hook for several things the trainer and the
quantized communication layer need (a bucket-padding hook, a buffer-class hook, a hook before the
distributed optimizer writes the model params, a public index reader, the per-split document
ranges, ...). Every access to a private name, and every reliance on an undocumented behaviour,
lives here, behind a small public function that says why. The installed version is checked at
import (:data:`SUPPORTED`), and ``tests/test_mcore_compat.py`` holds one contract test per touch
point, so a megatron-core upgrade fails in one named test instead of somewhere in training.

Touch points (megatron-core name -- what we rely on -- who uses it):

* ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` -- the RNG tracker
  calls them as module globals with ``(device, clone, graph_safe)`` / ``(new_state, device,
  graph_safe)``, so replacing the globals redirects it -- :func:`patch_tp_rng_state`, used by
  ``megatron/training/cpu_mode.py``. Also the tracker's warning text and logger
  (:data:`TP_RNG_LOGGER`, :data:`TP_RNG_CPU_STATE_WARNING`) that CPU mode filters.
* ``megatron.core.jit.jit_fuser`` -- modules decorate with the module global at import time;
  ``disable_jit_fuser`` replaces it -- :func:`suspend_jit_fuser`, used by cpu_mode.py.
* ``datasets.indexed_dataset._IndexReader`` (and ``IndexedDataset.index``, an ``_IndexReader``)
  -- reads an ``.idx`` without memory-mapping the ``.bin``; attributes ``sequence_count``,
  ``document_indices``, ``sequence_pointers`` (byte offsets), ``sequence_lengths``, ``dtype``,
  ``dtype_size`` -- :func:`read_index_summary`, :func:`index_token_count`, used by
  ``megatron/training/data.py`` and ``tools/merge_datasets.py``.
* ``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits`` and the constructor signature
  it calls dataset classes with -- the per-split document ranges -- :func:`dataset_split_parts`,
  used by data.py. A ``None`` bookend in ``split_matrix`` skips that split (data.py builds no
  unused split).
* ``GPTDataset._get_num_epochs`` -- loops forever when a requested split has no tokens; the
  reason data.py checks every used split before megatron-core builds it (contract test only).
* ``DistributedOptimizer._init_optimizer_states_with_dummy_values`` -- gives a fresh optimizer
  Adam states before a sharded load -- :func:`init_optimizer_states_with_dummy_values`, used by
  ``megatron/training/dist_checkpoint.py``.
* ``num_microbatches_calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR`` -- no longer read: init
  asserts that no calculator exists, destroy is safe when none does --
  :func:`reinit_num_microbatches_calculator`, used by ``megatron/training/initialize.py``.
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
* ``DistributedOptimizer._copy_main_params_to_model_params`` (called from
  ``step_with_ready_grads``), ``prepare_grads`` looked up on the instance by ``step``,
  ``ChainedOptimizer.chained_optimizers``, ``OptimizerConfig.use_precision_aware_optimizer_no_fp8_
  or_ds_fp8`` -- :func:`leaf_optimizers`, :func:`wrap_copy_main_params_to_model_params`,
  :func:`wrap_prepare_grads`, :func:`writes_model_params_in_step`; quant/ddp.py.
* ``step_with_ready_grads`` looked up on the instance by ``step``; the DDP chunk's
  ``overlap_param_gather_with_optimizer_step`` attribute read by its forward pre-hooks;
  ``bucket_groups`` in reverse forward order -- :func:`wrap_step_with_ready_grads`,
  :func:`dispatch_param_gathers_after_step`, :func:`wait_param_gathers_in_flight`;
  ``integration.build_optimizer`` (``--overlap-param-gather-with-optimizer-step`` with one model
  chunk), ``integration.wait_param_gathers_in_flight`` (end of training).
* ``optimizer.clip_grads.l2_norm_impl`` / ``multi_tensor_scale_impl`` /
  ``multi_tensor_applier`` and ``optimizer.optimizer.multi_tensor_scale_impl`` -- module globals
  read at call time; megatron-core's fallback is ``utils.local_multi_tensor_applier`` --
  :func:`install_foreach_multi_tensor_ops`, used by ``megatron/training/fusions.py`` on CUDA
  without TE/Apex.
* ``dist_checkpointing.strategies.filesystem_async._results_queue`` -- the lazily created
  write-results queue of torch_dist saves -- :func:`torch_dist_results_queue`,
  :func:`set_torch_dist_results_queue`, used by ``megatron/training/save_guard.py``.
* ``DistributedOptimizer._get_model_param_range_map`` -- which elements of a model param this
  rank's shard owns -- :func:`model_param_range_map`, for ``tests/test_integration_ddp.py``.

Behaviour relied on by cpu_mode.py's torch proxy (megatron-core modules use a module-global
``torch``; the optimizers classify params by ``Tensor.type()`` strings) is exercised end to end by
``tests/test_cpu_mode.py``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from megatron.core import package_info as _package_info

SUPPORTED: Tuple[int, int] = (0, 16)
"""(major, minor) of the megatron-core this module was written against; any patch release."""
SUPPORTED_SPEC = "0.16.x"


def check_version(version: str) -> None:
    """Raise ImportError unless ``version`` is a megatron-core release this module supports.

    Why at import: every touch point below is private; on another minor release any of them may
    be gone or behave differently, and the failure would otherwise surface mid-training."""
    parts = str(version).split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        major_minor = None
    if major_minor != SUPPORTED:
        raise ImportError(
            f"megatron-core {version} is installed, but megatron/distributed/quant/mcore_compat.py "
            f"supports megatron-core {SUPPORTED_SPEC} only (it touches private names); install "
            f"megatron-core=={SUPPORTED_SPEC.replace('x', '1')} or update mcore_compat.py and run "
            f"tests/test_mcore_compat.py")


MCORE_VERSION: str = _package_info.__version__
check_version(MCORE_VERSION)

# Imported after the check: on another version these imports may be what fails.
import torch  # noqa: E402
from megatron.core.distributed import distributed_data_parallel as _mcore_ddp_module  # noqa: E402
from megatron.core.distributed import param_and_grad_buffer as _mcore_pgb_module  # noqa: E402
from megatron.core.distributed.param_and_grad_buffer import (  # noqa: E402
    _ParamAndGradBucketGroup,
    _ParamAndGradBuffer,
    shard_buffer,
)

Undo = Callable[[], None]

# ================================================================================ CPU mode (RNG)
TP_RNG_LOGGER = "megatron.core.tensor_parallel.random"
"""Logger of the RNG tracker (CPU mode filters one expected warning on it)."""
TP_RNG_CPU_STATE_WARNING = "CPU RNG state changed within GPU RNG context"
"""The tracker's warning when the CPU generator changes inside ``fork()``; on CPU the forked
generator *is* the CPU generator, so CPU mode expects it every forward."""


def patch_tp_rng_state(get_fn: Callable[..., torch.Tensor],
                       set_fn: Callable[..., None]) -> Undo:
    """Replace the RNG tracker's CUDA state getter/setter; returns the undo.

    Why: ``get_cuda_rng_tracker().fork()`` and ``model_parallel_cuda_manual_seed`` save and
    restore the CUDA generator through the module globals ``_get_cuda_rng_state(device, clone,
    graph_safe)`` / ``_set_cuda_rng_state(new_state, device, graph_safe)``; CPU mode points them at
    the CPU generator. ``get_fn`` / ``set_fn`` must accept those signatures."""
    import megatron.core.tensor_parallel.random as tp_random

    old_get, old_set = tp_random._get_cuda_rng_state, tp_random._set_cuda_rng_state
    tp_random._get_cuda_rng_state = get_fn
    tp_random._set_cuda_rng_state = set_fn

    def undo() -> None:
        tp_random._get_cuda_rng_state = old_get
        tp_random._set_cuda_rng_state = old_set

    return undo


def suspend_jit_fuser() -> Undo:
    """Make ``megatron.core.jit.jit_fuser`` a no-op decorator; returns the undo.

    Why: the bias-GELU/SwiGLU fusions go through ``torch.compile`` (a C++ toolchain on CPU, nothing
    gained on tiny CPU runs). Modules read ``jit_fuser`` when they are imported, so only modules
    imported while it is suspended are affected; restoring does not recompile them."""
    import megatron.core.jit as mcore_jit

    old = mcore_jit.jit_fuser
    mcore_jit.disable_jit_fuser()

    def undo() -> None:
        mcore_jit.jit_fuser = old

    return undo


# ================================================================================ datasets
@dataclass(frozen=True)
class IndexSummary:
    """What an ``.idx`` says, read from its header and last entries only."""

    sequence_count: int
    first_document: Optional[int]
    """``document_indices[0]`` (0 for a well-formed index), None when it is empty."""
    last_document: Optional[int]
    """``document_indices[-1]`` (the sequence count for a well-formed index)."""
    dtype: Any
    """numpy dtype class of the tokens (e.g. ``numpy.uint16``)."""
    dtype_size: int
    data_bytes: int
    """Bytes the ``.bin`` must have: last pointer + last length * token size (0 if empty)."""


def read_index_summary(idx_path: str) -> IndexSummary:
    """Read an ``.idx`` with megatron-core's ``_IndexReader`` (any parse error propagates).

    Why the private reader: the public ``IndexedDataset`` also memory-maps the ``.bin``, which
    fails for a 0-byte ``.bin`` and is what we want to check against the index. Only the header
    and the last entries are touched (the arrays can be gigabytes), and the memory map is closed
    before returning."""
    from megatron.core.datasets.indexed_dataset import _IndexReader

    index = _IndexReader(idx_path, multimodal=False)
    try:
        sequences = int(index.sequence_count)
        doc_idx = index.document_indices
        first = int(doc_idx[0]) if len(doc_idx) else None
        last = int(doc_idx[-1]) if len(doc_idx) else None
        dtype, itemsize = index.dtype, int(index.dtype_size)
        data = (int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * itemsize
                if sequences else 0)
        del doc_idx
    finally:
        del index  # closes the .idx memory map
    return IndexSummary(sequences, first, last, dtype, itemsize, data)


def index_token_count(indexed_dataset: Any, indices: Sequence[int]) -> int:
    """Tokens in the documents ``indices`` of a megatron-core ``IndexedDataset``.

    Why here: it reads the ``_IndexReader`` behind ``IndexedDataset.index``. megatron-core's
    splits are contiguous ranges and ``sequence_pointers`` are byte offsets of consecutive
    documents, so two pointers give the count without reading every length; anything else is
    summed."""
    if len(indices) == 0:
        return 0
    first, last = int(indices[0]), int(indices[-1])
    index = indexed_dataset.index
    if last - first + 1 == len(indices):
        end = (int(index.sequence_pointers[last])
               + int(index.sequence_lengths[last]) * index.dtype_size)
        return (end - int(index.sequence_pointers[first])) // index.dtype_size
    return int(index.sequence_lengths[indices].sum(dtype="int64"))


def _split_probe_class() -> type:
    """A GPTDataset stand-in that builds nothing and keeps what megatron-core hands it (the
    builder calls ``cls(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split,
    config)``)."""
    from megatron.core.datasets.gpt_dataset import GPTDataset

    class _SplitProbe(GPTDataset):
        def __init__(self, indexed_dataset: Any, dataset_path: Any, indexed_indices: Any,
                     num_samples: Any, index_split: Any, config: Any) -> None:
            self.dataset = indexed_dataset
            self.indices = indexed_indices

    return _SplitProbe


def dataset_split_parts(prefix: str, config: Any) -> List[Optional[Any]]:
    """Per split (train, validation, test): what megatron-core hands that split's dataset, or None.

    Each part has ``.indices`` (the document indices of the split) and ``.dataset`` (the file's
    ``IndexedDataset``). Why the private method: 0.16 has no public function for the per-split
    ranges (the rounding lives in ``_build_megatron_dataset_splits``); running it on a stand-in
    class gives by construction the ranges the real build uses. None: a ``None`` bookend in
    ``config.split_matrix`` (the split is not built). No barrier: every rank runs this alone."""
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder

    sizes = [0, 0, 0]
    builder = BlendedMegatronDatasetBuilder(_split_probe_class(), sizes, lambda: True, config)
    return builder._build_megatron_dataset_splits(prefix, config.split_matrix, sizes, False)


# ================================================================================ init / ckpt
def reinit_num_microbatches_calculator(**kwargs: Any) -> None:
    """(Re)create megatron-core's global num-microbatches calculator.

    Why: ``init_num_microbatches_calculator`` asserts that none exists, and a process may
    initialize twice (tests, a second ``pretrain`` call); ``destroy_num_microbatches_calculator``
    is a no-op when none exists, so it replaces reading the private global."""
    from megatron.core import num_microbatches_calculator as nmc

    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(**kwargs)


def init_optimizer_states_with_dummy_values(opt: Any) -> None:
    """Give a fresh ``DistributedOptimizer`` its Adam states (one step on zero gradients).

    Why: without Apex/TE, 0.16's ``sharded_state_dict(is_loading=True)`` asserts one common
    ``step`` over existing states and a new optimizer has none; this private method is
    megatron-core's own remedy, every value it writes is overwritten by the load."""
    opt._init_optimizer_states_with_dummy_values()


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
                        "data_parallel_world_size; update mcore_compat.PaddedParamAndGradBuffer")

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


# ================================================================================ optimizer
HOOK_MARK = "_quant_hook"
"""Attribute set on our wrappers, so that wrapping twice is a no-op."""


def optimizer_bucket_layout(leaf_optimizer: Any) -> Optional[Dict[int, Dict[Any, int]]]:
    """``{grad buffer index: {dtype: number of buckets}}`` of a ``DistributedOptimizer`` (its
    ``gbuf_ranges``), the structure its dp-reshardable state is keyed by; None for another
    optimizer."""
    ranges = getattr(leaf_optimizer, "gbuf_ranges", None)
    if ranges is None:
        return None
    return _bucket_counts(enumerate(ranges))


def saved_bucket_layout(param_state: Any) -> Optional[Dict[int, Dict[Any, int]]]:
    """:func:`optimizer_bucket_layout` of the optimizer that wrote ``param_state`` (its
    ``get_parameter_state_dp_reshardable()``: grad buffer index -> dtype -> per-bucket lists,
    beside non-integer bookkeeping keys); None for anything else."""
    if not isinstance(param_state, dict):
        return None
    return _bucket_counts((i, per_dtype) for i, per_dtype in param_state.items()
                          if isinstance(i, int))


def _bucket_counts(per_buffer: Any) -> Dict[int, Dict[Any, int]]:
    return {i: {dtype: len(buckets) for dtype, buckets in per_dtype.items()}
            for i, per_dtype in per_buffer}


def leaf_optimizers(optimizer: Any) -> List[Any]:
    """The optimizers that own parameters: ``ChainedOptimizer.chained_optimizers``, recursively."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return [optimizer]
    out: List[Any] = []
    for opt in chained:
        out.extend(leaf_optimizers(opt))
    return out


def wrap_copy_main_params_to_model_params(leaf_opt: Any, before: Callable[[], None]) -> bool:
    """Call ``before()`` every time ``leaf_opt`` is about to copy its main params into the model.

    Why: in 0.16 the model params of a ``DistributedOptimizer`` are views of the DDP param buffer,
    and ``step_with_ready_grads`` overwrites them through the private
    ``_copy_main_params_to_model_params``; qWD must snapshot its reference shard first. Idempotent
    (a wrapped method is left alone). Returns False when ``leaf_opt`` has no such method."""
    orig = getattr(leaf_opt, "_copy_main_params_to_model_params", None)
    if orig is None:
        return False
    if getattr(orig, HOOK_MARK, False):
        return True

    def copy_with_before(_orig: Callable[[], None] = orig) -> None:
        before()
        _orig()

    setattr(copy_with_before, HOOK_MARK, True)
    leaf_opt._copy_main_params_to_model_params = copy_with_before
    return True


def wrap_prepare_grads(optimizer: Any, extra: Callable[[], bool]) -> None:
    """Make ``optimizer.prepare_grads()`` report ``found_inf`` also when ``extra()`` is true.

    Why: megatron-core's ``step()`` calls ``self.prepare_grads()`` (an instance lookup) and skips
    the step on ``found_inf``; the quantized path reports non-finite quantized gradients there.
    ``extra`` runs even when the original already found inf (it holds a collective every rank
    must join). Idempotent."""
    orig = optimizer.prepare_grads
    if getattr(orig, HOOK_MARK, False):
        return

    def prepare_grads_with_extra() -> bool:
        found_inf = bool(orig())
        extra_inf = bool(extra())
        return found_inf or extra_inf

    setattr(prepare_grads_with_extra, HOOK_MARK, True)
    optimizer.prepare_grads = prepare_grads_with_extra


def wrap_step_with_ready_grads(optimizer: Any, after: Callable[[], None]) -> None:
    """Call ``after()`` right after a successful ``optimizer.step_with_ready_grads()``.

    Why: megatron-core's own ``overlap_param_gather_with_optimizer_step`` dispatches the weight
    all-gathers from ``ChainedOptimizer.step_with_ready_grads`` but only for interleaved
    pipelines (``get_megatron_optimizer`` puts the first model chunk in an optimizer of its own
    and fails with a single chunk). ``step()`` and our trainer's step both go through this
    instance attribute, so wrapping it gives the same dispatch point for one chunk. Idempotent."""
    orig = optimizer.step_with_ready_grads
    if getattr(orig, HOOK_MARK, False):
        return

    def step_with_ready_grads_then(*args: Any, **kwargs: Any) -> Any:
        success = orig(*args, **kwargs)
        if success:
            after()
        return success

    setattr(step_with_ready_grads_then, HOOK_MARK, True)
    optimizer.step_with_ready_grads = step_with_ready_grads_then


def dispatch_param_gathers_after_step(ddp_chunk: Any) -> None:
    """Start every bucket group's weight all-gather of ``ddp_chunk`` now -- dense groups in
    forward order, then the expert-parallel ones (also in forward order) -- and tell its forward
    pre-hooks not to chain-dispatch them again.

    Why: megatron-core's ``DistributedDataParallel.start_param_sync(force_dispatch=True)`` walks
    ``bucket_groups`` in buffer order, which is the *reverse* of forward order (buffers are
    filled in backward order; ``next_param_gather_bucket_group`` links group i to i-1). The
    first layer would then wait for every gather queued before its own. The pre-hook's
    ``finish_param_sync(skip_next_bucket_dispatch=...)`` reads the chunk's
    ``overlap_param_gather_with_optimizer_step`` attribute, which megatron-core sets in
    ``get_megatron_optimizer`` only for the interleaved case."""
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


def model_param_range_map(leaf_opt: Any, model_param: torch.Tensor) -> Any:
    """The ranges of ``model_param`` this rank's ``DistributedOptimizer`` shard owns: a dict with
    ``"param"`` (range within the param), ``"gbuf_world_in_bucket"`` (within its bucket), ...

    Why: 0.16 exposes the ownership of a model param's elements only through the private
    ``_get_model_param_range_map``; tests read it to compare master weights with the buffer."""
    return leaf_opt._get_model_param_range_map(model_param)


def writes_model_params_in_step(leaf_opt: Any) -> bool:
    """True for megatron-core's precision-aware optimizer, which writes the model params itself
    inside ``step()`` -- before any hook on ``_copy_main_params_to_model_params`` runs."""
    cfg = getattr(leaf_opt, "config", None)
    return bool(cfg is not None
                and getattr(cfg, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))


# ================================================================================ multi-tensor ops
def foreach_multi_tensor_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: Any,
                                 per_tensor: bool, *args: Any) -> Tuple[torch.Tensor, None]:
    """``amp_C.multi_tensor_l2norm``'s contract on torch ``_foreach`` ops: one kernel group for
    all tensors, the result stays on the device. megatron-core's fallback
    (``local_multi_tensor_l2_norm``) launches a norm per tensor, builds a host tensor from them
    and reads it back with ``float()``: a host sync and O(params) launches per step."""
    tensors = [t for tensors_ in tensor_lists for t in tensors_]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32), None
    norms = torch._foreach_norm(tensors, 2.0)
    total = torch.linalg.vector_norm(torch.stack([n.to(torch.float32) for n in norms]))
    return total.reshape(1), None


def foreach_multi_tensor_scale(chunk_size: int, noop_flag: Any, tensor_lists: Any,
                               scale: float) -> None:
    """``amp_C.multi_tensor_scale``'s contract (``dst = src * scale``) on ``_foreach`` ops.

    Out of place, the products are made a group of tensors at a time (at most
    :data:`FOREACH_SCALE_GROUP_NUMEL` elements), not for every tensor at once: fp16 training
    copies the main params into the model through here every step, and one temporary of all of
    them was an extra 4 bytes per parameter at the step's peak. A scale of 1 is a plain copy."""
    src, dst = list(tensor_lists[0]), list(tensor_lists[1])
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
        return
    start = 0
    while start < len(src):
        end, numel = start, 0
        while end < len(src) and (end == start or numel + src[end].numel()
                                  <= FOREACH_SCALE_GROUP_NUMEL):
            numel += src[end].numel()
            end += 1
        group_src, group_dst = src[start:end], dst[start:end]
        torch._foreach_copy_(group_dst, group_src if scale == 1.0
                             else torch._foreach_mul(group_src, scale))
        start = end


FOREACH_SCALE_GROUP_NUMEL = 1 << 26
"""Elements per group of :func:`foreach_multi_tensor_scale`'s out-of-place products (256 MB of
fp32 temporaries at most)."""


def install_foreach_multi_tensor_ops() -> Undo:
    """Where megatron-core fell back to its per-tensor loops (neither TE nor Apex imported),
    route its grad-norm and scale calls through :func:`foreach_multi_tensor_l2_norm` /
    :func:`foreach_multi_tensor_scale`. Touch points: the module globals ``l2_norm_impl`` and
    ``multi_tensor_scale_impl`` of ``megatron.core.optimizer.clip_grads`` and
    ``multi_tensor_scale_impl`` of ``megatron.core.optimizer.optimizer``, which their functions
    read at call time through ``multi_tensor_applier`` (the local applier passes its arguments
    through). A no-op (returns a no-op undo) when megatron-core uses TE's or Apex's kernels, or
    when they are installed already (the trainer applies its fusions again after a load)."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads, optimizer as mcore_optimizer

    if (clip_grads.multi_tensor_applier is not mcore_utils.local_multi_tensor_applier
            or clip_grads.l2_norm_impl is foreach_multi_tensor_l2_norm):  # TE/Apex, or done
        return lambda: None
    saved = [(clip_grads, "l2_norm_impl", clip_grads.l2_norm_impl),
             (clip_grads, "multi_tensor_scale_impl", clip_grads.multi_tensor_scale_impl),
             (mcore_optimizer, "multi_tensor_scale_impl", mcore_optimizer.multi_tensor_scale_impl)]
    clip_grads.l2_norm_impl = foreach_multi_tensor_l2_norm
    clip_grads.multi_tensor_scale_impl = foreach_multi_tensor_scale
    mcore_optimizer.multi_tensor_scale_impl = foreach_multi_tensor_scale

    def undo() -> None:
        for module, name, value in saved:
            setattr(module, name, value)
    return undo


# ================================================================================ torch_dist writer
def torch_dist_results_queue() -> Any:
    """megatron-core's torch_dist write-results queue, or None before the first save creates it
    (``dist_checkpointing.strategies.filesystem_async._results_queue``, made lazily by
    ``_get_write_results_queue`` with a spawn-context ``Manager``)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return getattr(filesystem_async, "_results_queue", None)


def set_torch_dist_results_queue(queue: Any) -> None:
    """Install ``queue`` as that queue before the first save, so megatron-core uses it instead
    of creating its own (``_get_write_results_queue`` only creates one when the global is None)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue


__all__ = [
    "SUPPORTED", "SUPPORTED_SPEC", "MCORE_VERSION", "check_version",
    "TP_RNG_LOGGER", "TP_RNG_CPU_STATE_WARNING", "patch_tp_rng_state", "suspend_jit_fuser",
    "IndexSummary", "read_index_summary", "index_token_count", "dataset_split_parts",
    "reinit_num_microbatches_calculator", "init_optimizer_states_with_dummy_values",
    "ParamAndGradBuffer", "ParamAndGradBucketGroup", "shard_buffer", "PaddedParamAndGradBuffer",
    "ddp_buffer_class", "adopt_bucket_group", "grad_sync_is_noop", "grad_sync_preamble",
    "param_sync_is_wait_only", "param_sync_preamble", "set_grad_reduce_handle",
    "set_param_gather_handle", "dp_instance_group", "dp_instance_size", "dp_instance_rank",
    "bucket_grad_shard", "bucket_param_shard", "patch_bucket_collectives", "HOOK_MARK",
    "leaf_optimizers", "wrap_copy_main_params_to_model_params", "wrap_prepare_grads",
    "model_param_range_map", "writes_model_params_in_step", "foreach_multi_tensor_l2_norm",
    "foreach_multi_tensor_scale", "install_foreach_multi_tensor_ops", "torch_dist_results_queue",
    "set_torch_dist_results_queue",
]
