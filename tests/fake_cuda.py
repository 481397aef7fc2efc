"""Just enough of ``torch.cuda`` to drive the CUDA communication stages on a machine without a GPU,
and an allocator check that finds cross-stream use-after-free hazards on that fake.

Why: the CUDA path of :mod:`megatron.distributed.quant.streams` enqueues work on several streams;
its hazards (a block freed on the stream that allocated it while another stream's pending work
still reads it) never show as wrong numbers on a CPU, and rarely on one GPU. The fake records what
the stages ask of streams and events; :class:`StreamAllocationCheck` tags every freshly allocated
tensor with the fake stream that was current when it was made and records every tensor a
collective reads on another stage, so a test can assert the product's rule: *a tensor allocated on
one stage and read by another is handed to that stage with ``record_stream``* (the caching
allocator then keeps the block until the reader is done).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import weakref
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class FakeCuda:
    """Streams and events that log what was asked of them; ``torch.cuda.stream`` switches the
    current stream (per thread, like CUDA's)."""

    def __init__(self) -> None:
        self.log: List[Tuple[Any, ...]] = []
        self.default = self.Stream(self, "default")
        self._tls = threading.local()
        self.on_record: List[Any] = []
        """Callbacks ``(tensor, stream name)`` run at every ``record_stream`` (the allocation
        check ties the hand-over to the allocation it was made for)."""

    @property
    def current(self) -> "FakeCuda.Stream":
        return getattr(self._tls, "current", self.default)

    @current.setter
    def current(self, stream: "FakeCuda.Stream") -> None:
        self._tls.current = stream

    class Stream:
        def __init__(self, fake: "FakeCuda", name: str = "", device: Any = None,
                     priority: int = 0) -> None:
            self.fake, self.name, self.device, self.priority = fake, name, device, priority

        def wait_stream(self, other: "FakeCuda.Stream") -> None:
            self.fake.log.append(("wait_stream", self.name, other.name))

        def wait_event(self, event: "FakeCuda.Event") -> None:
            self.fake.log.append(("wait_event", self.name, event.name))

        def __repr__(self) -> str:
            return self.name

    class Event:
        count = 0

        def __init__(self, fake: "FakeCuda") -> None:
            FakeCuda.Event.count += 1
            self.fake, self.name = fake, f"event{FakeCuda.Event.count}"

        done = True
        """What :meth:`query` answers (a test holds an event "on the device")."""
        elapsed_ms = 2.5
        """What :meth:`elapsed_time` answers for any pair."""

        def record(self, stream: "FakeCuda.Stream") -> None:
            self.fake.log.append(("record", self.name, stream.name))

        def query(self) -> bool:
            return self.done

        def elapsed_time(self, end: "FakeCuda.Event") -> float:
            return self.elapsed_ms

    def install(self, monkeypatch: Any, names: Optional[List[str]] = None) -> None:
        """Patch ``torch.cuda``'s stream API (and ``Tensor.record_stream``) for the test.

        Streams are named in creation order from ``names`` (the stages' order of first use)."""
        stream_names = iter(names or ["intra", "inter", "weights"])

        @contextlib.contextmanager
        def stream(s: "FakeCuda.Stream"):
            prev, self.current = self.current, s
            try:
                yield
            finally:
                self.current = prev

        def record_stream(tensor: torch.Tensor, s: "FakeCuda.Stream") -> None:
            for callback in self.on_record:
                callback(tensor, s.name)

        monkeypatch.setattr(torch.cuda, "Stream",
                            lambda device=None, priority=0: self.Stream(
                                self, next(stream_names), device, priority))
        monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: self.Event(self))
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)


