"""The one seam to megatron-core's private names and private behaviour (megatron-core 0.16.x).

Every access to a megatron-core private name or undocumented behaviour lives here, behind a
small public function; importing a submodule checks the version (:data:`SUPPORTED`), and
``tests/test_mcore_compat.py`` has one contract test per touch point. One submodule per
megatron-core part (import from it):

* :mod:`.process_globals` -- process-wide module globals the trainer replaces or recreates:
  ``tensor_parallel.random``'s CUDA RNG state functions, ``jit.jit_fuser``, the
  num-microbatches calculator, the torch_dist write-results queue of ``dist_checkpointing``.
* :mod:`.data` -- ``datasets``: the ``.idx`` reader and the per-split document ranges of the
  blended dataset builder.
* :mod:`.ddp_buckets` -- ``distributed.param_and_grad_buffer`` / ``distributed_data_parallel``:
  the padded buffer class, the bucket groups' internals and their module-global collectives, the
  weight all-gathers of a DDP chunk's bucket groups.
* :mod:`.optimizer` -- ``optimizer`` (``DistributedOptimizer``, ``ChainedOptimizer``): hooks
  around the step, the dp-reshardable state's bucket layout, dummy states, param ranges.
* :mod:`.ops` -- ``optimizer.clip_grads`` / ``optimizer.optimizer``: the multi-tensor op
  globals, replaced by torch ``_foreach`` versions.
"""
# See [Note: megatron-core seam] in docs/architecture.md

from __future__ import annotations

from typing import Callable, Tuple

from megatron.core import package_info as _package_info

SUPPORTED: Tuple[int, int] = (0, 16)
"""(major, minor) of the megatron-core this package was written against; any patch release."""
SUPPORTED_SPEC = "0.16.x"


def check_version(version: str) -> None:
    """Raise ImportError unless ``version`` is a megatron-core release this package supports.

    Checked at import so that an unsupported release fails at once, not mid-training."""
    parts = str(version).split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        major_minor = None
    if major_minor != SUPPORTED:
        raise ImportError(
            f"megatron-core {version} is installed, but megatron/distributed/mcore_compat/ "
            f"supports megatron-core {SUPPORTED_SPEC} only (it touches private names); install "
            f"megatron-core=={SUPPORTED_SPEC.replace('x', '1')} or update mcore_compat and run "
            f"tests/test_mcore_compat.py")


MCORE_VERSION: str = _package_info.__version__
check_version(MCORE_VERSION)

Undo = Callable[[], None]
"""What every patching function of the submodules returns: restores what it replaced."""
