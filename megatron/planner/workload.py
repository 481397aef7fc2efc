"""What one training iteration of a run is, from its ``pretrain_gpt.py`` flags and the cluster.

Why from the flags: the user plans the run they will launch, so the planner reads the trainer's
argument parser and FLOPs count. This module decides the layout: the data-parallel grid, the
micro-batches, the parameters each rank holds and megatron-core's buckets.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

from megatron.training.model.flops import moe_layer_indices, training_flops_per_iteration

from .cluster import Cluster

__all__ = ["Workload", "DPGroup", "ParameterCount", "count_parameters", "parameter_counts",
           "moe_layer_pattern", "set_padded_vocab_size",
           "set_default_ffn_hidden_size",
           "GPT2_VOCAB"]

GPT2_VOCAB = 50257
"""GPT2BPETokenizer's vocabulary, used when the run gives no ``--vocab-size``."""


def set_padded_vocab_size(args: argparse.Namespace) -> None:
    """``args.padded_vocab_size`` from ``--vocab-size`` (GPT-2's without one), as the trainer pads
    it, unless already set (the trainer sets it from its tokenizer)."""
    if getattr(args, "padded_vocab_size", None) is None:
        from megatron.training.arguments.parser import padded_vocab_size

        args.padded_vocab_size = padded_vocab_size(args.vocab_size or GPT2_VOCAB, args)


def set_default_ffn_hidden_size(args: argparse.Namespace) -> None:
    """``args.ffn_hidden_size`` as the trainer's validation defaults it (4 x hidden, or 8/3 x
    hidden rounded to 64 with ``--swiglu``) when the flags give none."""
    if getattr(args, "ffn_hidden_size", None) is None:
        from megatron.training.arguments.validation import default_ffn_hidden_size

        default_ffn_hidden_size(args)


def moe_layer_pattern(args: argparse.Namespace) -> List[bool]:
    """Which layers are MoE layers (:func:`megatron.training.model.flops.moe_layer_indices`:
    none without ``--num-experts``, ``--moe-layer-freq`` as megatron-core reads it)."""
    moe = set(moe_layer_indices(args))
    return [i in moe for i in range(args.num_layers)]


@dataclass(frozen=True)
class ParameterCount:
    """A model's parameters split as megatron-core's DDP splits its buffers."""

    dense: int
    """Everything but the routed experts: embeddings, attention, norms, dense MLPs, routers,
    shared experts (megatron-core's dense buffers)."""
    expert: int
    """The routed experts of every MoE layer, all of them (with ``--expert-model-parallel-size``
    > 1 megatron-core's expert buffers, reduced over the expert-data-parallel group)."""
    active: int
    """What one token's forward pass multiplies with: the dense part and the top-k experts of
    each MoE layer (``--moe-router-topk``)."""

    @property
    def total(self) -> int:
        return self.dense + self.expert


def parameter_counts(args: argparse.Namespace) -> ParameterCount:
    """Parameters of megatron-core's GPT model for these flags (tied output layer unless
    ``--untie-embeddings-and-output-weights``), dense / routed-expert / active;
    tests/test_planner.py checks them against the trainer's counts and megatron-core's MoE
    model. An MoE layer (:func:`moe_layer_pattern`) has a router (h x E, + E bias with linear
    biases), E experts, each the (gated with ``--swiglu``) MLP of ``--moe-ffn-hidden-size``
    (default ``--ffn-hidden-size``), and with ``--moe-shared-expert-intermediate-size`` a shared
    expert MLP of that width (bias-free, as megatron-core requires; + h for
    ``--moe-shared-expert-gate``)."""
    h, layers = args.hidden_size, args.num_layers
    heads = args.num_attention_heads
    head = args.kv_channels if getattr(args, "kv_channels", None) else h // heads
    q = head * heads
    kv = head * (args.num_query_groups if getattr(args, "group_query_attention", False) else heads)
    f = args.ffn_hidden_size or 4 * h
    # the parser keeps --disable-bias-linear as add_bias_linear (a namespace built by hand may
    # carry disable_bias_linear)
    bias = bool(getattr(args, "add_bias_linear", not getattr(args, "disable_bias_linear", False)))
    norm = 2 * h if getattr(args, "normalization", "LayerNorm") == "LayerNorm" else h
    gated = bool(getattr(args, "swiglu", False))

    def mlp(width: int, with_bias: bool = bias) -> int:
        return h * width * (2 if gated else 1) + width * h + (
            (2 * width if gated else width) + h if with_bias else 0)

    attn = h * (q + 2 * kv) + q * h + (q + 2 * kv + h if bias else 0)
    vocab = args.padded_vocab_size
    embedding = vocab * h
    position = (args.max_position_embeddings * h
                if getattr(args, "position_embedding_type", "learned_absolute") == "learned_absolute"
                else 0)
    output = vocab * h if getattr(args, "untie_embeddings_and_output_weights", False) else 0
    pattern = moe_layer_pattern(args)
    moe_layers = sum(pattern)
    dense = (layers * (attn + 2 * norm) + (layers - moe_layers) * mlp(f)
             + embedding + position + output + norm)
    expert = active_expert = 0
    if moe_layers:
        e = args.num_experts
        topk = getattr(args, "moe_router_topk", 2) or 2
        fe = getattr(args, "moe_ffn_hidden_size", None) or f
        shared_width = getattr(args, "moe_shared_expert_intermediate_size", None)
        router = h * e + (e if bias else 0)
        shared = (mlp(shared_width, with_bias=False) + (
            h if getattr(args, "moe_shared_expert_gate", False) else 0)) if shared_width else 0
        dense += moe_layers * (router + shared)
        expert = moe_layers * e * mlp(fe)
        active_expert = moe_layers * min(topk, e) * mlp(fe)
    return ParameterCount(dense=dense, expert=expert, active=dense + active_expert)


