"""Every rank issues the same collectives, in the same order, on every communicator (issue 36,
item 6).

Why: collectives pair by issue order. A change that lets ranks diverge -- one rank skipping a
bucket's reduce-scatter, two stages sharing a communicator and issuing in a different order on
different ranks, a rank-dependent branch around an all-gather -- hangs a cluster, or worse, pairs
bucket b with a peer's bucket b+1 of the same size and trains on wrong data. On a CPU test it
may pass by luck of timing. :class:`CollectiveTrace` records, per communicator, the sequence of
(collective, dtype, elements) this rank issued, from every thread; :func:`divergences` compares
the ranks' traces. tests/dist_harness.py runs every multi-rank test under it and fails a test
whose ranks diverged, naming the communicator, the position and what each rank issued.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
               "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "barrier",
               "monitored_barrier", "all_gather_object", "broadcast_object_list",
               "gather_object", "scatter_object_list")
"""The group collectives of ``torch.distributed`` that are traced (point-to-point sends and
receives differ between the two sides by nature, and are not)."""

Key = Tuple[str, Tuple[int, ...]]
"""A communicator: (torch's group name, its global ranks)."""
Entry = Tuple[str, Optional[str], Optional[int]]
"""(collective, dtype of its first tensor, elements of all its tensors); None for objects."""


def _tensors(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class CollectiveTrace:
    """Wraps ``torch.distributed``'s collectives while entered; :attr:`calls` maps each
    communicator to the sequence this process issued on it."""

    def __init__(self) -> None:
        self.calls: Dict[Key, List[Entry]] = {}
        self._lock = threading.Lock()
        self._originals: Dict[str, Callable[..., Any]] = {}

    def _key(self, group: Any) -> Key:
        group = dist.group.WORLD if group is None else group
        return (str(getattr(group, "group_name", id(group))),
                tuple(dist.get_process_group_ranks(group)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)
        objects = name.endswith("_object") or name.endswith("_object_list")

        def traced(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return fn(*args, **kwargs)   # let torch raise its own error
            group = bound.arguments.get("group")
            tensors = [] if objects else [t for v in bound.arguments.values()
                                          for t in _tensors(v)]
            # an uneven all-to-all (split sizes given: MoE token dispatch) sends a different
            # number of elements from every rank by design
            uneven = bound.arguments.get("output_split_sizes") is not None
            entry: Entry = (name, str(tensors[0].dtype) if tensors else None,
                            sum(t.numel() for t in tensors) if tensors and not uneven else None)
            key = self._key(group)
            with self._lock:
                self.calls.setdefault(key, []).append(entry)
            return fn(*args, **kwargs)
        traced.__wrapped__ = fn  # type: ignore[attr-defined]
        return traced

    def __enter__(self) -> "CollectiveTrace":
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._originals[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()


def divergences(traces: Sequence[Optional[Dict[Key, List[Entry]]]], limit: int = 3) -> List[str]:
    """Where the ranks' traces (``traces[r]``: rank r's :attr:`CollectiveTrace.calls`, None if
    it has none) disagree: per communicator, its members must have issued the same sequence."""
    problems: List[str] = []
    keys = {k for t in traces if t for k in t}
    for name, ranks in sorted(keys, key=lambda k: (k[1], k[0])):
        members = [r for r in ranks if r < len(traces) and traces[r] is not None]
        seqs = {r: traces[r].get((name, ranks), []) for r in members}  # type: ignore[union-attr]
        if len({tuple(s) for s in seqs.values()}) <= 1:
            continue
        longest = max(len(s) for s in seqs.values())
        at = next(i for i in range(longest)
                  if len({s[i] if i < len(s) else None for s in seqs.values()}) > 1)
        issued = "; ".join(f"rank {r}: {s[at] if at < len(s) else 'nothing'} "
                           f"({len(s)} in all)" for r, s in seqs.items())
        problems.append(f"communicator {name} (ranks {list(ranks)}), collective #{at}: {issued}")
        if len(problems) >= limit:
            break
    return problems
