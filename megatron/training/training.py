"""GPT pretraining loop on megatron-core 0.16.1 (our own code; Megatron-LM semantics).

What it builds, in order: TransformerConfig -> GPTModel (TE spec when transformer_engine is
importable and we are on GPU, else megatron-core's local spec) -> Float16Module (bf16/fp16) ->
data-parallel wrapper via ``integration.wrap_model`` (megatron-core DDP, or the PaRO engine for
``--paro-strategy`` other than NNN / NNG; the loop below is the same) -> optimizer via
``integration.build_optimizer`` + OptimizerParamScheduler.  Data come from megatron-core's
BlendedMegatronDatasetBuilder (GPTDataset, or MockGPTDataset with --mock-data) through a
consumed-samples-aware sampler (:mod:`.sampler`) so a resumed run sees exactly the batches the
uninterrupted run would have seen.

Why our own optimizer step (:func:`optimizer_step`): megatron-core only skips a step on fp16
overflow; with bf16 a NaN/Inf gradient would be applied.  We use the optimizer's own building
blocks (prepare_grads / get_grad_norm / clip / step_with_ready_grads) and skip when the global
grad norm is not finite, counting it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
import weakref
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron.distributed.quant import failures, integration

from . import checkpointing, save_guard
from .errors import StartupError
from .arguments import padded_vocab_size
from .fusions import apply_optimizer_fusions, fusion_plan
from .layer_specs import attention_choice, config_attention_backend, gpt_layer_spec
from .logging_utils import MetricsLogger, print_rank_0
from .profiling import StepProfiler, memory_report
from .sampler import build_data_iterator
from .throughput import tflops_per_gpu
from .tokenizer import build_tokenizer


# ----------------------------------------------------------------------------- configs
def build_transformer_config(args: argparse.Namespace):
    """Megatron-LM flags -> megatron-core TransformerConfig (fusions from :mod:`.fusions`)."""
    from megatron.core.transformer import TransformerConfig

    cpu = args.device == "cpu"
    kwargs: Dict[str, Any] = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        num_query_groups=(args.num_query_groups
                          if getattr(args, "group_query_attention", False) else None),
        attention_backend=config_attention_backend(args),
        init_method_std=args.init_method_std, layernorm_epsilon=args.layernorm_epsilon,
        normalization=args.normalization, gated_linear_unit=args.swiglu,
        add_bias_linear=args.add_bias_linear,
        bf16=args.bf16, fp16=args.fp16, params_dtype=args.params_dtype,
        pipeline_dtype=args.params_dtype,
        use_cpu_initialization=args.use_cpu_initialization or cpu,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        # Fused kernels: what is installed decides (fusions.py; none on CPU).
        **fusion_plan(args).transformer_config_kwargs(),
    )
    if args.swiglu:
        import torch.nn.functional as F

        kwargs["activation_func"] = F.silu
    return TransformerConfig(**kwargs)


def build_ddp_config(args: argparse.Namespace):
    from megatron.core.distributed import DistributedDataParallelConfig

    kwargs = dict(grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
                  overlap_grad_reduce=args.overlap_grad_reduce,
                  overlap_param_gather=args.overlap_param_gather,
                  use_distributed_optimizer=args.use_distributed_optimizer,
                  reduce_scatter_with_fp32_accumulation=(
                      args.ddp_reduce_scatter_with_fp32_accumulation),
                  average_in_collective=args.ddp_average_in_collective,
                  check_for_nan_in_grad=False)
    if args.ddp_bucket_size is not None:
        kwargs["bucket_size"] = args.ddp_bucket_size
    return DistributedDataParallelConfig(**kwargs)


def build_optimizer_config(args: argparse.Namespace):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr,
        weight_decay=args.weight_decay, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps, sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad,
        bf16=args.bf16, fp16=args.fp16, params_dtype=args.params_dtype,
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis, use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
        overlap_param_gather_with_optimizer_step=args.overlap_param_gather_with_optimizer_step)


def config_summary(args: argparse.Namespace) -> Dict[str, Any]:
    """Every config the run would build (for --dry-run), as JSON-friendly dicts."""
    from dataclasses import fields

    def as_dict(cfg: Any) -> Dict[str, Any]:
        out = {}
        for f in fields(cfg):
            v = getattr(cfg, f.name, None)
            out[f.name] = v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
        return out

    return {"transformer": as_dict(build_transformer_config(args)),
            "ddp": as_dict(build_ddp_config(args)),
            "optimizer": as_dict(build_optimizer_config(args)),
            "layer_spec": "transformer_engine" if attention_choice(args).uses_te else "local",
            "attention": attention_choice(args).impl}


# ----------------------------------------------------------------------------- model
def model_provider(args: argparse.Namespace, config: Any, vocab_size: int,
                   pre_process: bool, post_process: bool) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel

    return GPTModel(config=config, transformer_layer_spec=gpt_layer_spec(args, config),
                    vocab_size=vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type,
                    rotary_percent=args.rotary_percent, rotary_base=args.rotary_base)


def get_model(args: argparse.Namespace, config: Any, vocab_size: int) -> List[torch.nn.Module]:
    """One model chunk (no virtual pipeline), mixed-precision wrapped, DDP via the integration."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    chunk = model_provider(args, config, vocab_size,
                           pre_process=ps.is_pipeline_first_stage(),
                           post_process=ps.is_pipeline_last_stage())
    if args.device == "cuda":
        chunk.cuda(torch.cuda.current_device())
    if args.bf16 or args.fp16:
        chunk = Float16Module(config, chunk)
    note = integration.resolve_auto_strategy(args, sum(p.numel() for p in chunk.parameters()))
    if note:
        print_rank_0(f" > --paro-strategy {note}")
    return integration.wrap_model(config, build_ddp_config(args), [chunk], args.quant_config,
                                  strategy=args.paro_strategy, group_size=args.paro_group_size)


