"""Gradient-accumulation dtype is independent of the wire format.

Why: megatron-core ties both to ``grad_reduce_in_fp32``; with quantized gradients the wire is the
quantized codes whatever the buffer dtype. We check the accumulator dtype (``param.main_grad``,
the DDP grad buffer) and the bytes on the wire (communication accounting) separately.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_integration_ddp import build, forward_backward, run_distributed, train  # noqa: E402

from megatron.distributed.quant.arguments import add_quantization_args  # noqa: E402
from megatron.distributed.quant.config import QuantizationConfig  # noqa: E402
from megatron.distributed.quant.grad_accum import (apply_grad_accum_dtype,  # noqa: E402
                                                   resolve_grad_dtypes)


def _args(*argv: str, bf16: bool = True, fp32_acc: bool = True) -> argparse.Namespace:
    p = add_quantization_args(argparse.ArgumentParser())
    a = p.parse_args(list(argv))
    a.bf16, a.fp16, a.accumulate_allreduce_grads_in_fp32 = bf16, False, fp32_acc
    return a


def _resolved(*argv: str, bf16: bool = True, fp32_acc: bool = True):
    """:func:`resolve_grad_dtypes` of the config these flags build (the trainer's defaults)."""
    return resolve_grad_dtypes(QuantizationConfig.from_args(_args(*argv, bf16=bf16,
                                                                  fp32_acc=fp32_acc)),
                               params_dtype=torch.bfloat16 if bf16 else torch.float32,
                               accumulate_in_fp32_default=fp32_acc)


def test_default_keeps_megatron_core_behaviour():
    assert _resolved()[0] == torch.float32          # --bf16 => fp32 accumulation
    assert _resolved(fp32_acc=False)[0] == torch.bfloat16  # --grad-reduce-in-bf16
    assert _resolved(bf16=False, fp32_acc=False)[0] == torch.float32
    assert "exact fp32" in _resolved()[1]


def test_accum_dtype_independent_of_wire():
    acc, wire = _resolved("--grad-accum-dtype", "bf16", "--quantized-grad-bits", "4")
    assert acc == torch.bfloat16 and "int4" in wire and "int8" in wire
    acc, wire = _resolved("--grad-accum-dtype", "fp32", "--quantized-gradients",
                          "--hadamard-transform")
    assert acc == torch.float32 and "Hadamard" in wire
    acc, wire = _resolved("--grad-accum-dtype", "bf16")
    assert acc == torch.bfloat16 and "exact bf16" in wire


def test_bf16_accumulation_needs_bf16_params():
    with pytest.raises(ValueError, match="bf16 parameters"):
        _resolved("--grad-accum-dtype", "bf16", bf16=False, fp32_acc=False)


def test_apply_sets_ddp_config():
    from megatron.core.distributed import DistributedDataParallelConfig

    c = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    q = QuantizationConfig(grad_accum_dtype="bf16")
    assert apply_grad_accum_dtype(c, q, torch.bfloat16) == torch.bfloat16
    assert c.grad_reduce_in_fp32 is False
    c2 = DistributedDataParallelConfig(grad_reduce_in_fp32=False)
    assert apply_grad_accum_dtype(c2, QuantizationConfig(), torch.bfloat16) == torch.bfloat16
    assert c2.grad_reduce_in_fp32 is False  # unset flag: untouched


CASES = {
    # name: (quantization kwargs, expected accumulator dtype, expected grad wire bits/element)
    "bf16acc_4bit_wire": ({"grad_accum_dtype": "bf16", "quantized_gradients": True,
                           "data_parallel_intra_node_size": 1}, torch.bfloat16, 4 + 32 / 128),
    "fp32acc_4bit_wire": ({"grad_accum_dtype": "fp32", "quantized_gradients": True,
                           "data_parallel_intra_node_size": 1}, torch.float32, 4 + 32 / 128),
    "fp32acc_fp32_wire": ({"grad_accum_dtype": "fp32", "quantized_weights": True,
                           "wq_group_size": 128}, torch.float32, 32.0),
    "bf16acc_bf16_wire": ({"grad_accum_dtype": "bf16", "quantized_weights": True,
                           "wq_group_size": 128}, torch.bfloat16, 16.0),
}


def _scenarios(rank: int, world: int) -> Dict[str, Any]:
    from megatron.distributed.quant import integration

    res: Dict[str, Any] = {}
    for name, (qkw, _, _) in CASES.items():
        chunks, opt, _ = build(qkw, grad_reduce_in_fp32=True)
        ddp = chunks[0]
        ddp.zero_grad_buffer()
        forward_backward(ddp, rank, 0, micro_batches=2)  # accumulate 2 micro-batches in the buffer
        main_dtypes = {p.main_grad.dtype for p in ddp.module.parameters()}
        ddp.finish_grad_sync()
        ok, _, _ = opt.step()
        out = train(chunks, opt, rank, 1, start=1)
        rep = integration.communication_report(chunks)
        res[name] = {"buffer_dtypes": {b.grad_dtype for b in ddp.buffers}, "main_grad": main_dtypes,
                     "wire_bits": rep.get("grad_total_bits_per_element"),
                     "baseline_bits": rep.get("grad_total_baseline_bits_per_element"),
                     "ok": bool(ok) and out["oks"] == [True]}
    return res


@pytest.fixture(scope="module")
def results():
    return run_distributed(_scenarios, 2)


@pytest.mark.parametrize("name", list(CASES))
def test_accumulator_and_wire_checked_independently(results, name):
    _, acc, bits = CASES[name]
    for r in results:
        got = r[name]
        assert got["buffer_dtypes"] == {acc}
        assert got["main_grad"] == {acc}
        assert got["wire_bits"] == pytest.approx(bits)
        # the baseline (megatron-core's exact reduce-scatter) would send the accumulator dtype
        assert got["baseline_bits"] == pytest.approx(torch.finfo(acc).bits)
        assert got["ok"]
