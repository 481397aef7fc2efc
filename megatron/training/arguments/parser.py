"""The trainer's flags (Megatron-LM names and meanings), their parser, and which of them were
given.  What a parsed command line must satisfy is :mod:`.validation`; the entry point that runs
both is :func:`megatron.training.arguments.parse_args`.

Why our own parser: Megatron-LM's ``megatron/training/arguments.py`` is not part of the
megatron-core wheel, and we must not copy it.  The flags below keep Megatron-LM's spelling and
semantics so existing launch scripts work; flags that only tune GPU kernels parse and are
documented as no-ops.  The quantization and PaRO flags come from the communication layer
(:func:`megatron.distributed.quant.integration.add_arguments`) and become the one
``QuantizationConfig`` only via ``integration.build_quantization_config`` (in
:func:`.validation.validate_args`, stored as ``args.quant_config``); ``--paro-strategy`` is checked by
``integration.check_strategy_args``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, FrozenSet, List, NoReturn, Optional

from megatron.distributed.quant import integration

from megatron.training.arguments.moe import add_moe_args
from megatron.training.data.tokenizer import TOKENIZER_TYPES
from megatron.training.model import rope_scaling
from megatron.training.profiling import add_profile_args

NOOP = "(no-op in this trainer; accepted for Megatron-LM script compatibility)"

NONZERO_RANK_ERROR_GRACE_S = 5.0
"""How long a rank other than 0 waits before it exits on a bad command line (see
:meth:`RankAwareParser.error`)."""


def launcher_rank() -> int:
    """This process's global rank as the launcher set it (``RANK``; 0 without a launcher)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class RankAwareParser(argparse.ArgumentParser):
    """ArgumentParser whose errors are reported once per job, not once per rank.

    Every rank parses the same command line, so every rank finds the same error. Rank 0 prints
    argparse's usage and message and exits with status 2. The other ranks wait
    :data:`NONZERO_RANK_ERROR_GRACE_S` first: torchrun stops the remaining ranks as soon as one
    fails, so rank 0 failing first is what keeps its message from being cut off (rank 0 exiting
    after another rank would be killed possibly before it printed). A rank still alive after the
    grace (no launcher that stops it, e.g. one srun task per rank) prints a one-line message and
    exits with the same status 2.
    """

    def error(self, message: str) -> NoReturn:
        rank = launcher_rank()
        if rank == 0:
            super().error(message)
        time.sleep(NONZERO_RANK_ERROR_GRACE_S)
        self.exit(2, f"{self.prog}: error (rank {rank}): {message}\n")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers.")
    g.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size.")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP hidden size (default 4*hidden, or 8/3*hidden rounded to 64 with --swiglu).")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None, help="Sequence length of a sample.")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="Size of the learned position table (default: --seq-length).")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated linear unit with SiLU).")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"),
                   default="learned_absolute")
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Separate output projection instead of reusing the word embeddings.")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   help="No biases in linear layers.")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--attention-backend", choices=("flash", "fused", "unfused", "local", "auto"),
                   default="auto",
                   help="Attention implementation (Megatron-LM's values). With Transformer Engine "
                        "on CUDA: TE's spec with TE's flash / fused (cuDNN) / unfused kernel, or "
                        "TE's choice (auto). Without TE (CPU, or CUDA without TE): auto = torch "
                        "scaled_dot_product_attention (torch picks the kernel), flash / fused = "
                        "SDPA limited to torch's flash / cuDNN+memory-efficient kernels, unfused "
                        "= megatron-core's DotProductAttention. local = megatron-core's local spec "
                        "and DotProductAttention, also with TE.")
    g.add_argument("--group-query-attention", action="store_true",
                   help="Grouped-query attention: --num-query-groups key/value heads.")
    g.add_argument("--num-query-groups", type=int, default=1,
                   help="Key/value head groups with --group-query-attention.")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocabulary to a multiple of this times the TP size.")
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="layernorm_epsilon", type=float,
                   default=1e-5, help="Epsilon of every LayerNorm / RMSNorm (--layernorm-epsilon "
                   "is the older spelling).")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="Zero-centered norm weights: the norm scales by (1 + weight), the weight "
                        "starts at 0 (megatron-core's layernorm_zero_centered_gamma).")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="Per-head projection size (default --hidden-size / --num-attention-heads).")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="Biases in the QKV projection even with --disable-bias-linear (Qwen2).")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.x RoPE frequency scaling (megatron-core's: "
                        f"{rope_scaling.describe()}; the factor is --rope-scaling-factor).")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="The factor of --use-rope-scaling.")
    g.add_argument("--openai-gelu", action="store_true",
                   help="The tanh approximation of GELU (GPT-2's gelu_new) instead of the exact "
                        "one (megatron-core's fused bias-GELU is not used with it).")
    g.add_argument("--mask-padded-vocab-logits", action="store_true",
                   help="Set the logits of the padding rows of the vocabulary (ids >= the "
                        "unpadded vocabulary, see --make-vocab-size-divisible-by) to -inf before "
                        "the loss, so the softmax is over the real vocabulary only (an imported "
                        "Hugging Face model then computes its own loss). Off by default.")
    g.add_argument("--model-args-file", type=str, default=None,
                   help="Read more flags from this file (shell-quoted, any number per line, '#' "
                        "comments), e.g. the model_args.txt tools/checkpoint/convert_from_hf.py "
                        "writes. A value given on the command line wins over the file's; a "
                        "switch the file turns on (e.g. --swiglu) stays on, as the command line "
                        "cannot turn it off.")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Selective activation recomputation (same as --recompute-granularity selective).")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="For --recompute-granularity full (default uniform).")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="For --recompute-granularity full (default 1).")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="Initialize weights on the CPU (always on in CPU mode).")


