"""Benchmark-only exact reduce-scatters with the byte volume of NCCL's, for gloo process groups.

gloo implements ``reduce_scatter_tensor``/``reduce_scatter_single`` (and their coalesced form,
which megatron-core's ``_ParamAndGradBucketGroup.start_grad_sync`` uses through
``torch.distributed._coalescing_manager``) as an all-reduce followed by a copy: every rank sends
and receives ≈ 2·(P-1)/P·N elements, twice what a ring reduce-scatter moves. That inflates the
emulated-network baseline. This module replaces the reduce-scatter, **for gloo groups only**, by
one of two exact fp32 algorithms that move (P-1)/P·N elements per rank:

* ``a2a``  : ``all_to_all_single`` of the P chunks of N/P elements, then a local sum of the
             received chunks in rank order (chunk of rank 0 + rank 1 + ...). On the emulated
             2×2 topology every cross-node pair exchanges its chunks directly: 8 B/param of fp32
             gradients cross the link (both directions together).
* ``ring`` : the classic ring reduce-scatter with point-to-point isend/irecv, P-1 steps of N/P
             elements to rank+1 (ring 0→1→2→3→0). Sum order is the ring's (not rank order).
             Crosses the link twice per step: 6 B/param, NCCL's ring volume on this topology.

Neither changes megatron-core's source: :func:`install` rebinds
``torch.distributed.reduce_scatter_tensor``/``reduce_scatter_single``/``_reduce_scatter_base``
and ``megatron.core.distributed.param_and_grad_buffer.dist_reduce_scatter_func`` (bound at import
time to ``torch.distributed.reduce_scatter_tensor``). Calls on non-gloo groups, and reduce ops other
than SUM/AVG, go to the original function.

Semantics kept from ``reduce_scatter_single``: ``output`` may alias a chunk of ``input`` (megatron's
bucket shard is a view into the bucket), ``input`` may be a concatenation or a stack of the
outputs, AVG divides the sum by P (gloo itself rejects AVG). ``async_op=True`` is served
**synchronously** (the result is ready on return; a completed work handle is returned): inside
megatron's ``_coalescing_manager`` only the manager's own recorded ops are waited on, so a deferred
local sum would never run. The benchmark runs without ``--overlap-grad-reduce``, so megatron calls
it with ``async_op=False`` anyway.
"""

from __future__ import annotations

import sys
from typing import Callable, Dict

import torch
import torch.distributed as dist

ALGOS = ("a2a", "ring")

_ORIG: Dict[str, Callable] = {}
STATS = {"calls": 0, "elements": 0, "fallbacks": 0, "algo": None}


class _DoneWork:
    """Work handle of an already completed operation."""

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - same signature as c10d Work
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


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
    rank = dist.get_rank(group)
    n = output.numel()
    if input.numel() != n * world:
        raise ValueError(f"input has {input.numel()} elements, expected {n} x {world}")
    if input.dtype != output.dtype:
        raise ValueError(f"dtype mismatch: input {input.dtype}, output {output.dtype}")
    STATS["calls"] += 1
    STATS["elements"] += input.numel()
    flat_in = input.reshape(-1)
    if not flat_in.is_contiguous():
        flat_in = flat_in.contiguous()
    if algo == "a2a":
        # chunk j of every rank goes to rank j; recv[i] = chunk `rank` of rank i.
        recv = torch.empty_like(flat_in)
        dist.all_to_all_single(recv, flat_in, group=group)
        result = torch.empty(n, dtype=output.dtype, device=output.device)
        _sum_rank_order(recv.view(world, n), result)
    elif algo == "ring":
        chunks = flat_in.view(world, n)
        nxt = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
        prv = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
        buf = chunks[(rank - 1) % world].clone()
        tmp = torch.empty_like(buf)
        for s in range(world - 1):
            reqs = [dist.isend(buf, nxt, group=group), dist.irecv(tmp, prv, group=group)]
            for r in reqs:
                r.wait()
            # received: partial sum of chunk (rank - 2 - s) from the previous rank
            buf = tmp + chunks[(rank - 2 - s) % world]
        result = buf  # after P-1 steps: the full sum of chunk `rank`
    else:
        raise ValueError(f"unknown algorithm {algo!r}; choose from {ALGOS}")
    if op == dist.ReduceOp.AVG:
        result.div_(world)
    # written only now: `output` may be a view into `input` (megatron's bucket shard)
    output.copy_(result.view(output.shape))
    return _DoneWork() if async_op else None


def install(algo: str) -> Callable:
    """Route every gloo reduce-scatter of this process (incl. megatron-core's bucket group) through
    ``algo``. Returns the replacement function. Idempotent per process for one algorithm."""
    if algo not in ALGOS:
        raise ValueError(f"unknown algorithm {algo!r}; choose from {ALGOS}")
    fn = reduce_scatter_a2a if algo == "a2a" else reduce_scatter_ring
    for name in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"):
        if name not in _ORIG and hasattr(dist, name):
            _ORIG[name] = getattr(dist, name)
        if hasattr(dist, name):
            setattr(dist, name, fn)
    import megatron.core.distributed.param_and_grad_buffer as pgb  # binds the name at import

    pgb.dist_reduce_scatter_func = fn
    STATS["algo"] = algo
    return fn


def uninstall() -> None:
    for name, f in _ORIG.items():
        setattr(dist, name, f)
    pgb = sys.modules.get("megatron.core.distributed.param_and_grad_buffer")
    if pgb is not None and "reduce_scatter_tensor" in _ORIG:
        pgb.dist_reduce_scatter_func = _ORIG["reduce_scatter_tensor"]
    _ORIG.clear()
    STATS["algo"] = None


def summary() -> str:
    return (f"[ring_volume_rs] algo={STATS['algo']} calls={STATS['calls']} "
            f"elements={STATS['elements']} fallbacks={STATS['fallbacks']}")
