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

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"   # must precede the first @triton.jit decoration

pytest.importorskip("triton")

from megatron.distributed.quant import kernels as K  # noqa: E402
from megatron.distributed.quant.kernels import reference as R  # noqa: E402

try:
    from megatron.distributed.quant.kernels import triton_kernels as T  # noqa: E402
except Exception as exc:  # pragma: no cover - broken triton install
    pytest.skip(f"triton kernels cannot be imported: {exc!r}", allow_module_level=True)

if not _CUDA:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(T._quantize_kernel, InterpretedFunction):
        # another test module imported the kernels before TRITON_INTERPRET was set: rebuild them
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


@pytest.mark.parametrize("hadamard", [False, True])
def test_quantize_partitions_bit_exact(hadamard: bool) -> None:
    x = _randn(8 * 256, seed=1)
    order = [0, 4, 1, 5, 2, 6, 3, 7]
    a = K.quantize_partitions(x, 8, order, 4, 128, stochastic=False, hadamard=hadamard)
    b = R.quantize_partitions(x, 8, order, 4, 128, stochastic=False, hadamard=hadamard)
    assert _same(a, b)
    # stochastic: random stream follows input order, so it equals quantize + permutation
    c = K.quantize_partitions(x, 8, order, 8, 128, generator=_gen(3), hadamard=hadamard)
    d = K.quantize(x, 8, 128, generator=_gen(3), hadamard=hadamard)
    assert torch.equal(c.codes, d.codes.view(8, -1)[order].reshape(-1))
    assert torch.equal(c.scales, d.scales.view(8, -1)[order].reshape(-1))


def test_dequantize_sum_requantize_bit_exact() -> None:
    x = _randn(4 * 512, seed=2)
    x[:128] = 0.0
    for bits_in, bits_out in ((8, 4), (4, 2), (8, 8)):
        q = R.quantize(x, bits_in, 128, stochastic=False)
        for gso in (None, 64, 256):
            a = K.dequantize_sum_requantize(q, 4, bits_out, group_size_out=gso, stochastic=False)
            b = R.dequantize_sum_requantize(q, 4, bits_out, group_size_out=gso, stochastic=False)
            assert _same(a, b), (bits_in, bits_out, gso)


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


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float32])
def test_weight_diff_ops_bit_exact(dt: torch.dtype) -> None:
    ref = _randn(2048, seed=5).to(dt)
    new = ref.float() + 1e-2 * _randn(2048, seed=6)
    a = K.quantize_difference(new, ref, 4, 512, stochastic=False)
    b = R.quantize_difference(new, ref, 4, 512, stochastic=False)
    assert _same(a, b)
    expect = R.dequantize_add(b, ref)
    assert torch.equal(K.dequantize_add(a, ref), expect)
    alias = ref.clone()
    out = K.dequantize_add(a, alias, out=alias)
    assert out is alias and torch.equal(alias, expect)


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
    with pytest.raises(K.NonFiniteError, match="3 non-finite"):
        K.quantize(x, 4, 128)
    with pytest.raises(K.NonFiniteError, match="3 non-finite"):
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
    """With ``nonfinite_counter`` the kernel adds its fused count into the caller's int32 device
    tensor and no ``.item()`` runs (it was one host sync per quantize call); the codes are those
    of the unchecked call; several calls accumulate."""
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
    assert counter.tolist() == [12]
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
    per bucket in the backward hooks."""
    a = T._slot_table((1, 0, 3, 2), torch.device(DEV))
    assert a is T._slot_table((1, 0, 3, 2), torch.device(DEV))
    assert a.tolist() == [1, 0, 3, 2] and T._slot_table((0, 1, 2, 3), torch.device(DEV)) is not a
