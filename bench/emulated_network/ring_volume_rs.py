"""Benchmark-only exact reduce-scatters with the byte volume of NCCL's, for gloo process groups.

gloo implements ``reduce_scatter_tensor``/``reduce_scatter_single`` (and their coalesced form,
which megatron-core's ``_ParamAndGradBucketGroup.start_grad_sync`` uses through
``torch.distributed._coalescing_manager``) as an all-reduce followed by a copy: every rank sends
and receives ≈ 2·(P-1)/P·N elements, twice what a ring reduce-scatter moves. That inflates the
emulated-network baseline. This module replaces the reduce-scatter, **for gloo groups only**, by
one of two exact algorithms that move (P-1)/P·N elements per rank (byte counts below are for fp32
gradients; bf16 gradients, ``--grad-reduce-in-bf16``, halve them):

* ``a2a``  : ``all_to_all_single`` of the P chunks of N/P elements, then a local sum of the
             received chunks in rank order (chunk of rank 0 + rank 1 + ...). On the emulated
             2×2 topology every cross-node pair exchanges its chunks directly: 8 B/param of fp32
             gradients cross the link (both directions together).
* ``ring`` : the classic ring reduce-scatter with point-to-point isend/irecv, P-1 steps of N/P
             elements to rank+1 (ring 0→1→2→3→0). Sum order is the ring's (not rank order).
             Crosses the link twice per step: 6 B/param, NCCL's ring volume on this topology.

Neither changes megatron-core's source: :func:`install` rebinds
``torch.distributed.reduce_scatter_tensor``/``reduce_scatter_single``/``_reduce_scatter_base``
and, through ``mcore_compat.ddp_buckets.patch_bucket_collectives``, megatron-core's
``dist_reduce_scatter_func`` (bound at import time to ``torch.distributed.reduce_scatter_tensor``).
Calls on non-gloo groups, and reduce ops other than SUM/AVG, go to the original function.

Semantics kept from ``reduce_scatter_single``: ``output`` may alias a chunk of ``input`` (megatron's
bucket shard is a view into the bucket), ``input`` may be a concatenation or a stack of the
outputs, AVG divides the sum by P (gloo itself rejects AVG). Any dtype whose ``+`` torch has on
CPU works: fp32 (the default grad buffers) and bf16 (``--grad-reduce-in-bf16`` makes megatron-core's
grad buffers bf16). The sums are done in the buffer's dtype, one rounding per add, like NCCL's
bf16 ring reduce-scatter; both algorithms only move raw bytes (``all_to_all_single``,
``isend``/``irecv``), which gloo does for every dtype.

``async_op`` (megatron-core 0.16.1 passes ``async_op=overlap_grad_reduce`` and later calls
``.wait()`` on the handle it keeps):

* ``False``: done on the calling thread; returns None.
* ``True`` (``install(..., async_mode="thread")``, the default): the reduce-scatter is queued to
  one worker thread per process (the product's CPU communication stage, ``streams.py``), which
  runs the queued jobs one by one in submission order
  (every rank submits in the same order: megatron's bucket order), so it overlaps the backward
  pass. ``ring``: the worker runs the whole ring (``isend``/``irecv`` and the adds) on the
  caller's group with its own P2P tag (``RING_TAG``), which keeps its messages apart from
  everything the main thread issues meanwhile (collectives have their own gloo slots, and P2P
  messages are matched per peer and tag, in order). ``a2a``: the ``all_to_all_single`` is issued
  by the calling thread with ``async_op=True`` (c10d collectives must be issued in the same order
  on every rank, so not from a second thread); the worker waits for it, then does the local sum
  and the copy. No new process group is created (a lazily created group would need every member
  to create it at the same point, and torch's locally synchronized group names depend on how many
  groups each process already belongs to). The returned handle's ``wait()`` blocks until the job
  is done and re-raises its exception. Megatron keeps, as its handle, the ``_coalescing_manager``
  object it opened around the call, whose ``wait()`` only waits on the c10d works the manager
  itself recorded (none: ``all_to_all_single``/``isend`` are not coalescable). So :func:`install`
  also wraps ``param_and_grad_buffer._coalescing_manager`` (and
  ``torch.distributed._coalescing_manager``) to note the open manager, and the replacement
  appends its handle to it: ``cm.wait()`` then waits for the reduce-scatter.
* ``True`` with ``async_mode="sync"``: done on the calling thread, a completed handle is returned
  (no overlap; the behaviour before the worker thread existed).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import threading
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.distributed.quant.streams import CommStreams, Job

ALGOS = ("a2a", "ring")
ASYNC_MODES = ("thread", "sync")

_ORIG: Dict[str, Callable] = {}
STATS = {"calls": 0, "elements": 0, "fallbacks": 0, "async_calls": 0, "algo": None,
         "async_mode": "thread"}


class _DoneWork:
    """Work handle of an already completed operation."""

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - same signature as c10d Work
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


class _ThreadWork:
    """c10d-``Work``-like handle of a reduce-scatter queued to the worker thread: a view of the
    product's :class:`streams.Job` with c10d's ``wait(timeout)`` signature (see module docstring)."""

    def __init__(self, job: Job) -> None:
        self._job = job

    def wait(self, timeout=None) -> bool:
        """Block until the job is done (``timeout``: seconds or a timedelta; on expiry a
        RuntimeError, like c10d). Re-raises the job's exception. Idempotent."""
        if isinstance(timeout, _dt.timedelta):
            timeout = timeout.total_seconds()
        try:
            self._job.wait(timeout)
        except TimeoutError:
            raise RuntimeError(f"ring_volume_rs: reduce-scatter not done after {timeout} s") from None
        return True

    def is_completed(self) -> bool:
        return self._job.is_completed()

    def is_success(self) -> bool:
        return self._job.is_completed() and self._job.error is None


