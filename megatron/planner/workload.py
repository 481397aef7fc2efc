"""What one training iteration of a run is, from its ``pretrain_gpt.py`` flags and the cluster.

Why from the flags: the user plans the run they will launch, so the planner reads the trainer's
argument parser and FLOPs count. This module decides the layout: the data-parallel grid, the
micro-batches, the parameters each rank holds and megatron-core's buckets.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Optional, Tuple

from megatron.training.model.flops import training_flops_per_iteration

from .cluster import Cluster

__all__ = ["Workload", "count_parameters", "set_padded_vocab_size", "GPT2_VOCAB"]

GPT2_VOCAB = 50257
"""GPT2BPETokenizer's vocabulary, used when the run gives no ``--vocab-size``."""


def set_padded_vocab_size(args: argparse.Namespace) -> None:
    """``args.padded_vocab_size`` from ``--vocab-size`` (GPT-2's without one), as the trainer pads
    it, unless already set (the trainer sets it from its tokenizer)."""
    if getattr(args, "padded_vocab_size", None) is None:
        from megatron.training.arguments.parser import padded_vocab_size

        args.padded_vocab_size = padded_vocab_size(args.vocab_size or GPT2_VOCAB, args)


def count_parameters(args: argparse.Namespace) -> int:
    """Parameters of megatron-core's GPT model for these flags (tied output layer unless
    ``--untie-embeddings-and-output-weights``); tests/test_planner.py checks it against the
    trainer's own count."""
    h, layers = args.hidden_size, args.num_layers
    heads = args.num_attention_heads
    head = args.kv_channels if getattr(args, "kv_channels", None) else h // heads
    q = head * heads
    kv = head * (args.num_query_groups if getattr(args, "group_query_attention", False) else heads)
    f = args.ffn_hidden_size or 4 * h
    bias = not getattr(args, "disable_bias_linear", False)
    norm = 2 * h if getattr(args, "normalization", "LayerNorm") == "LayerNorm" else h
    gated = bool(getattr(args, "swiglu", False))
    attn = h * (q + 2 * kv) + q * h + (q + 2 * kv + h if bias else 0)
    mlp = h * f * (2 if gated else 1) + f * h + ((2 * f if gated else f) + h if bias else 0)
    per_layer = attn + mlp + 2 * norm
    vocab = args.padded_vocab_size
    embedding = vocab * h
    position = (args.max_position_embeddings * h
                if getattr(args, "position_embedding_type", "learned_absolute") == "learned_absolute"
                else 0)
    output = vocab * h if getattr(args, "untie_embeddings_and_output_weights", False) else 0
    return layers * per_layer + embedding + position + output + norm


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
    """Parameters one rank holds (its tensor / pipeline share)."""
    buckets: Tuple[int, ...]
    """Elements of each gradient bucket of one rank, in the order the backward pass fills them
    (last layers first)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace, cluster: Cluster) -> "Workload":
        set_padded_vocab_size(args)
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
        parameters = count_parameters(args)
        rank_params = math.ceil(parameters / (tp * pp))
        ns = argparse.Namespace(**vars(args))
        ns.global_batch_size, ns.world_size = gbs, world
        flops = training_flops_per_iteration(ns)
        return cls(args=args, cluster=cluster, parameters=parameters, flops_per_iteration=flops,
                   tp=tp, pp=pp, dp=dp, dp_per_node=d, dp_nodes=dp // d,
                   micro_batches=gbs // (mbs * dp), rank_parameters=rank_params,
                   buckets=_buckets(rank_params, dp, args))

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
        return (f"{self.parameters / 1e9:.3g}B parameters, TP {self.tp} x PP {self.pp} x DP "
                f"{self.dp} (D={self.dp_per_node} per node x M={self.dp_nodes} nodes), "
                f"{self.micro_batches} micro-batch(es) of {self.args.micro_batch_size} x seq "
                f"{self.args.seq_length} per rank, {len(self.buckets)} bucket(s) of "
                f"{max(self.buckets) / 1e6:.1f}M elements")


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
