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

plus, once per token, the logits, h x V over the padded vocabulary V.
"""

from __future__ import annotations

import argparse
from typing import Optional


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
    per_layer = h * (q + 2 * kv) + q * h + 2 * s * q + mlp_matrices * h * ffn
    logits = h * args.padded_vocab_size
    multiply_adds_per_token = layers * per_layer + logits
    tokens = (args.global_batch_size if batch_size is None else batch_size) * s
    return 3 * 2 * multiply_adds_per_token * tokens


def tflops_per_gpu(args: argparse.Namespace, seconds_per_iteration: float,
                   batch_size: Optional[float] = None) -> float:
    """TFLOP/s per GPU (per rank) at ``seconds_per_iteration`` of ``batch_size`` sequences
    (default ``--global-batch-size``)."""
    if seconds_per_iteration <= 0:
        return 0.0
    return training_flops_per_iteration(args, batch_size) / (
        seconds_per_iteration * args.world_size * 1e12)
