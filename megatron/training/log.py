"""What the training loop reports, in Megatron-LM's form: the iteration line every
``--log-interval``, tensorboard scalars every ``--tensorboard-log-interval``, the validation
block, the final (partial) interval and the training summary -- printed by rank 0 and recorded
in ``--jsonl-log`` / tensorboard / W&B (:class:`~.logging_utils.MetricsLogger`).

Why a module of its own: the loop (:mod:`.training`) says when something happened; the fields,
their averaging over an interval (:class:`LogInterval`) and their format are decided here, so
the loop stays a sequence of named steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.distributed.quant import integration

from megatron.training.logging_utils import MetricsLogger, print_rank_0
from megatron.training.profiling import memory_report
from megatron.training.step_timers import StepTimers
from megatron.training.model.flops import tflops_per_gpu
from megatron.training.step import current_loss_scale


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
    samples: int = 0
    """Sequences of the interval's steps (their batch sizes grow with --rampup-batch-size)."""

    def add(self, loss: float, seconds: float, skipped: bool, is_nan: bool,
            samples: int = 0) -> None:
        """One iteration. The logged loss is the mean of the interval's finite forward losses: a
        step skipped for NaN/Inf gradients (a 'nan' iteration) still ran a finite forward when
        only its gradients were poisoned, and that loss is real; a loss the forward itself made
        non-finite is left out, and an interval with none left prints NAN."""
        self.iterations += 1
        self.samples += samples
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

    def samples_per_iteration(self) -> float:
        """The interval's mean batch size (what its tokens/s and TFLOP/s are of)."""
        return self.samples / self.iterations if self.iterations else 0.0


MOE_BALANCING_LOSS_NAMES = {"aux_loss": "load_balancing_loss",
                            "seq_aux_loss": "seq_load_balancing_loss",
                            "global_aux_loss": "global_load_balancing_loss"}
"""The name megatron-core's router records each ``--moe-router-load-balancing-type``'s loss under."""


def moe_loss_names(args: argparse.Namespace) -> List[str]:
    """The MoE auxiliary losses this run's router records (as Megatron-LM tracks them)."""
    if getattr(args, "num_experts", None) is None:
        return []
    names = [MOE_BALANCING_LOSS_NAMES[args.moe_router_load_balancing_type]] if (
        args.moe_router_load_balancing_type in MOE_BALANCING_LOSS_NAMES) else []
    return names + (["z_loss"] if args.moe_z_loss_coeff is not None else [])


class _PerLayer:
    """Takes megatron-core's per-layer scalars (its tensorboard writer's ``add_scalar``)."""

    def __init__(self) -> None:
        self.values: Dict[str, float] = {}

    def add_scalar(self, name: str, value: Any, iteration: int) -> None:
        if name.startswith("moe/"):
            self.values[name] = float(value)


def moe_aux_losses(args: argparse.Namespace) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
    """This iteration's MoE auxiliary losses as Megatron-LM logs them (the mean over MoE layers of
    the micro-batches' mean), reduced over the ranks that hold them, left on the device; with
    ``--moe-per-layer-logging`` also each layer's (``moe/<name>_layer_<i>``, host floats).
    Clears megatron-core's tracker. Empty for a dense model."""
    names = moe_loss_names(args)
    if not names:
        return {}, {}
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    losses: Dict[str, torch.Tensor] = {}
    per_layer = _PerLayer() if args.moe_per_layer_logging else None
    track_moe_metrics(loss_scale=1.0 / get_num_microbatches(), iteration=0,
                      total_loss_dict=losses, writer=per_layer,
                      per_layer_logging=per_layer is not None, force_initialize=True,
                      track_names=names, num_layers=args.num_layers,
                      moe_layer_freq=args.moe_layer_freq)
    return ({k: v for k, v in losses.items() if k in names},
            {} if per_layer is None else per_layer.values)


