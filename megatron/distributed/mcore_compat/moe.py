"""megatron-core's MoE layer (``transformer.moe``) without Transformer Engine, and on CPU.

Touch points (megatron-core name -- what we rely on -- who uses it):

* ``transformer.moe.moe_utils.te_general_gemm`` -- imported only when Transformer Engine is,
  but ``RouterGatingLinearFunction`` reads it unconditionally: every router forward fails with
  ``NameError`` without TE, on GPU as on CPU. Defined as None, the router takes its own
  ``torch.mm`` branch -- :func:`install_moe_fixes`, called by the model builder.
* ``transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu`` -- the alltoall dispatcher's
  split sizes: numpy only for CUDA tensors, so on CPU the split sizes stay tensors and
  ``all_to_all_single`` refuses them. Wrapped to return numpy for a host tensor too (what the
  CUDA path returns) -- :func:`install_moe_fixes` with ``cpu=True``.
"""

from __future__ import annotations

from typing import Any, List

import torch

from . import Undo


def _host_splits(original: Any) -> Any:
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False,
                                 record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu.__wrapped__ = original  # type: ignore[attr-defined]
    return maybe_move_tensor_to_cpu


def install_moe_fixes(cpu: bool) -> Undo:
    """Make megatron-core 0.16's MoE layer run without TE (and on CPU with ``cpu``); idempotent.
    Returns what restores megatron-core's names."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    undo: List[Any] = []
    if not getattr(moe_utils, "HAVE_TE", False) and "te_general_gemm" not in vars(moe_utils):
        moe_utils.te_general_gemm = None
        undo.append(lambda: delattr(moe_utils, "te_general_gemm"))
    current = token_dispatcher.maybe_move_tensor_to_cpu
    if cpu and not hasattr(current, "__wrapped__"):
        token_dispatcher.maybe_move_tensor_to_cpu = _host_splits(current)
        undo.append(lambda: setattr(token_dispatcher, "maybe_move_tensor_to_cpu", current))

    def restore() -> None:
        for step in reversed(undo):
            step()

    return restore
