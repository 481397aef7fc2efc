"""Gradient-accumulation dtype, decoupled from the wire format.

In megatron-core the grad buffer's dtype (``grad_reduce_in_fp32``) is also the wire dtype; with
quantized gradients the wire is the codes, so the two are independent (as DeepSpeed's
``grad_accum_dtype``). ``--grad-accum-dtype fp32|bf16`` sets the buffer dtype (``None``:
megatron-core's choice); megatron-core allocates it in fp32 or the parameter dtype only, so bf16
needs bf16 params.
"""

from __future__ import annotations

from typing import Any, Tuple

import torch

from .config import QuantizationConfig

__all__ = ["resolve_grad_dtypes", "apply_grad_accum_dtype", "describe_wire", "DTYPE_NAMES"]

DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def describe_wire(quant: QuantizationConfig, accum_dtype: torch.dtype) -> str:
    """Human-readable wire format of the gradient reduce-scatter."""
    if not quant.quantized_gradients:
        return f"exact {_SHORT.get(accum_dtype, str(accum_dtype))} reduce-scatter (megatron-core)"
    desc = (f"TLq: intra int{quant.gradient_quantization_bits_intra}/g{quant.gq_group_size_intra}, "
            f"inter int{quant.gradient_quantization_bits_inter}/g{quant.gq_group_size_inter} "
            f"(+fp32 scales)")
    if quant.hadamard_transform:
        desc += f", Hadamard {quant.hadamard_block_size}"
    if quant.loco:
        desc += f", LoCo beta={quant.loco_error_beta}"
    if quant.gradients_quantization_start_iteration > 0:
        desc += (f"; exact {_SHORT.get(accum_dtype, str(accum_dtype))} before iteration "
                 f"{quant.gradients_quantization_start_iteration}")
    return desc


def resolve_grad_dtypes(quant: QuantizationConfig, *, params_dtype: torch.dtype = torch.float32,
                        accumulate_in_fp32_default: bool = False) -> Tuple[torch.dtype, str]:
    """``(accumulation dtype, wire description)`` of the run's config.

    ``params_dtype``: the parameters'; ``accumulate_in_fp32_default``: what the trainer gives
    megatron-core as ``grad_reduce_in_fp32`` (``--accumulate-allreduce-grads-in-fp32``), the
    accumulation dtype when ``--grad-accum-dtype`` is unset (fp32 if set, else the parameter
    dtype, as megatron-core/Megatron do). ValueError for bf16 accumulation of non-bf16
    parameters (megatron-core's grad buffer is fp32 or the parameter dtype).
    """
    if quant.grad_accum_dtype is None:
        accum = torch.float32 if accumulate_in_fp32_default else params_dtype
    else:
        accum = DTYPE_NAMES[quant.grad_accum_dtype]
        if accum != torch.float32 and accum != params_dtype:
            raise ValueError(
                f"--grad-accum-dtype {quant.grad_accum_dtype} needs {quant.grad_accum_dtype} "
                f"parameters (megatron-core's grad buffer is fp32 or the param dtype), params are "
                f"{_SHORT.get(params_dtype, params_dtype)}")
    return accum, describe_wire(quant, accum)


def apply_grad_accum_dtype(ddp_config: Any, quant: QuantizationConfig,
                           params_dtype: torch.dtype) -> torch.dtype:
    """Set ``ddp_config.grad_reduce_in_fp32`` from ``--grad-accum-dtype`` (no-op when unset).

    Returns the resulting accumulation dtype (the dtype of megatron-core's grad buffer)."""
    accum, _ = resolve_grad_dtypes(quant, params_dtype=params_dtype,
                                   accumulate_in_fp32_default=bool(ddp_config.grad_reduce_in_fp32))
    if quant.grad_accum_dtype is not None:
        ddp_config.grad_reduce_in_fp32 = accum == torch.float32
    return accum
