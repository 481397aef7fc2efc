"""GPT pretraining on megatron-core 0.16.1 (our own code; Megatron-LM semantics): the run, as a
sequence of named steps.

:func:`pretrain` runs them in order::

    setup   -> _setup: initialize, guard --save, build (tokenizer, data, model, optimizer),
               resume (--load), report the startup
    loop    -> _train: one step, its logs, then evaluation, save and the exit check on their
               intervals, until --train-iters or an exit condition
    eval    -> _evaluate: one validation pass, logged
    save    -> _save: one checkpoint of the current iteration (at most one per iteration)
    exit    -> _exit: the end-of-training evaluation and save, the final interval and summary

What a step does is :mod:`.training_step`; what is built, :mod:`.training_components` (from the
configs of :mod:`.config_builders`); what is logged, :mod:`.training_log`.  Data come through a
consumed-samples-aware sampler (:mod:`.sampler`), so a resumed run sees exactly the batches the
uninterrupted run would have seen.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from functools import partial
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from megatron.distributed import failures
from megatron.distributed.quant import integration

from megatron.training.checkpoint import save_load as checkpointing
from megatron.training.checkpoint import save_guard
from megatron.training import attempt, fault_injection, step_timers
from megatron.training.checkpoint import writer_processes
from megatron.training.arguments.parser import model_vocab_size, padded_vocab_size
from megatron.training.model.config_builders import build_transformer_config
from megatron.training.errors import StartupError
from megatron.training.exit_conditions import ExitConditions
from megatron.training.model.fusions import apply_optimizer_fusions, fusion_plan
from megatron.training.model.layer_specs import attention_choice
from megatron.training.logging_utils import MetricsLogger, print_rank_0
from megatron.training.profiling import StepProfiler
from megatron.training.data.sampler import build_data_iterator
from megatron.training.data.tokenizer import build_tokenizer
from megatron.training.components import (build_datasets, configure_schedule, get_model,
                                  get_optimizer_and_scheduler)
from megatron.training.log import TrainingLog
from megatron.training.step import (current_global_batch_size, evaluate, forward_step,
                                    start_iteration, step_outcome, train_step)


@dataclasses.dataclass
class TrainingRun:
    """Everything the loop works on: what :func:`_setup` built, and where the run is."""

    args: argparse.Namespace
    forward_step_func: Any
    device: torch.device
    model: List[torch.nn.Module]
    optimizer: Any
    scheduler: Any
    train_iter: Optional[Iterator]
    valid_iter: Optional[Iterator]
    exits: ExitConditions
    save_dir: Optional[save_guard.SaveDirGuard]
    log: TrainingLog
    # Where the run is; the first four are what a checkpoint carries (its train_state).
    iteration: int = 0
    consumed_train: int = 0
    consumed_valid: int = 0
    skipped_total: int = 0
    nan_total: int = 0
    last_saved: Optional[int] = None
    """The iteration of this run's (or the loaded) checkpoint: never saved twice."""
    # This run only (the summary).
    run_iters: int = 0
    run_time: float = 0.0
    last_loss: Optional[float] = None
    last_val: Optional[float] = None

    def train_state(self) -> Dict[str, int]:
        """What a checkpoint of this iteration carries of the loop's progress."""
        return {"consumed_train_samples": self.consumed_train,
                "consumed_valid_samples": self.consumed_valid,
                "skipped_iterations": self.skipped_total, "nan_iterations": self.nan_total}


def pretrain(args: argparse.Namespace, forward_step_func=None) -> Dict[str, Any]:
    """Initialize, build, (resume), train, evaluate, save.  Returns the summary dict.

    ``--device cpu``: megatron-core's CUDA touch points are redirected to the CPU for the run
    only (:func:`.cpu_mode.cpu_mode`, left when the run ends, even on an error)."""
    from contextlib import ExitStack

    from megatron.training.cpu_mode import cpu_mode

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
    """setup, the loop, exit (evaluation and save run inside the last two)."""
    run = _setup(args, forward_step_func, cleanup)
    stop = _train(run)
    return _exit(run, stop)


