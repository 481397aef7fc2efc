"""bench/quant_error_study.py: the virtual M x D world gives exactly what real ranks give.

Why: the study's numbers (docs/results.md, "Quantization error vs nodes") are only worth
something if replaying the product's collectives on P threads with an in-process transport
(bench/virtual_world.py) is the same computation as P real processes. At 2 x 2 the same
per-rank program -- the call sequence of ddp.py's bucket groups on a ``QuantizationRuntime`` --
runs once on 4 gloo ranks and once on 4 virtual ranks, with the same seeds and inputs; outputs,
stochastic-rounding generator states, LoCo buffers and qWD replicas must be bit-identical, over
3 steps of TLq-HS + LoCo and of qWD. Then checks that the study's measurement can fail: 2-bit
inter-node codes must cost clearly more error than 4-bit, and the per-hop split must add up.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from dist_harness import run_distributed  # noqa: E402
from megatron.distributed.quant.config import QuantizationConfig  # noqa: E402
from megatron.distributed.quant.runtime import QuantizationRuntime  # noqa: E402
from megatron.distributed.quant.topology import build_two_level_groups  # noqa: E402
from quant_error_study import (KEY, INDEX, VirtualCluster, hop_errors, rel_cos,  # noqa: E402
                               reduce_scatter_step, weight_gather_step)

M, D, STEPS = 2, 2, 3
P = M * D
N = 4 * 8192            # a multiple of P * lcm(512, 128) and of P * 2048 (qWD groups)
GRAD_CFG = QuantizationConfig(quantized_gradients=True, hadamard_transform=True, loco=True,
                              data_parallel_intra_node_size=D, seed=77)
WEIGHT_CFG = QuantizationConfig(quantized_weights=True, data_parallel_intra_node_size=D, seed=78)


def _gradient(step: int, rank: int) -> torch.Tensor:
    """Heavy-tailed, rank- and step-dependent: groups with outliers, like real gradients."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    shared = torch.randn(N, generator=torch.Generator().manual_seed(step))
    own = torch.randn(N, generator=g) * torch.exp(torch.randn(N, generator=g))
    return (shared + own) * 1e-3


def _master(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5000 + step)
    base = torch.randn(N, generator=torch.Generator().manual_seed(4999)) * 0.02
    return base + 1e-3 * step * torch.randn(N, generator=g)


def _program(rank: int, grad_rt: QuantizationRuntime,
             weight_rt: QuantizationRuntime) -> Dict[str, Any]:
    """What one rank does, identical on the real and the virtual path."""
    res: Dict[str, Any] = {"out": [], "params": []}
    params = _master(0).to(torch.bfloat16)
    for step in range(STEPS):
        bucket = _gradient(step, rank).mul_(1.0 / P)   # megatron-core's 1/P pre-scaling
        res["out"].append(reduce_scatter_step(grad_rt, bucket, step))
        weight_gather_step(weight_rt, params, _master(step + 1), step)
        res["params"].append(params.clone())
    res["generators"] = {f"{name}:{k}": g.get_state()
                         for name, rt in (("grad", grad_rt), ("weight", weight_rt))
                         for k, g in rt.generators.items()}
    res["loco"] = grad_rt.loco.state_dict()
    return res


def _gloo_rank(rank: int, world: int) -> Dict[str, Any]:
    groups = build_two_level_groups(list(range(world)), D)
    rts = []
    for cfg in (GRAD_CFG, WEIGHT_CFG):
        rt = QuantizationRuntime(cfg, groups)
        rt.register(KEY, INDEX)
        rts.append(rt)
    return _program(rank, *rts)


