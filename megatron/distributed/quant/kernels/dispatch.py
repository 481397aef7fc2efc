"""The quantization kernels' public ops, each sent to the backend that runs it.

Three backends implement the same public ops:

* ``torch``  — the PyTorch reference (:mod:`.reference`), any device; the numerical definition.
* ``triton`` — Triton kernels (:mod:`.triton_launch`, the launchers of :mod:`.triton_device`),
  used for CUDA tensors.
* ``cpp``    — fused single-pass C++ CPU kernels (:mod:`.cpu_kernels`), compiled at first use
  with ``torch.utils.cpp_extension`` (needs a C++ compiler and ``ninja``) and cached per machine.

``backend_for(x)`` says which one the public ops use for a tensor like ``x``. The environment
variable ``QUANT_KERNELS`` (read at every call) chooses:

* ``auto`` (default): ``triton`` for CUDA tensors (an error naming the import failure when triton
  does not import: no silent fall back to the reference on a GPU), ``cpp`` for CPU tensors when
  the C++ kernels build (if they cannot — no compiler, no ninja, build error — one warning is logged
  and ``torch`` is used), ``torch`` otherwise;
* ``torch``, ``triton`` or ``cpp`` (alias ``cpu``) force that backend; forcing one that cannot be
  loaded raises RuntimeError. ``triton`` on CPU tensors is how CI runs the Triton kernels under
  ``TRITON_INTERPRET=1``; ``cpp`` hands tensors it cannot handle (non-CPU, or dtypes other than
  fp32/bf16/fp16) to the reference.

Numerics are defined once, in :mod:`.reference`; the Triton and C++ kernels reproduce them
bit-for-bit for round-to-nearest and in distribution for stochastic rounding (each backend has its
own random stream, reproducible from the caller's ``torch.Generator``). The data types and the
backend-independent helpers (:class:`~.reference.QuantizedTensor`, :func:`~.reference.pack`,
:mod:`.hadamard`) are exported here too, so callers import the whole API from this module.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

import torch

from . import reference as _ref
from .hadamard import hadamard_matrix, hadamard_transform, inverse_hadamard_transform
from .reference import NoiseIndex, NonFiniteError, QuantizedTensor, SUPPORTED_BITS, pack, unpack

__all__ = [
    "QuantizedTensor", "NonFiniteError", "NoiseIndex", "SUPPORTED_BITS",
    "quantize", "dequantize", "pack", "unpack",
    "hadamard_transform", "inverse_hadamard_transform", "hadamard_matrix",
    "quantize_partitions", "dequantize_partitions", "dequantize_sum_requantize", "dequantize_sum",
    "quantize_difference", "dequantize_add", "triton_available", "cpu_kernels_available",
    "backend_for", "count_nonfinite", "all_finite",
]

_TRITON_MOD = None
_TRITON_ERR: Optional[BaseException] = None


def _triton():
    """Import the Triton kernels once; return the module or None if triton is unusable."""
    global _TRITON_MOD, _TRITON_ERR
    if _TRITON_MOD is None and _TRITON_ERR is None:
        try:
            from . import triton_launch as mod  # noqa: WPS433 (lazy on purpose)
            _TRITON_MOD = mod
        except Exception as exc:  # triton missing or broken: fall back to torch
            _TRITON_ERR = exc
    return _TRITON_MOD


def triton_available() -> bool:
    """True if the Triton kernels can be imported in this process."""
    return _triton() is not None


_CPU_WARNED = False


def _cpu():
    """The C++ CPU kernels module if they build/load in this process, else None."""
    from . import cpu_kernels as mod  # noqa: WPS433 (lazy: importing it builds nothing)
    return mod if mod.available() else None


def cpu_kernels_available() -> bool:
    """True if the C++ CPU kernels are built and loaded (builds them on the first call)."""
    return _cpu() is not None


def _auto_cpu() -> str:
    global _CPU_WARNED
    if _cpu() is not None:
        return "cpp"
    if not _CPU_WARNED:
        _CPU_WARNED = True
        from . import cpu_kernels as mod
        logging.getLogger(__name__).warning(
            "C++ CPU quantization kernels unavailable (%r); using the slower torch reference. "
            "Install a C++ compiler and ninja (pip install ninja) to enable them.",
            mod.build_error())
    return "torch"


def backend_for(x: torch.Tensor) -> str:
    """'triton', 'cpp' or 'torch': the backend the public ops will use for a tensor like ``x``.

    See the module docstring for ``QUANT_KERNELS``. In ``auto`` mode the first CPU call builds
    (or loads from the cache) the C++ kernels.
    """
    mode = os.environ.get("QUANT_KERNELS", "auto").strip().lower()
    if mode == "torch":
        return "torch"
    if mode == "triton":
        if _triton() is None:
            raise RuntimeError(f"QUANT_KERNELS=triton but triton kernels cannot be imported: "
                               f"{_TRITON_ERR!r}")
        return "triton"
    if mode in ("cpp", "cpu"):
        if _cpu() is None:
            from . import cpu_kernels as mod
            raise RuntimeError(f"QUANT_KERNELS={mode} but the C++ CPU kernels cannot be built: "
                               f"{mod.build_error()!r}")
        return "cpp"
    if mode not in ("", "auto"):
        raise ValueError(f"QUANT_KERNELS must be 'auto', 'torch', 'triton' or 'cpp', got {mode!r}")
    if x.is_cuda:
        if _triton() is None:
            raise RuntimeError(
                f"the quantization kernels for CUDA tensors need triton, which cannot be imported "
                f"({_TRITON_ERR!r}); install the triton that matches your torch (pip install "
                f"triton), or set QUANT_KERNELS=torch to run the torch reference on the GPU "
                f"knowingly (several times slower, and its stochastic rounding draws noise on the "
                f"host)")
        return "triton"
    if x.device.type == "cpu":
        return _auto_cpu()
    return "torch"


def _impl(x: torch.Tensor):
    b = backend_for(x)
    if b == "triton":
        return _triton()
    if b == "cpp":
        return _cpu()
    return _ref


def count_nonfinite(x: torch.Tensor) -> int:
    """Number of NaN/Inf elements of ``x`` (one fused pass on the C++ backend)."""
    if backend_for(x) == "cpp":
        return _cpu().count_nonfinite(x)
    return int((~torch.isfinite(x)).sum().item())


def all_finite(x: torch.Tensor) -> bool:
    """``bool(torch.isfinite(x).all())``, without the bool temporary on the C++ backend."""
    if backend_for(x) == "cpp" and x.device.type == "cpu":
        return _cpu().count_nonfinite(x) == 0
    return bool(torch.isfinite(x).all())


def _count_nonfinite_into(counter: torch.Tensor, *tensors: torch.Tensor) -> None:
    """``counter += number of NaN/Inf in tensors`` for the backends without a fused count: the
    one-pass C++ counter on CPU, a device reduction elsewhere (never read back here)."""
    for x in tensors:
        if backend_for(x) == "cpp" and x.device.type == "cpu":
            counter.add_(count_nonfinite(x))
        else:
            counter.add_((~torch.isfinite(x)).sum().to(counter.dtype))


def _with_counter(x: torch.Tensor, counter: Optional[torch.Tensor], check_finite: bool,
                  *checked: torch.Tensor) -> dict:
    """Keyword arguments for a backend's quantize: the Triton kernels count the groups holding a
    NaN/Inf into ``counter`` in the same pass; the others get the elements counted here first."""
    if counter is None:
        return {"check_finite": check_finite}
    if backend_for(x) == "triton":
        return {"check_finite": False, "nonfinite_counter": counter}
    _count_nonfinite_into(counter, *checked)
    return {"check_finite": False}


def quantize(x: torch.Tensor, bits: int, group_size: int, *, stochastic: bool = True,
             generator: Optional[torch.Generator] = None, hadamard: bool = False,
             hadamard_block: int = 32, check_finite: bool = True,
             nonfinite_counter: Optional[torch.Tensor] = None) -> QuantizedTensor:
    """Group-wise symmetric quantization of the flattened ``x`` to ``bits`` (2, 4 or 8).

    Raises ValueError for unsupported bits / non-dividing group sizes / bad Hadamard blocks and
    :class:`NonFiniteError` if ``check_finite`` and ``x`` holds NaN/Inf. ``nonfinite_counter``
    (an int32 device tensor) replaces that check: a count that is positive exactly when ``x``
    holds a NaN/Inf is added to it on the device (the groups holding one, fused into the Triton
    kernel; the elements on the CPU backends) and nothing is read back -- the trainer's
    once-per-step agreement reads it.
    """
    return _impl(x).quantize(x, bits, group_size, stochastic=stochastic, generator=generator,
                             hadamard=hadamard, hadamard_block=hadamard_block,
                             **_with_counter(x, nonfinite_counter, check_finite, x))


def dequantize(q: QuantizedTensor, *, hadamard: bool = False, hadamard_block: int = 32,
               out_dtype: torch.dtype = torch.float32,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``code * scale`` (fp32) [-> inverse Hadamard], returned as ``out_dtype`` or written to ``out``."""
    return _impl(q.codes).dequantize(q, hadamard=hadamard, hadamard_block=hadamard_block,
                                     out_dtype=out_dtype, out=out)