def count_parameters(args: argparse.Namespace) -> int:
    """All parameters of megatron-core's GPT model for these flags (every expert counted):
    :func:`parameter_counts`' total."""
    return parameter_counts(args).total



@dataclass(frozen=True)
class DPGroup:
    """One data-parallel group a buffer is reduced and gathered over, with its two levels."""

    size: int
    """P: ranks in the group."""
    per_node: int
    """D: its ranks on one node (the intra-node level)."""
    nodes: int
    """M: nodes it spans (the inter-node level); size = per_node x nodes."""


@dataclass(frozen=True)
class Workload:
    """One iteration of the run on the cluster, per rank."""

    args: argparse.Namespace
    """The run's parsed flags (``padded_vocab_size`` filled in)."""
    cluster: Cluster
    """Where it runs."""
    parameters: int
    """Parameters of the whole model."""
    flops_per_iteration: float
    """Model FLOPs of one iteration, all ranks (the trainer's ``--log-throughput`` count)."""
    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    dp: int
    """Data-parallel size P = world / (TP x PP)."""
    dp_per_node: int
    """D: data-parallel ranks of one group on a node."""
    dp_nodes: int
    """M: nodes a data-parallel group spans."""
    micro_batches: int
    """Micro-batches per rank per iteration (gradient accumulation steps)."""
    rank_parameters: int
    """Parameters one rank holds (its tensor / pipeline share; of the routed experts, its
    expert-parallel share)."""
    buckets: Tuple[int, ...]
    """Elements of each gradient bucket of one rank's dense buffers (with EP 1, all its
    parameters), in the order the backward pass fills them (last layers first)."""
    counts: ParameterCount = ParameterCount(0, 0, 0)
    """The model's dense / routed-expert / active parameters."""
    ep: int = 1
    """Expert-parallel size (``--expert-model-parallel-size``); expert tensor parallel = TP."""
    expert_dp: int = 1
    """Expert-data-parallel size DP / EP (the expert buffers' group; with EP 1 there is none:
    the experts are dense parameters)."""
    expert_dp_per_node: int = 1
    """Ranks of one expert-data-parallel group on a node (its intra-node level)."""
    expert_dp_nodes: int = 1
    """Nodes an expert-data-parallel group spans (its inter-node level)."""
    rank_expert_parameters: int = 0
    """Parameters of one rank's expert buffers (0 with EP 1)."""
    expert_buckets: Tuple[int, ...] = ()
    """Elements of each bucket of one rank's expert buffers (megatron-core's bucket size, the
    dense group's), empty with EP 1."""

    @classmethod
    def from_args(cls, args: argparse.Namespace, cluster: Cluster) -> "Workload":
        set_padded_vocab_size(args)
        set_default_ffn_hidden_size(args)
        tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        world = cluster.world_size
        if world % (tp * pp):
            raise ValueError(f"{world} GPUs ({cluster.nodes} x {cluster.gpus_per_node}) are not a "
                             f"multiple of --tensor-model-parallel-size {tp} x "
                             f"--pipeline-model-parallel-size {pp}")
        dp = world // (tp * pp)
        per_node = max(1, cluster.gpus_per_node // tp) if tp <= cluster.gpus_per_node else 1
        d = math.gcd(dp, per_node)
        mbs, gbs = args.micro_batch_size, args.global_batch_size or args.micro_batch_size * dp
        if gbs % (mbs * dp):
            raise ValueError(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size "
                             f"{mbs} x data-parallel size {dp} (a smaller --micro-batch-size; "
                             f"the recipes take MICRO_BATCH_SIZE=...)")
        counts = parameter_counts(args)
        ep = int(getattr(args, "expert_model_parallel_size", 1) or 1) if counts.expert else 1
        if dp % ep:
            raise ValueError(f"--expert-model-parallel-size {ep} does not divide the data-parallel "
                             f"size {dp}")
        if ep > 1 and args.num_experts % ep:
            raise ValueError(f"--expert-model-parallel-size {ep} does not divide --num-experts "
                             f"{args.num_experts}")
        # the expert-data-parallel group: the dense DP ranks of one EP rank, stride EP
        edp = dp // ep
        if d % ep == 0:
            ed = d // ep
        elif ep % d == 0:
            ed = 1
        else:
            raise ValueError(f"--expert-model-parallel-size {ep} and the {d} data-parallel ranks "
                             f"per node: an expert-data-parallel group would hold a different "
                             f"number of ranks on each node (one must divide the other)")
        rank_dense = math.ceil(counts.dense / (tp * pp))
        rank_expert = math.ceil(counts.expert / (tp * pp * ep))
        if ep == 1:   # the experts are ordinary dense parameters
            rank_dense, rank_expert = math.ceil(counts.total / (tp * pp)), 0
        ns = argparse.Namespace(**vars(args))
        ns.global_batch_size, ns.world_size = gbs, world
        flops = training_flops_per_iteration(ns)
        return cls(args=args, cluster=cluster, parameters=counts.total, flops_per_iteration=flops,
                   tp=tp, pp=pp, dp=dp, dp_per_node=d, dp_nodes=dp // d,
                   micro_batches=gbs // (mbs * dp), rank_parameters=rank_dense + rank_expert,
                   buckets=_buckets(rank_dense, dp, args), counts=counts, ep=ep, expert_dp=edp,
                   expert_dp_per_node=ed, expert_dp_nodes=edp // ed,
                   rank_expert_parameters=rank_expert,
                   expert_buckets=_buckets(rank_expert, dp, args) if rank_expert else ())

    @property
    def moe(self) -> bool:
        """Whether the model has routed experts."""
        return self.counts.expert > 0

    @property
    def rank_dense_parameters(self) -> int:
        """Parameters of one rank's dense buffers."""
        return self.rank_parameters - self.rank_expert_parameters

    @property
    def dense_group(self) -> DPGroup:
        return DPGroup(self.dp, self.dp_per_node, self.dp_nodes)

    @property
    def expert_group(self) -> DPGroup:
        return DPGroup(self.expert_dp, self.expert_dp_per_node, self.expert_dp_nodes)

    @property
    def compute_parameters(self) -> int:
        """The size of dense model whose measured compute rate stands for this one: the active
        parameters (a token's matmuls), all of them for a dense model."""
        return self.counts.active or self.parameters

    @property
    def overlap_grad_reduce(self) -> bool:
        return bool(getattr(self.args, "overlap_grad_reduce", False))

    @property
    def overlap_param_gather(self) -> bool:
        return bool(getattr(self.args, "overlap_param_gather", False))

    @property
    def flops_per_rank(self) -> float:
        return self.flops_per_iteration / self.cluster.world_size

    def grad_bytes(self, grad_accum_dtype: Optional[str] = None) -> int:
        """Bytes of one gradient element in the buffer megatron-core reduces: fp32 main grads for
        bf16 training unless ``--grad-reduce-in-bf16`` or ``--grad-accum-dtype bf16``."""
        if grad_accum_dtype == "fp32":
            return 4
        return 2 if grad_accum_dtype == "bf16" or getattr(self.args, "grad_reduce_in_bf16", False) else 4

    def describe(self) -> str:
        text = (f"{self.parameters / 1e9:.3g}B parameters, TP {self.tp} x PP {self.pp} x DP "
                f"{self.dp} (D={self.dp_per_node} per node x M={self.dp_nodes} nodes), "
                f"{self.micro_batches} micro-batch(es) of {self.args.micro_batch_size} x seq "
                f"{self.args.seq_length} per rank, {len(self.buckets)} bucket(s) of "
                f"{max(self.buckets) / 1e6:.1f}M elements")
        if not self.moe:
            return text
        a = self.args
        text += (f"; MoE: {a.num_experts} experts top-{a.moe_router_topk} in "
                 f"{sum(moe_layer_pattern(a))} of {a.num_layers} layers, "
                 f"{self.counts.active / 1e9:.3g}B active ({self.counts.expert / 1e9:.3g}B in "
                 f"routed experts)")
        if self.rank_expert_parameters:
            text += (f", EP {self.ep}: expert buffers over expert-DP {self.expert_dp} "
                     f"(D={self.expert_dp_per_node} per node x M={self.expert_dp_nodes} nodes), "
                     f"{len(self.expert_buckets)} bucket(s) of "
                     f"{max(self.expert_buckets) / 1e6:.1f}M elements")
        else:
            text += ", EP 1: the experts in the dense buffers"
        return text


def _buckets(rank_params: int, dp: int, args: argparse.Namespace) -> Tuple[int, ...]:
    """megatron-core's bucketing (distributed_data_parallel.py): ``--ddp-bucket-size`` or
    max(40M, 1M x DP) elements with ``--overlap-grad-reduce``, one bucket without. Buckets close
    at parameter boundaries; equal cuts here."""
    if not getattr(args, "overlap_grad_reduce", False):
        return (rank_params,)
    size = getattr(args, "ddp_bucket_size", None) or max(40_000_000, 1_000_000 * dp)
    count = max(1, math.ceil(rank_params / size))
    base, extra = divmod(rank_params, count)
    return tuple(base + (1 if i < extra else 0) for i in range(count))
