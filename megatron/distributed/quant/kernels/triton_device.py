"""The ``@triton.jit`` functions of the Triton backend: device code only, no launches.

Why a module of its own: these functions are what Triton compiles (and what
``bench/triton_aot.py`` compiles ahead of time for real GPUs); their Python launchers -- block
sizes, seeds, argument checks, output allocation -- are :mod:`.triton_launch`. Every kernel
reproduces :mod:`.reference`'s fp32 operation sequence, so round-to-nearest output is
bit-identical and stochastic rounding matches in distribution (Philox instead of
``torch.rand``).  Details that matter for bit parity:

* ``qmax / amax`` and ``1 / inv`` use ``div_rn`` (Triton's ``/`` is an approximate division on
  NVIDIA GPUs); the launchers pass ``enable_fp_fusion=False`` so ``acc + code*scale`` is not
  contracted into an FMA (torch does not fuse either).
* fp32 -> bf16 rounding is round-to-nearest-even: the GPU's cast, and under the Triton CPU
  interpreter (whose cast truncates) the same rounding by bit manipulation
  (:data:`NATIVE_BF16_CAST`); the final cast of an exactly representable value is then exact
  on every backend.
* The 2^k-point Hadamard transform is the same butterfly as ``reference._fwht_rows``: stages with
  stride 1, 2, 4, ..., each computing exactly ``(a + b, a - b)`` (as two-element sums, see
  ``_bfly_stage``).
* The random stream is indexed by the *input* element index, so a permuted output layout does
  not change which ``u`` an element gets.  Element i's ``u`` is 16 (15) bits of Philox(seed,
  counter i // 8) (:func:`_philox_at`, :data:`PHILOX_ROUNDS` rounds): each call serves eight
  elements (:func:`_noise_tile`).

The entry kernels (``_quantize_kernel``, ``_dsum_requant_kernel``, ``_dsum_kernel``,
``_dequant_parts_kernel``, ``_dequant_add_kernel``) are the jit functions no other jit function
calls; the quantize kernel adds the number of groups holding a NaN/Inf (their scale is NaN)
into an int32 counter with ``atomic_add`` (``CHECK``).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def _interpreted() -> bool:
    """Whether Triton runs this module's functions in its CPU interpreter: its own switch, read
    when the functions are decorated (TRITON_INTERPRET)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


NATIVE_BF16_CAST = tl.constexpr(not _interpreted())
"""Round fp32 to bf16 with the GPU's cast (one round-to-nearest-even ``cvt`` per element). The
Triton CPU interpreter's cast truncates, so there ``_round_bf16`` rounds by bit manipulation,
the same values in five instructions an element (most of the qWD receive's arithmetic on a GPU:
78 against 98 % of copy bandwidth modelled for bf16 weights)."""

INLINE_PTX = tl.constexpr(not _interpreted())
"""Write a few steps as inline PTX where ptxas would not pick the instructions: the 2- and 4-bit
code decoder's and-xor as one ``lop3`` (_field_dequant; ptxas emits ``(w & m) ^ k`` with two
immediates as two ``LOP3``), the noise's low halves or'd into the rounding base in one ``lop3``
(_low_bits), round to nearest as two round-down adds (_round_half_up_word; Triton has no
directed-rounding add), the 2- and 4-bit packing as byte permutes (codes_word_ptx), Philox's
products as wide multiplies (_mulhilo) and bf16 widened two elements a word (_to_f32). NVIDIA
PTX (the backend targets NVIDIA GPUs); the Triton CPU interpreter runs no inline PTX, so there
the same values come from plain Python."""

PHILOX_ROUNDS = tl.constexpr(7)
"""Rounds of the Philox4x32 generator behind stochastic rounding. Philox4x32 passes TestU01's
BigCrush from 7 rounds (Salmon et al., SC'11, "Crush-resistant"); Triton's default of 10 is a
safety margin for general use. The rounds are the arithmetic that bounds the stochastic kernels
(28 instructions a call at 7 rounds on sm_90, _philox_at, shared by eight elements), and
rounding noise needs far less than BigCrush. The statistics tests (tests/test_triton_kernels.py)
hold for this setting."""


THREAD_RUN = tl.constexpr(16)
"""Consecutive elements a thread holds in the kernels' tiles on sm_80 / sm_90 (16 bytes of 8-bit
codes, which the quantize kernel's layout anchor gives every bit width): butterfly stages of a
wider stride pair two threads' elements (_bfly_stage). Only the instruction mix depends on it."""


SOURCES_UNROLLED = tl.constexpr(8)
"""Slots a summing kernel loads in one unrolled run: every slot of the middle hop (S <= 8 GPUs
per node), chunks of 8 for a final hop over more nodes. bench/kernel_cost_model.py counts a
loop's body S // 8 times."""


def codes_word_ptx(bits: int, byte: int) -> str:
    """PTX (an inline asm block) that packs the 2- or 4-bit codes of 32 // bits code words into
    one int32 ``$0``: operand ``$(1 + i)`` is element i's word, its code in the low bits of its
    byte ``byte``; out byte j holds elements 8 j / bits .. from its most significant bits down
    (MSB-first, byte 0 first: the reference's packing).

    For each position m in a byte, three ``prmt`` gather the code bytes of elements m, per + m,
    2 per + m and 3 per + m (per = 8 // bits codes a byte) into one word g_m; every g_m but the
    last is shifted left to its bits, and each after the first is merged into g_0 by a bit select
    (``lop3`` 0xe2: (a & mask) | (c & ~mask)) that keeps the bits above its own. 8 instructions
    for 8 4-bit codes, 18 for 16 2-bit ones.
    tests/test_triton_kernels.py runs this text through an emulator of the three instructions."""
    per = 8 // bits
    lo = ((4 + byte) << 4) | byte              # [a.byte, b.byte, -, -]
    hi = ((4 + byte) << 12) | (byte << 8)      # [-, -, a.byte, b.byte]
    lines = [".reg .b32 p, q, " + ", ".join(f"g{m}" for m in range(per)) + ";"]
    for m in range(per):
        a, b, c, d = (1 + m + per * j for j in range(4))
        lines += [f"prmt.b32 p, ${a}, ${b}, {lo};", f"prmt.b32 q, ${c}, ${d}, {hi};",
                  f"prmt.b32 g{m}, p, q, 0x7610;"]
    lines.append(f"shl.b32 g0, g0, {(per - 1) * bits};")
    for m in range(1, per):
        shift = (per - 1 - m) * bits
        if shift:
            lines.append(f"shl.b32 g{m}, g{m}, {shift};")
        keep = ((0xFF << ((per - m) * bits)) & 0xFF) * 0x01010101
        dst = "$0" if m == per - 1 else "g0"
        lines.append(f"lop3.b32 {dst}, g0, {keep:#x}, g{m}, 0xe2;")
    return "{ " + " ".join(lines) + " }"


