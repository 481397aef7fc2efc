"""When a bucket's full parameters exist: the engine's parameter gathers, prefetch and release.

Parameters at level I / G live persistently only as their shard; each bucket has its own full
buffer whose storage exists only while the bucket is gathered (``untyped_storage().resize_(0)``
otherwise, as FSDP does; the parameters are views into it). :class:`ParamGathers` is the one
place that allocates, fills and frees that storage, so the memory a gathered bucket costs is
decided here: inline on the engine's ``groups`` right before use, or -- ``param_groups``
(``--overlap-param-gather``) -- on the ``weights`` communication stage, started one bucket ahead
by the hooks (:mod:`.hooks`) so the gather travels while the previous module computes
(:data:`PARAM_GATHERS_AHEAD` at most). A release waits for a gather still in flight into the
bucket. For p = N the buckets are views of the resident flat buffer and nothing here moves.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

import torch

from ..streams import CommStreams
from .layout import Bucket, ShardGeometry
from .strategy import Level
from .transitions import LevelCollectives

__all__ = ["ParamGathers", "PARAM_GATHERS_AHEAD"]

PARAM_GATHERS_AHEAD = 1
"""``param_groups`` (``--overlap-param-gather``, p = I / G): buckets whose parameter gather a
hook has started ahead of their use (the next bucket in forward order, the previous one in
backward order) and nobody waited for yet: each is one bucket's full parameters beyond the
inline path's peak."""


class ParamGathers:
    """Gather, prefetch and release of one engine's buckets (see the module docstring).

    ``buckets``: the engine's buckets (their ``full`` buffers are allocated and freed here);
    ``param_level``: the strategy's parameter level p; ``param_shard``: the persistent shard at
    p (None for p = N); ``geometry``: where this rank's shard of a bucket lies;
    ``collectives``: what gathers and counts; ``param_groups``: the communicators of the
    overlapped gathers (None: inline); ``note_allocation``: called after every allocation of a
    full buffer, so the engine can track its peak.
    """

    def __init__(self, buckets: Sequence[Bucket], param_level: Level,
                 param_shard: Optional[torch.Tensor], geometry: ShardGeometry,
                 collectives: LevelCollectives, param_groups: Any,
                 note_allocation: Callable[[], None]) -> None:
        self.buckets = buckets
        self.param_level = param_level
        self.param_shard = param_shard
        self.geometry = geometry
        self.collectives = collectives
        self.param_groups = param_groups
        self.note_allocation = note_allocation
        self.stages: Optional[CommStreams] = None
        """The ``weights`` stage of the overlapped gathers (made at the first one)."""
        self.in_flight: Dict[int, Any] = {}
        """Bucket index -> handle of its parameter gather started ahead and not waited for."""

    @torch.no_grad()
    def gather(self, b: Bucket) -> None:
        """Rebuild bucket ``b``'s full parameters from the shards (collective; p = I / G), or
        wait for the gather a hook started ahead (:meth:`prefetch`)."""
        if b.gathered:
            return
        handle = self.in_flight.pop(b.index, None)
        if handle is None:
            handle = self.start(b)
        if handle is not None:
            handle.wait()
        b.gathered = True
        self.note_allocation()

    def start(self, b: Bucket) -> Any:
        """Allocate bucket ``b``'s full storage and gather it: inline on ``groups`` (returns
        None), or on the ``weights`` stage over ``param_groups`` (returns the job; counted here,
        in the hook's thread, as the inline path counts)."""
        storage = b.full.untyped_storage()
        need = b.size * b.full.element_size()
        if storage.nbytes() != need:
            storage.resize_(need)
        p = self.param_level
        shard = b.shard(self.param_shard, self.geometry.level_ranks(p))
        scope = "intra" if p == Level.I else "global"
        collectives = self.collectives
        collectives.count_exact_gather(b.full, scope)
        if self.param_groups is None:
            collectives.exact_gather(b.full, shard, scope)
            return None
        if self.stages is None:
            self.stages = CommStreams.for_device(b.full.device)
        full, groups = b.full, self.param_groups
        # The full buffer was allocated here, on the caller's stream; the stage waits on that
        # stream before it writes, and the buffer is freed only after the wait (release).
        return self.stages.submit(
            "weights", lambda: collectives.exact_gather(full, shard, scope, groups))

    def prefetch(self, index: int, in_backward: bool) -> None:
        """Start the gather of bucket ``index`` ahead of its use (``param_groups`` only): not
        past the ends, not one gathered or in flight, not one whose backward is over (in the
        backward pass), and at most :data:`PARAM_GATHERS_AHEAD` in flight. The order is the
        buckets' (module order), the same on every rank."""
        buckets = self.buckets
        if self.param_groups is None or not 0 <= index < len(buckets):
            return
        b = buckets[index]
        if b.gathered or b.index in self.in_flight or (in_backward and b.reduced):
            return
        if len(self.in_flight) >= PARAM_GATHERS_AHEAD:
            return
        self.in_flight[b.index] = self.start(b)
        self.note_allocation()

    def release(self, b: Bucket) -> None:
        """Free bucket ``b``'s full parameter storage (p = I / G); the views stay valid. A gather
        still in flight into it is waited for first (its stage writes the storage)."""
        handle = self.in_flight.pop(b.index, None)
        if handle is not None:
            handle.wait()
            b.gathered = True
        if self.param_level == Level.N or not b.gathered:
            return
        b.full.untyped_storage().resize_(0)
        b.gathered = False

    def gather_all(self) -> None:
        """Gather every bucket (collective; no-op for p = N)."""
        for b in self.buckets:
            self.gather(b)

    def release_all(self) -> None:
        """Release every bucket (p = I / G)."""
        for b in self.buckets:
            self.release(b)
