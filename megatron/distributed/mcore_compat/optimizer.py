"""megatron-core's ``optimizer``: hooks around the step and what its sharded state looks like.

Why a module of its own: 0.16 has no hook before the optimizer writes the model params or decides
whether gradients are finite, and no public name for its state layout.

Touch points (megatron-core name -- what we rely on -- who uses it):

* ``DistributedOptimizer._init_optimizer_states_with_dummy_values`` -- gives a fresh optimizer
  Adam states before a sharded load -- :func:`init_optimizer_states_with_dummy_values`, used by
  ``megatron/training/checkpoint/torch_dist_format.py``.
* ``DistributedOptimizer.gbuf_ranges`` and the structure of
  ``get_parameter_state_dp_reshardable()`` -- :func:`optimizer_bucket_layout`,
  :func:`saved_bucket_layout`, used by ``megatron/training/checkpoint/torch_format.py``.
* ``DistributedOptimizer._copy_main_params_to_model_params`` (called from
  ``step_with_ready_grads``), ``prepare_grads`` looked up on the instance by ``step``,
  ``ChainedOptimizer.chained_optimizers``, ``OptimizerConfig.use_precision_aware_optimizer_no_fp8_
  or_ds_fp8`` -- :func:`leaf_optimizers`, :func:`wrap_copy_main_params_to_model_params`,
  :func:`wrap_prepare_grads`, :func:`writes_model_params_in_step`; quant/ddp.py.
* ``step_with_ready_grads`` looked up on the instance by ``step`` --
  :func:`wrap_step_with_ready_grads`, used by ``integration.build_optimizer``
  (``--overlap-param-gather-with-optimizer-step`` with one model chunk) to call
  :func:`.ddp_buckets.dispatch_param_gathers_after_step`.
* ``DistributedOptimizer._get_model_param_range_map`` -- which elements of a model param this
  rank's shard owns -- :func:`model_param_range_map`, for ``tests/test_integration_ddp.py``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch


# ================================================================================ checkpoints
def init_optimizer_states_with_dummy_values(opt: Any) -> None:
    """Give a fresh ``DistributedOptimizer`` its Adam states (one step on zero gradients).

    Why: without Apex/TE, 0.16's ``sharded_state_dict(is_loading=True)`` asserts one common
    ``step`` over existing states and a new optimizer has none; this private method is
    megatron-core's own remedy, every value it writes is overwritten by the load."""
    opt._init_optimizer_states_with_dummy_values()


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


# ================================================================================ step hooks
HOOK_MARK = "_quant_hook"
"""Attribute set on our wrappers, so that wrapping twice is a no-op."""


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

    Why: megatron-core dispatches the weight all-gathers after the step only for interleaved
    pipelines; ``step()`` and our trainer's step both call this instance attribute, so wrapping it
    gives the same dispatch point for one chunk. Idempotent."""
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



__all__ = [
    "init_optimizer_states_with_dummy_values", "HOOK_MARK", "optimizer_bucket_layout",
    "saved_bucket_layout", "leaf_optimizers", "wrap_copy_main_params_to_model_params",
    "wrap_prepare_grads", "wrap_step_with_ready_grads", "model_param_range_map",
    "writes_model_params_in_step",
]
