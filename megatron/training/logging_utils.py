"""Metric sinks of the trainer: stdout, tensorboard, JSON lines, optional Weights & Biases.

Why one class: the training loop reports each metric once (``MetricsLogger.scalars``) and every
enabled sink receives it; only one rank (rank 0) writes, the others get a logger whose methods
do nothing, so the loop never branches on the rank.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import warnings
from typing import Any, Dict


def print_rank_0(msg: str) -> None:
    """Print once per job (flush: torchrun interleaves the ranks' stdout)."""
    import torch

    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(msg, flush=True)


def quiet_library_warnings(rank: int) -> None:
    """One copy of each library notice per job, on rank 0; none repeated per rank.

    Why: every rank would print megatron-core's fallback warnings (no TE / Apex) and its
    deprecation notices (renamed torch collectives, internal imports, config defaults) before the
    first log line. Rank 0 says each fallback once; notices addressed to megatron-core's
    developers and its per-rank log chatter are dropped; our own warnings are untouched. Call it
    before megatron-core is imported.
    """
    import logging

    noisy = r"(megatron\.core|torch\.distributed|transformer_engine|apex)(\.|$)"
    if rank != 0:
        for category in (UserWarning, FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=noisy)
        logging.getLogger("megatron.core").setLevel(logging.ERROR)
        return
    warnings.filterwarnings("once", category=UserWarning, module=noisy)
    for message in (r"Transformer Engine and Apex are not installed. Falling back to local",
                    r"full scope is deprecated",  # megatron-core's own cuda_graph_scope default
                    r"`torch\.distributed\.\w+` is deprecated"):
        warnings.filterwarnings("ignore", message=message)


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/Inf; keep the information as a string
    return v


class MetricsLogger:
    """Tensorboard / JSON-lines / W&B writer; inert when ``active`` is False."""

    def __init__(self, args: argparse.Namespace, active: bool) -> None:
        self.active = active
        self.tb = None
        self.jsonl = None
        self.wandb = None
        if not active:
            return
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=args.tensorboard_dir,
                                    max_queue=args.tensorboard_queue_size)
        if args.jsonl_log:
            os.makedirs(os.path.dirname(os.path.abspath(args.jsonl_log)), exist_ok=True)
            self.jsonl = open(args.jsonl_log, "a", encoding="utf-8")
        if args.wandb_project:
            try:
                import wandb

                self.wandb = wandb.init(project=args.wandb_project,
                                        entity=getattr(args, "wandb_entity", "") or None,
                                        name=args.wandb_exp_name or None,
                                        dir=args.wandb_save_dir or None,
                                        config={k: str(v) for k, v in vars(args).items()})
            except Exception as e:  # optional dependency: never fail the run for it
                warnings.warn(f"wandb disabled: {e}")
                self.wandb = None

    def scalars(self, values: Dict[str, float], step: int, tensorboard: bool = True) -> None:
        """One scalar per key to tensorboard and W&B (keys are tensorboard tags)."""
        if not self.active:
            return
        if self.tb is not None and tensorboard:
            for k, v in values.items():
                if v is not None:
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in values.items() if v is not None}, step=step)

    def record(self, record: Dict[str, Any]) -> None:
        """One JSON object per line (flushed, so plotting tools can tail the file)."""
        if self.active and self.jsonl is not None:
            self.jsonl.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
            self.jsonl.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.tb = self.jsonl = self.wandb = None