def _equal(a: Any, b: Any) -> bool:
    """Recursive bit equality of tensors / containers / dataclass-like state."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dict__"):
        return type(a) is type(b) and _equal(vars(a), vars(b))
    return a == b


def test_virtual_2x2_is_bit_identical_to_gloo(tmp_path):
    real = run_distributed(P, _gloo_rank, tmp_path)
    grad, weight = VirtualCluster(M, D, GRAD_CFG), VirtualCluster(M, D, WEIGHT_CFG)
    virtual = grad.run(lambda r: _program(r, grad.runtimes[r], weight.runtimes[r]))
    for r in range(P):
        for what in ("out", "params", "generators", "loco"):
            assert _equal(real[r][what], virtual[r][what]), f"rank {r}: {what} differ"
    # not trivially equal: the rounding streams moved and the result is quantized
    full = torch.cat([virtual[r]["out"][-1] for r in range(P)])
    exact = sum(_gradient(STEPS - 1, r) for r in range(P)) / P
    assert 0 < rel_cos(full, exact)[0] < 0.5
    assert not _equal(real[0]["out"][0], real[0]["out"][1])


def _errors(cfg: QuantizationConfig, grads: List[torch.Tensor]) -> Dict[str, float]:
    cl = VirtualCluster(M, D, cfg)
    ref = torch.stack(grads).double().mean(0)
    out, hop1 = cl.reduce_scatter(grads, 0, observe_hop1=True)
    rel, _ = rel_cos(out, ref)
    return dict(hop_errors(cl, grads, out, hop1, ref), e2e_rel=rel)


def test_error_grows_with_fewer_bits_and_hops_add_up():
    grads = [_gradient(0, r) for r in range(P)]
    base = QuantizationConfig(quantized_gradients=True, hadamard_transform=True)
    e4 = _errors(base, grads)
    e2 = _errors(replace(base, gradient_quantization_bits_inter=2), grads)
    e8 = _errors(replace(base, gradient_quantization_bits_inter=8), grads)
    assert e2["e2e_rel"] > 2 * e4["e2e_rel"] > 2 * 2 * e8["e2e_rel"] > 0
    # the intra hop (8-bit in all three) is unchanged by the inter bits
    assert e2["hop1_rel"] == pytest.approx(e4["hop1_rel"]) == pytest.approx(e8["hop1_rel"])
    for e in (e2, e4, e8):   # independent hop errors: squares (nearly) add up
        split = e["hop1_out_rel"] ** 2 + e["hop2_rel"] ** 2
        assert e["e2e_rel"] ** 2 == pytest.approx(split, rel=0.1)


def test_report_keeps_the_rest_of_results_md(tmp_path):
    """The generated block replaces itself only; the hand-written text around it stays."""
    import argparse

    from quant_study_report import BEGIN, END, SECTION, write_outputs

    grid = [dict(step=0, config=c, M=m, D=d, e2e_rel=0.01 * m * d, e2e_cos=0.99,
                 **({"hop1_rel": 0.01, "hop2_rel": 0.02} if m > 1 and d > 1 else {}))
            for c in ("TLq", "TLq-HS", "TLq 4-bit intra", "TLq-HS 2-bit inter", "TLq-HS 8-bit inter")
            for m in (1, 2) for d in (1, 2)]
    series = [dict(step=s, kind="grad", config="TLq-HS", M=2, D=2, rel=0.1, cos=0.99,
                   cum_rel=0.1 / (s + 1)) for s in range(3)]
    series += [dict(step=s, kind="weight", config="qWD", M=2, D=2, rel=1e-3, cos=1.0,
                    rel_to_update=0.1, update_cos=0.98) for s in range(3)]
    md = tmp_path / "results.md"
    md.write_text("# Results\n\nintro\n\n## Other\n\nkept\n")
    args = argparse.Namespace(out=str(tmp_path / "out"), img=str(tmp_path / "img"),
                              results_md=str(md), steps=3, grid_steps=1)
    for _ in range(2):   # the second run replaces the block written by the first
        write_outputs(dict(grid=grid, series=series, params=10, seconds=1.0, gradient_seconds=0.5,
                           command="python bench/quant_error_study.py"), args)
        text = md.read_text()
        assert text.count(SECTION) == text.count(BEGIN) == text.count(END) == 1
        assert "intro" in text and "## Other\n\nkept" in text and "| 2×2 | 4 |" in text
    assert len(list((tmp_path / "img").glob("*.png"))) == 3
