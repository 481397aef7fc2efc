"""C++ CPU kernels (megatron/distributed/quant/kernels/cpu_kernels.*) vs the torch reference.

Round-to-nearest results must be bit-identical to the reference for every op; stochastic rounding
must be unbiased (checked against the exact per-element variance of stochastic rounding) and
reproducible from a seeded generator; validation errors and NonFiniteError must match the
reference's. The one-time build takes a few seconds (cached in TORCH_EXTENSIONS_DIR).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron.distributed.quant.kernels import dispatch as K
from megatron.distributed.quant.kernels import cpu_kernels as C
from megatron.distributed.quant.kernels import reference as R

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _toolchain() -> bool:
    try:
        import ninja  # noqa: F401
        has_ninja = True
    except ImportError:
        has_ninja = shutil.which("ninja") is not None
    return has_ninja and shutil.which(os.environ.get("CXX", "c++")) is not None


if not C.available():
    if _toolchain():  # a compiler and ninja are there: a failed build is a bug, not a skip
        raise AssertionError(f"C++ CPU kernels failed to build: {C.build_error()!r}")
    pytest.skip(f"no C++ toolchain for the CPU kernels: {C.build_error()!r}", allow_module_level=True)


@pytest.fixture(autouse=True)
def _cpp_backend(monkeypatch):
    monkeypatch.setenv("QUANT_KERNELS", "cpp")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _data(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gaussian data with the awkward cases: zero group, denormal-tiny group, outliers, ties."""
    x = torch.randn(n, generator=_gen(seed)) * 3.0
    if n >= 512:
        x[64:128] = 0.0                               # all-zero group(s) -> scale 0
        x[128:192] = 1e-39                            # amax tiny: qmax/amax = inf -> scale 0
        x[200] = 1e4                                  # outlier
        x[256:320] = torch.arange(64, dtype=torch.float32) * 0.25 - 8.0   # many exact ties
    return x.to(dtype)


