"""The engine's weights to and from a host (CPU) state dict, for checkpoints.

Why: ``state_dict()`` / ``load_state_dict`` inside ``full_params`` would gather every bucket at
once, the model-sized memory a p = I / G strategy avoids. These give the same result gathering at
most one bucket at a time (save) or nothing (load).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .gather import ParamGathers
from .layout import FlatLayout, ShardGeometry
from .strategy import Level

__all__ = ["host_state_dict", "load_host_state_dict"]


def _param_keys(layout: FlatLayout, sd: Dict[str, Any]) -> Dict[int, List[str]]:
    """Parameter index -> its keys in ``sd``, a ``state_dict(keep_vars=True)`` of the module
    (the parameter objects themselves: their data is not read while released; several keys
    for tied weights)."""
    index = {id(p): i for i, p in enumerate(layout.params)}
    keys_of: Dict[int, List[str]] = {}
    for key, value in sd.items():
        if torch.is_tensor(value) and id(value) in index:
            keys_of.setdefault(index[id(value)], []).append(key)
    return keys_of


@torch.no_grad()
def host_state_dict(module: torch.nn.Module, layout: FlatLayout, param_gathers: ParamGathers,
                    keep: bool = True) -> Optional[Dict[str, Any]]:
    """``module.state_dict()`` with every tensor copied to the CPU, for a checkpoint;
    collective for p = I / G (every rank of the DP group calls it; ``keep=False`` on ranks
    that do not store the weights: they take part in the gathers and return None).
    ``layout`` / ``param_gathers``: the engine's, whose parameters are ``module``'s.

    Same keys, order, dtypes, shapes and values as ``state_dict()`` inside ``full_params``, but
    buckets are gathered one at a time, copied to the host and released: the device holds at most
    one gathered bucket above the persistent state and nothing is cloned on it.
    """
    sd = module.state_dict(keep_vars=True)
    keys_of = _param_keys(layout, sd)
    params = {key for keys in keys_of.values() for key in keys}
    out: Dict[str, Any] = {}
    for key, value in sd.items():
        if key in params:
            out[key] = None  # filled bucket by bucket below; keeps the key order
        elif keep:
            out[key] = value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
    for b in layout.buckets:
        wanted = [i for i in b.params if i in keys_of]
        if not wanted:
            continue
        was_gathered = b.gathered
        param_gathers.gather(b)
        if keep:
            for i in wanted:
                for key in keys_of[i]:
                    out[key] = layout.params[i].detach().to("cpu", copy=True)
        if not was_gathered:
            param_gathers.release(b)
    return out if keep else None


@torch.no_grad()
def load_host_state_dict(module: torch.nn.Module, sd: Dict[str, Any], layout: FlatLayout,
                         geometry: ShardGeometry, param_level: Level,
                         param_shard: Optional[torch.Tensor],
                         param_gathers: ParamGathers) -> None:
    """``module.load_state_dict(sd, strict=True)`` for a full (host) state dict, written
    straight into this rank's parameter shard: no gather, no collective. ``layout``,
    ``geometry``, ``param_level`` (p), ``param_shard`` (None for p = N) and ``param_gathers``:
    the engine's, whose parameters are ``module``'s.

    Same result as ``load_state_dict`` inside ``full_params(writeback=True)`` (tied weights take
    their last key's value, padding untouched), but nothing model-sized is allocated."""
    if param_shard is None:                  # p = N: the parameters are always full
        module.load_state_dict(sd, strict=True)
        return
    current = module.state_dict(keep_vars=True)
    missing = [k for k in current if k not in sd]
    unexpected = [k for k in sd if k not in current]
    if missing or unexpected:
        raise RuntimeError(f"Error(s) in loading state_dict for "
                           f"{type(module).__name__}: missing keys {missing}, "
                           f"unexpected keys {unexpected}")
    keys_of = _param_keys(layout, current)
    params = {key for keys in keys_of.values() for key in keys}
    others = {key: sd[key] for key in current if key not in params}
    for i, keys in keys_of.items():
        for key in keys:
            if tuple(sd[key].shape) != tuple(layout.slots[i].shape):
                raise RuntimeError(
                    f"size mismatch for {key}: copying a param with shape "
                    f"{tuple(sd[key].shape)} from checkpoint, the shape in current model is "
                    f"{tuple(layout.slots[i].shape)}")
    module.load_state_dict(others, strict=False)   # buffers, extra state
    k = geometry.level_ranks(param_level)
    for b in layout.buckets:
        a, e = geometry.local_range(b, param_level)
        shard = b.shard(param_shard, k)
        for i in b.params:
            slot = layout.slots[i]
            lo = max(slot.offset - b.start, a)           # bucket-local, inside the shard
            hi = min(slot.offset - b.start + slot.numel, e)
            if lo >= hi or i not in keys_of:
                continue
            first = lo - (slot.offset - b.start)         # element of the parameter
            for key in keys_of[i]:                       # tied: the last key wins
                shard[lo - a:hi - a].copy_(sd[key].reshape(-1)[first:first + hi - lo])
        if b.gathered:                  # stale now: the next use gathers the new values
            param_gathers.release(b)
