"""The one seam to megatron-core's private names and private behaviour (megatron-core 0.16.x).

Why this package exists: megatron-core has no public hook for several things the trainer and the
quantized communication layer need (a bucket-padding hook, a buffer-class hook, a hook before the
distributed optimizer writes the model params, a public index reader, the per-split document
ranges, ...). Every access to a private name, and every reliance on an undocumented behaviour,
lives in this package, behind a small public function that says why; nothing else in our code
touches megatron-core internals. Importing any submodule first runs this file, which checks the
installed version (:data:`SUPPORTED`), and ``tests/test_mcore_compat.py`` holds one contract
test per touch point, so a megatron-core upgrade fails in one named test instead of somewhere in
training.

One submodule per megatron-core part it adapts (each lists its touch points and their users);
import a name from the submodule that defines it:

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

Behaviour relied on by cpu_mode.py's torch proxy (megatron-core modules use a module-global
``torch``; the optimizers classify params by ``Tensor.type()`` strings) is exercised end to end by
``tests/test_cpu_mode.py``.
"""

from __future__ import annotations

from typing import Callable, Tuple

from megatron.core import package_info as _package_info

SUPPORTED: Tuple[int, int] = (0, 16)
"""(major, minor) of the megatron-core this package was written against; any patch release."""
SUPPORTED_SPEC = "0.16.x"


def check_version(version: str) -> None:
    """Raise ImportError unless ``version`` is a megatron-core release this package supports.

    Why at import: every touch point in the submodules is private; on another minor release any
    of them may be gone or behave differently, and the failure would otherwise surface
    mid-training."""
    parts = str(version).split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        major_minor = None
    if major_minor != SUPPORTED:
        raise ImportError(
            f"megatron-core {version} is installed, but megatron/distributed/quant/mcore_compat/ "
            f"supports megatron-core {SUPPORTED_SPEC} only (it touches private names); install "
            f"megatron-core=={SUPPORTED_SPEC.replace('x', '1')} or update mcore_compat and run "
            f"tests/test_mcore_compat.py")


MCORE_VERSION: str = _package_info.__version__
check_version(MCORE_VERSION)

Undo = Callable[[], None]
"""What every patching function of the submodules returns: restores what it replaced."""
