"""Small constant index tables on the device, built once and never with a host sync.

Why: ``torch.tensor(list, device="cuda")`` copies from pageable memory and blocks the host, a
sync per bucket in the backward hooks. Each table is copied once per (order, device) from pinned
memory on the stream that first asks; an event makes every later caller's stream wait on the copy.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["inverse_order", "slot_of"]

_Entry = Tuple[torch.Tensor, Optional[torch.cuda.Event], torch.Tensor]
_TABLES: Dict[Tuple[Tuple[int, ...], str], _Entry] = {}
_LOCK = threading.Lock()   # stages of several ranks (bench/virtual_world.py) may ask at once


def inverse_order(order: Sequence[int]) -> List[int]:
    """``t[partition] = slot`` of ``order`` (``order[slot] = partition``), on the host."""
    inverse = [0] * len(order)
    for slot, part in enumerate(order):
        inverse[int(part)] = slot
    return inverse


def slot_of(order: Sequence[int], device: torch.device) -> torch.Tensor:
    """int32 table ``t[partition] = slot`` of ``order`` (``order[slot] = partition``) on
    ``device``; the same tensor for every call with this order and device."""
    device = torch.device(device)
    key = (tuple(int(p) for p in order), str(device))
    with _LOCK:
        entry = _TABLES.get(key)
        if entry is None:
            host = torch.tensor(inverse_order(key[0]), dtype=torch.int32)
            if device.type == "cuda":
                host = host.pin_memory()   # kept in the entry: the copy reads it asynchronously
                table = host.to(device, non_blocking=True)
                ready: Optional[torch.cuda.Event] = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(device))
            else:
                table, ready = host.to(device), None
            _TABLES[key] = (table, ready, host)
            return table
    table, ready, _ = entry
    if ready is not None:
        torch.cuda.current_stream(device).wait_event(ready)
    return table
