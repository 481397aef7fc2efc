"""Numerical core of the quantized collectives: group-wise symmetric 2/4/8-bit quantization.

Every public op dispatches to a Triton kernel when the input is a CUDA tensor and triton can be
imported, and to the PyTorch reference (:mod:`.reference`) otherwise.  The environment variable
``QUANT_KERNELS`` overrides the choice: ``triton`` forces the Triton path (this is how CI runs the
kernels on CPU tensors under ``TRITON_INTERPRET=1``), ``torch`` forces the reference.  Triton is
imported lazily so CPU-only installs without triton keep working.

Numerics are defined once, in :mod:`.reference`; the Triton kernels reproduce them bit-for-bit for
round-to-nearest and in distribution for stochastic rounding.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from . import reference as _ref
from .hadamard import hadamard_matrix, hadamard_transform, inverse_hadamard_transform
from .reference import NonFiniteError, QuantizedTensor, SUPPORTED_BITS, pack, unpack

__all__ = [
    "QuantizedTensor", "NonFiniteError", "SUPPORTED_BITS",
    "quantize", "dequantize", "pack", "unpack",
    "hadamard_transform", "inverse_hadamard_transform", "hadamard_matrix",
    "quantize_partitions", "dequantize_sum_requantize", "dequantize_sum",
    "quantize_difference", "dequantize_add", "triton_available", "backend_for",
]

_TRITON_MOD = None
_TRITON_ERR: Optional[BaseException] = None


def _triton():
    """Import the Triton kernels once; return the module or None if triton is unusable."""
    global _TRITON_MOD, _TRITON_ERR
    if _TRITON_MOD is None and _TRITON_ERR is None:
        try:
            from . import triton_kernels as mod  # noqa: WPS433 (lazy on purpose)
            _TRITON_MOD = mod
        except Exception as exc:  # triton missing or broken: fall back to torch
            _TRITON_ERR = exc
    return _TRITON_MOD


def triton_available() -> bool:
    """True if the Triton kernels can be imported in this process."""
    return _triton() is not None


def backend_for(x: torch.Tensor) -> str:
    """'triton' or 'torch': the backend the public ops will use for a tensor on x's device."""
    mode = os.environ.get("QUANT_KERNELS", "auto").strip().lower()
    if mode == "torch":
        return "torch"
    if mode == "triton":
        if _triton() is None:
            raise RuntimeError(f"QUANT_KERNELS=triton but triton kernels cannot be imported: "
                               f"{_TRITON_ERR!r}")
        return "triton"
    if mode not in ("", "auto"):
        raise ValueError(f"QUANT_KERNELS must be 'auto', 'torch' or 'triton', got {mode!r}")
    return "triton" if (x.is_cuda and _triton() is not None) else "torch"


def _impl(x: torch.Tensor):
    return _triton() if backend_for(x) == "triton" else _ref


def quantize(x: torch.Tensor, bits: int, group_size: int, *, stochastic: bool = True,
             generator: Optional[torch.Generator] = None, hadamard: bool = False,
             hadamard_block: int = 32, check_finite: bool = True) -> QuantizedTensor:
    """Group-wise symmetric quantization of the flattened ``x`` to ``bits`` (2, 4 or 8).

    Raises ValueError for unsupported bits / non-dividing group sizes / bad Hadamard blocks and
    :class:`NonFiniteError` if ``check_finite`` and ``x`` holds NaN/Inf.
    """
    return _impl(x).quantize(x, bits, group_size, stochastic=stochastic, generator=generator,
                             hadamard=hadamard, hadamard_block=hadamard_block,
                             check_finite=check_finite)


def dequantize(q: QuantizedTensor, *, hadamard: bool = False, hadamard_block: int = 32,
               out_dtype: torch.dtype = torch.float32,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``code * scale`` (fp32) [-> inverse Hadamard], returned as ``out_dtype`` or written to ``out``."""
    return _impl(q.codes).dequantize(q, hadamard=hadamard, hadamard_block=hadamard_block,
                                     out_dtype=out_dtype, out=out)


def quantize_partitions(x: torch.Tensor, num_partitions: int, partition_order: Sequence[int],
                        bits: int, group_size: int, *, stochastic: bool = True,
                        generator: Optional[torch.Generator] = None, hadamard: bool = False,
                        hadamard_block: int = 32, check_finite: bool = True) -> QuantizedTensor:
    """Fused [Hadamard ->] quantize -> pack -> destination-major write.

    ``x`` is ``num_partitions`` equal contiguous partitions; output slot j holds partition
    ``partition_order[j]`` (ready for ``all_to_all_single`` with equal splits).
    """
    return _impl(x).quantize_partitions(
        x, num_partitions, partition_order, bits, group_size, stochastic=stochastic,
        generator=generator, hadamard=hadamard, hadamard_block=hadamard_block,
        check_finite=check_finite)


def dequantize_sum_requantize(q: QuantizedTensor, num_sources: int, bits_out: int, *,
                              group_size_out: Optional[int] = None, stochastic: bool = True,
                              generator: Optional[torch.Generator] = None) -> QuantizedTensor:
    """Middle hop: dequantize ``num_sources`` equal chunks, fp32 sum in source order, requantize."""
    return _impl(q.codes).dequantize_sum_requantize(
        q, num_sources, bits_out, group_size_out=group_size_out, stochastic=stochastic,
        generator=generator)


def dequantize_sum(q: QuantizedTensor, num_sources: int, *, hadamard: bool = False,
                   hadamard_block: int = 32, out: Optional[torch.Tensor] = None,
                   scale: float = 1.0) -> torch.Tensor:
    """Final hop: dequantize + fp32 sum in source order [-> inverse Hadamard] * scale -> out."""
    return _impl(q.codes).dequantize_sum(q, num_sources, hadamard=hadamard,
                                         hadamard_block=hadamard_block, out=out, scale=scale)


def quantize_difference(new: torch.Tensor, reference: torch.Tensor, bits: int, group_size: int, *,
                        stochastic: bool = True, generator: Optional[torch.Generator] = None,
                        check_finite: bool = True) -> QuantizedTensor:
    """qWD send side: quantize ``reference.dtype(new) - reference`` (subtraction in reference.dtype)."""
    return _impl(reference).quantize_difference(new, reference, bits, group_size,
                                                stochastic=stochastic, generator=generator,
                                                check_finite=check_finite)


def dequantize_add(q: QuantizedTensor, reference: torch.Tensor, *,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """qWD receive side: ``reference.dtype(reference.dtype(code*scale) + reference)``."""
    return _impl(reference).dequantize_add(q, reference, out=out)