class _Worker:
    """One worker thread (the product's CPU communication stage, streams.py) that runs queued
    reduce-scatters in submission order."""

    def __init__(self) -> None:
        self._stage = CommStreams("thread").stage("inter")

    def submit(self, job: Callable[[], None]) -> _ThreadWork:
        return _ThreadWork(self._stage.submit(job))


_WORKER: Optional[_Worker] = None
_UNDO: list = []  # the undo of the bucket-collective patch (mcore_compat), when installed
_OPEN_CMS = threading.local()  # .stack: the _coalescing_manager objects open on this thread
RING_TAG = 0x52494E47  # P2P tag of the ring steps run by the worker thread ("RING")


def _worker() -> _Worker:
    global _WORKER
    if _WORKER is None:
        _WORKER = _Worker()
    return _WORKER


def _open_cm_stack() -> List[object]:
    if not hasattr(_OPEN_CMS, "stack"):
        _OPEN_CMS.stack = []
    return _OPEN_CMS.stack


def _make_tracking_cm(orig_cm: Callable) -> Callable:
    """``_coalescing_manager`` that records the open manager so an async replacement call inside
    it can append its handle (megatron waits on the manager, not on the returned handle)."""

    @contextlib.contextmanager
    def tracking_coalescing_manager(*args, **kwargs):
        with orig_cm(*args, **kwargs) as cm:
            stack = _open_cm_stack()
            stack.append(cm)
            try:
                yield cm
            finally:
                stack.pop()

    tracking_coalescing_manager.__wrapped__ = orig_cm
    return tracking_coalescing_manager


def _is_gloo(group) -> bool:
    try:
        return dist.get_backend(group) == "gloo"
    except Exception:  # not a c10d group we know: leave it alone
        return False


def _sum_rank_order(chunks: torch.Tensor, out: torch.Tensor) -> None:
    """out = chunks[0] + chunks[1] + ... (left to right, one rounding per add)."""
    out.copy_(chunks[0])
    for j in range(1, chunks.shape[0]):
        out.add_(chunks[j])


def reduce_scatter_a2a(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                       group=None, async_op: bool = False):
    """Exact reduce-scatter by all-to-all + local sum in rank order (see module docstring)."""
    return _reduce_scatter(output, input, op, group, async_op, "a2a")


def reduce_scatter_ring(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                        group=None, async_op: bool = False):
    """Exact ring reduce-scatter over isend/irecv (see module docstring)."""
    return _reduce_scatter(output, input, op, group, async_op, "ring")


def _reduce_scatter(output, input, op, group, async_op, algo):
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or not _is_gloo(group):
        STATS["fallbacks"] += 1
        return _ORIG.get("reduce_scatter_single", dist.reduce_scatter_single)(
            output, input, op=op, group=group, async_op=async_op)
    world = dist.get_world_size(group)
    n = output.numel()
    if input.numel() != n * world:
        raise ValueError(f"input has {input.numel()} elements, expected {n} x {world}")
    if input.dtype != output.dtype:
        raise ValueError(f"dtype mismatch: input {input.dtype}, output {output.dtype}")
    if algo not in ALGOS:
        raise ValueError(f"unknown algorithm {algo!r}; choose from {ALGOS}")
    STATS["calls"] += 1
    STATS["elements"] += input.numel()
    if not async_op:
        _reduce_scatter_now(output, input, op, group, algo)
        return None
    if STATS["async_mode"] == "sync":
        _reduce_scatter_now(output, input, op, group, algo)
        return _DoneWork()
    STATS["async_calls"] += 1
    if algo == "a2a":  # the collective is issued here, in this thread's (= every rank's) order
        recv, pending = _a2a_start(input, group, async_op=True)

        def job() -> None:
            pending.wait()
            _a2a_finish(recv, output, op, group)
    else:
        def job() -> None:
            _reduce_scatter_now(output, input, op, group, algo, tag=RING_TAG)
    work = _worker().submit(job)
    stack = _open_cm_stack()
    if stack:  # megatron keeps the manager as its handle: make cm.wait() wait for this job
        stack[-1].append(work)
    return work


