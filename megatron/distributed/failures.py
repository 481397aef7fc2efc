"""One rank's failure stops every rank, soon, with the one error that caused it.

Why: collectives pair by issue order. When a job of one rank fails (an out-of-memory at the LoCo
or Hadamard peak of one bucket's intra-node job), that rank's later collectives never run
(streams.py stops the stage), and its peers wait inside theirs: on NCCL until the watchdog's
timeout (``--distributed-timeout-minutes``, 10 minutes by default), and the cause is in one rank's
log among hundreds. Here the failing rank posts one line -- its rank, where (the bucket and the
hop) and the exception -- to the job's rendezvous store (the first post wins, so a peer's
follow-up error, a gloo "connection closed" once the failing rank exits, never hides the root
cause), and every rank watches for it:

* a wait of this layer (:meth:`Job.wait <.streams.Job.wait>` on the CPU stages) raises
  :class:`CommunicationFailure` with that line as soon as it is posted, so the trainer stops
  through its normal error path;
* a rank stuck where Python cannot interrupt it (inside a gloo collective, or at a CUDA
  synchronisation behind an NCCL kernel that never completes) prints the line and leaves with
  exit status 1 after :data:`GRACE_S` seconds; torchrun then stops the rest of the node.

A rank that dies without a word (SIGKILL, a lost node) posts nothing; its peers meet gloo's
"Connection reset by peer" / "Connection closed by peer", each naming itself. So every rank's
watcher also beats a counter of its own in the store, and a rank whose collective failed with a
lost connection first looks which peers' counters stopped (for :data:`ROLL_CALL_S`): the line it
posts then names them -- ``rank 1 stopped answering: rank 0 at <where>: <gloo's text>``.

Nothing here runs until :func:`install` (the trainer, after ``init_process_group``): the
collectives used standalone or by tests keep their plain exceptions.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any, List, Optional

__all__ = ["CommunicationFailure", "default_store", "install", "uninstall", "report", "posted",
           "raise_if_posted", "watch", "wait_until", "POLL_S", "GRACE_S"]

KEY = "megatron_quant/failure"
ALIVE_KEY = "megatron_quant/alive/"
"""Each rank's heartbeat counter: ``ALIVE_KEY + str(rank)``."""
PEER_LOSS = ("Connection reset by peer", "Connection closed by peer", "Connection refused",
             "Broken pipe")
"""Phrases of a failure that a peer's death causes (gloo's, the socket's)."""
POLL_S = float(os.environ.get("QUANT_FAILURE_POLL_S", "2"))
"""Seconds between two looks at the store (one small request per rank)."""
GRACE_S = float(os.environ.get("QUANT_FAILURE_GRACE_S", "20"))
"""Seconds a rank that saw a posted failure has to stop through its normal error path before it
exits with status 1 (a rank blocked inside a collective never gets there)."""


def roll_call_s() -> float:
    """How long a rank that lost a connection watches its peers' heartbeats before it names
    the silent ones: two and a half beats (a live peer beats every :data:`POLL_S`)."""
    return 2.5 * POLL_S


class CommunicationFailure(RuntimeError):
    """A rank of the job failed; the message is that rank's posted line (``rank R: where:
    ExceptionType: message``), the same on every rank."""


class _Beacon:
    def __init__(self, store: Any, rank: int, world_size: Optional[int]) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        """Set: this rank beats its heartbeat and a lost connection names the silent peers."""
        self.seen: Optional[str] = None
        """The posted line once this rank has seen it (posted here, or read by the watcher)."""
        self.stop = threading.Event()


_BEACON: Optional[_Beacon] = None


