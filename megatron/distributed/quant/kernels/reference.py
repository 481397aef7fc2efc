"""Pure-PyTorch reference implementation of the group-wise symmetric quantizer.

This module is the numerical definition of every kernel in this package: the Triton kernels in
``triton_device.py`` reproduce these fp32 operations in the same order, so that round-to-nearest
results are bit-identical and stochastic rounding matches in distribution.  It also runs on any
device (CPU included), which is what the unit tests and CPU/gloo users rely on.

Numerics (SDP4Bit spec §2, with the deviations noted):

* ``qmax = 2**(bits-1) - 1``; per group ``amax = max |x|`` in fp32.
* ``inv = qmax / amax`` (fp32), ``scale = 1 / inv`` (fp32), ``v = x * inv``.  This is the
  SDP4Bit formula (``1/(qmax/amax)`` may differ from ``amax/qmax`` by one ulp).
* A group whose ``qmax/amax`` is not finite (``amax == 0`` or ``amax`` below ~1e-37) gets
  ``scale = 0`` and all codes 0, so it dequantizes to exactly 0 and never produces NaN.
  A group containing NaN/Inf (only reachable with ``check_finite=False``) gets ``scale = NaN`` and
  codes 0, so the NaN survives dequantization instead of silently becoming a finite number.
* Stochastic rounding: ``floor(v) + (u < v - floor(v))`` with ``u ~ U[0, 1)`` drawn with
  ``torch.rand`` in input element order (so a permuted layout draws the same ``u`` per element).
  Round to nearest: ``floor(v) + (v - floor(v) >= 0.5)`` (ties away from -inf); written this way,
  rather than ``torch.round``, because it is trivially reproducible in Triton.
* Codes are clamped to ``[-2**(bits-1), qmax]`` and packed MSB-first (§2.6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from ..device_tables import slot_of

SUPPORTED_BITS = (2, 4, 8)  # the one definition: config.py (flag validation) imports it


@dataclass
class QuantizedTensor:
    """Packed codes plus one fp32 scale per group.

    ``codes`` is uint8: 8-bit = one two's-complement code per byte; 4-bit = two codes per byte
    (element 2i in the high nibble); 2-bit = four per byte (element 4i in the highest two bits).
    The dequantized value of element i is ``code[i] * scales[i // group_size]``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    group_size: int
    numel: int

    @property
    def num_groups(self) -> int:
        """Number of quantization groups (= ``scales.numel()`` for a well-formed tensor)."""
        return self.numel // self.group_size

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (codes + scales), used for communication accounting."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4

    @staticmethod
    def wire_bytes(numel: int, bits: int, group_size: int) -> int:
        """:attr:`nbytes` of a valid tensor of ``numel`` elements, before it exists (the
        collectives account for a transfer in the caller's thread, the stages build it later)."""
        return numel * bits // 8 + numel // group_size * 4

    def validate(self) -> None:
        """Raise ValueError if the fields are inconsistent (cheap shape checks only)."""
        _check_bits(self.bits)
        _check_group(self.numel, self.group_size, self.bits)
        if self.codes.dtype != torch.uint8:
            raise ValueError(f"QuantizedTensor.codes must be uint8, got {self.codes.dtype}")
        if self.codes.numel() != self.numel * self.bits // 8:
            raise ValueError(
                f"QuantizedTensor.codes has {self.codes.numel()} bytes, expected "
                f"{self.numel * self.bits // 8} for numel={self.numel}, bits={self.bits}")
        if self.scales.numel() != self.num_groups:
            raise ValueError(
                f"QuantizedTensor.scales has {self.scales.numel()} entries, expected "
                f"{self.num_groups} (numel={self.numel}, group_size={self.group_size})")


class NonFiniteError(ValueError):
    """The tensor to quantize contains NaN/Inf; the caller is expected to skip the step."""


# ------------------------------------------------------------------------------------------------
# argument checks (shared with the Triton path so both raise identical errors)
# ------------------------------------------------------------------------------------------------

def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def _check_group(numel: int, group_size: int, bits: int) -> None:
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if numel % group_size != 0:
        raise ValueError(
            f"numel {numel} is not divisible by group_size {group_size}; pad the buffer to a "
            f"multiple of the group size")
    if (group_size * bits) % 8 != 0:
        # every group must start on a byte boundary so groups/partitions can be sliced and
        # permuted as whole bytes
        raise ValueError(
            f"group_size {group_size} * bits {bits} must be a multiple of 8 (groups must occupy "
            f"whole bytes)")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of contiguous ``a`` and ``b`` overlaps (an ``out`` that partly aliases
    an input must not be written while the kernel still reads it; exact aliasing is fine where a
    kernel reads each element before writing it)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + a.numel() * a.element_size()
    b1 = b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


HADAMARD_MAX_BLOCK = 1024
"""Largest Hadamard block every backend computes: the Triton butterfly is unrolled up to stride
512 (``triton_device._fwht``); a larger block would skip stages there. Checked here, for all
backends, and by the config for ``--hadamard-block-size``."""


def _check_hadamard(group_size: int, block: int) -> None:
    if not isinstance(block, int) or block < 1 or (block & (block - 1)) != 0:
        raise ValueError(f"hadamard_block must be a power of two, got {block!r}")
    if block > HADAMARD_MAX_BLOCK:
        raise ValueError(f"hadamard_block {block} is larger than {HADAMARD_MAX_BLOCK}, the largest "
                         f"block the kernels transform")
    if group_size % block != 0:
        raise ValueError(
            f"group_size {group_size} must be a multiple of hadamard_block {block} (the "
            f"transform works on aligned blocks inside each group)")


def _check_finite(x: torch.Tensor, what: str) -> None:
    if bool(torch.isfinite(x).all()):
        return
    bad = int((~torch.isfinite(x)).sum().item())
    if bad:
        raise NonFiniteError(
            f"{what}: input has {bad} non-finite (NaN/Inf) value(s) out of {x.numel()}; "
            f"refusing to quantize (skip this step)")


def _flat(x: torch.Tensor, what: str) -> torch.Tensor:
    if not x.is_floating_point():
        raise ValueError(f"{what}: expected a floating-point tensor, got {x.dtype}")
    return x.reshape(-1)


def _qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


# ------------------------------------------------------------------------------------------------
# packing
# ------------------------------------------------------------------------------------------------

def pack(codes_int8: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack int8 codes in ``[-2**(bits-1), 2**(bits-1)-1]`` into uint8, MSB-first."""
    _check_bits(bits)
    c = codes_int8.reshape(-1)
    per = 8 // bits
    if c.numel() % per != 0:
        raise ValueError(f"pack: {c.numel()} codes is not a multiple of {per} for {bits}-bit")
    u = c.to(torch.int8).view(torch.uint8)
    if bits == 8:
        return u.clone()
    # uint8 arithmetic throughout (no widening): mask to the low `bits`, shift into place
    u = (u & ((1 << bits) - 1)).view(-1, per)
    out = u[:, 0] << (8 - bits)
    for j in range(1, per):
        out |= u[:, j] << (bits * (per - 1 - j))
    return out


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack`: sign-extended int8 codes, first ``numel`` elements."""
    _check_bits(bits)
    p = packed.reshape(-1)
    if p.dtype != torch.uint8:
        raise ValueError(f"unpack: packed codes must be uint8, got {p.dtype}")
    per = 8 // bits
    if numel > p.numel() * per:
        raise ValueError(f"unpack: numel {numel} exceeds {p.numel()} bytes * {per} codes/byte")
    if bits == 8:
        return p[:numel].view(torch.int8).clone()
    # move each field to the top of the byte, reinterpret as int8, arithmetic-shift back down:
    # this sign-extends without widening to int32
    cols = [(p << (bits * j)).view(torch.int8) >> (8 - bits) for j in range(per)]
    return torch.stack(cols, dim=1).reshape(-1)[:numel]


# ------------------------------------------------------------------------------------------------
# Hadamard
# ------------------------------------------------------------------------------------------------

def _fwht_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """Unnormalised Sylvester FWHT on each row of ``x`` ([rows, block], fp32).

    Butterfly with strides h = 1, 2, 4, ...; each stage is exactly ``(a + b, a - b)`` in fp32,
    which the Triton kernels reproduce op for op (so results are bit-identical).
    """
    rows = x.shape[0]
    h = 1
    while h < block:
        y = x.view(rows, block // (2 * h), 2, h)
        a = y[:, :, 0, :]
        b = y[:, :, 1, :]
        x = torch.stack((a + b, a - b), dim=2).reshape(rows, block)
        h *= 2
    return x


def hadamard_transform(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard transform of every aligned ``block`` of the flattened input.

    Returns fp32 with the shape of ``x``.  H[a][c] = (-1)^popcount(a & c); H·H = block·I.
    """
    _check_hadamard(block, block)
    f = _flat(x, "hadamard_transform").to(torch.float32)
    if f.numel() % block != 0:
        raise ValueError(f"hadamard_transform: numel {f.numel()} is not a multiple of block {block}")
    return _fwht_rows(f.reshape(-1, block), block).reshape(x.shape)


def inverse_hadamard_transform(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Inverse of :func:`hadamard_transform` (H / block; the 1/block factor is exact)."""
    return hadamard_transform(x, block) * (1.0 / block)


# ------------------------------------------------------------------------------------------------
# quantize / dequantize core
# ------------------------------------------------------------------------------------------------

def draw_seed(generator: Optional[torch.Generator], low: int, high: int) -> int:
    """One integer in [low, high) from ``generator``: the seed of a fused kernel's random stream.

    The one place a kernel backend reads a generator on the host.  The trainer's generators are
    host (CPU) generators, so this is never a device synchronisation; the host-sync budget
    (tests/test_host_sync_budget.py) relies on that and does not count it."""
    dev = generator.device if generator is not None else "cpu"
    return int(torch.randint(low, high, (1,), dtype=torch.int64, generator=generator,
                             device=dev).item())


@dataclass(frozen=True)
class NoiseIndex:
    """Where a pipeline chunk sits in the random stream of the whole call it was cut from.

    Element ``i`` of the chunk draws the stochastic-rounding noise of element
    ``(i // part_len) * part_stride + base + i % part_len`` of the whole call (``total``
    elements). Called with the generator state the whole call would start from, the chunks of a
    split call therefore round exactly like the whole call, whatever the number of chunks
    (``--gradient-alltoall-pipeline``). The C++ and Triton kernels hash the mapped index; the
    reference draws the whole call's ``torch.rand`` and picks the chunk's values.
    """

    part_len: int
    """Chunk elements per part (a multiple of the output group size)."""
    part_stride: int
    """Distance between two parts in the whole call."""
    base: int
    """Offset of the chunk inside each part of the whole call."""
    total: int
    """Elements of the whole call."""

    def check(self, n: int, group_size: int) -> None:
        if (self.part_len <= 0 or n % self.part_len or self.part_len % group_size
                or self.base < 0 or self.base + self.part_len > self.part_stride
                or (n // self.part_len - 1) * self.part_stride + self.base + self.part_len
                > self.total):
            raise ValueError(f"noise index {self} does not fit a chunk of {n} elements with "
                             f"group size {group_size}")

    def indices(self, n: int, device: torch.device) -> torch.Tensor:
        i = torch.arange(n, dtype=torch.int64, device=device)
        return (i // self.part_len) * self.part_stride + self.base + i % self.part_len


def _round(v: torch.Tensor, stochastic: bool, generator: Optional[torch.Generator],
           noise_index: Optional[NoiseIndex] = None) -> torch.Tensor:
    lo = torch.floor(v)
    frac = v - lo
    if stochastic:
        # The trainer's generators live on the host (a seed draw from a CUDA generator would
        # sync the stream); the reference then draws there and copies.
        dev = generator.device if generator is not None else v.device
        if noise_index is None:
            u = torch.rand(v.shape, generator=generator, device=dev, dtype=torch.float32)
        else:
            whole = torch.rand(noise_index.total, generator=generator, device=dev,
                               dtype=torch.float32)
            u = whole[noise_index.indices(v.numel(), whole.device)].view(v.shape)
        u = u.to(v.device)
        return lo + (u < frac).to(torch.float32)
    return lo + (frac >= 0.5).to(torch.float32)


def _quantize_groups(xg: torch.Tensor, bits: int, stochastic: bool,
                     generator: Optional[torch.Generator],
                     noise_index: Optional[NoiseIndex] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """xg: fp32 [groups, group_size] -> (int8 codes [groups, group_size], fp32 scales [groups])."""
    qmax = float(_qmax(bits))
    amax = xg.abs().amax(dim=1)
    # NB: ``qmax / tensor`` in torch is ``reciprocal(tensor) * qmax`` (two roundings); divide two
    # tensors so this is one IEEE fp32 division, like ``div_rn`` in the Triton kernel.
    inv = torch.full_like(amax, qmax) / amax  # inf for amax == 0 (or tiny), NaN for NaN amax
    ok = (inv < float("inf")) & (inv > 0)  # False for amax 0/tiny (inv inf), Inf (inv 0), NaN
    inv_safe = torch.where(ok, inv, torch.zeros_like(inv))
    # bad groups: scale 0 if the group is (numerically) all zero, NaN if it holds NaN/Inf
    bad_scale = torch.where(amax < float("inf"), torch.zeros_like(amax),
                            torch.full_like(amax, float("nan")))
    scales = torch.where(ok, torch.ones_like(inv_safe) / inv_safe, bad_scale)
    v = xg * inv_safe[:, None]
    v = torch.where(ok[:, None], v, torch.zeros_like(v))  # 0 * inf = NaN guard
    q = _round(v, stochastic, generator, noise_index)
    q = q.clamp_(-(qmax + 1), qmax)
    return q.to(torch.int8), scales


def _prep(x: torch.Tensor, bits: int, group_size: int, hadamard: bool, hadamard_block: int,
          check_finite: bool, what: str) -> torch.Tensor:
    _check_bits(bits)
    f = _flat(x, what)
    _check_group(f.numel(), group_size, bits)
    if hadamard:
        _check_hadamard(group_size, hadamard_block)
    if check_finite:
        _check_finite(f, what)
    return f


def quantize(x: torch.Tensor, bits: int, group_size: int, *, stochastic: bool = True,
             generator: Optional[torch.Generator] = None, hadamard: bool = False,
             hadamard_block: int = 32, check_finite: bool = True) -> QuantizedTensor:
    """Group-wise symmetric quantization of the flattened ``x`` (see module docstring)."""
    f = _prep(x, bits, group_size, hadamard, hadamard_block, check_finite, "quantize")
    xf = f.to(torch.float32)
    if hadamard:
        xf = _fwht_rows(xf.reshape(-1, hadamard_block), hadamard_block).reshape(-1)
    codes, scales = _quantize_groups(xf.view(-1, group_size), bits, stochastic, generator)
    return QuantizedTensor(pack(codes, bits), scales, bits, group_size, f.numel())


def dequantize(q: QuantizedTensor, *, hadamard: bool = False, hadamard_block: int = 32,
               out_dtype: torch.dtype = torch.float32,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``code * scale`` in fp32 [-> inverse Hadamard] -> ``out_dtype`` (or into ``out``)."""
    q.validate()
    if hadamard:
        _check_hadamard(q.group_size, hadamard_block)
    y = _dequant_fp32(q)
    if hadamard:
        y = _fwht_rows(y.view(-1, hadamard_block), hadamard_block).reshape(-1) * (1.0 / hadamard_block)
    return _write_out(y, out, out_dtype, "dequantize")


def _dequant_fp32(q: QuantizedTensor) -> torch.Tensor:
    c = unpack(q.codes, q.bits, q.numel).to(torch.float32).view(-1, q.group_size)
    return (c * q.scales.reshape(-1, 1).to(torch.float32)).reshape(-1)


def _write_out(y: torch.Tensor, out: Optional[torch.Tensor], out_dtype: torch.dtype,
               what: str) -> torch.Tensor:
    if out is None:
        return y.to(out_dtype)
    if out.numel() != y.numel():
        raise ValueError(f"{what}: out has {out.numel()} elements, expected {y.numel()}")
    out.copy_(y.view(out.shape))
    return out


# ------------------------------------------------------------------------------------------------
# fused ops (reference = unfused composition)
# ------------------------------------------------------------------------------------------------

def _check_order(partition_order: Sequence[int], num_partitions: int) -> list[int]:
    order = [int(p) for p in (partition_order.tolist() if isinstance(partition_order, torch.Tensor)
                              else partition_order)]
    if sorted(order) != list(range(num_partitions)):
        raise ValueError(
            f"partition_order must be a permutation of range({num_partitions}), got {order}")
    return order


def _check_partitions(numel: int, num_partitions: int, group_size: int, what: str) -> None:
    if num_partitions < 1:
        raise ValueError(f"{what}: num_partitions must be >= 1, got {num_partitions}")
    if numel % (num_partitions * group_size) != 0:
        raise ValueError(
            f"{what}: numel {numel} is not divisible by num_partitions*group_size = "
            f"{num_partitions}*{group_size}")


def quantize_partitions(x: torch.Tensor, num_partitions: int, partition_order: Sequence[int],
                        bits: int, group_size: int, *, stochastic: bool = True,
                        generator: Optional[torch.Generator] = None, hadamard: bool = False,
                        hadamard_block: int = 32, check_finite: bool = True) -> QuantizedTensor:
    """Quantize and write partition ``partition_order[j]`` into output slot j.

    Random draws follow input element order, so this equals ``quantize`` + slot permutation
    bit-for-bit even with stochastic rounding and the same generator state.
    """
    _check_bits(bits)
    f = _flat(x, "quantize_partitions")
    _check_partitions(f.numel(), num_partitions, group_size, "quantize_partitions")
    order = _check_order(partition_order, num_partitions)
    q = quantize(f, bits, group_size, stochastic=stochastic, generator=generator,
                 hadamard=hadamard, hadamard_block=hadamard_block, check_finite=check_finite)
    idx = torch.tensor(order, dtype=torch.long, device=f.device)
    codes = q.codes.view(num_partitions, -1).index_select(0, idx).reshape(-1)
    scales = q.scales.view(num_partitions, -1).index_select(0, idx).reshape(-1)
    return QuantizedTensor(codes, scales, bits, group_size, q.numel)


def _check_dequantize_partitions(q: QuantizedTensor, num_partitions: int,
                                 partition_order: Sequence[int], hadamard: bool,
                                 hadamard_block: int, subtract_from: Optional[torch.Tensor],
                                 out: Optional[torch.Tensor]) -> list[int]:
    """Validation shared by every backend's ``dequantize_partitions``; returns the order."""
    q.validate()
    _check_partitions(q.numel, num_partitions, q.group_size, "dequantize_partitions")
    order = _check_order(partition_order, num_partitions)
    if hadamard:
        _check_hadamard(q.group_size, hadamard_block)
    if subtract_from is not None:
        if subtract_from.dtype != torch.float32 or subtract_from.numel() != q.numel:
            raise ValueError(f"dequantize_partitions: subtract_from must be fp32 with {q.numel} "
                             f"elements, got {subtract_from.dtype} with {subtract_from.numel()}")
    if out is not None:
        if out.dtype != torch.float32 or out.numel() != q.numel:
            raise ValueError(f"dequantize_partitions: out must be fp32 with {q.numel} elements, "
                             f"got {out.dtype} with {out.numel()}")
        if (subtract_from is not None and out.data_ptr() != subtract_from.data_ptr()
                and _overlaps(out.reshape(-1), subtract_from.reshape(-1))):
            raise ValueError("dequantize_partitions: out overlaps subtract_from without being it")
    return order


def dequantize_partitions(q: QuantizedTensor, num_partitions: int,
                          partition_order: Sequence[int], *, hadamard: bool = False,
                          hadamard_block: int = 32, subtract_from: Optional[torch.Tensor] = None,
                          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of :func:`quantize_partitions`'s layout: slot j of ``q`` (``num_partitions`` equal
    slots) dequantized [-> inverse Hadamard] into partition ``partition_order[j]`` of a flat fp32
    result in the input layout; with ``subtract_from`` (fp32, ``q.numel`` elements) the result is
    ``subtract_from - that`` (LoCo's residual ``h - sent``). ``out`` (fp32) may be
    ``subtract_from`` itself. Per element the same fp32 operations as :func:`dequantize` of each
    slot followed by ``torch.sub``, so bit-identical to that slot-by-slot composition (Hadamard
    blocks never straddle a partition: partitions are whole groups). Here the slots' codes and
    scales (bytes, not fp32) are gathered into input order first, so no fp32 temporary beyond the
    dequantized values is made."""
    order = _check_dequantize_partitions(q, num_partitions, partition_order, hadamard,
                                         hadamard_block, subtract_from, out)
    idx = slot_of(order, q.codes.device)  # cached, no host copy per call
    codes = q.codes.reshape(num_partitions, -1).index_select(0, idx).reshape(-1)
    scales = q.scales.reshape(num_partitions, -1).index_select(0, idx).reshape(-1)
    y = dequantize(QuantizedTensor(codes, scales, q.bits, q.group_size, q.numel),
                   hadamard=hadamard, hadamard_block=hadamard_block)
    if subtract_from is not None:
        y = torch.sub(subtract_from.reshape(-1), y, out=y)
    if out is None:
        return y
    out.copy_(y.view(out.shape))
    return out


def _check_sources(q: QuantizedTensor, num_sources: int, what: str) -> int:
    q.validate()
    if num_sources < 1 or q.numel % num_sources != 0:
        raise ValueError(f"{what}: numel {q.numel} is not divisible by num_sources {num_sources}")
    n = q.numel // num_sources
    if n % q.group_size != 0:
        raise ValueError(
            f"{what}: chunk size {n} (= numel/num_sources) is not a multiple of group_size "
            f"{q.group_size}")
    return n


def _check_dequantize_sum_requantize(q: QuantizedTensor, num_sources: int, bits_out: int,
                                    group_size_out: Optional[int],
                                    noise_index: Optional[NoiseIndex] = None) -> Tuple[int, int]:
    """Validation shared by every backend's ``dequantize_sum_requantize``; returns (chunk size,
    output group size)."""
    n = _check_sources(q, num_sources, "dequantize_sum_requantize")
    gs = q.group_size if group_size_out is None else group_size_out
    _check_bits(bits_out)
    _check_group(n, gs, bits_out)
    if noise_index is not None:
        noise_index.check(n, gs)
    return n, gs


def _check_dequantize_sum(q: QuantizedTensor, num_sources: int, hadamard: bool,
                          hadamard_block: int) -> int:
    """Validation shared by every backend's ``dequantize_sum``; returns the chunk size."""
    n = _check_sources(q, num_sources, "dequantize_sum")
    if hadamard:
        _check_hadamard(hadamard_block, hadamard_block)
        if n % hadamard_block != 0:
            raise ValueError(
                f"dequantize_sum: chunk size {n} is not a multiple of hadamard_block {hadamard_block}")
    return n


def _sum_sources(q: QuantizedTensor, num_sources: int, n: int) -> torch.Tensor:
    d = _dequant_fp32(q).view(num_sources, n)
    acc = torch.zeros(n, dtype=torch.float32, device=d.device)
    for s in range(num_sources):       # fixed source order 0..S-1 (determinism across ranks)
        acc = acc + d[s]
    return acc


def dequantize_sum_requantize(q: QuantizedTensor, num_sources: int, bits_out: int, *,
                              group_size_out: Optional[int] = None, stochastic: bool = True,
                              generator: Optional[torch.Generator] = None,
                              noise_index: Optional[NoiseIndex] = None) -> QuantizedTensor:
    """Dequantize ``num_sources`` chunks, fp32-sum them in order, requantize (middle hop).
    ``noise_index``: this call is a pipeline chunk of a larger one (:class:`NoiseIndex`)."""
    n, gs = _check_dequantize_sum_requantize(q, num_sources, bits_out, group_size_out, noise_index)
    acc = _sum_sources(q, num_sources, n)
    codes, scales = _quantize_groups(acc.view(-1, gs), bits_out, stochastic, generator,
                                     noise_index)
    return QuantizedTensor(pack(codes, bits_out), scales, bits_out, gs, n)


def dequantize_sum(q: QuantizedTensor, num_sources: int, *, hadamard: bool = False,
                   hadamard_block: int = 32, out: Optional[torch.Tensor] = None,
                   scale: float = 1.0) -> torch.Tensor:
    """Dequantize ``num_sources`` chunks, fp32 sum in order [-> inverse Hadamard] -> * scale."""
    n = _check_dequantize_sum(q, num_sources, hadamard, hadamard_block)
    acc = _sum_sources(q, num_sources, n)
    if hadamard:
        acc = _fwht_rows(acc.view(-1, hadamard_block), hadamard_block).reshape(-1) * (1.0 / hadamard_block)
    if scale != 1.0:
        acc = acc * float(scale)
    return _write_out(acc, out, torch.float32, "dequantize_sum")


def _difference(new: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    if new.numel() != reference.numel():
        raise ValueError(
            f"quantize_difference: new has {new.numel()} elements, reference {reference.numel()}")
    if not reference.is_floating_point():
        raise ValueError(f"quantize_difference: reference must be floating point, got {reference.dtype}")
    return new.reshape(-1).to(reference.dtype) - reference.reshape(-1)


def quantize_difference(new: torch.Tensor, reference: torch.Tensor, bits: int, group_size: int, *,
                        stochastic: bool = True, generator: Optional[torch.Generator] = None,
                        check_finite: bool = True) -> QuantizedTensor:
    """``quantize(reference.dtype(new) - reference)`` with the subtraction rounded to
    ``reference.dtype`` (bf16 RN for bf16 params, as in SDP4Bit qWD §4.2)."""
    d = _difference(new, reference)
    return quantize(d, bits, group_size, stochastic=stochastic, generator=generator,
                    check_finite=check_finite)


def dequantize_add(q: QuantizedTensor, reference: torch.Tensor, *,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``reference.dtype(reference.dtype(code*scale) + reference)``; ``out`` may alias it."""
    q.validate()
    if reference.numel() != q.numel:
        raise ValueError(f"dequantize_add: reference has {reference.numel()} elements, q {q.numel}")
    dt = reference.dtype
    y = _dequant_fp32(q).to(dt) + reference.reshape(-1)
    if out is None:
        return y.view(reference.shape)
    if out.numel() != q.numel:
        raise ValueError(f"dequantize_add: out has {out.numel()} elements, expected {q.numel}")
    out.copy_(y.view(out.shape))
    return out
