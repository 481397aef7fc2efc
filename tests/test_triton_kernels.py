"""Triton kernels vs the torch reference.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before
triton is imported) on small tensors; with a GPU they run compiled on CUDA tensors.  Round-to-
nearest results must be bit-identical to the reference; stochastic rounding must match it in
distribution (the RNGs differ: Philox in Triton, torch.rand in the reference).
"""

from __future__ import annotations

import importlib
import math
import os
import random
import struct
from fractions import Fraction

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"   # must precede the first @triton.jit decoration

pytest.importorskip("triton")

from megatron.distributed.quant.kernels import dispatch as K  # noqa: E402
from megatron.distributed.quant.kernels import reference as R  # noqa: E402

try:
    from megatron.distributed.quant.kernels import triton_device as J  # noqa: E402
    from megatron.distributed.quant.kernels import triton_launch as T  # noqa: E402
except Exception as exc:  # pragma: no cover - broken triton install
    pytest.skip(f"triton kernels cannot be imported: {exc!r}", allow_module_level=True)

if not _CUDA:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(J._quantize_kernel, InterpretedFunction):
        # another test module imported the kernels before TRITON_INTERPRET was set: rebuild them
        # (the jit functions first, then the launchers that import them)
        J = importlib.reload(J)
        T = importlib.reload(T)
        K._TRITON_MOD = T

DEV = "cuda" if _CUDA else "cpu"

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy 1/0 in masked lanes


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.setenv("QUANT_KERNELS", "triton")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _randn(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=_gen(seed), device=DEV).to(dtype)


def _same(a: K.QuantizedTensor, b: K.QuantizedTensor) -> bool:
    return (torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
            and (a.bits, a.group_size, a.numel) == (b.bits, b.group_size, b.numel))


def test_dispatch_uses_triton() -> None:
    assert K.backend_for(_randn(8)) == "triton"


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_rn_bit_exact(bits: int) -> None:
    x = _randn(3 * 1024, seed=bits)
    x[128:256] = 0.0                                           # zero group
    x[300] = 40.0                                              # outlier
    for gs, had in ((128, False), (128, True), (96, False), (96, True), (64, False)):
        for dt in (torch.float32, torch.bfloat16):
            xi = x.to(dt)
            a = K.quantize(xi, bits, gs, stochastic=False, hadamard=had)
            b = R.quantize(xi, bits, gs, stochastic=False, hadamard=had)
            assert _same(a, b), (bits, gs, had, dt)
            assert torch.equal(K.dequantize(a, hadamard=had), R.dequantize(b, hadamard=had))
    for dt in (torch.bfloat16, torch.float16):
        assert torch.equal(K.dequantize(a, out_dtype=dt), R.dequantize(b, out_dtype=dt))


@pytest.mark.parametrize("part_len", [256, 384, 5120])
@pytest.mark.parametrize("hadamard", [False, True])
def test_quantize_partitions_bit_exact(hadamard: bool, part_len: int) -> None:
    """Parts of 2, 3 and 40 groups: a program of 32 group rows spans many parts, parts of an odd
    group count, and a part boundary inside a program (the kernel's multiply-shift division)."""
    x = _randn(8 * part_len, seed=1)
    order = [0, 4, 1, 5, 2, 6, 3, 7]
    a = K.quantize_partitions(x, 8, order, 4, 128, stochastic=False, hadamard=hadamard)
    b = R.quantize_partitions(x, 8, order, 4, 128, stochastic=False, hadamard=hadamard)
    assert _same(a, b)
    # stochastic: random stream follows input order, so it equals quantize + permutation
    c = K.quantize_partitions(x, 8, order, 8, 128, generator=_gen(3), hadamard=hadamard)
    d = K.quantize(x, 8, 128, generator=_gen(3), hadamard=hadamard)
    assert torch.equal(c.codes, d.codes.view(8, -1)[order].reshape(-1))
    assert torch.equal(c.scales, d.scales.view(8, -1)[order].reshape(-1))