def configure_schedule(args: argparse.Namespace, config: Any, model: List[torch.nn.Module],
                       optimizer: Any) -> None:
    """The hooks megatron-core's schedule calls: loss scaling, gradient finalization, no_sync."""
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = integration.finalize_model_grads_func(model)
    config.no_sync_func = model[0].no_sync
    if args.overlap_grad_reduce:
        config.grad_sync_func = model[0].start_grad_sync
    config.timers = None


def get_optimizer_and_scheduler(args: argparse.Namespace, model: List[torch.nn.Module]):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = integration.build_optimizer(build_optimizer_config(args), model, args.quant_config)
    apply_optimizer_fusions(fusion_plan(args), optimizer)
    gbs = args.global_batch_size
    decay_steps = args.lr_decay_iters * gbs
    if args.lr_warmup_fraction is not None:
        warmup_steps = int(args.lr_warmup_fraction * decay_steps)
    else:
        warmup_steps = args.lr_warmup_iters * gbs
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=False)
    return optimizer, scheduler


# ----------------------------------------------------------------------------- data
def build_datasets(args: argparse.Namespace, tokenizer: Any):
    """(train, validation, None) for the whole run: see :mod:`megatron.training.data`, which
    checks the .bin/.idx files and the --split before megatron-core builds (no hang, clear error)."""
    from .data import build_datasets as build_checked_datasets

    return build_checked_datasets(args, tokenizer)


# ----------------------------------------------------------------------------- steps
def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Token-mean LM loss; reports [sum, count] so the average is exact across microbatches/DP."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().clone(), mask.sum().detach()])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(args: argparse.Namespace, data_iterator: Iterator, model: torch.nn.Module):
    batch = next(data_iterator)
    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else None
    tokens = batch["tokens"]
    labels = batch["labels"]
    loss_mask = batch["loss_mask"]
    position_ids = batch["position_ids"]
    if dev is not None:
        tokens, labels, loss_mask, position_ids = (t.to(dev, non_blocking=True) for t in
                                                   (tokens, labels, loss_mask, position_ids))
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(loss_func, loss_mask)