def _add_optimizer_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine",
                                                "inverse-square-root", "WSD"), default="linear",
                   help="WSD: warmup, constant (stable) lr, then a decay over the last "
                        "--lr-wsd-decay-iters (or --lr-wsd-decay-samples) of the decay horizon, "
                        "shaped by --lr-wsd-decay-style.")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="Iterations to decay over (default: --train-iters).")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="Warmup as a fraction of --lr-decay-iters (exclusive with --lr-warmup-iters).")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    _add_sample_based_schedule_args(g)
    g.add_argument("--override-opt_param-scheduler", dest="override_opt_param_scheduler",
                   action="store_true",
                   help="On --load: use this run's learning-rate schedule flags (--lr, --min-lr, "
                        "warmup, decay horizon and style), not the checkpoint's; the schedule "
                        "continues from the checkpoint's consumed samples.")
    g.add_argument("--use-checkpoint-opt_param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="On --load: keep the checkpoint's learning-rate schedule, whatever this "
                        "run's flags say. Without either flag a schedule that differs from the "
                        "checkpoint's stops the run naming the difference (as in Megatron-LM).")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="Separate peak learning rate of the input embedding and output layer "
                        "(megatron-core's decoupled_lr; not with PaRO-engine strategies).")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="Minimum learning rate of --decoupled-lr's parameters.")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0, help="Global grad-norm clip (0 = off).")


def _add_sample_based_schedule_args(g: argparse._ArgumentGroup) -> None:
    """Megatron-LM's sample-based schedule (with --train-samples) and the WSD decay phase."""
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="Samples to decay over, with --train-samples (default: --train-samples).")
    g.add_argument("--lr-warmup-samples", type=int, default=0,
                   help="Warmup samples, with --train-samples.")
    g.add_argument("--lr-wsd-decay-style", choices=("exponential", "linear", "cosine",
                                                    "minus_sqrt"), default="exponential",
                   help="Shape of the decay phase of --lr-decay-style WSD.")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="Length of the decay phase of --lr-decay-style WSD, in iterations "
                        "(with --train-iters).")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="Length of the decay phase of --lr-decay-style WSD, in samples (with "
                        "--train-samples).")


def _add_mixed_precision_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true", help="bf16 params/compute, fp32 main params.")
    g.add_argument("--fp16", action="store_true", help="fp16 params/compute with loss scaling.")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="Static loss scale (fp16); default: dynamic scaling.")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="Accumulate and reduce gradients in fp32 (implied by --bf16 unless "
                        "--grad-accum-dtype bf16).")