# ----------------------------------------------------------------------------- setup
def _setup(args: argparse.Namespace, forward_step_func, cleanup: Any) -> TrainingRun:
    """Startup, up to the first step: start (exit conditions, distributed init, --save guards),
    build, resume, the data iterators from the resumed position, the startup report."""
    exits, save_dir, device = _start(args, cleanup)
    if forward_step_func is None:
        forward_step_func = partial(forward_step, args)
    model, optimizer, scheduler, train_ds, valid_ds = _build(args)
    iteration, train_state = _resume(args, model, optimizer, scheduler)
    consumed_train = int(train_state.get("consumed_train_samples", iteration * args.global_batch_size))
    consumed_valid = int(train_state.get("consumed_valid_samples", 0))
    train_iter = build_data_iterator(train_ds, consumed_train, args)
    valid_iter = build_data_iterator(valid_ds, consumed_valid, args, cyclic=True)
    metrics = MetricsLogger(args, active=torch.distributed.get_rank() == 0)
    _report_startup(args, model, optimizer, exits, save_dir, device)
    timers = step_timers.configure(args.timing_log_level, device)
    cleanup.callback(step_timers.configure, 0, torch.device("cpu"))   # not into the next run
    if args.timing_log_level:
        # rank 0 alone opened the logs above: the first forward-backward would time the other
        # ranks waiting for it, not their work
        torch.distributed.barrier()
    return TrainingRun(
        args=args, forward_step_func=forward_step_func, device=device, model=model,
        optimizer=optimizer, scheduler=scheduler, train_iter=train_iter, valid_iter=valid_iter,
        exits=exits, save_dir=save_dir, log=TrainingLog(args, metrics, timers), iteration=iteration,
        consumed_train=consumed_train, consumed_valid=consumed_valid,
        skipped_total=int(train_state.get("skipped_iterations", 0)),
        nan_total=int(train_state.get("nan_iterations", 0)),
        last_saved=iteration if args.load else None)


def _start(args: argparse.Namespace, cleanup: Any
           ) -> Tuple[ExitConditions, Optional[save_guard.SaveDirGuard], torch.device]:
    """The exit conditions, torch.distributed and megatron-core's parallel state, the --save
    guards; returns them with the device the run computes on."""
    from megatron.training.initialize import initialize_megatron

    start_time = time.time()
    # Preemption (--exit-signal-handler / --exit-duration-in-mins / --exit-interval): the handler
    # is in place before the (possibly long) startup; the ranks agree at iteration boundaries.
    exits = ExitConditions(args, start_time, rank=int(os.environ.get("RANK", "0")))
    cleanup.callback(exits.release)
    writer_processes.install_fork_guard()  # checkpoint-writer processes die with their rank
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
    return exits, save_dir, device


def _build(args: argparse.Namespace) -> Tuple[List[torch.nn.Module], Any, Any, Any, Any]:
    """(model, optimizer, scheduler, train dataset, validation dataset)."""
    tokenizer = build_tokenizer(args)
    # Data first: a truncated file or an empty split stops the run before the model is built.
    train_ds, valid_ds, _ = build_datasets(args, tokenizer)
    try:
        args.model_vocab_size = model_vocab_size(tokenizer.vocab_size, args)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    args.padded_vocab_size = padded_vocab_size(args.model_vocab_size, args)
    config = build_transformer_config(args)
    model = get_model(args, config, args.padded_vocab_size)
    optimizer, scheduler = get_optimizer_and_scheduler(args, model)

    configure_schedule(args, config, model, optimizer)
    return model, optimizer, scheduler, train_ds, valid_ds


def _resume(args: argparse.Namespace, model: List[torch.nn.Module], optimizer: Any,
            scheduler: Any) -> Tuple[int, Dict[str, Any]]:
    """--load: (iteration, train_state) of the checkpoint, or (0, {}) from scratch."""
    iteration, train_state = 0, {}
    if args.load:
        iteration, train_state = checkpointing.load_checkpoint(args, model, optimizer, scheduler)
        apply_optimizer_fusions(fusion_plan(args), optimizer)
        if iteration:
            print_rank_0(f" loaded checkpoint from {args.load} at iteration {iteration}")
    restarted = attempt.current()
    if restarted is not None and restarted.number > 1:   # say what a restart resumed from
        print_rank_0(f" > attempt {restarted.number} resumes from "
                     + (f"the checkpoint of iteration {iteration} in {args.load}: training "
                        f"continues at iteration {iteration + 1}" if iteration else
                        "no checkpoint (nothing saved yet, or no --load): from iteration 0"))
    return iteration, train_state


