"""Deterministic fault injection for the crash-recovery tests.

Why: "a rank killed while a checkpoint is written" must be tested at exactly that moment, not
by racing a timer against the save.  With ``MEGATRON_FAULT_INJECTION=kill:POINT:ITERATION:RANK``
in the environment, rank RANK sends itself SIGKILL when it reaches POINT at ITERATION (the same
as ``kill -9`` from outside: no Python cleanup, no flush).  Unset, :func:`point` does nothing.
"""

from __future__ import annotations

import os
import signal

ENV = "MEGATRON_FAULT_INJECTION"


def point(name: str, iteration: int) -> None:
    """Mark a named point of the run; die here if the environment asks for it."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    action, where, at_iteration, rank = spec.split(":")
    import torch

    if (action == "kill" and where == name and int(at_iteration) == iteration
            and torch.distributed.get_rank() == int(rank)):
        os.kill(os.getpid(), signal.SIGKILL)