def test_partition_division_is_exact_below_its_limit() -> None:
    """division_magic's (m, p): n // d == (n * m) >> p with m < 2^31 for every n < 2^30, at the
    edges of each quotient and over random n, for small, power-of-two, odd and huge divisors."""
    rng = random.Random(5)
    limit = T.PERMUTE_MAX_GROUPS
    divisors = (list(range(1, 260)) + [2 ** k + j for k in range(9, 30) for j in (-1, 0, 1)]
                + [rng.randrange(1, limit) for _ in range(200)])
    for d in divisors:
        m, p = T.division_magic(d)
        assert 0 < m < 2 ** 31
        ns = {0, limit - 1, d - 1, d, (limit - 1) // d * d, (limit - 1) // d * d - 1}
        ns |= {rng.randrange(limit) for _ in range(50)}
        for n in ns:
            if 0 <= n < limit:
                assert (n * m) >> p == n // d, (n, d)
    with pytest.raises(ValueError, match="divisor"):
        T.division_magic(0)


def test_permuting_quantize_refuses_more_groups_than_its_division_covers(monkeypatch) -> None:
    monkeypatch.setattr(T, "PERMUTE_MAX_GROUPS", 8)
    with pytest.raises(ValueError, match="quantize_partitions: .* 16 groups; a permuting quantize"):
        T.quantize_partitions(_randn(2 * 1024, seed=1), 2, [1, 0], 4, 128)
    # dequantize_partitions takes its per-element path (an int64 division) instead: same values
    q = R.quantize(_randn(2 * 1024, seed=1), 4, 128, stochastic=False)
    sub = _randn(2 * 1024, seed=2)
    for had in (False, True):
        assert torch.equal(T.dequantize_partitions(q, 2, [1, 0], hadamard=had, subtract_from=sub),
                           R.dequantize_partitions(q, 2, [1, 0], hadamard=had,
                                                   subtract_from=sub))


def test_dequantize_sum_requantize_bit_exact() -> None:
    x = _randn(4 * 512, seed=2)
    x[:128] = 0.0
    for bits_in, bits_out in ((8, 4), (4, 2), (8, 8), (2, 4)):
        q = R.quantize(x, bits_in, 128, stochastic=False)
        for gso in (None, 64, 256):
            a = K.dequantize_sum_requantize(q, 4, bits_out, group_size_out=gso, stochastic=False)
            b = R.dequantize_sum_requantize(q, 4, bits_out, group_size_out=gso, stochastic=False)
            assert _same(a, b), (bits_in, bits_out, gso)


@pytest.mark.parametrize("sources", [2, 8])
def test_dequantize_sum_requantize_slots_and_default_group_sizes_bit_exact(sources: int) -> None:
    """The middle hop at the shapes users run: S = 8 GPUs per node (and 2), intra groups of 512
    (--gq-group-size-intra's default) requantized to inter groups of 128, every bit width: each
    output row lies in one input group (the row path: one scale per row), summed in slot order
    like the reference. Slot s's scales differ per group so a wrong scale index shows."""
    n = 2048
    x = _randn(sources * n, seed=5) * torch.linspace(0.5, 4.0, sources * n, device=DEV)
    for bits_in in (2, 4, 8):
        q = R.quantize(x, bits_in, 512, stochastic=False)
        for bits_out in (2, 4, 8):
            a = K.dequantize_sum_requantize(q, sources, bits_out, group_size_out=128,
                                            stochastic=False)
            b = R.dequantize_sum_requantize(q, sources, bits_out, group_size_out=128,
                                            stochastic=False)
            assert _same(a, b), (bits_in, bits_out)
    c = K.dequantize_sum(R.quantize(x, 4, 128, stochastic=False), sources)
    assert torch.equal(c, R.dequantize_sum(R.quantize(x, 4, 128, stochastic=False), sources))


@pytest.mark.parametrize("hadamard", [False, True])
def test_dequantize_sum_bit_exact(hadamard: bool) -> None:
    s, n = 4, 512
    q = R.quantize(_randn(s * n, seed=4), 4, 128, stochastic=False, hadamard=hadamard)
    assert torch.equal(K.dequantize_sum(q, s, hadamard=hadamard),
                       R.dequantize_sum(q, s, hadamard=hadamard))
    for dt in (torch.float32, torch.bfloat16):
        buf_a = torch.full((2 * n,), 7.0, dtype=dt, device=DEV)
        buf_b = buf_a.clone()
        K.dequantize_sum(q, s, hadamard=hadamard, out=buf_a[1::2], scale=0.125)
        R.dequantize_sum(q, s, hadamard=hadamard, out=buf_b[1::2], scale=0.125)
        assert torch.equal(buf_a, buf_b)
        assert torch.equal(buf_a[::2], torch.full((n,), 7.0, dtype=dt, device=DEV))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float32])
def test_weight_diff_ops_bit_exact(dt: torch.dtype, bits: int) -> None:
    """qWD send and receive against the reference; the receive loads group rows for 2-byte
    weights and elements for fp32 ones (triton_launch._dequant_add_rows)."""
    ref = _randn(2048, seed=5).to(dt)
    new = ref.float() + 1e-2 * _randn(2048, seed=6)
    a = K.quantize_difference(new, ref, bits, 512, stochastic=False)
    b = R.quantize_difference(new, ref, bits, 512, stochastic=False)
    assert _same(a, b)
    expect = R.dequantize_add(b, ref)
    assert torch.equal(K.dequantize_add(a, ref), expect)
    alias = ref.clone()
    out = K.dequantize_add(a, alias, out=alias)
    assert out is alias and torch.equal(alias, expect)
    # out overlapping the reference one element further on (over more than one program's
    # tile, so one program's writes land where the next still reads): through a temporary
    big_ref = _randn(3 * 4096, seed=7).to(dt)
    big = K.quantize_difference(big_ref.float() + 1e-2, big_ref, bits, 512, stochastic=False)
    buf = torch.cat([big_ref, big_ref[:1]])
    shifted = K.dequantize_add(big, buf[:-1], out=buf[1:])
    assert shifted.data_ptr() == buf[1:].data_ptr()
    assert torch.equal(buf[1:], R.dequantize_add(big, big_ref))


def test_strided_codes_and_wide_scales_are_read_as_the_reference_reads_them() -> None:
    """``QuantizedTensor.validate`` checks dtypes and sizes, not layout: codes that are a strided
    view and fp64 scales decoded garbage / other values in the Triton kernels (the kernels read
    raw buffers), where the torch and C++ backends make them contiguous fp32."""
    q = R.quantize(_randn(4096, seed=8), 4, 128, stochastic=False)
    strided = torch.stack([q.codes, torch.zeros_like(q.codes)], 1)[:, 0]
    assert not strided.is_contiguous()
    odd = K.QuantizedTensor(strided, q.scales.double(), 4, 128, 4096)
    want = R.dequantize(q)
    assert torch.equal(K.dequantize(odd), want)
    assert torch.equal(K.dequantize_sum(odd, 2), R.dequantize_sum(q, 2))
    assert _same(K.dequantize_sum_requantize(odd, 2, 8, stochastic=False),
                 R.dequantize_sum_requantize(q, 2, 8, stochastic=False))
    ref = _randn(4096, seed=9).to(torch.bfloat16)
    assert torch.equal(K.dequantize_add(odd, ref), R.dequantize_add(q, ref))


@pytest.mark.parametrize("bits", [2, 4])
def test_codes_at_an_odd_byte_offset_decode_as_the_reference_decodes_them(bits: int) -> None:
    """The dequantizing kernels read 2- and 4-bit rows as int32 words (``_word_rows``): a
    contiguous codes view that starts off a 4-byte boundary is read from an aligned copy
    (``triton_launch._operands``); both give the reference's values."""
    q = R.quantize(_randn(4 * 1024, seed=10), bits, 128, stochastic=False)
    buf = torch.zeros(q.codes.numel() + 1, dtype=torch.uint8, device=DEV)
    buf[1:] = q.codes
    shifted = K.QuantizedTensor(buf[1:], q.scales, bits, 128, q.numel)
    assert shifted.codes.is_contiguous() and shifted.codes.data_ptr() % 4 != 0
    codes, _ = T._operands(shifted)
    assert codes.data_ptr() % 4 == 0 and torch.equal(codes, q.codes)
    assert torch.equal(K.dequantize_sum(shifted, 4), R.dequantize_sum(q, 4))
    assert _same(K.dequantize_sum_requantize(shifted, 4, 4, stochastic=False),
                 R.dequantize_sum_requantize(q, 4, 4, stochastic=False))
    assert torch.equal(K.dequantize_partitions(shifted, 4, [2, 0, 3, 1]),
                       R.dequantize_partitions(q, 4, [2, 0, 3, 1]))
    ref = _randn(4 * 1024, seed=11).to(torch.bfloat16)
    assert torch.equal(K.dequantize_add(shifted, ref), R.dequantize_add(q, ref))
    aligned = K.QuantizedTensor(q.codes, q.scales, bits, 128, q.numel)
    assert T._operands(aligned)[0].data_ptr() == q.codes.data_ptr()     # no copy


