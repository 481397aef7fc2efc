"""Numerics of the torch reference quantizer (megatron/distributed/quant/kernels).

These tests exercise the public API with the backend forced to the PyTorch reference, which is
the definition the Triton kernels are checked against in tests/test_triton_kernels.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron.distributed.quant.kernels import dispatch as K
from megatron.distributed.quant.kernels import reference as R

N = 1 << 16  # big enough that error estimates fluctuate < 1 %, small enough to be fast


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("QUANT_KERNELS", "torch")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel(y: torch.Tensor, x: torch.Tensor) -> float:
    return ((y.float() - x.float()).norm() / x.float().norm()).item()


def _gauss(n: int = N, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=_gen(seed))


# ------------------------------------------------------------------------------------------------
# error bounds
# ------------------------------------------------------------------------------------------------
# For N(0,1) data and group 128 the group absmax is ~2.7 (expected max of 128 |normals|), so the
# step is s = 2.7/qmax.  RN error is uniform on [-s/2, s/2] -> rms s/sqrt(12); SR error has
# variance E[f(1-f)] s^2 = s^2/6 -> rms s/sqrt(6).  4-bit: s~0.39 -> RN ~0.11, SR ~0.16 (measured
# 0.117 / 0.166); 8-bit: s~0.021 -> RN ~0.0062, SR ~0.0088 (measured 0.0065 / 0.0091).
# Bounds add ~15 % margin (the absmax distribution tail) while still catching e.g. an off-by-one
# qmax (which changes 4-bit error by ~15-30 %) or a wrong scale formula.
@pytest.mark.parametrize("bits,stochastic,bound", [
    (4, False, 0.13), (4, True, 0.19), (8, False, 0.0075), (8, True, 0.0105),
])
def test_error_bounds_gaussian(bits: int, stochastic: bool, bound: float) -> None:
    x = _gauss()
    q = K.quantize(x, bits, 128, stochastic=stochastic, generator=_gen(1))
    err = _rel(K.dequantize(q), x)
    assert err < bound, f"{bits}-bit stochastic={stochastic}: rel L2 {err:.4f} >= {bound}"
    # and not suspiciously small (a no-op quantizer would pass the upper bound)
    assert err > 0.6 * bound


def test_2bit_is_coarser_than_4bit() -> None:
    x = _gauss()
    e2 = _rel(K.dequantize(K.quantize(x, 2, 128, stochastic=False)), x)
    e4 = _rel(K.dequantize(K.quantize(x, 4, 128, stochastic=False)), x)
    assert e4 < e2 < 1.0


def test_error_bound_bf16_input() -> None:
    x = _gauss().bfloat16()
    err = _rel(K.dequantize(K.quantize(x, 4, 128, stochastic=False)), x)
    assert err < 0.13


@pytest.mark.parametrize("stochastic", [False, True])
def test_hadamard_reduces_error_on_heavy_tails(stochastic: bool) -> None:
    # Student-t with 2 dof: outliers dominate the plain absmax; the Hadamard transform spreads each
    # outlier over its 32-block.  Measured ratio HT/plain is 0.40-0.48; require < 0.65.
    x = torch.distributions.StudentT(2.0).sample((N,))
    plain = _rel(K.dequantize(K.quantize(x, 4, 128, stochastic=stochastic, generator=_gen(2))), x)
    had = _rel(K.dequantize(K.quantize(x, 4, 128, stochastic=stochastic, generator=_gen(2),
                                       hadamard=True), hadamard=True), x)
    assert had < 0.65 * plain, (plain, had)


def test_hadamard_reduces_error_with_spikes() -> None:
    x = _gauss()
    x[torch.randperm(N, generator=_gen(3))[: N // 512]] *= 100.0
    plain = _rel(K.dequantize(K.quantize(x, 8, 128, stochastic=False)), x)
    had = _rel(K.dequantize(K.quantize(x, 8, 128, stochastic=False, hadamard=True), hadamard=True), x)
    assert had < 0.5 * plain, (plain, had)   # measured ~0.21


# ------------------------------------------------------------------------------------------------
# format
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip(bits: int) -> None:
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    c = torch.randint(lo, hi + 1, (4096,), generator=_gen(4), dtype=torch.int64).to(torch.int8)
    c[:2] = torch.tensor([lo, hi], dtype=torch.int8)
    p = K.pack(c, bits)
    assert p.dtype == torch.uint8 and p.numel() == 4096 * bits // 8
    assert torch.equal(K.unpack(p, bits, 4096), c)


def test_pack_layout() -> None:
    # 4-bit: element 2i in the high nibble; 2-bit: element 4i in the top two bits
    assert K.pack(torch.tensor([-8, 7], dtype=torch.int8), 4).tolist() == [0x87]
    assert K.pack(torch.tensor([1, -1], dtype=torch.int8), 4).tolist() == [0x1F]
    assert K.pack(torch.tensor([-2, 1, 0, -1], dtype=torch.int8), 2).tolist() == [0b10010011]
    assert K.pack(torch.tensor([-128, 127], dtype=torch.int8), 8).tolist() == [0x80, 0x7F]


def test_codes_within_range_and_scale_formula() -> None:
    x = _gauss(4096)
    q = K.quantize(x, 4, 128, stochastic=True, generator=_gen(5))
    c = K.unpack(q.codes, 4, q.numel)
    assert int(c.min()) >= -8 and int(c.max()) <= 7
    amax = x.view(-1, 128).abs().amax(1)
    expect = 1.0 / (torch.full_like(amax, 7.0) / amax)
    assert torch.equal(q.scales, expect)
    assert q.scales.dtype == torch.float32 and q.scales.shape == (32,)


def test_zero_groups_are_safe() -> None:
    x = _gauss(512)
    x[128:256] = 0.0
    x[256:384] = 1e-40  # subnormal: qmax/amax overflows -> treated as a zero group
    for sr in (False, True):
        q = K.quantize(x, 4, 128, stochastic=sr)
        y = K.dequantize(q)
        assert torch.isfinite(q.scales).all()
        assert q.scales[1] == 0 and q.scales[2] == 0
        assert torch.equal(y[128:384], torch.zeros(256))
        assert torch.isfinite(y).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_unchecked_nonfinite_stays_nan(bad: float) -> None:
    # with check_finite=False a poisoned group must dequantize to NaN, never to finite values
    x = _gauss(256)
    x[5] = bad
    q = K.quantize(x, 4, 128, check_finite=False)
    y = K.dequantize(q)
    assert torch.isnan(y[:128]).all() and torch.isfinite(y[128:]).all()


# ------------------------------------------------------------------------------------------------
# stochastic rounding
# ------------------------------------------------------------------------------------------------
def test_stochastic_rounding_unbiased() -> None:
    x = _gauss(1024, seed=6)
    draws = 2000
    g = _gen(7)
    acc = torch.zeros_like(x)
    for _ in range(draws):
        acc += K.dequantize(K.quantize(x, 4, 128, stochastic=True, generator=g))
    mean = acc / draws
    # per-element std of one draw <= step/2; standard error of the mean = step/(2 sqrt(draws))
    step = (x.view(-1, 128).abs().amax(1) / 7.0).repeat_interleave(128)
    z = (mean - x).abs() / (step / (2 * math.sqrt(draws)))
    assert z.max() < 5.0, float(z.max())
    # round-to-nearest, by contrast, is biased for a typical element
    rn = K.dequantize(K.quantize(x, 4, 128, stochastic=False))
    assert ((rn - x).abs() / (step / (2 * math.sqrt(draws)))).max() > 5.0


def test_seeded_generator_reproducible() -> None:
    x = _gauss(4096)
    a = K.quantize(x, 4, 128, generator=_gen(8))
    b = K.quantize(x, 4, 128, generator=_gen(8))
    c = K.quantize(x, 4, 128, generator=_gen(9))
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    assert not torch.equal(a.codes, c.codes)


# ------------------------------------------------------------------------------------------------
# Hadamard
# ------------------------------------------------------------------------------------------------
def test_hadamard_matches_dense_matrix_and_inverts() -> None:
    x = _gauss(4 * 32)
    H = K.hadamard_matrix(32)
    assert torch.equal(H @ H, 32 * torch.eye(32))
    assert torch.allclose(K.hadamard_transform(x).view(4, 32), x.view(4, 32) @ H.T, atol=1e-5)
    assert torch.allclose(K.inverse_hadamard_transform(K.hadamard_transform(x)), x, atol=1e-6)
    assert torch.allclose(K.hadamard_transform(x, 8).view(-1, 8), x.view(-1, 8) @ K.hadamard_matrix(8).T,
                          atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_hadamard_blocks_beyond_what_every_kernel_transforms_are_refused(monkeypatch,
                                                                          backend: str) -> None:
    """The Triton butterfly is unrolled to stride 512: a 2048-point block (accepted before by
    --hadamard-block-size) skipped a stage there and quantized another transform, silently. Every
    backend and the flag refuse blocks above HADAMARD_MAX_BLOCK; 1024 still works."""
    from megatron.distributed.quant.config import QuantizationConfig

    monkeypatch.setenv("QUANT_KERNELS", backend)
    if backend == "cpp" and not K.cpu_kernels_available():
        pytest.skip("C++ kernels not built here")
    if backend == "triton":
        pytest.importorskip("triton")
    x = _gauss(4096)
    with pytest.raises(ValueError, match="larger than 1024"):
        K.quantize(x, 8, 2048, stochastic=False, hadamard=True, hadamard_block=2048)
    q = K.quantize(x, 8, 2048, stochastic=False)
    with pytest.raises(ValueError, match="larger than 1024"):
        K.dequantize(q, hadamard=True, hadamard_block=2048)
    big = K.quantize(x, 8, 1024, stochastic=False, hadamard=True, hadamard_block=1024)
    want = R.quantize(x, 8, 1024, stochastic=False, hadamard=True, hadamard_block=1024)
    assert torch.equal(big.codes, want.codes) and torch.equal(big.scales, want.scales)
    with pytest.raises(ValueError, match="--hadamard-block-size must be at most 1024"):
        QuantizationConfig(quantized_gradients=True, hadamard_transform=True,
                           hadamard_block_size=2048, gq_group_size_intra=2048,
                           gq_group_size_inter=2048).validate()


def test_quantize_hadamard_quantizes_transformed_values() -> None:
    x = _gauss(1024)
    q = K.quantize(x, 8, 128, stochastic=False, hadamard=True)
    ref = K.quantize(K.hadamard_transform(x), 8, 128, stochastic=False)
    assert torch.equal(q.codes, ref.codes) and torch.equal(q.scales, ref.scales)


# ------------------------------------------------------------------------------------------------
# fused ops == unfused compositions
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hadamard", [False, True])
def test_quantize_partitions_is_permuted_quantize(hadamard: bool) -> None:
    x = _gauss(8 * 256)
    order = [0, 4, 1, 5, 2, 6, 3, 7]
    for sr in (False, True):
        q = K.quantize_partitions(x, 8, order, 4, 128, stochastic=sr, generator=_gen(10),
                                  hadamard=hadamard)
        full = K.quantize(x, 4, 128, stochastic=sr, generator=_gen(10), hadamard=hadamard)
        codes = full.codes.view(8, -1)[order].reshape(-1)
        scales = full.scales.view(8, -1)[order].reshape(-1)
        assert torch.equal(q.codes, codes) and torch.equal(q.scales, scales)
        assert q.numel == x.numel() and q.group_size == 128 and q.bits == 4


def _slot_by_slot(q: R.QuantizedTensor, order, hadamard: bool, hadamard_block: int,
                  h=None) -> torch.Tensor:
    """What LoCo's first hop did before dequantize_partitions: one dequantize call per slot
    into its partition's place, then ``torch.sub(h, sent)`` into that buffer."""
    rows = len(order)
    out = torch.empty(q.numel, dtype=torch.float32)
    part = out.view(rows, -1)
    cb, ng = q.codes.numel() // rows, q.scales.numel() // rows
    for slot, partition in enumerate(order):
        piece = R.QuantizedTensor(q.codes[slot * cb:(slot + 1) * cb],
                                  q.scales[slot * ng:(slot + 1) * ng], q.bits, q.group_size,
                                  q.numel // rows)
        K.dequantize(piece, hadamard=hadamard, hadamard_block=hadamard_block, out=part[partition])
    return out if h is None else torch.sub(h, out, out=out)


def _backend(monkeypatch, backend: str) -> None:
    monkeypatch.setenv("QUANT_KERNELS", backend)
    if backend == "cpp" and not K.cpu_kernels_available():
        pytest.skip("C++ kernels not built here")
    if backend == "triton":
        pytest.importorskip("triton")


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_dequantize_partitions_is_slot_by_slot_bit_for_bit(monkeypatch, backend: str) -> None:
    """One call over the slot table (LoCo's first hop) == dequantizing slot by slot into the
    input layout, then ``h - sent``: every bit, in every backend (Triton in the interpreter),
    for every bit width, with and without the inverse Hadamard, power-of-two and other group
    sizes, into a new buffer, into ``out`` and in place into ``h``; and equal to the reference."""
    _backend(monkeypatch, backend)
    p = 8
    order = [(j % 2) * 4 + j // 2 for j in range(p)]      # swizzle_order(4, 2): not the identity
    bits_i = lambda t: t.view(torch.int32)
    for bits in (2, 4, 8):
        for gs, had, hb in ((128, False, 32), (128, True, 32), (96, False, 32), (64, True, 64)):
            x = torch.randn(p * gs * 5, generator=_gen(bits + gs)) * 3
            x[gs:2 * gs] = 0.0                              # a zero group: scale 0
            for sr in (False, True):
                q = K.quantize_partitions(x, p, order, bits, gs, stochastic=sr,
                                          generator=_gen(7), hadamard=had, hadamard_block=hb)
                want = _slot_by_slot(q, order, had, hb)
                got = K.dequantize_partitions(q, p, order, hadamard=had, hadamard_block=hb)
                assert torch.equal(bits_i(got), bits_i(want)), (bits, gs, had, sr)
                ref = R.dequantize_partitions(q, p, order, hadamard=had, hadamard_block=hb)
                assert torch.equal(bits_i(got), bits_i(ref)), (bits, gs, had, sr, "reference")
                h = x + 0.25
                want = _slot_by_slot(q, order, had, hb, h)
                out = torch.full_like(h, float("nan"))
                got = K.dequantize_partitions(q, p, order, hadamard=had, hadamard_block=hb,
                                              subtract_from=h, out=out)
                assert got is out and torch.equal(bits_i(out), bits_i(want))
                got = K.dequantize_partitions(q, p, order, hadamard=had, hadamard_block=hb,
                                              subtract_from=h, out=h)   # in place: no buffer
                assert got is h and torch.equal(bits_i(h), bits_i(want)), (bits, gs, had, sr)
    # the identity order (one-level layouts) and a single partition
    q = K.quantize(x, 4, 64, stochastic=False)
    for parts in (1, 5):
        got = K.dequantize_partitions(q, parts, list(range(parts)))
        assert torch.equal(bits_i(got), bits_i(K.dequantize(q)))


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_dequantize_partitions_errors(monkeypatch, backend: str) -> None:
    _backend(monkeypatch, backend)
    q = K.quantize(_gauss(1024), 4, 128, stochastic=False)
    with pytest.raises(ValueError, match="permutation"):
        K.dequantize_partitions(q, 4, [0, 1, 2, 2])
    with pytest.raises(ValueError, match="not divisible"):
        K.dequantize_partitions(q, 3, [0, 1, 2])
    with pytest.raises(ValueError, match="subtract_from must be fp32"):
        K.dequantize_partitions(q, 4, [0, 1, 2, 3], subtract_from=torch.zeros(1024).bfloat16())
    with pytest.raises(ValueError, match="out must be fp32"):
        K.dequantize_partitions(q, 4, [0, 1, 2, 3], out=torch.zeros(512))
    h = torch.zeros(2048)
    with pytest.raises(ValueError, match="overlaps"):
        K.dequantize_partitions(q, 4, [0, 1, 2, 3], subtract_from=h[:1024], out=h[512:1536])


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_final_hop_over_more_than_eight_slots_is_the_reference(monkeypatch, backend: str) -> None:
    """The final hop at 16 nodes (16 x 8 GPUs): the Triton kernel sums more than 8 slots as a
    loop over chunks of 8 and then the rest (11 = 8 + 3), in slot order: bit-identical to the
    reference's sum in order, with and without the inverse Hadamard, at every bit width."""
    _backend(monkeypatch, backend)
    n = 768
    for sources in (16, 11):
        for bits in (2, 4, 8):
            for gs, had in ((128, False), (128, True), (96, False)):
                x = torch.randn(sources * n, generator=_gen(sources + bits)) * 2
                q = R.quantize(x, bits, gs, stochastic=False, hadamard=had)
                want = R.dequantize_sum(q, sources, hadamard=had)
                got = K.dequantize_sum(q, sources, hadamard=had)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (
                    sources, bits, gs, had)


def test_dequantize_sum_requantize_matches_composition() -> None:
    s, n = 4, 1024
    x = _gauss(s * n)
    q = K.quantize(x, 8, 128, stochastic=False)
    for gso in (None, 64, 256):
        r = K.dequantize_sum_requantize(q, s, 4, group_size_out=gso, stochastic=False)
        d = K.dequantize(q).view(s, n)
        acc = torch.zeros(n)
        for i in range(s):
            acc = acc + d[i]
        ref = K.quantize(acc, 4, gso or 128, stochastic=False)
        assert torch.equal(r.codes, ref.codes) and torch.equal(r.scales, ref.scales)
        assert r.numel == n and r.bits == 4 and r.group_size == (gso or 128)


@pytest.mark.parametrize("hadamard", [False, True])
def test_dequantize_sum_matches_composition(hadamard: bool) -> None:
    s, n = 3, 512
    x = _gauss(s * n)
    q = K.quantize(x, 4, 128, stochastic=False, hadamard=hadamard)
    d = K.dequantize(q).view(s, n)          # no inverse transform per chunk: sum first
    acc = torch.zeros(n)
    for i in range(s):
        acc = acc + d[i]
    if hadamard:
        acc = K.inverse_hadamard_transform(acc)
    expect = acc * 0.5
    got = K.dequantize_sum(q, s, hadamard=hadamard, scale=0.5)
    assert torch.equal(got, expect)
    # strided bf16 destination
    buf = torch.zeros(2 * n, dtype=torch.bfloat16)
    view = buf[::2]
    K.dequantize_sum(q, s, hadamard=hadamard, scale=0.5, out=view)
    assert torch.equal(view, expect.bfloat16()) and torch.equal(buf[1::2], torch.zeros(n, dtype=torch.bfloat16))
    # the sum approximates the exact sum of the inputs
    exact = x.view(s, n).sum(0) * 0.5
    assert _rel(got, exact) < 0.2


def test_two_hop_pipeline_error() -> None:
    # 8-bit intra hop -> sum -> 4-bit inter hop -> sum, as in SDP4Bit TLq-HS (§3.3)
    d, m, n = 4, 2, 1024
    grads = _gauss(d * m * n).view(d * m, n)
    exact = grads.sum(0)
    per_node = []
    for node in range(m):
        qs = [K.quantize(grads[node * d + l], 8, 128, stochastic=False) for l in range(d)]
        q = K.QuantizedTensor(torch.cat([a.codes for a in qs]), torch.cat([a.scales for a in qs]),
                              8, 128, d * n)
        per_node.append(K.dequantize_sum_requantize(q, d, 4, stochastic=False))
    q2 = K.QuantizedTensor(torch.cat([a.codes for a in per_node]),
                           torch.cat([a.scales for a in per_node]), 4, 128, m * n)
    err = _rel(K.dequantize_sum(q2, m), exact)
    assert err < 0.13, err   # dominated by the 4-bit hop (~0.08 relative to the sum)


def test_quantize_difference_bf16_semantics() -> None:
    g = _gen(11)
    ref = torch.randn(1024, generator=g).bfloat16()
    new = ref.float() + 1e-2 * torch.randn(1024, generator=g)
    q = K.quantize_difference(new, ref, 4, 128, stochastic=False)
    d = new.bfloat16() - ref            # bf16 subtraction with RN
    expect = K.quantize(d, 4, 128, stochastic=False)
    assert torch.equal(q.codes, expect.codes) and torch.equal(q.scales, expect.scales)
    # the difference really is rounded to bf16 (differs from the fp32 difference)
    d32 = K.quantize(new - ref.float(), 4, 128, stochastic=False)
    assert not torch.equal(d32.scales, q.scales)


def test_dequantize_add_bf16_semantics_and_alias() -> None:
    g = _gen(12)
    ref = torch.randn(1024, generator=g).bfloat16()
    delta = 1e-2 * torch.randn(1024, generator=g)
    q = K.quantize(delta, 4, 128, stochastic=False)
    expect = K.dequantize(q).bfloat16() + ref
    got = K.dequantize_add(q, ref)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expect)
    alias = ref.clone()
    out = K.dequantize_add(q, alias, out=alias)
    assert out is alias and torch.equal(alias, expect)


def test_qwd_error_does_not_accumulate() -> None:
    # W~_t = W~_{t-1} + Q(bf16(W_t) - W~_{t-1}): the error stays at one quantization step
    g = _gen(13)
    w = torch.randn(4096, generator=g)
    rec = w.bfloat16()
    for _ in range(20):
        w = w + 1e-3 * torch.randn(4096, generator=g)
        q = K.quantize_difference(w, rec, 4, 512, generator=g)
        rec = K.dequantize_add(q, rec, out=rec)
    assert (rec.float() - w).abs().max() < 2e-2


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------
def test_errors() -> None:
    x = _gauss(1024)
    with pytest.raises(ValueError, match="bits"):
        K.quantize(x, 3, 128)
    with pytest.raises(ValueError, match="divisible"):
        K.quantize(x, 4, 100)
    with pytest.raises(ValueError, match="power of two"):
        K.quantize(x, 4, 128, hadamard=True, hadamard_block=24)
    with pytest.raises(ValueError, match="multiple of hadamard_block"):
        K.quantize(x, 4, 64, hadamard=True, hadamard_block=128)
    with pytest.raises(ValueError, match="num_partitions"):
        K.quantize_partitions(x, 3, [0, 1, 2], 4, 128)
    with pytest.raises(ValueError, match="permutation"):
        K.quantize_partitions(x, 2, [0, 0], 4, 128)
    with pytest.raises(ValueError, match="num_sources"):
        K.dequantize_sum(K.quantize(x, 4, 128), 3)
    with pytest.raises(ValueError, match="bits"):
        K.dequantize_sum_requantize(K.quantize(x, 8, 128), 2, 5)
    with pytest.raises(ValueError, match="power of two"):
        K.hadamard_transform(x, 12)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_raises(bad: float) -> None:
    x = _gauss(1024)
    x[[3, 700]] = bad
    with pytest.raises(K.NonFiniteError, match="2 non-finite"):
        K.quantize(x, 4, 128)
    with pytest.raises(K.NonFiniteError):
        K.quantize_partitions(x, 2, [1, 0], 8, 128)
    ref = torch.zeros(1024, dtype=torch.bfloat16)
    with pytest.raises(K.NonFiniteError):
        K.quantize_difference(x, ref, 4, 128)
    assert issubclass(K.NonFiniteError, ValueError)


def test_backend_dispatch(monkeypatch) -> None:
    x = _gauss(256)
    assert K.backend_for(x) == "torch"
    monkeypatch.setenv("QUANT_KERNELS", "auto")
    # CPU tensor -> the C++ kernels when they build here, else the reference
    assert K.backend_for(x) == ("cpp" if K.cpu_kernels_available() else "torch")
    monkeypatch.setenv("QUANT_KERNELS", "bogus")
    with pytest.raises(ValueError, match="QUANT_KERNELS"):
        K.backend_for(x)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_pipeline_chunks_round_like_the_whole_call(backend: str, monkeypatch) -> None:
    """--gradient-alltoall-pipeline: chunks of the middle requantization, each called with the
    generator state of the whole call and its NoiseIndex, give the whole call's codes and scales
    (stochastic rounding included) and leave the generator where the whole call leaves it."""
    monkeypatch.setenv("QUANT_KERNELS", backend)
    m, s, d, gs = 2, 512, 2, 128
    x = torch.randn(d * m * s, generator=torch.Generator().manual_seed(3))
    q = K.quantize(x, 8, 128, stochastic=False)
    g = torch.Generator().manual_seed(5)
    whole = K.dequantize_sum_requantize(q, d, 4, group_size_out=gs, generator=g)
    after_whole = g.get_state()
    for edges in ([0, 256, 512], [0, 128, 384, 512]):
        g = torch.Generator().manual_seed(5)
        start = g.get_state()
        for a, b in zip(edges[:-1], edges[1:]):
            codes = q.codes.view(d, m, s)[:, :, a:b].reshape(-1)
            scales = q.scales.view(d, m, s // 128)[:, :, a // 128:b // 128].reshape(-1)
            chunk = K.QuantizedTensor(codes, scales, 8, 128, d * m * (b - a))
            g.set_state(start)
            r = K.dequantize_sum_requantize(chunk, d, 4, group_size_out=gs, generator=g,
                                            noise_index=K.NoiseIndex(b - a, s, a, m * s))
            assert torch.equal(r.codes.view(m, -1), whole.codes.view(m, -1)[:, a // 2:b // 2])
            assert torch.equal(r.scales.view(m, -1), whole.scales.view(m, -1)[:, a // gs:b // gs])
        assert torch.equal(g.get_state(), after_whole)
    # without the map a chunk draws other noise: the map is what makes them agree
    g = torch.Generator().manual_seed(5)
    codes = q.codes.view(d, m, s)[:, :, 256:512].reshape(-1)
    scales = q.scales.view(d, m, s // 128)[:, :, 2:4].reshape(-1)
    plain = K.dequantize_sum_requantize(K.QuantizedTensor(codes, scales, 8, 128, d * m * 256), d,
                                        4, group_size_out=gs, generator=g)
    assert not torch.equal(plain.codes.view(m, -1), whole.codes.view(m, -1)[:, 128:256])


def test_noise_index_must_fit() -> None:
    q = K.quantize(torch.randn(2 * 256), 8, 128, stochastic=False)
    with pytest.raises(ValueError, match="noise index"):
        K.dequantize_sum_requantize(q, 2, 4, group_size_out=128,
                                    noise_index=K.NoiseIndex(100, 512, 0, 1024))