def _add_distributed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism: LayerNorm/dropout activations split along "
                        "the sequence over the tensor-parallel ranks (needs TP > 1; ignored with "
                        "a note at TP = 1, as in Megatron-LM).")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Shard the optimizer state over data-parallel ranks (ZeRO-1).")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Overlap the gradient reduce(-scatter) with the backward pass.")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="Overlap the distributed optimizer's param all-gather with the forward pass.")
    g.add_argument("--overlap-param-gather-with-optimizer-step", action="store_true",
                   help="Start every weight all-gather (quantized or exact) right after a "
                        "successful optimizer step, in forward order, instead of each bucket "
                        "group's gather when the previous group's forward starts (Megatron-LM's "
                        "flag; here also without interleaved pipelining). Needs "
                        "--overlap-param-gather.")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="Accumulate and reduce gradients in bf16 instead of fp32 (Megatron-LM; "
                        "needs --bf16; the same as --grad-accum-dtype bf16).")
    g.add_argument("--ddp-reduce-scatter-with-fp32-accumulation", action="store_true",
                   help="megatron-core's reduce-scatter that sends bf16 and sums in fp32 (needs "
                        "--use-distributed-optimizer and bf16 gradients; the unquantized path).")
    g.add_argument("--ddp-average-in-collective", action="store_true",
                   help="Average gradients inside the collective instead of scaling them before "
                        "it (megatron-core's average_in_collective).")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="Elements per DDP bucket (default megatron-core's); with a PaRO-engine "
                        "strategy, the cap on a gather/reduce-scatter bucket (default one per "
                        "layer).")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="Default: nccl on GPU, gloo on CPU.")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--no-async-tensor-model-parallel-allreduce", action="store_true",
                   help=NOOP)
    g.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="Default: cuda when available, else cpu (CPU mode, gloo).")
    _add_fusion_args(parser)


