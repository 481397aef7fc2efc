#!/usr/bin/env python3
"""Pretrain a GPT model with megatron-core 0.16.1 (Megatron-LM compatible flags).

    torchrun --nproc-per-node 2 pretrain_gpt.py --num-layers 2 --hidden-size 64 \
        --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --global-batch-size 8 \
        --train-iters 20 --lr 1e-3 --mock-data --bf16 --use-distributed-optimizer

Runs on CPU ranks (gloo) automatically when no GPU is present (or with ``--device cpu``).
``--dry-run`` parses and builds every config without initializing torch.distributed.
"""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import os

from megatron.training.logging_utils import quiet_library_warnings

quiet_library_warnings(int(os.environ.get("RANK", "0")))  # before megatron-core is imported

from megatron.training.arguments import parse_args  # noqa: E402


def dry_run(args) -> None:
    """Print the parsed args, the QuantizationConfig and the built configs as JSON lines."""
    from megatron.training.model.config_builders import config_summary

    print("DRY_RUN_ARGS " + json.dumps(vars(args), default=str), flush=True)
    print("DRY_RUN_QUANT " + json.dumps(args.quant_config.to_dict(), default=str), flush=True)
    print("DRY_RUN_CONFIGS " + json.dumps(config_summary(args), default=str), flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args)
        return 0
    import torch

    from megatron.distributed.failures import CommunicationFailure
    from megatron.training.errors import StartupError
    from megatron.training.checkpoint.save_guard import CheckpointWriteError
    from megatron.training.pretrain import pretrain

    try:
        pretrain(args)
    except CheckpointWriteError as exc:
        # No space / no permission while saving: one line from each rank that met it (its peers
        # may still wait in the save's barrier; the launcher stops them).
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except CommunicationFailure as exc:
        # One rank failed (its traceback is in its log): every rank prints the same line -- the
        # rank, where, the cause -- and leaves without the collectives of a clean shutdown.
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except StartupError as exc:
        # Every rank raises it (deterministic checks): one message, no per-rank tracebacks.
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return 1
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
