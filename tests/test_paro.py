"""PaRO: strategy parsing, memory / communication model, auto choice, PaRO-CC all-reduce.

Why these tests: the strategy grid and its validity rule are easy to get subtly wrong (the spec
derives 14 of 27 combinations; paro.strategy), the cost model is what ``--paro-strategy auto``
will trust (paro.cost), and the hierarchical all-reduce the engine uses for NNN must give exactly
the flat all-reduce's result while sending what the model says (paro.comm). The distributed
checks run once, on 4 gloo ranks laid out as 2 groups x 2, then 1 x 4 and 4 x 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.distributed.quant import arguments as quant_args
from megatron.distributed.quant.paro import comm as paro_comm
from megatron.distributed.quant.paro import cost as paro_cost
from megatron.distributed.quant.paro import strategy as paro_strategy
from megatron.distributed.quant.config import QuantizationConfig
from megatron.distributed.quant.paro.cost import (StateBytes, choose_strategy_auto,
                                                  communication_volume, model_state_memory)
from megatron.distributed.quant.paro.strategy import (PaRoStrategy, parse_paro_strategy,
                                                      resolve_group_size, uses_engine)
from dist_harness import free_port, init_process_group, shutdown_process_group

SPEC_VALID = ["NNN", "NNI", "NII", "INI", "III", "NNG", "NIG", "NGG", "ING", "IIG", "IGG", "GNG",
              "GIG", "GGG"]

# Spec §3 pattern table: (collective label, phase) per strategy.
M, B, S = "param_gather", "grad_sync", "param_sync"
SPEC_PATTERN = {
    "NNN": [("global AR(g)", B)],
    "NNI": [("intra RS(g)", B), ("inter AR(g)", B), ("intra AG(p')", S)],
    "NII": [("intra RS(g)", "grad_micro"), ("inter AR(g)", B), ("intra AG(p')", S)],
    "INI": [("intra AG(p)x2", M), ("intra RS(g)", B), ("inter AR(g)", B)],
    "III": [("intra AG(p)x2", M), ("intra RS(g)", "grad_micro"), ("inter AR(g)", B)],
    "NNG": [("global RS(g)", B), ("global AG(p')", S)],
    "NIG": [("intra RS(g)", "grad_micro"), ("inter RS(g)", B), ("global AG(p')", S)],
    "NGG": [("global RS(g)", "grad_micro"), ("global AG(p')", S)],
    "ING": [("intra AG(p)x2", M), ("global RS(g)", B), ("inter AG(p')", S)],
    "IIG": [("intra AG(p)x2", M), ("intra RS(g)", "grad_micro"), ("inter RS(g)", B),
            ("inter AG(p')", S)],
    "IGG": [("intra AG(p)x2", M), ("global RS(g)", "grad_micro"), ("inter AG(p')", S)],
    "GNG": [("global AG(p)x2", M), ("global RS(g)", B)],
    "GIG": [("global AG(p)x2", M), ("intra RS(g)", "grad_micro"), ("inter RS(g)", B)],
    "GGG": [("global AG(p)x2", M), ("global RS(g)", "grad_micro")],
}


# ------------------------------------------------------------------------------------------------
# parsing
# ------------------------------------------------------------------------------------------------

def test_exactly_the_spec_strategies_are_valid():
    assert list(paro_strategy.VALID_STRATEGIES) == SPEC_VALID
    for name in SPEC_VALID:
        assert PaRoStrategy.from_string(name).name == name
    letters = "NIG"
    rejected = [a + b + c for a in letters for b in letters for c in letters if a + b + c not in SPEC_VALID]
    assert len(rejected) == 13
    for name in rejected:
        with pytest.raises(ValueError, match="less finely than"):
            PaRoStrategy.from_string(name)


@pytest.mark.parametrize("text,expected", [
    ("nig", "NIG"), (" PIIG ", "IIG"), ("zero-1", "NNG"), ("ZeRO2", "NGG"), ("zero3", "GGG"),
    ("ddp", "NNN"), ("MiCS", "III"), ("ING", "ING"),
])
def test_aliases_case_and_prefix(text, expected):
    assert parse_paro_strategy(text).name == expected


def test_auto_and_known_names():
    assert parse_paro_strategy("AUTO") == paro_strategy.AUTO
    with pytest.raises(ValueError, match="choose_strategy_auto"):
        PaRoStrategy.from_string("auto")
    assert PaRoStrategy.from_string("NNG").known_as == "ZeRO-1"
    assert PaRoStrategy.from_string("NIG").known_as is None


def test_which_strategies_use_the_engine():
    """NNN / NNG (any spelling) stay on megatron-core; every other strategy, and 'auto' (it may
    pick one), train on the PaRO engine; no strategy or an invalid one does not."""
    assert [s for s in SPEC_VALID if not uses_engine(s)] == ["NNN", "NNG"]
    assert not uses_engine("zero1") and not uses_engine("ddp") and uses_engine("nig")
    assert uses_engine("auto") and uses_engine("AUTO")
    assert not uses_engine(None) and not uses_engine("GNI")


@pytest.mark.parametrize("text,pattern", [
    ("GNI", r"optimizer states \(I\) are partitioned less finely than parameters \(G\).*use GNG"),
    ("NGI", r"less finely than gradients \(G\).*use NGG"),
    ("IGN", r"than parameters \(I\).*than gradients \(G\)"),  # both reasons reported
    ("NXG", r"unknown partition level 'X' for gradients"),
    ("NIGG", r"must be three letters"),
    ("", r"must be three letters"),
])
def test_rejections_say_why(text, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_paro_strategy(text)


def test_group_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert resolve_group_size(16) == 8
    assert resolve_group_size(16, tensor_model_parallel_size=2) == 4
    assert resolve_group_size(4) == 4  # one partially filled node: the group is the whole world
    assert resolve_group_size(16, 2) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert resolve_group_size(6) == 6
    with pytest.raises(ValueError, match="does not divide the data-parallel world size 12"):
        resolve_group_size(12, 8)
    with pytest.raises(ValueError, match="positive"):
        resolve_group_size(8, 0)
    with pytest.raises(ValueError, match="does not divide"):
        model_state_memory("NIG", 1e9, 12, 8)


def test_add_paro_args():
    parser = quant_args.add_paro_args(argparse.ArgumentParser())
    args = parser.parse_args(["--paro-strategy", "nig", "--paro-group-size", "4"])
    assert parse_paro_strategy(args.paro_strategy).name == "NIG"
    assert args.paro_group_size == 4
    defaults = parser.parse_args([])
    assert defaults.paro_strategy is None and defaults.paro_group_size is None


def test_integration_is_a_no_op_for_megatron_core_chunks():
    """The trainer's checkpoint and report hooks leave a module that is not a PaRO engine alone."""
    from megatron.distributed.quant import integration

    chunk = torch.nn.Linear(2, 2)
    with integration.full_model_params([chunk], writeback=True) as gathered:
        assert gathered is False
    assert integration.communication_report([chunk]) == {}
    assert integration.communication_report([chunk], totals=True) == {}
    assert integration.uses_sharded_engine("NIG") and not integration.uses_sharded_engine("zero1")


