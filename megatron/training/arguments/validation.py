"""What a parsed command line must satisfy, and the values derived from it: one rule per
function, grouped by subject, run in the order of :data:`RULES` by :func:`validate_args`.

Why one rule per function: each rule either fills a derived value (world and data-parallel
size, defaults that depend on other flags, ``args.quant_config``, ``args.params_dtype``) or
refuses one bad combination with an :class:`ArgumentError` that says what to change.  The order
matters -- a rule may read what an earlier one derived -- and is the order of :data:`RULES`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import warnings
from typing import Callable, Tuple

from megatron.distributed.quant import integration

from megatron.training.data.blend import data_blend, is_number
from megatron.training.arguments import moe
from megatron.training.arguments.parser import flags_given, launcher_rank
from megatron.training.profiling import validate_profile_args
from megatron.training.data.tokenizer import SENTENCEPIECE_TYPES


class ArgumentError(ValueError):
    """A bad flag combination; the message says what to change."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ArgumentError(msg)


# ----------------------------------------------------------------------------- required
def required_flags_given(args: argparse.Namespace) -> None:
    """The model shape, the batch, the length of the run and the learning rate have no default."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "lr"):
        _require(getattr(args, name) is not None, f"--{name.replace('_', '-')} is required")
    _require((args.train_iters is None) != (args.train_samples is None),
             "give one of --train-iters and --train-samples" if args.train_iters is None else
             "--train-iters and --train-samples are exclusive: give one")


def heads_divide_hidden_size(args: argparse.Namespace) -> None:
    """--hidden-size splits into the heads, unless --kv-channels sets the head size."""
    kv_channels = getattr(args, "kv_channels", None)
    if kv_channels is not None:
        _require(kv_channels > 0, "--kv-channels must be positive")
        return
    _require(args.hidden_size % args.num_attention_heads == 0,
             "--hidden-size must be divisible by --num-attention-heads (or give --kv-channels)")


def rope_scaling_needs_rope(args: argparse.Namespace) -> None:
    """--use-rope-scaling scales RoPE frequencies: it needs --position-embedding-type rope."""
    if getattr(args, "use_rope_scaling", False):
        _require(args.position_embedding_type == "rope",
                 "--use-rope-scaling needs --position-embedding-type rope")
        _require(args.rope_scaling_factor > 0, "--rope-scaling-factor must be positive")


def openai_gelu_not_with_swiglu(args: argparse.Namespace) -> None:
    """--swiglu's activation is SiLU (gated): an --openai-gelu beside it would be ignored."""
    _require(not (getattr(args, "openai_gelu", False) and args.swiglu),
             "--openai-gelu and --swiglu are mutually exclusive: --swiglu's activation is SiLU, "
             "--openai-gelu would be ignored; drop one")


# ----------------------------------------------------------------------------- device
def default_device(args: argparse.Namespace) -> None:
    """--device: cuda when available, else cpu (CPU mode)."""
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"


def default_backend(args: argparse.Namespace) -> None:
    """--distributed-backend: gloo on CPU, nccl on GPU."""
    if args.distributed_backend is None:
        args.distributed_backend = "gloo" if args.device == "cpu" else "nccl"


def nccl_needs_cuda(args: argparse.Namespace) -> None:
    _require(not (args.device == "cpu" and args.distributed_backend == "nccl"),
             "--distributed-backend nccl needs --device cuda")


# ----------------------------------------------------------------------------- parallel sizes
def derive_data_parallel_size(args: argparse.Namespace) -> None:
    """World size and rank from the launcher; the data-parallel size is what TP x PP leaves."""
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.rank = int(os.environ.get("RANK", "0"))
    mp = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    _require(args.world_size % mp == 0,
             f"world size {args.world_size} (WORLD_SIZE) is not divisible by "
             f"--tensor-model-parallel-size {args.tensor_model_parallel_size} x "
             f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}")
    args.data_parallel_size = args.world_size // mp