def _add_fusion_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's fusion switches: every fusion is on where what it needs is installed
    (megatron/training/model/fusions.py decides, and prints one line saying what runs); these turn one
    off. ``--apply-rope-fusion`` asks for TE's fused RoPE and is an error without TE."""
    g = parser.add_argument_group("fusions")
    for flag, dest, what in (
            ("--no-persist-layer-norm", "persist_layer_norm", "Apex's persistent layer norm"),
            ("--no-masked-softmax-fusion", "masked_softmax_fusion",
             "Megatron's fused scale-mask-softmax (local attention)"),
            ("--no-bias-gelu-fusion", "bias_gelu_fusion", "jit-fused bias + GeLU"),
            ("--no-bias-swiglu-fusion", "bias_swiglu_fusion", "jit-fused bias + SwiGLU"),
            ("--no-bias-dropout-fusion", "bias_dropout_fusion", "jit-fused bias + dropout + add"),
            ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion",
             "weight-gradient GEMMs accumulating into main_grad (TE or Apex)"),
            ("--no-rope-fusion", "apply_rope_fusion", "Transformer Engine's fused RoPE")):
        g.add_argument(flag, dest=dest, action="store_false",
                       help=f"Do not use {what} even where it is installed.")
    g.add_argument("--apply-rope-fusion", dest="apply_rope_fusion_explicit", action="store_true",
                   help="Require Transformer Engine's fused RoPE (an error without TE on CUDA).")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples per optimizer step (default micro-batch-size * DP).")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None,
                   help="Train on this many samples instead of --train-iters (the learning rate "
                        "schedule then counts samples: --lr-decay-samples, --lr-warmup-samples).")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCR", "SAMPLES"),
                   help="Grow the global batch size from START by INCR over the first SAMPLES "
                        "samples, up to --global-batch-size (megatron-core's calculator; needs "
                        "--train-samples, as in Megatron-LM).")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="Average the loss over every token of the global batch, not per "
                        "micro-batch: the gradients are summed and divided by the global token "
                        "count (megatron-core's calculate_per_token_loss).")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="Save (if --save) and exit with status 0 when iteration %% N == 0.")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="Save (if --save) and exit with status 0 at the first iteration boundary "
                        "after this many minutes (on every rank at the same iteration).")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On the --exit-signal (SIGTERM: what SLURM and torchrun send before a "
                        "kill), finish the current iteration, save (if --save) and exit with "
                        "status 0; every rank stops at the same iteration.")
    g.add_argument("--exit-signal", choices=("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"),
                   default="SIGTERM",
                   help="The signal --exit-signal-handler acts on (Megatron-LM's choices).")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--skip-train", action="store_true", help="Only evaluate.")
    g.add_argument("--dry-run", action="store_true",
                   help="Parse, validate and build every config on the CPU, print them as JSON "
                        "(DRY_RUN_ARGS / DRY_RUN_QUANT / DRY_RUN_CONFIGS lines) and exit 0.")


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="Prefixes of .bin/.idx files, optionally weighted: 'w1 p1 w2 p2'.")
    g.add_argument("--mock-data", action="store_true",
                   help="megatron-core MockGPTDataset (synthetic, learnable) instead of files.")
    g.add_argument("--split", type=str, default="969,30,1", help="train,valid,test weights.")
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per rank.")
    g.add_argument("--tokenizer-type", default=None,
                   choices=TOKENIZER_TYPES,
                   help="Default: GPT2BPETokenizer with --vocab-file, else NullTokenizer.")
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--tokenizer-model", type=str, default=None,
                   help="SentencePiece model file or local HuggingFace tokenizer directory.")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer / mock-data vocabulary size (incl. the EOD token); "
                        "default 1024. With HuggingFaceTokenizer: the model's vocabulary when "
                        "larger than the tokenizer's (a HF config.json's vocab_size).")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="Not supported (stops the launch): attention is causal over the whole "
                        "sequence, documents are not masked from each other.")
    g.add_argument("--eod-mask-loss", action="store_true")


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None, help="Checkpoint directory to write.")
    g.add_argument("--load", type=str, default=None, help="Checkpoint directory to resume from.")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true",
                   help="Do not restore the optimizer state on --load. The learning-rate "
                        "schedule still continues at the checkpoint's iteration: from its "
                        "scheduler state (checked as without this flag), or, when it has none, "
                        "this run's schedule advanced to its consumed samples (--finetune "
                        "starts it at 0).")
    g.add_argument("--no-load-rng", action="store_true", help="Do not restore RNG state on --load.")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="Load model weights only; restart iteration count and data at 0.")
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist"], default="torch",
                   help="Format --save writes (--load reads either): 'torch' = one file per rank, "
                        "resumes on the same TP/PP/DP layout only; 'torch_dist' = megatron-core "
                        "dist_checkpointing, resumes on another DP (and TP/PP) size and with "
                        "quantization switched on or off.")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="With --load: stop with an error when there is no checkpoint to resume "
                        "from, instead of training from iteration 0 (without it only a --load "
                        "directory that does not exist -- or an empty --load that is also "
                        "--save -- starts from scratch; anything else without a checkpoint is "
                        "an error).")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="With --load DIR: load iteration N (DIR/iter_NNNNNNN) instead of the "
                        "one latest_checkpointed_iteration.txt names (Megatron-LM's flag).")
    g.add_argument("--no-verify-checkpoint", dest="verify_checkpoint", action="store_false",
                   help="Do not check the loaded checkpoint's files against the sizes and "
                        "digests in its manifest.json (checked by default: a damaged file stops "
                        "the run naming it).")
    g.add_argument("--allow-low-disk-space", action="store_true",
                   help="Start even when --save has less free space than one checkpoint of "
                        "this run (refused by default: the first save would fail after "
                        "--save-interval iterations); a WARNING is printed instead.")


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--timing-log-level", type=int, choices=(0, 1, 2), default=0,
                   help="0: iteration time only; 1: + the forward-backward pass and the "
                        "optimizer step, ms per iteration of the slowest rank, on a line after "
                        "each iteration line and in --jsonl-log (the device is synchronised "
                        "around each timed part); 2: + the batch generator and zeroing the "
                        "gradients.")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="The iteration time and the --timing-log-level timers in tensorboard.")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-throughput", action="store_true", help="tokens/s in the log line.")
    g.add_argument("--log-loss-scale", action="store_true",
                   help="Also write the loss scale to tensorboard (always in the log line).")
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--wandb-project", type=str, default="")
    g.add_argument("--wandb-exp-name", type=str, default="")
    g.add_argument("--wandb-save-dir", type=str, default="")
    g.add_argument("--wandb-entity", type=str, default="",
                   help="W&B team or user the --wandb-project run is logged under (default: "
                        "wandb's default entity).")
    g.add_argument("--jsonl-log", type=str, default=None,
                   help="Append one JSON object per log interval / evaluation (rank 0).")


