"""No checkpoint-writer process outlives its rank.

Why: megatron-core's ``torch_dist`` save starts helper processes from the rank (writer workers
forked per save, a spawned ``multiprocessing`` manager for the results queue), which a rank killed
with SIGKILL would leave behind, the manager waiting forever. Every process forked from a rank's
main thread asks the kernel for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``,
:func:`install_fork_guard`) and exits at once if the parent is already gone; we start the manager
with the same request (:func:`guard_torch_dist_writer_queue`). multiprocessing's resource tracker
exits by itself.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, List, Optional

PR_SET_PDEATHSIG = 1
HOLD_ENV = "MEGATRON_TEST_HOLD_FORKED_CHILD"
"""Tests only: ``RANK:DIR`` -- a process forked from that rank writes ``DIR/held-PID`` (its
parent's pid inside) and then waits until it is killed, so a test can kill the rank while its
checkpoint writer is alive, at a known moment."""

_installed = False
_parent_pid: Optional[int] = None
_forked_from_main = False


def _before_fork() -> None:
    global _parent_pid, _forked_from_main
    _parent_pid = os.getpid()
    _forked_from_main = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    """Runs in every child forked from this process: die with the parent."""
    if _forked_from_main:  # the signal follows the forking *thread*: only the main one lives on
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
        if _parent_pid is not None and os.getppid() != _parent_pid:
            os._exit(1)  # the parent died before the request took effect
    hold = os.environ.get(HOLD_ENV)
    if hold:
        rank, _, directory = hold.partition(":")
        if os.environ.get("RANK", "0") == rank:
            path = os.path.join(directory, f"held-{os.getpid()}")
            with open(path + ".part", "w", encoding="ascii") as f:
                f.write(str(os.getppid()))
            os.replace(path + ".part", path)
            while True:
                signal.pause()


def _die_with_parent(parent_pid: int) -> None:
    """Initializer of a spawned helper process: SIGKILL when ``parent_pid`` dies."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)


_writer_managers: List[Any] = []


def guard_torch_dist_writer_queue() -> bool:
    """Start megatron-core's torch_dist write-results queue ourselves, served by a manager
    process that dies with this rank.

    Why: megatron-core 0.16.1 creates it lazily at the first ``torch_dist`` save
    (``filesystem_async._get_write_results_queue``: ``mp.get_context("spawn").Manager()``).  That
    manager is a *spawned* process (fork + exec, so :func:`install_fork_guard` does not reach
    it), it re-imports the entry script (hundreds of MB) and it has no parent check: it would
    outlive a SIGKILLed rank, waiting on its stop event.  Ours is the same spawn-context ``SyncManager``, started with an initializer that asks for SIGKILL
    when the rank dies.  Idempotent; returns whether the queue is ours."""
    if not sys.platform.startswith("linux"):
        return False
    from megatron.distributed.mcore_compat.process_globals import (
        set_torch_dist_results_queue, torch_dist_results_queue)

    if torch_dist_results_queue() is not None:
        return bool(_writer_managers)
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=_die_with_parent, initargs=(os.getpid(),))
    _writer_managers.append(manager)
    set_torch_dist_results_queue(manager.Queue())
    return True


def install_fork_guard() -> bool:
    """Make every process later forked from this one's main thread die with it (Linux; once
    per process).  Returns whether the guard is active."""
    global _installed
    if not sys.platform.startswith("linux"):
        return False
    if not _installed:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _installed = True
    return True