class StreamAllocationCheck(TorchDispatchMode):
    """Tags each freshly allocated tensor with the fake stream current at its allocation.

    An op output without alias information in the op's schema and not on an operand's storage
    is a new allocation (not a view, an in-place result or an ``out=`` argument), exactly the
    blocks the caching allocator hands out per stream. :meth:`note_read` (called for every
    operand of an op, and by a fake collective) records a use of a tensor on the current stream;
    :meth:`hazards` lists reads of a block allocated on another *stage* stream that was never
    ``record_stream``-ed to the reader. Blocks allocated on the default stream are the caller's
    buffers, which the caller keeps until it waits (not a hazard) -- unless a stage job drops the
    last reference itself: a block freed by the host while a stage that read it is enqueuing (its
    kernels still pending) goes back to its allocating stream's pool at once, so that is a hazard
    too, wherever the block was allocated (LoCo's error buffers after a resume).

    Only a stage dropping the last reference counts as that stage freeing a block: blocks the
    cyclic garbage collector frees (reference cycles, at a moment of its choosing and on whatever
    thread allocated last) and blocks of a check whose ``with`` block has ended are forgotten
    without a verdict, so the result never depends on the collector's timing."""

    def __init__(self, fake: FakeCuda) -> None:
        super().__init__()
        self.fake = fake
        self.allocated_on: Dict[int, Tuple[str, int]] = {}
        """storage data_ptr -> (stage current at its allocation, allocation number)"""
        self.reads: List[Tuple[int, str, str, int]] = []
        """(data_ptr, allocating stage, reading stage, allocation number) of every use"""
        self.protected: Set[Tuple[int, str]] = set()
        """(allocation number, stream) of every ``record_stream`` hand-over: per allocation, so
        the hand-over of an earlier block at the same address protects nothing later."""
        self._allocations = itertools.count()
        self.read_on: Dict[int, Set[str]] = {}
        """allocation number -> streams that read it"""
        self.freed_while_read: List[Tuple[str, str]] = []
        """(allocating stream, reading stage) of blocks freed by that stage without hand-over"""
        fake.on_record.append(self._note_hand_over)
        self._finished = False
        """Set when the ``with`` block ends: a block of this check that the cyclic collector
        frees during a later run is no evidence about that run (finalizers record nothing)."""
        self._collecting: Set[int] = set()
        """Threads inside a cyclic garbage collection (``gc.callbacks``): a block freed there was
        dropped by the collector at a moment of its choosing, not by the stage that happens to
        be current on that thread."""

    def _note_collection(self, phase: str, info: Dict[str, int]) -> None:
        if phase == "start":
            self._collecting.add(threading.get_ident())
        else:
            self._collecting.discard(threading.get_ident())

    def __enter__(self) -> "StreamAllocationCheck":
        self._finished = False
        gc.callbacks.append(self._note_collection)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        self._finished = True
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._note_collection)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        operands = set()
        for t in tree_leaves((args, kwargs or {})):   # every op's operands are reads too (the
            if isinstance(t, torch.Tensor) and t.numel() > 0:   # copy into a packed message)
                self.note_read(t)
                operands.add(t.untyped_storage().data_ptr())
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for ret, t in zip(returns, outs):
            # an output on an operand's storage is no allocation, annotated or not (c10d's
            # collectives return their output tensor without an alias annotation)
            if isinstance(t, torch.Tensor) and ret.alias_info is None and t.numel() > 0 and \
                    t.untyped_storage().data_ptr() not in operands:
                storage = t.untyped_storage()
                ptr, number = storage.data_ptr(), next(self._allocations)
                self.allocated_on[ptr] = (self.fake.current.name, number)
                # forget the tag when the block is freed: a later allocation at the same address
                # made outside the check (another thread, torch.load) is the caller's, not this
                weakref.finalize(storage, self._forget, ptr, number)
        return out

    def _forget(self, ptr: int, number: int) -> None:
        alloc = self.allocated_on.get(ptr, (None, None))
        if alloc[1] == number:
            self.allocated_on.pop(ptr, None)
        freeing = self.fake.current.name
        dropped_by_a_stage = not self._finished and threading.get_ident() not in self._collecting
        if dropped_by_a_stage and alloc[1] == number and freeing not in ("default", alloc[0]) \
                and freeing in self.read_on.get(number, ()) and \
                (number, freeing) not in self.protected:
            self.freed_while_read.append((alloc[0], freeing))
        self.read_on.pop(number, None)

    def note_read(self, tensor: torch.Tensor) -> None:
        ptr = tensor.untyped_storage().data_ptr()
        stage, number = self.allocated_on.get(ptr, ("default", -1))
        self.reads.append((ptr, stage, self.fake.current.name, number))
        self.read_on.setdefault(number, set()).add(self.fake.current.name)

    def _note_hand_over(self, tensor: torch.Tensor, stream: str) -> None:
        ptr = tensor.untyped_storage().data_ptr()
        self.protected.add((self.allocated_on.get(ptr, ("default", -1))[1], stream))

    def hazards(self) -> List[Tuple[str, str]]:
        """``(allocating stage, reading stage)`` of every unprotected cross-stage read, and of
        every block a reading stage freed without hand-over (see the class docstring)."""
        return [(alloc, reader) for _, alloc, reader, number in self.reads
                if alloc not in ("default", reader) and (number, reader) not in self.protected
                ] + list(self.freed_while_read)