def test_stochastic_rounding_probability() -> None:
    # every group: one element at amax (v = 7 exactly) and the others at v = 2.3 or -4.7 (frac 0.3
    # above the floor), so each
    # rounds up with probability 0.3; the up-fraction must be binomial(n, 0.3) within 5 sigma
    n_groups, gs = 32, 128
    v = torch.full((n_groups, gs), 2.3)
    v[:, 0] = 7.0
    v[:, 1::2] = -4.7
    x = (v / 7.0).reshape(-1).to(DEV)
    q = K.quantize(x, 4, gs, generator=_gen(7))
    assert torch.equal(q.scales, R.quantize(x, 4, gs, stochastic=False).scales)
    c = K.unpack(q.codes, 4, q.numel).view(n_groups, gs).float().cpu()
    up = torch.cat([(c[:, 2::2] == 3).flatten(), (c[:, 1::2] == -4).flatten()]).float()
    down = torch.cat([(c[:, 2::2] == 2).flatten(), (c[:, 1::2] == -5).flatten()]).float()
    assert torch.equal(up + down, torch.ones_like(up))       # only floor/ceil are produced
    m = up.numel()
    assert abs(up.mean().item() - 0.3) < 5 * math.sqrt(0.3 * 0.7 / m)


def test_stochastic_rounding_unbiased_and_matches_reference_error() -> None:
    x = _randn(512, seed=8)
    g = _gen(9)
    draws = 40
    acc = torch.zeros_like(x)
    sq_t = 0.0
    for _ in range(draws):
        y = K.dequantize(K.quantize(x, 4, 128, generator=g))
        acc += y
        sq_t += float(((y - x) ** 2).sum())
    step = (x.view(-1, 128).abs().amax(1) / 7.0).repeat_interleave(128)
    z = ((acc / draws - x).abs() / (step / (2 * math.sqrt(draws))))
    assert z.max() < 5.0, float(z.max())
    # mean squared error equals the reference's (same distribution): within 10 % (~9 standard
    # errors for 40 x 512 samples)
    gr = _gen(10)
    sq_r = sum(float(((R.dequantize(R.quantize(x, 4, 128, generator=gr)) - x) ** 2).sum())
               for _ in range(draws))
    assert abs(sq_t / sq_r - 1.0) < 0.1, (sq_t, sq_r)


def test_stochastic_requantize_unbiased() -> None:
    q = R.quantize(_randn(2 * 256, seed=11), 8, 128, stochastic=False)
    exact = R.dequantize_sum(q, 2)
    g = _gen(12)
    draws = 40
    acc = torch.zeros_like(exact)
    for _ in range(draws):
        acc += R.dequantize(K.dequantize_sum_requantize(q, 2, 4, generator=g))
    step = (exact.view(-1, 128).abs().amax(1) / 7.0).repeat_interleave(128)
    assert ((acc / draws - exact).abs() / (step / (2 * math.sqrt(draws)))).max() < 5.0


def test_seeded_generator_reproducible() -> None:
    x = _randn(1024, seed=13)
    a = K.quantize(x, 4, 128, generator=_gen(14))
    b = K.quantize(x, 4, 128, generator=_gen(14))
    c = K.quantize(x, 4, 128, generator=_gen(15))
    assert _same(a, b) and not torch.equal(a.codes, c.codes)


def test_nonfinite_and_zero_groups() -> None:
    x = _randn(512, seed=16)
    x[[1, 300, 301]] = torch.tensor([float("nan"), float("inf"), -float("inf")], device=DEV)
    # the kernel counts groups (their absmax is NaN/Inf): 1 in group 0, 300 and 301 in group 2
    with pytest.raises(K.NonFiniteError, match=r"non-finite \(NaN/Inf\) values in 2 of its 4 "
                                               r"groups of 128"):
        K.quantize(x, 4, 128)
    with pytest.raises(K.NonFiniteError, match="in 2 of its 4 groups"):
        K.quantize_partitions(x, 2, [1, 0], 4, 128, hadamard=True)
    q = K.quantize(x, 4, 128, check_finite=False)
    y = K.dequantize(q)
    assert torch.isnan(y[:128]).all() and torch.isnan(y[256:384]).all()
    assert torch.isfinite(y[128:256]).all() and torch.isfinite(y[384:]).all()
    z = torch.zeros(256, device=DEV)
    qz = K.quantize(z, 4, 128)
    assert torch.equal(qz.scales, torch.zeros(2, device=DEV))
    assert torch.equal(K.dequantize(qz), z)


def test_errors_match_reference() -> None:
    x = _randn(1024)
    with pytest.raises(ValueError, match="bits"):
        K.quantize(x, 3, 128)
    with pytest.raises(ValueError, match="divisible"):
        K.quantize(x, 4, 100)
    with pytest.raises(ValueError, match="power of two"):
        K.quantize(x, 4, 128, hadamard=True, hadamard_block=24)
    with pytest.raises(ValueError, match="num_sources"):
        K.dequantize_sum(R.quantize(x, 4, 128), 3)


