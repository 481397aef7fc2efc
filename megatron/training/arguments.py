"""Command-line arguments of the trainer (Megatron-LM names and meanings).

Why our own parser: Megatron-LM's ``megatron/training/arguments.py`` is not part of the
megatron-core wheel, and we must not copy it.  The flags below keep Megatron-LM's spelling and
semantics so existing launch scripts work; flags that only tune GPU kernels parse and are
documented as no-ops.  The quantization and PaRO flags come from the communication layer
(:func:`megatron.distributed.quant.integration.add_arguments`) and become the one
``QuantizationConfig`` only via ``integration.build_quantization_config`` (in
:func:`validate_args`, stored as ``args.quant_config``); ``--paro-strategy`` is checked by
``integration.check_strategy_args``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import warnings
from typing import Callable, FrozenSet, List, NoReturn, Optional, Tuple

from megatron.distributed.quant import integration

from .profiling import add_profile_args, validate_profile_args
from .tokenizer import SENTENCEPIECE_TYPES, TOKENIZER_TYPES

NOOP = "(no-op in this trainer; accepted for Megatron-LM script compatibility)"


class ArgumentError(ValueError):
    """A bad flag combination; the message says what to change."""


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
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
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
                                                "inverse-square-root"), default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="Iterations to decay over (default: --train-iters).")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="Warmup as a fraction of --lr-decay-iters (exclusive with --lr-warmup-iters).")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0, help="Global grad-norm clip (0 = off).")


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
    (megatron/training/fusions.py decides, and prints one line saying what runs); these turn one
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
                        "default 1024.")
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
                   help="Do not restore optimizer/scheduler state on --load.")
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
                   help="0: iteration time only; 1: + forward-backward/optimizer; 2: + finer timers.")
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
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
    g.add_argument("--jsonl-log", type=str, default=None,
                   help="Append one JSON object per log interval / evaluation (rank 0).")


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
    add_profile_args(parser)
    integration.add_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    return parser


def parse_args(argv: Optional[List[str]] = None,
               extra_args_provider: Optional[Callable] = None,
               validate: bool = True) -> argparse.Namespace:
    """Parse (``sys.argv[1:]`` by default) and validate; bad combinations exit with a message
    (status 2, printed by rank 0 only: :class:`RankAwareParser`).

    Also records ``args.explicit_flags``, the dests given on the command line (see
    :func:`flags_given`)."""
    parser = build_parser(extra_args_provider)
    args = parser.parse_args(argv)
    args.explicit_flags = _explicit_dests(parser, argv)
    if validate:
        try:
            validate_args(args)
        except ArgumentError as e:
            parser.error(str(e))
    return args


def _explicit_dests(parser: argparse.ArgumentParser, argv: Optional[List[str]]) -> List[str]:
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

    ``args.explicit_flags`` when :func:`parse_args` recorded it; for a namespace built another
    way (e.g. ``build_parser().parse_args(...)``), the dests whose value differs from the parser
    default.
    """
    recorded = getattr(args, "explicit_flags", None)
    if recorded is not None:
        return frozenset(recorded)
    defaults = {a.dest: a.default for a in build_parser()._actions}
    return frozenset(k for k, v in vars(args).items() if k in defaults and v != defaults[k])