def _report_startup(args: argparse.Namespace, model: List[torch.nn.Module], optimizer: Any,
                    exits: ExitConditions, save_dir: Optional[save_guard.SaveDirGuard],
                    device: torch.device) -> None:
    """The free space of --save against a checkpoint's size, then what this run is: parameters,
    layout, attention, fusions, warnings, memory and strategy reports."""
    from megatron.core import parallel_state as ps

    n_params = sum(p.numel() for p in model[0].parameters())
    if save_dir is not None:  # warns below two checkpoints' worth of free space
        save_dir.check_free_space(args, n_params, device)
    print_rank_0(f" > number of parameters on (tensor, pipeline) model parallel rank "
                 f"({ps.get_tensor_model_parallel_rank()}, {ps.get_pipeline_model_parallel_rank()}): "
                 f"{n_params}")
    print_rank_0(f" > device: {args.device}, backend: {args.distributed_backend}, world size: "
                 f"{args.world_size} (TP={args.tensor_model_parallel_size}, "
                 f"PP={args.pipeline_model_parallel_size}, DP={args.data_parallel_size})")
    if getattr(args, "num_experts", None) is not None:
        ep = args.expert_model_parallel_size
        print_rank_0(f" > mixture of experts: {args.num_experts} experts, top-"
                     f"{args.moe_router_topk}, {args.moe_token_dispatcher_type} dispatcher, "
                     f"EP={ep}, expert DP={args.data_parallel_size // ep} (expert weights and "
                     "gradients gathered and reduced over the expert-data-parallel group)")
    print_rank_0(f" > attention: {attention_choice(args).describe()}")
    print_rank_0(fusion_plan(args).summary())
    if (args.quant_config.enabled and not integration.uses_sharded_engine(args.paro_strategy)
            and integration.nobody_to_talk_to()):
        print_rank_0(" > quantized communication off: data-parallel size 1, nothing is sent "
                     "(megatron-core's exact path, bit-identical to the baseline)")
    for warning in integration.startup_warnings(
            args.quant_config, model, device=args.device,
            overlap=args.overlap_grad_reduce or args.overlap_param_gather,
            tensor_parallel=args.tensor_model_parallel_size,
            sequence_parallel=getattr(args, "sequence_parallel", False)) + (
            [exits.warning] if exits.warning else []):
        print_rank_0(f"WARNING: {warning}")
    layer_memory = integration.memory_report(model)
    if layer_memory:
        print_rank_0(f" > {layer_memory}")
    report = integration.strategy_report(args.quant_config, model, optimizer)
    if report:
        print_rank_0(report)


# ----------------------------------------------------------------------------- loop
def _train(run: TrainingRun) -> Optional[str]:
    """Steps until --train-iters; after each, evaluation and save on their intervals and the
    exit check (the same answer on every rank).  Returns the exit condition that stopped it,
    or None."""
    args = run.args
    for chunk in run.model:
        chunk.train()
    # A signal that arrived during startup (or a time budget spent by it) stops before training.
    stop = run.exits.check(run.iteration, boundary=False) \
        if run.exits.needs_agreement and not args.skip_train else None
    profiler = StepProfiler(args, torch.distributed.get_rank(), log=print)
    while not stop and not args.skip_train and run.iteration < args.train_iters:
        _train_one_iteration(run, profiler)
        if (args.eval_interval and run.iteration % args.eval_interval == 0
                and run.valid_iter is not None):
            run.last_val = _evaluate(run, "validation")
            run.consumed_valid += args.eval_iters * args.global_batch_size
        if args.save and args.save_interval and run.iteration % args.save_interval == 0:
            _save(run)
        stop = run.exits.check(run.iteration)  # the same answer on every rank
    return stop