def sequence_parallel_needs_tensor_parallel(args: argparse.Namespace) -> None:
    """At TP = 1, --sequence-parallel is switched off with a note (as in Megatron-LM)."""
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        if args.rank == 0:
            print(" > --sequence-parallel has no effect with --tensor-model-parallel-size 1: "
                  "disabled", flush=True)
        args.sequence_parallel = False


def layers_divide_over_pipeline(args: argparse.Namespace) -> None:
    if args.pipeline_model_parallel_size > 1:
        _require(args.num_layers % args.pipeline_model_parallel_size == 0,
                 "--num-layers must be divisible by --pipeline-model-parallel-size")


def moe_flags_fit(args: argparse.Namespace) -> None:
    """The MoE flags (:data:`.moe.RULES`: expert parallelism inside the data-parallel ranks,
    the expert MLP size, grouped GEMM installed)."""
    try:
        for rule in moe.RULES:
            rule(args)
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def moe_not_on_paro_engine(args: argparse.Namespace) -> None:
    """The PaRO engine shards dense parameters only: a MoE model trains on megatron-core's DDP
    (the quantized path covers its expert buffers)."""
    if moe.is_moe(args) and integration.uses_sharded_engine(args.paro_strategy):
        raise ArgumentError(
            f"--paro-strategy {args.paro_strategy}: the PaRO engine does not shard expert "
            "parameters (--num-experts); use --paro-strategy NNN or NNG, or none "
            "(megatron-core's distributed optimizer, quantized with the quantization flags)")


# ----------------------------------------------------------------------------- batch sizes
def derive_global_batch_size(args: argparse.Namespace) -> None:
    """Default micro-batch size x DP; else a whole number of micro-batches per DP rank."""
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    _require(args.global_batch_size % (args.micro_batch_size * args.data_parallel_size) == 0,
             f"--global-batch-size ({args.global_batch_size}) must be divisible by "
             f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size "
             f"({args.data_parallel_size})")


def schedule_flags_match_training_unit(args: argparse.Namespace) -> None:
    """Iteration-based runs (--train-iters) take the *-iters schedule flags, sample-based runs
    (--train-samples) the *-samples ones; --rampup-batch-size needs samples (as in Megatron-LM:
    with a growing batch an iteration is no fixed number of samples)."""
    if args.train_iters is not None:
        for flag, given in (("--lr-decay-samples", args.lr_decay_samples is not None),
                            ("--lr-warmup-samples", bool(args.lr_warmup_samples)),
                            ("--lr-wsd-decay-samples", args.lr_wsd_decay_samples is not None)):
            _require(not given, f"{flag} counts samples: use it with --train-samples (with "
                                f"--train-iters give {flag.replace('samples', 'iters')})")
        _require(args.rampup_batch_size is None,
                 "--rampup-batch-size needs sample-based training: give --train-samples instead "
                 "of --train-iters (as in Megatron-LM)")
    else:
        for flag, given in (("--lr-decay-iters", args.lr_decay_iters is not None),
                            ("--lr-warmup-iters", bool(args.lr_warmup_iters)),
                            ("--lr-wsd-decay-iters", args.lr_wsd_decay_iters is not None)):
            _require(not given, f"{flag} counts iterations: with --train-samples give "
                                f"{flag.replace('iters', 'samples')}")


def rampup_batch_size_fits(args: argparse.Namespace) -> None:
    """--rampup-batch-size START INCR SAMPLES: START grows by INCR up to --global-batch-size;
    every batch size on the way is a whole number of micro-batches per data-parallel rank."""
    if args.rampup_batch_size is None:
        return
    start, incr, samples = args.rampup_batch_size
    gbs, unit = args.global_batch_size, args.micro_batch_size * args.data_parallel_size
    _require(start > 0 and incr > 0 and samples >= 0,
             "--rampup-batch-size START INCR SAMPLES: START and INCR must be positive, SAMPLES "
             ">= 0")
    _require(start <= gbs and (gbs - start) % incr == 0,
             f"--rampup-batch-size: --global-batch-size {gbs} must be START {start} plus a whole "
             f"number of INCR {incr}")
    _require(start % unit == 0 and incr % unit == 0,
             f"--rampup-batch-size: START {start} and INCR {incr} must be multiples of "
             f"--micro-batch-size x data-parallel size ({unit})")


