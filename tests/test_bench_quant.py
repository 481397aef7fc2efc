"""bench/bench_quant.py on CPU: the trainer's call convention, another kernel version loaded
beside the current one, and the flags' errors. (Its CUDA timing, ``triton.testing.do_bench``
plus the host enqueue time, runs only on a GPU.)"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_quant_under_test",
                                                  os.path.join(ROOT, "bench", "bench_quant.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module                 # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_trainer_convention_passes_the_device_counter_or_turns_the_readback_off():
    bq = _bench()
    conv = bq.call_convention("cpu", "device", torch.Generator())
    assert conv.seed_generator.device.type == "cpu"
    assert conv.nonfinite_counter.dtype == torch.int32

    def with_counter(x, *, nonfinite_counter=None, check_finite=True):
        return nonfinite_counter

    def without_counter(x, *, check_finite=True):
        return check_finite

    assert conv.quantizing_kwargs(with_counter) == {"nonfinite_counter": conv.nonfinite_counter}
    assert conv.quantizing_kwargs(without_counter) == {"check_finite": False}
    # the old tables' convention: a device generator and a read-back per call
    gen = torch.Generator()
    legacy = bq.call_convention("cuda", "per-call-sync", gen)
    assert legacy.seed_generator is gen and legacy.nonfinite_counter is None
    assert legacy.quantizing_kwargs(with_counter) == {}


def test_cpu_rows_for_every_kernel(capsys):
    bq = _bench()
    assert bq.main(["--sizes", "4K", "--bits", "4", "--device", "cpu", "--iters", "1",
                    "--backends", "torch"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line and not line.startswith(("#", "kernel"))]
    names = [r[0] for r in rows]
    assert names == ["quantize", "quantize+HT32", "quantize_partitions(4)+HT", "dequantize",
                     "dequant_sum_requant(S=8)", "dequant_sum(S=8)",
                     "quantize_difference(bf16)", "dequantize_add(bf16)"]
    for r in rows:
        assert r[1] == "torch" and float(r[4]) > 0 and r[5] == "-"   # ms, no host column on CPU
    # round to nearest dequantizes exactly; the quantizers' error is that of 4 bits
    assert float(rows[3][-2]) == 0.0 and 0.05 < float(rows[0][-2]) < 0.3


def test_sources_flag_names_the_hop_rows_and_the_planner_reads_them(capsys, tmp_path):
    """--sources sets the slots the middle and final hops sum (the run's GPUs per node); the
    planner's --kernels-json reads the rows whatever S they were timed at."""
    from megatron.planner import calibration

    bq = _bench()
    out = tmp_path / "rows.json"
    assert bq.main(["--sizes", "4K", "--bits", "4", "--device", "cpu", "--iters", "1",
                    "--backends", "torch", "--sources", "2", "--json", str(out)]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()
             if line and not line.startswith(("#", "kernel"))]
    assert "dequant_sum_requant(S=2)" in names and "dequant_sum(S=2)" in names
    rows = json.loads(out.read_text())["rows"]
    mid = next(r for r in rows if r["kernel"] == "dequant_sum_requant(S=2)")
    # 4096 4-bit codes + scales in, 2048 out
    assert mid["moved_bytes"] == (2048 + 128) + (1024 + 64)
    assert calibration.bench_kernel_name("dequant_sum(S=8)") == "dequantize_sum"
    assert calibration.bench_kernel_name("dequant_sum_requant(S=2)") == "dequantize_sum_requantize"
    assert calibration.bench_kernel_name("quantize_difference(bf16)") == "quantize_difference"
    assert calibration.bench_kernel_name("copy") is None
    rates = calibration.load_kernels_json(str(out), calibration.default_rates())
    assert rates.kernel("dequantize_sum").bandwidth > 0


@pytest.mark.parametrize("argv, message", [
    (["--compare-kernels", "x.py"], "--compare-kernels needs --device cuda"),
    (["--backends", "torch,nope"], "--backends: ['nope']"),
])
def test_flag_errors_name_the_flag(argv, message, capsys):
    bq = _bench()
    with pytest.raises(SystemExit) as exc:
        bq.main(["--device", "cpu", "--sizes", "1K"] + argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_compare_kernels_loads_another_version_as_its_own_module(tmp_path):
    """The copy runs as the suite runs Triton: compiled on CUDA tensors with a GPU, else in the
    interpreter (tests/conftest.py sets TRITON_INTERPRET before anything imports triton)."""
    pytest.importorskip("triton")
    from megatron.distributed.quant.kernels import reference as R
    copy = tmp_path / "prev_kernels.py"
    shutil.copy(os.path.join(ROOT, "megatron", "distributed", "quant", "kernels",
                             "triton_launch.py"), copy)
    bq = _bench()
    label, module = bq.load_kernels(str(copy))
    try:
        assert label == "triton@prev_kernels"
        assert module.__file__ == str(copy) and module.__name__ in sys.modules
        x = torch.randn(1024, generator=torch.Generator().manual_seed(3))
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        got = module.quantize(x.to(dev), 4, 128, stochastic=False)
        want = R.quantize(x, 4, 128, stochastic=False)
        assert torch.equal(got.codes.cpu(), want.codes) and torch.equal(got.scales.cpu(),
                                                                        want.scales)
    finally:
        sys.modules.pop(module.__name__, None)