def _add_megatron_lm_compat_args(parser: argparse.ArgumentParser) -> None:
    """Flags of Megatron-LM's GPT / Llama launch scripts that have no group of their own here:
    GPU-kernel and memory tuning that does nothing in this trainer (NOOP help), old spellings
    that map onto this trainer's choices, and features this trainer does not have, which parse
    and are then refused with the reason (:func:`.validation.unsupported_megatron_lm_features`)."""
    g = parser.add_argument_group("Megatron-LM script compatibility")
    for flag in ("--use-mcore-models", "--cross-entropy-loss-fusion", "--manual-gc",
                 "--no-create-attention-mask-in-dataloader",
                 "--use-contiguous-parameters-in-local-ddp"):
        g.add_argument(flag, action="store_true", help=NOOP)
    g.add_argument("--manual-gc-interval", type=int, default=0, help=NOOP)
    g.add_argument("--empty-unused-memory-level", type=int, choices=(0, 1, 2), default=0,
                   help=NOOP)
    g.add_argument("--tiktoken-pattern", type=str, default=None,
                   help=f"{NOOP} Read by Megatron-LM's TikTokenizer only, which this trainer "
                        "does not have.")
    g.add_argument("--no-position-embedding", dest="add_position_embedding",
                   action="store_false",
                   help=f"{NOOP} With --position-embedding-type rope there is no position table "
                        "to leave out; with learned_absolute it is refused.")
    g.add_argument("--rerun-mode", choices=("disabled", "validate_results", "report_stats"),
                   default="disabled",
                   help=f"{NOOP} 'disabled' is what this trainer does; the result-validating "
                        "modes are refused.")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="Megatron-LM's older spelling of --attention-backend flash.")
    g.add_argument("--transformer-impl", choices=("transformer_engine", "local"), default=None,
                   help="transformer_engine: Transformer Engine's layers where installed (on "
                        "CUDA), else megatron-core's local ones -- this trainer's default; local: "
                        "megatron-core's local layers (the same as --attention-backend local).")
    g.add_argument("--attention-softmax-in-fp32", action="store_true",
                   help="Compute the attention softmax in fp32: always so here "
                        "(megatron-core's attention_softmax_in_fp32 default), so a no-op.")
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false",
                   help="Read the .bin data files without memory-mapping them.")
    g.add_argument("--dataloader-type", choices=("single", "cyclic", "external"),
                   default="single",
                   help="single: the resumable sequential sampler (this trainer's); cyclic and "
                        "external are refused.")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="Only 1: this trainer has no context parallelism (larger values are "
                        "refused).")
    g.add_argument("--fp8-format", choices=("e4m3", "hybrid"), default=None,
                   help="Refused: FP8 training needs Transformer Engine's FP8 layers, which this "
                        "trainer does not drive (train in --bf16).")
    for flag, kind in (("--fp8-margin", int), ("--fp8-interval", int),
                       ("--fp8-amax-history-len", int)):
        g.add_argument(flag, type=kind, default=None, help="Refused: see --fp8-format.")
    g.add_argument("--fp8-amax-compute-algo", choices=("most_recent", "max"), default=None,
                   help="Refused: see --fp8-format.")
    g.add_argument("--fp8-param-gather", action="store_true", help="Refused: see --fp8-format.")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="Refused: this trainer shards with --use-distributed-optimizer (ZeRO-1) "
                        "or a --paro-strategy, not torch FSDP2.")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="Refused: give the model flags on the command line (or "
                        "--model-args-file); a checkpoint of another shape is refused at load.")