def derive_train_iters_from_samples(args: argparse.Namespace) -> None:
    """--train-samples: the iterations that consume them (megatron-core's ramp-up calculator
    gives each iteration's global batch size), as Megatron-LM counts them: the ramp-up steps
    while the samples consumed are at most its SAMPLES, then whole global batches of what is
    left; a partial last batch is not run.

    Every counted step fits in --train-samples (one ending exactly on it counts): the training
    split is sized to exactly --train-samples, so a ramp-up step past it would read samples the
    split does not have."""
    if args.train_samples is None:
        return
    _require(args.train_samples > 0, "--train-samples must be positive")
    iterations, consumed = 0, 0
    if args.rampup_batch_size is not None:
        from megatron.core.num_microbatches_calculator import \
            RampupBatchsizeNumMicroBatchesCalculator

        start, incr, samples = args.rampup_batch_size
        calc = RampupBatchsizeNumMicroBatchesCalculator(   # a local one; rank -1: no log lines
            args.global_batch_size, args.micro_batch_size, args.data_parallel_size, False, -1,
            start, incr, samples)
        while consumed <= samples:
            calc.update(consumed, consistency_check=False)
            batch = calc.get_current_global_batch_size()
            if consumed + batch > args.train_samples:
                break
            consumed += batch
            iterations += 1
    iterations += (args.train_samples - consumed) // args.global_batch_size
    _require(iterations > 0, f"--train-samples {args.train_samples} is less than one global "
                             f"batch ({args.global_batch_size})")
    args.train_iters = iterations


# ----------------------------------------------------------------------------- precision
def one_half_precision(args: argparse.Namespace) -> None:
    _require(not (args.bf16 and args.fp16), "--bf16 and --fp16 are mutually exclusive")


def derive_params_dtype(args: argparse.Namespace) -> None:
    """``args.params_dtype``: bf16, fp16 or fp32."""
    import torch

    args.params_dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else torch.float32)


def grad_reduce_in_bf16_means_bf16_accumulation(args: argparse.Namespace) -> None:
    """``--grad-reduce-in-bf16`` is Megatron-LM's name for what ``--grad-accum-dtype bf16`` says
    (megatron-core has one grad buffer: the dtype gradients accumulate in is the dtype they are
    reduced in); it becomes ``--grad-accum-dtype bf16``, and an explicit fp32 request
    contradicts it."""
    if args.grad_reduce_in_bf16:
        given = flags_given(args)
        _require(args.bf16, "--grad-reduce-in-bf16 needs --bf16")
        _require(args.grad_accum_dtype != "fp32",
                 "--grad-reduce-in-bf16 contradicts --grad-accum-dtype fp32")
        _require("accumulate_allreduce_grads_in_fp32" not in given,
                 "--grad-reduce-in-bf16 contradicts --accumulate-allreduce-grads-in-fp32")
        args.grad_accum_dtype = "bf16"


def fp32_accumulating_reduce_scatter_fits(args: argparse.Namespace) -> None:
    """megatron-core's bf16-wire / fp32-sum reduce-scatter needs the distributed optimizer and
    bf16 gradients; the quantized reduce-scatter (``--quantized-gradients``) replaces it, and it
    only sums, so it excludes ``--ddp-average-in-collective`` (which otherwise combines with
    everything: the quantized collectives divide after their fp32 sum)."""
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


