"""Gradient-accumulation dtype, decoupled from the wire format.

megatron-core has one knob, ``DistributedDataParallelConfig.grad_reduce_in_fp32``: the DDP grad
buffer (``param.main_grad``, where every micro-batch's gradient is added) is fp32 when it is set,
else the parameter dtype -- and the reduce-scatter runs on that same buffer, so accumulation dtype
and wire dtype are one and the same (see ../shared/research/gradaccum.md §B).

With quantized gradients the wire format is the quantized codes, whatever the buffer dtype, so
the two choices become independent, as in DeepSpeed's ``data_types.grad_accum_dtype``:

* ``--grad-accum-dtype fp32|bf16`` picks the buffer (accumulation) dtype, i.e. sets
  ``grad_reduce_in_fp32``; ``None`` keeps megatron-core's behaviour (fp32 when
  ``--accumulate-allreduce-grads-in-fp32``, which Megatron turns on for ``--bf16``; else the param
  dtype);
* the wire is the quantized two-level all-to-all when ``--quantized-gradients`` (codes + fp32
  scales per group), else megatron-core's exact reduce-scatter *in the accumulation dtype*.

megatron-core can only allocate the buffer in fp32 or in the parameter dtype, so bf16 accumulation
needs bf16 parameters.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from .config import QuantizationConfig

__all__ = ["resolve_grad_dtypes", "apply_grad_accum_dtype", "params_dtype_of", "describe_wire",
           "DTYPE_NAMES"]

DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def params_dtype_of(args: Any) -> torch.dtype:
    """Parameter dtype implied by Megatron-style flags (``--bf16`` / ``--fp16``, else fp32), or an
    explicit ``params_dtype`` attribute (TransformerConfig)."""
    explicit = getattr(args, "params_dtype", None)
    if isinstance(explicit, torch.dtype):
        return explicit
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return torch.float32


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


def resolve_grad_dtypes(args_or_config: Any, *, params_dtype: Optional[torch.dtype] = None,
                        accumulate_in_fp32_default: Optional[bool] = None
                        ) -> Tuple[torch.dtype, str]:
    """``(accumulation dtype, wire description)`` for argparse args or a QuantizationConfig.

    With args, the default (``--grad-accum-dtype`` unset) follows megatron-core/Megatron:
    fp32 if ``args.accumulate_allreduce_grads_in_fp32`` else the param dtype. With a bare
    QuantizationConfig pass ``params_dtype`` and ``accumulate_in_fp32_default`` (what the trainer
    would give megatron-core as ``grad_reduce_in_fp32``).
    """
    if isinstance(args_or_config, QuantizationConfig):
        quant = args_or_config
        pdtype = params_dtype if params_dtype is not None else torch.float32
        fp32_default = bool(accumulate_in_fp32_default)
    else:
        quant = QuantizationConfig.from_args(args_or_config)
        pdtype = params_dtype if params_dtype is not None else params_dtype_of(args_or_config)
        fp32_default = (bool(getattr(args_or_config, "accumulate_allreduce_grads_in_fp32", False))
                        if accumulate_in_fp32_default is None else bool(accumulate_in_fp32_default))
    if quant.grad_accum_dtype is None:
        accum = torch.float32 if fp32_default else pdtype
    else:
        accum = DTYPE_NAMES[quant.grad_accum_dtype]
        if accum != torch.float32 and accum != pdtype:
            raise ValueError(
                f"--grad-accum-dtype {quant.grad_accum_dtype} needs {quant.grad_accum_dtype} "
                f"parameters (megatron-core's grad buffer is fp32 or the param dtype), params are "
                f"{_SHORT.get(pdtype, pdtype)}")
    return accum, describe_wire(quant, accum)


def apply_grad_accum_dtype(ddp_config: Any, quant: QuantizationConfig,
                           params_dtype: torch.dtype) -> torch.dtype:
    """Set ``ddp_config.grad_reduce_in_fp32`` from ``--grad-accum-dtype`` (no-op when unset).

    Returns the resulting accumulation dtype (the dtype of megatron-core's grad buffer)."""
    accum, _ = resolve_grad_dtypes(quant, params_dtype=params_dtype,
                                   accumulate_in_fp32_default=ddp_config.grad_reduce_in_fp32)
    if quant.grad_accum_dtype is not None:
        ddp_config.grad_reduce_in_fp32 = accum == torch.float32
    return accum
