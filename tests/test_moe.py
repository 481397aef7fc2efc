"""Mixture-of-Experts on the quantized path: megatron-core's MoE GPT on 4 CPU gloo ranks.

Why these tests: with expert parallelism megatron-core keeps expert parameters in buffers of
their own, reduced and gathered over the expert-data-parallel group; the quantized layer must
take those buffers over that group's own two levels, and leave every number megatron-core's
where quantization is off. Checked for EP 2 x DP 2 and EP 1 x DP 4: flags off is megatron-core's
DDP, bit-identical; the quantized DDP before its start iteration is bit-identical too (dense and
expert buffers fall back to megatron-core's collectives); SDP4Bit + LoCo with both overlaps keeps
every replica identical (expert weights over their expert-DP group), stays close to the exact
run, counts the expert bytes beside the dense ones and saves one state per runtime.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

import dist_harness
from test_integration_ddp import batch, param_vector, train

EXPERTS = 4
LAYOUTS = (2, 1)
"""Expert-parallel sizes run on the 4 ranks (EP 2 x expert-DP 2, EP 1 x DP 4)."""


def build_moe(ep: int, qkw: Dict[str, Any] = None, ddpkw: Dict[str, Any] = None, *,
              plain: bool = False):
    """Tiny bf16 MoE GPTModel (4 experts, top-2, alltoall) -> DDP -> distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module
    from megatron.distributed.mcore_compat.moe import install_moe_fixes
    from megatron.distributed.quant import integration
    from megatron.distributed.quant.config import QuantizationConfig

    install_moe_fixes(cpu=True)
    model_parallel_cuda_manual_seed(123)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                            use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16,
                            pipeline_dtype=torch.bfloat16, hidden_dropout=0.0,
                            attention_dropout=0.0, num_moe_experts=EXPERTS,
                            expert_model_parallel_size=ep, moe_router_topk=2,
                            moe_ffn_hidden_size=48, moe_aux_loss_coeff=0.01,
                            moe_token_dispatcher_type="alltoall", add_bias_linear=False)
    model = Float16Module(cfg, GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(
        num_experts=EXPERTS), vocab_size=128, max_sequence_length=16))
    ddpc = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                         **(ddpkw or {}))
    qc = QuantizationConfig(**(qkw or {}))
    qc.validate()
    optc = OptimizerConfig(optimizer="adam", lr=3e-3, bf16=True, use_distributed_optimizer=True)
    if plain:
        chunks = [DistributedDataParallel(cfg, ddpc, model)]
        return chunks, get_megatron_optimizer(optc, chunks)
    chunks = integration.wrap_model_with_ddp(cfg, ddpc, [model], qc)
    return chunks, integration.build_optimizer(optc, chunks, qc)


def _same_over(t: torch.Tensor, group: Any) -> bool:
    lst = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(lst, t.contiguous(), group=group)
    return all(torch.equal(lst[0], x) for x in lst[1:])


def _split_params(ddp) -> Dict[str, torch.Tensor]:
    """Dense and expert parameters (megatron-core's ``allreduce`` flag) as flat vectors."""
    dense = [p for p in ddp.module.parameters() if getattr(p, "allreduce", True)]
    expert = [p for p in ddp.module.parameters() if not getattr(p, "allreduce", True)]
    flat = lambda ps: (torch.cat([p.detach().float().reshape(-1) for p in ps])  # noqa: E731
                       if ps else torch.zeros(0))
    return {"dense": flat(dense), "expert": flat(expert)}