def megatron_core_ddp_options_not_on_paro_engine(args: argparse.Namespace) -> None:
    """PaRO-engine strategies have their own collectives: megatron-core's DDP options are
    refused there."""
    mcore_only = [f for f, on in (("--ddp-reduce-scatter-with-fp32-accumulation",
                                    args.ddp_reduce_scatter_with_fp32_accumulation),
                                   ("--ddp-average-in-collective", args.ddp_average_in_collective))
                   if on]
    _require(not (mcore_only and integration.uses_sharded_engine(args.paro_strategy)),
             f"{', '.join(mcore_only)}: megatron-core DDP options; --paro-strategy "
             f"{args.paro_strategy} may train on the PaRO engine, which has its own collectives")


def derive_grad_accumulation_dtype(args: argparse.Namespace) -> None:
    """bf16 accumulation needs --bf16; otherwise bf16 gradients accumulate in fp32 (as in
    Megatron-LM: numerically necessary)."""
    if args.grad_accum_dtype == "bf16":
        _require(args.bf16, "--grad-accum-dtype bf16 needs --bf16")
        _require(not args.accumulate_allreduce_grads_in_fp32,
                 "--grad-accum-dtype bf16 contradicts --accumulate-allreduce-grads-in-fp32")
        args.accumulate_allreduce_grads_in_fp32 = False
    elif args.bf16 or args.grad_accum_dtype == "fp32":
        # Megatron-LM accumulates bf16 gradients in fp32 (numerically necessary).
        args.accumulate_allreduce_grads_in_fp32 = True


# ----------------------------------------------------------------------------- overlap
def overlap_param_gather_needs_overlapped_distributed_optimizer(args: argparse.Namespace) -> None:
    if args.overlap_param_gather:
        _require(args.use_distributed_optimizer,
                 "--overlap-param-gather needs --use-distributed-optimizer")
        _require(args.overlap_grad_reduce,
                 "--overlap-param-gather needs --overlap-grad-reduce (as in megatron-core)")


def overlap_with_optimizer_step_needs_overlap_param_gather(args: argparse.Namespace) -> None:
    _require(not args.overlap_param_gather_with_optimizer_step or args.overlap_param_gather,
             "--overlap-param-gather-with-optimizer-step needs --overlap-param-gather")


# ----------------------------------------------------------------------------- quantization
def derive_quantization_config(args: argparse.Namespace) -> None:
    """Sub-flags need their switch (one table: quant.arguments.REQUIRES), then the one place
    flags become a QuantizationConfig (``args.quant_config``)."""
    try:
        args.quant_config = integration.build_quantization_config(args, flags_given(args))
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    # the trainer's record of --paro-strategy, as the config resolved it (name, group size)
    args.paro_strategy = args.quant_config.paro.strategy
    args.paro_group_size = args.quant_config.paro.group_size


def check_paro_strategy(args: argparse.Namespace) -> None:
    """--paro-strategy: NNN / NNG on megatron-core, the other 12 on the PaRO engine, 'auto'
    resolved at startup."""
    try:
        integration.check_strategy_args(args)
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def quantized_megatron_core_path_fits(args: argparse.Namespace) -> None:
    """The megatron-core quantized path quantizes the distributed optimizer's collectives, in a
    parameter dtype it supports."""
    if args.quant_config.enabled and not integration.uses_sharded_engine(args.paro_strategy):
        _require(args.use_distributed_optimizer,
                 "quantized communication (--quantized-weights / --quantized-gradients / "
                 "--quantized-grad-bits) needs --use-distributed-optimizer")
        dtype_error = integration.weight_quantization_dtype_error(args.quant_config,
                                                                  args.params_dtype)
        _require(dtype_error is None, dtype_error or "")


def two_level_topology_fits_world(args: argparse.Namespace) -> None:
    """Checked here, once, instead of failing at model build on every rank.  The megatron-core
    quantized path builds its groups from it; an explicit value must make sense whatever the
    path (the PaRO engine's groups come from --paro-group-size)."""
    if ((args.quant_config.enabled and not integration.uses_sharded_engine(args.paro_strategy))
            or "data_parallel_intra_node_size" in flags_given(args)):
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