def default_store() -> Any:
    """The store of the default process group: the launcher's store under the prefix of this
    attempt (megatron/training/attempt.py), so a restarted job never sees the last attempt's
    failure or heartbeats. torch has no public accessor for it."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def install(store: Any, rank: int, world_size: Optional[int] = None) -> None:
    """Report failures of this process (rank ``rank``) to ``store``, the job's shared store
    (a previous installation's watcher stops). ``world_size``: also keep a heartbeat (beaten by
    :func:`watch`), so a peer that dies silently can be named."""
    global _BEACON
    uninstall()
    _BEACON = _Beacon(store, rank, world_size)
    _beat(_BEACON)


def _beat(beacon: _Beacon) -> None:
    if beacon.world_size is not None:
        try:
            beacon.store.add(f"{ALIVE_KEY}{beacon.rank}", 1)
        except Exception:  # noqa: BLE001 -- the store went away: the job is ending
            pass


def _silent_peers(beacon: _Beacon) -> List[int]:
    """The peers whose heartbeat did not move for :func:`roll_call_s` (none when a failure
    was posted meanwhile: that line is the cause, or when the store is gone)."""
    if beacon.world_size is None or beacon.world_size < 2:
        return []
    peers = [r for r in range(beacon.world_size) if r != beacon.rank]
    try:
        if beacon.store.check([KEY]):
            return []
        start = {r: beacon.store.add(f"{ALIVE_KEY}{r}", 0) for r in peers}
        deadline = time.monotonic() + roll_call_s()
        idle = threading.Event()
        while peers and time.monotonic() < deadline:
            idle.wait(POLL_S / 2)
            if beacon.store.check([KEY]):
                return []
            peers = [r for r in peers if beacon.store.add(f"{ALIVE_KEY}{r}", 0) == start[r]]
    except Exception:  # noqa: BLE001 -- the store went away with a peer: nothing to name
        return []
    return peers


def uninstall() -> None:
    """Stop reporting, and watching unless a failure was seen: then the watcher keeps its grace
    period, so a process whose exit blocks (an NCCL communicator waiting for a peer that never
    comes) still leaves with status 1."""
    global _BEACON
    if _BEACON is not None and _BEACON.seen is None:
        _BEACON.stop.set()
    _BEACON = None


def _line(rank: int, where: str, exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"rank {rank}: {where}: {type(exc).__name__}: {text[0] if text else ''}"


def report(where: str, exc: BaseException) -> BaseException:
    """Post this rank's failure ``exc`` at ``where`` (unless a failure was posted already) and
    return the exception to raise: a :class:`CommunicationFailure` with the job's first posted
    line, caused by ``exc``; ``exc`` itself when nothing is installed or it already is one. The
    rank whose post is the first prints ``exc``'s traceback (the others' errors follow from it)."""
    beacon = _BEACON
    if beacon is None or isinstance(exc, CommunicationFailure):
        return exc
    mine = _line(beacon.rank, where, exc)
    if any(phrase in str(exc) for phrase in PEER_LOSS):
        silent = _silent_peers(beacon)
        if silent:
            who = (f"rank {silent[0]}" if len(silent) == 1 else
                   f"ranks {', '.join(map(str, silent))}")
            mine = f"{who} stopped answering: {mine.replace(': ', ' at ', 1)}"
    try:
        first = beacon.store.compare_set(KEY, "", mine)
        beacon.seen = first.decode() if isinstance(first, bytes) else str(first)
    except Exception:  # noqa: BLE001 -- the store is gone (the job is ending): keep the cause
        beacon.seen = beacon.seen or mine
    if beacon.seen == mine:   # the root cause: its traceback once, on the rank where it happened
        print(f"[rank {beacon.rank}] {where} failed; every rank stops:", file=sys.stderr)
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        sys.stderr.flush()
    failure = CommunicationFailure(beacon.seen)
    failure.__cause__ = exc
    return failure


def posted() -> Optional[str]:
    """The job's posted failure line once this rank has seen it (no store access), else None."""
    beacon = _BEACON
    return None if beacon is None else beacon.seen


def raise_if_posted() -> None:
    """Raise :class:`CommunicationFailure` if a failure was posted (a waiter's check)."""
    line = posted()
    if line is not None:
        raise CommunicationFailure(line)


def watch(log: Any = None) -> Optional[threading.Thread]:
    """Start the daemon thread that looks for a posted failure every :data:`POLL_S` seconds;
    once there is one, it prints it (``log``: a callable taking the line, default stderr) and,
    if the process is still alive :data:`GRACE_S` seconds later, exits with status 1."""
    beacon = _BEACON
    if beacon is None:
        return None

    def say(line: str) -> None:
        if log is not None:
            log(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def run() -> None:
        while not beacon.stop.wait(POLL_S):
            _beat(beacon)
            try:
                found = beacon.store.check([KEY])
                line = beacon.store.get(KEY).decode() if found else None
            except Exception:  # noqa: BLE001 -- the store went away: the job is ending
                return
            if line is None:
                continue
            beacon.seen = line
            say(f"[rank {beacon.rank}] stopping: {line}")
            time.sleep(GRACE_S)
            say(f"[rank {beacon.rank}] still blocked {GRACE_S:.0f} s after the failure was "
                "posted (inside a collective): exiting with status 1")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    thread = threading.Thread(target=run, name="quant-failure-watch", daemon=True)
    thread.start()
    return thread


def wait_until(done: Any, timeout: Optional[float]) -> bool:
    """``done.wait(timeout)`` for a ``threading.Event`` that also returns (raising
    :class:`CommunicationFailure`) once another rank's failure was posted."""
    if _BEACON is None:
        return done.wait(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        step = POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - time.monotonic()))
        if done.wait(step):
            return True
        raise_if_posted()
        if deadline is not None and time.monotonic() >= deadline:
            return False
