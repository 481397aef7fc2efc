"""One training step (forward-backward over the micro-batches, then the optimizer step or its
skip) and the evaluation pass, with the loss reduction both share.

Why our own optimizer step (:func:`optimizer_step`): megatron-core only skips a step on fp16
overflow; with bf16 a NaN/Inf gradient would be applied.  We use the optimizer's own building
blocks (prepare_grads / get_grad_norm / clip / step_with_ready_grads) and skip when the global
grad norm is not finite, counting it (:func:`step_outcome`).

Why the host reads the device only where it already waits: the loss and the fp16 loss scale are
read inside ``before_update`` (right after the gradient norm), never after the update is queued
(tests/test_step_syncs.py).
"""

from __future__ import annotations

import argparse
import math
import weakref
from contextlib import nullcontext
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron.distributed.quant import integration
from megatron.training import step_timers


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Token-mean LM loss; reports [sum, count] so the average is exact across microbatches/DP."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().clone(), mask.sum().detach()])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(args: argparse.Namespace, data_iterator: Iterator, model: torch.nn.Module):
    # evaluation (the model in eval mode) reads batches too: not part of a training step's time
    with step_timers.current().time("batch-generator") if model.training else nullcontext():
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


def current_loss_scale(optimizer: Any) -> float:
    """The loss scale for the log: the value the last step read (no device read after the
    update is queued), else :func:`_loss_scale`."""
    cached = _LOSS_SCALE_AFTER_LAST_STEP.get(optimizer)
    return cached if cached is not None else _loss_scale(optimizer)


def current_global_batch_size(args: argparse.Namespace) -> int:
    """The global batch size of the coming step: megatron-core's calculator's (it grows with
    --rampup-batch-size; :func:`start_iteration` updates it).

    No calculator is an error, not --global-batch-size: the training loop would then log, count
    consumed samples and advance the schedule by a batch size the steps did not run."""
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size

    try:
        return int(get_current_global_batch_size())
    except AttributeError:  # megatron-core's global calculator is None
        raise RuntimeError(
            "no num-microbatches calculator for this step's batch size (--global-batch-size "
            f"{args.global_batch_size}, --rampup-batch-size): initialize_megatron "
            "(init_num_microbatches) must run before the training loop") from None


def start_iteration(consumed_samples: int) -> None:
    """Before each training step: the calculator's batch size for the samples consumed so far
    (checked to be whole micro-batches per data-parallel rank)."""
    from megatron.core.num_microbatches_calculator import update_num_microbatches

    update_num_microbatches(consumed_samples, consistency_check=True)


def eval_num_microbatches(args: argparse.Namespace) -> int:
    """An evaluation batch is always the full --global-batch-size (as in Megatron-LM), also
    during a batch-size ramp-up."""
    return args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)


def train_step(args, forward_step_func, data_iterator, model, optimizer, scheduler, device,
               batch_size: Optional[int] = None):
    """One optimizer step over num_microbatches micro-batches (the current global batch;
    ``batch_size``: its size when the caller has it, else :func:`current_global_batch_size`)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func

    timers = step_timers.current()
    with timers.time("zero-grad"):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
    fwd_bwd = get_forward_backward_func()
    with timers.time("forward-backward"):
        losses = fwd_bwd(forward_step_func=forward_step_func, data_iterator=data_iterator,
                         model=model, num_microbatches=get_num_microbatches(),
                         seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                         decoder_seq_length=args.seq_length, forward_only=False)
    # The loss reduction is queued now and read inside optimizer_step, right after the gradient
    # norm has waited for the device. Read after the update, it would make the host wait for the
    # optimizer instead of queuing the next iteration behind it; read right here, it would stop
    # the host before it queues the gradient-norm work. On a GPU nothing in this step or in the
    # loop around it (training.py, training_log.py) reads the device after the update is queued
    # (tests/test_step_syncs.py).
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

    with timers.time("optimizer"):
        ok, grad_norm, reason = optimizer_step(optimizer, before_update=before_update)
    loss = read[0]
    scale_after = _LOSS_SCALE_AFTER_LAST_STEP.get(optimizer, 1.0) if scaled else 1.0
    if ok:
        scheduler.step(increment=batch_size if batch_size is not None
                       else current_global_batch_size(args))
        if scale_after != scale_before:  # fp16 dynamic scale grew: keep LoCo errors in scaled units
            integration.on_loss_scale_changed(model, scale_after / scale_before)
    else:
        ratio = (scale_after / scale_before) if reason == "overflow" else None
        integration.on_step_skipped(model, ratio)
    return loss, ok, grad_norm, reason


def evaluate(args, forward_step_func, data_iterator, model, device) -> Optional[float]:
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
                num_microbatches=eval_num_microbatches(args), seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
                forward_only=True)
            total.append(_reduce_losses(losses, device))
    for chunk in model:
        chunk.train()
    return sum(total) / len(total)