def _same_q(a: K.QuantizedTensor, b: K.QuantizedTensor) -> None:
    assert (a.bits, a.group_size, a.numel) == (b.bits, b.group_size, b.numel)
    assert a.codes.dtype == b.codes.dtype == torch.uint8
    assert a.scales.dtype == b.scales.dtype
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales, b.scales) or (
        torch.equal(a.scales.isnan(), b.scales.isnan())
        and torch.equal(a.scales.nan_to_num(), b.scales.nan_to_num()))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype in (torch.float32, torch.bfloat16, torch.float16):
        ia = a.view(torch.int32 if a.dtype == torch.float32 else torch.int16)
        ib = b.view(torch.int32 if b.dtype == torch.float32 else torch.int16)
        nan = a.isnan()
        assert torch.equal(nan, b.isnan())
        assert torch.equal(ia[~nan], ib[~nan])
    else:
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# round to nearest: bit-identical to the reference
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("gs,hb", [(32, 0), (128, 0), (96, 0), (2048, 0), (128, 32), (64, 8),
                                   (256, 256), (32, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_rn_bit_exact(bits, gs, hb, dtype) -> None:
    x = _data(6144, seed=bits + gs, dtype=dtype)
    kw = dict(stochastic=False, hadamard=hb > 0, hadamard_block=hb or 32)
    _same_q(C.quantize(x, bits, gs, **kw), R.quantize(x, bits, gs, **kw))
    # through the dispatcher too
    _same_q(K.quantize(x, bits, gs, **kw), R.quantize(x, bits, gs, **kw))


@pytest.mark.parametrize("order", [[0], [1, 0], [2, 0, 1], [3, 1, 0, 2], [0, 2, 1, 3]])
@pytest.mark.parametrize("bits,hb", [(8, 32), (4, 0), (2, 16)])
def test_quantize_partitions_rn_bit_exact(order, bits, hb) -> None:
    p = len(order)
    x = _data(p * 3 * 128, seed=p, dtype=torch.bfloat16)
    kw = dict(stochastic=False, hadamard=hb > 0, hadamard_block=hb or 32)
    _same_q(C.quantize_partitions(x, p, order, bits, 128, **kw),
            R.quantize_partitions(x, p, order, bits, 128, **kw))
    # tensor order, as the collectives may pass
    _same_q(C.quantize_partitions(x, p, torch.tensor(order), bits, 128, **kw),
            R.quantize_partitions(x, p, order, bits, 128, **kw))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("hb", [0, 32])
def test_dequantize_bit_exact(bits, hb) -> None:
    x = _data(4096, seed=3)
    q = R.quantize(x, bits, 128, stochastic=False)
    kw = dict(hadamard=hb > 0, hadamard_block=hb or 32)
    _bits_equal(C.dequantize(q, **kw), R.dequantize(q, **kw))
    _bits_equal(C.dequantize(q, out_dtype=torch.bfloat16, **kw),
                R.dequantize(q, out_dtype=torch.bfloat16, **kw))
    o1 = torch.full((2, 2048), 7.0, dtype=torch.bfloat16)
    o2 = torch.full((2, 2048), 7.0, dtype=torch.bfloat16)
    C.dequantize(q, out=o1, **kw)
    R.dequantize(q, out=o2, **kw)
    _bits_equal(o1, o2)
    s1 = torch.zeros(8192)[::2]                       # strided fp32 out
    s2 = torch.zeros(8192)[::2]
    C.dequantize(q, out=s1, **kw)
    R.dequantize(q, out=s2, **kw)
    _bits_equal(s1, s2)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("sources", [1, 2, 3, 4])
@pytest.mark.parametrize("hb,scale", [(0, 1.0), (32, 1.0), (32, 0.25), (0, 1.0 / 3.0), (64, 0.1)])
def test_dequantize_sum_bit_exact(bits, sources, hb, scale) -> None:
    gs = 64
    x = _data(sources * 1024, seed=sources)
    q = R.quantize(x, bits, gs, stochastic=False)
    kw = dict(hadamard=hb > 0, hadamard_block=hb or 32, scale=scale)
    ref = R.dequantize_sum(q, sources, **kw)
    _bits_equal(C.dequantize_sum(q, sources, **kw), ref)
    out = torch.full((1024,), 5.0)
    assert C.dequantize_sum(q, sources, out=out, **kw) is out
    _bits_equal(out, ref)
    ob1 = torch.zeros(32, 32, dtype=torch.bfloat16)
    ob2 = torch.zeros(32, 32, dtype=torch.bfloat16)
    C.dequantize_sum(q, sources, out=ob1, **kw)
    R.dequantize_sum(q, sources, out=ob2, **kw)
    _bits_equal(ob1, ob2)


def test_dequantize_sum_hadamard_block_larger_than_group() -> None:
    # n % hb == 0 but groups (32) are smaller than the Hadamard block (128): tiles cross groups
    q = R.quantize(_data(2 * 1024, seed=9), 4, 32, stochastic=False)
    _bits_equal(C.dequantize_sum(q, 2, hadamard=True, hadamard_block=128),
                R.dequantize_sum(q, 2, hadamard=True, hadamard_block=128))


@pytest.mark.parametrize("bits_in,gs_in", [(8, 128), (8, 32), (4, 64), (2, 256)])
@pytest.mark.parametrize("bits_out,gs_out", [(4, 128), (8, 64), (2, 32), (4, 256)])
@pytest.mark.parametrize("sources", [1, 2, 4])
def test_dequantize_sum_requantize_rn_bit_exact(bits_in, gs_in, bits_out, gs_out, sources) -> None:
    x = _data(sources * 1024, seed=bits_in * sources)
    q = R.quantize(x, bits_in, gs_in, stochastic=False)
    kw = dict(group_size_out=gs_out, stochastic=False)
    _same_q(C.dequantize_sum_requantize(q, sources, bits_out, **kw),
            R.dequantize_sum_requantize(q, sources, bits_out, **kw))


@pytest.mark.parametrize("new_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ref_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,gs", [(4, 2048), (8, 128), (2, 64)])
def test_quantize_difference_rn_bit_exact(new_dtype, ref_dtype, bits, gs) -> None:
    ref = _data(4096, seed=1).to(ref_dtype)
    new = (ref.float() + 0.01 * torch.randn(4096, generator=_gen(2))).to(new_dtype)
    new[:gs] = ref[:gs].to(new_dtype)                 # zero-difference group
    _same_q(C.quantize_difference(new, ref, bits, gs, stochastic=False),
            R.quantize_difference(new, ref, bits, gs, stochastic=False))


@pytest.mark.parametrize("ref_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_dequantize_add_bit_exact(ref_dtype, bits) -> None:
    ref = _data(4096, seed=4).to(ref_dtype)
    q = R.quantize(0.01 * torch.randn(4096, generator=_gen(5)), bits, 128, stochastic=False)
    expect = R.dequantize_add(q, ref)
    _bits_equal(C.dequantize_add(q, ref), expect)
    alias = ref.clone()
    assert C.dequantize_add(q, alias, out=alias) is alias     # in place (the qWD path)
    _bits_equal(alias, expect)
    two_d = ref.clone().view(64, 64)
    _bits_equal(C.dequantize_add(q, two_d), expect.view(64, 64))
    wide = torch.zeros(4096, dtype=torch.float32)             # out of another dtype
    C.dequantize_add(q, ref, out=wide)
    _bits_equal(wide, expect.float())
    # out overlapping the reference at an offset: must still equal the reference result
    buf = torch.cat([ref, ref[:64]])
    shifted_ref = buf[:4096]
    shifted_out = buf[64:]
    expect_shift = R.dequantize_add(q, shifted_ref.clone())
    C.dequantize_add(q, shifted_ref, out=shifted_out)
    _bits_equal(shifted_out, expect_shift)


def test_nonfinite_groups_without_check_match_reference() -> None:
    x = _data(1024, seed=6)
    x[5] = float("nan")
    x[300] = float("inf")
    x[700] = -float("inf")
    for bits in (2, 4, 8):
        a = C.quantize(x, bits, 128, stochastic=False, check_finite=False)
        b = R.quantize(x, bits, 128, stochastic=False, check_finite=False)
        _same_q(a, b)
        assert int(a.scales.isnan().sum()) == 3
        _bits_equal(C.dequantize(a), R.dequantize(b))


def test_empty_inputs() -> None:
    e = torch.empty(0)
    q = C.quantize(e, 4, 128)
    assert q.codes.numel() == 0 and q.scales.numel() == 0
    assert C.dequantize(q).numel() == 0


# ------------------------------------------------------------------------------------------------
# stochastic rounding: unbiased, reproducible
# ------------------------------------------------------------------------------------------------

def _check_unbiased(x: torch.Tensor, draws: list[torch.Tensor], scales: torch.Tensor,
                    group_size: int) -> None:
    """Stochastic rounding of v = x/scale to floor(v)+Bernoulli(frac): the error of one draw has
    mean 0 and variance scale^2 * frac * (1 - frac). Over K draws and all elements the total
    error divided by its exact standard deviation is N(0, 1): assert |z| < 5 (a false failure
    has probability < 1e-6), and every element's mean is within 6 of its own sigmas + 1e-6
    (P < 1e-8 per element)."""
    k = len(draws)
    err = torch.stack(draws).double() - x.double()            # [K, n]
    s = scales.double().repeat_interleave(group_size)
    v = x.double() / s
    frac = v - torch.floor(v)
    var = (s * s) * frac * (1 - frac)                         # per draw, per element
    z_total = err.sum().item() / math.sqrt(k * var.sum().item())
    assert abs(z_total) < 5.0, z_total
    mean_err = err.mean(0)
    tol = 6.0 * torch.sqrt(var / k) + 1e-6 * s
    assert bool((mean_err.abs() <= tol).all()), float((mean_err.abs() - tol).max())
    # rounding really is stochastic, with the Bernoulli spread (not round-to-nearest in disguise)
    ratio = float(err.var(0).sum() / var.sum())
    assert 0.9 < ratio < 1.1, ratio


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_stochastic_unbiased(bits) -> None:
    x = torch.randn(2048, generator=_gen(10))
    g = _gen(123)
    qs = [C.quantize(x, bits, 128, stochastic=True, generator=g) for _ in range(300)]
    scales = qs[0].scales
    for q in qs:                                               # scale does not depend on draws
        assert torch.equal(q.scales, scales)
    _check_unbiased(x, [C.dequantize(q) for q in qs], scales, 128)


def test_dequantize_sum_requantize_stochastic_unbiased() -> None:
    x = torch.randn(2 * 1024, generator=_gen(11))
    q = R.quantize(x, 8, 128, stochastic=False)
    target = R.dequantize_sum(q, 2)
    g = _gen(7)
    outs = [C.dequantize_sum_requantize(q, 2, 4, group_size_out=64, generator=g)
            for _ in range(300)]
    _check_unbiased(target, [C.dequantize(o) for o in outs], outs[0].scales, 64)


def test_stochastic_reproducible_and_seeded() -> None:
    x = _data(4096, seed=12, dtype=torch.bfloat16)
    a = C.quantize(x, 4, 128, generator=_gen(5), hadamard=True)
    b = C.quantize(x, 4, 128, generator=_gen(5), hadamard=True)
    c = C.quantize(x, 4, 128, generator=_gen(6), hadamard=True)
    _same_q(a, b)
    assert not torch.equal(a.codes, c.codes)
    g = _gen(5)
    first = C.quantize(x, 4, 128, generator=g)
    second = C.quantize(x, 4, 128, generator=g)              # generator advanced: new draws
    assert not torch.equal(first.codes, second.codes)
    # saving/restoring the generator state reproduces the stream (checkpoint/resume)
    g = _gen(9)
    state = g.get_state()
    one = C.dequantize_sum_requantize(R.quantize(x.float(), 8, 128, stochastic=False), 2, 4,
                                      generator=g)
    g.set_state(state)
    two = C.dequantize_sum_requantize(R.quantize(x.float(), 8, 128, stochastic=False), 2, 4,
                                      generator=g)
    _same_q(one, two)
    # one seed draw per call, nothing else
    g1, g2 = _gen(3), _gen(3)
    C.quantize(x, 8, 128, generator=g1)
    torch.randint(-2 ** 63, 2 ** 63 - 1, (1,), dtype=torch.int64, generator=g2)
    assert torch.equal(g1.get_state(), g2.get_state())


def test_partitions_stochastic_equals_quantize_then_permute() -> None:
    """Random stream indexed by input element: the permuted layout gets the same draws."""
    x = _data(4 * 512, seed=13)
    order = [2, 0, 3, 1]
    qp = C.quantize_partitions(x, 4, order, 8, 128, generator=_gen(4), hadamard=True)
    q = C.quantize(x, 8, 128, generator=_gen(4), hadamard=True)
    idx = torch.tensor(order)
    assert torch.equal(qp.codes, q.codes.view(4, -1)[idx].reshape(-1))
    assert torch.equal(qp.scales, q.scales.view(4, -1)[idx].reshape(-1))


def test_stochastic_error_matches_reference_statistics() -> None:
    """Same distribution as the reference: relative error of SR agrees within 3 %."""
    x = torch.randn(1 << 16, generator=_gen(14))
    e_c = torch.stack([(C.dequantize(C.quantize(x, 4, 128, generator=_gen(s))) - x).norm()
                       for s in range(4)]).mean()
    e_r = torch.stack([(R.dequantize(R.quantize(x, 4, 128, generator=_gen(s))) - x).norm()
                       for s in range(4)]).mean()
    assert abs(float(e_c / e_r) - 1.0) < 0.03


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------

def _same_error(fn_c, fn_r, exc=ValueError) -> None:
    with pytest.raises(exc) as ec:
        fn_c()
    with pytest.raises(exc) as er:
        fn_r()
    assert type(ec.value) is type(er.value)
    assert str(ec.value) == str(er.value)


@pytest.mark.parametrize("case", [
    dict(bits=3, gs=128), dict(bits=4, gs=100), dict(bits=4, gs=0), dict(bits=2, gs=2),
    dict(bits=4, gs=128, hadamard=True, hadamard_block=24),
    dict(bits=4, gs=96, hadamard=True, hadamard_block=64),
])
def test_quantize_errors_match(case) -> None:
    x = torch.randn(768)
    kw = {k: v for k, v in case.items() if k not in ("bits", "gs")}
    _same_error(lambda: C.quantize(x, case["bits"], case["gs"], **kw),
                lambda: R.quantize(x, case["bits"], case["gs"], **kw))


def test_other_errors_match() -> None:
    x = torch.randn(1024)
    q = R.quantize(x, 8, 128)
    for c, r in [
        (lambda: C.quantize(torch.arange(256), 8, 128), lambda: R.quantize(torch.arange(256), 8, 128)),
        (lambda: C.quantize_partitions(x, 3, [0, 1, 2], 8, 128),
         lambda: R.quantize_partitions(x, 3, [0, 1, 2], 8, 128)),
        (lambda: C.quantize_partitions(x, 2, [0, 0], 8, 128),
         lambda: R.quantize_partitions(x, 2, [0, 0], 8, 128)),
        (lambda: C.quantize_partitions(x, 2, [1, 0], 5, 128),
         lambda: R.quantize_partitions(x, 2, [1, 0], 5, 128)),
        (lambda: C.dequantize_sum(q, 3), lambda: R.dequantize_sum(q, 3)),
        (lambda: C.dequantize_sum(q, 2, hadamard=True, hadamard_block=1024),
         lambda: R.dequantize_sum(q, 2, hadamard=True, hadamard_block=1024)),
        (lambda: C.dequantize_sum(q, 1, out=torch.empty(5)), lambda: R.dequantize_sum(q, 1, out=torch.empty(5))),
        (lambda: C.dequantize_sum_requantize(q, 2, 3), lambda: R.dequantize_sum_requantize(q, 2, 3)),
        (lambda: C.dequantize_sum_requantize(q, 2, 4, group_size_out=100),
         lambda: R.dequantize_sum_requantize(q, 2, 4, group_size_out=100)),
        (lambda: C.dequantize(q, hadamard=True, hadamard_block=256),
         lambda: R.dequantize(q, hadamard=True, hadamard_block=256)),
        (lambda: C.quantize_difference(x, x[:512], 4, 128), lambda: R.quantize_difference(x, x[:512], 4, 128)),
        (lambda: C.quantize_difference(x, x, 4, 100), lambda: R.quantize_difference(x, x, 4, 100)),
        (lambda: C.dequantize_add(q, x[:512]), lambda: R.dequantize_add(q, x[:512])),
        (lambda: C.dequantize_add(q, x, out=torch.empty(3)), lambda: R.dequantize_add(q, x, out=torch.empty(3))),
    ]:
        _same_error(c, r)
    bad = K.QuantizedTensor(q.codes[:10], q.scales, 8, 128, 1024)
    _same_error(lambda: C.dequantize(bad), lambda: R.dequantize(bad))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_raises_like_reference(value) -> None:
    x = torch.randn(1024)
    x[17] = value
    x[900] = value
    for fn in (lambda m, g: m.quantize(x, 4, 128, generator=g),
               lambda m, g: m.quantize(x.bfloat16(), 8, 128, generator=g, hadamard=True),
               lambda m, g: m.quantize_partitions(x, 2, [1, 0], 8, 128, generator=g),
               lambda m, g: m.quantize_difference(x, torch.zeros(1024, dtype=torch.bfloat16), 4, 128,
                                                  generator=g)):
        gc, gr = _gen(1), _gen(1)
        _same_error(lambda: fn(C, gc), lambda: fn(R, gr), exc=K.NonFiniteError)
        assert torch.equal(gc.get_state(), gr.get_state())   # the failed call drew nothing
    # difference overflowing to inf in bf16 is caught too
    new = torch.full((256,), 3e38)
    ref = torch.full((256,), -3e38, dtype=torch.bfloat16)
    _same_error(lambda: C.quantize_difference(new, ref, 4, 128),
                lambda: R.quantize_difference(new, ref, 4, 128), exc=K.NonFiniteError)
    assert K.count_nonfinite(x) == 2
    assert K.count_nonfinite(x.bfloat16()) == 2
    assert K.count_nonfinite(torch.randn(100)) == 0


# ------------------------------------------------------------------------------------------------
# dispatch and build
# ------------------------------------------------------------------------------------------------

def test_dispatch(monkeypatch) -> None:
    x = torch.randn(256)
    assert K.backend_for(x) == "cpp"
    monkeypatch.setenv("QUANT_KERNELS", "cpu")
    assert K.backend_for(x) == "cpp"
    monkeypatch.setenv("QUANT_KERNELS", "auto")
    assert K.backend_for(x) == "cpp"
    monkeypatch.setenv("QUANT_KERNELS", "torch")
    assert K.backend_for(x) == "torch"
    # fp64 is not handled by the C++ kernels: handed to the reference, same result
    monkeypatch.setenv("QUANT_KERNELS", "cpp")
    xd = torch.randn(1024, dtype=torch.float64)
    _same_q(K.quantize(xd, 4, 128, stochastic=False), R.quantize(xd, 4, 128, stochastic=False))


def test_concurrent_first_build(tmp_path) -> None:
    """Four processes building into an empty extension cache at once all load the library
    (cpp_extension's file lock serialises the build)."""
    code = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, %r)
        from megatron.distributed.quant.kernels import cpu_kernels as C
        from megatron.distributed.quant.kernels import reference as R
        assert C.available(), C.build_error()
        x = torch.randn(4096)
        q = C.quantize(x, 4, 128, stochastic=False)
        assert torch.equal(q.codes, R.quantize(x, 4, 128, stochastic=False).codes)
        print("OK", C.library_path())
    """ % REPO)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        assert "OK " + str(tmp_path) in out, out


def test_fallback_when_toolchain_missing(tmp_path) -> None:
    """No ninja/compiler on PATH: auto mode falls back to the reference with ONE warning, results
    equal the reference; QUANT_KERNELS=cpp raises instead."""
    code = textwrap.dedent("""
        import logging, os, sys, torch
        sys.path.insert(0, %r)
        logging.basicConfig(level=logging.WARNING, format="LOG %%(message)s")
        from megatron.distributed.quant.kernels import dispatch as K
        from megatron.distributed.quant.kernels import reference as R
        x = torch.randn(4096)
        assert K.backend_for(x) == "torch"
        for _ in range(3):
            q = K.quantize(x, 4, 128, stochastic=False)
        assert torch.equal(q.codes, R.quantize(x, 4, 128, stochastic=False).codes)
        os.environ["QUANT_KERNELS"] = "cpp"
        try:
            K.backend_for(x)
        except RuntimeError as exc:
            print("RAISED", exc)
    """ % REPO)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), PATH=str(tmp_path / "empty"),
               OMP_NUM_THREADS="1")
    env.pop("QUANT_KERNELS", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count("C++ CPU quantization kernels unavailable") == 1, out
    assert "RAISED QUANT_KERNELS=cpp" in out, out
