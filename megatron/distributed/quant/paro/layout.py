"""The PaRO engine's flat layout: which parameters share a bucket, and where each one lives.

Buckets (one per unit module, padded to the DP size and quantization unit) are the unit of
gather / release and gradient reduce-scatter; inside a bucket the layout is local-major, so every
PaRO transition is one plain collective on a contiguous slice.
"""
# See [Note: PaRO flat layout] in docs/architecture.md

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .strategy import Level

__all__ = ["Slot", "Bucket", "FlatLayout", "ShardGeometry", "plan_buckets", "output_tensors"]


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in the flat buffer."""

    name: str
    offset: int
    numel: int
    shape: torch.Size


@dataclass
class Bucket:
    """A contiguous, separately padded piece of the flat buffer: the unit of gather / release and
    of the per-micro-step gradient reduce-scatter.

    ``start`` / ``size``: its range in the flat (level-N) buffer; ``size`` is a multiple of the
    padding unit (n, or the quantization unit), so each of its I / G shards is whole.
    ``params``: indices into :attr:`FlatLayout.params`. ``owners``: the modules that use its
    parameters, in forward order (gathered before the first one's forward, released after the last
    one's; several owners for tied / shared weights).
    """

    index: int
    start: int
    size: int
    params: List[int]
    owners: List[torch.nn.Module]
    numel: int = 0
    full: Optional[torch.Tensor] = None  # full parameters of this bucket (own storage for p = I / G)
    gathered: bool = True
    tmp_grad: Optional[torch.Tensor] = None  # g = I / G: this micro-step's full gradient
    pending: int = 0  # parameters whose gradient has not arrived yet in this backward
    reduced: bool = False  # gradients of this micro-step already reduce-scattered

    def shard_offset(self, k: int) -> int:
        """Offset of this bucket's piece in a shard-space tensor with k ranks per element."""
        return self.start // k

    def shard(self, t: torch.Tensor, k: int) -> torch.Tensor:
        """This bucket's piece (a view) of ``t``, a shard-space tensor with k ranks per element."""
        return t[self.start // k:(self.start + self.size) // k]


@dataclass(frozen=True)
class FlatLayout:
    """Which parameters share a bucket and where each one lives in the flat buffer: what
    :func:`plan_buckets` decides for one model chunk, fixed for the engine's life (the buckets'
    own fields are its runtime state: gathered, pending, ...)."""

    params: Tuple[torch.nn.Parameter, ...]
    """The parameters in flat order (a tied parameter once)."""
    slots: Tuple[Slot, ...]
    """Where each parameter lives, by the same index."""
    buckets: Tuple[Bucket, ...]
    """The buckets in flat (module) order; ``buckets[i].index == i``."""
    bucket_of: Tuple[int, ...]
    """Parameter index -> index of its bucket."""
    padded_numel: int
    """S: the sum of the padded bucket sizes, what the engine allocates and sends."""


@dataclass(frozen=True)
class ShardGeometry:
    """Which shard of every bucket this rank holds at each partition level (see the module
    docstring's local-major layout). A value the engine computes once from its groups and hands
    to what reads or writes shards, so they need not reach into the engine for it."""

    intra_size: int
    """m: ranks of one PaRO group (the 'intra' scope), the ranks sharing an I-level element."""
    inter_size: int
    """g: PaRO groups (the 'inter' scope); the DP size is m * g."""
    local: int
    """This rank's index inside its group, 0..m-1 (DP rank = group_index * m + local)."""
    group_index: int
    """This rank's group, 0..g-1."""

    @property
    def dp_size(self) -> int:
        """n = m * g: the ranks sharing a G-level element."""
        return self.intra_size * self.inter_size

    def level_ranks(self, level: Level) -> int:
        """Ranks sharing one element's state at ``level`` (1, m or n)."""
        return {Level.N: 1, Level.I: self.intra_size, Level.G: self.dp_size}[level]

    def local_range(self, b: Bucket, level: Level) -> Tuple[int, int]:
        """[start, end) of this rank's shard at ``level`` inside bucket ``b`` (local-major:
        I-shard ``local``, and within it G sub-chunk ``group_index``)."""
        if level == Level.N:
            return 0, b.size
        i_start = self.local * (b.size // self.intra_size)
        if level == Level.I:
            return i_start, i_start + b.size // self.intra_size
        g_start = i_start + self.group_index * (b.size // self.dp_size)
        return g_start, g_start + b.size // self.dp_size


def _has_module_list(mod: torch.nn.Module) -> bool:
    return any(isinstance(x, torch.nn.ModuleList) for x in mod.modules())


def _units(mod: torch.nn.Module, cap: Optional[int], child_of_list: bool = False
           ) -> List[Tuple[torch.nn.Module, List[torch.nn.Parameter]]]:
    """Owner modules and the parameters of each, in module order (FSDP-style wrap policy).

    A module is one unit unless it contains a ``ModuleList`` (then its children -- e.g. the
    embedding, every transformer layer, the final norm, the output layer -- are considered in
    turn, and the children of the ModuleList are units) or it holds more than ``cap`` elements and
    has children to split into. Parameters held directly by a split module form their own unit.
    """
    params = list(mod.parameters())
    if not params:
        return []
    total = sum(p.numel() for p in params)
    has_children = any(True for c in mod.children() if any(True for _ in c.parameters()))
    split = has_children and ((not child_of_list and _has_module_list(mod))
                              or (cap is not None and total > cap))
    if not split:
        return [(mod, params)]
    out = []
    direct = list(mod.parameters(recurse=False))
    if direct:
        out.append((mod, direct))
    is_list = isinstance(mod, torch.nn.ModuleList)
    for child in mod.children():
        out += _units(child, cap, child_of_list=is_list)
    return out


def _tied_output_users(module: torch.nn.Module) -> Dict[int, List[torch.nn.Module]]:
    """id(weight) -> modules that use it without registering it: megatron-core's GPT with tied
    embeddings passes the word-embedding weight to ``output_layer`` at call time."""
    out: Dict[int, List[torch.nn.Module]] = {}
    for mod in module.modules():
        if getattr(mod, "share_embeddings_and_output_weights", False) and \
                getattr(mod, "post_process", True) and hasattr(mod, "output_layer") and \
                hasattr(mod, "shared_embedding_or_output_weight"):
            w = mod.shared_embedding_or_output_weight()
            if w is not None:
                out.setdefault(id(w), []).append(mod.output_layer)
    return out


def plan_buckets(module: torch.nn.Module, bucket_numel: Optional[int], unit: int) -> FlatLayout:
    """The flat layout of ``module``: parameters in flat order, their slots, the buckets, and
    the padded size S.

    Buckets: unit modules in module order; a parameter used by several units (or passed to a
    module at call time, tied embeddings) gets a bucket of its own owned by all of them. Each
    bucket is padded to a multiple of ``unit`` (the DP size, and the quantization unit when
    quantized), so each of its I / G shards is whole.
    """
    named = [(name, p) for name, p in module.named_parameters()]
    names = {id(p): name for name, p in named}
    units = _units(module, bucket_numel)
    extra_users = _tied_output_users(module)
    users: Dict[int, List[torch.nn.Module]] = {}
    for mod, ps in units:
        for p in ps:
            users.setdefault(id(p), []).append(mod)
    for pid, mods in extra_users.items():
        users.setdefault(pid, []).extend(mods)
    groups_of_params: List[Tuple[List[torch.nn.Module], List[torch.nn.Parameter]]] = []
    placed = set()
    for mod, ps in units:
        own = []
        for p in ps:
            if id(p) in placed:
                continue
            placed.add(id(p))
            if len(users[id(p)]) > 1:
                groups_of_params.append((list(users[id(p)]), [p]))
            else:
                own.append(p)
        if own:
            groups_of_params.append(([mod], own))
    assert len(placed) == len(named), "every parameter belongs to one bucket"
    params: List[torch.nn.Parameter] = []
    slots: List[Slot] = []
    buckets: List[Bucket] = []
    start = 0
    for owners, ps in groups_of_params:
        idx, offset = [], start
        for p in ps:
            idx.append(len(params))
            params.append(p)
            slots.append(Slot(names[id(p)], offset, p.numel(), p.shape))
            offset += p.numel()
        numel = offset - start
        size = -(-numel // unit) * unit
        buckets.append(Bucket(len(buckets), start, size, idx, owners, numel=numel))
        start += size
    bucket_of = [0] * len(params)
    for b in buckets:
        for i in b.params:
            bucket_of[i] = b.index
    return FlatLayout(tuple(params), tuple(slots), tuple(buckets), tuple(bucket_of), start)


def output_tensors(x: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module output (tensor, or tuples / lists / dicts of them)."""
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from output_tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from output_tensors(y)
