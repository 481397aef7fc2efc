"""PaRO cost model: per-rank model-state memory, per-step communication, the report, ``auto``.

Spec: ../shared/research/paro.md §3. For a strategy (:mod:`.strategy`) and a model of Ψ
parameters on n ranks in groups of m:

* :func:`strategy_collectives` -- the collectives of one global step (the spec's pattern table);
* :func:`model_state_memory` -- Mem = bp·Ψ/d(p) + bg·Ψ'/d(g) + K·Ψ'/d(os) per rank;
* :func:`communication_volume` -- bytes sent per rank on the intra-group and inter-group links,
  optionally with quantized collectives taken from a
  :class:`~megatron.distributed.quant.config.QuantizationConfig`;
* :func:`paro_report` / :func:`format_report` -- the startup report;
* :func:`choose_strategy_auto` -- ``--paro-strategy auto``;
* :func:`activation_memory` -- an estimate of one micro-batch's activations, which ``auto``
  reserves next to the model states (:data:`DEVICE_RESERVE_FRACTION` on top).

The engine (:mod:`.engine`) counts what it really sends with :class:`.comm.CommCounter`,
in the same convention, so a measured step equals :func:`communication_volume` exactly.

Byte convention (same as :mod:`..accounting`): per rank, the payload bytes it delivers to the other
ranks of the group. For a reduce-scatter / all-gather of a logical tensor of ``S`` bytes among ``k``
ranks that is ``(k-1)/k * S`` (what a ring sends); an all-reduce counts twice that. The time model
is ``intra_bytes / intra_bandwidth + inter_bytes / inter_bandwidth`` (spec §3): compute time is the
same for every strategy and is left out, so the model ranks strategies rather than predicting
absolute step times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from .strategy import VALID_STRATEGIES, Level, PaRoStrategy, as_strategy, resolve_group_size

__all__ = [
    "StateBytes", "CollectiveSpec", "MemoryBreakdown", "CommVolume", "strategy_collectives",
    "ring_bytes", "wire_bytes_per_element", "model_state_memory", "communication_volume",
    "estimate_step_time", "paro_report", "format_report", "compare_strategies", "AutoChoice",
    "choose_strategy_auto", "activation_memory", "DEVICE_RESERVE_FRACTION",
]


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
    s = as_strategy(strategy)
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
    s = as_strategy(strategy)
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
    inter hop on the 1/m slice), which is what the engine's global collectives send
    (:func:`.comm.hierarchical_all_reduce` for NNN's all-reduce).
    """
    s = as_strategy(strategy)
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
    s = as_strategy(strategy)
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


DEVICE_RESERVE_FRACTION = 0.10
"""Share of the device memory ``auto`` keeps free besides the activations by default: the CUDA
context, NCCL's communicator buffers, cuBLAS workspaces, the allocator's fragmentation and the
engine's transient buckets (about 1-3 GB each on an 80 GB GPU together, the rest is slack)."""


def activation_memory(*, seq_length: int, micro_batch_size: int, hidden_size: int, num_layers: int,
                      num_attention_heads: int, vocab_size: int,
                      ffn_hidden_size: Optional[int] = None, gated_mlp: bool = False,
                      bytes_per_value: float = 2.0, attention_scores: bool = True,
                      recompute: Optional[str] = None, recompute_num_layers: int = 1) -> float:
    """Bytes of activations one micro-batch keeps for its backward on one rank (no tensor,
    sequence or pipeline parallelism: the only layouts ``auto`` chooses for).

    Korthikanti et al. 2022 §4.1, generalised to the MLP width and activation dtype; an estimate
    for reserving room, not a measurement.
    """
    # See [Note: activation memory estimate] in docs/architecture.md
    s, b, h, a, v = seq_length, micro_batch_size, hidden_size, num_attention_heads, vocab_size
    f = ffn_hidden_size or 4 * h
    B = float(bytes_per_value)
    sbh = s * b * h
    mlp_act = 3 * f if gated_mlp else 2 * f
    scores = (B * 2 + 1) * a * s * s * b if (attention_scores and recompute != "selective") else 0
    per_layer = (B * 5 * sbh + sbh + scores            # attention
                 + B * sbh + B * s * b * mlp_act + sbh  # MLP
                 + B * 2 * sbh)                         # layer norms
    if recompute == "full":
        layers = B * sbh * num_layers + per_layer * min(recompute_num_layers, num_layers)
    else:
        layers = per_layer * num_layers
    return layers + (B + 4) * s * b * v