def _fmt_log_line(iteration: int, args, consumed: int, ms_per_iter: float, lr: float,
                  loss: float, loss_scale: float, grad_norm: Optional[float], skipped: int,
                  nans: int, tokens_per_s: float, comm: Dict[str, float],
                  batch_size: int, tflops: float = 0.0,
                  moe: Optional[Dict[str, float]] = None) -> str:
    parts = [f" iteration {iteration:8d}/{args.train_iters:8d}",
             f"consumed samples: {consumed:12d}",
             f"elapsed time per iteration (ms): {ms_per_iter:.1f}",
             f"learning rate: {lr:.6E}",
             f"global batch size: {batch_size:5d}",
             f"lm loss: {loss:.6E}"]
    parts += [f"{name}: {value:.6E}" for name, value in (moe or {}).items()]
    parts += [f"loss scale: {loss_scale:.1f}"]
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    parts += [f"number of skipped iterations: {skipped:3d}",
              f"number of nan iterations: {nans:3d}"]
    if args.log_throughput:
        parts.append(f"throughput per GPU (TFLOP/s/GPU): "
                     f"{tflops:.3f}")
        parts.append(f"throughput (tokens/s): {tokens_per_s:.1f}")
    for k in LOG_LINE_COMM_KEYS:  # the rest goes to --jsonl-log / tensorboard only
        if k in comm:
            parts.append(f"{k}: {comm[k]:.3f}")
    return " | ".join(parts) + " |"


LOG_LINE_COMM_KEYS = ("grad_inter_bits_per_element", "weight_inter_bits_per_element",
                      "expert_grad_inter_bits_per_element", "expert_weight_inter_bits_per_element",
                      "comm_grad_exposed_ms", "comm_weight_exposed_ms")
"""The communication figures of the iteration log line, after Megatron-LM's own fields: what
crosses the slow link (bits per element, gradients and weights) and what the step waited for.
The full report (about 30 figures: per link, totals, ratios, errors) is in every ``--jsonl-log``
record and in tensorboard; in the line it made ~2,000 characters per iteration."""