# ------------------------------------------------------------------------------------------------
# memory and communication model
# ------------------------------------------------------------------------------------------------

def test_memory_matches_zero_paper():
    """ZeRO paper Fig. 1: Ψ = 7.5B, N = 64, K = 12, 2 + 2 bytes: 120 / 31.4 / 16.6 / 1.9 GB."""
    gb = {z: round(model_state_memory(z, 7.5e9, 64, 8).total / 1e9, 1)
          for z in ("ddp", "zero-1", "zero-2", "zero-3")}
    assert gb == {"ddp": 120.0, "zero-1": 31.4, "zero-2": 16.6, "zero-3": 1.9}
    # I partitions among the m = 8 ranks of a group only.
    mem = model_state_memory("NIG", 7.5e9, 64, 8)
    assert (mem.params, mem.grads, mem.optimizer_states) == (15e9, 15e9 / 8, 90e9 / 64)
    mem = model_state_memory("IIG", 7.5e9, 64, 8)
    assert (mem.params, mem.grads, mem.optimizer_states) == (15e9 / 8, 15e9 / 8, 90e9 / 64)


def test_memory_partial_training_and_fp32_grads():
    # Ψ' = Ψ/16: frozen parameters keep the 2Ψ term, only Ψ' has gradients and optimizer state.
    mem = model_state_memory("ING", 16e9, 16, 8, trainable_params=1e9,
                             state_bytes=StateBytes(grad=4))
    assert (mem.params, mem.grads, mem.optimizer_states) == (32e9 / 8, 4e9, 12e9 / 16)


