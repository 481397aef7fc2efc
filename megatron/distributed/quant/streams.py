"""Communication streams: where a bucket's quantized collectives run so that compute goes on.

Three stages (``intra``, ``inter``, ``weights``) each run their jobs in submission order, so
bucket ``i+1``'s intra hop overlaps bucket ``i``'s inter hop and compute goes on. A stage is a
worker thread on CPU / gloo and a ``torch.cuda.Stream`` on CUDA (:meth:`CommStreams.for_device`);
:data:`INLINE` runs the same steps in the caller, so overlap never changes the numbers. Each stage
times its jobs (``busy_s``). See "Streams and overlap (streams.py)" in docs/architecture.md.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from megatron.distributed import failures

__all__ = ["Job", "CommStreams", "CommTiming", "INLINE", "STAGES", "used_on_this_stage",
           "single_hardware_queue_warning"]

STAGES = ("intra", "inter", "weights")

_RUNNING = threading.local()
"""``_RUNNING.cuda_stage``: the :class:`_CudaStage` whose job the calling thread is enqueuing."""


def used_on_this_stage(*tensors: torch.Tensor) -> None:
    """Declare that the CUDA stage enqueuing the current job reads ``tensors``, which another
    stream allocated (the middle hop's codes: made on the ``intra`` stage, sent by ``inter``).
    A no-op outside a CUDA stage."""
    # See [Note: cross-stream buffer lifetimes] in docs/architecture.md
    stage = getattr(_RUNNING, "cuda_stage", None)
    if stage is None:
        return
    for t in tensors:
        t.record_stream(stage.stream)


def single_hardware_queue_warning(env: Dict[str, str], *, device: str, overlap: bool,
                                  tensor_parallel: int, sequence_parallel: bool) -> Optional[str]:
    """The startup warning for ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with overlapped quantized
    communication on CUDA, or None.

    With one hardware queue every stream's work is serialised, so a stage waiting on the network
    holds back the compute queued after it and the overlap is lost."""
    if device != "cuda" or not overlap or env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        return None
    why = ("" if tensor_parallel > 1 and sequence_parallel else
           " (nothing in this run needs it: unset it)")
    return ("CUDA_DEVICE_MAX_CONNECTIONS=1 puts every CUDA stream in one hardware queue: the "
            "quantized collectives' communication stages (--overlap-grad-reduce / "
            "--overlap-param-gather) then block the compute queued after them, so communication "
            f"no longer overlaps with compute{why}")


class Job:
    """A submitted job: :meth:`wait` for it (idempotent; re-raises the job's error)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self.event: Any = None      # CUDA: the event recorded at the end of the job
        self.keepalive: Any = None
        """CUDA: the job's closure, so the tensors it enqueued work on stay allocated until
        :meth:`wait` has ordered the waiting stream after the job (the caching allocator may
        hand a freed block to other work at once; FSDP2 keeps its buffers the same way)."""

    def _finish(self, error: Optional[BaseException] = None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        """The job ran (CPU), or its CUDA work finished on the device (not only enqueued)."""
        return self._done.is_set() and (self.event is None or bool(self.event.query()))

    @property
    def error(self) -> Optional[BaseException]:
        """The job's exception once it finished with one (else None)."""
        return self._error

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the job finished (``timeout`` seconds at most: then ``TimeoutError``), or
        until another rank's failure was posted (:mod:`.failures`: then ``CommunicationFailure``,
        since this job may wait for that rank forever)."""
        if not failures.wait_until(self._done, timeout):
            raise TimeoutError(f"communication job not done after {timeout} s")
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
            self.keepalive = None   # later work on any stage is ordered after this stream
        if self._error is not None:
            raise self._error


class _Stage:
    """One stage: runs jobs in submission order, timing each.

    An asynchronous stage stops at its first failed job (later jobs fail with its error unrun)
    and posts it to every rank (:mod:`.failures`)."""
    # See [Note: a stage stops at its first failure] in docs/architecture.md

    stops_at_first_error = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy_s = 0.0
        self.failed: Optional[BaseException] = None

    def submit(self, fn: Callable[[], None], after: Sequence[Job], label: str = "") -> Job:
        raise NotImplementedError

    def _run(self, fn: Callable[[], None], after: Sequence[Job], job: Job,
             label: str = "") -> None:
        if self.failed is not None and self.stops_at_first_error:
            job._finish(self.failed)
            return
        t0 = time.perf_counter()
        try:
            for dep in after:
                dep.wait()
            t0 = time.perf_counter()   # waiting for another stage is not this stage's time
            fn()
        except BaseException as e:  # noqa: BLE001 -- delivered to the waiter
            e = failures.report(label or f"a job of the {self.name} communication stage", e)
            if self.stops_at_first_error:
                self.failed = e
            job._finish(e)
        else:
            job._finish()
        finally:
            self._add_host_time(time.perf_counter() - t0)

    def _add_host_time(self, seconds: float) -> None:
        self.busy_s += seconds


class _InlineStage(_Stage):
    stops_at_first_error = False   # each job runs in its caller, who gets its error at once

    def submit(self, fn: Callable[[], None], after: Sequence[Job] = (), label: str = "") -> Job:
        job = Job()
        self._run(fn, after, job, label)
        return job


class _ThreadStage(_Stage):
    """A daemon worker thread with a FIFO queue (CPU / gloo)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"quant-comm-{name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, after, job, label = self._queue.get()
            self._run(fn, after, job, label)

    def submit(self, fn: Callable[[], None], after: Sequence[Job] = (), label: str = "") -> Job:
        job = Job()
        self._queue.put((fn, tuple(after), job, label))
        return job


class _CudaStage(_Stage):
    """A CUDA stream: jobs are enqueued at once, ordered by events (see the module docstring).

    The stream has the highest priority the device offers, so that a communication kernel that
    becomes ready is scheduled before queued compute (as NCCL's own internal streams are)."""

    def __init__(self, name: str, device: torch.device) -> None:
        super().__init__(name)
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        self._device_s = 0.0
        self._timed: list = []
        """(start, end) timing events of jobs whose device time is not yet counted."""

    def _add_host_time(self, seconds: float) -> None:
        """The host part of a CUDA job only enqueues: its time is not the stage's."""

    @property
    def busy_s(self) -> float:
        """Device time of this stage's finished jobs (CUDA events; jobs still running on the
        device are counted once they finished). Read at log intervals only."""
        pending = []
        for start, end in self._timed:
            if end.query():
                self._device_s += start.elapsed_time(end) / 1000.0
            else:
                pending.append((start, end))
        self._timed = pending
        return self._device_s

    @busy_s.setter
    def busy_s(self, value: float) -> None:
        self._device_s = value

    def submit(self, fn: Callable[[], None], after: Sequence[Job] = (), label: str = "") -> Job:
        job = Job()
        failed = self.failed or next((dep.error for dep in after if dep.error is not None), None)
        if failed is not None:
            # The host part of a CUDA job runs at submission, so a dependency (or an earlier
            # job of this stage) has already finished: its error is the cause, running ``fn``
            # would only hide it behind a follow-up error (the inter hop's missing codes) and
            # enter a collective the failed rank never joins (see _Stage).
            self.failed = failed
            job._finish(failed)
            return job
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        for dep in after:
            if dep.event is not None:
                self.stream.wait_event(dep.event)
        with torch.cuda.stream(self.stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            _RUNNING.cuda_stage = self
            try:
                self._run(fn, (), job, label)
            finally:
                _RUNNING.cuda_stage = None
            job.event = torch.cuda.Event(enable_timing=True)
            job.event.record(self.stream)
        self._timed.append((start, job.event))
        job.keepalive = fn
        return job


class CommStreams:
    """The three stages of one model's quantized communication (created lazily)."""

    def __init__(self, kind: str, device: Optional[torch.device] = None) -> None:
        if kind not in ("inline", "thread", "cuda"):
            raise ValueError(f"unknown stream kind {kind!r}")
        self.kind = kind
        self.device = device
        self._stages: Dict[str, _Stage] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_device(cls, device: torch.device) -> "CommStreams":
        """Worker threads for CPU buffers, CUDA streams for CUDA buffers."""
        return cls("cuda", device) if torch.device(device).type == "cuda" else cls("thread")

    def stage(self, name: str) -> _Stage:
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}; choose from {STAGES}")
        with self._lock:
            st = self._stages.get(name)
            if st is None:
                if self.kind == "thread":
                    st = _ThreadStage(name)
                elif self.kind == "cuda":
                    st = _CudaStage(name, self.device)
                else:
                    st = _InlineStage(name)
                self._stages[name] = st
            return st

    def submit(self, stage: str, fn: Callable[[], None], after: Sequence[Job] = (),
               label: str = "") -> Job:
        """Run ``fn`` on ``stage`` after the jobs ``after`` finished. ``label`` says what the
        job is (the bucket and the hop) in the error every rank sees if it fails."""
        return self.stage(stage).submit(fn, after, label)

    def busy_seconds(self) -> Dict[str, float]:
        """Wall time each stage has spent in jobs so far (monotonic; diff it per interval)."""
        return {name: self._stages[name].busy_s if name in self._stages else 0.0
                for name in STAGES}


INLINE = CommStreams("inline")
"""Runs every job at once in the caller (no overlap)."""


class CommTiming:
    """Per-iteration communication time of one model: total (time the stages spent in jobs) vs
    exposed (time the trainer's thread spent in them or waiting for them).

    Without overlap the jobs run inline, so total == exposed; with overlap the difference is what
    the overlap hid behind compute. Reported by :meth:`interval_report` as
    ``comm_grad_intra_ms``, ``comm_grad_inter_ms`` (total per stage), ``comm_grad_exposed_ms``,
    ``comm_weight_ms``, ``comm_weight_exposed_ms`` (per iteration, over the interval).
    On CUDA "total" is device time between events and "exposed" only the host's enqueue of the
    wait; the real stall shows in the iteration time.
    """

    def __init__(self, inline: CommStreams) -> None:
        self.inline = inline
        self.overlapped: Optional[CommStreams] = None
        self.waited = {"grad": 0.0, "weight": 0.0}
        self.iterations = 0
        self._last: Dict[str, float] = {}

    def wait(self, kind: str, handle: Any) -> None:
        """``handle.wait()``, counting the time as exposed ``kind`` ('grad' / 'weight') time."""
        t0 = time.perf_counter()
        try:
            handle.wait()
        finally:
            self.waited[kind] += time.perf_counter() - t0

    def _cumulative(self) -> Dict[str, float]:
        inline = self.inline.busy_seconds()
        over = (self.overlapped.busy_seconds() if self.overlapped is not None
                else dict.fromkeys(STAGES, 0.0))
        return {
            "grad_intra": inline["intra"] + over["intra"],
            "grad_inter": inline["inter"] + over["inter"],
            "grad_exposed": inline["intra"] + inline["inter"] + self.waited["grad"],
            "weight": inline["weights"] + over["weights"],
            "weight_exposed": inline["weights"] + self.waited["weight"],
            "iterations": float(self.iterations),
        }

    def interval_report(self, reset: bool = True) -> Dict[str, float]:
        """Milliseconds per iteration since the last reset (empty if no iteration ran)."""
        now = self._cumulative()
        delta = {k: v - self._last.get(k, 0.0) for k, v in now.items()}
        if reset:
            self._last = now
        its = delta.pop("iterations")
        if its <= 0:
            return {}
        return {f"comm_{k}_ms": 1000.0 * v / its for k, v in delta.items()}