def _flat(input: torch.Tensor) -> torch.Tensor:
    flat_in = input.reshape(-1)
    return flat_in if flat_in.is_contiguous() else flat_in.contiguous()


def _a2a_start(input, group, async_op: bool = False):
    """all_to_all_single of the P chunks: recv[i] = chunk `rank` of rank i. (recv, work or None)"""
    flat_in = _flat(input)
    recv = torch.empty_like(flat_in)
    return recv, dist.all_to_all_single(recv, flat_in, group=group, async_op=async_op)


def _a2a_finish(recv, output, op, group) -> None:
    """Local sum of the received chunks in rank order, AVG, then the write into ``output``."""
    world = dist.get_world_size(group)
    n = output.numel()
    result = torch.empty(n, dtype=output.dtype, device=output.device)
    _sum_rank_order(recv.view(world, n), result)
    if op == dist.ReduceOp.AVG:
        result.div_(world)
    # written only now: `output` may be a view into `input` (megatron's bucket shard)
    output.copy_(result.view(output.shape))


def _reduce_scatter_now(output, input, op, group, algo, tag: int = 0) -> None:
    """The reduce-scatter itself, on the calling thread (validated by :func:`_reduce_scatter`);
    ``tag``: the ring's P2P tag."""
    if algo == "a2a":
        recv, _ = _a2a_start(input, group)
        _a2a_finish(recv, output, op, group)
        return
    # ring
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    n = output.numel()
    chunks = _flat(input).view(world, n)
    nxt = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    prv = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    buf = chunks[(rank - 1) % world].clone()
    tmp = torch.empty_like(buf)
    for s in range(world - 1):
        reqs = [dist.isend(buf, nxt, group=group, tag=tag),
                dist.irecv(tmp, prv, group=group, tag=tag)]
        for r in reqs:
            r.wait()
        # received: partial sum of chunk (rank - 2 - s) from the previous rank
        buf = tmp + chunks[(rank - 2 - s) % world]
    result = buf  # after P-1 steps: the full sum of chunk `rank`
    if op == dist.ReduceOp.AVG:
        result.div_(world)
    # written only now: `output` may be a view into `input` (megatron's bucket shard)
    output.copy_(result.view(output.shape))


def install(algo: str, async_mode: str = "thread") -> Callable:
    """Route every gloo reduce-scatter of this process (incl. megatron-core's bucket group) through
    ``algo``; ``async_mode`` says how ``async_op=True`` calls are served (module docstring).
    Returns the replacement function. Idempotent per process for one algorithm."""
    if algo not in ALGOS:
        raise ValueError(f"unknown algorithm {algo!r}; choose from {ALGOS}")
    if async_mode not in ASYNC_MODES:
        raise ValueError(f"unknown async mode {async_mode!r}; choose from {ASYNC_MODES}")
    fn = reduce_scatter_a2a if algo == "a2a" else reduce_scatter_ring
    for name in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"):
        if name not in _ORIG and hasattr(dist, name):
            _ORIG[name] = getattr(dist, name)
        if hasattr(dist, name):
            setattr(dist, name, fn)
    if "_coalescing_manager" not in _ORIG:
        _ORIG["_coalescing_manager"] = dist._coalescing_manager
        dist._coalescing_manager = _make_tracking_cm(_ORIG["_coalescing_manager"])
    # megatron-core's bucket groups bound both names at import: re-point them (through the
    # compat seam, megatron/distributed/mcore_compat/ddp_buckets.py).
    from megatron.distributed.mcore_compat.ddp_buckets import patch_bucket_collectives

    if _UNDO:
        _UNDO.pop()()
    _UNDO.append(patch_bucket_collectives(
        reduce_scatter=fn, coalescing_manager=_make_tracking_cm(_ORIG["_coalescing_manager"])))
    STATS["algo"] = algo
    STATS["async_mode"] = async_mode
    return fn


def uninstall() -> None:
    if _UNDO:
        _UNDO.pop()()
    for name, f in _ORIG.items():
        setattr(dist, name, f)
    _ORIG.clear()
    STATS["algo"] = None
    STATS["async_mode"] = "thread"


def summary() -> str:
    return (f"[ring_volume_rs] algo={STATS['algo']} calls={STATS['calls']} "
            f"elements={STATS['elements']} fallbacks={STATS['fallbacks']} "
            f"async_calls={STATS['async_calls']} async_mode={STATS['async_mode']}")
