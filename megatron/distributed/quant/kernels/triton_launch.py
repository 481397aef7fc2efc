"""The Triton backend's public ops: host launchers of the kernels in :mod:`.triton_device`.

Why a module of its own: this is what the backend switch (:mod:`.dispatch`, ``QUANT_KERNELS``)
loads for CUDA tensors -- the same functions, signatures and checks as :mod:`.reference` -- and it
decides everything a launch needs that is not device code: the tile and block sizes, the
``enable_fp_fusion=False`` launch option (bit parity, see :mod:`.triton_device`), the stochastic
rounding seed, the output buffers, and the NaN/Inf counter.

The stochastic rounding seed is drawn from the caller's ``torch.Generator`` with
``torch.randint`` (so the generator is consumed deterministically). NaN/Inf detection is fused:
the quantize kernels count the groups holding a NaN/Inf into an int32 counter with
``atomic_add``. The trainer passes its own device counter (``nonfinite_counter``), read once per
step; a call without one reads a private counter back and raises :class:`NonFiniteError` (one
small sync: for direct callers and tests).

The entry kernels are module globals here, looked up at every launch: ``bench/triton_aot.py``
swaps them for recorders to capture each launch's specialisation.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
import triton

from ..device_tables import slot_of
from . import reference as _ref
from .reference import NonFiniteError, QuantizedTensor
from .triton_device import (_dequant_add_kernel, _dequant_parts_kernel, _dsum_kernel,
                            _dsum_requant_kernel, _quantize_kernel)

# elements per program (rows * padded group); the interpreter prefers few large programs
_TILE = 4096


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _group_rows(group_size: int, block: int) -> bool:
    """Whether a block of ``block`` elements is whole groups, which the dequantizing kernels
    then load as rows (one run of packed bytes and one scale per group, ``ROWS``)."""
    return _pow2(group_size) and block % group_size == 0


def _rows_for(gp: int) -> int:
    return max(1, _TILE // gp)


QUANTIZE_WARPS = 4
"""Warps of a quantize program (a 4096-element tile: 32 elements per thread). Every bit width,
input dtype and Hadamard variant fits in 56-80 registers at 4 warps on sm_90 since the 2- and
4-bit tiles take the 8-bit tile's layout (the layout anchor in _quantize_kernel); 2-bit codes
once needed 8 warps (134-140 registers at 4). The values do not depend on it (a group's absmax
is exact in any order)."""

DIFFERENCE_MAXNREG = 128
"""Register ceiling of a quantize launch that takes a difference (qWD's send: new minus reference,
two input tiles, 64 loaded values a thread). Without one, ptxas 12.8 (Triton 3.6, torch 2.11's)
allocates 64 registers to the fp32 4-bit stochastic kernel on sm_90 and spills 4 B; given this
ceiling it allocates 57-82 to every difference kernel, no spill, within -1.0 to +0.3
instructions an element of before with Triton 3.6 and 3.9 (docs/performance.md, "The qWD send
without a spill under Triton 3.6"). The other quantize launches keep ptxas's own choice (a
ceiling moved all of them, for no spill to remove)."""


# ------------------------------------------------------------------------------------------------
# host wrappers (same signatures and checks as the reference)
# ------------------------------------------------------------------------------------------------

def _noise_rows_aligned(*sizes: int) -> bool:
    """Whether every tile row starts the random stream at a multiple of 8 and spans whole Philox
    calls (group size, padded group size and the noise index's part geometry all multiples of 8):
    then triton_device._noise_tile draws one Philox call per eight elements."""
    return all(v % 8 == 0 for v in sizes)


PERMUTE_MAX_GROUPS = 1 << 30
"""Groups a permuting quantize call may hold: its kernel finds a group's partition with
:func:`division_magic`, exact below 2^30 groups (1.4e11 elements at groups of 128). A
dequantize_partitions call of more groups takes its per-element path."""


def division_magic(d: int) -> Tuple[int, int]:
    """(m, p) with n // d == (n * m) >> p for every 0 <= n < 2^30 and m < 2^31 (Granlund and
    Montgomery's division by an invariant integer: p = 30 + ceil(log2 d), m = ceil(2^p / d),
    whose error m * d - 2^p < d <= 2^(p - 30) keeps the floor exact)."""
    if d < 1:
        raise ValueError(f"division_magic: divisor must be >= 1, got {d}")
    p = 30 + (d - 1).bit_length()
    return -(-(1 << p) // d), p


def _seed(stochastic: bool, generator: Optional[torch.Generator]) -> int:
    return _ref.draw_seed(generator, 0, 2 ** 31 - 1) if stochastic else 0


def _launch_quantize(x: torch.Tensor, ref: Optional[torch.Tensor], bits: int, group_size: int,
                     stochastic: bool, generator: Optional[torch.Generator], hadamard: bool,
                     hadamard_block: int, check_finite: bool, slots: Optional[torch.Tensor],
                     groups_per_part: int, what: str,
                     nonfinite_counter: Optional[torch.Tensor] = None) -> QuantizedTensor:
    """``nonfinite_counter`` (int32, on the device): the kernel adds the number of groups holding
    a NaN/Inf into it with its fused atomic count and nothing is read back (the caller agrees on
    it once per step); else with ``check_finite`` the count is read back here (one host sync) and
    raises."""
    numel = x.numel()
    ng = numel // group_size
    # a fresh allocation, 4-byte aligned: triton_device._store_packed writes whole int32 words
    codes = torch.empty(numel * bits // 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(ng, dtype=torch.float32, device=x.device)
    if nonfinite_counter is not None:
        if nonfinite_counter.dtype != torch.int32 or nonfinite_counter.device != x.device:
            raise ValueError(f"{what}: nonfinite_counter must be an int32 tensor on {x.device}, "
                             f"got {nonfinite_counter.dtype} on {nonfinite_counter.device}")
        counter = nonfinite_counter
    elif check_finite:
        counter = torch.zeros(1, dtype=torch.int32, device=x.device)
    else:
        counter = None
    gp = _next_pow2(group_size)
    rows = _rows_for(gp)
    seed = _seed(stochastic, generator)
    gpp = max(groups_per_part, 1)
    if slots is not None and ng >= PERMUTE_MAX_GROUPS:
        raise ValueError(f"{what}: {numel} elements in groups of {group_size} are {ng} groups; "
                         f"a permuting quantize takes fewer than {PERMUTE_MAX_GROUPS} (split the "
                         f"call)")
    magic, shift = division_magic(gpp)
    if ng > 0:
        _quantize_kernel[(triton.cdiv(ng, rows),)](
            x, ref if ref is not None else x, codes, scales,
            slots if slots is not None else _placeholder(x.device, torch.int32, 1),
            counter if counter is not None else _placeholder(x.device, torch.int32, 1),
            _placeholder(x.device, torch.uint8, rows * gp), seed, ng, gpp, magic, shift,
            GS=group_size, GP=gp, R=rows, BITS=bits, STOCHASTIC=bool(stochastic),
            HADAMARD=bool(hadamard), HB=hadamard_block if hadamard else 1,
            DIFF=ref is not None, PERMUTE=slots is not None, CHECK=counter is not None,
            ALIGNED=_noise_rows_aligned(group_size, gp), FULL=gp == group_size and ng % rows == 0,
            num_warps=QUANTIZE_WARPS, enable_fp_fusion=False,
            maxnreg=DIFFERENCE_MAXNREG if ref is not None else None)
    if check_finite and nonfinite_counter is None:
        bad = int(counter.item())
        if bad:
            raise NonFiniteError(
                f"{what}: input has non-finite (NaN/Inf) values in {bad} of its {ng} groups of "
                f"{group_size}; refusing to quantize (skip this step)")
    return QuantizedTensor(codes, scales, bits, group_size, numel)


def _contig_flat(x: torch.Tensor, what: str) -> torch.Tensor:
    return _ref._flat(x, what).contiguous()


def quantize(x: torch.Tensor, bits: int, group_size: int, *, stochastic: bool = True,
             generator: Optional[torch.Generator] = None, hadamard: bool = False,
             hadamard_block: int = 32, check_finite: bool = True,
             nonfinite_counter: Optional[torch.Tensor] = None) -> QuantizedTensor:
    """Triton version of :func:`reference.quantize` (``nonfinite_counter``: see
    :func:`_launch_quantize`)."""
    _ref._check_bits(bits)
    f = _contig_flat(x, "quantize")
    _ref._check_group(f.numel(), group_size, bits)
    if hadamard:
        _ref._check_hadamard(group_size, hadamard_block)
    return _launch_quantize(f, None, bits, group_size, stochastic, generator, hadamard,
                            hadamard_block, check_finite, None, 0, "quantize", nonfinite_counter)


def quantize_partitions(x: torch.Tensor, num_partitions: int, partition_order: Sequence[int],
                        bits: int, group_size: int, *, stochastic: bool = True,
                        generator: Optional[torch.Generator] = None, hadamard: bool = False,
                        hadamard_block: int = 32, check_finite: bool = True,
                        nonfinite_counter: Optional[torch.Tensor] = None) -> QuantizedTensor:
    """Triton version of :func:`reference.quantize_partitions` (one fused pass)."""
    _ref._check_bits(bits)
    f = _contig_flat(x, "quantize_partitions")
    _ref._check_partitions(f.numel(), num_partitions, group_size, "quantize_partitions")
    _ref._check_group(f.numel(), group_size, bits)
    if hadamard:
        _ref._check_hadamard(group_size, hadamard_block)
    order = _ref._check_order(partition_order, num_partitions)
    slots = slot_of(order, f.device)
    gpp = f.numel() // (num_partitions * group_size)
    return _launch_quantize(f, None, bits, group_size, stochastic, generator, hadamard,
                            hadamard_block, check_finite, slots, gpp, "quantize_partitions",
                            nonfinite_counter)


_PLACEHOLDERS: Dict[Tuple[str, torch.dtype], torch.Tensor] = {}


def _placeholder(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A zero tensor for a pointer argument the launch never reads or writes: no slot table and
    no count (int32, one element), or the target of the quantize kernel's never-executed layout
    anchor store (uint8, one program's tile, so even a store that ran would touch nothing else).
    One per device and dtype, grown to the largest size asked for: no allocation per call, and
    the same specialisation every time."""
    key = (str(device), dtype)
    t = _PLACEHOLDERS.get(key)
    if t is None or t.numel() < numel:
        t = _PLACEHOLDERS[key] = torch.zeros(numel, dtype=dtype, device=device)
    return t


def quantize_difference(new: torch.Tensor, reference: torch.Tensor, bits: int, group_size: int, *,
                        stochastic: bool = True, generator: Optional[torch.Generator] = None,
                        check_finite: bool = True,
                        nonfinite_counter: Optional[torch.Tensor] = None) -> QuantizedTensor:
    """Triton version of :func:`reference.quantize_difference` (no materialised difference)."""
    _ref._check_bits(bits)
    if new.numel() != reference.numel():
        raise ValueError(
            f"quantize_difference: new has {new.numel()} elements, reference {reference.numel()}")
    if not reference.is_floating_point():
        raise ValueError(f"quantize_difference: reference must be floating point, got {reference.dtype}")
    f = _contig_flat(new, "quantize_difference")
    r = _contig_flat(reference, "quantize_difference")
    _ref._check_group(f.numel(), group_size, bits)
    return _launch_quantize(f, r, bits, group_size, stochastic, generator, False, 1,
                            check_finite, None, 0, "quantize_difference", nonfinite_counter)


def _out_1d(out: torch.Tensor, numel: int, what: str) -> Optional[torch.Tensor]:
    """A 1-D (possibly strided) view of ``out`` the kernel can write, or None if impossible."""
    if out.numel() != numel:
        raise ValueError(f"{what}: out has {out.numel()} elements, expected {numel}")
    if not out.is_floating_point():
        raise ValueError(f"{what}: out must be a floating-point tensor, got {out.dtype}")
    if out.dim() == 1:
        return out
    if out.is_contiguous():
        return out.view(-1)
    return None


def _operands(q: QuantizedTensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes, fp32 scales) as the kernels read them: contiguous buffers. ``validate`` checks
    dtypes and sizes only, and a strided view read as a raw buffer would decode garbage (the
    other backends make both contiguous too). The codes start 4-byte aligned: the dequantizing
    kernels read 2- and 4-bit rows as int32 words (triton_device._word_rows); a view at an odd
    offset (never one of the trainer's buffers, whose groups are whole words) is copied. No copy
    when they already are both."""
    codes = q.codes.contiguous()
    if codes.data_ptr() % 4:
        codes = codes.clone()
    return codes, q.scales.to(torch.float32).contiguous()


def _launch_dsum(q: QuantizedTensor, num_sources: int, n: int, out1d: torch.Tensor,
                 hadamard: bool, hadamard_block: int, scale: float) -> None:
    block = max(_TILE, hadamard_block if hadamard else 1)
    if n > 0:
        codes, scales = _operands(q)
        _dsum_kernel[(triton.cdiv(n, block),)](
            codes, scales, out1d, out1d.stride(0) if out1d.numel() > 1 else 1, float(scale),
            n, S=num_sources, GS=q.group_size, BITS=q.bits, BLOCK=block, HADAMARD=bool(hadamard),
            HB=hadamard_block if hadamard else 1, HAS_SCALE=float(scale) != 1.0,
            ROWS=_group_rows(q.group_size, block), enable_fp_fusion=False)


def _dsum_into(q: QuantizedTensor, num_sources: int, n: int, out: Optional[torch.Tensor],
               out_dtype: torch.dtype, hadamard: bool, hadamard_block: int, scale: float,
               what: str) -> torch.Tensor:
    if out is None:
        res = torch.empty(n, dtype=out_dtype, device=q.codes.device)
        _launch_dsum(q, num_sources, n, res, hadamard, hadamard_block, scale)
        return res
    o1 = _out_1d(out, n, what)
    if o1 is None:  # exotic multi-dim strided view: compute then copy
        tmp = torch.empty(n, dtype=out.dtype, device=out.device)
        _launch_dsum(q, num_sources, n, tmp, hadamard, hadamard_block, scale)
        out.copy_(tmp.view(out.shape))
    else:
        _launch_dsum(q, num_sources, n, o1, hadamard, hadamard_block, scale)
    return out


def dequantize(q: QuantizedTensor, *, hadamard: bool = False, hadamard_block: int = 32,
               out_dtype: torch.dtype = torch.float32,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton version of :func:`reference.dequantize`."""
    q.validate()
    if hadamard:
        _ref._check_hadamard(q.group_size, hadamard_block)
    return _dsum_into(q, 1, q.numel, out, out_dtype, hadamard, hadamard_block, 1.0, "dequantize")


def dequantize_sum(q: QuantizedTensor, num_sources: int, *, hadamard: bool = False,
                   hadamard_block: int = 32, out: Optional[torch.Tensor] = None,
                   scale: float = 1.0) -> torch.Tensor:
    """Triton version of :func:`reference.dequantize_sum` (one fused pass into ``out``)."""
    n = _ref._check_dequantize_sum(q, num_sources, hadamard, hadamard_block)
    return _dsum_into(q, num_sources, n, out, torch.float32, hadamard, hadamard_block, scale,
                      "dequantize_sum")


def dequantize_sum_requantize(q: QuantizedTensor, num_sources: int, bits_out: int, *,
                              group_size_out: Optional[int] = None, stochastic: bool = True,
                              generator: Optional[torch.Generator] = None,
                              noise_index: Optional[_ref.NoiseIndex] = None) -> QuantizedTensor:
    """Triton version of :func:`reference.dequantize_sum_requantize` (no fp32 intermediate)."""
    n, gs = _ref._check_dequantize_sum_requantize(q, num_sources, bits_out, group_size_out,
                                                  noise_index)
    part_len, part_stride, base = ((max(n, 1), 0, 0) if noise_index is None else
                                   (noise_index.part_len, noise_index.part_stride,
                                    noise_index.base))
    ng = n // gs
    dev = q.codes.device
    # a fresh allocation, 4-byte aligned: triton_device._store_packed writes whole int32 words
    codes = torch.empty(n * bits_out // 8, dtype=torch.uint8, device=dev)
    scales = torch.empty(ng, dtype=torch.float32, device=dev)
    gp = _next_pow2(gs)
    rows = _rows_for(gp)
    seed = _seed(stochastic, generator)
    if ng > 0:
        src_codes, src_scales = _operands(q)
        _dsum_requant_kernel[(triton.cdiv(ng, rows),)](
            src_codes, src_scales, codes, scales, seed, n, ng, part_len, part_stride, base,
            S=num_sources, GS_IN=q.group_size, BITS_IN=q.bits, GS=gs, GP=gp, R=rows,
            BITS=bits_out, STOCHASTIC=bool(stochastic),
            ALIGNED=_noise_rows_aligned(gs, gp, part_len, part_stride, base),
            ROWS=gp == gs and q.group_size % gs == 0, enable_fp_fusion=False)
    return QuantizedTensor(codes, scales, bits_out, gs, n)


def dequantize_partitions(q: QuantizedTensor, num_partitions: int,
                          partition_order: Sequence[int], *, hadamard: bool = False,
                          hadamard_block: int = 32, subtract_from: Optional[torch.Tensor] = None,
                          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton version of :func:`reference.dequantize_partitions`: one launch for every slot (the
    slot table of :func:`quantize_partitions`), the subtraction fused; ``out`` may be
    ``subtract_from``."""
    order = _ref._check_dequantize_partitions(q, num_partitions, partition_order, hadamard,
                                              hadamard_block, subtract_from, out)
    n = q.numel
    dev = q.codes.device
    sub = None
    if subtract_from is not None:
        sub = subtract_from.reshape(-1)
        if not sub.is_contiguous():
            sub = sub.contiguous()
    direct = (out is not None and out.is_contiguous()
              and (sub is None or out.data_ptr() == sub.data_ptr() or not _ref._overlaps(out, sub)))
    target = out.view(-1) if direct else torch.empty(n, dtype=torch.float32, device=dev)
    block = max(_TILE, hadamard_block if hadamard else 1)
    ng = n // q.group_size
    # whole group rows, their partition by division_magic (exact below PERMUTE_MAX_GROUPS);
    # larger calls take the per-element path, which divides in int64
    rows = _group_rows(q.group_size, block) and ng < PERMUTE_MAX_GROUPS
    magic, shift = division_magic(max(ng // num_partitions, 1))
    if n > 0:
        codes, scales = _operands(q)
        _dequant_parts_kernel[(triton.cdiv(n, block),)](
            codes, scales, slot_of(order, dev), sub if sub is not None else target, target, n,
            n // num_partitions, magic, shift, GS=q.group_size, BITS=q.bits, BLOCK=block,
            HADAMARD=bool(hadamard), HB=hadamard_block if hadamard else 1, SUB=sub is not None,
            ROWS=rows, enable_fp_fusion=False)
    if out is None:
        return target
    if not direct:
        out.copy_(target.view(out.shape))
    return out


def _dequant_add_rows(group_size: int, block: int, reference: torch.Tensor) -> bool:
    """Whether the qWD receive loads whole groups as rows (one run of packed bytes and one scale
    per group): for 2-byte weights (bf16 / fp16), whose per-element byte and scale loads made it
    issue bound (bf16 4-bit groups of 2048: 73 -> 78 % of copy bandwidth modelled on sm_90). fp32
    weights stay per element: memory bound there already (99 %), and rows of 8-bit codes spill
    20 B on sm_90."""
    return _group_rows(group_size, block) and reference.element_size() == 2


def dequantize_add(q: QuantizedTensor, reference: torch.Tensor, *,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton version of :func:`reference.dequantize_add`; ``out`` may alias ``reference``."""
    q.validate()
    if reference.numel() != q.numel:
        raise ValueError(f"dequantize_add: reference has {reference.numel()} elements, q {q.numel}")
    if not reference.is_floating_point():
        raise ValueError(f"dequantize_add: reference must be floating point, got {reference.dtype}")
    n = q.numel
    r = reference.reshape(-1)
    if not r.is_contiguous():
        r = r.contiguous()
    if out is not None and out.numel() != n:
        raise ValueError(f"dequantize_add: out has {out.numel()} elements, expected {n}")
    # out may be reference itself (each element read before written), not overlap it partly
    direct = (out is not None and out.dtype == reference.dtype and out.is_contiguous()
              and (out.data_ptr() == r.data_ptr() or not _ref._overlaps(out, r)))
    target = (out.view(-1) if direct
              else torch.empty(n, dtype=reference.dtype, device=reference.device))
    codes, scales = _operands(q)
    block = _TILE
    if n > 0:
        _dequant_add_kernel[(triton.cdiv(n, block),)](
            codes, scales, r, target, n, GS=q.group_size, BITS=q.bits, BLOCK=block,
            ROWS=_dequant_add_rows(q.group_size, block, r), enable_fp_fusion=False)
    if out is None:
        return target.view(reference.shape)
    if not direct:
        out.copy_(target.view(out.shape))
    return out
