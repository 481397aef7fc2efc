"""PaRO (Partial Redundancy Optimizer): strategy grid, cost model and PaRO-CC collectives.

Spec: ../shared/research/paro.md. PaRO assigns each model state -- parameters (p), gradients (g)
and optimizer states (os) -- one partition level:

* ``N`` replicated on every rank,
* ``I`` split into ``m`` shards inside each group of ``m`` ranks (a node) and replicated across the
  ``g = n / m`` groups,
* ``G`` split into ``n`` shards across all ranks (ZeRO).

A strategy is the three letters in the order p, g, os (``NIG``, ``IIG``, ZeRO-1 = ``NNG``, ...).
This module holds the model and the collectives; training of the strategies lives in
:mod:`.paro_engine`:

1. :class:`PaRoStrategy` / :func:`parse_paro_strategy` -- parsing and the validity rule (14 of the
   27 combinations are effective; every rejection says why);
2. a per-rank theoretical model: model-state memory (:func:`model_state_memory`) and per-step
   communication volume on the intra-group and inter-group links (:func:`communication_volume`),
   optionally with quantized collectives taken from a
   :class:`~megatron.distributed.quant.config.QuantizationConfig`; a startup report
   (:func:`paro_report`, :func:`format_report`) and the automatic choice
   (:func:`choose_strategy_auto`);
3. PaRO-CC hierarchical collectives on ``torch.distributed`` (:func:`hierarchical_all_reduce`,
   :func:`hierarchical_reduce_scatter`, :func:`hierarchical_all_gather`) with a byte counter
   (:class:`CommCounter`) that uses the same convention as the model, and
   :func:`run_strategy_comm_pattern`, which executes one step's collectives of any strategy so the
   model can be checked against what really goes over the wire.

Byte convention (same as :mod:`.accounting`): per rank, the payload bytes it delivers to the other
ranks of the group. For a reduce-scatter / all-gather of a logical tensor of ``S`` bytes among ``k``
ranks that is ``(k-1)/k * S`` (what a ring sends); an all-reduce counts twice that. The time model
is ``intra_bytes / intra_bandwidth + inter_bytes / inter_bandwidth`` (spec §3): compute time is the
same for every strategy and is left out, so the model ranks strategies rather than predicting
absolute step times.
"""

from __future__ import annotations

import argparse
import enum
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .collectives import all_gather_flat, reduce_scatter_flat

__all__ = [
    "Level", "PaRoStrategy", "VALID_STRATEGIES", "STRATEGY_ALIASES", "AUTO",
    "parse_paro_strategy", "resolve_group_size", "add_paro_args",
    "StateBytes", "CollectiveSpec", "MemoryBreakdown", "CommVolume",
    "strategy_collectives", "model_state_memory", "communication_volume", "estimate_step_time",
    "paro_report", "format_report", "compare_strategies", "format_strategy_table",
    "AutoChoice", "choose_strategy_auto",
    "CommCounter", "build_paro_groups", "hierarchical_all_reduce", "hierarchical_reduce_scatter",
    "hierarchical_all_gather", "run_strategy_comm_pattern", "HIERARCHICAL_MIN_NUMEL",
    "use_hierarchical", "paro_all_reduce", "ring_bytes", "wire_bytes_per_element",
]

AUTO = "auto"


# =================================================================================================
# 1. Strategy grid
# =================================================================================================

class Level(enum.IntEnum):
    """Partition level of one model state; the integer order is 'coarse < fine' (N < I < G)."""

    N = 0
    I = 1  # noqa: E741 - the paper's letter
    G = 2

    def divisor(self, group_size: int, world_size: int) -> int:
        """d(level) of the spec: how many shards the state is cut into (1, m or n)."""
        return (1, group_size, world_size)[int(self)]


_STATE_NAMES = ("parameters", "gradients", "optimizer states")

STRATEGY_ALIASES: Dict[str, str] = {
    "DDP": "NNN",
    "ZERO1": "NNG", "ZERO-1": "NNG",
    "ZERO2": "NGG", "ZERO-2": "NGG",
    "ZERO3": "GGG", "ZERO-3": "GGG",
    "MICS": "III", "HSDP": "III",
}
"""Familiar names accepted by the parser (case-insensitive)."""

_KNOWN_AS: Dict[str, str] = {"NNN": "DDP", "NNG": "ZeRO-1", "NGG": "ZeRO-2", "GGG": "ZeRO-3",
                             "III": "MiCS / FSDP hybrid shard"}


def _validity_error(p: Level, g: Level, os_: Level) -> Optional[str]:
    """Why (p, g, os) is not an effective strategy, or None if it is (spec §2).

    The rule: optimizer states must be partitioned at least as finely as parameters and
    gradients. They dominate memory (K = 12 bytes per trainable parameter for Adam against 2 + 2),
    so cutting p or g finer than os saves little memory while adding communication: every such
    strategy is dominated by the one that raises os to the finer level. p and g are not ordered
    against each other (ING is a PaRO strategy).
    """
    reasons = []
    if os_ < p:
        reasons.append(
            f"optimizer states ({os_.name}) are partitioned less finely than parameters ({p.name}): "
            f"each rank would keep optimizer state for parameters it does not hold, so the memory "
            f"saved on the 2-byte parameters is dwarfed by the replicated 12-byte optimizer state "
            f"while the parameter gathers still cost communication; use {p.name}{g.name}"
            f"{max(p, g).name} instead")
    if os_ < g:
        reasons.append(
            f"optimizer states ({os_.name}) are partitioned less finely than gradients ({g.name}): "
            f"the optimizer consumes the gradients, so a gradient shard finer than the optimizer "
            f"shard would have to be gathered back before the update -- extra communication for a "
            f"2-byte saving next to the 12-byte optimizer state; use {p.name}{g.name}"
            f"{max(p, g).name} instead")
    return "; ".join(reasons) if reasons else None