# ----------------------------------------------------------------------------- attention, kernels
def query_groups_divide_heads(args: argparse.Namespace) -> None:
    """Key/value head groups divide the heads, and split evenly over (or share) TP ranks."""
    if args.group_query_attention:
        _require(args.num_query_groups >= 1 and args.num_attention_heads % args.num_query_groups == 0,
                 f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
                 f"--num-query-groups ({args.num_query_groups})")
        tp = args.tensor_model_parallel_size
        _require(args.num_query_groups % tp == 0 or tp % args.num_query_groups == 0,
                 f"--num-query-groups ({args.num_query_groups}) must be a multiple or a divisor "
                 f"of --tensor-model-parallel-size ({tp})")


def resolve_attention_backend(args: argparse.Namespace) -> None:
    """The one resolver of --attention-backend; its choice is kept in args (``attention_impl``),
    so checkpoints record it."""
    from megatron.training.model.layer_specs import resolve_attention

    try:
        args.attention_impl = resolve_attention(args).impl
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def requested_fusions_available(args: argparse.Namespace) -> None:
    """An explicit fusion flag that cannot be honoured stops the launch here."""
    from megatron.training.model.fusions import fusion_plan

    try:
        fusion_plan(args)
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def per_token_loss_fits(args: argparse.Namespace) -> None:
    """--calculate-per-token-loss sums the gradients and divides by the global token count in
    megatron-core's finalize_model_grads: not with an averaging collective, nor on the PaRO
    engine (its gradient sync has no token count)."""
    if args.calculate_per_token_loss:
        _require(not args.ddp_average_in_collective,
                 "--calculate-per-token-loss contradicts --ddp-average-in-collective: the "
                 "gradients are summed, then divided by the token count")
        _require(not integration.uses_sharded_engine(args.paro_strategy),
                 f"--calculate-per-token-loss: --paro-strategy {args.paro_strategy} may train on "
                 "the PaRO engine, whose gradient sync has no per-token scaling")


def old_attention_spellings(args: argparse.Namespace) -> None:
    """Megatron-LM's older attention flags become --attention-backend: --use-flash-attn is
    flash, --transformer-impl local is local (transformer_engine is the default choice)."""
    given = flags_given(args)
    for flag, on, backend in (("--use-flash-attn", args.use_flash_attn, "flash"),
                              ("--transformer-impl local", args.transformer_impl == "local",
                               "local")):
        if not on:
            continue
        _require("attention_backend" not in given or args.attention_backend == backend,
                 f"{flag} means --attention-backend {backend}, not {args.attention_backend}")
        args.attention_backend = backend


def _transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


UNSUPPORTED_MEGATRON_LM_FEATURES: Tuple[Tuple[str, Callable[[argparse.Namespace], bool],
                                              Callable[[], str]], ...] = (
    ("--fp8-format / --fp8-*", lambda a: a.fp8_format is not None or a.fp8_param_gather or any(
        getattr(a, d) is not None for d in ("fp8_margin", "fp8_interval", "fp8_amax_history_len",
                                             "fp8_amax_compute_algo")),
     lambda: ("FP8 training needs Transformer Engine's FP8 layers, and Transformer Engine is not "
              "installed" if not _transformer_engine_installed() else
              "FP8 training (Transformer Engine's fp8_autocast) is not driven by this trainer")
     + "; train in --bf16 (the 4-bit communication is independent of it)"),
    ("--use-torch-fsdp2", lambda a: a.use_torch_fsdp2,
     lambda: "torch FSDP2 is not supported: shard with --use-distributed-optimizer (ZeRO-1) or "
             "a --paro-strategy"),
    ("--use-checkpoint-args", lambda a: a.use_checkpoint_args,
     lambda: "not supported: give the model flags on the command line or with "
             "--model-args-file (a checkpoint of another shape is refused at --load)"),
    ("--context-parallel-size", lambda a: a.context_parallel_size != 1,
     lambda: "context parallelism is not supported: only 1"),
    ("--dataloader-type", lambda a: a.dataloader_type != "single",
     lambda: "only 'single': this trainer's resumable sequential sampler (cyclic's shuffled "
             "epochs and external loaders are not supported)"),
    ("--rerun-mode", lambda a: a.rerun_mode != "disabled",
     lambda: "only 'disabled': this trainer has no rerun state machine (a NaN/Inf step is "
             "skipped and counted instead)"),
    ("--no-position-embedding", lambda a: (not a.add_position_embedding
                                           and a.position_embedding_type != "rope"),
     lambda: "a model without position information is not supported: use it with "
             "--position-embedding-type rope (where it changes nothing)"),
)
"""(flag, given?, why) of each Megatron-LM feature this trainer parses but does not have."""


