"""When a run stops early: a signal (``--exit-signal-handler``), a time budget
(``--exit-duration-in-mins``) or an iteration count (``--exit-interval``), as in Megatron-LM.

Why one place: a preempted job must save and exit cleanly, and every rank must stop at the
*same* iteration boundary (an early rank would leave its peers blocked in a collective, and the
checkpoint would mix two iterations). Signals and clocks differ per rank, so the decision is one
all-reduce MAX of the local flags per iteration, only with a signal handler or a time budget;
``--exit-interval`` needs none. The handler only records the signal; the loop saves and exits 0.
See [Note: stopping under torchrun] in docs/architecture.md.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable, Dict, Optional

SIGNALS: Dict[str, signal.Signals] = {
    "SIGTERM": signal.SIGTERM,
    "SIGINT": signal.SIGINT,
    "SIGUSR1": signal.SIGUSR1,
    "SIGUSR2": signal.SIGUSR2,
}
"""The signals ``--exit-signal`` may name (Megatron-LM's choices)."""


class ExitSignalHandler:
    """Records that ``sig`` arrived; :meth:`release` restores the previous handler.

    The handler itself only sets a flag and writes one line to stderr with ``os.write`` (a
    ``print`` could re-enter a stream the interrupted code was writing to)."""

    def __init__(self, sig: signal.Signals = signal.SIGTERM, rank: Optional[int] = None) -> None:
        self.sig = sig
        self.rank = rank
        self.received = False
        self._previous: Any = None
        self._installed = False

    def install(self) -> "ExitSignalHandler":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("--exit-signal-handler: signal handlers can only be installed "
                               "from the main thread")
        self._previous = signal.signal(self.sig, self._handle)
        self._installed = True
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.received:
            who = f"rank {self.rank}" if self.rank is not None else f"pid {os.getpid()}"
            os.write(2, (f" > {who}: received {signal.Signals(signum).name}: saving and exiting "
                         "at the end of this iteration\n").encode())
        self.received = True

    def release(self) -> None:
        if self._installed:
            signal.signal(self.sig, self._previous)
            self._installed = False


def launcher_forwarding_warning(sig_name: str, environ: Dict[str, str]) -> Optional[str]:
    """The startup WARNING when torchrun will not forward ``sig_name`` to the workers, or None.

    torchrun's agent exports ``TORCHELASTIC_SIGNALS_TO_HANDLE`` (its ``--signals-to-handle``)
    to the workers. A signal outside that list sent to torchrun kills torchrun (exit -10 for
    SIGUSR1) and the workers train on as orphans to the last iteration: the save the user asked
    for never happens."""
    handled = environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    if handled is None:            # not under torchrun: the signal reaches this process
        return None
    names = {n.strip() for n in handled.split(",") if n.strip()}
    if sig_name in names:
        return None
    return (f"--exit-signal {sig_name}: this torchrun forwards only {', '.join(sorted(names))} "
            f"to its workers; {sig_name} sent to torchrun kills torchrun and leaves the workers "
            f"running without a save. Launch torchrun with --signals-to-handle "
            f"{','.join(sorted(names | {sig_name}))}, or send {sig_name} to the worker processes")


class ExitConditions:
    """The early-exit rules of one run; :meth:`check` is called at every iteration boundary.

    ``all_reduce_max`` (for tests) replaces the world all-reduce: it takes a list of two
    floats and returns the elementwise maximum over all ranks."""

    def __init__(self, args: Any, start_time: float, device: Any = None,
                 all_reduce_max: Optional[Callable[[list], list]] = None,
                 rank: Optional[int] = None) -> None:
        self.interval = getattr(args, "exit_interval", None)
        minutes = getattr(args, "exit_duration_in_mins", None)
        self.minutes = minutes
        self.deadline = None if minutes is None else start_time + 60.0 * float(minutes)
        self.handler: Optional[ExitSignalHandler] = None
        self.warning: Optional[str] = None
        """What the trainer warns about at startup (:func:`launcher_forwarding_warning`)."""
        if getattr(args, "exit_signal_handler", False):
            sig = SIGNALS[getattr(args, "exit_signal", None) or "SIGTERM"]
            self.handler = ExitSignalHandler(sig, rank).install()
            self.warning = launcher_forwarding_warning(sig.name, dict(os.environ))
        self.device = device
        self._all_reduce_max = all_reduce_max

    @property
    def needs_agreement(self) -> bool:
        """True when :meth:`check` communicates (a signal or a time budget is watched)."""
        return self.handler is not None or self.deadline is not None

    def local_flags(self) -> list:
        """[signal received, time up] on this rank (0.0 / 1.0)."""
        sig = 1.0 if self.handler is not None and self.handler.received else 0.0
        late = 1.0 if self.deadline is not None and time.time() >= self.deadline else 0.0
        return [sig, late]

    def _agree(self, flags: list) -> list:
        if self._all_reduce_max is not None:
            return list(self._all_reduce_max(flags))
        import torch
        import torch.distributed as dist

        t = torch.tensor(flags, dtype=torch.float32, device=self.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]

    def check(self, iteration: int, boundary: bool = True) -> Optional[str]:
        """The reason to stop after ``iteration`` (the same on every rank), or None.

        Collective when :attr:`needs_agreement`: every rank must call it at the same
        boundaries.  ``boundary=False`` (before the first iteration) skips --exit-interval."""
        if self.needs_agreement:
            sig, late = self._agree(self.local_flags())
            if sig:
                return f"exit signal {self.handler.sig.name if self.handler else 'received'}"
            if late:
                return f"exit duration {self.minutes} min"
        if boundary and self.interval and iteration % self.interval == 0:
            return f"exit interval {self.interval}"
        return None

    def release(self) -> None:
        """Restore the previous signal handler (end of the run)."""
        if self.handler is not None:
            self.handler.release()
