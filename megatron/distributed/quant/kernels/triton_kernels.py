"""Triton kernels for the quantized collectives (same numerics as :mod:`.reference`).

Every kernel reproduces the reference's fp32 operation sequence, so round-to-nearest output is
bit-identical and stochastic rounding matches in distribution (Philox instead of
``torch.rand``).  Details that matter for bit parity:

* ``qmax / amax`` and ``1 / inv`` use ``div_rn`` (Triton's ``/`` is an approximate division on
  NVIDIA GPUs); kernels are launched with ``enable_fp_fusion=False`` so ``acc + code*scale`` is
  not contracted into an FMA (torch does not fuse either).
* fp32 -> bf16 rounding is done by bit manipulation (round-to-nearest-even), because the Triton
  CPU interpreter's own bf16 cast truncates; the final cast of an exactly representable value is
  then exact on every backend.
* The 2^k-point Hadamard transform is the same butterfly as ``reference._fwht_rows``: stages with
  stride 1, 2, 4, ..., each computing exactly ``(a + b, a - b)`` (as two-element sums, see
  ``_bfly_stage``).
* The stochastic rounding seed is drawn from the caller's ``torch.Generator`` with
  ``torch.randint`` (so the generator is consumed deterministically); the random stream is indexed
  by the *input* element index, so a permuted output layout does not change which ``u`` an
  element gets.  Element i's ``u`` is output i % 4 of Philox(seed, counter i // 4)
  (``tl.randint4x`` with :data:`PHILOX_ROUNDS`): all four outputs of each Philox call are used.

NaN/Inf detection is fused: the quantize kernels count non-finite inputs into an int32 counter with
``atomic_add``.  The trainer passes its own device counter (``nonfinite_counter``), read once per
step; a call without one reads a private counter back and raises :class:`NonFiniteError` (one
small sync: for direct callers and tests).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from ..device_tables import slot_of
from . import reference as _ref
from .reference import NonFiniteError, QuantizedTensor

# elements per program (rows * padded group); the interpreter prefers few large programs
_TILE = 4096

PHILOX_ROUNDS = tl.constexpr(7)
"""Rounds of the Philox4x32 generator behind stochastic rounding. Philox4x32 passes TestU01's
BigCrush from 7 rounds (Salmon et al., SC'11, "Crush-resistant"); Triton's default of 10 is a
safety margin for general use. The rounds are the arithmetic that bounds the stochastic kernels
(about 25 integer operations per element at 10 rounds, near the GPU's integer throughput at
70 % of memory bandwidth), and rounding noise needs far less than BigCrush: 7 rounds cut them by
30 %. The statistics tests (tests/test_triton_kernels.py) hold for this setting."""


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _rows_for(gp: int) -> int:
    return max(1, _TILE // gp)


# ------------------------------------------------------------------------------------------------
# jit helpers
# ------------------------------------------------------------------------------------------------

@triton.jit
def _bfly_stage(x, R: tl.constexpr, HB: tl.constexpr, H: tl.constexpr):
    """One butterfly stage with stride H on x [R, HB]: (a, b) -> (a + b, a - b).

    Both results are two-element sums over the pair axis of the reshaped tile (a + b, and
    a + (-b), which IEEE defines as a - b: bit-identical to the reference's butterfly). A sum
    over an axis stays in the tile's own layout (in registers, or one warp shuffle when the pair
    is on two threads), where permute / split / join made Triton move the tile through shared
    memory at every stage: for the recipe's 8-bit hop 1 on sm_90, 4 -> 1 layout conversions,
    25 -> 1 barriers, 230 -> 70 shuffles, 122 -> 86 registers (bench/triton_aot.py)."""
    if H < HB:
        y = tl.reshape(x, (R, HB // (2 * H), 2, H))
        half = tl.arange(0, 2)[None, None, :, None]
        s = tl.sum(y, axis=2)                                  # a + b
        d = tl.sum(tl.where(half == 0, y, -y), axis=2)         # a + (-b), exactly a - b
        y = tl.where(half == 0, s[:, :, None, :], d[:, :, None, :])
        x = tl.reshape(y, (R, HB))
    return x


@triton.jit
def _fwht(x, R: tl.constexpr, HB: tl.constexpr):
    """Unnormalised Sylvester FWHT on each row of x [R, HB] (HB <= 1024)."""
    x = _bfly_stage(x, R, HB, 1)
    x = _bfly_stage(x, R, HB, 2)
    x = _bfly_stage(x, R, HB, 4)
    x = _bfly_stage(x, R, HB, 8)
    x = _bfly_stage(x, R, HB, 16)
    x = _bfly_stage(x, R, HB, 32)
    x = _bfly_stage(x, R, HB, 64)
    x = _bfly_stage(x, R, HB, 128)
    x = _bfly_stage(x, R, HB, 256)
    x = _bfly_stage(x, R, HB, 512)
    return x


@triton.jit
def _round_bf16(x):
    """fp32 -> nearest-even bf16 value, returned as fp32 (NaN passes through)."""
    b = x.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    y = r.to(tl.float32, bitcast=True)
    return tl.where(x != x, x, y)


@triton.jit
def _round_to(x, DT: tl.constexpr):
    """Round fp32 x to dtype DT (bf16 / fp16 / fp32) and widen back to fp32."""
    if DT == tl.bfloat16:
        x = _round_bf16(x)
    elif DT == tl.float16:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _uniform_tile(seed, rand_base, R: tl.constexpr, GP: tl.constexpr, ALIGNED: tl.constexpr):
    """Stochastic-rounding noise u in [0, 1) for a tile [R, GP] whose row r holds the random-stream
    elements rand_base[r] + 0..GP-1 (int32).

    Element i of the stream gets output i % 4 of the Philox call at counter i // 4: a pure
    function of (seed, i), so pipeline chunks and permuted layouts draw the same u as the whole
    call, with one Philox call per four elements (``tl.rand`` draws one per element and uses one
    of its four outputs).  ALIGNED (every row base and GP multiples of 4): GP / 4 calls per row,
    their outputs interleaved; else each element computes its own call and picks its lane."""
    if ALIGNED:
        ctr = (rand_base // 4)[:, None] + tl.arange(0, GP // 4)[None, :]
        r0, r1, r2, r3 = tl.randint4x(seed, ctr, PHILOX_ROUNDS)
        # join(join(r0, r2), join(r1, r3))[k, q, p] = r_(2q + p), i.e. element 4k + 2q + p
        r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (R, GP))
    else:
        i = rand_base[:, None] + tl.arange(0, GP)[None, :]
        r0, r1, r2, r3 = tl.randint4x(seed, i // 4, PHILOX_ROUNDS)
        lane = i % 4
        r = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    return tl.random.uint_to_uniform_float(r)


@triton.jit
def _quant_tile(x, rand_base, seed, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr,
                R: tl.constexpr, GP: tl.constexpr, ALIGNED: tl.constexpr):
    """x fp32 [R, GP] (one group per row, padding = 0) -> (int32 codes [R, GP], fp32 scales [R]).
    Row r's elements are random-stream elements rand_base[r] + 0.. (see _uniform_tile)."""
    a = tl.abs(x)
    a = tl.where(a == a, a, float("inf"))          # NaN groups -> amax = inf -> scale NaN
    amax = tl.max(a, axis=1)
    inv = tl.math.div_rn(tl.full(amax.shape, QMAX, tl.float32), amax)
    ok = (inv < float("inf")) & (inv > 0.0)     # amax 0/tiny -> inf, amax Inf -> 0
    inv_safe = tl.where(ok, inv, 0.0)
    bad = tl.where(amax < float("inf"), 0.0, float("nan"))
    scale = tl.where(ok, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), inv_safe), bad)
    v = x * inv_safe[:, None]
    v = tl.where(ok[:, None], v, 0.0)
    lo = tl.floor(v)
    frac = v - lo
    if STOCHASTIC:
        u = _uniform_tile(seed, rand_base, R, GP, ALIGNED)
        q = lo + tl.where(u < frac, 1.0, 0.0)
    else:
        q = lo + tl.where(frac >= 0.5, 1.0, 0.0)
    q = tl.minimum(tl.maximum(q, -QMAX - 1.0), QMAX * 1.0)
    return q.to(tl.int32), scale