def unsupported_megatron_lm_features(args: argparse.Namespace) -> None:
    """A Megatron-LM flag of a feature this trainer does not have stops the launch with why."""
    for flag, given, why in UNSUPPORTED_MEGATRON_LM_FEATURES:
        _require(not given(args), f"{flag}: {why()}")


def profile_flags_valid(args: argparse.Namespace) -> None:
    profile_error = validate_profile_args(args)
    _require(profile_error is None, profile_error or "")


# ----------------------------------------------------------------------------- model shape
def position_table_covers_sequence(args: argparse.Namespace) -> None:
    """Default --seq-length; a learned position table must cover a sample."""
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute":
        _require(args.max_position_embeddings >= args.seq_length,
                 "--max-position-embeddings must be >= --seq-length")


def default_ffn_hidden_size(args: argparse.Namespace) -> None:
    """Default 4 x hidden, or 8/3 x hidden rounded down to 64 with --swiglu."""
    if args.ffn_hidden_size is None:
        if args.swiglu:
            args.ffn_hidden_size = max(64, int((4 * args.hidden_size * 2 / 3) / 64) * 64)
        else:
            args.ffn_hidden_size = 4 * args.hidden_size


def derive_recompute_settings(args: argparse.Namespace) -> None:
    """--recompute-activations is selective recomputation; full recomputation defaults to
    uniform over 1 layer."""
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full":
        args.recompute_method = args.recompute_method or "uniform"
        args.recompute_num_layers = args.recompute_num_layers or 1


# ----------------------------------------------------------------------------- learning rate
def default_lr_decay_iters(args: argparse.Namespace) -> None:
    """The decay horizon defaults to the whole run (--train-iters, or --train-samples)."""
    if args.train_samples is None:
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
    elif args.lr_decay_samples is None:
        args.lr_decay_samples = args.train_samples


def one_warmup_flag(args: argparse.Namespace) -> None:
    """One of --lr-warmup-fraction (in [0, 1]) and --lr-warmup-iters / --lr-warmup-samples."""
    _require(not (args.lr_warmup_fraction is not None and args.lr_warmup_iters),
             "use only one of --lr-warmup-fraction and --lr-warmup-iters")
    _require(not (args.lr_warmup_fraction is not None and args.lr_warmup_samples),
             "use only one of --lr-warmup-fraction and --lr-warmup-samples")
    if args.lr_warmup_fraction is not None:
        _require(0.0 <= args.lr_warmup_fraction <= 1.0, "--lr-warmup-fraction must be in [0, 1]")


