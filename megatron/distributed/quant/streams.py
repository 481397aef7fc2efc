"""Communication streams: where a bucket's quantized collectives run so that compute goes on.

The quantized collectives of one bucket are a chain of steps (quantize, intra-node all-to-all,
dequantize-sum-requantize, inter-node all-to-all, final sum; for weights: quantize, all-gather,
dequantize-add). Overlap means the chain of bucket ``i`` proceeds while the caller computes
(backward of the next layers, forward of the current one) and while bucket ``i+1``'s chain
starts. Three named stages, each executing its jobs in submission order:

* ``intra`` -- quantization and the intra-node hop (and the middle requantization) of the
  gradient reduce-scatter; the first hop of a single-hop path;
* ``inter`` -- the inter-node hop and the final reduction of the gradient reduce-scatter;
* ``weights`` -- the quantized weight all-gather.

So the intra hop of bucket ``i+1`` (or of pipeline chunk ``y+1``) runs while the inter hop of
bucket ``i`` (chunk ``y``) is on the wire. Collectives of one process group are issued by one
stage only, in submission order, which is the same on every rank (bucket and chunk order).

Backends (chosen by the device of the buffers, :meth:`CommStreams.for_device`):

* **CPU / gloo** (what runs here): each stage is one worker thread. A gloo collective blocks its
  caller, and the C++ kernels and gloo release the GIL, so a worker's communication and
  quantization run while the main thread computes. Jobs return a :class:`Job` whose
  :meth:`Job.wait` blocks until the job (and what it waited on) finished, re-raising its error.
* **CUDA / NCCL** (the GPU design, untested on this machine): each stage is a
  ``torch.cuda.Stream``. A job runs at once on the host, inside ``torch.cuda.stream(stage)``,
  after the stage stream waits on the submitting stream (the gradients / master weights are
  ready there) and on the events of the jobs it depends on; it records an event at its end.
  Kernels and NCCL calls are only enqueued, so the host never blocks; :meth:`Job.wait` makes the
  *current* stream wait on the job's event, as megatron-core's ``finish_grad_sync`` does with its
  NCCL handles. Buffers a stage reads or writes stay alive through the job's closure until
  :meth:`Job.wait` (``Job.keepalive``), and every stage first waits on the submitting stream, so a
  block freed after the wait is never reused under a pending read; the caller must not reuse the
  input / output buffers before the wait (the bucket's own handle guarantees it).

Without overlap, :data:`INLINE` runs every job at once in the caller's thread/stream: the same
steps in the same order, so overlap never changes the numbers.

Each stage accumulates the time its jobs took (``busy_s``: wall time of the worker on CPU, device
time between CUDA events on a GPU): the "total" communication time of the per-iteration timing
log, next to the "exposed" time the main thread waited.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from . import failures

__all__ = ["Job", "CommStreams", "CommTiming", "INLINE", "STAGES", "used_on_this_stage",
           "single_hardware_queue_warning"]

STAGES = ("intra", "inter", "weights")

_RUNNING = threading.local()
"""``_RUNNING.cuda_stage``: the :class:`_CudaStage` whose job the calling thread is enqueuing."""


def used_on_this_stage(*tensors: torch.Tensor) -> None:
    """Declare that the CUDA stage enqueuing the current job reads ``tensors``, which another
    stream allocated (the middle hop's codes: made on the ``intra`` stage, sent by ``inter``).

    The caching allocator ties a block to the stream that allocated it: once the last Python
    reference is gone, the next allocation *on that stream* may reuse the block at once, while
    this stage's kernels or NCCL call (enqueued, not executed) still read it. Since torch 2.8 an
    NCCL call with ``async_op=False`` does not keep its tensors alive either. ``record_stream``
    makes the allocator wait for this stage's pending work before it reuses the block -- the
    standard rule "every tensor used on another stream stays alive until that stream is done".
    Outside a CUDA stage (inline, CPU worker threads) there is nothing to do."""
    stage = getattr(_RUNNING, "cuda_stage", None)
    if stage is None:
        return
    for t in tensors:
        t.record_stream(stage.stream)


def single_hardware_queue_warning(env: Dict[str, str], *, device: str, overlap: bool,
                                  tensor_parallel: int, sequence_parallel: bool) -> Optional[str]:
    """The startup warning for ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with overlapped quantized
    communication on CUDA, or None.

    With one hardware queue every stream's work is serialised in submission order: the inter
    stage's wait on the intra stage's all-to-all (which waits on the network) then holds back the
    compute kernels queued after it, and the communication stops overlapping with compute
    (stream priorities cannot help). Megatron-LM's recipes export the variable for tensor-parallel
    communication overlap; with one tensor-parallel rank, or without sequence parallelism, it
    buys nothing here."""
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

    An asynchronous stage (worker thread, CUDA stream) stops at its first failed job: every
    later job finishes with that error without running. Its collectives pair with the peers'
    by issue order, so one that ran after a rank-local failure (an out-of-memory in one bucket's
    quantize) would exchange bucket b+1's codes with the peers' bucket b: wrong data when the
    sizes match, a hang otherwise. The error reaches the caller at its next wait; nothing
    recovers from it (the run stops). The first failure is posted to every rank with the job's
    ``label`` (:mod:`.failures`; the error then raised names the rank, the bucket and the hop)."""

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
    On CUDA the stages' time is device time between CUDA events recorded around each job (the
    host only enqueues); "exposed" is the host's wait, which on CUDA is the time to make the
    waiting stream wait -- the real stall shows in the iteration time.
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