def test_pattern_matches_spec_table():
    for name, expected in SPEC_PATTERN.items():
        got = [(c.label, c.phase) for c in paro_cost.strategy_collectives(name)]
        assert got == expected, name


def test_nig_communication_closed_form():
    """NIG, n = 16, m = 8, Ψ = 1.3B, A = 4, 2-byte states (spec §3 formulas by hand)."""
    psi, n, m, a = 1.3e9, 16, 8, 4
    g = n // m
    v = communication_volume("NIG", psi, n, m, micro_steps=a)
    micro_rs = (m - 1) / m * 2 * psi                      # intra RS(g) every micro-step
    boundary_rs = (g - 1) / g * 2 * psi / m                # inter RS of the 1/m slice
    ag_intra, ag_inter = (m - 1) / m * 2 * psi, (g - 1) / n * 2 * psi  # hierarchical global AG
    assert v.micro_intra == pytest.approx(micro_rs) and v.micro_inter == 0
    assert v.intra == pytest.approx(a * micro_rs + ag_intra)
    assert v.inter == pytest.approx(boundary_rs + ag_inter)
    # Partial redundancy: no inter-group traffic during micro-steps, and it does not grow with A,
    # unlike ZeRO-2 (global RS every micro-step).
    z2 = communication_volume("NGG", psi, n, m, micro_steps=a)
    assert z2.micro_inter > 0 and z2.inter > v.inter
    assert communication_volume("NIG", psi, n, m, micro_steps=1).inter == pytest.approx(v.inter)


def test_single_group_has_no_inter_traffic():
    for name in SPEC_VALID:
        assert communication_volume(name, 1e9, 8, 8, micro_steps=2).inter == 0


def test_quantized_wire_bits():
    psi, n, m = 1.6e9, 16, 8
    g = n // m
    q = QuantizationConfig(quantized_gradients=True, quantized_weights=True)
    v = communication_volume("NIG", psi, n, m, quant_config=q)
    bits = {r["collective"]: r for r in v.rows}
    intra_b, inter_b, w_b = (8 + 32 / 512) / 8, (4 + 32 / 128) / 8, (4 + 32 / 2048) / 8
    assert bits["intra RS(g)"]["intra"] == pytest.approx((m - 1) / m * psi * intra_b)
    assert bits["inter RS(g)"]["inter"] == pytest.approx((g - 1) / g * psi / m * inter_b)
    assert bits["global AG(p')"]["inter"] == pytest.approx((g - 1) / n * psi * w_b)
    # qWD ('diff') quantizes only the post-step sync; 'direct' (qwZ) also the micro-step gathers.
    diff = communication_volume("IIG", psi, n, m, quant_config=q).rows[0]
    q = dataclasses.replace(q, weight_quantization_mode="direct")
    direct = communication_volume("IIG", psi, n, m, quant_config=q).rows[0]
    assert diff["collective"] == "intra AG(p)x2"
    assert diff["intra"] == pytest.approx(2 * (m - 1) / m * psi * 2)
    assert direct["intra"] == pytest.approx(2 * (m - 1) / m * psi * w_b)


def test_report_and_format():
    rep = paro_cost.paro_report("IIG", 1.3e9, 16, 8, micro_steps=4, gpu_memory_bytes=2e9,
                           intra_bandwidth=150e9, inter_bandwidth=12.5e9)
    assert rep["num_groups"] == 2 and rep["fits"] is True
    assert rep["memory"]["total"] == pytest.approx(2 * 1.3e9 / 8 * 2 + 12 * 1.3e9 / 16)
    tot = rep["comm"]["per_step_total"]
    assert rep["comm_time_s"] == pytest.approx(tot["intra"] / 150e9 + tot["inter"] / 12.5e9)
    text = paro_cost.format_report(rep)
    for needle in ("PaRO strategy IIG", "intra AG(p)x2", "inter AG(p')", "fits", "total per step"):
        assert needle in text
    small = paro_cost.paro_report("NNN", 1.3e9, 16, 8, gpu_memory_bytes=2e9)
    assert small["fits"] is False and "DOES NOT FIT" in paro_cost.format_report(small)


