"""PaRO (Partial Redundancy Optimizer) strategies: the grammar, the validity rule, the group size.

Spec: ../shared/research/paro.md. PaRO assigns each model state -- parameters (p), gradients (g)
and optimizer states (os) -- one partition level:

* ``N`` replicated on every rank,
* ``I`` split into ``m`` shards inside each group of ``m`` ranks (a node) and replicated across the
  ``g = n / m`` groups,
* ``G`` split into ``n`` shards across all ranks (ZeRO).

A strategy is the three letters in the order p, g, os (``NIG``, ``IIG``, ZeRO-1 = ``NNG``, ...).
:class:`PaRoStrategy` / :func:`parse_paro_strategy` parse it and apply the validity rule (14 of the
27 combinations are effective; every rejection says why); :func:`check_trainable` says how the
trainer runs one (NNN / NNG on megatron-core, the others on :mod:`.engine`). The rest of PaRO:
the cost model and report in :mod:`.cost`, the PaRO-CC collectives in :mod:`.comm`, the
flags in :mod:`..arguments`.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

__all__ = [
    "Level", "PaRoStrategy", "VALID_STRATEGIES", "STRATEGY_ALIASES", "AUTO",
    "parse_paro_strategy", "as_strategy", "resolve_group_size", "MEGATRON_CORE_STRATEGIES",
    "uses_engine", "check_trainable", "quantization_support_error",
]

AUTO = "auto"


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


def as_strategy(strategy: Union[PaRoStrategy, str]) -> PaRoStrategy:
    """``strategy`` itself, or the :class:`PaRoStrategy` its name parses to."""
    return strategy if isinstance(strategy, PaRoStrategy) else PaRoStrategy.from_string(strategy)


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


MEGATRON_CORE_STRATEGIES: Dict[str, bool] = {"NNN": False, "NNG": True}
"""Strategies megatron-core's DDP / DistributedOptimizer realise directly (value: the
``--use-distributed-optimizer`` setting they need). Every other effective strategy is trained by
the PaRO engine (:mod:`.engine`)."""


def uses_engine(strategy: Optional[str]) -> bool:
    """True when the trainer builds ``strategy`` (``--paro-strategy``, any spelling) on the PaRO
    engine. ``'auto'`` counts (it may pick such a strategy); ``None`` (no ``--paro-strategy``) and
    an invalid name (:func:`check_trainable` refuses it with the reason) do not.
    """
    if strategy is None:
        return False
    try:
        parsed = parse_paro_strategy(strategy)
    except ValueError:
        return False
    return parsed == AUTO or parsed.name not in MEGATRON_CORE_STRATEGIES


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
    needs = MEGATRON_CORE_STRATEGIES.get(parsed.name)
    if needs is not None and needs != use_distributed_optimizer:
        raise ValueError(f"--paro-strategy {parsed.name} " + (
            "needs --use-distributed-optimizer" if needs
            else "replicates optimizer states: drop --use-distributed-optimizer"))
    return parsed


def quantization_support_error(strategy: str, quant_config: Any) -> Optional[str]:
    """Why the PaRO engine cannot run ``strategy`` with these quantization flags, or None.

    Supported (the model's :class:`~..runtime.QuantizationRuntime`, the same object megatron-core's
    bucket groups use, runs SDP4Bit's collectives inside the PaRO groups):

    * ``--quantized-gradients`` (TLq / TLq-HS, LoCo, ``--gradients-quantization-start-iteration``,
      ``--gradient-alltoall-pipeline``, NaN/Inf skip): every gradient reduce-scatter -- intra and
      inter (one hop) and global (two-level) -- so strategies whose optimizer states are
      partitioned globally (os = G). Gradient all-reduces (os = N / I) have no quantized
      collective.
    * ``--quantized-weights``: the post-step parameter sync (qWD: difference to the last synced
      weights; or 'direct'), on whatever hops it has (intra, inter or both). 'direct' mode also
      quantizes the per-micro-step gathers in the cost model, which the engine does not do, so it
      is refused when parameters are partitioned.

    ``--overlap-grad-reduce`` runs the per-bucket gradient reduce-scatters on the communication
    stages (:class:`.engine.ParoDataParallel`, ``grad_groups``); ``--overlap-param-gather``
    (p = I / G) the per-bucket parameter gathers, one bucket ahead (``param_groups``).
    """
    q = quant_config
    if q is None or not q.enabled:
        return None
    s = PaRoStrategy.from_string(strategy)
    what = f"--paro-strategy {s.name} (PaRO engine)"
    if q.quantized_gradients and s.optim != Level.G:
        return (f"{what} with --quantized-gradients: the gradient sync of a strategy with "
                f"optimizer states at level {s.optim.name} is an all-reduce, which has no quantized "
                f"collective; quantized gradients work with os = G (NIG, NGG, ING, IIG, IGG, GNG, "
                f"GIG, GGG)")
    if q.quantized_weights and q.weight_quantization_mode == "direct" and s.params != Level.N:
        return (f"{what} with --weight-quantization-mode direct: the per-micro-step parameter "
                f"gathers are not quantized by the engine; use diff (qWD)")
    return None