class TrainingLog:
    """The loop's log of one run: call :meth:`iteration` after every step, :meth:`validation`
    after every evaluation, :meth:`final_interval` and :meth:`summary` once at the end."""

    def __init__(self, args: argparse.Namespace, metrics: MetricsLogger,
                 timers: Optional[StepTimers] = None) -> None:
        self.args = args
        self.metrics = metrics
        self.timers = timers if timers is not None else StepTimers()
        self.interval = LogInterval()
        self.run_samples = 0
        """Sequences of this run's steps, for the summary's rates."""
        self.memory_reported = False
        self.moe_sums: Dict[str, torch.Tensor] = {}
        """The interval's MoE auxiliary losses, summed on the device (:func:`moe_aux_losses`)."""

    def iteration(self, iteration: int, consumed_samples: int, model: List[torch.nn.Module],
                  optimizer: Any, loss: float, lr: float, grad_norm: Optional[float],
                  seconds: float, skipped: bool, is_nan: bool,
                  batch_size: Optional[int] = None) -> None:
        """One step: counted into the interval; its scalars on the tensorboard interval; the
        iteration line (and, once, the memory report) when the log interval ends.
        ``batch_size``: this step's global batch size (it grows with --rampup-batch-size); the
        rates (tokens/s, TFLOP/s) are of the batches actually run."""
        args, metrics = self.args, self.metrics
        samples = batch_size or args.global_batch_size
        self.interval.add(loss, seconds, skipped, is_nan, samples)
        self.run_samples += samples
        losses, per_layer = moe_aux_losses(args)
        for name, value in losses.items():
            self.moe_sums[name] = self.moe_sums.get(name, 0.0) + value
        if per_layer:
            metrics.scalars(per_layer, iteration)
        if iteration % args.tensorboard_log_interval == 0:
            tb = {"lm loss": loss if math.isfinite(loss) else None, "learning-rate": lr,
                  "grad-norm": grad_norm if (grad_norm is not None and math.isfinite(grad_norm)) else None,
                  "throughput/tokens-per-sec":
                      samples * args.seq_length / seconds if seconds > 0 else None}
            if args.log_loss_scale:
                tb["loss-scale"] = current_loss_scale(optimizer)
            if args.log_timers_to_tensorboard:
                tb["iteration-time"] = seconds
            metrics.scalars(tb, iteration)

        if iteration % args.log_interval == 0:
            interval = self.interval
            ms = interval.ms_per_iteration()
            avg_loss = interval.mean_loss()
            per_iteration = interval.samples_per_iteration()
            tps = interval.tokens_per_s(per_iteration * args.seq_length)
            tflops = tflops_per_gpu(args, ms / 1000.0, per_iteration)
            comm = integration.communication_report(model, reset=True)
            timed = self.timers.report(interval.iterations)   # every rank: an all-reduce
            moe = {name: float(total) / interval.iterations
                   for name, total in self.moe_sums.items()}
            self.moe_sums = {}
            line = _fmt_log_line(iteration, args, consumed_samples, ms, lr, avg_loss,
                                 current_loss_scale(optimizer), grad_norm, interval.skipped,
                                 interval.nan, tps, comm, samples, tflops, moe)
            print_rank_0(line)
            if timed:   # Megatron-LM prints its timers on a line of their own, after the iteration's
                print_rank_0(" timers (ms per iteration, slowest rank) | " + " | ".join(
                    f"{name}: {ms_:.2f}" for name, ms_ in timed.items()) + " |")
            if not self.memory_reported:   # Megatron-LM's report, once, after the first interval
                self.memory_reported = True
                print_rank_0(memory_report(args.device, iteration, torch.distributed.get_rank()))
            metrics.record({"type": "train", "iteration": iteration,
                            "consumed_samples": consumed_samples, "lm_loss": avg_loss, "lr": lr,
                            "global_batch_size": samples,
                            "grad_norm": grad_norm, "loss_scale": current_loss_scale(optimizer),
                            "skipped_iterations": interval.skipped,
                            "nan_iterations": interval.nan, "ms_per_iteration": ms,
                            "iterations_in_interval": interval.iterations,
                            "tokens_per_s": tps,
                            "tflops_per_gpu": tflops, **moe, **comm,
                            **({"timers_ms": timed} if timed else {})})
            if moe:
                metrics.scalars(moe, iteration)
            if comm:
                metrics.scalars({f"comm/{k}": v for k, v in comm.items()}, iteration)
            if timed and args.log_timers_to_tensorboard:
                metrics.scalars({f"timers/{k}-time-ms": v for k, v in timed.items()}, iteration)
            self.interval = LogInterval()

    def validation(self, iteration: int, val: float, label: str) -> None:
        """The validation block: loss and perplexity, in the log and the records."""
        ppl = math.exp(min(20.0, val))
        bar = "-" * 100
        print_rank_0(f"{bar}\n {label} loss at iteration {iteration} | lm loss value: {val:.6E} | "
                     f"lm loss PPL: {ppl:.6E} |\n{bar}")
        tb = {"lm loss validation": val}
        if self.args.log_validation_ppl_to_tensorboard:
            tb["lm loss validation ppl"] = ppl
        self.metrics.scalars(tb, iteration)
        self.metrics.record({"type": "valid", "iteration": iteration, "lm_loss": val, "ppl": ppl})

    def final_interval(self, iteration: int, model: List[torch.nn.Module]) -> None:
        """What happened after the last log line, reported as a final (partial) interval, so the
        log intervals add up to the summary's totals: the iterations since then, and traffic no
        log line saw -- with --overlap-param-gather the last update's parameter all-gather only
        runs at the next forward (end-of-run evaluation) or at the checkpoint's forced sync, and
        with --overlap-param-gather-with-optimizer-step right after the last step."""
        interval = self.interval
        tail = integration.communication_report(model, reset=True)
        since_log = interval.iterations
        timed = self.timers.report(since_log) if since_log else {}   # every rank (an all-reduce)
        if since_log or any(v for k, v in tail.items() if k.endswith(("_bytes", "_calls"))):
            final = {"iterations": since_log, "skipped_iterations": interval.skipped,
                     "nan_iterations": interval.nan, **tail}
            print_rank_0(f" final interval (after the last log line, to iteration {iteration}) | "
                         + " | ".join(f"{k}: {v:g}" for k, v in final.items()) + " |")
            self.metrics.record({"type": "final_interval", "iteration": iteration, **final,
                                 **({"timers_ms": timed} if timed else {})})

    def run_rates(self, iterations: int, seconds: float) -> Tuple[float, float]:
        """(tokens/s, TFLOP/s per GPU) of this run's ``iterations`` steps in ``seconds``, of the
        batches actually run (they grow with --rampup-batch-size)."""
        if seconds <= 0 or iterations <= 0:
            return 0.0, 0.0
        per_iteration = self.run_samples / iterations
        return (self.run_samples * self.args.seq_length / seconds,
                tflops_per_gpu(self.args, seconds / iterations, per_iteration))

    def summary(self, summary: Dict[str, Any]) -> None:
        """The training summary line and record; closes the records."""
        fmt = lambda v: f"{v:.4E}" if isinstance(v, float) else str(v)  # noqa: E731
        print_rank_0(" training summary | " + " | ".join(f"{k}: {fmt(v)}" for k, v in summary.items()
                                                         if k != "type") + " |")
        self.metrics.record(summary)
        self.metrics.close()
