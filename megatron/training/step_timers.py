"""``--timing-log-level``: how long each part of a step took, next to the iteration line.

Level 1 times the forward-backward pass (every micro-batch, with the gradient reduction the
schedule waits for) and the optimizer step (gradient norm, update and, without
``--overlap-param-gather``, the parameter gather); level 2 adds the batch generator (the data
iterator's ``next`` in the trainer's own forward step; a ``forward_step_func`` passed to
``pretrain`` is not timed there) and zeroing the gradient buffers. At each log interval every rank reports
its mean milliseconds per iteration and the log shows the slowest rank's, as Megatron-LM's
timers do (one small all-reduce per log interval, on every rank).

Why a device sync around each timed part at levels 1 and 2: the host returns from a CUDA step
long before the device has run what it queued, so without one the timers would measure
queueing. Megatron-LM's timers synchronise too. At level 0, the default, nothing is timed and
nothing waits (tests/test_step_syncs.py).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Dict, Iterator

import torch

__all__ = ["TIMER_LEVELS", "StepTimers", "configure", "current"]

TIMER_LEVELS: Dict[str, int] = {"forward-backward": 1, "optimizer": 1, "batch-generator": 2,
                                "zero-grad": 2}
"""Each timer and the lowest ``--timing-log-level`` that shows it, in the log's order."""


class StepTimers:
    """The timers of one run at one ``--timing-log-level``."""

    def __init__(self, level: int = 0, device: torch.device = torch.device("cpu")) -> None:
        if level not in (0, 1, 2):
            raise ValueError(f"--timing-log-level must be 0, 1 or 2, got {level}")
        self.level = level
        self.device = device
        self.names = [n for n, lvl in TIMER_LEVELS.items() if lvl <= level]
        self._seconds: Dict[str, float] = dict.fromkeys(self.names, 0.0)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Add the seconds the block took to ``name`` (when the level shows it)."""
        if name not in self._seconds:
            if name not in TIMER_LEVELS:
                raise KeyError(f"unknown timer {name!r}; known: {', '.join(TIMER_LEVELS)}")
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._seconds[name] += time.perf_counter() - start

    def report(self, iterations: int) -> Dict[str, float]:
        """Milliseconds per iteration of each shown timer since the last report, the slowest
        rank's (every rank must call this at the same iteration); resets. Empty at level 0."""
        if not self.names:
            return {}
        local = torch.tensor([self._seconds[n] for n in self.names], dtype=torch.float64,
                             device=self.device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX)
        self._seconds = dict.fromkeys(self.names, 0.0)
        per = 1e3 / max(1, iterations)
        return {n: s * per for n, s in zip(self.names, local.tolist())}


_CURRENT = StepTimers()


def configure(level: int, device: torch.device) -> StepTimers:
    """Set the run's timers (training start); :func:`current` returns them from then on."""
    global _CURRENT
    _CURRENT = StepTimers(level, device)
    return _CURRENT


def current() -> StepTimers:
    """The run's timers (level 0, timing nothing, before :func:`configure`)."""
    return _CURRENT
