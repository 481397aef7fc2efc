"""Time the model's forward and backward alone, its optimizer's update, and what overlap costs, for
``--measure``.

Why alone: the planner needs a rank's compute per micro-batch without data-parallel
communication, on the user's device with every rank computing at once. The model and optimizer
are the trainer's own, wrapped as in training (backward under ``no_sync()``). Then forward and
backward again beside a collective, as the overlapped run does it: an overlapped collective takes
cores (CPU) or SMs and memory bandwidth (GPU), so it hides less than its time alone says
(:class:`~.calibration.Contention`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.training.model.flops import training_flops_per_iteration

from .calibration import Contention
from .measure import median_seconds, slowest_rank_median

__all__ = ["ComputeProbe", "forward_backward_seconds", "side_by_side"]

MAX_JOBS_BESIDE = 4096
"""At most this many collectives run beside the compute per kind (at least 3); they are sized to
last about three steps alone."""


@dataclass(frozen=True)
class ComputeProbe:
    """What :func:`forward_backward_seconds` measured (the times each step's slowest rank's)."""

    forward_backward_s: float
    """Median seconds of one micro-batch's forward + backward, alone, each step at its slowest
    rank."""
    flops: float
    """The model FLOPs of that micro-batch on this rank."""
    optimizer_s: float
    """Median seconds of the optimizer's update of the ranks' shards, each at its slowest rank."""
    contention: Dict[str, Contention] = field(default_factory=dict)
    """By the kinds of ``beside``: the compute and the collective side by side."""


def side_by_side(step: Callable[[], None], job: Callable[[], None], sync: Callable[[], None],
                 step_alone: float, device: torch.device) -> Contention:
    """Run ``job`` (one collective and its kernels, synchronised) back to back on a thread while
    this thread runs ``step`` (``sync`` waits for this thread's own work only: on CUDA its stream,
    not the job's); each one's median beside the other over its median alone.

    Every rank runs the same number of jobs (their collectives pair up across ranks), enough to
    last about three steps alone, and the same number of steps (a step's own collectives, tensor
    parallelism's, pair up too): enough to outlast the jobs at twice their time alone. Counted:
    the steps that ended while the jobs ran, the jobs that ended while the steps ran; where no
    step ended in time, the first step's slowdown from the part of it the jobs overlapped."""
    job()   # warm-up: the communicator's first call sets it up
    job_alone = median_seconds(job, 3, lambda: None, align=dist.barrier)
    # the slowest rank's ratios, so every rank computes the same counts from them
    ratios = torch.tensor([step_alone / max(job_alone, 1e-9), job_alone / step_alone],
                          dtype=torch.float64, device=device)
    dist.all_reduce(ratios, op=dist.ReduceOp.MAX)
    jobs = int(min(MAX_JOBS_BESIDE, max(3, math.ceil(3 * ratios[0].item()))))
    steps = math.ceil(2 * jobs * ratios[1].item()) + 1
    job_ends: List[float] = []
    job_times: List[float] = []
    errors: List[BaseException] = []

    def side() -> None:
        try:
            for _ in range(jobs):
                t = time.perf_counter()
                job()
                job_ends.append(time.perf_counter())
                job_times.append(job_ends[-1] - t)
        except BaseException as e:  # noqa: BLE001 - raised again on the probe's thread
            errors.append(e)

    step_spans: List[Tuple[float, float]] = []
    sync()
    dist.barrier()
    thread = threading.Thread(target=side, name="planner-beside", daemon=True)
    start = time.perf_counter()
    thread.start()
    for _ in range(steps):
        t = time.perf_counter()
        step()
        sync()
        step_spans.append((t, time.perf_counter()))
    thread.join()
    if errors:
        raise errors[0]
    jobs_end = job_ends[-1]
    beside = [e - t for t, e in step_spans if e <= jobs_end]
    if beside:
        compute = statistics.median(beside) / step_alone
    else:   # one step outlasted every job: work s = d / c + (T - d) for the d seconds overlapped
        t0, t1 = step_spans[0]
        d = jobs_end - start
        left = step_alone - (t1 - t0) + d   # what it did in the overlap, at least a trace
        compute = d / max(left, 1e-3 * step_alone)
    steps_end = step_spans[-1][1]
    overlapped = [x for x, e in zip(job_times, job_ends) if e <= steps_end] or job_times
    communication = statistics.median(overlapped) / job_alone
    # below 1.0 is noise: running beside something never speeds either up
    return Contention(compute=max(1.0, compute), communication=max(1.0, communication))


def forward_backward_seconds(args: argparse.Namespace, steps: int,
                             beside: Optional[Mapping[str, Callable[[], None]]] = None
                             ) -> ComputeProbe:
    """The model's forward + backward and optimizer update (:class:`ComputeProbe`) after one
    warm-up step each, every rank at once and each step at its slowest rank, then beside each of
    ``beside``'s collectives (:func:`side_by_side`). A collective call: every rank calls it with
    the same ``steps``. Needs ``initialize_megatron(args)``."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from megatron.training.model.config_builders import build_transformer_config
    from megatron.training.components import get_model, get_optimizer_and_scheduler

    config = build_transformer_config(args)
    (model,) = get_model(args, config, args.padded_vocab_size)
    if getattr(model, "use_forward_hook", False):
        # --overlap-param-gather: megatron-core's forward pre-hooks would gather the parameters
        # (a collective, and with quantized weights one that needs the trainer's optimizer hook);
        # the probe times the compute alone, as the hooks find nothing left to wait for
        model.disable_forward_pre_hook(param_sync=False)
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    b, s = args.micro_batch_size, args.seq_length
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    tokens = torch.randint(0, args.padded_vocab_size, (b, s), generator=gen).to(device)
    labels = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step() -> None:
        with model.no_sync():
            loss = model(tokens, positions, None, labels=labels).float().mean()
            loss.backward()
        model.zero_grad_buffer()

    def timed(fn: Callable[[], None]) -> float:   # each step at its slowest rank
        fn()   # warm-up
        return slowest_rank_median(fn, max(1, steps), sync, device)

    fwd_bwd = timed(step)
    optimizer, _ = get_optimizer_and_scheduler(args, [model])
    leaves = getattr(optimizer, "chained_optimizers", [optimizer])
    with model.no_sync():   # gradients for the update to read
        model(tokens, positions, None, labels=labels).float().mean().backward()

    def update() -> None:   # training_step.optimizer_step without the parameter all-gather
        optimizer.prepare_grads()
        norm = optimizer.get_grad_norm()   # the chain's one global norm, one all-reduce
        for leaf in leaves:
            if getattr(leaf, "is_stub_optimizer", False):
                continue
            if leaf.config.clip_grad > 0 and leaf.get_parameters():
                clip_grad_by_total_norm_fp32(leaf.get_parameters(), max_norm=leaf.config.clip_grad,
                                             total_norm=norm)
            leaf.optimizer.step()

    opt = timed(update)
    own_stream = torch.cuda.current_stream(device).synchronize if cuda else sync
    contention = {kind: side_by_side(step, job, own_stream, fwd_bwd, device)
                  for kind, job in (beside or {}).items()}
    ns = argparse.Namespace(**vars(args))
    ns.global_batch_size = b
    flops = training_flops_per_iteration(ns) / (args.tensor_model_parallel_size
                                                * args.pipeline_model_parallel_size)
    return ComputeProbe(fwd_bwd, flops, opt, contention)