def derive_lr_schedule_steps(args: argparse.Namespace) -> None:
    """The one translation of the schedule flags into megatron-core's OptimizerParamScheduler
    steps, which count samples: ``args.lr_decay_steps``, ``args.lr_warmup_steps``,
    ``args.lr_wsd_decay_steps`` (None unless WSD) and ``args.wd_incr_steps``.  Iteration flags
    are multiplied by --global-batch-size (as in Megatron-LM)."""
    gbs = args.global_batch_size
    if args.train_samples is None:
        unit, decay, wsd = "iters", args.lr_decay_iters * gbs, args.lr_wsd_decay_iters
        warmup, wsd = args.lr_warmup_iters * gbs, (wsd * gbs if wsd is not None else None)
        args.wd_incr_steps = args.train_iters * gbs
    else:
        unit, decay, wsd = "samples", args.lr_decay_samples, args.lr_wsd_decay_samples
        warmup = args.lr_warmup_samples
        args.wd_incr_steps = args.train_samples
    if args.lr_warmup_fraction is not None:
        warmup = int(args.lr_warmup_fraction * decay)
    _require(decay > 0, f"--lr-decay-{unit} must be positive")
    _require(warmup < decay, f"the warmup ({warmup} samples) must be shorter than the decay "
                             f"horizon ({decay} samples, --lr-decay-{unit})")
    if args.lr_decay_style == "WSD":
        _require(wsd is not None, f"--lr-decay-style WSD needs --lr-wsd-decay-{unit}: the "
                                  "length of its decay phase")
        _require(0 < wsd <= decay, f"--lr-wsd-decay-{unit} must be positive and at most the "
                                   f"decay horizon (--lr-decay-{unit})")
    else:
        wsd = None
    args.lr_decay_steps, args.lr_warmup_steps, args.lr_wsd_decay_steps = decay, warmup, wsd


def decoupled_lr_fits(args: argparse.Namespace) -> None:
    """--decoupled-lr is megatron-core's optimizer's (not the PaRO engine's); its minimum needs
    it."""
    _require(args.decoupled_min_lr is None or args.decoupled_lr is not None,
             "--decoupled-min-lr needs --decoupled-lr")
    _require(args.decoupled_lr is None or not integration.uses_sharded_engine(args.paro_strategy),
             f"--decoupled-lr: megatron-core's optimizer option; --paro-strategy "
             f"{args.paro_strategy} may train on the PaRO engine, whose optimizer has one "
             "learning rate")


def one_scheduler_resume_policy(args: argparse.Namespace) -> None:
    _require(not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
             "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are "
             "exclusive: take this run's schedule or the checkpoint's")


def min_lr_at_most_lr(args: argparse.Namespace) -> None:
    _require(args.min_lr <= args.lr, "--min-lr must be <= --lr")


# ----------------------------------------------------------------------------- data, tokenizer
def one_data_source(args: argparse.Namespace) -> None:
    _require(bool(args.data_path) or args.mock_data,
             "give --data-path PREFIX (preprocessed .bin/.idx) or --mock-data")
    _require(not (args.data_path and args.mock_data), "--data-path and --mock-data are exclusive")


def no_reset_attention_mask(args: argparse.Namespace) -> None:
    _require(not args.reset_attention_mask,
             "--reset-attention-mask is not supported: attention is causal over the whole "
             "sequence (no per-document mask reaches the attention kernels), so the flag would "
             "change nothing; drop it (--reset-position-ids and --eod-mask-loss work)")


def resolve_tokenizer(args: argparse.Namespace) -> None:
    """Default GPT2BPETokenizer with --vocab-file, else NullTokenizer; the files each type
    needs exist (NullTokenizer: a vocabulary of at least 2, default 1024)."""
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


def data_files_exist(args: argparse.Namespace) -> None:
    """Every --data-path prefix has its .bin and .idx."""
    if args.data_path:
        prefixes, _ = data_blend(args.data_path)
        for prefix in prefixes:
            for ext in (".bin", ".idx"):
                _require(os.path.isfile(prefix + ext), f"data file {prefix + ext!r} does not exist")


def split_weights_valid(args: argparse.Namespace) -> None:
    """--split: at most three non-negative weights, not all zero."""
    weights = [s for s in args.split.replace("/", ",").split(",") if s.strip()]
    _require(len(weights) <= 3 and all(is_number(s) and float(s) >= 0 for s in weights)
             and sum(float(s) for s in weights) > 0, f"bad --split {args.split!r}")


# ----------------------------------------------------------------------------- logging, checkpointing
def positive_intervals(args: argparse.Namespace) -> None:
    for name in ("log_interval", "eval_iters", "tensorboard_log_interval"):
        _require(getattr(args, name) > 0 or name == "eval_iters",
                 f"--{name.replace('_', '-')} must be positive")
    _require(args.eval_interval is None or args.eval_interval > 0, "--eval-interval must be positive")