def build_parser(extra_args_provider: Optional[Callable] = None) -> argparse.ArgumentParser:
    """All trainer flags plus the quantization flags (plus the caller's extra ones)."""
    parser = RankAwareParser(description="Megatron-compatible GPT trainer (megatron-core "
                                         "0.16.1) with quantized communication",
                             allow_abbrev=False)
    _add_model_args(parser)
    _add_optimizer_args(parser)
    _add_mixed_precision_args(parser)
    _add_distributed_args(parser)
    _add_training_args(parser)
    _add_data_args(parser)
    _add_checkpoint_args(parser)
    _add_logging_args(parser)
    _add_megatron_lm_compat_args(parser)
    add_moe_args(parser)
    add_profile_args(parser)
    integration.add_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    return parser


def explicit_dests(parser: argparse.ArgumentParser, argv: Optional[List[str]]) -> List[str]:
    """Dests of the flags present in ``argv``: parse again with every default suppressed, so
    exactly the given flags land in the namespace (a flag given with its default value counts
    as given)."""
    saved = [(action, action.default) for action in parser._actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        return sorted(vars(parser.parse_args(argv)))
    finally:
        for action, default in saved:
            action.default = default


def flags_given(args: argparse.Namespace) -> FrozenSet[str]:
    """The one answer to "was this flag given on the command line?" (as dests).

    ``args.explicit_flags`` when ``parse_args`` recorded it; for a namespace built another
    way (e.g. ``build_parser().parse_args(...)``), the dests whose value differs from the parser
    default.
    """
    recorded = getattr(args, "explicit_flags", None)
    if recorded is not None:
        return frozenset(recorded)
    defaults = {a.dest: a.default for a in build_parser()._actions}
    return frozenset(k for k, v in vars(args).items() if k in defaults and v != defaults[k])


def model_vocab_size(tokenizer_vocab_size: int, args: argparse.Namespace) -> int:
    """The model's vocabulary before padding: the tokenizer's, or ``--vocab-size`` with
    HuggingFaceTokenizer where a model has more embedding rows than its tokenizer has tokens."""
    override = getattr(args, "vocab_size", None)
    if getattr(args, "tokenizer_type", None) != "HuggingFaceTokenizer" or override is None:
        return tokenizer_vocab_size
    if override < tokenizer_vocab_size:
        raise ValueError(f"--vocab-size {override} is smaller than the HuggingFaceTokenizer's "
                         f"{tokenizer_vocab_size} tokens")
    return int(override)


def read_model_args_file(path: str) -> List[str]:
    """The flags of a ``--model-args-file`` (shell quoting, ``#`` comments)."""
    import shlex

    try:
        with open(path, encoding="utf-8") as f:
            return shlex.split(f.read(), comments=True)
    except OSError as exc:
        raise ValueError(f"--model-args-file {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # unbalanced quotes
        raise ValueError(f"--model-args-file {path}: {exc}") from None


def expand_model_args_file(argv: List[str]) -> List[str]:
    """``argv`` with the flags of its ``--model-args-file`` put in front, so that the command
    line's own flags, parsed later, win.  The file may not name another file."""
    path = None
    for i, arg in enumerate(argv):
        if arg == "--model-args-file" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--model-args-file="):
            path = arg.split("=", 1)[1]
    if path is None:
        return list(argv)
    extra = read_model_args_file(path)
    if any(a == "--model-args-file" or a.startswith("--model-args-file=") for a in extra):
        raise ValueError(f"--model-args-file {path} names another --model-args-file")
    return extra + list(argv)


def padded_vocab_size(orig_vocab_size: int, args: argparse.Namespace) -> int:
    """Pad the vocabulary so the embedding splits evenly over TP ranks (Megatron semantics)."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    if multiple <= 0:
        return orig_vocab_size
    return ((orig_vocab_size + multiple - 1) // multiple) * multiple


if __name__ == "__main__":  # pragma: no cover - handy for eyeballing the flag list
    build_parser().print_help(sys.stdout)
