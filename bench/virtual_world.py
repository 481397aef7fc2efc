"""A virtual data-parallel world in one process: P threads stand for P ranks.

Why: the error of the two-level quantized reduce-scatter depends on the number of nodes M and
ranks per node D, and a CPU machine cannot start 128 gloo processes. The product's collectives
(:mod:`megatron.distributed.quant.collectives`) and group builder
(:mod:`megatron.distributed.quant.topology`) only call a handful of ``torch.distributed``
functions. :class:`VirtualDist` implements exactly those on in-process group objects (a barrier
and one slot per member), and :func:`installed` swaps it in as the ``dist`` attribute of the
product modules for the duration of a ``with`` block (restored afterwards). Each virtual rank is a
thread that calls the product's own ``QuantizationRuntime`` methods, so kernels, partition layout,
seeded generators and LoCo buffers are the product's; only the transport is replaced. The C++
kernels and torch ops release the GIL, so the threads really run side by side.

The transport is exact (a copy of the sender's bytes), like gloo: the study's numbers are those a
real cluster with the same seeds would produce (``tests/test_quant_error_study.py`` checks it
against 4 real gloo ranks bit for bit).

On CUDA tensors the collectives follow NCCL's stream semantics, so several ranks can share one GPU
(NCCL refuses two ranks on one device) and still exercise the product's CUDA stream code: the
host never waits; the receiver's current stream waits on an event the sender recorded on its
current stream at the call, copies on the receiver's stream, and the sender's stream then waits
until every receiver's copy is done (the sender may reuse its input after that, in stream order,
as after an NCCL call).  bench/virtual_cuda_ranks.py runs the runtime's bucket calls this way.
"""

from __future__ import annotations

import contextlib
import threading
from types import ModuleType, SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.distributed.quant import runtime, topology
from megatron.distributed.quant.collectives import common, gradients, weights
from megatron.distributed.quant.topology import TwoLevelGroups, build_two_level_groups

__all__ = ["VirtualGroup", "VirtualDist", "installed", "build_virtual_groups"]

PATCHED_MODULES: Tuple[ModuleType, ...] = (common, gradients, weights, topology, runtime)
"""Product modules whose ``dist`` attribute the virtual world replaces (all of their
``torch.distributed`` calls on the study's paths)."""

BARRIER_TIMEOUT_S = 900.0
"""A rank that never arrives (a bug, not a slow kernel) fails the study instead of hanging it."""


