"""The device-side non-finite counter on the CPU backends, and no silent reference fallback on
CUDA (issue 24, items 1 and 5).

Why: the trainer's quantized collectives count NaN/Inf inputs into one int32 device tensor per
step (agreed once per step); the torch reference and the C++ kernels count it in the dispatcher
(Triton fuses it into the kernel: tests/test_triton_kernels.py). And a CUDA tensor whose Triton
kernels cannot load used to run the torch reference silently, several times slower, with its
noise drawn on the host: now it is an error naming the import failure and the opt-in.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.distributed.quant.kernels import dispatch as K


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_cpu_backends_count_into_the_counter(monkeypatch, backend: str) -> None:
    monkeypatch.setenv("QUANT_KERNELS", backend)
    if backend == "cpp" and not K.cpu_kernels_available():
        pytest.skip("C++ kernels not built here")
    x = torch.randn(1024)
    x[[1, 2]] = float("nan")
    counter = torch.zeros(1, dtype=torch.int32)
    q = K.quantize_partitions(x, 4, [0, 2, 1, 3], 4, 128, stochastic=False,
                              nonfinite_counter=counter)
    K.quantize_difference(torch.ones(256), torch.zeros(256), 4, 128, nonfinite_counter=counter)
    assert counter.item() == 2
    ref = K.quantize_partitions(x, 4, [0, 2, 1, 3], 4, 128, stochastic=False, check_finite=False)
    assert torch.equal(q.codes, ref.codes) and torch.equal(q.scales.isnan(), ref.scales.isnan())
    with pytest.raises(K.NonFiniteError):   # without a counter the standalone check still raises
        K.quantize(x, 4, 128)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_a_difference_that_overflows_the_reference_dtype_is_counted(monkeypatch,
                                                                      backend: str) -> None:
    """qWD with fp16 weights: finite fp32 ``new`` and fp16 ``reference`` whose difference
    overflows fp16 (Inf): its group's scale is NaN, so the weights would turn NaN on every rank.
    The counter must see it on every backend (the CPU backends counted only the two inputs)."""
    monkeypatch.setenv("QUANT_KERNELS", backend)
    if backend == "cpp" and not K.cpu_kernels_available():
        pytest.skip("C++ kernels not built here")
    if backend == "triton":
        pytest.importorskip("triton")
    new = torch.zeros(256)
    new[70] = 7.0e4                                    # beyond fp16's 65504
    ref = torch.zeros(256, dtype=torch.float16)
    counter = torch.zeros(1, dtype=torch.int32)
    q = K.quantize_difference(new, ref, 4, 64, nonfinite_counter=counter)
    assert bool(q.scales[1].isnan()) and int(counter.item()) >= 1
    counter.zero_()
    K.quantize_difference(torch.ones(256), ref, 4, 64, nonfinite_counter=counter)
    assert int(counter.item()) == 0


def test_cuda_tensors_without_triton_are_an_error_not_a_fallback(monkeypatch) -> None:
    monkeypatch.delenv("QUANT_KERNELS", raising=False)
    monkeypatch.setattr(K, "_TRITON_MOD", None)
    monkeypatch.setattr(K, "_TRITON_ERR", ImportError("libcuda.so.1: cannot open shared object"))
    fake_cuda_tensor = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match=r"need triton.*libcuda.*QUANT_KERNELS=torch"):
        K.backend_for(fake_cuda_tensor)
    monkeypatch.setenv("QUANT_KERNELS", "torch")          # the explicit opt-in still works
    assert K.backend_for(fake_cuda_tensor) == "torch"