def scenarios(rank: int, world: int) -> Dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.distributed.quant import integration
    from megatron.distributed.quant.ddp import QuantizedDistributedDataParallel

    out: Dict[str, Any] = {}
    for ep in LAYOUTS:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
        res: Dict[str, Any] = {}
        chunks, opt = build_moe(ep, plain=True)
        base = train(chunks, opt, rank, 3)
        res["expert_buckets"] = len(chunks[0].expert_parallel_bucket_groups)

        # flags off: megatron-core's own DDP
        chunks, opt = build_moe(ep, {})
        off = train(chunks, opt, rank, 3)
        res["off_plain"] = type(chunks[0]) is DistributedDataParallel
        res["off_identical"] = (base["losses"] == off["losses"]
                                and torch.equal(base["params"], off["params"]))

        # the quantized DDP before its start iteration: every bucket on megatron-core's path
        chunks, opt = build_moe(ep, {"quantized_gradients": True, "quantized_weights": True,
                                     "gradients_quantization_start_iteration": 100,
                                     "data_parallel_intra_node_size": 2})
        res["late_type"] = type(chunks[0]) is QuantizedDistributedDataParallel
        res["late_expert_runtime"] = chunks[0].expert_quant_runtime is not None
        # quantized weights are on from the start: compare gradients only through the loss of
        # the first step (before any quantized gather reaches a forward)
        chunks, opt = build_moe(ep, {"quantized_gradients": True,
                                     "gradients_quantization_start_iteration": 100,
                                     "data_parallel_intra_node_size": 2})
        late = train(chunks, opt, rank, 3)
        res["late_identical"] = (base["losses"] == late["losses"]
                                 and torch.equal(base["params"], late["params"]))

        # SDP4Bit + LoCo with both overlaps, two "nodes" of 2 ranks
        sdp = {"quantized_gradients": True, "quantized_weights": True, "hadamard_transform": True,
               "loco": True, "data_parallel_intra_node_size": 2}
        chunks, opt = build_moe(ep, sdp, {"overlap_grad_reduce": True,
                                          "overlap_param_gather": True, "bucket_size": 4000})
        q = train(chunks, opt, rank, 3)
        ddp = chunks[0]
        parts = _split_params(ddp)
        res["q_oks"] = q["oks"]
        res["q_losses"], res["base_losses"] = q["losses"], base["losses"]
        res["q_dense_same"] = _same_over(parts["dense"], None)
        res["q_expert_same"] = _same_over(parts["expert"], ps.get_expert_data_parallel_group())
        rt = ddp.expert_quant_runtime
        res["q_expert_groups"] = None if rt is None else (
            rt.groups.dp_size, rt.groups.intra_size, rt.groups.inter_size, list(rt.groups.dp_ranks))
        res["q_expert_groups_converted"] = [
            type(bg).__name__ for bg in ddp.expert_parallel_bucket_groups]
        res["q_report"] = integration.communication_report(chunks, totals=True)
        state = integration.quantization_state_dict(chunks)
        res["q_state_runtimes"] = len(state.get("runtimes", []))
        res["q_state_keys"] = [sorted(sd["layout"]["buffers"]) for sd in state.get("runtimes", [])]
        res["q_rel_diff"] = (float((q["params"] - base["params"]).norm() / base["params"].norm()))
        out[f"ep{ep}"] = res
    return out


