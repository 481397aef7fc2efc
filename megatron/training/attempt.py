"""Which attempt of the job this process belongs to, and the store key space of that attempt.

Why: torchrun restarts the workers into the job's one TCP store, and torch's ``env://`` adds no
per-attempt prefix, so restarted ranks would rendezvous among the dead attempt's keys (gloo
connects to dead addresses, the failure beacon finds the old failure). Every attempt therefore
uses a ``PrefixStore`` of its own, numbered by an agreement through the store (a counter rank 0
takes, a nonce handshake only a live rank 0 answers). See [Note: attempt numbers] in
docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from typing import Any, Mapping, Optional

COUNTER_KEY = "megatron/attempt_counter"
CURRENT_KEY = "megatron/attempt_current"
POLL_S = 0.05
"""Seconds between two looks at the store while waiting (each look is one small request)."""


class AttemptAgreementError(RuntimeError):
    """The ranks of this round could not agree on an attempt before the deadline."""


@dataclasses.dataclass(frozen=True)
class Attempt:
    """This process's attempt: its number (1 for the first on this store), the prefix of its
    store keys, and what torchrun said about it (None outside torchrun)."""

    number: int
    prefix: str
    run_id: Optional[str] = None
    restart_count: Optional[int] = None
    max_restarts: Optional[int] = None

    def describe(self) -> str:
        """One line for the startup log."""
        where = f"attempt {self.number}"
        if self.run_id is not None:
            where += f" of run {self.run_id}"
        if self.restart_count is not None:
            where += (f" (this node's torchrun restart {self.restart_count} of at most "
                      f"{self.max_restarts})")
        return f"{where}; process groups rendezvous under store keys '{self.prefix}'"


def int_or_none(text: Optional[str]) -> Optional[int]:
    """``text`` as an int; None when absent or not a number (a launcher's variable)."""
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _wait_for(store: Any, key: str, deadline: float) -> bool:
    """Whether ``key`` appeared in ``store`` before ``deadline`` (``store.check`` polled:
    a timed-out ``store.wait`` logs a warning from c10d each time)."""
    idle = threading.Event()
    while True:
        if store.check([key]):
            return True
        if time.monotonic() >= deadline:
            return False
        idle.wait(POLL_S)


def agree(store: Any, rank: int, world_size: int, timeout_s: float,
          environ: Mapping[str, str] = os.environ) -> Attempt:
    """The attempt every rank of this rendezvous round agrees on (see the module docstring);
    raises :class:`AttemptAgreementError` naming what did not arrive by ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        number = int(store.add(COUNTER_KEY, 1))
        floor = (int_or_none(environ.get("TORCHELASTIC_RESTART_COUNT")) or 0) + 1
        if number < floor:   # a store of this round only: count at least this agent's restarts
            number = int(store.add(COUNTER_KEY, floor - number))
        store.set(CURRENT_KEY, str(number))
        for peer in range(1, world_size):
            hello = f"megatron/attempt{number}/hello/{peer}"
            if not _wait_for(store, hello, deadline):
                raise AttemptAgreementError(
                    f"rank 0, attempt {number}: rank {peer} did not check in within "
                    f"{timeout_s:.0f} s (not started, or it cannot reach the store at "
                    f"{environ.get('MASTER_ADDR')}:{environ.get('MASTER_PORT')})")
            nonce = store.get(hello).decode()
            store.set(f"megatron/attempt{number}/welcome/{nonce}", "1")
    else:
        nonce = uuid.uuid4().hex
        number, told = None, None
        while True:
            if not _wait_for(store, CURRENT_KEY, deadline):
                raise AttemptAgreementError(
                    f"rank {rank}: rank 0 published no attempt within {timeout_s:.0f} s")
            current = int(store.get(CURRENT_KEY).decode())
            if current != told:       # a new candidate (the first, or a newer round's)
                store.set(f"megatron/attempt{current}/hello/{rank}", nonce)
                told = current
            if store.check([f"megatron/attempt{current}/welcome/{nonce}"]):
                number = current
                break
            if time.monotonic() >= deadline:
                raise AttemptAgreementError(
                    f"rank {rank}: rank 0 of attempt {current} did not answer within "
                    f"{timeout_s:.0f} s (the attempt of a dead round, and no rank 0 of this "
                    "round published a newer one)")
            threading.Event().wait(POLL_S)
    return Attempt(number=number, prefix=f"megatron/attempt{number}/pg/",
                   run_id=environ.get("TORCHELASTIC_RUN_ID"),
                   restart_count=int_or_none(environ.get("TORCHELASTIC_RESTART_COUNT")),
                   max_restarts=int_or_none(environ.get("TORCHELASTIC_MAX_RESTARTS")))


_CURRENT: Optional[Attempt] = None


def current() -> Optional[Attempt]:
    """The attempt of this process's default process group (None before the trainer's
    :func:`~megatron.training.initialize.initialize_distributed`, or when the group was made
    elsewhere)."""
    return _CURRENT


def set_current(attempt: Optional[Attempt]) -> None:
    global _CURRENT
    _CURRENT = attempt
