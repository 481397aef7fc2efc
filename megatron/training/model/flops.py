"""Model FLOPs of one training iteration, for the ``TFLOP/s/GPU`` of ``--log-throughput``.

Why this count: Megatron-LM and the SDP4Bit paper (Table 2) report throughput as model FLOPs per
second per GPU, so users compare runs across sizes and clusters with it, not with tokens/s.  The
count is the standard one for a GPT decoder: every matrix multiply of a token's forward pass costs
2 FLOPs per multiply-add, the backward pass twice the forward (gradients of activations and of
weights), i.e. 3x the forward in all; activation recomputation is not counted (model FLOPs, not
hardware FLOPs).  Per layer and token, with hidden size h, query width q = heads x head size,
key/value width k, MLP width f and sequence length s, the forward pass multiplies:

* the QKV projection, h x (q + 2k), and the output projection, q x h;
* the attention scores and their weighted sum of values, 2 x s x q (the full s x s square, causal
  masking not discounted, as the Megatron-LM paper's closed form 72 B s L h^2 (1 + s/(6h) +
  V/(12 L h)) and the SDP4Bit paper count it; Megatron-LM's code has since halved this term for
  causal attention, so its TFLOP/s for the same run are lower by that term: 7 % at s = h = 2048,
  24 layers);
* the MLP, 2 x h x f, or 3 x h x f when gated (SwiGLU: gate, up and down projections);

plus, once per token, the logits, h x V over the padded vocabulary V. A MoE layer (``--num-experts``
E, ``--moe-layer-freq``) counts what a token runs, as Megatron-LM does: the router, h x E, and
top-k expert MLPs of width ``--moe-ffn-hidden-size`` (plus the shared expert, if any).
"""

from __future__ import annotations

import argparse
from typing import List, Optional


def training_flops_per_iteration(args: argparse.Namespace,
                                 batch_size: Optional[float] = None) -> float:
    """Model FLOPs of one iteration of ``batch_size`` sequences (forward + backward); default
    ``--global-batch-size`` (pass the step's own during --rampup-batch-size)."""
    h, s, layers = args.hidden_size, args.seq_length, args.num_layers
    head_size = h // args.num_attention_heads
    q = head_size * args.num_attention_heads
    kv = head_size * (args.num_query_groups if getattr(args, "group_query_attention", False)
                      else args.num_attention_heads)  # --group-query-attention: fewer k/v heads
    ffn = args.ffn_hidden_size or 4 * h
    mlp_matrices = 3 if args.swiglu else 2
    attention = h * (q + 2 * kv) + q * h + 2 * s * q
    moe_layers = len(moe_layer_indices(args))
    moe_mlp = 0
    if moe_layers:
        expert = args.moe_ffn_hidden_size or ffn
        shared = getattr(args, "moe_shared_expert_intermediate_size", None) or 0
        moe_mlp = (h * args.num_experts
                   + mlp_matrices * h * (args.moe_router_topk * expert + shared))
    logits = h * args.padded_vocab_size
    multiply_adds_per_token = (layers * attention + (layers - moe_layers) * mlp_matrices * h * ffn
                               + moe_layers * moe_mlp + logits)
    tokens = (args.global_batch_size if batch_size is None else batch_size) * s
    return 3 * 2 * multiply_adds_per_token * tokens


def moe_layer_indices(args: argparse.Namespace) -> List[int]:
    """The layers that are MoE (none for a dense model): ``--moe-layer-freq`` N makes every N-th
    (0, N, 2N, ...), a 0/1 list marks each layer, as megatron-core's block spec reads it."""
    if getattr(args, "num_experts", None) is None:
        return []
    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, str):  # a namespace built by hand: Megatron-LM's spelling
        from megatron.training.arguments.moe import moe_layer_freq

        freq = moe_layer_freq(freq)
    if isinstance(freq, int):
        return [i for i in range(args.num_layers) if i % freq == 0]
    return [i for i, moe in enumerate(freq) if moe]


def tflops_per_gpu(args: argparse.Namespace, seconds_per_iteration: float,
                   batch_size: Optional[float] = None) -> float:
    """TFLOP/s per GPU (per rank) at ``seconds_per_iteration`` of ``batch_size`` sequences
    (default ``--global-batch-size``)."""
    if seconds_per_iteration <= 0:
        return 0.0
    return training_flops_per_iteration(args, batch_size) / (
        seconds_per_iteration * args.world_size * 1e12)