@dataclass(frozen=True)
class PaRoStrategy:
    """One of the 14 effective PaRO strategies (levels of parameters, gradients, optimizer states).

    Construct with :meth:`from_string` (or :func:`parse_paro_strategy`); the constructor validates
    too, so an invalid strategy object cannot exist.
    """

    params: Level
    grads: Level
    optim: Level

    def __post_init__(self) -> None:
        for name in ("params", "grads", "optim"):
            object.__setattr__(self, name, Level(getattr(self, name)))
        err = _validity_error(self.params, self.grads, self.optim)
        if err is not None:
            raise ValueError(f"PaRO strategy {self.name} is not an effective strategy: {err}")

    @property
    def name(self) -> str:
        return self.params.name + self.grads.name + self.optim.name

    @property
    def known_as(self) -> Optional[str]:
        """The established name (DDP, ZeRO-1/2/3, MiCS) if the strategy has one."""
        return _KNOWN_AS.get(self.name)

    @property
    def zero_stage(self) -> int:
        """Stage of the ZeRO optimizer the PR #5588 implementation builds this strategy on.

        NNG -> 1; NGG / NII / NIG (parameters replicated) -> 2; parameter-partitioning
        strategies -> 3; NNN / NNI -> 0 / 1 by the same logic (our extension, the PR does not
        cover them). Useful later to decide which megatron-core machinery a strategy can reuse.
        """
        if self.params != Level.N:
            return 3
        if self.grads != Level.N:
            return 2
        return 0 if self.optim == Level.N else 1

    def __str__(self) -> str:
        return self.name

    @classmethod
    def from_string(cls, text: str) -> "PaRoStrategy":
        """Parse ``'NIG'``, ``'nig'``, ``'PNIG'`` (the paper's P prefix) or an alias (``'zero-2'``).

        ``'auto'`` is not a strategy: use :func:`parse_paro_strategy` where it is allowed.
        """
        if not isinstance(text, str):
            raise ValueError(f"PaRO strategy must be a string, got {type(text).__name__}")
        raw = text.strip()
        key = raw.upper()
        if key == AUTO.upper():
            raise ValueError("'auto' is resolved by choose_strategy_auto(), not by PaRoStrategy")
        key = STRATEGY_ALIASES.get(key, key)
        if len(key) == 4 and key[0] == "P":
            key = key[1:]
        if len(key) != 3:
            raise ValueError(
                f"PaRO strategy {raw!r} must be three letters (parameters, gradients, optimizer "
                f"states), each N (replicated), I (partitioned within a group) or G (partitioned "
                f"globally), e.g. NIG; or one of 'auto', {', '.join(sorted(STRATEGY_ALIASES))}")
        levels = []
        for state, letter in zip(_STATE_NAMES, key):
            if letter not in Level.__members__:
                raise ValueError(
                    f"PaRO strategy {raw!r}: unknown partition level {letter!r} for {state}; "
                    f"use N (replicated), I (partitioned within a group) or G (partitioned across "
                    f"all ranks)")
            levels.append(Level[letter])
        return cls(*levels)


def _all_combinations() -> List[Tuple[Level, Level, Level]]:
    return [(p, g, o) for p in Level for g in Level for o in Level]


VALID_STRATEGIES: Tuple[str, ...] = tuple(
    p.name + g.name + o.name for (p, g, o) in sorted(_all_combinations(), key=lambda t: (t[2], t[0], t[1]))
    if _validity_error(p, g, o) is None)
"""The 14 effective strategies, ordered like the spec's table (by os level, then p, then g)."""


def parse_paro_strategy(text: str) -> Union[PaRoStrategy, str]:
    """Parse the ``--paro-strategy`` value: a :class:`PaRoStrategy` or the string ``'auto'``."""
    if isinstance(text, str) and text.strip().lower() == AUTO:
        return AUTO
    return PaRoStrategy.from_string(text)