# ------------------------------------------------------------------------------------------------
# auto choice
# ------------------------------------------------------------------------------------------------

AUTO_KW = dict(num_params=1.3e9, world_size=16, group_size=8, micro_steps=4)


def test_auto_fits_and_follows_bandwidth_skew():
    cap = 3.8e9  # excludes NIG / ING (3.9 GB) and everything heavier
    balanced = choose_strategy_auto(gpu_memory_bytes=cap, intra_bandwidth=100e9,
                                    inter_bandwidth=100e9, **AUTO_KW)
    skewed = choose_strategy_auto(gpu_memory_bytes=cap, intra_bandwidth=300e9,
                                  inter_bandwidth=5e9, **AUTO_KW)
    for choice in (balanced, skewed):
        assert choice.report["memory"]["total"] <= cap
        fitting = [r for r in choice.candidates if r["fits"]]
        assert choice.report["comm_time_s"] == min(r["comm_time_s"] for r in fitting)
        assert "NIG" in choice.explanation.split("Do not fit:")[1]
    # Equal links: ZeRO-2 moves the fewest bytes. Slow inter links: keep micro-step traffic inside
    # the group; IIG ties III on time and wins on memory.
    assert balanced.strategy.name == "NGG"
    assert skewed.strategy.name == "IIG"
    assert "Tied on time with III" in skewed.explanation


def test_auto_prefers_partial_redundancy_with_room():
    choice = choose_strategy_auto(gpu_memory_bytes=4.0e9, intra_bandwidth=300e9,
                                  inter_bandwidth=5e9, **AUTO_KW)
    assert choice.strategy.name == "NIG"  # NIG beats NGG once both fit and inter links are slow


def test_auto_nothing_fits():
    with pytest.raises(ValueError, match="no PaRO strategy fits: the smallest, GGG"):
        choose_strategy_auto(gpu_memory_bytes=10e9, reserved_bytes=9e9, intra_bandwidth=1e11,
                             inter_bandwidth=1e10, **AUTO_KW)


# ------------------------------------------------------------------------------------------------
# PaRO-CC all-reduce on 4 gloo ranks (2 groups x 2, one group of 4, 4 groups of 1)
# ------------------------------------------------------------------------------------------------

def _check_collectives(groups, rank: int, world: int) -> None:
    intra, inter = groups.intra_group, groups.inter_group
    m = 1 if intra is None else dist.get_world_size(intra)
    g = world // m
    gen = torch.Generator().manual_seed(100 + rank)

    # all-reduce: odd size (padding) and a non-contiguous 2-D view.
    x = torch.randint(-1000, 1000, (1001,), generator=gen).float()
    ref = x.clone()
    dist.all_reduce(ref)
    counter = paro_comm.CommCounter()
    out = paro_comm.hierarchical_all_reduce(x, intra, inter, counter=counter)
    assert out is x and torch.equal(x, ref)
    padded = -(-1001 // m) * m
    expect = communication_volume("NNN", padded, world, m, state_bytes=StateBytes(grad=4))
    assert counter.bytes == {"intra": expect.intra, "inter": expect.inter}
    if m > 1 and g > 1:
        assert counter.calls == [("intra", "reduce_scatter", padded, m),
                                 ("inter", "all_reduce", padded // m, g),
                                 ("intra", "all_gather", padded, m)]
    y = torch.randint(-9, 9, (6, 10), generator=gen).float().t()
    ref = y.clone()
    dist.all_reduce(ref)
    paro_comm.hierarchical_all_reduce(y, intra, inter)
    assert torch.equal(y, ref)


def _worker(rank: int, world: int, port: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    init_process_group(rank, world, port)
    healthy = False
    try:
        for m in (2, 4, 1):  # 2 x 2, then one group of 4, then 4 groups of 1
            groups = paro_comm.build_paro_groups(m)
            assert groups.intra_size == m and groups.local == rank % m
            _check_collectives(groups, rank, world)
        with pytest.raises(ValueError, match="does not divide"):
            paro_comm.build_paro_groups(3)
        healthy = True
    finally:
        shutdown_process_group(healthy)


def test_hierarchical_all_reduce_on_four_ranks():
    mp.spawn(_worker, args=(4, free_port()), nprocs=4, join=True)