def _train_one_iteration(run: TrainingRun, profiler: StepProfiler) -> None:
    """One step, counted and logged."""
    args = run.args
    integration.set_iteration(run.model, run.iteration + 1)
    profiler.before_step(run.iteration + 1)
    start_iteration(run.consumed_train)   # the batch size of this step (--rampup-batch-size)
    batch_size = current_global_batch_size(args)
    t0 = time.time()
    loss, ok, grad_norm, reason = train_step(args, run.forward_step_func, run.train_iter,
                                             run.model, run.optimizer, run.scheduler, run.device,
                                             batch_size=batch_size)
    dt = time.time() - t0
    run.iteration += 1
    profiler.after_step(run.iteration, last=run.iteration >= args.train_iters)
    run.run_iters += 1
    run.run_time += dt
    run.consumed_train += batch_size
    skipped, is_nan = step_outcome(ok, reason, loss)
    run.skipped_total += int(skipped)
    run.nan_total += int(is_nan)
    if math.isfinite(loss):
        run.last_loss = loss
    lr = _logged_lr(run.optimizer)
    run.log.iteration(run.iteration, run.consumed_train, run.model, run.optimizer, loss, lr,
                      grad_norm, dt, skipped, is_nan, batch_size=batch_size)
    fault_injection.point("iteration-end", run.iteration)


def _logged_lr(optimizer: Any) -> float:
    """The lr of the default schedule's param groups (megatron-core's choice for logging; not
    --decoupled-lr's group), or the first group's where none is marked (PaRO engine)."""
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    lr = get_canonical_lr_for_logging(optimizer.param_groups)
    return float(optimizer.param_groups[0]["lr"] if lr is None else lr)


# ----------------------------------------------------------------------------- eval
def _evaluate(run: TrainingRun, label: str) -> Optional[float]:
    """One validation pass (--eval-iters batches), logged under ``label``; its mean loss, or
    None when there is nothing to evaluate."""
    val = evaluate(run.args, run.forward_step_func, run.valid_iter, run.model, run.device)
    if val is None:
        return None
    run.log.validation(run.iteration, val, label)
    return val


# ----------------------------------------------------------------------------- save
def _save(run: TrainingRun) -> None:
    """A checkpoint of the current iteration into --save, unless there is one already; a save
    that failed for lack of space or permission is one line saying so."""
    args, it = run.args, run.iteration
    if args.save and run.last_saved != it:
        if args.ckpt_format == "torch_dist":  # its helper processes die with this rank
            writer_processes.guard_torch_dist_writer_queue()
        try:
            checkpointing.save_checkpoint(args, it, run.model, run.optimizer, run.scheduler,
                                          run.train_state())
        except Exception as exc:  # no space / no permission: one line, not torch's
            failure = save_guard.describe_save_failure(
                exc, args.save, it, run.save_dir.checkpoint_bytes if run.save_dir else None)
            if failure is None:
                raise
            raise failure from exc
        run.last_saved = it
        print_rank_0(f" saved checkpoint at iteration {it:7d} to {args.save}")


# ----------------------------------------------------------------------------- exit
def _exit(run: TrainingRun, stop: Optional[str]) -> Dict[str, Any]:
    """After the loop: the end-of-training evaluation (when the run finished and the last
    iteration was not evaluated already), the last save, then the final interval and the
    summary, which is returned."""
    args = run.args
    exit_reason = "finished"
    if stop:
        exit_reason = stop
        print_rank_0(f" > {stop}: stopping after iteration {run.iteration}"
                     + (f", saving to {args.save}" if args.save else " (no --save)"))
    if exit_reason == "finished" and run.valid_iter is not None and (args.skip_train or not (
            args.eval_interval and run.iteration % args.eval_interval == 0)):
        run.last_val = _evaluate(run, "validation (end of training)")
    _save(run)
    # --overlap-param-gather-with-optimizer-step: the last step's gathers may still be running
    integration.wait_param_gathers_in_flight(run.model)

    run.log.final_interval(run.iteration, run.model)
    comm_total = integration.communication_report(run.model, totals=True)
    run_iters, run_time = run.run_iters, run.run_time
    tokens_per_s, tflops = run.log.run_rates(run_iters, run_time)
    summary = {"type": "summary", "iterations": run.iteration, "iterations_this_run": run_iters,
               "exit_reason": exit_reason, "final_lm_loss": run.last_loss,
               "final_val_loss": run.last_val, "skipped_iterations": run.skipped_total,
               "nan_iterations": run.nan_total,
               "ms_per_iteration": 1000.0 * run_time / max(1, run_iters),
               "tokens_per_s": tokens_per_s, "tflops_per_gpu": tflops,
               "quantization": args.quant_config.enabled, **comm_total}
    run.log.summary(summary)
    return summary