NIBBLES_PTX_RN = tl.constexpr(codes_word_ptx(4, 0))
"""codes_word_ptx for 4-bit round-to-nearest code words (the code in bits 0..)."""
NIBBLES_PTX_SR = tl.constexpr(codes_word_ptx(4, 2))
"""codes_word_ptx for 4-bit stochastic code words (the code in bits 16..)."""
CRUMBS_PTX_RN = tl.constexpr(codes_word_ptx(2, 0))
"""codes_word_ptx for 2-bit round-to-nearest code words."""
CRUMBS_PTX_SR = tl.constexpr(codes_word_ptx(2, 2))
"""codes_word_ptx for 2-bit stochastic code words."""

ROUND_HALF_UP_PTX = tl.constexpr(
    "{ .reg .f32 t; add.rm.f32 t, $1, 0f3F000000; add.rm.f32 $0, t, 0f4B400000; }")
"""PTX of _round_half_up_word: rd(rd(v + 0.5) + 1.5 2^23), the code word of floor(v + 0.5)."""

MULHILO_PTX = tl.constexpr("{ .reg .b64 t; mul.wide.u32 t, $2, $3; mov.b64 {$1, $0}, t; }")
"""PTX of _mulhilo: the 64-bit product of $2 and $3, its high word to $0 and its low to $1."""

BF16_PAIR_PTX = tl.constexpr("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }")
"""PTX of _to_f32: the word $2 of two bf16 (element 0 in its low half) to their fp32 bit
patterns, element 0 to $0 and element 1 to $1."""


# ------------------------------------------------------------------------------------------------
# jit helpers
# ------------------------------------------------------------------------------------------------

