"""megatron-core's process-wide module globals that the trainer replaces or recreates.

Why a module of its own: each of these is a module global that megatron-core reads at call time
(or at decoration time), with no public setter; the trainer swaps it for CPU mode, for a second
initialization in one process, or for a save that must not spawn its own manager process.

Touch points (megatron-core name -- what we rely on -- who uses it):

* ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` -- the RNG tracker
  calls them as module globals with ``(device, clone, graph_safe)`` / ``(new_state, device,
  graph_safe)``, so replacing the globals redirects it -- :func:`patch_tp_rng_state`, used by
  ``megatron/training/cpu_mode.py``. Also the tracker's warning text and logger
  (:data:`TP_RNG_LOGGER`, :data:`TP_RNG_CPU_STATE_WARNING`) that CPU mode filters.
* ``megatron.core.jit.jit_fuser`` -- modules decorate with the module global at import time;
  ``disable_jit_fuser`` replaces it -- :func:`suspend_jit_fuser`, used by cpu_mode.py.
* ``num_microbatches_calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR`` -- not read: init
  asserts that no calculator exists, destroy is safe when none does --
  :func:`reinit_num_microbatches_calculator`, used by ``megatron/training/initialize.py``.
* ``dist_checkpointing.strategies.filesystem_async._results_queue`` -- the lazily created
  write-results queue of torch_dist saves -- :func:`torch_dist_results_queue`,
  :func:`set_torch_dist_results_queue`, used by ``megatron/training/checkpoint/writer_processes.py``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import Undo

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


# ================================================================================ initialization
def reinit_num_microbatches_calculator(**kwargs: Any) -> None:
    """(Re)create megatron-core's global num-microbatches calculator.

    Why: ``init_num_microbatches_calculator`` asserts that none exists, and a process may
    initialize twice (tests, a second ``pretrain`` call); ``destroy_num_microbatches_calculator``
    is a no-op when none exists, so it replaces reading the private global."""
    from megatron.core import num_microbatches_calculator as nmc

    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(**kwargs)


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
    "TP_RNG_LOGGER", "TP_RNG_CPU_STATE_WARNING", "patch_tp_rng_state", "suspend_jit_fuser",
    "reinit_num_microbatches_calculator", "torch_dist_results_queue",
    "set_torch_dist_results_queue",
]
