"""Fused C++ CPU backend of the quantization kernels (same public ops as :mod:`.reference`).

``cpu_kernels.cpp`` is compiled at first use with :func:`torch.utils.cpp_extension.load` (needs a
C++ compiler and ``ninja``) into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), so it compiles once per machine and source version; concurrent
processes are serialised by cpp_extension's file lock and then all load the same library. The
library has a plain C ABI (no torch headers: the build takes seconds) and is called through
:mod:`ctypes` with raw pointers. On x86-64 machines whose torch reports AVX2/AVX512 it is built
with ``-mavx2 -mfma -mf16c`` (the ISA is part of the library name, so a shared cache never hands
an AVX2 build to an older CPU); everything is built with ``-ffp-contract=off`` so that no FMA
changes the fp32 results.

Numerics (see ``cpu_kernels.cpp``): round-to-nearest results are bit-identical to the reference
(NaN payloads of bf16 outputs aside); stochastic rounding is unbiased and reproducible — one
64-bit seed per call is drawn from the caller's ``torch.Generator`` (``torch.randint``), and a
counter-based hash of (seed, element index) replaces ``torch.rand``. So a seeded generator gives
identical reruns and the generator's saved state covers the stream, but the draws differ from the
reference's ``torch.rand`` ones (equal in distribution only). Validation reuses the reference's
``_check_*`` helpers in the reference's order, so errors are identical; ``NonFiniteError`` is
raised with the reference's message (count of NaN/Inf in the input), after restoring the
generator's state so the failed call consumes no randomness (as in the reference).

Single-threaded (the trainer's ranks run with ``OMP_NUM_THREADS=1``). Inputs of dtypes other
than float32 / bfloat16 / float16, and non-CPU tensors, are handed to the reference.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..device_tables import inverse_order
from . import reference as _ref
from .reference import NonFiniteError, QuantizedTensor

__all__ = [
    "available", "build_error", "library_path", "quantize", "dequantize", "quantize_partitions",
    "dequantize_sum_requantize", "dequantize_sum", "dequantize_partitions", "quantize_difference",
    "dequantize_add", "count_nonfinite",
]

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("cpu_kernels.cpp")
_ABI_VERSION = 3
_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_LOCK = threading.Lock()
_LIB: Optional[ctypes.CDLL] = None
_LIB_PATH: Optional[str] = None
_ERR: Optional[BaseException] = None


def _isa() -> str:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic"
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover - very old torch
        cap = "DEFAULT"
    return "avx2" if cap in ("AVX2", "AVX512") else "generic"


_STALE_LOCK_S = 600.0   # the build takes seconds; a lock this old was left by a killed process


def _clear_stale_lock(cpp_extension, name: str) -> None:
    """cpp_extension serialises concurrent builds with a lock file and waits for it *forever*; a
    process killed mid-build (e.g. a rank hitting a timeout) leaves it behind. Remove such a lock
    when it is clearly stale."""
    import time

    try:
        lock = Path(cpp_extension._get_build_directory(name, False)) / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            log.warning("removing stale cpp_extension lock %s", lock)
            lock.unlink()
    except OSError:
        pass


def _build() -> ctypes.CDLL:
    import shutil

    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # pip's ninja wheel may live outside PATH (user installs)
        try:
            import ninja  # noqa: F401
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except (ImportError, AttributeError):
            pass
    cpp_extension.verify_ninja_availability()       # RuntimeError with a clear message if missing
    isa = _isa()
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
    if isa == "avx2":
        flags += ["-mavx2", "-mfma", "-mf16c"]
    name = f"sdp4bit_quant_cpu_{isa}"
    _clear_stale_lock(cpp_extension, name)
    path = cpp_extension.load(name=name, sources=[str(_SRC)],
                              extra_cflags=flags, is_python_module=False, with_cuda=False,
                              verbose=False)
    if not isinstance(path, str):  # older torch returns None: find the library ourselves
        build_dir = cpp_extension._get_build_directory(name, False)
        cands = sorted(Path(build_dir).glob("*.so"), key=lambda p: p.stat().st_mtime)
        if not cands:
            raise RuntimeError(f"cpp_extension built nothing in {build_dir}")
        path = str(cands[-1])
    lib = ctypes.CDLL(path)
    if lib.sdp4bit_cpu_abi_version() != _ABI_VERSION:
        raise RuntimeError(f"{path}: ABI version {lib.sdp4bit_cpu_abi_version()} != {_ABI_VERSION}")
    P, I, I64, U64, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint64, ctypes.c_float
    lib.sdp4bit_quantize.restype = I64
    lib.sdp4bit_quantize.argtypes = [P, I, P, I, I64, I, I64, I, U64, I64, P, I64, I, P, P]
    lib.sdp4bit_dsum_requant.restype = None
    lib.sdp4bit_dsum_requant.argtypes = [P, P, I, I64, I64, I64, I, I64, I, U64, I64, I64, I64,
                                         P, P]
    lib.sdp4bit_dsum.restype = None
    lib.sdp4bit_dsum.argtypes = [P, P, I, I64, I64, I64, I64, I, F, I, P, I]
    lib.sdp4bit_dequant_parts.restype = None
    lib.sdp4bit_dequant_parts.argtypes = [P, P, I, I64, I64, P, I64, I64, P, P]
    lib.sdp4bit_dequant_add.restype = None
    lib.sdp4bit_dequant_add.argtypes = [P, P, I, I64, I64, P, I, P]
    lib.sdp4bit_count_nonfinite.restype = I64
    lib.sdp4bit_count_nonfinite.argtypes = [P, I, I64]
    global _LIB_PATH
    _LIB_PATH = path
    return lib


def _lib() -> Optional[ctypes.CDLL]:
    """Build/load the library once per process; None (and ``build_error()``) if impossible."""
    global _LIB, _ERR
    if _LIB is None and _ERR is None:
        with _LOCK:
            if _LIB is None and _ERR is None:
                try:
                    _LIB = _build()
                except Exception as exc:  # compiler/ninja missing, build failure, ...
                    _ERR = exc
    return _LIB


def available() -> bool:
    """True if the C++ kernels are built and loaded in this process (builds them on first call)."""
    return _lib() is not None


def build_error() -> Optional[BaseException]:
    """Why the C++ kernels are unavailable (None if they loaded or were never tried)."""
    return _ERR


def library_path() -> Optional[str]:
    """Path of the loaded shared library (None before the first successful build)."""
    return _LIB_PATH


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _require() -> ctypes.CDLL:
    lib = _lib()
    if lib is None:
        raise RuntimeError(f"the C++ CPU quantization kernels cannot be built: {_ERR!r}")
    return lib


def _ok(*tensors: torch.Tensor) -> bool:
    """All tensors on CPU with a dtype the C++ kernels handle (else: use the reference)."""
    _require()
    return all(t.device.type == "cpu" and t.dtype in _DT for t in tensors)


def _gen_state(generator: Optional[torch.Generator]) -> torch.Tensor:
    return (generator if generator is not None else torch.default_generator).get_state()


def _set_gen_state(generator: Optional[torch.Generator], state: torch.Tensor) -> None:
    (generator if generator is not None else torch.default_generator).set_state(state)


def _seed(stochastic: bool, generator: Optional[torch.Generator]) -> int:
    """One 64-bit draw from the caller's generator per call (0 for round-to-nearest)."""
    if not stochastic:
        return 0
    return _ref.draw_seed(generator, -2 ** 63, 2 ** 63 - 1) & 0xFFFFFFFFFFFFFFFF