def test_pipeline_chunks_round_like_the_whole_call() -> None:
    """The Triton middle-hop kernel honours NoiseIndex: pipeline chunks (--gradient-alltoall-
    pipeline), each from the whole call's generator state, give the whole call's stochastic codes."""
    m, s, d, gs = 2, 256, 2, 64
    x = torch.randn(d * m * s, generator=torch.Generator().manual_seed(3)).to(DEV)
    q = T.quantize(x, 8, 64, stochastic=False)
    whole = T.dequantize_sum_requantize(q, d, 4, group_size_out=gs,
                                        generator=torch.Generator().manual_seed(5))
    for a, b in ((0, 128), (128, 256)):
        codes = q.codes.view(d, m, s)[:, :, a:b].reshape(-1)
        scales = q.scales.view(d, m, s // 64)[:, :, a // 64:b // 64].reshape(-1)
        chunk = K.QuantizedTensor(codes, scales, 8, 64, d * m * (b - a))
        r = T.dequantize_sum_requantize(chunk, d, 4, group_size_out=gs,
                                        generator=torch.Generator().manual_seed(5),
                                        noise_index=K.NoiseIndex(b - a, s, a, m * s))
        assert torch.equal(r.codes.view(m, -1), whole.codes.view(m, -1)[:, a // 2:b // 2])
        assert torch.equal(r.scales.view(m, -1), whole.scales.view(m, -1)[:, a // gs:b // gs])


# -- issue 24 item 1: the non-finite count goes to a device counter, nothing is read back ---------

def test_fused_nonfinite_counter_counts_without_reading_back(monkeypatch) -> None:
    """With ``nonfinite_counter`` the kernel adds its fused count of groups holding a NaN/Inf into
    the caller's int32 device tensor and no ``.item()`` runs (it was one host sync per quantize
    call); the codes are those of the unchecked call; several calls accumulate."""
    x = _randn(4 * 256, seed=3)
    x[[5, 300, 301]] = float("nan")
    x[700] = float("inf")
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    reads = []
    with monkeypatch.context() as patched:
        patched.setattr(torch.Tensor, "item", lambda t: reads.append(t) or 0)
        q = K.quantize(x, 4, 128, stochastic=False, nonfinite_counter=counter)
        p = K.quantize_partitions(x, 4, [2, 0, 3, 1], 8, 256, stochastic=False,
                                  nonfinite_counter=counter)
        d = K.quantize_difference(x, torch.zeros_like(x), 4, 128, stochastic=False,
                                  nonfinite_counter=counter)
    assert reads == []
    # groups of 128: 5 in group 0, 300 and 301 in group 2, 700 in group 5 (3 per call, twice);
    # groups of 256: groups 0, 1 and 2
    assert counter.tolist() == [9]
    same = lambda a, b: (torch.equal(a.codes, b.codes)  # noqa: E731 (NaN scales compare equal)
                         and torch.equal(a.scales.nan_to_num(-1.0), b.scales.nan_to_num(-1.0)))
    assert same(q, K.quantize(x, 4, 128, stochastic=False, check_finite=False))
    assert same(p, K.quantize_partitions(x, 4, [2, 0, 3, 1], 8, 256, stochastic=False,
                                          check_finite=False))
    assert same(d, K.quantize_difference(x, torch.zeros_like(x), 4, 128, stochastic=False,
                                          check_finite=False))
    with pytest.raises(ValueError, match="int32"):
        K.quantize(x, 4, 128, nonfinite_counter=torch.zeros(1, device=DEV))


def test_partition_slot_table_is_built_once_per_order_and_device() -> None:
    """It was ``torch.tensor(slot_of, device=...)`` per call: a host-to-device copy (a sync)
    per bucket in the backward hooks; the table is now cached (megatron/distributed/quant/
    device_tables.py), shared with LoCo's un-permutation."""
    from megatron.distributed.quant.device_tables import slot_of

    a = slot_of((1, 0, 3, 2), torch.device(DEV))
    assert a is slot_of([1, 0, 3, 2], DEV)
    assert a.dtype == torch.int32 and a.tolist() == [1, 0, 3, 2]
    assert slot_of((2, 0, 3, 1), DEV).tolist() == [1, 3, 0, 2]    # t[order[s]] = s
    assert slot_of((0, 1, 2, 3), DEV) is not a


@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device: set_sync_debug_mode is CUDA's")
def test_per_bucket_kernel_calls_never_synchronise_the_host() -> None:
    """Issue 24 item 1, on a GPU: the calls a bucket makes (TLq hop 1 with the partition order,
    the middle hop, the final hop, qWD's send and receive), stochastic with the trainer's host
    generator and a device non-finite counter, run under ``set_sync_debug_mode("error")``: any
    ``.item()``, blocking copy or host-built device tensor raises.  One warm-up call first (the
    Triton compile and the cached slot table are once per process, not per bucket)."""
    x = _randn(8 * 4096, seed=11)
    ref = _randn(8 * 4096, seed=12).to(torch.bfloat16)
    order = [0, 4, 1, 5, 2, 6, 3, 7]
    out = torch.zeros(4096, device=DEV)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    gen = torch.Generator(device="cpu").manual_seed(5)

    def bucket() -> None:
        p = K.quantize_partitions(x, 8, order, 8, 128, generator=gen, hadamard=True,
                                  nonfinite_counter=counter)
        m = K.dequantize_sum_requantize(p, 2, 4, generator=gen)
        K.dequantize_sum(m, 4, hadamard=True, out=out)
        d = K.quantize_difference(x, ref, 4, 2048, generator=gen, nonfinite_counter=counter)
        K.dequantize_add(d, ref)

    bucket()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        bucket()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert counter.item() == 0


# -- issue 24 item 2: stochastic-rounding noise from all four Philox outputs ---------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _noise_probe_kernel(base_ptr, out_ptr, seed, R: tl.constexpr, GP: tl.constexpr,
                        ALIGNED: tl.constexpr):
    """Writes the kernels' own noise u = k * 2^-16 (_noise_tile's 16 bits k) for R rows of GP
    elements per program."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    base = tl.load(base_ptr + rows)
    u = J._noise_tile(seed, base, R, GP, ALIGNED, 16, 0).to(tl.float32) * (1.0 / 65536)
    tl.store(out_ptr + rows[:, None] * GP + tl.arange(0, GP)[None, :], u)


def _noise(row_bases, gp: int, seed: int, aligned: bool, rows: int = 8) -> torch.Tensor:
    """u [len(row_bases), gp]: row r holds the noise of stream elements row_bases[r] + 0..gp-1."""
    base = torch.tensor(row_bases, dtype=torch.int64, device=DEV)
    assert base.numel() % rows == 0
    out = torch.empty(base.numel(), gp, dtype=torch.float32, device=DEV)
    _noise_probe_kernel[(base.numel() // rows,)](base, out, seed, R=rows, GP=gp, ALIGNED=aligned)
    return out.cpu()


def test_noise_is_a_pure_function_of_seed_and_element_index() -> None:
    """Both code paths (aligned rows: one Philox call per 8 elements, interleaved; any row: each
    element's own call and lane) give element i the same u, wherever its row starts: so pipeline
    chunks, permuted layouts and group sizes that are not multiples of 8 keep drawing the noise of
    the whole call."""
    gp = 64
    whole = _noise([r * gp for r in range(16)], gp, seed=77, aligned=True).reshape(-1)
    same = _noise([r * gp for r in range(16)], gp, seed=77, aligned=False).reshape(-1)
    assert torch.equal(whole, same)
    # rows starting anywhere (unaligned path): element i still gets whole[i]
    starts = [3, 1, 130, 517, 64, 0, 902, 45]
    moved = _noise(starts, gp, seed=77, aligned=False)
    for r, s in enumerate(starts):
        assert torch.equal(moved[r], whole[s:s + gp]), s
    # rows in another order, aligned: permuted layouts
    perm = [5, 2, 7, 0, 1, 6, 3, 4]
    assert torch.equal(_noise([p * gp for p in perm], gp, seed=77, aligned=True),
                       whole.view(16, gp)[perm])
    assert not torch.equal(_noise([0] * 8, gp, seed=78, aligned=True)[0], whole[:gp])
    # past 2^31, 2^32 and 2^35 elements (one call of a whole multi-billion-parameter bucket): the
    # int64 index does not wrap (an int32 one repeated base 0 at 2^32), and from 2^35 the
    # Philox counter's high word carries the upper bits; both paths still agree
    far = [2 ** 31, 2 ** 32, 2 ** 35, 2 ** 36, 2 ** 35 + 8, 2 ** 36 + 8, 2 ** 40, 2 ** 40 + 64]
    u_far = _noise(far, gp, seed=77, aligned=True)
    assert torch.equal(u_far, _noise(far, gp, seed=77, aligned=False))
    near = _noise([8 * r for r in range(8)], gp, seed=77, aligned=True)
    for r in range(len(far)):
        assert not torch.equal(u_far[r], near[0]), far[r]
    assert not torch.equal(u_far[2], u_far[3]) and not torch.equal(u_far[2], u_far[6])


def _philox4x32(seed: int, ctr: int, rounds: int) -> tuple:
    """Philox4x32 (Salmon et al., SC'11) in plain Python: counter (ctr's low word, its high word,
    0, 0), key (seed's low word, its high word)."""
    m32 = 0xFFFFFFFF
    c = [ctr & m32, ctr >> 32 & m32, 0, 0]
    k = [seed & m32, seed >> 32 & m32]
    for _ in range(rounds):
        pa, pb = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(pb >> 32) ^ c[1] ^ k[0], pb & m32, (pa >> 32) ^ c[3] ^ k[1], pa & m32]
        k = [(k[0] + 0x9E3779B9) & m32, (k[1] + 0xBB67AE85) & m32]
    return tuple(c)


@triton.jit
def _philox_probe_kernel(ctr_ptr, out_ptr, seed, N: tl.constexpr):
    """Writes triton_device._philox_at's four words and tl.philox's at N counters."""
    i = tl.arange(0, N)
    ctr = tl.load(ctr_ptr + i)
    mine = J._philox_at(seed, ctr)
    theirs = tl.philox(seed, ctr.to(tl.uint32), (ctr >> 32).to(tl.uint32), i.to(tl.uint32) * 0,
                       i.to(tl.uint32) * 0, J.PHILOX_ROUNDS)
    for w in tl.static_range(4):
        tl.store(out_ptr + w * N + i, mine[w].to(tl.int32, bitcast=True))
        tl.store(out_ptr + (4 + w) * N + i, theirs[w].to(tl.int32, bitcast=True))


@pytest.mark.parametrize("seed", [0, 77, 2 ** 31 - 1, 2 ** 40 + 77])
def test_philox_is_the_standard_generator(seed) -> None:
    """_philox_at (each round's products as two wide multiplies: inline PTX on a GPU, uint64
    products under the interpreter) gives Triton's own tl.philox words and those of Philox4x32 in
    plain Python, at counters whose high word is 0, 1 and large, and a seed whose high word (the
    key's second word) is not 0 (the launchers draw seeds below 2^31)."""
    ctrs = [0, 1, 2, 7, 12345, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 32 + 5, 2 ** 35 + 3,
            2 ** 40 + 64, 2 ** 62 + 987654321, 3, 99, 100000, 2 ** 20]
    ctr = torch.tensor(ctrs, dtype=torch.int64, device=DEV)
    out = torch.empty(8, len(ctrs), dtype=torch.int32, device=DEV)
    _philox_probe_kernel[(1,)](ctr, out, seed, N=len(ctrs))
    words = (out.cpu().to(torch.int64) & 0xFFFFFFFF).tolist()
    mine = list(zip(*words[:4]))
    assert mine == list(zip(*words[4:])), "differs from tl.philox"
    assert mine == [_philox4x32(seed, c, int(J.PHILOX_ROUNDS)) for c in ctrs]
    # the plain-Python generator itself: Random123's known answer for 10 rounds at 0, key 0
    assert _philox4x32(0, 0, 10) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)


@triton.jit
def _part_probe_kernel(row_ptr, magic_ptr, shift_ptr, out_ptr, N: tl.constexpr):
    """Writes triton_device._part_of(row, magic, shift) for N (row, magic, shift) triples."""
    i = tl.arange(0, N)
    part = J._part_of(tl.load(row_ptr + i), tl.load(magic_ptr + i), tl.load(shift_ptr + i))
    tl.store(out_ptr + i, part.to(tl.int32))


def test_partition_of_a_row_in_the_kernel_is_the_floor_division() -> None:
    """The kernels' _part_of (the high word of 4 row * m, shifted right by p - 30) gives row // d
    for division_magic(d)'s (m, p), also where p < 32 (d = 1, 2: the plain high word of row * m
    would be a right shift by p - 32 < 0) and at the largest row, 2^30 - 1, whose 4 row needs all
    32 bits."""
    rng = random.Random(6)
    limit = T.PERMUTE_MAX_GROUPS
    rows, magics, shifts, want = [], [], [], []
    divisors = [1, 2, 3, 4, 5, 7, 31, 32, 33, 127, 128, 129, 2441, 2 ** 20 + 1, 2 ** 29,
                limit - 1] + [rng.randrange(1, limit) for _ in range(16)]
    for d in divisors:
        m, p = T.division_magic(d)
        for n in {0, 1, d - 1, d, limit - 1, (limit - 1) // d * d, (limit - 1) // d * d - 1,
                  rng.randrange(limit)}:
            if 0 <= n < limit:
                rows.append(n)
                magics.append(m)
                shifts.append(p)
                want.append(n // d)
    size = 1 << (len(rows) - 1).bit_length()
    pad = size - len(rows)
    col = lambda v: torch.tensor(v + v[:1] * pad, dtype=torch.int32, device=DEV)  # noqa: E731
    out = torch.empty(size, dtype=torch.int32, device=DEV)
    _part_probe_kernel[(1,)](col(rows), col(magics), col(shifts), out, N=size)
    assert out[:len(rows)].cpu().tolist() == want


@pytest.mark.parametrize("qmax, base, noise_bits, bound", [(7, 192.0, 16, 2.0 ** -21),
                                                         (127, 384.0, 15, 2.0 ** -17.5)])
def test_stochastic_rounding_in_the_float_pipe_is_nearly_unbiased(qmax, base, noise_bits,
                                                                   bound) -> None:
    """_quant_tile's stochastic rounding, floor(RN(v + (base + u))) - base with u = k 2^-NB (the
    kernel's fma(x, inv, base + u) rounds the exact sum once, as this fp32 add of an fp32 v does),
    emulated over every k for 3000 values of v (full fp32 mantissas, both signs): the mean code
    minus v (in quantization steps) stays below ``bound`` on each sign, where base 128 for 4-bit
    codes gave -3.6e-6 (2^-18) for negative v (the sum crossed a binade) and every single v stays
    within one noise step."""
    rng = torch.Generator().manual_seed(0)
    v = ((torch.rand(3000, generator=rng, dtype=torch.float64) * 2 - 1) * (qmax + 1)).float()
    u = torch.arange(2 ** noise_bits, dtype=torch.float64) * 2.0 ** -noise_bits
    f = (base + u).float()                                   # exact: the kernel's bit pattern
    assert torch.equal(f.double() - base, u)
    bias = []
    for chunk in v.split(500):
        q = torch.floor((chunk[:, None] + f[None, :]).double()) - base   # fp32 sum, then floor
        bias.append(q.mean(dim=1) - chunk.double())
    bias = torch.cat(bias)
    assert float(bias.abs().max()) <= 2.0 ** -noise_bits
    for side in (v < 0, v >= 0):
        assert abs(float(bias[side].mean())) < bound, float(bias[side].mean())


def _code_of_word(w: torch.Tensor, bits: int, stochastic: bool = True) -> torch.Tensor:
    """The code _store_packed takes from a code word (fp32 bit pattern), as a signed integer:
    stochastic, bits 16.. for 2- and 4-bit codes and bits 15.. minus 128 for 8-bit ones; round to
    nearest, bits 0.."""
    b = w.float().view(torch.int32).long()
    if not stochastic:
        c = b & ((1 << bits) - 1)
    elif bits == 8:
        c = ((b >> 15) + 128) & 0xFF
    else:
        c = (b >> 16) & ((1 << bits) - 1)
    return torch.where(c >= 1 << (bits - 1), c - (1 << bits), c)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_code_words_hold_the_codes_and_never_pass_qmax(bits: int) -> None:
    """_quant_tile's code words without a clamp: for every noise value k and products x * inv
    up to the largest any group can reach in magnitude, qmax (1 + 2^-24) (its absmax times
    RN(qmax / absmax)), and a little beyond, the word's bits hold floor(word) - base (the
    stochastic code, emulated as the kernel's single rounding of the exact sum), that code is
    never above qmax nor below -qmax - 1, and the absmax element's code is qmax for every k. Round
    to nearest: the words 1.5 2^23 + q of every code q."""
    qmax = (1 << (bits - 1)) - 1
    pattern, nb = (J.SR_BASE_NARROW, 16) if bits < 8 else (J.SR_BASE_WIDE, 15)
    base = float(torch.tensor([int(pattern)], dtype=torch.int32).view(torch.float32))
    assert base == (192.0 if bits < 8 else 384.0)
    f = base + torch.arange(2 ** nb, dtype=torch.float64) * 2.0 ** -nb
    edge = qmax * (1 + torch.tensor([0.0, 2.0 ** -24, 2.0 ** -23], dtype=torch.float64))
    v = torch.cat([edge, -edge, torch.linspace(-qmax, qmax, 301, dtype=torch.float64)])
    words = (v[:, None] + f[None, :]).float()               # one rounding of the exact sum
    codes = _code_of_word(words, bits)
    assert torch.equal(codes, (torch.floor(words.double()) - base).long())
    assert int(codes.max()) <= qmax and int(codes.min()) >= -qmax - 1
    assert bool((codes[:3] == qmax).all())
    ints = torch.arange(-qmax - 1, qmax + 1, dtype=torch.float64)
    assert torch.equal(_code_of_word((ints + 1.5 * 2 ** 23).float(), bits, False), ints.long())


def _f32_add_round_down(a: float, b: float) -> float:
    """fp32 a + b rounded toward -inf (PTX ``add.rm.f32``, subnormals kept), exactly: the sum as a
    fraction, then the largest fp32 not above it."""
    exact = Fraction(a) + Fraction(b)
    c = torch.tensor(float(exact), dtype=torch.float32)     # a neighbour of the answer
    down, up = torch.tensor(-math.inf), torch.tensor(math.inf)
    while Fraction(float(c)) > exact:
        c = torch.nextafter(c, down)
    while Fraction(float(torch.nextafter(c, up))) <= exact:
        c = torch.nextafter(c, up)
    return float(c)


def test_round_to_nearest_as_two_round_down_adds_is_the_references_rule() -> None:
    """The GPU build's round to nearest (triton_device.ROUND_HALF_UP_PTX under INLINE_PTX, which
    the interpreter does not run): its PTX text, rd(rd(v + 0.5) + 1.5 2^23) emulated exactly, is
    the code word 1.5 2^23 + q of the reference's q = floor(v) + (v - floor(v) >= 0.5), for
    every tie k + 1/2 of the 8-bit range and its fp32 neighbours, tiny and subnormal values of
    both signs (where the reference's v - floor(v) is inexact), +-0 and random fp32 values; the
    word's low 8 bits hold every q an 8-bit code can be."""
    magic = 1.5 * 2 ** 23
    ties = torch.arange(-129, 129, dtype=torch.float32) + 0.5
    up, down = torch.tensor(math.inf), torch.tensor(-math.inf)
    tiny = torch.tensor([2.0 ** -149, 1e-40, 2.0 ** -126, 2.0 ** -30, 2.0 ** -26, 2.0 ** -25,
                         2.0 ** -24, 0.25, 0.5 - 2.0 ** -26, 0.5, 1.0 - 2.0 ** -25, 0.0])
    rng = torch.Generator().manual_seed(3)
    v = torch.cat([ties, torch.nextafter(ties, up), torch.nextafter(ties, down), tiny, -tiny,
                   (torch.rand(600, generator=rng) * 2 - 1) * 130,
                   (torch.rand(200, generator=rng) * 2 - 1) * 2]).float()
    want = R._round(v, stochastic=False, generator=None)
    words = torch.tensor([_f32(_run_ptx(J.ROUND_HALF_UP_PTX.value, [_f32_bits(x)]))
                          for x in v.tolist()], dtype=torch.float32)
    assert torch.equal(words.double() - magic, want.double())
    fits = (want >= -128) & (want <= 127)                   # v reaches at most qmax (1 + 2^-24)
    assert torch.equal(_code_of_word(words[fits], 8, stochastic=False), want[fits].long())


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _run_ptx(text: str, inputs: list, outputs: int = 1):
    """Emulate an inline asm block of ``prmt.b32`` (default mode), ``shl.b32``, ``and.b32``,
    ``lop3.b32``, ``add.rm.f32``, ``mul.wide.u32`` and ``mov.b64 {lo, hi}`` on 32-bit patterns
    (64-bit for a wide product); ``$0`` .. ``$(outputs - 1)`` are the results, the inputs follow
    (``$outputs + k`` is inputs[k]), ``0fXXXXXXXX`` is an fp32 immediate. Returns the result, or
    the tuple of results."""
    regs = {f"${outputs + k}": v & 0xFFFFFFFF for k, v in enumerate(inputs)}

    def val(op: str) -> int:
        if op in regs:
            return regs[op]
        return int(op[2:], 16) if op.startswith("0f") else int(op, 0)

    for stmt in text.strip("{} ").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        opcode, rest = stmt.split(None, 1)
        if opcode == "mov.b64":                      # {lo, hi}, wide: unpack
            lo, hi, src = (o.strip(" {}") for o in rest.split(","))
            regs[lo], regs[hi] = regs[src] & 0xFFFFFFFF, regs[src] >> 32
            continue
        ops = [o.strip() for o in rest.split(",")]
        if opcode == "prmt.b32":
            pool, sel = val(ops[1]) | (val(ops[2]) << 32), val(ops[3])
            assert sel & 0x8888 == 0, "no emulation of prmt's sign-replicating selectors"
            out = sum(((pool >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif opcode == "add.rm.f32":
            out = _f32_bits(_f32_add_round_down(_f32(val(ops[1])), _f32(val(ops[2]))))
        elif opcode == "shl.b32":
            out = (val(ops[1]) << val(ops[2])) & 0xFFFFFFFF
        elif opcode == "and.b32":
            out = val(ops[1]) & val(ops[2])
        elif opcode == "mul.wide.u32":
            out = val(ops[1]) * val(ops[2])
        elif opcode == "lop3.b32":
            a, b, c, lut = (val(o) for o in ops[1:5])
            out = sum(((lut >> (((a >> i) & 1) * 4 + ((b >> i) & 1) * 2 + ((c >> i) & 1))) & 1) << i
                      for i in range(32))
        else:
            raise AssertionError(f"no emulation of {opcode}")
        regs[ops[0]] = out
    results = tuple(regs[f"${k}"] for k in range(outputs))
    return results[0] if outputs == 1 else results


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("stochastic", [False, True])
def test_gpu_code_packing_ptx_packs_as_the_reference(bits: int, stochastic: bool) -> None:
    """The GPU build's packing of 2- and 4-bit codes into words (triton_device.codes_word_ptx, run
    under INLINE_PTX, which the interpreter does not run), emulated instruction by instruction:
    for code words that hold random codes where _quant_tile puts them (bits 16.. stochastic, 0..
    to nearest) and random bits everywhere else, the word is the reference's packed bytes of
    those codes read little-endian."""
    per_word = 32 // bits
    shift = 16 if stochastic else 0
    text = J.codes_word_ptx(bits, shift // 8)
    rng = random.Random(bits * 10 + stochastic)
    qmax = (1 << (bits - 1)) - 1
    for _ in range(300):
        codes = [rng.randint(-qmax - 1, qmax) for _ in range(per_word)]
        words = [(rng.getrandbits(32) & ~(((1 << bits) - 1) << shift))
                 | ((c & ((1 << bits) - 1)) << shift) for c in codes]
        packed = R.pack(torch.tensor(codes, dtype=torch.int8), bits)
        assert _run_ptx(text, words) == int.from_bytes(bytes(packed.tolist()), "little"), codes


def test_gpu_philox_products_ptx_gives_high_then_low_word() -> None:
    """The GPU build's Philox products (triton_device.MULHILO_PTX, run under INLINE_PTX only),
    emulated: for both round constants and random, edge and all-ones words, $0 is the high word
    and $1 the low word of the exact 64-bit product (the interpreter's uint64 product in
    _mulhilo)."""
    rng = random.Random(5)
    words = [0, 1, 0xFFFFFFFF, 0x80000000] + [rng.getrandbits(32) for _ in range(200)]
    for m in (0xD2511F53, 0xCD9E8D57):
        for a in words:
            assert _run_ptx(J.MULHILO_PTX.value, [a, m], outputs=2) == ((a * m) >> 32,
                                                                       (a * m) & 0xFFFFFFFF)


def test_gpu_bf16_pair_ptx_widens_both_halves() -> None:
    """The GPU build's bf16 widening (triton_device.BF16_PAIR_PTX, pack=2: element 0 in the
    word's low half), emulated: both elements come out as the fp32 bit patterns torch's
    conversion gives, for random bf16 and zeros of both signs, infinities, NaN, subnormals."""
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40,
                            3.0e38], dtype=torch.bfloat16)
    x = torch.cat([special, torch.randn(400, generator=torch.Generator().manual_seed(6))
                   .to(torch.bfloat16)])
    halves = (x.view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
    want = (x.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF).tolist()
    for i in range(0, len(halves) - 1):
        got = _run_ptx(J.BF16_PAIR_PTX.value, [halves[i] | halves[i + 1] << 16], outputs=2)
        assert got == (want[i], want[i + 1]), i


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_absmax_element_stays_at_qmax_under_stochastic_rounding(bits: int) -> None:
    """The kernel's own edge: groups whose absmax a has a * RN(qmax / a) > qmax exactly (the
    kernel's fma sees the exact product) keep the absmax element at qmax and -a at -qmax or
    -qmax - 1 under every noise draw: a code past qmax would wrap to the most negative one."""
    qmax = (1 << (bits - 1)) - 1
    rng = random.Random(bits)
    amax = []
    while len(amax) < 16:
        a = torch.tensor(1 + rng.random(), dtype=torch.float32)
        inv = torch.tensor(float(qmax), dtype=torch.float32) / a         # RN, as div_rn
        if a.double() * inv.double() > qmax:
            amax.append(float(a))
    x = (_randn(16 * 128, seed=bits) * 0.3).clamp(-0.9, 0.9)
    x.view(16, 128)[:, 0] = torch.tensor(amax, device=DEV)
    x.view(16, 128)[:, 1] = -torch.tensor(amax, device=DEV)
    for seed in range(4):
        c = K.unpack(K.quantize(x, bits, 128, generator=_gen(seed)).codes, bits,
                     x.numel()).view(16, 128).cpu()
        assert bool((c[:, 0] == qmax).all()), (seed, c[:, 0])
        assert bool(((c[:, 1] == -qmax) | (c[:, 1] == -qmax - 1)).all()), (seed, c[:, 1])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_zero_and_nonfinite_groups_get_zero_codes(bits: int, monkeypatch) -> None:
    """A group that is all zero or holds a NaN/Inf gets zero codes, as in the reference (its
    scale, 0 or NaN, carries the information), on every path: round to nearest, stochastic, with
    the Hadamard transform, permuted, and the middle hop's requantization of a NaN group. The
    code buffers start as 0xFF bytes, so a row the kernel's zero store skipped would show (a NaN
    word happens to decode to 0 on the interpreter's NaN, not on the GPU's)."""
    empty = torch.empty

    def filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(0xFF) if t.dtype == torch.uint8 else t

    monkeypatch.setattr(torch, "empty", filled)
    x = _randn(6 * 128, seed=20 + bits)
    x[128:256] = 0.0
    x[300] = float("nan")
    x[600] = -float("inf")

    def zero(q: K.QuantizedTensor, g: int) -> bool:
        return bool((K.unpack(q.codes, bits, q.numel).view(-1, 128)[g] == 0).all())

    for stochastic in (False, True):
        for had in (False, True):
            q = K.quantize(x, bits, 128, stochastic=stochastic, generator=_gen(1), hadamard=had,
                           check_finite=False)
            assert all(zero(q, g) for g in (1, 2, 4)), (stochastic, had)
            r = R.quantize(x, bits, 128, stochastic=stochastic, generator=_gen(1), hadamard=had,
                           check_finite=False)
            assert torch.equal(q.scales.nan_to_num(-1.0), r.scales.nan_to_num(-1.0))
            if not stochastic:
                assert _same(K.QuantizedTensor(q.codes, q.scales.nan_to_num(-1.0), bits, 128,
                                               q.numel),
                             K.QuantizedTensor(r.codes, r.scales.nan_to_num(-1.0), bits, 128,
                                               r.numel))
    p = K.quantize_partitions(x, 2, [1, 0], bits, 128, check_finite=False, generator=_gen(2))
    assert all(zero(p, g) for g in (4, 5, 1))        # slot 1 first: groups 3-5 move to 0-2
    q8 = R.quantize(x, 8, 128, stochastic=False, check_finite=False)
    m = K.dequantize_sum_requantize(q8, 2, bits, generator=_gen(3))
    # output group 1 sums input groups 1 and 4 (zero, -Inf), group 2 groups 2 and 5 (NaN)
    assert zero(m, 1) and zero(m, 2) and bool(torch.isnan(m.scales[1:]).all())


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def test_noise_statistics_uniform_and_uncorrelated() -> None:
    """2^16 draws per seed, 3 consecutive seeds (steps).  Each bound is 5 standard errors of a
    truly uniform, independent source: mean 1/2 (se 1/sqrt(12 n)); 16-bin histogram chi-square
    (15 degrees of freedom: mean 15, sd 5.5) under 15 + 5 x 5.5; correlations (se 1/sqrt(n)) of
    neighbours (lag 1, 2, 4 and 8: inside one Philox call and across calls), of the same
    element in neighbouring groups (rows), and of the same element across steps (seeds)."""
    rows, gp = 256, 256
    n = rows * gp
    bound = 5 / math.sqrt(n)
    steps = [_noise([r * gp for r in range(rows)], gp, seed=s, aligned=True) for s in (41, 42, 43)]
    for u in steps:
        flat = u.reshape(-1)
        assert float(flat.min()) >= 0.0 and float(flat.max()) < 1.0
        assert abs(float(flat.double().mean()) - 0.5) < 5 / math.sqrt(12 * n)
        hist = torch.histc(flat, bins=16, min=0.0, max=1.0)
        chi2 = float(((hist - n / 16) ** 2 / (n / 16)).sum())
        assert chi2 < 15 + 5 * math.sqrt(30), chi2
        for lag in (1, 2, 4, 8):
            assert abs(_corr(flat[:-lag], flat[lag:])) < 5 / math.sqrt(n - lag), lag
        assert abs(_corr(u[:-1].reshape(-1), u[1:].reshape(-1))) < 5 / math.sqrt(n - gp)
        # the eight 16-bit halves of one Philox call against each other; 16 bits of resolution
        assert torch.equal(flat * 65536, (flat * 65536).round())
        lanes = flat.view(-1, 8)
        for a in range(8):
            for b in range(a + 1, 8):
                assert abs(_corr(lanes[:, a], lanes[:, b])) < 5 / math.sqrt(n // 8), (a, b)
    for a, b in ((0, 1), (1, 2), (0, 2)):
        assert abs(_corr(steps[a].reshape(-1), steps[b].reshape(-1))) < bound
