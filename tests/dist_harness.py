"""Shared helpers for the multi-process gloo tests (loopback only)."""

from __future__ import annotations

import os
import socket
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo *_tensor deprecation notes
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        try:
            res = fn(rank, world, *args)
        except Exception:  # report instead of hanging the peers' assertions
            res = {"__error__": traceback.format_exc()}
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_distributed(world: int, fn, out_dir, *args) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result dict.

    A rank that raises reports its traceback through its result file, so the test fails with the
    real error instead of the peers hanging in a collective.
    """
    mp.spawn(_entry, args=(world, free_port(), fn, str(out_dir), args), nprocs=world, join=True)
    results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        if "__error__" in res:
            raise AssertionError(f"rank {r} failed:\n{res['__error__']}")
    return results