def resolve_group_size(world_size: int, group_size: Optional[int] = None,
                       tensor_model_parallel_size: int = 1) -> int:
    """The PaRO group size m (data-parallel ranks per group) for ``world_size`` DP ranks.

    Default: the data-parallel ranks of one node, ``LOCAL_WORLD_SIZE // TP`` (torchrun sets
    LOCAL_WORLD_SIZE), because the spec's group is the fast-link domain. Without LOCAL_WORLD_SIZE
    the whole world is taken as one group (single-node runs). Raises ValueError when m does not
    divide the world: PaRO needs every group to hold the same number of ranks ("full rectangle").
    """
    if world_size <= 0:
        raise ValueError(f"world size must be positive, got {world_size}")
    if group_size is None:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is None:
            group_size = world_size
        else:
            group_size = max(1, int(local) // max(1, tensor_model_parallel_size))
            group_size = min(group_size, world_size)
    if group_size <= 0:
        raise ValueError(f"--paro-group-size must be positive, got {group_size}")
    if world_size % group_size:
        raise ValueError(
            f"--paro-group-size {group_size} does not divide the data-parallel world size "
            f"{world_size}: every group must hold the same number of ranks")
    return group_size


# Strategies megatron-core's DDP / DistributedOptimizer realise directly (value: the
# --use-distributed-optimizer setting they need). Every other effective strategy is trained by
# the PaRO engine (megatron/distributed/quant/paro_engine.py).
TRAINABLE_STRATEGIES: Dict[str, bool] = {"NNN": False, "NNG": True}


def check_trainable(text: str, use_distributed_optimizer: bool) -> Union[PaRoStrategy, str]:
    """Parse ``--paro-strategy`` for training; ValueError (with the fix) when it cannot be run.

    All 14 effective strategies train: NNN and NNG on megatron-core (with the matching
    ``--use-distributed-optimizer`` setting, so the flag and the strategy never disagree), the
    others on the PaRO engine. ``'auto'`` is returned as is and resolved at startup, once the
    model size and the world are known. Ineffective strategies raise with the reason.
    """
    parsed = parse_paro_strategy(text)
    if parsed == AUTO:
        return AUTO
    name = parsed.name
    if name in TRAINABLE_STRATEGIES and TRAINABLE_STRATEGIES[name] != use_distributed_optimizer:
        raise ValueError(
            f"--paro-strategy {name} " + ("needs --use-distributed-optimizer" if TRAINABLE_STRATEGIES[name]
                                          else "replicates optimizer states: drop --use-distributed-optimizer"))
    return parsed


def add_paro_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the PaRO flags (the trainer's parser must call this; see docs/paro.md)."""
    group = parser.add_argument_group(title="PaRO (partial redundancy optimizer)")
    group.add_argument("--paro-strategy", type=str, default=None,
                       help="Partition levels of parameters, gradients, optimizer states, each "
                            "N (replicated), I (within a group) or G (global), e.g. NIG, IIG; "
                            "aliases ddp, zero1, zero2, zero3, mics; or 'auto' (cheapest modelled "
                            "communication that fits in memory). NNN and NNG (ZeRO-1, needs "
                            "--use-distributed-optimizer) run on megatron-core, the other 12 on the "
                            "PaRO engine (TP=PP=1, bf16/fp32); prints the memory/communication report.")
    group.add_argument("--paro-group-size", type=int, default=None,
                       help="Data-parallel ranks per PaRO group (default LOCAL_WORLD_SIZE // TP, "
                            "i.e. one node).")
    group.add_argument("--paro-gpu-memory-gb", type=float, default=None,
                       help="Memory per GPU (GB = 1e9 bytes) that --paro-strategy auto may fill "
                            "(default: the device's total memory).")
    group.add_argument("--paro-reserved-memory-gb", type=float, default=0.0,
                       help="Memory per GPU kept for activations and workspace when choosing "
                            "automatically.")
    group.add_argument("--paro-intra-bandwidth-gbs", type=float, default=150.0,
                       help="Intra-group (NVLink) bandwidth per GPU in GB/s for the cost model.")
    group.add_argument("--paro-inter-bandwidth-gbs", type=float, default=12.5,
                       help="Inter-group (RDMA) bandwidth per GPU in GB/s for the cost model.")
    return parser


# =================================================================================================
# 2. Cost model
# =================================================================================================

@dataclass(frozen=True)
class StateBytes:
    """Bytes per element of each model state, in memory and on the wire.

    Defaults follow the spec (16-bit parameters and gradients, mixed-precision Adam: K = 12 = fp32
    master weights + two fp32 moments). Megatron with fp32 main grads: ``grad=4``.
    """

    param: float = 2.0
    grad: float = 2.0
    optim: float = 12.0
    param_comm: Optional[float] = None
    """Bytes per element of unquantized parameter gathers (default ``param``)."""
    grad_comm: Optional[float] = None
    """Bytes per element of unquantized gradient reductions (default ``grad``)."""

    def wire_param(self) -> float:
        return self.param if self.param_comm is None else self.param_comm

    def wire_grad(self) -> float:
        return self.grad if self.grad_comm is None else self.grad_comm


@dataclass(frozen=True)
class CollectiveSpec:
    """One collective of a strategy's step (a row of the spec's §3 pattern table).

    ``scope`` 'intra' runs among the m ranks of a group on the full tensor; 'inter' runs among the
    g ranks sharing a local index on the 1/m slice; 'global' is a hierarchical (PaRO-CC)
    collective over all n ranks. ``data`` says which state moves: 'params' (all Ψ parameters,
    frozen ones included), 'trainable_params' (Ψ', the post-step sync) or 'grads' (Ψ').
    """

    phase: str
    """'param_gather' | 'grad_micro' (both every micro-step) | 'grad_sync' | 'param_sync'."""
    op: str
    """'all_gather' | 'reduce_scatter' | 'all_reduce'."""
    scope: str
    data: str
    count: int = 1
    """Calls per occurrence (2 for the forward and backward parameter gathers)."""

    @property
    def per_micro_step(self) -> bool:
        return self.phase in ("param_gather", "grad_micro")

    @property
    def label(self) -> str:
        short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}[self.op]
        what = {"params": "(p)", "trainable_params": "(p')", "grads": "(g)"}[self.data]
        return f"{self.scope} {short}{what}" + (f"x{self.count}" if self.count > 1 else "")


def strategy_collectives(strategy: Union[PaRoStrategy, str]) -> List[CollectiveSpec]:
    """The collectives of one global step of ``strategy`` (spec §3, phases 1-4), in order."""
    s = _as_strategy(strategy)
    p, g, o = s.params, s.grads, s.optim
    out: List[CollectiveSpec] = []
    scope_of = {Level.I: "intra", Level.G: "global"}
    # 1. forward + backward parameter gathers, every micro-step.
    if p != Level.N:
        out.append(CollectiveSpec("param_gather", "all_gather", scope_of[p], "params", count=2))
    # 2. gradient reduction every micro-step (g = N accumulates locally).
    if g != Level.N:
        out.append(CollectiveSpec("grad_micro", "reduce_scatter", scope_of[g], "grads"))
    # 3. gradient sync at the accumulation boundary, g -> os.
    sync = {
        (Level.N, Level.N): [("all_reduce", "global")],
        (Level.N, Level.I): [("reduce_scatter", "intra"), ("all_reduce", "inter")],
        (Level.N, Level.G): [("reduce_scatter", "global")],
        (Level.I, Level.I): [("all_reduce", "inter")],
        (Level.I, Level.G): [("reduce_scatter", "inter")],
        (Level.G, Level.G): [],
    }[(g, o)]
    out.extend(CollectiveSpec("grad_sync", op, scope, "grads") for op, scope in sync)
    # 4. parameter sync after the optimizer step, os -> p (trainable parameters only).
    psync = {
        (Level.G, Level.I): [("all_gather", "inter")],
        (Level.G, Level.N): [("all_gather", "global")],
        (Level.I, Level.N): [("all_gather", "intra")],
    }.get((o, p), [])
    out.extend(CollectiveSpec("param_sync", op, scope, "trainable_params") for op, scope in psync)
    return out


def _hops(op: str, scope: str) -> List[Tuple[str, str, bool]]:
    """How a collective decomposes into (link, op, on_1/m_slice) hops under PaRO-CC (spec §4)."""
    if scope == "intra":
        return [("intra", op, False)]
    if scope == "inter":
        return [("inter", op, True)]
    return {
        "all_reduce": [("intra", "reduce_scatter", False), ("inter", "all_reduce", True),
                       ("intra", "all_gather", False)],
        "reduce_scatter": [("intra", "reduce_scatter", False), ("inter", "reduce_scatter", True)],
        "all_gather": [("inter", "all_gather", True), ("intra", "all_gather", False)],
    }[op]


def ring_bytes(op: str, total_bytes: float, ranks: int) -> float:
    """Bytes one rank sends in ``op`` on a logical tensor of ``total_bytes`` among ``ranks``."""
    if ranks <= 1:
        return 0.0
    factor = 2.0 if op == "all_reduce" else 1.0
    return factor * (ranks - 1) / ranks * total_bytes


def wire_bytes_per_element(data: str, link: str, phase: str, state_bytes: StateBytes,
                           quant_config: Any = None) -> float:
    """Bytes per element that ``data`` costs on ``link`` (quantized codes + fp32 scales).

    Gradients use the QuantizationConfig's intra / inter bits (TLq: 8-bit intra, 4-bit inter by
    default). Parameters use the weight bits on the post-step sync; the per-micro-step gathers of
    partitioned parameters are quantized only in 'direct' mode (ZeRO++ qwZ), since 'diff' mode
    (qWD) quantizes the update relative to the last synced weights, which exists only after a step.
    """
    q = quant_config
    if data == "grads":
        if q is not None and getattr(q, "quantized_gradients", False):
            if link == "intra":
                bits, gs = q.gradient_quantization_bits_intra, q.gq_group_size_intra
            else:
                bits, gs = q.gradient_quantization_bits_inter, q.gq_group_size_inter
            return (bits + 32.0 / gs) / 8.0
        return state_bytes.wire_grad()
    if q is not None and getattr(q, "quantized_weights", False) and (
            phase == "param_sync" or getattr(q, "weight_quantization_mode", "diff") == "direct"):
        return (q.weight_quantization_bits + 32.0 / q.wq_group_size) / 8.0
    return state_bytes.wire_param()


@dataclass
class MemoryBreakdown:
    """Per-rank model-state bytes: Mem = bp·Ψ/d(p) + bg·Ψ'/d(g) + K·Ψ'/d(os) (spec §3)."""

    params: float
    grads: float
    optimizer_states: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer_states

    def to_dict(self) -> Dict[str, float]:
        return {"params": self.params, "grads": self.grads,
                "optimizer_states": self.optimizer_states, "total": self.total}


@dataclass
class CommVolume:
    """Per-rank bytes sent in one global step (``micro_steps`` micro-steps), by link."""

    micro_intra: float = 0.0
    """Bytes per micro-step on the intra-group link (repeated ``micro_steps`` times)."""
    micro_inter: float = 0.0
    once_intra: float = 0.0
    """Bytes once per global step (gradient sync at the boundary + post-step parameter sync)."""
    once_inter: float = 0.0
    micro_steps: int = 1
    rows: List[Dict[str, Any]] = field(default_factory=list)
    """One row per collective: label, phase, intra and inter bytes per occurrence, occurrences."""

    @property
    def intra(self) -> float:
        return self.micro_steps * self.micro_intra + self.once_intra

    @property
    def inter(self) -> float:
        return self.micro_steps * self.micro_inter + self.once_inter

    def to_dict(self) -> Dict[str, Any]:
        return {"per_micro_step": {"intra": self.micro_intra, "inter": self.micro_inter},
                "per_step_once": {"intra": self.once_intra, "inter": self.once_inter},
                "per_step_total": {"intra": self.intra, "inter": self.inter},
                "micro_steps": self.micro_steps, "collectives": [dict(r) for r in self.rows]}


def _as_strategy(strategy: Union[PaRoStrategy, str]) -> PaRoStrategy:
    return strategy if isinstance(strategy, PaRoStrategy) else PaRoStrategy.from_string(strategy)


def _check_sizes(num_params: float, world_size: int, group_size: int,
                 trainable_params: Optional[float], micro_steps: int) -> float:
    if num_params <= 0:
        raise ValueError(f"num_params must be positive, got {num_params}")
    resolve_group_size(world_size, group_size)
    trainable = num_params if trainable_params is None else trainable_params
    if not 0 <= trainable <= num_params:
        raise ValueError(f"trainable_params must be in [0, num_params], got {trainable}")
    if micro_steps < 1:
        raise ValueError(f"micro_steps must be >= 1, got {micro_steps}")
    return trainable


def model_state_memory(strategy: Union[PaRoStrategy, str], num_params: float, world_size: int,
                       group_size: int, trainable_params: Optional[float] = None,
                       state_bytes: Optional[StateBytes] = None) -> MemoryBreakdown:
    """Per-rank bytes of parameters, gradients and optimizer states (spec §3).

    Frozen parameters are partitioned with the rest (the Ψ term); only trainable ones (Ψ') have
    gradients and optimizer states.
    """
    s = _as_strategy(strategy)
    sb = state_bytes or StateBytes()
    trainable = _check_sizes(num_params, world_size, group_size, trainable_params, 1)
    n, m = world_size, group_size
    return MemoryBreakdown(
        params=sb.param * num_params / s.params.divisor(m, n),
        grads=sb.grad * trainable / s.grads.divisor(m, n),
        optimizer_states=sb.optim * trainable / s.optim.divisor(m, n),
    )


def communication_volume(strategy: Union[PaRoStrategy, str], num_params: float, world_size: int,
                         group_size: int, trainable_params: Optional[float] = None,
                         micro_steps: int = 1, state_bytes: Optional[StateBytes] = None,
                         quant_config: Any = None) -> CommVolume:
    """Per-rank intra / inter bytes sent in one global step of ``micro_steps`` micro-steps.

    Global collectives are costed as PaRO-CC hierarchical ones (intra hop on the full tensor,
    inter hop on the 1/m slice), which is what :func:`hierarchical_all_reduce` and friends send.
    """
    s = _as_strategy(strategy)
    sb = state_bytes or StateBytes()
    trainable = _check_sizes(num_params, world_size, group_size, trainable_params, micro_steps)
    n, m = world_size, group_size
    g = n // m
    elements = {"params": num_params, "trainable_params": trainable, "grads": trainable}
    vol = CommVolume(micro_steps=micro_steps)
    for c in strategy_collectives(s):
        link_bytes = {"intra": 0.0, "inter": 0.0}
        for link, op, sliced in _hops(c.op, c.scope):
            numel = elements[c.data] / m if sliced else elements[c.data]
            per_elem = wire_bytes_per_element(c.data, link, c.phase, sb, quant_config)
            link_bytes[link] += c.count * ring_bytes(op, numel * per_elem, m if link == "intra" else g)
        if c.per_micro_step:
            vol.micro_intra += link_bytes["intra"]
            vol.micro_inter += link_bytes["inter"]
        else:
            vol.once_intra += link_bytes["intra"]
            vol.once_inter += link_bytes["inter"]
        vol.rows.append({"collective": c.label, "phase": c.phase,
                         "intra": link_bytes["intra"], "inter": link_bytes["inter"],
                         "times_per_step": micro_steps if c.per_micro_step else 1})
    return vol


def estimate_step_time(volume: CommVolume, intra_bandwidth: float, inter_bandwidth: float) -> float:
    """Communication seconds per global step: intra_bytes / B' + inter_bytes / B (spec §3)."""
    if intra_bandwidth <= 0 or inter_bandwidth <= 0:
        raise ValueError("bandwidths must be positive (bytes per second)")
    return volume.intra / intra_bandwidth + volume.inter / inter_bandwidth


def paro_report(strategy: Union[PaRoStrategy, str], num_params: float, world_size: int,
                group_size: Optional[int] = None, *, trainable_params: Optional[float] = None,
                micro_steps: int = 1, state_bytes: Optional[StateBytes] = None,
                quant_config: Any = None, gpu_memory_bytes: Optional[float] = None,
                reserved_bytes: float = 0.0, intra_bandwidth: Optional[float] = None,
                inter_bandwidth: Optional[float] = None) -> Dict[str, Any]:
    """Startup report of one strategy: memory, per-step communication, optional time and fit.

    Everything is per rank and theoretical; print it with :func:`format_report`. ``fits`` and
    ``memory_headroom`` appear when ``gpu_memory_bytes`` is given, ``comm_time_s`` when both
    bandwidths (bytes/s) are given.
    """
    s = _as_strategy(strategy)
    m = resolve_group_size(world_size, group_size)
    sb = state_bytes or StateBytes()
    mem = model_state_memory(s, num_params, world_size, m, trainable_params, sb)
    vol = communication_volume(s, num_params, world_size, m, trainable_params, micro_steps, sb,
                               quant_config)
    notes = []
    if m == world_size and world_size > 1:
        notes.append("one group spans every rank: I and G coincide and there is no inter-group link")
    if m == 1 and world_size > 1:
        notes.append("group size 1: I means replicated (same as N) and every link is inter-group")
    q = quant_config
    wire = {
        "grads_intra": wire_bytes_per_element("grads", "intra", "grad_sync", sb, q) * 8,
        "grads_inter": wire_bytes_per_element("grads", "inter", "grad_sync", sb, q) * 8,
        "params_gather": wire_bytes_per_element("params", "intra", "param_gather", sb, q) * 8,
        "params_sync": wire_bytes_per_element("trainable_params", "intra", "param_sync", sb, q) * 8,
    }
    report: Dict[str, Any] = {
        "strategy": s.name,
        "known_as": s.known_as,
        "world_size": world_size,
        "group_size": m,
        "num_groups": world_size // m,
        "num_params": num_params,
        "trainable_params": num_params if trainable_params is None else trainable_params,
        "micro_steps": micro_steps,
        "state_bytes": {"param": sb.param, "grad": sb.grad, "optim": sb.optim},
        "wire_bits_per_element": wire,
        "memory": mem.to_dict(),
        "comm": vol.to_dict(),
        "notes": notes,
    }
    if gpu_memory_bytes is not None:
        avail = gpu_memory_bytes - reserved_bytes
        report["gpu_memory_bytes"] = gpu_memory_bytes
        report["reserved_bytes"] = reserved_bytes
        report["fits"] = mem.total <= avail
        report["memory_headroom"] = avail - mem.total
    if intra_bandwidth is not None and inter_bandwidth is not None:
        report["intra_bandwidth"] = intra_bandwidth
        report["inter_bandwidth"] = inter_bandwidth
        report["comm_time_s"] = estimate_step_time(vol, intra_bandwidth, inter_bandwidth)
    return report


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def format_report(report: Dict[str, Any]) -> str:
    """Human-readable table of a :func:`paro_report` dict (for the training log at startup)."""
    r = report
    name = r["strategy"] + (f" ({r['known_as']})" if r.get("known_as") else "")
    lines = [
        f"PaRO strategy {name}: n={r['world_size']} ranks, m={r['group_size']} per group, "
        f"g={r['num_groups']} groups; Ψ={r['num_params']:.4g} params, Ψ'={r['trainable_params']:.4g} "
        f"trainable, A={r['micro_steps']} micro-steps",
        "model-state memory per rank:",
        f"  parameters        {_gb(r['memory']['params']):>12}",
        f"  gradients         {_gb(r['memory']['grads']):>12}",
        f"  optimizer states  {_gb(r['memory']['optimizer_states']):>12}",
        f"  total             {_gb(r['memory']['total']):>12}",
    ]
    if "fits" in r:
        lines.append(f"  GPU memory {_gb(r['gpu_memory_bytes'])} - reserved {_gb(r['reserved_bytes'])}: "
                     f"{'fits' if r['fits'] else 'DOES NOT FIT'} (headroom {_gb(r['memory_headroom'])})")
    w = r["wire_bits_per_element"]
    lines.append(f"wire bits/element: grads intra {w['grads_intra']:.3g}, grads inter "
                 f"{w['grads_inter']:.3g}, param gathers {w['params_gather']:.3g}, param sync "
                 f"{w['params_sync']:.3g}")
    lines.append("communication per rank (bytes sent):")
    lines.append(f"  {'collective':<22}{'phase':<14}{'x/step':>7}{'intra':>14}{'inter':>14}")
    for row in r["comm"]["collectives"]:
        lines.append(f"  {row['collective']:<22}{row['phase']:<14}{row['times_per_step']:>7}"
                     f"{_gb(row['intra']):>14}{_gb(row['inter']):>14}")
    if not r["comm"]["collectives"]:
        lines.append("  (none)")
    tot = r["comm"]["per_step_total"]
    lines.append(f"  {'total per step':<43}{_gb(tot['intra']):>14}{_gb(tot['inter']):>14}")
    if "comm_time_s" in r:
        lines.append(f"estimated communication time per step: {r['comm_time_s'] * 1e3:.1f} ms "
                     f"(B'={r['intra_bandwidth'] / 1e9:.4g} GB/s intra, B={r['inter_bandwidth'] / 1e9:.4g} "
                     f"GB/s inter, no overlap)")
    lines.extend(f"note: {n}" for n in r["notes"])
    return "\n".join(lines)


def compare_strategies(num_params: float, world_size: int, group_size: Optional[int] = None, *,
                       candidates: Optional[Sequence[Union[PaRoStrategy, str]]] = None,
                       **kwargs: Any) -> List[Dict[str, Any]]:
    """:func:`paro_report` for every candidate (default: the 14 effective strategies)."""
    names = candidates if candidates is not None else VALID_STRATEGIES
    return [paro_report(c, num_params, world_size, group_size, **kwargs) for c in names]


def format_strategy_table(reports: Sequence[Dict[str, Any]]) -> str:
    """One Markdown row per strategy: memory, intra / inter GB per step, time if known."""
    has_time = all("comm_time_s" in r for r in reports)
    head = "| strategy | params GB | grads GB | optim GB | total GB | intra GB/step | inter GB/step |"
    sep = "|---|---:|---:|---:|---:|---:|---:|"
    if has_time:
        head += " comm ms/step |"
        sep += "---:|"
    lines = [head, sep]
    for r in reports:
        mem, tot = r["memory"], r["comm"]["per_step_total"]
        name = r["strategy"] + (f" ({r['known_as']})" if r.get("known_as") else "")
        row = (f"| {name} | {mem['params'] / 1e9:.2f} | {mem['grads'] / 1e9:.2f} | "
               f"{mem['optimizer_states'] / 1e9:.2f} | {mem['total'] / 1e9:.2f} | "
               f"{tot['intra'] / 1e9:.2f} | {tot['inter'] / 1e9:.2f} |")
        if has_time:
            row += f" {r['comm_time_s'] * 1e3:.1f} |"
        lines.append(row)
    return "\n".join(lines)


@dataclass
class AutoChoice:
    """Result of :func:`choose_strategy_auto`."""

    strategy: PaRoStrategy
    report: Dict[str, Any]
    candidates: List[Dict[str, Any]]
    """Reports of every candidate, fastest first (non-fitting ones last)."""
    explanation: str


def choose_strategy_auto(num_params: float, world_size: int, group_size: Optional[int],
                         gpu_memory_bytes: float, intra_bandwidth: float, inter_bandwidth: float, *,
                         trainable_params: Optional[float] = None, micro_steps: int = 1,
                         state_bytes: Optional[StateBytes] = None, quant_config: Any = None,
                         reserved_bytes: float = 0.0,
                         candidates: Optional[Sequence[Union[PaRoStrategy, str]]] = None) -> AutoChoice:
    """Pick the strategy with the least modelled communication time whose model states fit.

    Spec §3 selection procedure: cost every strategy, drop those whose memory exceeds
    ``gpu_memory_bytes - reserved_bytes`` (reserve room for activations there), take the smallest
    time. Ties (within 1e-9 relative; e.g. NNN, NNI and NNG all move the same bytes with
    hierarchical collectives) go to the strategy with less memory, which leaves more room for
    activations at no communication cost. Raises ValueError when nothing fits.
    """
    reports = compare_strategies(num_params, world_size, group_size, candidates=candidates,
                                 trainable_params=trainable_params, micro_steps=micro_steps,
                                 state_bytes=state_bytes, quant_config=quant_config,
                                 gpu_memory_bytes=gpu_memory_bytes, reserved_bytes=reserved_bytes,
                                 intra_bandwidth=intra_bandwidth, inter_bandwidth=inter_bandwidth)
    fitting = [r for r in reports if r["fits"]]
    if not fitting:
        smallest = min(reports, key=lambda r: r["memory"]["total"])
        raise ValueError(
            f"no PaRO strategy fits: the smallest, {smallest['strategy']}, needs "
            f"{_gb(smallest['memory']['total'])} of model states per rank but only "
            f"{_gb(gpu_memory_bytes - reserved_bytes)} is available "
            f"({_gb(gpu_memory_bytes)} - {_gb(reserved_bytes)} reserved); add ranks, reduce the "
            f"model or use tensor/pipeline parallelism")
    best_time = min(r["comm_time_s"] for r in fitting)
    tied = [r for r in fitting if r["comm_time_s"] <= best_time * (1 + 1e-9) + 1e-15]
    best = min(tied, key=lambda r: r["memory"]["total"])
    ordered = sorted(fitting, key=lambda r: (r["comm_time_s"], r["memory"]["total"]))
    ordered += [r for r in reports if not r["fits"]]
    excluded = [r["strategy"] for r in reports if not r["fits"]]
    runner_up = next((r for r in ordered if r is not best and r["fits"]), None)
    parts = [
        f"auto chose {best['strategy']}"
        + (f" ({best['known_as']})" if best.get("known_as") else "")
        + f": {best['comm_time_s'] * 1e3:.1f} ms modelled communication per step "
        f"(intra {_gb(best['comm']['per_step_total']['intra'])}, inter "
        f"{_gb(best['comm']['per_step_total']['inter'])}), {_gb(best['memory']['total'])} of model "
        f"states per rank (available {_gb(gpu_memory_bytes - reserved_bytes)})."]
    if len(tied) > 1:
        parts.append(f"Tied on time with {', '.join(r['strategy'] for r in tied if r is not best)}; "
                     f"took the one with the least memory.")
    if runner_up is not None and runner_up not in tied:
        parts.append(f"Next fastest: {runner_up['strategy']} at {runner_up['comm_time_s'] * 1e3:.1f} ms.")
    if excluded:
        parts.append(f"Do not fit: {', '.join(excluded)}.")
    return AutoChoice(strategy=PaRoStrategy.from_string(best["strategy"]), report=best,
                      candidates=ordered, explanation=" ".join(parts))


# =================================================================================================
# 3. PaRO-CC hierarchical collectives
# =================================================================================================

class CommCounter:
    """Bytes this rank sends, by link, counted with the cost model's convention.

    Each recorded collective of a logical tensor of ``numel`` elements among ``ranks`` ranks adds
    :func:`ring_bytes` to its link, so a measured step can be compared with
    :func:`communication_volume` exactly.
    """

    def __init__(self) -> None:
        self.bytes: Dict[str, float] = {"intra": 0.0, "inter": 0.0}
        self.calls: List[Tuple[str, str, int, int]] = []
        """(link, op, logical numel, ranks) per collective call, in order."""

    def record(self, link: str, op: str, numel: int, element_size: float, ranks: int) -> None:
        if link not in self.bytes:
            raise ValueError(f"link must be 'intra' or 'inter', got {link!r}")
        self.bytes[link] += ring_bytes(op, numel * element_size, ranks)
        self.calls.append((link, op, numel, ranks))

    @property
    def intra(self) -> float:
        return self.bytes["intra"]

    @property
    def inter(self) -> float:
        return self.bytes["inter"]

    def reset(self) -> None:
        self.bytes = {"intra": 0.0, "inter": 0.0}
        self.calls = []


def build_paro_groups(group_size: int, dp_ranks: Optional[Sequence[int]] = None,
                      backend: Optional[str] = None) -> Any:
    """Intra (one per group of m consecutive DP ranks) and inter (same local index) groups.

    Delegates to :func:`megatron.distributed.quant.topology.build_two_level_groups`, whose layout
    (DP rank r = group * m + local) is the one PaRO assumes. Collective over the whole world;
    returns a ``TwoLevelGroups`` (``intra_group`` / ``inter_group`` are None for a size-1 side).
    """
    from .topology import build_two_level_groups

    ranks = list(range(dist.get_world_size())) if dp_ranks is None else list(dp_ranks)
    resolve_group_size(len(ranks), group_size)
    return build_two_level_groups(ranks, group_size, backend=backend)


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any, op: Any) -> None:
    reduce_scatter_flat(out, inp, group, op=op)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    all_gather_flat(out, inp, group)