def _resolve_gradient_reduction(args: argparse.Namespace, given: FrozenSet[str]) -> None:
    """The one place Megatron-LM's gradient-reduction knobs meet ours.

    ``--grad-reduce-in-bf16`` is Megatron-LM's name for what ``--grad-accum-dtype bf16`` says
    (megatron-core has one grad buffer: the dtype gradients accumulate in is the dtype they are
    reduced in); it becomes ``--grad-accum-dtype bf16``, and an explicit fp32 request contradicts
    it.  ``--ddp-reduce-scatter-with-fp32-accumulation`` is megatron-core's bf16-wire / fp32-sum
    reduce-scatter: it needs the distributed optimizer and bf16 gradients, and the quantized
    reduce-scatter (``--quantized-gradients``) replaces it, so the two are refused together; it
    only sums, so it also excludes ``--ddp-average-in-collective``, which otherwise combines with
    everything (the quantized collectives divide after their fp32 sum).  PaRO-engine strategies have their own collectives: refused there.
    """
    if args.grad_reduce_in_bf16:
        _require(args.bf16, "--grad-reduce-in-bf16 needs --bf16")
        _require(args.grad_accum_dtype != "fp32",
                 "--grad-reduce-in-bf16 contradicts --grad-accum-dtype fp32")
        _require("accumulate_allreduce_grads_in_fp32" not in given,
                 "--grad-reduce-in-bf16 contradicts --accumulate-allreduce-grads-in-fp32")
        args.grad_accum_dtype = "bf16"
    if args.ddp_reduce_scatter_with_fp32_accumulation:
        flag = "--ddp-reduce-scatter-with-fp32-accumulation"
        _require(args.use_distributed_optimizer, f"{flag} needs --use-distributed-optimizer")
        _require(args.grad_accum_dtype == "bf16",
                 f"{flag} sends bf16 gradients: add --grad-reduce-in-bf16 (or --grad-accum-dtype "
                 "bf16)")
        _require(not integration.gradients_quantized(args),
                 f"{flag} contradicts --quantized-gradients: the quantized reduce-scatter "
                 "replaces megatron-core's")
        _require(not args.ddp_average_in_collective,
                 f"{flag} contradicts --ddp-average-in-collective: megatron-core 0.16.1's fp32-"
                 "accumulating reduce-scatter only sums")
    mcore_only = [f for f, on in (("--ddp-reduce-scatter-with-fp32-accumulation",
                                    args.ddp_reduce_scatter_with_fp32_accumulation),
                                   ("--ddp-average-in-collective", args.ddp_average_in_collective))
                   if on]
    _require(not (mcore_only and integration.uses_sharded_engine(args.paro_strategy)),
             f"{', '.join(mcore_only)}: megatron-core DDP options; --paro-strategy "
             f"{args.paro_strategy} may train on the PaRO engine, which has its own collectives")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ArgumentError(msg)


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill derived values (world/DP size, defaults) and reject bad combinations.

    Raises :class:`ArgumentError` with the fix in the message.  Sets ``args.quant_config``
    (the one :class:`QuantizationConfig`), ``args.params_dtype`` and ``args.data_parallel_size``.
    """
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "train_iters", "lr"):
        _require(getattr(args, name) is not None, f"--{name.replace('_', '-')} is required")
    _require(args.hidden_size % args.num_attention_heads == 0,
             "--hidden-size must be divisible by --num-attention-heads")

    # Device.
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.distributed_backend is None:
        args.distributed_backend = "gloo" if args.device == "cpu" else "nccl"
    _require(not (args.device == "cpu" and args.distributed_backend == "nccl"),
             "--distributed-backend nccl needs --device cuda")

    # Parallel sizes.
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.rank = int(os.environ.get("RANK", "0"))
    mp = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    _require(args.world_size % mp == 0,
             f"world size {args.world_size} (WORLD_SIZE) is not divisible by "
             f"--tensor-model-parallel-size {args.tensor_model_parallel_size} x "
             f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}")
    args.data_parallel_size = args.world_size // mp
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        if args.rank == 0:
            print(" > --sequence-parallel has no effect with --tensor-model-parallel-size 1: "
                  "disabled", flush=True)
        args.sequence_parallel = False
    if args.pipeline_model_parallel_size > 1:
        _require(args.num_layers % args.pipeline_model_parallel_size == 0,
                 "--num-layers must be divisible by --pipeline-model-parallel-size")

    # Batch sizes.
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    _require(args.global_batch_size % (args.micro_batch_size * args.data_parallel_size) == 0,
             f"--global-batch-size ({args.global_batch_size}) must be divisible by "
             f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size "
             f"({args.data_parallel_size})")

    # Precision.
    _require(not (args.bf16 and args.fp16), "--bf16 and --fp16 are mutually exclusive")
    import torch

    args.params_dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else torch.float32)
    _resolve_gradient_reduction(args, flags_given(args))
    if args.grad_accum_dtype == "bf16":
        _require(args.bf16, "--grad-accum-dtype bf16 needs --bf16")
        _require(not args.accumulate_allreduce_grads_in_fp32,
                 "--grad-accum-dtype bf16 contradicts --accumulate-allreduce-grads-in-fp32")
        args.accumulate_allreduce_grads_in_fp32 = False
    elif args.bf16 or args.grad_accum_dtype == "fp32":
        # Megatron-LM accumulates bf16 gradients in fp32 (numerically necessary).
        args.accumulate_allreduce_grads_in_fp32 = True

    # Distributed optimizer and overlap.
    if args.overlap_param_gather:
        _require(args.use_distributed_optimizer,
                 "--overlap-param-gather needs --use-distributed-optimizer")
        _require(args.overlap_grad_reduce,
                 "--overlap-param-gather needs --overlap-grad-reduce (as in megatron-core)")
    _require(not args.overlap_param_gather_with_optimizer_step or args.overlap_param_gather,
             "--overlap-param-gather-with-optimizer-step needs --overlap-param-gather")

    # Quantization: sub-flags need their switch (one table: quant.arguments.REQUIRES), then the
    # one place flags become a QuantizationConfig. Then the PaRO strategy: NNN / NNG on
    # megatron-core, the other 12 on the PaRO engine, 'auto' resolved at startup.
    given = flags_given(args)
    try:
        args.quant_config = integration.build_quantization_config(args, given)
        integration.check_strategy_args(args)
    except ValueError as e:
        raise ArgumentError(str(e)) from None

    if args.quant_config.enabled and not integration.uses_sharded_engine(args.paro_strategy):
        _require(args.use_distributed_optimizer,
                 "quantized communication (--quantized-weights / --quantized-gradients / "
                 "--quantized-grad-bits) needs --use-distributed-optimizer")
        dtype_error = integration.weight_quantization_dtype_error(args.quant_config,
                                                                  args.params_dtype)
        _require(dtype_error is None, dtype_error or "")
    # Two-level topology: checked here, once, instead of failing at model build on every rank.
    # The megatron-core quantized path builds its groups from it; an explicit value must make
    # sense whatever the path (the PaRO engine's groups come from --paro-group-size, above).
    if ((args.quant_config.enabled and not integration.uses_sharded_engine(args.paro_strategy))
            or "data_parallel_intra_node_size" in given):
        try:
            args.quant_config.intra_node_size(args.data_parallel_size,
                                              args.tensor_model_parallel_size)
        except integration.TopologyUnknownError:
            pass  # no launcher variable: the runtime counts the ranks per host at model build
        except ValueError as e:
            raise ArgumentError(
                f"{e} (= world size {args.world_size} / (--tensor-model-parallel-size "
                f"{args.tensor_model_parallel_size} x --pipeline-model-parallel-size "
                f"{args.pipeline_model_parallel_size}))") from None

    # Attention: grouped-query heads, then the one resolver of --attention-backend (its choice
    # is kept in args, so checkpoints record it).
    if args.group_query_attention:
        _require(args.num_query_groups >= 1 and args.num_attention_heads % args.num_query_groups == 0,
                 f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
                 f"--num-query-groups ({args.num_query_groups})")
        tp = args.tensor_model_parallel_size
        _require(args.num_query_groups % tp == 0 or tp % args.num_query_groups == 0,
                 f"--num-query-groups ({args.num_query_groups}) must be a multiple or a divisor "
                 f"of --tensor-model-parallel-size ({tp})")
    from .fusions import fusion_plan
    from .layer_specs import resolve_attention

    try:
        args.attention_impl = resolve_attention(args).impl
        fusion_plan(args)   # an explicit fusion flag that cannot be honoured stops the launch here
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    profile_error = validate_profile_args(args)
    _require(profile_error is None, profile_error or "")

    # Model shape defaults.
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute":
        _require(args.max_position_embeddings >= args.seq_length,
                 "--max-position-embeddings must be >= --seq-length")
    if args.ffn_hidden_size is None:
        if args.swiglu:
            args.ffn_hidden_size = max(64, int((4 * args.hidden_size * 2 / 3) / 64) * 64)
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full":
        args.recompute_method = args.recompute_method or "uniform"
        args.recompute_num_layers = args.recompute_num_layers or 1

    # LR schedule.
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    _require(not (args.lr_warmup_fraction is not None and args.lr_warmup_iters),
             "use only one of --lr-warmup-fraction and --lr-warmup-iters")
    if args.lr_warmup_fraction is not None:
        _require(0.0 <= args.lr_warmup_fraction <= 1.0, "--lr-warmup-fraction must be in [0, 1]")
    _require(args.min_lr <= args.lr, "--min-lr must be <= --lr")

    # Data and tokenizer.
    _require(bool(args.data_path) or args.mock_data,
             "give --data-path PREFIX (preprocessed .bin/.idx) or --mock-data")
    _require(not (args.data_path and args.mock_data), "--data-path and --mock-data are exclusive")
    _require(not args.reset_attention_mask,
             "--reset-attention-mask is not supported: attention is causal over the whole "
             "sequence (no per-document mask reaches the attention kernels), so the flag would "
             "change nothing; drop it (--reset-position-ids and --eod-mask-loss work)")
    if args.tokenizer_type is None:
        args.tokenizer_type = "GPT2BPETokenizer" if args.vocab_file else "NullTokenizer"
    if args.tokenizer_type == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
            _require(path is not None, f"GPT2BPETokenizer needs {flag}")
            _require(os.path.isfile(path), f"{flag} {path!r} does not exist")
    elif args.tokenizer_type in ("HuggingFaceTokenizer", *SENTENCEPIECE_TYPES):
        _require(args.tokenizer_model is not None, f"{args.tokenizer_type} needs --tokenizer-model")
        _require(os.path.exists(args.tokenizer_model),
                 f"--tokenizer-model {args.tokenizer_model!r} does not exist")
    elif args.tokenizer_type == "NullTokenizer":
        if args.vocab_size is None:
            args.vocab_size = 1024
        _require(args.vocab_size >= 2, "--vocab-size must be >= 2")
    if args.data_path:
        prefixes, _ = data_blend(args.data_path)
        for prefix in prefixes:
            for ext in (".bin", ".idx"):
                _require(os.path.isfile(prefix + ext), f"data file {prefix + ext!r} does not exist")
    split = [s for s in args.split.replace("/", ",").split(",") if s.strip()]
    _require(len(split) <= 3 and all(_is_number(s) and float(s) >= 0 for s in split)
             and sum(float(s) for s in split) > 0, f"bad --split {args.split!r}")

    # Logging / checkpointing.
    for name in ("log_interval", "eval_iters", "tensorboard_log_interval"):
        _require(getattr(args, name) > 0 or name == "eval_iters",
                 f"--{name.replace('_', '-')} must be positive")
    _require(args.eval_interval is None or args.eval_interval > 0, "--eval-interval must be positive")
    if args.exit_interval is not None:
        _require(args.exit_interval > 0, "--exit-interval must be positive")
    if args.exit_duration_in_mins is not None:
        _require(args.exit_duration_in_mins >= 0, "--exit-duration-in-mins must be >= 0")
    _require(args.exit_signal_handler or "exit_signal" not in flags_given(args),
             "--exit-signal acts under --exit-signal-handler: add it")
    if args.save_interval is not None:
        _require(args.save_interval > 0, "--save-interval must be positive")
        _require(args.save is not None, "--save-interval needs --save DIR")
    if args.ckpt_step is not None:
        _require(args.load is not None, "--ckpt-step needs --load DIR")
        _require(args.ckpt_step >= 0, "--ckpt-step must be >= 0")
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        if launcher_rank() == 0:  # every rank decides the same; one notice per job
            warnings.warn("--wandb-project given but wandb is not installed: W&B logging is off")
        args.wandb_project = ""
    return args


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def data_blend(data_path: List[str]) -> Tuple[List[str], Optional[List[float]]]:
    """Megatron's ``--data-path`` forms: ``PREFIX...`` or ``W1 PREFIX1 W2 PREFIX2 ...``.

    Returns (prefixes, weights or None), the shape megatron-core's ``blend`` config expects.
    """
    if len(data_path) > 1 and _is_number(data_path[0]):
        return list(data_path[1::2]), [float(w) for w in data_path[0::2]]
    return list(data_path), None


def padded_vocab_size(orig_vocab_size: int, args: argparse.Namespace) -> int:
    """Pad the vocabulary so the embedding splits evenly over TP ranks (Megatron semantics)."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    if multiple <= 0:
        return orig_vocab_size
    return ((orig_vocab_size + multiple - 1) // multiple) * multiple


if __name__ == "__main__":  # pragma: no cover - handy for eyeballing the flag list
    build_parser().print_help(sys.stdout)