@triton.jit
def _store_packed(codes_ptr, q, og, R: tl.constexpr, GS: tl.constexpr, GP: tl.constexpr,
                  BITS: tl.constexpr, gmask):
    """Pack int32 codes q [R, GP] (MSB-first) and store group rows at output group index og [R]."""
    BPG: tl.constexpr = GS * BITS // 8               # bytes per group
    base = og.to(tl.int64) * BPG
    if BITS == 8:
        cols = tl.arange(0, GP)
        byte = q & 0xFF
    elif BITS == 4:
        cols = tl.arange(0, GP // 2)
        hi, lo = tl.split(tl.reshape(q, (R, GP // 2, 2)))
        byte = ((hi & 0xF) << 4) | (lo & 0xF)
    else:
        cols = tl.arange(0, GP // 4)
        ev, od = tl.split(tl.reshape(q, (R, GP // 4, 2, 2)))   # [R, GP/4, 2]: 4i+2k, 4i+2k+1
        e0, e2 = tl.split(ev)
        e1, e3 = tl.split(od)
        byte = ((e0 & 3) << 6) | ((e1 & 3) << 4) | ((e2 & 3) << 2) | (e3 & 3)
    m = gmask[:, None] & (cols[None, :] < BPG)
    tl.store(codes_ptr + base[:, None] + cols[None, :], byte.to(tl.uint8), mask=m)


@triton.jit
def _load_deq(codes_ptr, scales_ptr, idx, mask, BITS: tl.constexpr, GS: tl.constexpr):
    """Dequantize elements at flat indices idx (int64) of a packed tensor -> fp32."""
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    SIGN: tl.constexpr = 1 << (BITS - 1)
    byte = tl.load(codes_ptr + idx // PER, mask=mask, other=0).to(tl.int32)
    shift = ((PER - 1) - (idx % PER)).to(tl.int32) * BITS
    c = (byte >> shift) & MASK
    c = (c ^ SIGN) - SIGN
    s = tl.load(scales_ptr + idx // GS, mask=mask, other=0.0)
    return c.to(tl.float32) * s


@triton.jit
def _load_deq_rows(codes_ptr, scales_ptr, first, gmask, R: tl.constexpr, GP: tl.constexpr,
                   GS: tl.constexpr, BITS: tl.constexpr):
    """Dequantize R whole groups -> fp32 [R, GP]: row r is the group starting at flat index
    first[r] (int64, a multiple of GS).  Same values as _load_deq, but each row's packed bytes
    are loaded once as a contiguous run (4- and 2-bit codes are split in registers instead of
    every element loading its own byte) and there is one scale load per group."""
    SIGN: tl.constexpr = 1 << (BITS - 1)
    PER: tl.constexpr = 8 // BITS
    eb = tl.arange(0, GP // PER)
    mb = gmask[:, None] & (eb[None, :] < GS // PER)
    byte = tl.load(codes_ptr + (first // PER)[:, None] + eb[None, :], mask=mb,
                   other=0).to(tl.int32)
    if BITS == 8:
        c = byte
    elif BITS == 4:                             # element 2i in the high nibble
        c = tl.reshape(tl.join(byte >> 4, byte & 0xF), (R, GP))
    else:                                       # element 4i in the highest two bits
        # join(join(c0, c2), join(c1, c3))[i, q, p] = c_(2q + p): element 4i + 2q + p
        c = tl.reshape(tl.join(tl.join(byte >> 6, (byte >> 2) & 3),
                               tl.join((byte >> 4) & 3, byte & 3)), (R, GP))
    c = (c ^ SIGN) - SIGN
    s = tl.load(scales_ptr + first // GS, mask=gmask, other=0.0)
    return c.to(tl.float32) * s[:, None]


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["seed"])  # a fresh seed per launch: never a new compile
def _quantize_kernel(x_ptr, ref_ptr, codes_ptr, scales_ptr, slot_ptr, nonfinite_ptr, seed,
                     num_groups, groups_per_part,
                     GS: tl.constexpr, GP: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr,
                     STOCHASTIC: tl.constexpr, HADAMARD: tl.constexpr, HB: tl.constexpr,
                     DIFF: tl.constexpr, PERMUTE: tl.constexpr, CHECK: tl.constexpr,
                     ALIGNED: tl.constexpr):
    """[new - ref ->] [FWHT ->] absmax -> round -> pack -> store at (permuted) group slot."""
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    pid = tl.program_id(0)
    g = pid.to(tl.int64) * R + tl.arange(0, R)
    gmask = g < num_groups
    e = tl.arange(0, GP)
    m = gmask[:, None] & (e[None, :] < GS)
    offs = g[:, None] * GS + e[None, :]
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    if DIFF:
        r = tl.load(ref_ptr + offs, mask=m, other=0.0)
        RT: tl.constexpr = ref_ptr.dtype.element_ty
        xn = _round_to(x.to(tl.float32), RT)        # new cast to the reference dtype
        x = _round_to(xn - r.to(tl.float32), RT)     # subtraction rounded to the reference dtype
    else:
        x = x.to(tl.float32)
    if CHECK:
        bad = tl.sum(tl.where(m & ((x != x) | (tl.abs(x) == float("inf"))), 1, 0))
        tl.atomic_add(nonfinite_ptr, bad)
    if HADAMARD:
        x = tl.reshape(_fwht(tl.reshape(x, (R * GP // HB, HB)), R * GP // HB, HB), (R, GP))
    q, scale = _quant_tile(x, (g * GS).to(tl.int32), seed, QMAX, STOCHASTIC, R, GP, ALIGNED)
    if PERMUTE:
        part = g // groups_per_part
        slot = tl.load(slot_ptr + part, mask=gmask, other=0).to(tl.int64)
        og = slot * groups_per_part + (g % groups_per_part)
    else:
        og = g
    tl.store(scales_ptr + og, scale, mask=gmask)
    _store_packed(codes_ptr, q, og, R, GS, GP, BITS, gmask)


@triton.jit(do_not_specialize=["seed"])  # a fresh seed per launch: never a new compile
def _dsum_requant_kernel(codes_ptr, scales_ptr, out_codes_ptr, out_scales_ptr, seed,
                         n, num_groups_out, part_len, part_stride, base, S: tl.constexpr,
                         GS_IN: tl.constexpr, BITS_IN: tl.constexpr,
                         GS: tl.constexpr, GP: tl.constexpr, R: tl.constexpr,
                         BITS: tl.constexpr, STOCHASTIC: tl.constexpr, ALIGNED: tl.constexpr):
    """Sum the dequantized source chunks (order 0..S-1, fp32) and requantize per output group.
    The noise of output element i is that of element (i // part_len) * part_stride + base +
    i % part_len of the whole call (reference.NoiseIndex; part_len = n, base = 0: identity).
    S is a compile-time constant so the S source loads are unrolled and issued together."""
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    pid = tl.program_id(0)
    g = pid.to(tl.int64) * R + tl.arange(0, R)
    gmask = g < num_groups_out
    e = tl.arange(0, GP)
    m = gmask[:, None] & (e[None, :] < GS)
    acc = tl.zeros((R, GP), dtype=tl.float32)
    first = g * GS                              # a row never straddles a part (NoiseIndex.check)
    src = first                                 # int64 running offset: no int32 overflow
    for _s in tl.static_range(S):
        if GS_IN == GS:                         # output groups are input groups: a scale per row
            acc = acc + _load_deq_rows(codes_ptr, scales_ptr, src, gmask, R, GP, GS, BITS_IN)
        else:
            acc = acc + _load_deq(codes_ptr, scales_ptr, src[:, None] + e[None, :], m, BITS_IN,
                                  GS_IN)
        src = src + n
    noise_base = (first // part_len) * part_stride + base + first % part_len
    q, scale = _quant_tile(acc, noise_base.to(tl.int32), seed, QMAX, STOCHASTIC, R, GP, ALIGNED)
    tl.store(out_scales_ptr + g, scale, mask=gmask)
    _store_packed(out_codes_ptr, q, g, R, GS, GP, BITS, gmask)


@triton.jit
def _dsum_kernel(codes_ptr, scales_ptr, out_ptr, out_stride, scale, n, S: tl.constexpr,
                 GS: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                 HADAMARD: tl.constexpr, HB: tl.constexpr, HAS_SCALE: tl.constexpr,
                 ROWS: tl.constexpr):
    """Dequantize + fp32 sum over sources [-> inverse FWHT] [* scale] -> strided out (any float).
    S (sources) is a compile-time constant: the S loads are unrolled and issued together. ROWS
    (GS a power of two dividing BLOCK): the block is BLOCK // GS whole groups, loaded as rows
    (packed bytes once, one scale per group); else every element loads its own byte and scale."""
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    if ROWS:
        RB: tl.constexpr = BLOCK // GS
        first = (pid.to(tl.int64) * RB + tl.arange(0, RB)) * GS
        gmask = first < n                       # n is a multiple of GS: rows are whole or out
        acc2 = tl.zeros((RB, GS), dtype=tl.float32)
        src = first                             # int64 running offset: no int32 overflow
        for _s in tl.static_range(S):
            acc2 = acc2 + _load_deq_rows(codes_ptr, scales_ptr, src, gmask, RB, GS, GS, BITS)
            src = src + n
        acc = tl.reshape(acc2, (BLOCK,))
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        src = idx                               # int64 running offset: no int32 overflow
        for _s in tl.static_range(S):
            acc = acc + _load_deq(codes_ptr, scales_ptr, src, m, BITS, GS)
            src = src + n
    if HADAMARD:
        acc = tl.reshape(_fwht(tl.reshape(acc, (BLOCK // HB, HB)), BLOCK // HB, HB), (BLOCK,))
        acc = acc * (1.0 / HB)
    if HAS_SCALE:
        acc = acc * scale
    OT: tl.constexpr = out_ptr.dtype.element_ty
    acc = _round_to(acc, OT)
    tl.store(out_ptr + idx * out_stride, acc.to(OT), mask=m)


@triton.jit
def _dequant_add_kernel(codes_ptr, scales_ptr, ref_ptr, out_ptr, n,
                        GS: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """out = dt(dt(code*scale) + ref) with dt = ref dtype (out may alias ref)."""
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    RT: tl.constexpr = ref_ptr.dtype.element_ty
    d = _round_to(_load_deq(codes_ptr, scales_ptr, idx, m, BITS, GS), RT)
    r = tl.load(ref_ptr + idx, mask=m, other=0.0).to(tl.float32)
    y = _round_to(d + r, RT)
    tl.store(out_ptr + idx, y.to(RT), mask=m)


# ------------------------------------------------------------------------------------------------
# host wrappers (same signatures and checks as the reference)
# ------------------------------------------------------------------------------------------------

def _noise_rows_aligned(*sizes: int) -> bool:
    """Whether every tile row starts the random stream at a multiple of 4 and spans whole Philox
    calls (group size, padded group size and the noise index's part geometry all multiples of 4):
    then _uniform_tile draws one Philox call per four elements."""
    return all(v % 4 == 0 for v in sizes)


def _seed(stochastic: bool, generator: Optional[torch.Generator]) -> int:
    return _ref.draw_seed(generator, 0, 2 ** 31 - 1) if stochastic else 0


def _launch_quantize(x: torch.Tensor, ref: Optional[torch.Tensor], bits: int, group_size: int,
                     stochastic: bool, generator: Optional[torch.Generator], hadamard: bool,
                     hadamard_block: int, check_finite: bool, slots: Optional[torch.Tensor],
                     groups_per_part: int, what: str,
                     nonfinite_counter: Optional[torch.Tensor] = None) -> QuantizedTensor:
    """``nonfinite_counter`` (int32, on the device): the kernel adds the number of non-finite
    inputs into it with its fused atomic count and nothing is read back (the caller agrees on it
    once per step); else with ``check_finite`` the count is read back here (one host sync) and
    raises."""
    numel = x.numel()
    ng = numel // group_size
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
    if ng > 0:
        _quantize_kernel[(triton.cdiv(ng, rows),)](
            x, ref if ref is not None else x, codes, scales,
            slots if slots is not None else _unused_i32(x.device),
            counter if counter is not None else _unused_i32(x.device),
            seed, ng, max(groups_per_part, 1),
            GS=group_size, GP=gp, R=rows, BITS=bits, STOCHASTIC=bool(stochastic),
            HADAMARD=bool(hadamard), HB=hadamard_block if hadamard else 1,
            DIFF=ref is not None, PERMUTE=slots is not None, CHECK=counter is not None,
            ALIGNED=_noise_rows_aligned(group_size, gp), enable_fp_fusion=False)
    if check_finite and nonfinite_counter is None:
        bad = int(counter.item())
        if bad:
            raise NonFiniteError(
                f"{what}: input has {bad} non-finite (NaN/Inf) value(s) out of {numel}; "
                f"refusing to quantize (skip this step)")
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


_UNUSED_I32: Dict[str, torch.Tensor] = {}


def _unused_i32(device: torch.device) -> torch.Tensor:
    """An int32 placeholder for a pointer argument the launch does not read (no slot table, no
    count): one per device, so no allocation per call and the same specialisation as before."""
    t = _UNUSED_I32.get(str(device))
    if t is None:
        t = _UNUSED_I32[str(device)] = torch.zeros(1, dtype=torch.int32, device=device)
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
    other backends make both contiguous too). No copy when they already are."""
    return q.codes.contiguous(), q.scales.to(torch.float32).contiguous()


def _launch_dsum(q: QuantizedTensor, num_sources: int, n: int, out1d: torch.Tensor,
                 hadamard: bool, hadamard_block: int, scale: float) -> None:
    block = max(_TILE, hadamard_block if hadamard else 1)
    if n > 0:
        codes, scales = _operands(q)
        _dsum_kernel[(triton.cdiv(n, block),)](
            codes, scales, out1d, out1d.stride(0) if out1d.numel() > 1 else 1, float(scale),
            n, S=num_sources, GS=q.group_size, BITS=q.bits, BLOCK=block, HADAMARD=bool(hadamard),
            HB=hadamard_block if hadamard else 1, HAS_SCALE=float(scale) != 1.0,
            ROWS=_pow2(q.group_size) and block % q.group_size == 0, enable_fp_fusion=False)


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
            enable_fp_fusion=False)
    return QuantizedTensor(codes, scales, bits_out, gs, n)


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
            enable_fp_fusion=False)
    if out is None:
        return target.view(reference.shape)
    if not direct:
        out.copy_(target.view(out.shape))
    return out