def quantize_partitions(x: torch.Tensor, num_partitions: int, partition_order: Sequence[int],
                        bits: int, group_size: int, *, stochastic: bool = True,
                        generator: Optional[torch.Generator] = None, hadamard: bool = False,
                        hadamard_block: int = 32, check_finite: bool = True,
                        nonfinite_counter: Optional[torch.Tensor] = None) -> QuantizedTensor:
    """Fused [Hadamard ->] quantize -> pack -> destination-major write.

    ``x`` is ``num_partitions`` equal contiguous partitions; output slot j holds partition
    ``partition_order[j]`` (ready for ``all_to_all_single`` with equal splits).
    ``nonfinite_counter``: as in :func:`quantize`.
    """
    return _impl(x).quantize_partitions(
        x, num_partitions, partition_order, bits, group_size, stochastic=stochastic,
        generator=generator, hadamard=hadamard, hadamard_block=hadamard_block,
        **_with_counter(x, nonfinite_counter, check_finite, x))


def dequantize_partitions(q: QuantizedTensor, num_partitions: int,
                          partition_order: Sequence[int], *, hadamard: bool = False,
                          hadamard_block: int = 32, subtract_from: Optional[torch.Tensor] = None,
                          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The inverse of :func:`quantize_partitions`'s layout in one call: slot j dequantized
    [-> inverse Hadamard] into partition ``partition_order[j]`` of an fp32 result in the input
    layout; with ``subtract_from`` (fp32) the result is ``subtract_from - that`` (LoCo's residual
    ``h - sent``). ``out`` (fp32) may be ``subtract_from`` itself: then no fp32 buffer is made.
    Bit-identical to dequantizing each slot into its partition and subtracting."""
    return _impl(q.codes).dequantize_partitions(
        q, num_partitions, partition_order, hadamard=hadamard, hadamard_block=hadamard_block,
        subtract_from=subtract_from, out=out)


def dequantize_sum_requantize(q: QuantizedTensor, num_sources: int, bits_out: int, *,
                              group_size_out: Optional[int] = None, stochastic: bool = True,
                              generator: Optional[torch.Generator] = None,
                              noise_index: Optional[NoiseIndex] = None) -> QuantizedTensor:
    """Middle hop: dequantize ``num_sources`` equal chunks, fp32 sum in source order, requantize.
    ``noise_index``: the call is a pipeline chunk of a larger one and rounds like it
    (:class:`~.reference.NoiseIndex`)."""
    return _impl(q.codes).dequantize_sum_requantize(
        q, num_sources, bits_out, group_size_out=group_size_out, stochastic=stochastic,
        generator=generator, noise_index=noise_index)


def dequantize_sum(q: QuantizedTensor, num_sources: int, *, hadamard: bool = False,
                   hadamard_block: int = 32, out: Optional[torch.Tensor] = None,
                   scale: float = 1.0) -> torch.Tensor:
    """Final hop: dequantize + fp32 sum in source order [-> inverse Hadamard] * scale -> out."""
    return _impl(q.codes).dequantize_sum(q, num_sources, hadamard=hadamard,
                                         hadamard_block=hadamard_block, out=out, scale=scale)


def quantize_difference(new: torch.Tensor, reference: torch.Tensor, bits: int, group_size: int, *,
                        stochastic: bool = True, generator: Optional[torch.Generator] = None,
                        check_finite: bool = True,
                        nonfinite_counter: Optional[torch.Tensor] = None) -> QuantizedTensor:
    """qWD send side: quantize ``reference.dtype(new) - reference`` (subtraction in reference.dtype).
    ``nonfinite_counter``: as in :func:`quantize`, for the *difference*: every backend counts the
    groups whose scale came out non-finite (exactly the groups with a NaN/Inf difference), the
    Triton kernel in the same pass. Counting ``new`` and ``reference`` missed a
    difference that overflows the reference dtype (fp32 weights beyond fp16's range): NaN
    weights on every rank, and no skipped step."""
    if nonfinite_counter is None or backend_for(reference) == "triton":
        return _impl(reference).quantize_difference(
            new, reference, bits, group_size, stochastic=stochastic, generator=generator,
            **_with_counter(reference, nonfinite_counter, check_finite))
    q = _impl(reference).quantize_difference(new, reference, bits, group_size,
                                             stochastic=stochastic, generator=generator,
                                             check_finite=False)
    _count_nonfinite_into(nonfinite_counter, q.scales)
    return q


def dequantize_add(q: QuantizedTensor, reference: torch.Tensor, *,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """qWD receive side: ``reference.dtype(reference.dtype(code*scale) + reference)``."""
    return _impl(reference).dequantize_add(q, reference, out=out)
