"""Deterministic fault injection for the crash-recovery tests.

Why: "a rank killed while a checkpoint is written" must be tested at exactly that moment, not
by racing a timer against the save.  With ``MEGATRON_FAULT_INJECTION=kill:POINT:ITERATION:RANK``
in the environment, rank RANK sends itself SIGKILL when it reaches POINT at ITERATION (the same
as ``kill -9`` from outside: no Python cleanup, no flush).  ``raise:POINT:ITERATION:RANK``
raises :class:`InjectedFault` there instead (a failure the trainer reports itself);
``kill-node:...`` SIGKILLs the rank's launcher (its parent, torchrun's agent) and then the rank: a
node lost, as far as the rest of the job can tell. RANK ``*`` is every rank (each of a node's
ranks then takes its agent down).  An optional fifth field, ``...:RESTART``, limits the fault
to the workers whose ``TORCHELASTIC_RESTART_COUNT`` is RESTART (a restarted attempt that trains
past the same point again must not die again).  Points: ``checkpoint-written`` (a rank's files
of a save written, before the checkpoint is complete) and ``iteration-end`` (an iteration
logged).  Unset, :func:`point` does nothing.
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
    action, where, at_iteration, rank, *restart = spec.split(":")
    if action not in ("kill", "raise", "kill-node"):
        raise ValueError(f"{ENV}={spec!r}: the action is 'kill', 'kill-node' or 'raise'")
    import torch

    if (where != name or int(at_iteration) != iteration
            or (rank != "*" and torch.distributed.get_rank() != int(rank))
            or (restart and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != restart[0])):
        return
    if action == "kill-node" and _parent_is_torchrun():
        os.kill(os.getppid(), signal.SIGKILL)
    if action in ("kill", "kill-node"):
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"injected fault at {name}, iteration {iteration}, rank {rank}")


class InjectedFault(RuntimeError):
    """The failure ``raise:...`` asks for."""


def _parent_is_torchrun() -> bool:
    """Whether this process's parent is torchrun's agent (not init, after a sibling took the
    agent down and this rank was re-parented)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return "torchrun" in cmdline or "torch.distributed.run" in cmdline
