"""Shared helpers for the trainer tests: free ports and a torchrun launcher for pretrain_gpt.py.

Why a fixture and not a helper module: tests/ is not a package, and every multi-process test
needs the same launch recipe (gloo on 127.0.0.1, OMP_NUM_THREADS=1 so two ranks fit on two
cores, a hard timeout so a hung collective fails the test instead of the CI job).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, List

import psutil
import pytest
import torch

if not torch.cuda.is_available():
    # Triton's CPU interpreter must be chosen before anything imports ``triton.language``: its own
    # @jit helpers (tl.max, ...) are decorated for the interpreter or the compiler at that import.
    # megatron-core imports it (through torch._inductor), and test modules that import
    # megatron-core at collection (tests/test_mcore_compat.py) run before test_triton_kernels.py.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dist_harness import free_port as free_port_number  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

TINY_GPT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32",
            "--micro-batch-size", "2", "--mock-data", "--vocab-size", "128",
            "--make-vocab-size-divisible-by", "8", "--device", "cpu"]


def run_in_own_session(cmd: List[str], env: dict, timeout: float,
                       stderr: int = subprocess.PIPE) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`` in a new session,
    whose whole process tree is killed on a timeout: killing only torchrun (what
    ``subprocess.run`` does) left its workers running, blocked in a collective, for the rest of
    the CI job. ``stderr=subprocess.STDOUT`` merges both streams in the order written."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=stderr, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each worker in a session of its own: kill the whole tree, not only
        # torchrun's group, or the workers hold the pipes open and communicate() never returns.
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture
def free_port() -> int:
    return free_port_number()


@pytest.fixture(scope="session")
def run_pretrain() -> Callable[..., subprocess.CompletedProcess]:
    """``run_pretrain(args, nproc=2, timeout=180, show_warnings=False)``: torchrun
    pretrain_gpt.py, capture output (Python warnings off unless ``show_warnings``)."""

    def run(args: List[str], nproc: int = 2, timeout: int = 180,
            show_warnings: bool = False) -> subprocess.CompletedProcess:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
                   PYTHONWARNINGS="ignore")
        if show_warnings:  # what a user sees
            del env["PYTHONWARNINGS"]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={free_port_number()}",
               str(REPO / "pretrain_gpt.py"), *TINY_GPT, *args]
        return run_in_own_session(cmd, env=env, timeout=timeout)

    return run