@pytest.fixture(scope="module")
def four() -> List[Dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out_dir:
        from test_integration_ddp import _in_cpu_mode

        return dist_harness.run_distributed(4, _in_cpu_mode, out_dir, scenarios)


@pytest.mark.parametrize("ep", LAYOUTS)
def test_quantization_off_is_megatron_core_bit_identical(four, ep):
    for r in four:
        res = r[f"ep{ep}"]
        assert res["expert_buckets"] == (1 if ep > 1 else 0)
        assert res["off_plain"] and res["off_identical"]
        assert res["late_type"] and res["late_identical"]
        assert res["late_expert_runtime"] == (ep > 1)


@pytest.mark.parametrize("ep", LAYOUTS)
def test_sdp4bit_loco_on_expert_buffers(four, ep):
    for rank, r in enumerate(four):
        res = r[f"ep{ep}"]
        assert res["q_oks"] == [True, True, True]
        assert res["q_dense_same"] and res["q_expert_same"]
        # 3 steps of 4-bit weights and gradients: the model stays within 5 % of the exact run
        assert res["q_rel_diff"] < 0.05, res["q_rel_diff"]
        for a, b in zip(res["q_losses"], res["base_losses"]):
            assert a == pytest.approx(b, rel=0.02)
        report = res["q_report"]
        assert report["grad_inter_bytes"] > 0 and report["weight_inter_bytes"] > 0
        if ep == 1:  # experts are dense parameters: one runtime, no expert fields
            assert res["q_expert_groups"] is None and res["q_state_runtimes"] == 1
            assert not any(k.startswith("expert_") for k in report)
            continue
        # expert-DP groups {0, 2} and {1, 3}: one rank on each "node" of 2 -> all inter-node
        assert res["q_expert_groups"] == (2, 1, 2, [rank % 2, rank % 2 + 2])
        converted = res["q_expert_groups_converted"]
        assert len(converted) >= 2 and set(converted) == {"QuantizedBucketGroup"}, converted
        assert report["expert_grad_inter_bits_per_element"] == pytest.approx(4.25, abs=0.1)
        assert report["expert_weight_inter_bits_per_element"] == pytest.approx(4.0, abs=0.1)
        assert report.get("expert_grad_intra_bytes", 0.0) == 0.0
        assert res["q_state_runtimes"] == 2
        assert all(k.startswith("chunk0/expert/") for k in res["q_state_keys"][1])


# ------------------------------------------------------------------------------------------------
# flags and layout rules (no process group)
# ------------------------------------------------------------------------------------------------

def _parse(extra: List[str], world: int = 4) -> argparse.Namespace:
    import os

    from megatron.training.arguments.parser import build_parser
    from megatron.training.arguments.validation import validate_args

    args = build_parser().parse_args(
        ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
         "--mock-data", "--vocab-size", "128", "--device", "cpu"] + extra)
    env = dict(os.environ)
    os.environ.update(WORLD_SIZE=str(world), RANK="0")
    try:
        return validate_args(args)
    finally:
        os.environ.clear()
        os.environ.update(env)


def test_moe_flags_reach_transformer_config():
    from megatron.training.model.config_builders import build_transformer_config

    args = _parse(["--num-experts", "8", "--expert-model-parallel-size", "4", "--moe-router-topk",
                   "2", "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
                   "--moe-layer-freq", "([0]*1+[1]*1)", "--ffn-hidden-size", "96"])
    cfg = build_transformer_config(args)
    assert (cfg.num_moe_experts, cfg.expert_model_parallel_size, cfg.moe_router_topk) == (8, 4, 2)
    assert cfg.moe_ffn_hidden_size == 96 and cfg.moe_layer_freq == [0, 1]
    assert cfg.moe_token_dispatcher_type == "alltoall" and cfg.moe_aux_loss_coeff == 1e-2


@pytest.mark.parametrize("extra,message", [
    (["--num-experts", "6", "--expert-model-parallel-size", "4"],
     "--num-experts 6 is not divisible by --expert-model-parallel-size 4"),
    (["--num-experts", "8", "--expert-model-parallel-size", "8"],
     "--expert-model-parallel-size 8 does not divide the data-parallel size 4"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 needs --num-experts"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk 5 must be in [1,"),
    (["--num-experts", "4", "--moe-grouped-gemm"], "--moe-grouped-gemm needs CUDA"),
    (["--num-experts", "4", "--moe-layer-freq", "[1,1,1]"], "--moe-layer-freq lists 3 layers"),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "2"],
     "--expert-tensor-parallel-size 2: only --tensor-model-parallel-size"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel",
      "--moe-token-dispatcher-type", "alltoall"], "use --moe-token-dispatcher-type allgather"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"], "needs --sequence-parallel"),
    (["--num-experts", "4", "--moe-shared-expert-intermediate-size", "32"],
     "--moe-shared-expert-intermediate-size needs --disable-bias-linear"),
    (["--num-experts", "4", "--paro-strategy", "GGG", "--use-distributed-optimizer"],
     "does not shard expert parameters"),
])
def test_bad_moe_flags_are_refused_naming_the_flag(extra, message):
    from megatron.training.arguments.validation import ArgumentError

    with pytest.raises(ArgumentError, match=None) as info:
        _parse(extra)
    assert message in str(info.value), str(info.value)


def test_moe_layer_freq_is_parsed_not_evaluated():
    from megatron.training.arguments.moe import moe_layer_freq

    assert moe_layer_freq("2") == 2
    assert moe_layer_freq("([0]*1+[1]*3)") == [0, 1, 1, 1]
    assert moe_layer_freq("[1,0]*2") == [1, 0, 1, 0]
    for bad in ("__import__('os')", "[2]", "0", "[1]*'a'"):
        with pytest.raises(argparse.ArgumentTypeError):
            moe_layer_freq(bad)


