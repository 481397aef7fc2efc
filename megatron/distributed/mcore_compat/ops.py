"""megatron-core's multi-tensor ops (``optimizer.clip_grads``, ``optimizer.optimizer``).

Why a module of its own: without TE or Apex, megatron-core falls back to per-tensor loops for
the grad norm and the main-to-model param scale (a host sync and O(params) launches per step);
it reads the ops through module globals at call time, so the trainer can route them through
torch ``_foreach`` versions here.

Touch points (megatron-core name -- what we rely on -- who uses it):

* ``optimizer.clip_grads.l2_norm_impl`` / ``multi_tensor_scale_impl`` /
  ``multi_tensor_applier`` and ``optimizer.optimizer.multi_tensor_scale_impl`` -- module globals
  read at call time; megatron-core's fallback is ``utils.local_multi_tensor_applier`` --
  :func:`install_foreach_multi_tensor_ops`, used by ``megatron/training/model/fusions.py`` on CUDA
  without TE/Apex.
"""

from __future__ import annotations

from typing import Any, Tuple

import torch

from . import Undo


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
    them would add 4 bytes per parameter at the step's peak. A scale of 1 is a plain copy."""
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
    :func:`foreach_multi_tensor_scale` (the module globals listed in the module docstring).
    A no-op (returns a no-op undo) with TE's or Apex's kernels, or when already installed."""
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


__all__ = ["foreach_multi_tensor_l2_norm", "foreach_multi_tensor_scale",
           "FOREACH_SCALE_GROUP_NUMEL", "install_foreach_multi_tensor_ops"]
