"""Shared helpers for the multi-process gloo tests (loopback only)."""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
import time
import traceback
import warnings
from datetime import timedelta
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pytest

from collective_trace import CollectiveTrace, divergences

FINAL_BARRIER_TIMEOUT_S = 120.0
"""How long a healthy rank waits at the final barrier for its peers (they may still be finishing
local work after the last collective; a peer that never comes is reported by rank)."""
COLLECTIVE_TIMEOUT_S = 300.0
"""gloo timeout of every collective: a mismatched collective fails the test instead of hanging."""
JOIN_TIMEOUT_S = float(os.environ.get("DIST_TEST_TIMEOUT_S", "600"))
"""Deadline of one :func:`run_distributed` job."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown_process_group(healthy: bool = True,
                           timeout_s: float = FINAL_BARRIER_TIMEOUT_S) -> None:
    """Final barrier, then ``destroy_process_group`` -- the end of every spawned test rank.

    Why the barrier: with ``init_method='tcp://...'`` rank 0 hosts the TCPStore. Without it,
    rank 0 could finish and exit while a peer was still creating a group or finishing a
    collective through the store, which then failed with "Broken pipe" / "Connection reset"
    (seen under load). ``monitored_barrier`` (gloo) has a timeout and names the ranks that did
    not arrive, so a stuck peer cannot hang the healthy ones.

    Why ``healthy``: a rank that raised may have left its peers blocked in a collective it
    never joined. It must not wait for them at a barrier (they would only arrive after the
    collective timeout); it leaves at once, which closes its connections, so the peers' pending
    collective fails fast and they report (and leave) too. Results are written *before* this
    call, so nothing is lost either way.
    """
    try:
        if healthy and dist.get_world_size() > 1:
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as exc:  # a peer failed or left: its own result says why
        print(f"[rank {dist.get_rank()}] final barrier: {str(exc).splitlines()[0]}",
              file=sys.stderr, flush=True)
    finally:
        dist.destroy_process_group()


def init_process_group(rank: int, world: int, port: int) -> None:
    """gloo on 127.0.0.1 with a collective timeout (see :data:`COLLECTIVE_TIMEOUT_S`)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


@contextlib.contextmanager
def model_parallel_world_of_one(seed: Optional[int] = None) -> Iterator[None]:
    """This process as a gloo world of one with megatron-core's model-parallel groups, in scoped
    CPU mode (skips the test when a process group already exists here). ``seed``: also seed torch
    and the tensor-parallel RNG tracker (dropout forks it)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    from megatron.training import cpu_mode

    init_process_group(0, 1, free_port())
    try:
        with cpu_mode.cpu_mode():
            from megatron.core import parallel_state
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            parallel_state.initialize_model_parallel(1, 1)
            if seed is not None:
                torch.manual_seed(seed)
                model_parallel_cuda_manual_seed(seed)
            try:
                yield
            finally:
                parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


PRELOADED_MODULES = ("torch", "torch.distributed", "megatron.core")
"""Imported once, by the fork server the ranks are forked from, instead of by every rank (about
5 s of CPU per rank: megatron-core's import compiles its fusions' wrappers). Their import-time
reads of the environment (and those of what they import: torch._inductor, triton.language) see
the environment of the first :func:`run_distributed` call, which tests/conftest.py has already
set up (TRITON_INTERPRET, thread counts); our modules are imported by each rank after its
environment is restored. The import initialises no CUDA context (a forked rank could not use
one): tests/test_dist_harness.py checks that."""


def _rank_context():
    """The multiprocessing context of the ranks: a fork server with :data:`PRELOADED_MODULES`
    (torch's "spawn" re-imports them per rank). multiprocessing hands each rank the caller's
    ``sys.path``, but its environment is the server's: :func:`_entry` restores the caller's
    before it unpickles the job, whose modules may read it at import."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOADED_MODULES))
    return ctx


def _entry(rank: int, world: int, port: int, job: bytes, out_dir: str, environ: dict) -> None:
    os.environ.clear()              # the test's environment, not the fork server's
    os.environ.update(environ)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo *_tensor deprecation notes
    init_process_group(rank, world, port)
    healthy = False
    trace = CollectiveTrace()
    try:
        try:
            fn, args, traced = pickle.loads(job)
            with trace if traced else contextlib.nullcontext():
                res = fn(rank, world, *args)
            healthy = True
        except Exception:  # report instead of hanging the peers' assertions
            res = {"__error__": traceback.format_exc()}
        torch.save(trace.calls, os.path.join(out_dir, f"rank{rank}.trace.pt"))
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        shutdown_process_group(healthy)


def run_distributed(world: int, fn, out_dir, *args, trace: bool = True) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result dict.

    Every rank's collectives are traced (tests/collective_trace.py): ranks that issued different
    collectives on a communicator fail the test, naming where. ``trace=False`` for a test that
    replaces ``torch.distributed``'s functions itself and checks which one is installed.

    A rank that raises reports its traceback through its result file, so the test fails with the
    real error instead of the peers hanging in a collective; every rank's error is shown (a peer
    of the failing rank may fail second, e.g. with a closed connection). The job has a deadline
    (:data:`JOIN_TIMEOUT_S`).
    """
    out_dir = str(out_dir)
    _rank_context()
    job = pickle.dumps((fn, args, trace))
    ctx = mp.start_processes(_entry, args=(world, free_port(), job, out_dir, dict(os.environ)),
                             nprocs=world, join=False, start_method="forkserver")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed test did not finish in {JOIN_TIMEOUT_S:.0f}s")
    except BaseException as exc:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        if isinstance(exc, KeyboardInterrupt):
            raise
        reported = _errors(_load(out_dir, world))
        raise AssertionError("\n".join([f"{type(exc).__name__}: {exc}"] + reported)) from exc
    results = _load(out_dir, world)
    errors = _errors(results)
    missing = [r for r, res in enumerate(results) if res is None]
    if errors or missing:
        raise AssertionError("\n".join(errors) or f"ranks {missing} wrote no result")
    diverged = divergences(_load(out_dir, world, ".trace.pt")) if trace else []
    if diverged:   # collectives pair by issue order: a divergence hangs or mixes data
        raise AssertionError("the ranks issued different collectives on a communicator:\n"
                             + "\n".join(diverged))
    return results


def _load(out_dir: str, world: int, suffix: str = ".pt") -> list:
    """Each rank's result (or trace, ``suffix='.trace.pt'``; None where the rank wrote none)."""
    paths = [os.path.join(out_dir, f"rank{r}{suffix}") for r in range(world)]
    return [torch.load(p, weights_only=False) if os.path.exists(p) else None for p in paths]


def _errors(results: list) -> list:
    return [f"rank {r} failed:\n{res['__error__']}" for r, res in enumerate(results)
            if isinstance(res, dict) and "__error__" in res]