@pytest.mark.parametrize("d,ep,expected", [(8, 8, 1), (8, 2, 4), (8, 1, 8), (4, 8, 1), (2, 2, 1)])
def test_expert_ranks_per_node(d, ep, expected):
    """The expert-DP group is every EP-th DP rank; its ranks per node follow the dense nodes."""
    from megatron.distributed.quant.topology import TwoLevelGroups, expert_intra_node_size

    p = 16
    dense = TwoLevelGroups(dp_group=None, intra_group=None, inter_group=None, dp_size=p,
                           dp_rank=0, intra_size=d, inter_size=p // d, node=0, local=0,
                           dp_ranks=list(range(p)))
    assert expert_intra_node_size(dense, list(range(0, p, ep))) == expected


def test_uneven_expert_layout_is_refused():
    from megatron.distributed.quant.topology import TwoLevelGroups, expert_intra_node_size

    dense = TwoLevelGroups(dp_group=None, intra_group=None, inter_group=None, dp_size=12,
                           dp_rank=0, intra_size=4, inter_size=3, node=0, local=0,
                           dp_ranks=list(range(12)))
    with pytest.raises(ValueError, match="spreads unevenly"):
        expert_intra_node_size(dense, [0, 3, 6, 9])  # EP 3 on nodes of 4


def test_moe_flops_count_what_a_token_runs():
    """Top-1 of experts as wide as the dense MLP = the dense model + the router (h x E per MoE
    layer and token); top-2 adds one expert MLP per MoE layer; --moe-layer-freq 2 halves it."""
    from megatron.training.model.flops import moe_layer_indices, training_flops_per_iteration

    a = argparse.Namespace(hidden_size=64, seq_length=32, num_layers=4, num_attention_heads=4,
                           ffn_hidden_size=128, swiglu=True, padded_vocab_size=128,
                           global_batch_size=8, num_experts=None)
    dense = training_flops_per_iteration(a)
    tokens_x6 = 6 * 8 * 32
    moe = argparse.Namespace(**vars(a), moe_router_topk=1, moe_ffn_hidden_size=128,
                             moe_layer_freq=1, moe_shared_expert_intermediate_size=None)
    moe.num_experts = 4
    assert training_flops_per_iteration(moe) - dense == 4 * 64 * 4 * tokens_x6
    moe.moe_router_topk = 2
    assert training_flops_per_iteration(moe) - dense == 4 * (64 * 4 + 3 * 64 * 128) * tokens_x6
    moe.moe_layer_freq = 2
    assert moe_layer_indices(moe) == [0, 2]
    assert training_flops_per_iteration(moe) - dense == 2 * (64 * 4 + 3 * 64 * 128) * tokens_x6
    moe.moe_layer_freq = [0, 1, 1, 1]
    assert moe_layer_indices(moe) == [1, 2, 3]


@pytest.mark.parametrize("balancing,z_loss,names", [
    ("aux_loss", None, ["load_balancing_loss"]),
    ("seq_aux_loss", None, ["seq_load_balancing_loss"]),
    ("global_aux_loss", 1e-3, ["global_load_balancing_loss", "z_loss"]),
    ("sinkhorn", None, []), ("none", 1e-3, ["z_loss"])])
def test_logged_moe_losses_are_the_names_megatron_cores_router_records(balancing, z_loss, names):
    """Each load-balancing type's loss is tracked under the name the router saves it as (a wrong
    name logs zeros and the real loss unreduced)."""
    import inspect

    from megatron.core.transformer.moe import router
    from megatron.training.log import moe_loss_names

    args = argparse.Namespace(num_experts=4, moe_router_load_balancing_type=balancing,
                              moe_z_loss_coeff=z_loss)
    assert moe_loss_names(args) == names
    source = inspect.getsource(router)
    assert all(f'"{name}"' in source for name in names)
    assert moe_loss_names(argparse.Namespace(num_experts=None)) == []