def _count(counter: Optional[CommCounter], link: str, op: str, numel: int, t: torch.Tensor,
           ranks: int) -> None:
    if counter is not None and ranks > 1:
        counter.record(link, op, numel, t.element_size(), ranks)


def hierarchical_all_reduce(tensor: torch.Tensor, intra_group: Any, inter_group: Any, *,
                            op: Any = dist.ReduceOp.SUM,
                            counter: Optional[CommCounter] = None) -> torch.Tensor:
    """In-place all-reduce as intra reduce-scatter -> inter all-reduce of the 1/m slice -> intra
    all-gather (spec §4).

    Only 1/m of the data crosses the slow inter-group link, and each of the m ranks of a group
    drives its own inter link in parallel. The tensor is padded to a multiple of m (the padding
    lives only in a scratch buffer and is dropped). ``None`` for a group means that
    side has one rank and its hop is skipped. Result equals ``dist.all_reduce`` up to summation
    order (exactly for integer-valued floats).
    """
    m, g = _size(intra_group), _size(inter_group)
    flat = tensor.reshape(-1)
    numel = flat.numel()
    padded_numel = -(-numel // m) * m
    if m > 1:
        buf = torch.zeros(padded_numel, dtype=tensor.dtype, device=tensor.device)
        buf[:numel].copy_(flat)
        shard = torch.empty(padded_numel // m, dtype=tensor.dtype, device=tensor.device)
        _reduce_scatter(shard, buf, intra_group, op)
        _count(counter, "intra", "reduce_scatter", padded_numel, buf, m)
    else:
        buf = flat.contiguous()  # a view of `tensor` when it is contiguous: reduced in place
        shard = buf
    if g > 1:
        dist.all_reduce(shard, op=op, group=inter_group)
        _count(counter, "inter", "all_reduce", shard.numel(), shard, g)
    if m > 1:
        _all_gather(buf, shard, intra_group)
        _count(counter, "intra", "all_gather", padded_numel, buf, m)
    if buf.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(buf[:numel].view(tensor.shape))
    return tensor


def hierarchical_reduce_scatter(output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                                intra_group: Any, inter_group: Any, *,
                                op: Any = dist.ReduceOp.SUM,
                                counter: Optional[CommCounter] = None) -> torch.Tensor:
    """Reduce-scatter over all n = g*m ranks in two hops (spec §4); layout of reduce_scatter_tensor.

    ``input`` holds n equal chunks, chunk r for DP rank r = group * m + local. The chunks are
    reordered local-major so one intra reduce-scatter leaves local rank l with chunks l, m + l,
    ... summed over its group (the spec's per-block intra reduce-scatters fused into one call),
    then an inter reduce-scatter of that 1/m slice hands each group its own chunk.
    """
    m, g = _size(intra_group), _size(inter_group)
    n = m * g
    if input.numel() != n * output.numel():
        raise ValueError(f"input has {input.numel()} elements, expected {n} x output ({output.numel()})")
    c = output.numel()
    local_major = input.reshape(g, m, c).transpose(0, 1).contiguous().reshape(-1)
    if m > 1:
        slice_ = torch.empty(g * c, dtype=input.dtype, device=input.device)
        _reduce_scatter(slice_, local_major, intra_group, op)
        _count(counter, "intra", "reduce_scatter", n * c, input, m)
    else:
        slice_ = local_major
    out = output.reshape(-1)
    if g > 1:
        res = torch.empty(c, dtype=input.dtype, device=input.device)
        _reduce_scatter(res, slice_, inter_group, op)
        _count(counter, "inter", "reduce_scatter", g * c, input, g)
        out.copy_(res)
    else:
        out.copy_(slice_)
    return output


def hierarchical_all_gather(output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                            intra_group: Any, inter_group: Any, *,
                            counter: Optional[CommCounter] = None) -> torch.Tensor:
    """All-gather over all n ranks in two hops (spec §4); layout of all_gather_into_tensor.

    Inter all-gather first (only this rank's 1/n shard crosses the slow link, gathering the chunks
    of the ranks with the same local index), then an intra all-gather of the 1/m slices, then the
    local-major result is reordered into DP-rank order.
    """
    m, g = _size(intra_group), _size(inter_group)
    n = m * g
    c = input.numel()
    if output.numel() != n * c:
        raise ValueError(f"output has {output.numel()} elements, expected {n} x input ({c})")
    shard = input.reshape(-1).contiguous()
    if g > 1:
        slice_ = torch.empty(g * c, dtype=input.dtype, device=input.device)
        _all_gather(slice_, shard, inter_group)
        _count(counter, "inter", "all_gather", g * c, input, g)
    else:
        slice_ = shard
    if m > 1:
        local_major = torch.empty(n * c, dtype=input.dtype, device=input.device)
        _all_gather(local_major, slice_, intra_group)
        _count(counter, "intra", "all_gather", n * c, input, m)
    else:
        local_major = slice_
    output.reshape(g, m, c).copy_(local_major.reshape(m, g, c).transpose(0, 1))
    return output


HIERARCHICAL_MIN_NUMEL = 1 << 20
"""Below this many elements PR #5588 keeps the flat collective: latency, not bandwidth, dominates."""


def use_hierarchical(groups: Any, numel: int, min_numel: int = HIERARCHICAL_MIN_NUMEL) -> bool:
    """PR #5588's rule for taking the PaRO-CC path (spec §4).

    Only when the group spans at least two groups/nodes (otherwise there is no slow link to
    spare), the layout is a full rectangle (guaranteed by :func:`build_paro_groups`) and the
    message is large enough for bandwidth to matter.
    """
    return groups.inter_size > 1 and groups.intra_size > 1 and numel >= min_numel


def paro_all_reduce(tensor: torch.Tensor, groups: Any, *, min_numel: int = HIERARCHICAL_MIN_NUMEL,
                    counter: Optional[CommCounter] = None) -> torch.Tensor:
    """All-reduce over the DP group: hierarchical when :func:`use_hierarchical`, else flat.

    The flat path is counted as a ring in DP-rank order: a rank sends everything to its successor,
    which sits in another group only for the last local index, so that rank's bytes go to 'inter'.
    """
    if use_hierarchical(groups, tensor.numel(), min_numel):
        return hierarchical_all_reduce(tensor, groups.intra_group, groups.inter_group, counter=counter)
    dist.all_reduce(tensor, group=groups.dp_group)
    if counter is not None and groups.dp_size > 1:
        crosses = groups.inter_size > 1 and groups.local == groups.intra_size - 1
        counter.record("inter" if crosses else "intra", "all_reduce", tensor.numel(),
                       tensor.element_size(), groups.dp_size)
    return tensor


def _run_collective(spec: CollectiveSpec, numel: int, intra_group: Any, inter_group: Any,
                    dtype: torch.dtype, counter: CommCounter) -> None:
    """Execute one :class:`CollectiveSpec` on a scratch tensor of the state's full size."""
    m, g = _size(intra_group), _size(inter_group)
    n = m * g
    full = torch.ones(numel, dtype=dtype)
    if spec.scope == "global":
        if spec.op == "all_reduce":
            hierarchical_all_reduce(full, intra_group, inter_group, counter=counter)
        elif spec.op == "reduce_scatter":
            hierarchical_reduce_scatter(torch.empty(numel // n, dtype=dtype), full, intra_group,
                                        inter_group, counter=counter)
        else:
            hierarchical_all_gather(full, torch.ones(numel // n, dtype=dtype), intra_group,
                                    inter_group, counter=counter)
        return
    # intra: the full tensor among the m ranks of the group; inter: the 1/m slice among g ranks.
    group, k, link = (intra_group, m, "intra") if spec.scope == "intra" else (inter_group, g, "inter")
    logical = numel if spec.scope == "intra" else numel // m
    if k == 1:
        return
    t = torch.ones(logical, dtype=dtype)
    if spec.op == "all_reduce":
        dist.all_reduce(t, group=group)
    elif spec.op == "reduce_scatter":
        _reduce_scatter(torch.empty(logical // k, dtype=dtype), t, group, dist.ReduceOp.SUM)
    else:
        _all_gather(t, torch.ones(logical // k, dtype=dtype), group)
    counter.record(link, spec.op, logical, t.element_size(), k)


def run_strategy_comm_pattern(strategy: Union[PaRoStrategy, str], num_params: int,
                              intra_group: Any, inter_group: Any, *,
                              trainable_params: Optional[int] = None, micro_steps: int = 1,
                              dtype: torch.dtype = torch.float32,
                              counter: Optional[CommCounter] = None) -> CommCounter:
    """Run the collectives of one global step of ``strategy`` on dummy buffers and count bytes.

    No model is involved: this replays the §3 pattern (parameter gathers and gradient reductions
    every micro-step, boundary sync, post-step parameter sync) with real collectives of the right
    sizes. It validates the cost model against what actually moves, and measures the pattern's
    wall-clock time on a real cluster. Sizes must be divisible by n = m * g.
    """
    s = _as_strategy(strategy)
    n = _size(intra_group) * _size(inter_group)
    trainable = num_params if trainable_params is None else trainable_params
    for what, v in (("num_params", num_params), ("trainable_params", trainable)):
        if v % n:
            raise ValueError(f"{what}={v} must be divisible by the world size {n}")
    counter = counter or CommCounter()
    sizes = {"params": num_params, "trainable_params": trainable, "grads": trainable}
    specs = strategy_collectives(s)
    for _ in range(micro_steps):
        for spec in specs:
            if spec.per_micro_step:
                for _ in range(spec.count):
                    _run_collective(spec, sizes[spec.data], intra_group, inter_group, dtype, counter)
    for spec in specs:
        if not spec.per_micro_step:
            for _ in range(spec.count):
                _run_collective(spec, sizes[spec.data], intra_group, inter_group, dtype, counter)
    return counter