def _nonfinite_error(bad: int, numel: int, what: str) -> NonFiniteError:
    return NonFiniteError(
        f"{what}: input has {bad} non-finite (NaN/Inf) value(s) out of {numel}; "
        f"refusing to quantize (skip this step)")


def _run_quantize(f: torch.Tensor, r: Optional[torch.Tensor], bits: int, group_size: int,
                  stochastic: bool, generator: Optional[torch.Generator], hb: int,
                  check_finite: bool, slot_of: Optional[torch.Tensor],
                  groups_per_part: int) -> QuantizedTensor:
    lib = _LIB
    numel = f.numel()
    codes = torch.empty(numel * bits // 8, dtype=torch.uint8)
    scales = torch.empty(numel // group_size, dtype=torch.float32)
    state = _gen_state(generator) if (stochastic and check_finite) else None
    seed = _seed(stochastic, generator)
    bad = lib.sdp4bit_quantize(
        f.data_ptr(), _DT[f.dtype], _ptr(r), _DT[r.dtype] if r is not None else 0, numel, bits,
        group_size, int(bool(stochastic)), seed, hb, _ptr(slot_of), groups_per_part,
        int(bool(check_finite)), codes.data_ptr(), scales.data_ptr())
    if bad:
        if state is not None:
            _set_gen_state(generator, state)   # the reference raises before drawing anything
        raise _nonfinite_error(bad, numel, "quantize")
    return QuantizedTensor(codes, scales, bits, group_size, numel)


def _qparts(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q.codes.reshape(-1).contiguous(), q.scales.reshape(-1).to(torch.float32).contiguous()


def _dsum_raw(q: QuantizedTensor, num_sources: int, n: int, hb: int, scale: float,
              assign_first: bool, out: torch.Tensor) -> None:
    codes, scales = _qparts(q)
    _LIB.sdp4bit_dsum(codes.data_ptr(), scales.data_ptr(), q.bits, q.group_size, n, num_sources,
                      hb, int(float(scale) != 1.0), float(scale), int(assign_first),
                      out.data_ptr(), 0 if out.dtype == torch.float32 else 1)


def _direct_target(out: torch.Tensor, dtypes: Sequence[torch.dtype]) -> bool:
    return out.dtype in dtypes and out.is_contiguous() and out.device.type == "cpu"


# ------------------------------------------------------------------------------------------------
# public ops (signatures and validation of reference.py)
# ------------------------------------------------------------------------------------------------

def quantize(x: torch.Tensor, bits: int, group_size: int, *, stochastic: bool = True,
             generator: Optional[torch.Generator] = None, hadamard: bool = False,
             hadamard_block: int = 32, check_finite: bool = True) -> QuantizedTensor:
    """C++ version of :func:`reference.quantize` (one pass: load, [FWHT], absmax, round, pack)."""
    _ref._check_bits(bits)
    f = _ref._flat(x, "quantize")
    _ref._check_group(f.numel(), group_size, bits)
    if hadamard:
        _ref._check_hadamard(group_size, hadamard_block)
    if not _ok(f):
        return _ref.quantize(x, bits, group_size, stochastic=stochastic, generator=generator,
                             hadamard=hadamard, hadamard_block=hadamard_block,
                             check_finite=check_finite)
    return _run_quantize(f.contiguous(), None, bits, group_size, stochastic, generator,
                         hadamard_block if hadamard else 0, check_finite, None, 1)


def quantize_partitions(x: torch.Tensor, num_partitions: int, partition_order: Sequence[int],
                        bits: int, group_size: int, *, stochastic: bool = True,
                        generator: Optional[torch.Generator] = None, hadamard: bool = False,
                        hadamard_block: int = 32, check_finite: bool = True) -> QuantizedTensor:
    """C++ version of :func:`reference.quantize_partitions` (fused slot permutation)."""
    _ref._check_bits(bits)
    f = _ref._flat(x, "quantize_partitions")
    _ref._check_partitions(f.numel(), num_partitions, group_size, "quantize_partitions")
    order = _ref._check_order(partition_order, num_partitions)
    _ref._check_group(f.numel(), group_size, bits)
    if hadamard:
        _ref._check_hadamard(group_size, hadamard_block)
    if not _ok(f):
        return _ref.quantize_partitions(
            x, num_partitions, order, bits, group_size, stochastic=stochastic,
            generator=generator, hadamard=hadamard, hadamard_block=hadamard_block,
            check_finite=check_finite)
    slots = torch.tensor(inverse_order(order), dtype=torch.int64)
    gpp = f.numel() // (num_partitions * group_size)
    return _run_quantize(f.contiguous(), None, bits, group_size, stochastic, generator,
                         hadamard_block if hadamard else 0, check_finite, slots, max(gpp, 1))


def quantize_difference(new: torch.Tensor, reference: torch.Tensor, bits: int, group_size: int, *,
                        stochastic: bool = True, generator: Optional[torch.Generator] = None,
                        check_finite: bool = True) -> QuantizedTensor:
    """C++ version of :func:`reference.quantize_difference` (difference never materialised)."""
    if new.numel() != reference.numel():
        raise ValueError(
            f"quantize_difference: new has {new.numel()} elements, reference {reference.numel()}")
    if not reference.is_floating_point():
        raise ValueError(f"quantize_difference: reference must be floating point, got {reference.dtype}")
    if not _ok(new, reference):
        return _ref.quantize_difference(new, reference, bits, group_size, stochastic=stochastic,
                                        generator=generator, check_finite=check_finite)
    _ref._check_bits(bits)
    _ref._check_group(new.numel(), group_size, bits)
    f = new.reshape(-1).contiguous()
    r = reference.reshape(-1).contiguous()
    return _run_quantize(f, r, bits, group_size, stochastic, generator, 0, check_finite, None, 1)


def dequantize(q: QuantizedTensor, *, hadamard: bool = False, hadamard_block: int = 32,
               out_dtype: torch.dtype = torch.float32,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """C++ version of :func:`reference.dequantize`."""
    q.validate()
    if hadamard:
        _ref._check_hadamard(q.group_size, hadamard_block)
    if not _ok(q.scales) or q.codes.device.type != "cpu":
        return _ref.dequantize(q, hadamard=hadamard, hadamard_block=hadamard_block,
                               out_dtype=out_dtype, out=out)
    n = q.numel
    hb = hadamard_block if hadamard else 0
    if out is None:
        res = torch.empty(n, dtype=torch.float32)
        _dsum_raw(q, 1, n, hb, 1.0, True, res)
        return res if out_dtype == torch.float32 else res.to(out_dtype)
    if out.numel() != n:
        raise ValueError(f"dequantize: out has {out.numel()} elements, expected {n}")
    if _direct_target(out, (torch.float32,)):
        _dsum_raw(q, 1, n, hb, 1.0, True, out)
        return out
    tmp = torch.empty(n, dtype=torch.float32)
    _dsum_raw(q, 1, n, hb, 1.0, True, tmp)
    out.copy_(tmp.view(out.shape))
    return out


def dequantize_sum(q: QuantizedTensor, num_sources: int, *, hadamard: bool = False,
                   hadamard_block: int = 32, out: Optional[torch.Tensor] = None,
                   scale: float = 1.0) -> torch.Tensor:
    """C++ version of :func:`reference.dequantize_sum` (one pass into ``out``)."""
    n = _ref._check_dequantize_sum(q, num_sources, hadamard, hadamard_block)
    if not _ok(q.scales) or q.codes.device.type != "cpu":
        return _ref.dequantize_sum(q, num_sources, hadamard=hadamard,
                                   hadamard_block=hadamard_block, out=out, scale=scale)
    hb = hadamard_block if hadamard else 0
    if out is None:
        res = torch.empty(n, dtype=torch.float32)
        _dsum_raw(q, num_sources, n, hb, scale, False, res)
        return res
    if out.numel() != n:
        raise ValueError(f"dequantize_sum: out has {out.numel()} elements, expected {n}")
    if _direct_target(out, (torch.float32,)):
        _dsum_raw(q, num_sources, n, hb, scale, False, out)
        return out
    tmp = torch.empty(n, dtype=torch.float32)
    _dsum_raw(q, num_sources, n, hb, scale, False, tmp)
    out.copy_(tmp.view(out.shape))
    return out


def dequantize_sum_requantize(q: QuantizedTensor, num_sources: int, bits_out: int, *,
                              group_size_out: Optional[int] = None, stochastic: bool = True,
                              generator: Optional[torch.Generator] = None,
                              noise_index: Optional[_ref.NoiseIndex] = None) -> QuantizedTensor:
    """C++ version of :func:`reference.dequantize_sum_requantize` (no fp32 intermediate)."""
    n, gs = _ref._check_dequantize_sum_requantize(q, num_sources, bits_out, group_size_out,
                                                  noise_index)
    if not _ok(q.scales) or q.codes.device.type != "cpu":
        return _ref.dequantize_sum_requantize(q, num_sources, bits_out, group_size_out=gs,
                                              stochastic=stochastic, generator=generator,
                                              noise_index=noise_index)
    codes_in, scales_in = _qparts(q)
    codes = torch.empty(n * bits_out // 8, dtype=torch.uint8)
    scales = torch.empty(n // gs, dtype=torch.float32)
    seed = _seed(stochastic, generator)
    _LIB.sdp4bit_dsum_requant(codes_in.data_ptr(), scales_in.data_ptr(), q.bits, q.group_size, n,
                              num_sources, bits_out, gs, int(bool(stochastic)), seed,
                              *_noise_map(noise_index, n), codes.data_ptr(), scales.data_ptr())
    return QuantizedTensor(codes, scales, bits_out, gs, n)


def _noise_map(noise_index: Optional[_ref.NoiseIndex], n: int) -> tuple:
    """(part_len, part_stride, base) of the kernels' noise index map; the identity without one."""
    if noise_index is None:
        return (max(n, 1), 0, 0)
    return (noise_index.part_len, noise_index.part_stride, noise_index.base)


def dequantize_partitions(q: QuantizedTensor, num_partitions: int,
                          partition_order: Sequence[int], *, hadamard: bool = False,
                          hadamard_block: int = 32, subtract_from: Optional[torch.Tensor] = None,
                          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """C++ version of :func:`reference.dequantize_partitions` (one pass over every slot, the
    subtraction fused; ``out`` may be ``subtract_from``)."""
    order = _ref._check_dequantize_partitions(q, num_partitions, partition_order, hadamard,
                                              hadamard_block, subtract_from, out)
    if (not _ok(q.scales) or q.codes.device.type != "cpu"
            or (subtract_from is not None and not _ok(subtract_from))):
        return _ref.dequantize_partitions(q, num_partitions, order, hadamard=hadamard,
                                          hadamard_block=hadamard_block,
                                          subtract_from=subtract_from, out=out)
    n = q.numel
    codes, scales = _qparts(q)
    sub = None
    if subtract_from is not None:
        sub = subtract_from.reshape(-1)
        if not sub.is_contiguous():
            sub = sub.contiguous()
    direct = (out is not None and _direct_target(out, (torch.float32,))
              and (sub is None or out.data_ptr() == sub.data_ptr() or not _ref._overlaps(out, sub)))
    target = out.view(-1) if direct else torch.empty(n, dtype=torch.float32)
    slots = torch.tensor(inverse_order(order), dtype=torch.int64)
    _LIB.sdp4bit_dequant_parts(codes.data_ptr(), scales.data_ptr(), q.bits, q.group_size, n,
                               slots.data_ptr(), n // num_partitions,
                               hadamard_block if hadamard else 0, _ptr(sub), target.data_ptr())
    if out is None:
        return target
    if not direct:
        out.copy_(target.view(out.shape))
    return out


def dequantize_add(q: QuantizedTensor, reference: torch.Tensor, *,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """C++ version of :func:`reference.dequantize_add`; ``out`` may alias ``reference``."""
    q.validate()
    if reference.numel() != q.numel:
        raise ValueError(f"dequantize_add: reference has {reference.numel()} elements, q {q.numel}")
    if not _ok(reference, q.scales) or q.codes.device.type != "cpu":
        return _ref.dequantize_add(q, reference, out=out)
    n = q.numel
    codes, scales = _qparts(q)
    r = reference.reshape(-1)
    if not r.is_contiguous():
        r = r.contiguous()
    if out is not None and out.numel() != n:
        raise ValueError(f"dequantize_add: out has {out.numel()} elements, expected {n}")
    direct = (out is not None and _direct_target(out, (reference.dtype,))
              and (out.data_ptr() == r.data_ptr() or not _ref._overlaps(out, r)))
    target = out.view(-1) if direct else torch.empty(n, dtype=reference.dtype)
    _LIB.sdp4bit_dequant_add(codes.data_ptr(), scales.data_ptr(), q.bits, q.group_size, n,
                             r.data_ptr(), _DT[reference.dtype], target.data_ptr())
    if out is None:
        return target.view(reference.shape)
    if not direct:
        out.copy_(target.view(out.shape))
    return out


def count_nonfinite(x: torch.Tensor) -> int:
    """Number of NaN/Inf elements of ``x`` (one pass, no temporaries)."""
    if _lib() is None or not _ok(x):
        return int((~torch.isfinite(x)).sum().item())
    f = x.reshape(-1)
    if not f.is_contiguous():
        f = f.contiguous()
    return int(_LIB.sdp4bit_count_nonfinite(f.data_ptr(), _DT[f.dtype], f.numel()))