def _sum_losses(losses_reduced: List[Dict[str, torch.Tensor]],
                device: torch.device) -> torch.Tensor:
    """[sum of LM losses, token count] over microbatches and DP ranks, broadcast from the last PP
    stage; on the device, not read back (see :func:`_mean_loss`)."""
    from megatron.core import parallel_state as ps

    total = torch.zeros(2, dtype=torch.float64, device=device)
    for d in losses_reduced:
        total += d["lm loss"].to(device=device, dtype=torch.float64)
    if ps.is_pipeline_last_stage():
        torch.distributed.all_reduce(total, group=ps.get_data_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        src = ps.get_pipeline_model_parallel_last_rank()
        torch.distributed.broadcast(total, src=src, group=ps.get_pipeline_model_parallel_group())
    return total


def _mean_loss(total: torch.Tensor) -> float:
    """The mean LM loss of a :func:`_sum_losses` total (reads the device)."""
    return float(total[0] / torch.clamp(total[1], min=1.0))


def _reduce_losses(losses_reduced: List[Dict[str, torch.Tensor]], device: torch.device) -> float:
    """Average LM loss over microbatches and DP ranks, broadcast from the last PP stage."""
    return _mean_loss(_sum_losses(losses_reduced, device))


def optimizer_step(optimizer: Any, before_update: Optional[Callable[[], None]] = None
                   ) -> Tuple[bool, Optional[float], str]:
    """Step unless the gradients overflowed (fp16) or their global norm is not finite.

    Returns (update_successful, grad_norm, reason) with reason in {'', 'overflow', 'nan'}.
    Mirrors megatron-core's MixedPrecisionOptimizer/ChainedOptimizer.step, plus the NaN check.

    ``before_update`` runs once, when the verdict is known and before the update is queued (or
    at return when there is none): the host has just waited for the device there (the gradient
    norm, or the non-finite agreement), so a read of the device in it waits for nothing more.

    The reason is the same on every path for the same event (every rank agrees on it: the
    verdicts below are all-reduced): 'overflow' only under fp16 loss scaling (the grad scaler
    found Inf/NaN and lowered the scale -- Megatron-LM's skipped-not-NaN case); any other
    non-finite gradient is 'nan' -- a non-finite global norm (megatron-core baseline, PaRO
    engine), or, without a loss scaler, ``prepare_grads`` reporting ``found_inf``, which then
    only the quantized reduce-scatter can have raised (it met NaN/Inf and did not sum).
    """
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    before_update = before_update or (lambda: None)
    if optimizer.prepare_grads():
        before_update()
        if _has_loss_scaler(optimizer):
            return False, None, "overflow"
        return False, float("nan"), "nan"
    grad_norm = optimizer.get_grad_norm()
    grad_norm = float(grad_norm) if grad_norm is not None else None
    before_update()
    if grad_norm is not None and not math.isfinite(grad_norm):
        return False, grad_norm, "nan"
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0.0:
            continue
        params = opt.get_parameters()
        if len(params) == 0:
            continue
        clip_grad_by_total_norm_fp32(
            params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
            use_decoupled_grad=getattr(opt.config,
                                       "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))
    ok = optimizer.step_with_ready_grads()
    return bool(ok), grad_norm, ""


def _has_loss_scaler(optimizer: Any) -> bool:
    """True when a (leaf) optimizer scales the loss (fp16): its ``found_inf`` is an overflow."""
    leaves = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return any(getattr(opt, "grad_scaler", None) is not None for opt in leaves)


def step_outcome(ok: bool, reason: str, loss: float) -> Tuple[bool, bool]:
    """(skipped, nan) of one iteration: the one rule behind Megatron's two counters.

    skipped: the optimizer did not update (NaN/Inf gradients or an fp16 overflow); nan: the
    gradients were non-finite (``reason == 'nan'``, identical on every engine and quantization
    mode, see :func:`optimizer_step`) or the loss was -- a NaN step counts in both, as in
    Megatron-LM.
    """
    return (not ok), (reason == "nan" or not math.isfinite(loss))


def _loss_scale(optimizer: Any) -> float:
    """The loss scale. Without a grad scaler (bf16, fp32, the PaRO engine) it is 1.0, and it is
    not read from the device: megatron-core keeps that constant in a CUDA tensor, and reading it
    back is a host synchronisation (two per step before, one of them after the update)."""
    if not _has_loss_scaler(optimizer):
        return 1.0
    try:
        return float(optimizer.get_loss_scale())
    except Exception:
        return 1.0


_LOSS_SCALE_AFTER_LAST_STEP: "weakref.WeakKeyDictionary[Any, float]" = weakref.WeakKeyDictionary()
"""fp16: per optimizer, the loss scale its last step left (megatron-core keeps it in a device
tensor). Read inside ``before_update``, where the host has already waited for the device, it is
the next step's "scale before" without a read that would wait for the backward (before) or the
update (after)."""


def _current_loss_scale(optimizer: Any) -> float:
    """The loss scale for the log: the value the last step read (no device read after the
    update is queued), else :func:`_loss_scale`."""
    cached = _LOSS_SCALE_AFTER_LAST_STEP.get(optimizer)
    return cached if cached is not None else _loss_scale(optimizer)


def train_step(args, forward_step_func, data_iterator, model, optimizer, scheduler, device):
    """One optimizer step over num_microbatches micro-batches."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    fwd_bwd = get_forward_backward_func()
    losses = fwd_bwd(forward_step_func=forward_step_func, data_iterator=data_iterator,
                     model=model, num_microbatches=get_num_microbatches(),
                     seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                     decoder_seq_length=args.seq_length, forward_only=False)
    # The loss reduction is queued now and read inside optimizer_step, right after the gradient
    # norm has waited for the device. Read after the update, it would make the host wait for the
    # optimizer instead of queuing the next iteration behind it; read right here, it would stop
    # the host before it queues the gradient-norm work. On a GPU nothing in this file reads the
    # device after the update is queued (tests/test_step_syncs.py).
    total = _sum_losses(losses, device)
    read: List[float] = []
    scaled = _has_loss_scaler(optimizer)
    # fp16: the scale this step's gradients were scaled by is the one the previous step left
    # (read then, inside before_update); only the first step reads it here.
    scale_before = _LOSS_SCALE_AFTER_LAST_STEP.get(optimizer) if scaled else 1.0
    if scale_before is None:
        scale_before = _loss_scale(optimizer)

    def before_update() -> None:
        read.append(_mean_loss(total))
        if scaled:  # prepare_grads has updated the scale by now
            _LOSS_SCALE_AFTER_LAST_STEP[optimizer] = _loss_scale(optimizer)

    ok, grad_norm, reason = optimizer_step(optimizer, before_update=before_update)
    loss = read[0]
    scale_after = _LOSS_SCALE_AFTER_LAST_STEP.get(optimizer, 1.0) if scaled else 1.0
    if ok:
        scheduler.step(increment=args.global_batch_size)
        if scale_after != scale_before:  # fp16 dynamic scale grew: keep LoCo errors in scaled units
            integration.on_loss_scale_changed(model, scale_after / scale_before)
    else:
        ratio = (scale_after / scale_before) if reason == "overflow" else None
        integration.on_step_skipped(model, ratio)
    return loss, ok, grad_norm, reason


def evaluate(args, forward_step_func, data_iterator, model, device) -> Optional[float]:
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if data_iterator is None or args.eval_iters <= 0:
        return None
    for chunk in model:
        chunk.eval()
    total = []
    with torch.no_grad():
        for _ in range(args.eval_iters):
            losses = get_forward_backward_func()(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
                forward_only=True)
            total.append(_reduce_losses(losses, device))
    for chunk in model:
        chunk.train()
    return sum(total) / len(total)


# ----------------------------------------------------------------------------- loop
@dataclasses.dataclass
class LogInterval:
    """What the iterations since the last log line add up to (Megatron-LM's line averages over
    them).

    The rates divide by the iterations actually run, not by ``--log-interval``: the first
    interval after a resume from an iteration that is not a multiple of it (a save on a signal,
    ``--exit-interval``, ``--save-interval`` off the log grid) is shorter, and dividing its time
    by the flag over-reported tokens/s and TFLOP/s."""

    iterations: int = 0
    time_s: float = 0.0
    loss_sum: float = 0.0
    finite_losses: int = 0
    skipped: int = 0
    nan: int = 0

    def add(self, loss: float, seconds: float, skipped: bool, is_nan: bool) -> None:
        """One iteration. The logged loss is the mean of the interval's finite forward losses: a
        step skipped for NaN/Inf gradients (a 'nan' iteration) still ran a finite forward when
        only its gradients were poisoned, and that loss is real; a loss the forward itself made
        non-finite is left out, and an interval with none left prints NAN."""
        self.iterations += 1
        self.time_s += seconds
        self.skipped += int(skipped)
        self.nan += int(is_nan)
        if math.isfinite(loss):
            self.loss_sum += loss
            self.finite_losses += 1

    def ms_per_iteration(self) -> float:
        return 1000.0 * self.time_s / self.iterations if self.iterations else 0.0

    def mean_loss(self) -> float:
        return self.loss_sum / self.finite_losses if self.finite_losses else float("nan")

    def tokens_per_s(self, tokens_per_iteration: int) -> float:
        return tokens_per_iteration * self.iterations / self.time_s if self.time_s > 0 else 0.0


def _fmt_log_line(iteration: int, args, consumed: int, ms_per_iter: float, lr: float,
                  loss: float, loss_scale: float, grad_norm: Optional[float], skipped: int,
                  nans: int, tokens_per_s: float, comm: Dict[str, float]) -> str:
    parts = [f" iteration {iteration:8d}/{args.train_iters:8d}",
             f"consumed samples: {consumed:12d}",
             f"elapsed time per iteration (ms): {ms_per_iter:.1f}",
             f"learning rate: {lr:.6E}",
             f"global batch size: {args.global_batch_size:5d}",
             f"lm loss: {loss:.6E}",
             f"loss scale: {loss_scale:.1f}"]
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    parts += [f"number of skipped iterations: {skipped:3d}",
              f"number of nan iterations: {nans:3d}"]
    if args.log_throughput:
        parts.append(f"throughput per GPU (TFLOP/s/GPU): "
                     f"{tflops_per_gpu(args, ms_per_iter / 1000.0):.3f}")
        parts.append(f"throughput (tokens/s): {tokens_per_s:.1f}")
    for k in LOG_LINE_COMM_KEYS:  # the rest goes to --jsonl-log / tensorboard only
        if k in comm:
            parts.append(f"{k}: {comm[k]:.3f}")
    return " | ".join(parts) + " |"


LOG_LINE_COMM_KEYS = ("grad_inter_bits_per_element", "weight_inter_bits_per_element",
                      "comm_grad_exposed_ms", "comm_weight_exposed_ms")
"""The communication figures of the iteration log line, after Megatron-LM's own fields: what
crosses the slow link (bits per element, gradients and weights) and what the step waited for.
The full report (about 30 figures: per link, totals, ratios, errors) is in every ``--jsonl-log``
record and in tensorboard; in the line it made ~2,000 characters per iteration."""


def pretrain(args: argparse.Namespace, forward_step_func=None) -> Dict[str, Any]:
    """Initialize, build, (resume), train, evaluate, save.  Returns the summary dict.

    ``--device cpu``: megatron-core's CUDA touch points are redirected to the CPU for the run
    only (:func:`.cpu_mode.cpu_mode`, left when the run ends, even on an error)."""
    from contextlib import ExitStack

    from .cpu_mode import cpu_mode

    # ``cleanup``: the exit-signal handler and the --save lock, released however the run ends.
    with cpu_mode(args.device == "cpu"), ExitStack() as cleanup:
        cleanup.callback(failures.uninstall)
        try:
            return _pretrain(args, forward_step_func, cleanup)
        except StartupError:
            raise                     # every rank raises it: nobody is left waiting
        except Exception as exc:
            # Posted to every rank (failures.py), so peers blocked in a collective with this
            # rank stop now with this cause instead of at the timeout.
            failure = failures.report("the training loop", exc)
            if failure is exc or isinstance(exc, save_guard.CheckpointWriteError):
                raise
            raise failure from exc


def _pretrain(args: argparse.Namespace, forward_step_func, cleanup: Any) -> Dict[str, Any]:
    from megatron.core import parallel_state as ps

    from .exit_conditions import ExitConditions
    from .initialize import initialize_megatron

    start_time = time.time()
    # Preemption (--exit-signal-handler / --exit-duration-in-mins / --exit-interval): the handler
    # is in place before the (possibly long) startup; the ranks agree at iteration boundaries.
    exits = ExitConditions(args, start_time, rank=int(os.environ.get("RANK", "0")))
    cleanup.callback(exits.release)
    save_guard.install_fork_guard()  # checkpoint-writer processes die with their rank
    initialize_megatron(args)
    # --save: created, writable, one run per directory -- at startup, not at the first save.
    save_dir = save_guard.prepare_save_dir(args.save) if args.save else None
    if save_dir is not None:
        cleanup.callback(save_dir.release)
    for warning in args.quant_config.fidelity_warnings():  # settings the error study flags
        print_rank_0(f"WARNING: {warning}")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    exits.device = device
    if forward_step_func is None:
        forward_step_func = partial(forward_step, args)

    tokenizer = build_tokenizer(args)
    # Data first: a truncated file or an empty split stops the run before the model is built.
    train_ds, valid_ds, _ = build_datasets(args, tokenizer)
    args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args)
    config = build_transformer_config(args)
    model = get_model(args, config, args.padded_vocab_size)
    optimizer, scheduler = get_optimizer_and_scheduler(args, model)

    configure_schedule(args, config, model, optimizer)

    iteration, train_state = 0, {}
    if args.load:
        iteration, train_state = checkpointing.load_checkpoint(args, model, optimizer, scheduler)
        apply_optimizer_fusions(fusion_plan(args), optimizer)
        if iteration:
            print_rank_0(f" loaded checkpoint from {args.load} at iteration {iteration}")
    consumed_train = int(train_state.get("consumed_train_samples", iteration * args.global_batch_size))
    consumed_valid = int(train_state.get("consumed_valid_samples", 0))
    skipped_total = int(train_state.get("skipped_iterations", 0))
    nan_total = int(train_state.get("nan_iterations", 0))

    train_iter = build_data_iterator(train_ds, consumed_train, args)
    valid_iter = build_data_iterator(valid_ds, consumed_valid, args, cyclic=True)

    is_logger = torch.distributed.get_rank() == 0
    metrics = MetricsLogger(args, active=is_logger)
    n_params = sum(p.numel() for p in model[0].parameters())
    if save_dir is not None:  # warns below two checkpoints' worth of free space
        save_dir.check_free_space(args, n_params, device)
    print_rank_0(f" > number of parameters on (tensor, pipeline) model parallel rank "
                 f"({ps.get_tensor_model_parallel_rank()}, {ps.get_pipeline_model_parallel_rank()}): "
                 f"{n_params}")
    print_rank_0(f" > device: {args.device}, backend: {args.distributed_backend}, world size: "
                 f"{args.world_size} (TP={args.tensor_model_parallel_size}, "
                 f"PP={args.pipeline_model_parallel_size}, DP={args.data_parallel_size})")
    print_rank_0(f" > attention: {attention_choice(args).describe()}")
    print_rank_0(fusion_plan(args).summary())
    if (args.quant_config.enabled and not integration.uses_sharded_engine(args.paro_strategy)
            and integration.nobody_to_talk_to()):
        print_rank_0(" > quantized communication off: data-parallel size 1, nothing is sent "
                     "(megatron-core's exact path, bit-identical to the baseline)")
    for warning in integration.startup_warnings(args, model) + (
            [exits.warning] if exits.warning else []):
        print_rank_0(f"WARNING: {warning}")
    layer_memory = integration.memory_report(args, model)
    if layer_memory:
        print_rank_0(f" > {layer_memory}")
    report = integration.strategy_report(args, model, optimizer)
    if report:
        print_rank_0(report)

    tokens_per_iter = args.global_batch_size * args.seq_length
    interval = LogInterval()
    run_iters, run_time = 0, 0.0
    last_saved = iteration if args.load else None
    last_loss: Optional[float] = None
    last_val: Optional[float] = None
    exit_reason = "finished"

    def save(it: int) -> None:
        nonlocal last_saved
        if args.save and last_saved != it:
            if args.ckpt_format == "torch_dist":  # its helper processes die with this rank
                save_guard.guard_torch_dist_writer_queue()
            try:
                checkpointing.save_checkpoint(args, it, model, optimizer, scheduler, {
                    "consumed_train_samples": consumed_train,
                    "consumed_valid_samples": consumed_valid,
                    "skipped_iterations": skipped_total, "nan_iterations": nan_total})
            except Exception as exc:  # no space / no permission: one line, not torch's
                failure = save_guard.describe_save_failure(
                    exc, args.save, it, save_dir.checkpoint_bytes if save_dir else None)
                if failure is None:
                    raise
                raise failure from exc
            last_saved = it
            print_rank_0(f" saved checkpoint at iteration {it:7d} to {args.save}")

    for chunk in model:
        chunk.train()
    # A signal that arrived during startup (or a time budget spent by it) stops before training.
    stop = exits.check(iteration, boundary=False) \
        if exits.needs_agreement and not args.skip_train else None
    profiler = StepProfiler(args, torch.distributed.get_rank(), log=print)
    memory_reported = False
    while not stop and not args.skip_train and iteration < args.train_iters:
        integration.set_iteration(model, iteration + 1)
        profiler.before_step(iteration + 1)
        t0 = time.time()
        loss, ok, grad_norm, reason = train_step(args, forward_step_func, train_iter, model,
                                                 optimizer, scheduler, device)
        dt = time.time() - t0
        iteration += 1
        profiler.after_step(iteration, last=iteration >= args.train_iters)
        run_iters += 1
        run_time += dt
        consumed_train += args.global_batch_size
        skipped, is_nan = step_outcome(ok, reason, loss)
        skipped_total += int(skipped)
        nan_total += int(is_nan)
        interval.add(loss, dt, skipped, is_nan)
        if math.isfinite(loss):
            last_loss = loss
        lr = float(optimizer.param_groups[0]["lr"])

        if iteration % args.tensorboard_log_interval == 0:
            tb = {"lm loss": loss if math.isfinite(loss) else None, "learning-rate": lr,
                  "grad-norm": grad_norm if (grad_norm is not None and math.isfinite(grad_norm)) else None,
                  "throughput/tokens-per-sec": tokens_per_iter / dt if dt > 0 else None}
            if args.log_loss_scale:
                tb["loss-scale"] = _current_loss_scale(optimizer)
            if args.log_timers_to_tensorboard:
                tb["iteration-time"] = dt
            metrics.scalars(tb, iteration)

        if iteration % args.log_interval == 0:
            ms = interval.ms_per_iteration()
            avg_loss = interval.mean_loss()
            tps = interval.tokens_per_s(tokens_per_iter)
            comm = integration.communication_report(model, reset=True)
            line = _fmt_log_line(iteration, args, consumed_train, ms, lr, avg_loss,
                                 _current_loss_scale(optimizer), grad_norm, interval.skipped,
                                 interval.nan, tps, comm)
            print_rank_0(line)
            if not memory_reported:   # Megatron-LM's report, once, after the first interval
                memory_reported = True
                print_rank_0(memory_report(args.device, iteration, torch.distributed.get_rank()))
            metrics.record({"type": "train", "iteration": iteration,
                            "consumed_samples": consumed_train, "lm_loss": avg_loss, "lr": lr,
                            "grad_norm": grad_norm, "loss_scale": _current_loss_scale(optimizer),
                            "skipped_iterations": interval.skipped,
                            "nan_iterations": interval.nan, "ms_per_iteration": ms,
                            "iterations_in_interval": interval.iterations,
                            "tokens_per_s": tps,
                            "tflops_per_gpu": tflops_per_gpu(args, ms / 1000.0), **comm})
            if comm:
                metrics.scalars({f"comm/{k}": v for k, v in comm.items()}, iteration)
            interval = LogInterval()

        if args.eval_interval and iteration % args.eval_interval == 0 and valid_iter is not None:
            last_val = _run_eval(args, forward_step_func, valid_iter, model, device, metrics,
                                 iteration, "validation")
            consumed_valid += args.eval_iters * args.global_batch_size

        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save(iteration)
        stop = exits.check(iteration)  # the same answer on every rank
        if stop:
            break

    if stop:
        exit_reason = stop
        print_rank_0(f" > {stop}: stopping after iteration {iteration}"
                     + (f", saving to {args.save}" if args.save else " (no --save)"))
    if exit_reason == "finished" and valid_iter is not None and (args.skip_train or not (
            args.eval_interval and iteration % args.eval_interval == 0)):
        last_val = _run_eval(args, forward_step_func, valid_iter, model, device, metrics,
                             iteration, "validation (end of training)")
    save(iteration)
    # --overlap-param-gather-with-optimizer-step: the last step's gathers may still be running
    integration.wait_param_gathers_in_flight(model)

    # What happened after the last log line is reported as a final (partial) interval, so the
    # log intervals add up to the summary's totals: the iterations since then, and traffic no
    # log line saw -- with --overlap-param-gather the last update's parameter all-gather only
    # runs at the next forward (end-of-run evaluation) or at the checkpoint's forced sync, and
    # with --overlap-param-gather-with-optimizer-step right after the last step.
    tail = integration.communication_report(model, reset=True)
    since_log = interval.iterations
    if since_log or any(v for k, v in tail.items() if k.endswith(("_bytes", "_calls"))):
        final = {"iterations": since_log, "skipped_iterations": interval.skipped,
                 "nan_iterations": interval.nan, **tail}
        print_rank_0(f" final interval (after the last log line, to iteration {iteration}) | "
                     + " | ".join(f"{k}: {v:g}" for k, v in final.items()) + " |")
        metrics.record({"type": "final_interval", "iteration": iteration, **final})
    comm_total = integration.communication_report(model, totals=True)
    summary = {"type": "summary", "iterations": iteration, "iterations_this_run": run_iters,
               "exit_reason": exit_reason, "final_lm_loss": last_loss, "final_val_loss": last_val,
               "skipped_iterations": skipped_total, "nan_iterations": nan_total,
               "ms_per_iteration": 1000.0 * run_time / max(1, run_iters),
               "tokens_per_s": tokens_per_iter * run_iters / run_time if run_time > 0 else 0.0,
               "tflops_per_gpu": tflops_per_gpu(args, run_time / max(1, run_iters)),
               "quantization": args.quant_config.enabled, **comm_total}
    fmt = lambda v: f"{v:.4E}" if isinstance(v, float) else str(v)  # noqa: E731
    print_rank_0(" training summary | " + " | ".join(f"{k}: {fmt(v)}" for k, v in summary.items()
                                                     if k != "type") + " |")
    metrics.record(summary)
    metrics.close()
    return summary


def _run_eval(args, forward_step_func, valid_iter, model, device, metrics, iteration,
              label: str) -> Optional[float]:
    val = evaluate(args, forward_step_func, valid_iter, model, device)
    if val is None:
        return None
    ppl = math.exp(min(20.0, val))
    bar = "-" * 100
    print_rank_0(f"{bar}\n {label} loss at iteration {iteration} | lm loss value: {val:.6E} | "
                 f"lm loss PPL: {ppl:.6E} |\n{bar}")
    tb = {"lm loss validation": val}
    if args.log_validation_ppl_to_tensorboard:
        tb["lm loss validation ppl"] = ppl
    metrics.scalars(tb, iteration)
    metrics.record({"type": "valid", "iteration": iteration, "lm_loss": val, "ppl": ppl})
    return val