def exit_flags_valid(args: argparse.Namespace) -> None:
    """--exit-interval positive, --exit-duration-in-mins not negative, --exit-signal only under
    --exit-signal-handler."""
    if args.exit_interval is not None:
        _require(args.exit_interval > 0, "--exit-interval must be positive")
    if args.exit_duration_in_mins is not None:
        _require(args.exit_duration_in_mins >= 0, "--exit-duration-in-mins must be >= 0")
    _require(args.exit_signal_handler or "exit_signal" not in flags_given(args),
             "--exit-signal acts under --exit-signal-handler: add it")


def save_interval_needs_save(args: argparse.Namespace) -> None:
    if args.save_interval is not None:
        _require(args.save_interval > 0, "--save-interval must be positive")
        _require(args.save is not None, "--save-interval needs --save DIR")


def ckpt_step_needs_load(args: argparse.Namespace) -> None:
    if args.ckpt_step is not None:
        _require(args.load is not None, "--ckpt-step needs --load DIR")
        _require(args.ckpt_step >= 0, "--ckpt-step must be >= 0")


def wandb_off_without_wandb(args: argparse.Namespace) -> None:
    """--wandb-project without wandb installed: W&B logging off, with one notice per job."""
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        if launcher_rank() == 0:  # every rank decides the same; one notice per job
            warnings.warn("--wandb-project given but wandb is not installed: W&B logging is off")
        args.wandb_project = ""


RULES: Tuple[Callable[[argparse.Namespace], None], ...] = (
    # required
    required_flags_given, heads_divide_hidden_size,
    # device
    default_device, default_backend, nccl_needs_cuda,
    # parallel sizes
    derive_data_parallel_size, sequence_parallel_needs_tensor_parallel,
    layers_divide_over_pipeline,
    # batch sizes
    derive_global_batch_size, schedule_flags_match_training_unit, rampup_batch_size_fits,
    derive_train_iters_from_samples,
    # precision
    one_half_precision, derive_params_dtype, grad_reduce_in_bf16_means_bf16_accumulation,
    fp32_accumulating_reduce_scatter_fits, megatron_core_ddp_options_not_on_paro_engine,
    derive_grad_accumulation_dtype,
    # overlap
    overlap_param_gather_needs_overlapped_distributed_optimizer,
    overlap_with_optimizer_step_needs_overlap_param_gather,
    # quantization
    derive_quantization_config, check_paro_strategy, moe_not_on_paro_engine,
    quantized_megatron_core_path_fits,
    two_level_topology_fits_world,
    # attention, kernels
    query_groups_divide_heads, old_attention_spellings, resolve_attention_backend,
    requested_fusions_available, per_token_loss_fits, unsupported_megatron_lm_features,
    profile_flags_valid,
    # model shape
    position_table_covers_sequence, default_ffn_hidden_size, moe_flags_fit,
    derive_recompute_settings,
    rope_scaling_needs_rope, openai_gelu_not_with_swiglu,
    # learning rate
    default_lr_decay_iters, one_warmup_flag, min_lr_at_most_lr, derive_lr_schedule_steps,
    decoupled_lr_fits, one_scheduler_resume_policy,
    # data, tokenizer
    one_data_source, no_reset_attention_mask, resolve_tokenizer, data_files_exist,
    split_weights_valid,
    # logging, checkpointing
    positive_intervals, exit_flags_valid, save_interval_needs_save, ckpt_step_needs_load,
    wandb_off_without_wandb,
)
"""Every rule, in the order they run (a rule may read what an earlier one derived)."""


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill derived values (world/DP size, defaults) and reject bad combinations.

    Raises :class:`ArgumentError` with the fix in the message.  Sets ``args.quant_config``
    (the one :class:`QuantizationConfig`), ``args.params_dtype`` and ``args.data_parallel_size``.
    """
    for rule in RULES:
        rule(args)
    return args
