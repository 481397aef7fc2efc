"""Time the model's forward and backward alone, and its optimizer's update, for ``--measure``.

Why alone: the planner needs the compute a rank does per micro-batch without any data-parallel
communication, measured on the user's device with every rank computing at once (as they do in
training). The model is the trainer's own, wrapped as the trainer wraps it
(``training_components.get_model``: mixed precision, the DDP wrapper whose backward hooks
accumulate into the gradient buffers), on random tokens, its backward inside the wrapper's
``no_sync()`` so no bucket is reduced; and the optimizer's own update on this rank's shard as the
trainer's step does it (``training_step.optimizer_step``: the gradients copied to the main
parameters, the global gradient norm with its all-reduce, the clip, the torch optimizer's step),
without the parameter all-gather that follows it in training.
"""

from __future__ import annotations

import argparse
from typing import Callable, Tuple

import torch

from megatron.training.throughput import training_flops_per_iteration

from .measure import median_seconds

__all__ = ["forward_backward_seconds"]


def forward_backward_seconds(args: argparse.Namespace, steps: int) -> Tuple[float, float, float]:
    """(median seconds of one micro-batch's forward + backward on this rank, the model FLOPs of
    that micro-batch on this rank, median seconds of the optimizer's update of this rank's shard)
    after one warm-up step each. Needs ``initialize_megatron(args)``."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from megatron.training.config_builders import build_transformer_config
    from megatron.training.training_components import get_model, get_optimizer_and_scheduler

    config = build_transformer_config(args)
    (model,) = get_model(args, config, args.padded_vocab_size)
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

    def timed(fn: Callable[[], None]) -> float:
        fn()   # warm-up
        return median_seconds(fn, max(1, steps), sync)

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
    ns = argparse.Namespace(**vars(args))
    ns.global_batch_size = b
    flops = training_flops_per_iteration(ns) / (args.tensor_model_parallel_size
                                                * args.pipeline_model_parallel_size)
    return fwd_bwd, flops, opt