class VirtualGroup:
    """A process group of the virtual world: ascending member ranks and a rendezvous."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks: Tuple[int, ...] = tuple(int(r) for r in ranks)
        self.index: Dict[int, int] = {r: i for i, r in enumerate(self.ranks)}
        self._barrier = threading.Barrier(len(self.ranks), timeout=BARRIER_TIMEOUT_S)
        self._slots: List[Any] = [None] * len(self.ranks)

    def __repr__(self) -> str:
        return f"VirtualGroup({list(self.ranks)})"

    def size(self) -> int:
        return len(self.ranks)

    def exchange(self, rank: int, value: Any, consume: Callable[[List[Any]], Any]) -> Any:
        """Publish ``value``, wait for every member, run ``consume(all values)``, wait again.

        The second wait keeps every sender's tensor untouched until all receivers copied from
        it (a collective's input may be reused by its caller as soon as the call returns)."""
        self._slots[self.index[rank]] = value
        self._barrier.wait()
        try:
            return consume(list(self._slots))
        finally:
            self._barrier.wait()

    def abort(self) -> None:
        self._barrier.abort()

    def exchange_on_streams(self, rank: int, tensor: torch.Tensor,
                            consume: Callable[[List[torch.Tensor]], Any]) -> Any:
        """:meth:`exchange` for CUDA tensors with NCCL's stream semantics and no host wait on the
        device: ``consume`` runs on the caller's current stream after it waits on every member's
        "input ready" event; then every member's stream waits on every member's "copied" event,
        so no input is overwritten (or its block reused) before all peers have read it."""
        stream = torch.cuda.current_stream(tensor.device)
        ready = torch.cuda.Event()
        ready.record(stream)

        def read(entries: List[Tuple[torch.Tensor, torch.cuda.Event]]) -> Any:
            for _, ev in entries:
                stream.wait_event(ev)
            return consume([t for t, _ in entries])
        result = self.exchange(rank, (tensor, ready), read)
        copied = torch.cuda.Event()
        copied.record(stream)
        self.exchange(rank, copied, lambda events: [stream.wait_event(ev) for ev in events])
        return result


class VirtualDist:
    """The subset of ``torch.distributed`` the quantized collectives and the group builder use,
    on :class:`VirtualGroup` objects; the caller's rank is the thread's (:meth:`as_rank`).

    Any other attribute raises AttributeError, so a product change that starts calling another
    collective fails the study loudly instead of silently bypassing it.
    """

    ReduceOp = dist.ReduceOp

    def __init__(self, world_size: int) -> None:
        self.world_size = int(world_size)
        self._groups: Dict[Tuple[Tuple[int, ...], int], VirtualGroup] = {}
        self._created: Dict[Tuple[Optional[int], Tuple[int, ...]], int] = {}
        self._tls = threading.local()
        world = VirtualGroup(range(self.world_size))   # not a new_group: none of them returns it
        self.group = SimpleNamespace(WORLD=world)
        self.received: Dict[int, List[Tuple[VirtualGroup, torch.Tensor]]] = {}
        """Per rank, every all-to-all output while :attr:`record` is on (the study reads the
        intra-node hop's codes and scales here: step 3's input, observed on the wire)."""
        self.record = False

    # -- ranks and groups -----------------------------------------------------------------------
    @contextlib.contextmanager
    def as_rank(self, rank: int) -> Iterator[None]:
        """Calls from this thread act as virtual rank ``rank`` (nests)."""
        old = getattr(self._tls, "rank", None)
        self._tls.rank = int(rank)
        try:
            yield
        finally:
            self._tls.rank = old

    def _me(self) -> int:
        rank = getattr(self._tls, "rank", None)
        if rank is None:
            raise RuntimeError("virtual torch.distributed called outside a virtual rank")
        return rank

    def _group(self, group: Optional[VirtualGroup]) -> VirtualGroup:
        return self.group.WORLD if group is None else group

    def new_group(self, ranks: Optional[Sequence[int]] = None, backend: Any = None,
                  **_: Any) -> VirtualGroup:
        """A new group of ``ranks``, like ``dist.new_group``: the k-th call for a member set
        returns, on every rank, the same object, and a different one from the (k-1)-th (two
        communicators over the same ranks stay two rendezvous, as with NCCL)."""
        members = range(self.world_size) if ranks is None else ranks
        ranks_key = tuple(sorted(int(r) for r in members))
        me = getattr(self._tls, "rank", None)
        count_key = (me, ranks_key)
        k = self._created.get(count_key, 0)
        self._created[count_key] = k + 1
        key = (ranks_key, k)
        if key not in self._groups:
            self._groups[key] = VirtualGroup(ranks_key)
        return self._groups[key]

    def get_rank(self, group: Optional[VirtualGroup] = None) -> int:
        return self._group(group).index[self._me()]

    def get_world_size(self, group: Optional[VirtualGroup] = None) -> int:
        return self._group(group).size()

    def get_process_group_ranks(self, group: VirtualGroup) -> List[int]:
        return list(group.ranks)

    def is_initialized(self) -> bool:
        return True

    def abort(self) -> None:
        """Break every rendezvous: ranks blocked in a collective raise BrokenBarrierError."""
        for g in list(self._groups.values()):
            g.abort()

    # -- collectives (blocking, equal splits: what the product calls) ----------------------------
    @staticmethod
    def _sync_only(async_op: bool) -> None:
        if async_op:
            raise NotImplementedError("the virtual world runs collectives synchronously")

    @staticmethod
    def _exchange(g: VirtualGroup, me: int, tensor: torch.Tensor,
                  consume: Callable[[List[torch.Tensor]], Any]) -> Any:
        if tensor.is_cuda:
            return g.exchange_on_streams(me, tensor, consume)
        return g.exchange(me, tensor, consume)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          output_split_sizes: Any = None, input_split_sizes: Any = None,
                          group: Optional[VirtualGroup] = None, async_op: bool = False) -> None:
        self._sync_only(async_op)
        if output_split_sizes or input_split_sizes:
            raise NotImplementedError("uneven all_to_all splits are not used by the product")
        g, me = self._group(group), self._me()
        k, i = g.size(), g.index[me]

        def consume(inputs: List[torch.Tensor]) -> None:
            out = output.view(k, -1)
            for j, src in enumerate(inputs):  # piece i of every member, in member order
                out[j].copy_(src.reshape(k, -1)[i])
        self._exchange(g, me, input, consume)
        if self.record:
            self.received.setdefault(me, []).append((g, output.clone()))

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                               group: Optional[VirtualGroup] = None,
                               async_op: bool = False) -> None:
        self._sync_only(async_op)
        g, me = self._group(group), self._me()

        def consume(inputs: List[torch.Tensor]) -> None:
            out = output.view(g.size(), -1)
            for j, src in enumerate(inputs):
                out[j].copy_(src.reshape(-1))
        self._exchange(g, me, input, consume)

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                   group: Optional[VirtualGroup] = None, async_op: bool = False) -> None:
        self._sync_only(async_op)
        g, me = self._group(group), self._me()
        fns = {dist.ReduceOp.SUM: torch.sum, dist.ReduceOp.MAX: torch.amax,
               dist.ReduceOp.MIN: torch.amin}
        if op not in fns:
            raise NotImplementedError(f"virtual all_reduce supports SUM/MAX/MIN, not {op}")

        def consume(inputs: List[torch.Tensor]) -> torch.Tensor:
            return fns[op](torch.stack([t.clone() for t in inputs]), dim=0)
        tensor.copy_(self._exchange(g, me, tensor, consume))

    def run(self, fn: Callable[[int], Any]) -> List[Any]:
        """``fn(rank)`` on every virtual rank, one thread each; results in rank order.

        A rank that raises aborts every rendezvous (its peers stop waiting) and its exception is
        re-raised here, naming the rank."""
        results: List[Any] = [None] * self.world_size
        errors: List[Tuple[int, BaseException]] = []

        def body(rank: int) -> None:
            try:
                with self.as_rank(rank):
                    results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 -- reported below
                errors.append((rank, exc))
                self.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"vrank{r}", daemon=True)
                   for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            first = ([e for e in errors if not isinstance(e[1], threading.BrokenBarrierError)]
                     or errors)
            rank, exc = first[0]
            raise RuntimeError(f"virtual rank {rank} failed: {exc!r}") from exc
        return results


@contextlib.contextmanager
def installed(vdist: VirtualDist) -> Iterator[VirtualDist]:
    """Swap ``vdist`` in as ``dist`` of the product modules (:data:`PATCHED_MODULES`); restore on
    exit. Process-wide while active: nothing else in the process may use those modules'
    real collectives meanwhile (the study and its test run nothing else)."""
    saved = [(m, m.dist) for m in PATCHED_MODULES]
    try:
        for m, _ in saved:
            m.dist = vdist
        yield vdist
    finally:
        for m, real in saved:
            m.dist = real


def build_virtual_groups(vdist: VirtualDist, intra_size: int) -> List[TwoLevelGroups]:
    """Every virtual rank's :class:`TwoLevelGroups`, built by the product's own
    :func:`~megatron.distributed.quant.topology.build_two_level_groups` (DP group = the whole
    virtual world, DP rank r = node * D + local); must run inside :func:`installed`."""
    out = []
    for rank in range(vdist.world_size):
        with vdist.as_rank(rank):
            out.append(build_two_level_groups(list(range(vdist.world_size)), intra_size))
    return out