@triton.jit
def _bfly_stage(x, R: tl.constexpr, HB: tl.constexpr, H: tl.constexpr):
    """One butterfly stage with stride H on x [R, HB]: (a, b) -> (a + b, a - b).

    Stages inside a thread's run of THREAD_RUN elements: both results are two-element sums over
    the pair axis of the reshaped tile (a + b, and a + (-b), which IEEE defines as a - b:
    bit-identical to the reference's butterfly), kept in registers in the tile's own layout
    (permute / split / join made Triton move the tile through shared memory at every stage).
    Wider stages pair elements of two threads: each takes its partner's value from one xor
    reduction of the bit patterns (a ^ b ^ own: one shuffle) and adds its own value times +1 or
    -1 in one fma (b + a and a + (-b), the same sums: the product is exact), where two sums cost
    two shuffles."""
    if H < HB:
        y = tl.reshape(x, (R, HB // (2 * H), 2, H))
        half = tl.arange(0, 2)[None, None, :, None]
        if H >= THREAD_RUN:
            bits = y.to(tl.uint32, bitcast=True)
            other = (tl.xor_sum(bits, axis=2)[:, :, None, :] ^ bits).to(tl.float32, bitcast=True)
            y = tl.fma(y, tl.where(half == 0, 1.0, -1.0), other)
        else:
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
    if NATIVE_BF16_CAST:
        return x.to(tl.bfloat16).to(tl.float32)
    b = x.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    y = r.to(tl.float32, bitcast=True)
    return tl.where(x != x, x, y)


@triton.jit
def _to_f32(x):
    """x widened to fp32. bf16 on a GPU (INLINE_PTX) two elements at a time from the 32-bit word
    that holds them: the low one shifted up, the high one masked (a bf16 is an fp32's high half):
    one instruction an element, where ptxas spends a PRMT and a shift on every high one."""
    if INLINE_PTX and x.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(BF16_PAIR_PTX, "=r,=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=2)
    return x.to(tl.float32)


@triton.jit
def _round_to(x, DT: tl.constexpr):
    """Round fp32 x to dtype DT (bf16 / fp16 / fp32) and widen back to fp32."""
    if DT == tl.bfloat16:
        x = _round_bf16(x)
    elif DT == tl.float16:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _mulhilo(a, M: tl.constexpr):
    """The high and low words of the 64-bit product of uint32 a and the constant M: one 32 x 32
    -> 64 multiply (``IMAD.WIDE.U32``), where ``umulhi`` and a separate low multiply are two."""
    if INLINE_PTX:
        return tl.inline_asm_elementwise(MULHILO_PTX, "=r,=r,r,r",
                                         [a, tl.full(a.shape, M, tl.uint32)],
                                         dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
    p = a.to(tl.uint64) * M
    return (p >> 32).to(tl.uint32), p.to(tl.uint32)


@triton.jit
def _philox_at(seed, ctr):
    """Philox4x32 (:data:`PHILOX_ROUNDS`) at the 64-bit counter ctr (int64 >= 0): its low and
    high words as the first two counter words (the others 0), key = seed's low and high words;
    four uint32 outputs, those of ``tl.philox`` (tests/test_triton_kernels.py compares them).
    Spelled out: each round's two products as two wide multiplies (_mulhilo), where tl.philox
    spends four instructions on them (42 a call at 7 rounds on sm_90, 28 this way); and an int64
    offset is Philox4x64 in the Tritons before triton-lang/triton#6832."""
    c0 = ctr.to(tl.uint32)
    c1 = (ctr >> 32).to(tl.uint32)
    c2 = c0 * 0
    c3 = c2
    s = seed.to(tl.uint64)
    k0 = s.to(tl.uint32)
    k1 = (s >> 32).to(tl.uint32)
    for _ in tl.static_range(PHILOX_ROUNDS):
        hi_a, lo_a = _mulhilo(c0, 0xD2511F53)
        hi_b, lo_b = _mulhilo(c2, 0xCD9E8D57)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _noise_tile(seed, rand_base, R: tl.constexpr, GP: tl.constexpr, ALIGNED: tl.constexpr,
                NB: tl.constexpr, BASE: tl.constexpr):
    """NB (15 or 16) random bits per element, uint32 in [0, 2^NB), or'd into the bit pattern BASE
    (0: the bits alone; a stochastic-rounding base, whose low NB bits are 0), for a tile [R, GP]
    whose row r holds the random-stream elements rand_base[r] + 0..GP-1 (int64: Philox's 64-bit
    counter i // 8, its high word non-zero from 2^35 elements, so no call repeats its noise; the
    int32 index this replaces wrapped past 2^31 elements).

    Element i of the stream gets the top NB bits of one 16-bit half of the Philox call at counter
    i // 8: of its output (i % 8) // 2, the high half when i is even, the low half when odd. So
    the bits are a pure function of (seed, i): pipeline chunks and permuted layouts draw the same
    as the whole call, and one Philox call serves eight elements (its rounds are most of a
    stochastic kernel's arithmetic). ALIGNED (every row base and GP multiples of 8): GP / 8 calls
    per row, their halves interleaved; else each element computes its own call and picks its
    bits."""
    if ALIGNED:
        ctr = (rand_base // 8)[:, None] + tl.arange(0, GP // 8)[None, :]
        r0, r1, r2, r3 = _philox_at(seed, ctr)
        # join(join(a0, a2), join(a1, a3))[k, a, b] = a_(2a + b); the outer join picks the half:
        # element 8k + 4a + 2b + c gets half c of r_(2a + b)
        hi = tl.join(tl.join(_high_bits(r0, NB, BASE), _high_bits(r2, NB, BASE)),
                     tl.join(_high_bits(r1, NB, BASE), _high_bits(r3, NB, BASE)))
        lo = tl.join(tl.join(_low_bits(r0, NB, BASE), _low_bits(r2, NB, BASE)),
                     tl.join(_low_bits(r1, NB, BASE), _low_bits(r3, NB, BASE)))
        k = tl.reshape(tl.join(hi, lo), (R, GP))
    else:
        i = rand_base[:, None] + tl.arange(0, GP)[None, :]
        r0, r1, r2, r3 = _philox_at(seed, i // 8)
        lane = (i % 8) // 2
        r = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
        k = tl.where(i % 2 == 0, _high_bits(r, NB, BASE), _low_bits(r, NB, BASE))
    return k


@triton.jit
def _high_bits(r, NB: tl.constexpr, BASE: tl.constexpr):
    """The top NB bits of r's high half, or'd into BASE (ptxas: one shift-and-add, LEA.HI)."""
    return (r >> (32 - NB)) | BASE


@triton.jit
def _low_bits(r, NB: tl.constexpr, BASE: tl.constexpr):
    """The top NB bits of r's low half, or'd into BASE: ``(r' & m) | BASE`` with r' = r >> (16 -
    NB). On a GPU with BASE in a register (INLINE_PTX): one ``lop3`` (truth table 0xea, (a & b) |
    c), where ptxas spends a LOP3 per immediate."""
    MASK: tl.constexpr = (1 << NB) - 1
    if 16 - NB > 0:
        r = r >> (16 - NB)
    if INLINE_PTX and BASE != 0:
        return tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, $2, $3, 0xea;", "=r,r,r,r",
            [r, tl.full(r.shape, MASK, tl.uint32), tl.full(r.shape, BASE, tl.uint32)],
            dtype=tl.uint32, is_pure=True, pack=1)
    return (r & MASK) | BASE


@triton.jit
def _part_of(row, part_magic, part_shift):
    """A group row's partition row // groups_per_part, int32: (row * part_magic) >> part_shift
    (triton_launch.division_magic: exact for 0 <= row < 2^30, part_magic < 2^31, part_shift >=
    30) computed as the high word of (4 row) * part_magic shifted right by part_shift - 30, the
    same floor: one 32-bit multiply-high and a shift, where the 64-bit product took four
    instructions (and a division per row a call into a 64-bit division routine)."""
    hi = tl.umulhi(row.to(tl.uint32) << 2, part_magic.to(tl.uint32))
    return (hi >> (part_shift - 30).to(tl.uint32)).to(tl.int32)


@triton.jit
def _max_nan(a, b):
    """``max`` that returns NaN when either operand is NaN (one ``max.NaN`` instruction): the
    group absmax of a group holding a NaN is NaN, as torch's ``amax``, without first replacing
    NaN by inf element by element (two instructions per element)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


ROUNDING_MAGIC = tl.constexpr(12582912.0)
"""1.5 * 2^23: a small integer n plus this is a float whose bit pattern ends in n's two's
complement (round to nearest's code words: the codes come out of a float add, no float -> int
conversion)."""

SR_BASE_NARROW = tl.constexpr(0x43400000)
"""Bit pattern of stochastic rounding's base for 2- and 4-bit codes, 192.0: base + v + u with
|v| < 8 and 0 <= u < 1 lies in [128, 256), where the float spacing is 2^-16 and bits 16.. of the
pattern hold the integer part minus 128, that is the code plus 64 (a multiple of 16 and of 4)."""

SR_BASE_WIDE = tl.constexpr(0x43C00000)
"""Bit pattern of stochastic rounding's base for 8-bit codes, 384.0: base + v + u with |v| < 128
lies in [256, 512), spacing 2^-15, bits 15.. of the pattern = the code plus 128 (mod 256)."""


@triton.jit
def _round_half_up_word(v):
    """Round to nearest's code word for fp32 v (|v| < 2^22): ROUNDING_MAGIC + floor(v + 0.5), the
    reference's floor(v) + (v - floor(v) >= 0.5) (frac(v) is exact for |v| >= 1/2 and rounds to
    >= 0.5 exactly when the true one is, below).

    On a GPU two round-down adds (ROUND_HALF_UP_PTX): rd(v + 0.5) has the floor of v + 0.5, as
    integers are floats and rounding down is monotone, and rd(y + ROUNDING_MAGIC), on the integer
    grid of [2^23, 2^24), is ROUNDING_MAGIC + floor(y). Three instructions with the product,
    against floor, difference, compare, select and add (tests/test_triton_kernels.py emulates the
    PTX text over ties, their neighbours and tiny negatives)."""
    if INLINE_PTX:
        return tl.inline_asm_elementwise(ROUND_HALF_UP_PTX, "=r,r", [v], dtype=tl.float32,
                                         is_pure=True, pack=1)
    lo = tl.floor(v)
    return lo + tl.where(v - lo >= 0.5, ROUNDING_MAGIC + 1.0, ROUNDING_MAGIC)


@triton.jit
def _quant_tile(x, rand_base, seed, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr,
                R: tl.constexpr, GP: tl.constexpr, ALIGNED: tl.constexpr):
    """x fp32 [R, GP] (one group per row, padding = 0) -> (int32 [R, GP] code words, fp32 scales
    [R], ok [R]: the row's codes are valid; False for a zero or non-finite group, whose codes
    _store_packed writes as 0). Row r's elements are random-stream elements rand_base[r] + 0..
    (see _noise_tile).

    A code word is the bit pattern of a float that holds the code where _store_packed takes it:
    ROUNDING_MAGIC + q (round to nearest: bits 0..) or an SR base + q + a fraction (stochastic:
    bits 16.. for 2 and 4 bits, bits 15.. plus 128 for 8). No clamp: |x * inv| <= amax *
    RN(QMAX / amax) <= QMAX (1 + 2^-24) < QMAX + 2^-17, so q <= QMAX under either rounding, and
    q >= -QMAX - 1 (tests/test_triton_kernels.py checks both at the edge, and every word).

    Stochastic: the word is fma(x, inv, base + u), u = k 2^-NB (base + u: the base's exponent with
    the random bits as its low mantissa, one or): the exact x * inv + base + u rounded once to the
    2^-NB grid, whose integer part is floor(v + u), up with probability frac(v) for v on that
    grid; to nearest, a tie at an integer rounds up (to the even neighbour), a mean bias below
    2^-21 of a quantization step for 2- and 4-bit codes and about 2^-18 for 8-bit ones
    (tests/test_triton_kernels.py emulates it over every u). Round to nearest: floor(v) +
    (frac(v) >= 0.5) with v = RN(x * inv), the reference's exact rule."""
    amax = tl.reduce(tl.abs(x), 1, _max_nan)      # NaN groups -> amax = NaN -> scale NaN
    inv = tl.math.div_rn(tl.full(amax.shape, QMAX, tl.float32), amax)
    ok = (inv < float("inf")) & (inv > 0.0)     # amax 0/tiny -> inf, Inf -> 0, NaN -> NaN
    inv_safe = tl.where(ok, inv, 0.0)
    bad = tl.where(amax < float("inf"), 0.0, float("nan"))
    scale = tl.where(ok, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), inv_safe), bad)
    if STOCHASTIC:
        if QMAX < 8:
            k = _noise_tile(seed, rand_base, R, GP, ALIGNED, 16, SR_BASE_NARROW)
        else:
            k = _noise_tile(seed, rand_base, R, GP, ALIGNED, 15, SR_BASE_WIDE)
        w = tl.fma(x, inv_safe[:, None], k.to(tl.float32, bitcast=True))
    else:
        w = _round_half_up_word(x * inv_safe[:, None])
    return w.to(tl.int32, bitcast=True), scale, ok


@triton.jit
def _byte_of(t, SH: tl.constexpr):
    """Byte SH // 8 of the code words t as the low byte of a uint32 (its low bits hold the code)."""
    return (t.to(tl.uint32, bitcast=True) >> SH) & 0xFF


@triton.jit
def _split8(t):
    """t [.., 2, 2, 2] -> its eight slices [..] in the order of 4x + 2y + z for t[.., x, y, z]."""
    z0, z1 = tl.split(t)
    y0z0, y1z0 = tl.split(z0)
    y0z1, y1z1 = tl.split(z1)
    e0, e4 = tl.split(y0z0)
    e2, e6 = tl.split(y1z0)
    e1, e5 = tl.split(y0z1)
    e3, e7 = tl.split(y1z1)
    return e0, e1, e2, e3, e4, e5, e6, e7


@triton.jit
def _pack_nibbles(t, SH: tl.constexpr):
    """t [.., 2, 2, 2]: the code words of eight consecutive elements, element 4x + 2y + z at
    [.., x, y, z], each code in the word's bits SH.. (_quant_tile) -> int32 [..]: their 4-bit
    codes, byte j = code(2j) << 4 | code(2j + 1) (MSB-first, little-endian: byte 0 first).
    On a GPU (INLINE_PTX) 8 instructions (codes_word_ptx), where shifting, masking and or-ing
    each code and assembling the bytes took about 2.5 an element."""
    e0, e1, e2, e3, e4, e5, e6, e7 = _split8(t)
    if INLINE_PTX:
        if SH == 0:
            PTX: tl.constexpr = NIBBLES_PTX_RN
        else:
            PTX: tl.constexpr = NIBBLES_PTX_SR
        word = tl.inline_asm_elementwise(PTX, "=r,r,r,r,r,r,r,r,r",
                                         [e0, e1, e2, e3, e4, e5, e6, e7], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        word = (_nibble_byte(e0, e1, SH) | (_nibble_byte(e2, e3, SH) << 8)
                | (_nibble_byte(e4, e5, SH) << 16) | (_nibble_byte(e6, e7, SH) << 24))
        word = word.to(tl.int32, bitcast=True)
    return word


@triton.jit
def _nibble_byte(t0, t1, SH: tl.constexpr):
    """The 4-bit codes of two code words as one byte, t0's in the high nibble (MSB-first)."""
    return ((_byte_of(t0, SH) & 0xF) << 4) | (_byte_of(t1, SH) & 0xF)


@triton.jit
def _crumb_byte(t0, t1, t2, t3, SH: tl.constexpr):
    """The 2-bit codes of four code words as one byte, t0's in the top bits (MSB-first)."""
    return (((_byte_of(t0, SH) & 3) << 6) | ((_byte_of(t1, SH) & 3) << 4)
            | ((_byte_of(t2, SH) & 3) << 2) | (_byte_of(t3, SH) & 3))


@triton.jit
def _pack_crumbs(t, SH: tl.constexpr):
    """t [.., 2, 2, 2, 2]: the code words of 16 consecutive elements, element 8a + 4b + 2c + d at
    [.., a, b, c, d] -> int32 [..]: their 2-bit codes, byte j = elements 4j .. 4j + 3 from the
    most significant bits down. On a GPU (INLINE_PTX) 18 instructions (codes_word_ptx), where the
    per-code shifts, masks and ors and the byte assembly took about 2 an element."""
    f0, f1, f2, f3, f4, f5, f6, f7 = _split8(t)     # [.., 2]: elements 8a + k, a = 0, 1
    e0, e8 = tl.split(f0)
    e1, e9 = tl.split(f1)
    e2, e10 = tl.split(f2)
    e3, e11 = tl.split(f3)
    e4, e12 = tl.split(f4)
    e5, e13 = tl.split(f5)
    e6, e14 = tl.split(f6)
    e7, e15 = tl.split(f7)
    if INLINE_PTX:
        if SH == 0:
            PTX: tl.constexpr = CRUMBS_PTX_RN
        else:
            PTX: tl.constexpr = CRUMBS_PTX_SR
        # a literal constraint string: Triton 3.6's code generator does not evaluate str.join
        word = tl.inline_asm_elementwise(
            PTX, "=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
            [e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        word = (_crumb_byte(e0, e1, e2, e3, SH) | (_crumb_byte(e4, e5, e6, e7, SH) << 8)
                | (_crumb_byte(e8, e9, e10, e11, SH) << 16)
                | (_crumb_byte(e12, e13, e14, e15, SH) << 24))
        word = word.to(tl.int32, bitcast=True)
    return word


@triton.jit
def _store_packed(codes_ptr, w, og, R: tl.constexpr, GS: tl.constexpr, GP: tl.constexpr,
                  BITS: tl.constexpr, STOCHASTIC: tl.constexpr, gmask, ok):
    """Pack _quant_tile's code words w [R, GP] (MSB-first) and store group rows at output group
    index og [R]; rows not ok get zero codes (a second, predicated store of zeros: a NaN input's
    word is NaN's, and a select per byte would cost an instruction each). 2- and 4-bit groups of
    whole words are packed and stored as int32 words (_pack_nibbles, _pack_crumbs), other group
    sizes and 8-bit codes byte by byte (packing 8-bit stochastic words the same way saved only 0.3
    instructions an element in the model: ptxas gathers those bytes well itself)."""
    BPG: tl.constexpr = GS * BITS // 8               # bytes per group
    if STOCHASTIC:
        SH: tl.constexpr = 16 if BITS < 8 else 15
    else:
        SH: tl.constexpr = 0
    base = og.to(tl.int64) * BPG
    if BITS < 8 and (GS * BITS) % 32 == 0:
        # whole words per group (the codes buffers are fresh allocations: 4-byte aligned)
        PW: tl.constexpr = 32 // BITS               # codes per word
        if BITS == 4:
            word = _pack_nibbles(tl.reshape(w, (R, GP // PW, 2, 2, 2)), SH)
            cols = tl.max_contiguous(tl.arange(0, GP // PW), 2)   # a thread's 8 bytes
        else:
            word = _pack_crumbs(tl.reshape(w, (R, GP // PW, 2, 2, 2, 2)), SH)
            cols = tl.max_contiguous(tl.arange(0, GP // PW), 1)   # a thread's 4 bytes
        m = gmask[:, None] & (cols[None, :] < BPG // 4)
        ptrs = codes_ptr.to(tl.pointer_type(tl.int32)) + (base // 4)[:, None] + cols[None, :]
        tl.store(ptrs, word, mask=m & ok[:, None])
        tl.store(ptrs, tl.zeros_like(word), mask=m & ~ok[:, None])
    else:
        if BITS == 8:
            cols = tl.arange(0, GP)
            if STOCHASTIC:
                byte = (w >> SH) + 128              # bits 15..22 hold code + 128 (mod 256)
            else:
                byte = w
        elif BITS == 4:
            cols = tl.max_contiguous(tl.arange(0, GP // 2), 8)
            hi, lo = tl.split(tl.reshape(w, (R, GP // 2, 2)))
            byte = (((hi >> SH) & 0xF) << 4) | ((lo >> SH) & 0xF)
        else:
            cols = tl.max_contiguous(tl.arange(0, GP // 4), 4)
            ev, od = tl.split(tl.reshape(w, (R, GP // 4, 2, 2)))   # [R, GP/4, 2]: 4i+2k, +1
            e0, e2 = tl.split(ev)
            e1, e3 = tl.split(od)
            byte = ((((e0 >> SH) & 3) << 6) | (((e1 >> SH) & 3) << 4)
                    | (((e2 >> SH) & 3) << 2) | ((e3 >> SH) & 3))
        m = gmask[:, None] & (cols[None, :] < BPG)
        ptrs = codes_ptr + base[:, None] + cols[None, :]
        tl.store(ptrs, byte.to(tl.uint8), mask=m & ok[:, None])
        tl.store(ptrs, tl.zeros_like(byte).to(tl.uint8), mask=m & ~ok[:, None])


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
def _field_dequant(acc, word, scale, P: tl.constexpr, BITS: tl.constexpr, ADD: tl.constexpr):
    """[acc +] code * scale for the signed BITS-wide code at bit P of int32 words (P + BITS <=
    23), with the reference's roundings (a product, then a sum: no fused multiply-add).

    The code becomes a float exactly in two instructions (no shift, sign extension or int ->
    float conversion): the field with its sign bit flipped (code + 2^(BITS-1), unsigned) is the
    low mantissa of a float whose exponent K = 23 - P gives bit P the weight 1, so that float is
    2^K + code + 2^(BITS-1) and subtracting the constant is exact. On a GPU the steps are one
    inline PTX block (INLINE_PTX): ptxas makes the and-xor one LOP3 only there, and the sum
    inside it keeps each slot's values from living until every slot is decoded (a summing
    kernel's slots are unrolled)."""
    K: tl.constexpr = 23 - P
    SIGN: tl.constexpr = 1 << (BITS - 1)
    MASK: tl.constexpr = ((1 << BITS) - 1) << P
    FLIP: tl.constexpr = (SIGN << P) | ((K + 127) << 23)
    OFFSET: tl.constexpr = float((1 << K) + SIGN)
    if INLINE_PTX:     # lop3 truth table 0x6a: (a & b) ^ c
        mask = tl.full(word.shape, MASK, tl.int32)
        flip = tl.full(word.shape, FLIP, tl.int32)
        offset = tl.full(word.shape, OFFSET, tl.float32)
        if ADD:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $2, $4, $5, 0x6a; sub.rn.f32 t, t, $6; "
                "mul.rn.f32 t, t, $3; add.rn.f32 $0, $1, t; }", "=r,r,r,r,r,r,r",
                [acc, word, scale, mask, flip, offset], dtype=tl.float32, is_pure=True, pack=1)
        else:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $1, $3, $4, 0x6a; sub.rn.f32 t, t, $5; "
                "mul.rn.f32 $0, t, $2; }", "=r,r,r,r,r,r",
                [word, scale, mask, flip, offset], dtype=tl.float32, is_pure=True, pack=1)
    else:
        d = (((word & MASK) ^ FLIP).to(tl.float32, bitcast=True) - OFFSET) * scale
        if ADD:
            out = acc + d
        else:
            out = d
    return out


@triton.jit
def _word_pair(t, w, h, s, P: tl.constexpr, BITS: tl.constexpr, ADD: tl.constexpr):
    """t [..., 2]: the elements of the field at bit P of w (index 0) and of h (index 1), both
    [acc +] dequantized (_field_dequant)."""
    a, b = tl.split(t)
    return tl.join(_field_dequant(a, w, s, P, BITS, ADD), _field_dequant(b, h, s, P, BITS, ADD))


@triton.jit
def _word_quad(t, w, h, s, P0: tl.constexpr, P1: tl.constexpr, BITS: tl.constexpr,
               ADD: tl.constexpr):
    """t [..., 2, 2]: _word_pair of the fields at bits P0 (index 0 of the last axis) and P1."""
    a, b = tl.split(t)
    return tl.join(_word_pair(a, w, h, s, P0, BITS, ADD), _word_pair(b, w, h, s, P1, BITS, ADD))


@triton.jit
def _word_rows(acc, codes_ptr, scales_ptr, first, gmask, R: tl.constexpr, GP: tl.constexpr,
               BITS: tl.constexpr, GS_SCALE: tl.constexpr, ADD: tl.constexpr):
    """[acc +] R rows of GP 2- or 4-bit codes dequantized -> fp32 [R, GP], the packed rows read
    as int32 words: row r starts at flat index first[r] (a whole number of words; codes_ptr
    4-byte aligned, triton_launch._operands) inside one scale group of GS_SCALE elements.

    In a little-endian word byte j holds the codes of elements PER j .. PER j + PER - 1 from its
    most significant bits down (MSB-first packing); the upper two bytes are read from the word
    shifted right by 16 (h), as the lower two. acc is split along the element order and the
    results joined back (a join's new axis is the last): 4-bit element 4x + 2y + z of a word is
    [.., x, y, z], the field at bit 8y + 4 - 4z of w (x = 0) or h (x = 1); 2-bit element
    8a + 4b + 2c + d is [.., a, b, c, d], at bit 8b + 6 - 4c - 2d of w (a = 0) or h (a = 1)."""
    PER: tl.constexpr = 8 // BITS
    W: tl.constexpr = GP * BITS // 32
    wptr = codes_ptr.to(tl.pointer_type(tl.int32))
    w = tl.load(wptr + (first // (4 * PER))[:, None] + tl.arange(0, W)[None, :],
                mask=gmask[:, None], other=0)
    h = w >> 16
    s = tl.load(scales_ptr + first // GS_SCALE, mask=gmask, other=0.0)[:, None]
    if BITS == 4:
        z0, z1 = tl.split(tl.reshape(acc, (R, W, 2, 2, 2)))
        c = tl.join(_word_quad(z0, w, h, s, 4, 12, 4, ADD), _word_quad(z1, w, h, s, 0, 8, 4, ADD))
    else:
        d0, d1 = tl.split(tl.reshape(acc, (R, W, 2, 2, 2, 2)))
        c00, c01 = tl.split(d0)
        c10, c11 = tl.split(d1)
        c = tl.join(tl.join(_word_quad(c00, w, h, s, 6, 14, 2, ADD),
                            _word_quad(c01, w, h, s, 2, 10, 2, ADD)),
                    tl.join(_word_quad(c10, w, h, s, 4, 12, 2, ADD),
                            _word_quad(c11, w, h, s, 0, 8, 2, ADD)))
    return tl.reshape(c, (R, GP))


@triton.jit
def _load_deq_rows(acc, codes_ptr, scales_ptr, first, gmask, R: tl.constexpr, GP: tl.constexpr,
                   GS: tl.constexpr, BITS: tl.constexpr, GS_SCALE: tl.constexpr,
                   ADD: tl.constexpr):
    """[acc +] R rows of GS elements dequantized -> fp32 [R, GP]: row r starts at flat index
    first[r] (int64, a multiple of GS) and lies inside one scale group of GS_SCALE elements
    (GS_SCALE a multiple of GS).  Same values as _load_deq, but each row's packed bytes are
    loaded once as a contiguous run (4- and 2-bit codes are split in registers instead of every
    element loading its own byte; as int32 words when a row is whole words, _word_rows) and
    there is one scale load per row."""
    if BITS < 8 and GP == GS and (GS * BITS) % 32 == 0:
        out = _word_rows(acc, codes_ptr, scales_ptr, first, gmask, R, GP, BITS, GS_SCALE, ADD)
    else:
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
        s = tl.load(scales_ptr + first // GS_SCALE, mask=gmask, other=0.0)
        d = c.to(tl.float32) * s[:, None]
        if ADD:
            out = acc + d
        else:
            out = d
    return out


@triton.jit
def _slot_steps(n, BITS: tl.constexpr, GS_SCALE: tl.constexpr):
    """(code bytes, scales) from one slot of n elements to the next, int64 (no int32 overflow; a
    cast, as the JIT makes n == 1 a compile-time constant). The summing kernels advance their
    codes and scales base pointers by these per slot, so a row's offsets from the bases are
    computed once."""
    n64 = tl.cast(n, tl.int64)
    return n64 * BITS // 8, n64 // GS_SCALE


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------

# a fresh seed per launch: never a new compile; num_groups == 1 would fold the layout anchor away
@triton.jit(do_not_specialize=["seed", "num_groups", "part_magic", "part_shift"])
def _quantize_kernel(x_ptr, ref_ptr, codes_ptr, scales_ptr, slot_ptr, nonfinite_ptr, anchor_ptr,
                     seed, num_groups, groups_per_part, part_magic, part_shift,
                     GS: tl.constexpr, GP: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr,
                     STOCHASTIC: tl.constexpr, HADAMARD: tl.constexpr, HB: tl.constexpr,
                     DIFF: tl.constexpr, PERMUTE: tl.constexpr, CHECK: tl.constexpr,
                     ALIGNED: tl.constexpr, FULL: tl.constexpr):
    """[new - ref ->] [FWHT ->] absmax -> round -> pack -> store at (permuted) group slot."""
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    pid = tl.program_id(0)
    g = pid.to(tl.int64) * R + tl.arange(0, R)
    gmask = g < num_groups
    e = tl.arange(0, GP)
    m = gmask[:, None] & (e[None, :] < GS)
    offs = g[:, None] * GS + e[None, :]
    if FULL:        # whole tiles of whole groups: no mask, so no zero fill before the loads
        x = tl.load(x_ptr + offs)
    else:
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
    if DIFF:
        if FULL:
            r = tl.load(ref_ptr + offs)
        else:
            r = tl.load(ref_ptr + offs, mask=m, other=0.0)
        RT: tl.constexpr = ref_ptr.dtype.element_ty
        xn = _round_to(x.to(tl.float32), RT)        # new cast to the reference dtype
        x = _round_to(xn - r.to(tl.float32), RT)     # subtraction rounded to the reference dtype
    else:
        x = _to_f32(x)
    if HADAMARD:
        x = tl.reshape(_fwht(tl.reshape(x, (R * GP // HB, HB)), R * GP // HB, HB), (R, GP))
    q, scale, ok = _quant_tile(x, g * GS, seed, QMAX, STOCHASTIC, R, GP, ALIGNED)
    if BITS < 8:
        # Layout anchor: Triton's coalescing gives the memory accesses of one tile shape the
        # widest vector any of them takes, and a uint8 access of [R, GP] takes 16 elements per
        # thread. The 8-bit codes' store is one; the 2- and 4-bit stores are narrower tiles, so
        # without this store the fp32 tile keeps 4 elements per thread: 4x the rows per thread,
        # each with its own divisions and absmax shuffles, and the Hadamard stages across
        # threads. The store never runs (num_groups >= 0) and would write zeros to a scratch tile.
        never = tl.zeros_like(offs) + num_groups < 0
        tl.store(anchor_ptr + tl.arange(0, R)[:, None] * GP + e[None, :],
                 tl.zeros([R, GP], dtype=tl.uint8), mask=never)
    if PERMUTE:
        n = pid * R + tl.arange(0, R)
        part = _part_of(n, part_magic, part_shift)
        slot = tl.load(slot_ptr + part, mask=gmask, other=0).to(tl.int64)
        og = slot * groups_per_part + (n - part * groups_per_part)
    else:
        og = g
    tl.store(scales_ptr + og, scale, mask=gmask)
    if CHECK:
        # groups whose absmax is NaN/Inf (scale NaN): a NaN/Inf input, or a transform or a
        # difference that overflowed; per group row (testing every element cost about 5
        # instructions per element), one relaxed atomic per such row: none in a clean step,
        # where summing the rows first cost a cross-warp reduction in every program. Its
        # pointers follow the scale store's (og * 0), so the rows reach it in that layout.
        tl.atomic_add(nonfinite_ptr + og * 0, tl.full([R], 1, tl.int32),
                      mask=gmask & (scale != scale), sem="relaxed")
    _store_packed(codes_ptr, q, og, R, GS, GP, BITS, STOCHASTIC, gmask, ok)


@triton.jit(do_not_specialize=["seed"])  # a fresh seed per launch: never a new compile
def _dsum_requant_kernel(codes_ptr, scales_ptr, out_codes_ptr, out_scales_ptr, seed,
                         n, num_groups_out, part_len, part_stride, base, S: tl.constexpr,
                         GS_IN: tl.constexpr, BITS_IN: tl.constexpr,
                         GS: tl.constexpr, GP: tl.constexpr, R: tl.constexpr,
                         BITS: tl.constexpr, STOCHASTIC: tl.constexpr, ALIGNED: tl.constexpr,
                         ROWS: tl.constexpr):
    """Sum the dequantized source chunks (order 0..S-1, fp32) and requantize per output group.
    The noise of output element i is that of element (i // part_len) * part_stride + base +
    i % part_len of the whole call (reference.NoiseIndex; part_len = n, base = 0: identity).
    S is a compile-time constant so the S source loads are unrolled and issued together (a
    runtime loop holding one slot at a time leaves a thread 1/S of the bytes in flight, which
    bench/kernel_cost_model.py models slower at S = 8). ROWS (GS_IN a multiple of GS, GP ==
    GS): each tile row lies in one input group, so its packed bytes load as one run and its scale
    once; else every element loads its own byte and scale (far more registers: it spills at S = 8
    on sm_90)."""
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    pid = tl.program_id(0)
    g = pid.to(tl.int64) * R + tl.arange(0, R)
    gmask = g < num_groups_out
    e = tl.arange(0, GP)
    m = gmask[:, None] & (e[None, :] < GS)
    acc = tl.zeros((R, GP), dtype=tl.float32)
    first = g * GS                              # a row never straddles a part (NoiseIndex.check)
    if ROWS:                                    # a row lies in one input group: a scale per row
        # the sum starts at slot 0's products, not 0 + them: that differs only in a zero's sign
        # (0 + -0 = +0), which the requantization does not see (|x| for the scale, x * inv + u
        # or the rounding of x * inv for the code: the same code either way)
        cstep, sstep = _slot_steps(n, BITS_IN, GS_IN)
        acc = _load_deq_rows(acc, codes_ptr, scales_ptr, first, gmask, R, GP, GS, BITS_IN, GS_IN,
                             False)
        for _s in tl.static_range(1, S):
            acc = _load_deq_rows(acc, codes_ptr + _s * cstep, scales_ptr + _s * sstep, first,
                                 gmask, R, GP, GS, BITS_IN, GS_IN, True)
    else:
        src = first                             # int64 running offset: no int32 overflow
        for _s in tl.static_range(S):
            acc = acc + _load_deq(codes_ptr, scales_ptr, src[:, None] + e[None, :], m, BITS_IN,
                                  GS_IN)
            src = src + n
    noise_base = (first // part_len) * part_stride + base + first % part_len
    q, scale, ok = _quant_tile(acc, noise_base, seed, QMAX, STOCHASTIC, R, GP, ALIGNED)
    tl.store(out_scales_ptr + g, scale, mask=gmask)
    _store_packed(out_codes_ptr, q, g, R, GS, GP, BITS, STOCHASTIC, gmask, ok)


@triton.jit
def _dsum_kernel(codes_ptr, scales_ptr, out_ptr, out_stride, scale, n, S: tl.constexpr,
                 GS: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                 HADAMARD: tl.constexpr, HB: tl.constexpr, HAS_SCALE: tl.constexpr,
                 ROWS: tl.constexpr):
    """Dequantize + fp32 sum over sources [-> inverse FWHT] [* scale] -> strided out (any float).
    S (sources) is a compile-time constant: up to SOURCES_UNROLLED (8) slots the S loads are
    unrolled and issued together; more (the final hop at 16 nodes) run as a loop over chunks of
    8 unrolled slots, in slot order (16 unrolled 8-bit slots took 150-168 registers on sm_90). ROWS
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
        cstep, sstep = _slot_steps(n, BITS, GS)
        cp = codes_ptr
        sp = scales_ptr
        if S > SOURCES_UNROLLED:                # chunks of 8 slots, then the rest, in order
            for _c in range(S // SOURCES_UNROLLED):
                for _s in tl.static_range(SOURCES_UNROLLED):
                    acc2 = _load_deq_rows(acc2, cp, sp, first, gmask, RB, GS, GS, BITS, GS, True)
                    cp = cp + cstep
                    sp = sp + sstep
            for _s in tl.static_range(S - S // SOURCES_UNROLLED * SOURCES_UNROLLED):
                acc2 = _load_deq_rows(acc2, cp, sp, first, gmask, RB, GS, GS, BITS, GS, True)
                cp = cp + cstep
                sp = sp + sstep
        else:
            for _s in tl.static_range(S):
                acc2 = _load_deq_rows(acc2, cp, sp, first, gmask, RB, GS, GS, BITS, GS, True)
                cp = cp + cstep
                sp = sp + sstep
        acc = tl.reshape(acc2, (BLOCK,))
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        src = idx                               # int64 running offset: no int32 overflow
        if S > SOURCES_UNROLLED:
            for _c in range(S // SOURCES_UNROLLED):
                for _s in tl.static_range(SOURCES_UNROLLED):
                    acc = acc + _load_deq(codes_ptr, scales_ptr, src, m, BITS, GS)
                    src = src + n
            for _s in tl.static_range(S - S // SOURCES_UNROLLED * SOURCES_UNROLLED):
                acc = acc + _load_deq(codes_ptr, scales_ptr, src, m, BITS, GS)
                src = src + n
        else:
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


@triton.jit(do_not_specialize=["part_magic", "part_shift"])
def _dequant_parts_kernel(codes_ptr, scales_ptr, slot_ptr, sub_ptr, out_ptr, n, part_len,
                          part_magic, part_shift,
                          GS: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                          HADAMARD: tl.constexpr, HB: tl.constexpr, SUB: tl.constexpr,
                          ROWS: tl.constexpr):
    """out[i] = [sub[i] -] [inverse FWHT] dequantized element i of the input layout, which lies in
    slot slot_of[p] (p = i // part_len) at i % part_len: the inverse of the quantize kernel's
    PERMUTE, for every slot in one launch (LoCo's first-hop residual ``h - sent``). Per element
    the operations of _dsum_kernel at S = 1 (``0 + code*scale``) then one subtraction, so
    bit-identical to dequantizing slot by slot and subtracting. part_len is a multiple of GS and
    HB: a group or Hadamard block never straddles two partitions. ROWS (GS a power of two dividing
    BLOCK): one slot lookup, packed-byte run and scale per group row, the row's partition by
    multiply and shift (part_magic, part_shift: triton_launch.division_magic of the groups per
    partition, exact below 2^30 groups; a 64-bit division routine per row made sm_90 spill
    around its call); else per element. out may be sub itself (each element is read before it
    is written, by the same program)."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * BLOCK             # the program's first element: int64 once,
    left = n - base                             # int32 offsets below it (BLOCK elements)
    if ROWS:                                    # [rows, GS] from load to store: no relayout
        RB: tl.constexpr = BLOCK // GS
        loc = tl.arange(0, RB)[:, None] * GS + tl.arange(0, GS)[None, :]
        first = base + tl.arange(0, RB) * GS
        gmask = first < n
        part = _part_of(pid * RB + tl.arange(0, RB), part_magic, part_shift).to(tl.int64)
        slot = tl.load(slot_ptr + part, mask=gmask, other=0).to(tl.int64)
        src = slot * part_len + (first - part * part_len)
        acc = tl.zeros((RB, GS), dtype=tl.float32)
        acc = _load_deq_rows(acc, codes_ptr, scales_ptr, src, gmask, RB, GS, GS, BITS, GS, True)
        if HADAMARD:
            acc = tl.reshape(_fwht(tl.reshape(acc, (BLOCK // HB, HB)), BLOCK // HB, HB),
                             (RB, GS))
            acc = acc * (1.0 / HB)
    else:
        loc = tl.arange(0, BLOCK)
        idx = base + loc
        m = loc < left
        slot = tl.load(slot_ptr + idx // part_len, mask=m, other=0).to(tl.int64)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        acc = acc + _load_deq(codes_ptr, scales_ptr, slot * part_len + idx % part_len, m, BITS,
                              GS)
        if HADAMARD:
            acc = tl.reshape(_fwht(tl.reshape(acc, (BLOCK // HB, HB)), BLOCK // HB, HB),
                             (BLOCK,))
            acc = acc * (1.0 / HB)
    m = loc < left                              # n is a multiple of GS: rows are whole
    if SUB:
        acc = tl.load(sub_ptr + base + loc, mask=m, other=0.0) - acc
    tl.store(out_ptr + base + loc, acc, mask=m)


@triton.jit
def _dequant_add_kernel(codes_ptr, scales_ptr, ref_ptr, out_ptr, n,
                        GS: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                        ROWS: tl.constexpr):
    """out = dt(dt(code*scale) + ref) with dt = ref dtype (out may alias ref). ROWS (GS a power of
    two dividing BLOCK): the block is BLOCK // GS whole groups, each group's packed bytes loaded
    once as a run and its scale once (_load_deq_rows); else every element loads its own byte and
    scale."""
    pid = tl.program_id(0)
    RT: tl.constexpr = ref_ptr.dtype.element_ty
    if ROWS:
        RB: tl.constexpr = BLOCK // GS
        first = (pid.to(tl.int64) * RB + tl.arange(0, RB)) * GS
        gmask = first < n                       # n is a multiple of GS: rows are whole or out
        idx = first[:, None] + tl.arange(0, GS)[None, :]
        m = gmask[:, None] & (idx < n)
        d = _load_deq_rows(tl.zeros((RB, GS), dtype=tl.float32), codes_ptr, scales_ptr, first,
                           gmask, RB, GS, GS, BITS, GS, False)
    else:
        idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = idx < n
        d = _load_deq(codes_ptr, scales_ptr, idx, m, BITS, GS)
    d = _round_to(d, RT)
    r = tl.load(ref_ptr + idx, mask=m, other=0.0).to(tl.float32)
    y = _round_to(d + r, RT)
    tl.store(out_ptr + idx, y.to(RT), mask=m)
