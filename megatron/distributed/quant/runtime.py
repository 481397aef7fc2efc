"""One object per model that owns its quantized data-parallel communication.

:class:`QuantizationRuntime` holds all state of the quantized path (config, groups, generators,
LoCo, qWD references, accounting, the NaN/Inf agreement) and offers
:meth:`~QuantizationRuntime.reduce_scatter` / :meth:`~QuantizationRuntime.all_gather` over a *scope*
('global', 'intra', 'inter'). Both :mod:`.ddp` and :mod:`.paro.engine` call it, so every strategy
behaves the same. Stateless collectives: :mod:`.collectives`; where they run: :mod:`.streams`.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from .accounting import CommAccounting
from .collectives.common import PendingCollective, reduce_scatter_flat
from .collectives.gradients import two_level_reduce_scatter
from .collectives.weights import gather_layout, quantized_all_gather
from .config import QuantizationConfig
from .loco import LoCoErrorFeedback
from .placement import agree_intra_node_size, placement_warning
from .streams import CommStreams, CommTiming
from .topology import TwoLevelGroups, build_two_level_groups_for_all, expert_intra_node_size

logger = logging.getLogger(__name__)

__all__ = ["QuantizationRuntime", "QuantizationErrorMonitor", "build_runtime",
           "build_expert_runtime", "SCOPES"]

SCOPES = ("global", "intra", "inter")
"""Where a collective runs: the whole DP group (two hops), the node, or across nodes."""

# Seed offsets: one generator per (rank, buffer, direction) so that the rounding stream of a
# buffer does not depend on the order in which buffers happen to be reduced (overlap vs. no
# overlap give identical numerics) nor on whether the other direction is quantized.
_SEED_RANK_STRIDE = 1_000_003
_SEED_BUCKET_STRIDE = 7_919
_SEED_WEIGHT_OFFSET = 104_729


class QuantizationErrorMonitor:
    """Quantized vs exact results of the monitored collectives, summed over an interval.

    Per kind ('grad': reduce-scatter outputs, 'weight': this rank's reconstructed weight shard):
    ``sum |q - e|^2``, ``sum |e|^2``, ``sum <q, e>``, ``sum |q|^2`` in fp64, so the report is the
    relative L2 error and cosine over every buffer of the interval (this rank's shards)."""

    KINDS = ("grad", "weight")

    def __init__(self) -> None:
        self._sums = {k: torch.zeros(4, dtype=torch.float64) for k in self.KINDS}

    def add(self, kind: str, quantized: torch.Tensor, exact: torch.Tensor) -> None:
        q = quantized.detach().reshape(-1).to(torch.float64).cpu()
        e = exact.detach().reshape(-1).to(torch.float64).cpu()
        self._sums[kind] += torch.stack([(q - e).square().sum(), e.square().sum(),
                                         (q * e).sum(), q.square().sum()])

    def report(self, reset: bool = True) -> Dict[str, float]:
        """``quant_error_{kind}_rel`` and ``quant_error_{kind}_cos`` for each kind measured since
        the last reset (nothing for a kind that was not)."""
        out: Dict[str, float] = {}
        for kind, (err, ref, dot, qq) in ((k, v.tolist()) for k, v in self._sums.items()):
            if ref > 0 or qq > 0:
                out[f"quant_error_{kind}_rel"] = (err / ref) ** 0.5 if ref > 0 else float("inf")
                out[f"quant_error_{kind}_cos"] = dot / (ref * qq) ** 0.5 if ref * qq > 0 else 0.0
        if reset:
            for v in self._sums.values():
                v.zero_()
        return out


class QuantizationRuntime:
    """Quantized data-parallel communication of one model (shared by its chunks).

    A *buffer* is a flat gradient / parameter bucket, registered once with :meth:`register`
    under a ``key`` (checkpoint name, LoCo buffer, generators) and an ``index`` (seed). The
    caller owns the buffers and decides *when* to communicate; this object decides *how*.
    """

    def __init__(self, config: QuantizationConfig, groups: TwoLevelGroups,
                 name: str = "") -> None:
        self.config = config
        """Validated where it was built (:meth:`QuantizationConfig.from_args`), not again here."""
        self.groups = groups
        self.name = name
        """'' for the dense buffers; 'expert' for MoE expert buffers over the expert-data-
        parallel group (the prefix of their report fields)."""
        self.iteration = 0
        self.last_stepped_iteration: Optional[int] = None
        self.accounting = CommAccounting()
        self.loco: Optional[LoCoErrorFeedback] = (
            LoCoErrorFeedback.from_config(config) if config.loco else None)
        self.generators: Dict[str, torch.Generator] = {}
        self.reference_shards: Dict[str, Optional[torch.Tensor]] = {}
        """qWD: per buffer key, this rank's shard of the last reconstructed weights, taken right
        before the optimizer overwrote it (None once a gather used it)."""
        self.updated: Dict[str, bool] = {}
        """Per buffer key: an optimizer update reached it since its last weight gather."""
        self.buffer_numel: Dict[str, Optional[int]] = {}
        """Per buffer key: its elements (the layout the saved state belongs to)."""
        self._nonfinite_flag: Optional[torch.Tensor] = None
        """Positive when the quantized collectives of this step met a NaN/Inf on this rank
        (the groups holding one, or the elements on the CPU backends), counted on the device by
        the quantize kernels (int32); agreed and reset once per step by :meth:`agree_nonfinite`,
        so no bucket waits for the host."""
        self.nonfinite_events = 0
        self.nonfinite_events_interval = 0
        self.timing = CommTiming(CommStreams("inline"))
        """Total vs exposed communication time per iteration (the log line's ``comm_*_ms``)."""
        self.startup_notes: List[str] = []
        """Warnings about how this run's ranks are placed (the trainer prints them at startup)."""
        self.errors = QuantizationErrorMonitor()
        """``--quantization-error-interval``: quantized vs exact, per interval (the log line's
        ``quant_error_*``)."""

    # -- where the collectives run ---------------------------------------------------------
    def overlap_streams(self, device: torch.device) -> CommStreams:
        """The stages the overlapped collectives run on (:mod:`.streams`; created once: worker
        threads for CPU buffers, CUDA streams for CUDA buffers)."""
        if self.timing.overlapped is None:
            self.timing.overlapped = CommStreams.for_device(device)
        return self.timing.overlapped

    def streams(self, device: torch.device, overlap: bool) -> CommStreams:
        """The overlapped stages, or the inline runner (timed as exposed)."""
        return self.overlap_streams(device) if overlap else self.timing.inline

    # -- decisions ----------------------------------------------------------------------------
    @property
    def quantize_gradients_now(self) -> bool:
        """Quantized reduce-scatter this iteration (else the caller's exact one)."""
        c = self.config
        return c.quantized_gradients and self.iteration >= c.gradients_quantization_start_iteration

    @property
    def monitor_now(self) -> bool:
        """This iteration measures the quantization error (``--quantization-error-interval``):
        its collectives run inline, the exact ones beside them on the same groups."""
        n = self.config.quantization_error_interval
        return n > 0 and self.iteration % n == 0

    @property
    def quantize_weights(self) -> bool:
        return self.config.quantized_weights

    @property
    def weights_as_difference(self) -> bool:
        """qWD (quantize new - reconstructed weights) rather than qW (the weights themselves)."""
        return self.config.weight_quantization_mode == "diff"

    # -- buffers and their generators ----------------------------------------------------------
    def register(self, key: str, index: int, numel: Optional[int] = None) -> None:
        """Declare buffer ``key`` (``numel`` elements): creates its generators now, so a
        checkpoint loaded before the first step finds them."""
        self.buffer_numel[key] = numel
        self.grad_generator(key, index)
        self.weight_generator(key, index)
        self.reference_shards.setdefault(key, None)
        self.updated.setdefault(key, False)

    def _seed(self, index: int) -> int:
        return (self.config.seed + _SEED_RANK_STRIDE * self.groups.dp_rank
                + _SEED_BUCKET_STRIDE * (index + 1))

    def grad_generator(self, key: str, index: int) -> torch.Generator:
        return self.generator("grad/" + key, self._seed(index))

    def weight_generator(self, key: str, index: int) -> torch.Generator:
        return self.generator("weight/" + key, self._seed(index) + _SEED_WEIGHT_OFFSET)

    def generator(self, key: str, seed: int) -> torch.Generator:
        """The stochastic-rounding generator registered under ``key`` (created seeded once).

        A host (CPU) generator whatever the buckets' device: the C++ and Triton kernels draw one
        seed per call from it, and a draw from a CUDA generator would be a host sync per bucket
        and hop (the host-sync budget, tests/test_host_sync_budget.py)."""
        gen = self.generators.get(key)
        if gen is None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(int(seed) % (2 ** 63))
            self.generators[key] = gen
        return gen

    # -- collectives ----------------------------------------------------------------------------
    def scope_groups(self, scope: str) -> TwoLevelGroups:
        """The groups of ``scope`` (:data:`SCOPES`, :meth:`TwoLevelGroups.scope`)."""
        return self.groups.scope(scope)

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor, *,  # noqa: A002
                       key: str, index: int, scope: str = "global",
                       streams: Optional[CommStreams] = None) -> Optional[PendingCollective]:
        """Quantized SUM reduce-scatter of buffer ``key`` over ``scope`` into ``output`` (this
        rank's shard, in the layout of ``dist.reduce_scatter_tensor`` over the scope's group):
        TLq / TLq-HS in two hops for 'global', one hop for 'intra' / 'inter', with the buffer's
        LoCo error feedback and seeded generator; NaN/Inf noted for :meth:`agree_nonfinite`.
        With ``streams`` (overlap) the hops run there and a handle is returned."""
        cfg = self.config
        ef = None
        if self.loco is not None:
            ef = self.loco.bucket(key if scope == "global" else f"{scope}/{key}")
        exact = None
        if self.monitor_now:  # before the call: ``output`` may alias a shard of ``input``
            exact = self._exact_reduce_scatter(input, scope)
            streams = self.timing.inline  # no stage may use the groups while the exact one runs
        handle = two_level_reduce_scatter(
            input, output, self.scope_groups(scope),
            intra=cfg.gradient_intra_hop, inter=cfg.gradient_inter_hop,
            generator=self.grad_generator(key, index), accounting=self.accounting, error_feedback=ef, async_op=streams is not None,
            nonfinite_flag=self.nonfinite_flag(input.device),
            pipeline=cfg.gradient_alltoall_pipeline, streams=streams,
            label=f"gradient reduce-scatter of {key}" + ("" if scope == "global" else
                                                         f" ({scope} scope)"))
        if exact is not None:
            self.errors.add("grad", output, exact)
        return handle

    def _exact_reduce_scatter(self, input: torch.Tensor, scope: str) -> torch.Tensor:  # noqa: A002
        """fp32 SUM reduce-scatter of ``input`` over ``scope``'s group (the monitor's reference;
        the DP-rank layout the quantized one writes)."""
        g = self.scope_groups(scope)
        x = input.detach().reshape(-1).to(torch.float32, copy=True)
        if g.dp_size == 1:
            return x
        out = torch.empty(x.numel() // g.dp_size, dtype=torch.float32, device=x.device)
        reduce_scatter_flat(out, x, g.dp_group)
        return out

    def all_gather(self, shard: torch.Tensor, output: torch.Tensor, *, key: str, index: int,
                   reference: Optional[torch.Tensor] = None, scope: str = "global",
                   hops: Optional[Sequence[str]] = None,
                   streams: Optional[CommStreams] = None) -> Any:
        """Quantized (qWD / qW) all-gather of this rank's updated ``shard`` of buffer ``key``
        into ``output``; for qWD ``reference`` is the last reconstructed buffer (identical on
        every rank; ``output`` may alias it).

        One collective over ``scope`` (output in the scope's rank order), or, with ``hops``
        (scope names, e.g. ``('inter', 'intra')``, PaRO's local-major layout), the codes
        forwarded hop by hop. With ``streams`` (overlap) a handle is returned."""
        cfg = self.config
        kwargs: Dict[str, Any] = {}
        monitor = self.monitor_now
        if monitor:
            streams = self.timing.inline  # so the reconstruction can be read right after
            exact = shard.detach().to(output.dtype).to(torch.float64).reshape(-1)
        if hops is None:
            g = self.scope_groups(scope)
            group: Any = g.weights_communicator
            kwargs["link_of_peer"] = g.link_of_peer
        else:
            parts = [(self.scope_groups(h).dp_group, h) for h in hops]
            parts = [(grp, h) for grp, h in parts if grp is not None]
            group = [grp for grp, _ in parts]
            kwargs["hop_links"] = [h for _, h in parts]
            if not group:  # every hop has one rank: the shard is the buffer
                output.copy_(shard.to(output.dtype).view(output.shape))
                return None
        handle = quantized_all_gather(
            shard, reference if self.weights_as_difference else None, output, group,
            mode=cfg.weight_quantization_mode, spec=cfg.weight_hop,
            generator=self.weight_generator(key, index), accounting=self.accounting,
            nonfinite_flag=self.nonfinite_flag(shard.device),
            async_op=streams is not None, streams=streams,
            label=f"weight all-gather of {key}", **kwargs)
        if monitor:  # this rank's shard of the reconstruction, where the gather put it
            n = exact.numel()
            _, position = gather_layout(group if isinstance(group, list) else [group])
            self.errors.add("weight", output.reshape(-1)[position * n:(position + 1) * n], exact)
        return handle

    # -- qWD reference shards -----------------------------------------------------------------
    def note_weights_updated(self, key: str, shard: torch.Tensor) -> None:
        """The optimizer is about to overwrite this rank's ``shard`` of buffer ``key``: for qWD
        keep a copy (the reference the next gather's difference is taken against; a snapshot not
        consumed yet is kept, it is still the true reference) and mark the buffer updated."""
        if self.weights_as_difference and self.reference_shards.get(key) is None:
            self.reference_shards[key] = shard.detach().clone()
        self.updated[key] = True

    def take_update(self, key: str) -> Tuple[bool, Optional[torch.Tensor]]:
        """(updated since the last gather, qWD reference) of buffer ``key``; both reset."""
        updated = self.updated.get(key, False)
        ref = self.reference_shards.get(key)
        self.updated[key] = False
        self.reference_shards[key] = None
        return updated, ref

    # -- accounting of the exact (megatron-core) collectives -------------------------------------
    def record_exact(self, name: str, kind: str, numel: int, elem_size: int) -> None:
        """Count an unquantized reduce-scatter / all-gather of ``numel`` elements: the same bytes
        as the baseline (accounting's two-level form), so reports cover every step."""
        p, d = self.groups.dp_size, self.groups.intra_size
        if p <= 1:
            return
        shard = numel // p
        self.accounting.record_baseline(name, kind=kind, numel=numel, elem_size=elem_size,
                                        dp_size=p, peers_intra=d - 1, peers_inter=p - d)
        self.accounting.record_all_gather(name, kind=kind, shard_bytes=shard * elem_size,
                                          shard_elements=shard, peers_intra=d - 1,
                                          peers_inter=p - d)

    # -- non-finite agreement (once per step) ---------------------------------------------------
    def nonfinite_flag(self, device: torch.device) -> torch.Tensor:
        """This step's device-side "met NaN/Inf" flag (created on first use)."""
        if self._nonfinite_flag is None:
            self._nonfinite_flag = torch.zeros(1, dtype=torch.int32, device=device)
        return self._nonfinite_flag

    def agree_nonfinite(self, device: torch.device) -> bool:
        """True on every rank if any rank's quantized collectives met NaN/Inf since the last call:
        one all-reduce (over all ranks, as megatron-core agrees on ``found_inf``) and the step's
        one host sync. Resets the flag; counts the event."""
        flag = self.nonfinite_flag(device).clone()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._nonfinite_flag.zero_()
        if not flag.item() > 0:
            return False
        self.nonfinite_events += 1
        self.nonfinite_events_interval += 1
        logger.warning("quantized communication met non-finite values at iteration %d; the step "
                       "is skipped", self.iteration)
        return True

    # -- iteration / skip hooks ---------------------------------------------------------------
    def set_iteration(self, iteration: int) -> None:
        """Start of a training iteration: remembers it (start-iteration switch) and advances the
        LoCo reset schedule once per new iteration (= once per optimizer step)."""
        iteration = int(iteration)
        self.timing.iterations += 1
        if (self.loco is not None and self.last_stepped_iteration is not None
                and iteration > self.last_stepped_iteration):
            for _ in range(iteration - self.last_stepped_iteration):
                self.loco.step()
        self.last_stepped_iteration = iteration
        self.iteration = iteration

    def resume_at(self, iteration: int) -> None:
        """A resume whose quantization state starts afresh: the counters follow the checkpoint's
        iteration, but no iteration ran (:meth:`set_iteration` would count one in the first
        interval's per-iteration communication times)."""
        self.iteration = self.last_stepped_iteration = int(iteration)

    def on_step_skipped(self, loss_scale_ratio: Optional[float]) -> None:
        """A skipped step may have polluted the error buffers with NaN/Inf: drop them (as
        DeepSpeed does on an fp16 overflow). A pure loss-scale change without skip is handled by
        :meth:`rescale_errors`."""
        if self._nonfinite_flag is not None:
            self._nonfinite_flag.zero_()
        if self.loco is not None:
            self.loco.drop()

    def rescale_errors(self, factor: float) -> None:
        """Loss scale changed by ``factor`` (new/old): keep LoCo errors in loss-scaled units."""
        if self.loco is not None and factor != 1.0:
            self.loco.rescale(factor)

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {
            "iteration": self.iteration,
            "last_stepped_iteration": self.last_stepped_iteration,
            "generators": {k: g.get_state() for k, g in self.generators.items()},
            "loco": None if self.loco is None else self.loco.state_dict(),
            # host copies: not a second copy on the device just for torch.save
            "reference_shards": {k: None if r is None else r.detach().to("cpu", copy=True)
                                 for k, r in self.reference_shards.items()},
            "updated_buckets": dict(self.updated),
            "layout": self.layout(),
            "nonfinite_events": self.nonfinite_events,
            "config": self.config.to_dict(),
        }

    def layout(self) -> Dict[str, Any]:
        """What the saved state is shaped by: the two-level group sizes and the buffers (keys
        and sizes: LoCo's error buffers hold a bucket's, or its intra-node sum's, elements)."""
        return {"dp_size": self.groups.dp_size, "intra_size": self.groups.intra_size,
                "buffers": dict(self.buffer_numel)}

    def layout_difference(self, state: Dict[str, Any]) -> Optional[str]:
        """Why :meth:`state_dict` output ``state`` does not fit this runtime, or None (also when
        it records no layout). The buckets and the intra-node size shape this state too, not only
        the parallel sizes a resharding format compares."""
        saved = state.get("layout")
        if saved is None:
            return None
        mine = self.layout()
        for name, what in (("dp_size", "data-parallel size"),
                           ("intra_size", "data-parallel ranks per node")):
            if saved.get(name) != mine[name]:
                return f"{what} {saved.get(name)} -> {mine[name]}"
        if saved.get("buffers") != mine["buffers"]:
            old, new = saved.get("buffers") or {}, mine["buffers"]
            return (f"the gradient buckets ({len(old)} of {sorted(set(old.values()), key=str)} "
                    f"elements -> {len(new)} of {sorted(set(new.values()), key=str)})")
        return None

    def load_state_dict(self, state: Dict[str, Any], device: Optional[torch.device] = None) -> None:
        """Restore :meth:`state_dict`'s output. Checkpoints are read with ``map_location="cpu"``:
        the LoCo error buffers and qWD reference shards are moved to ``device`` (the device of the
        model's buffers), or the first step after a resume would mix CPU and CUDA tensors."""
        self.iteration = int(state["iteration"])
        last = state.get("last_stepped_iteration")
        self.last_stepped_iteration = None if last is None else int(last)
        for key, gstate in state.get("generators", {}).items():
            gen = self.generators.get(key)
            if gen is None:
                raise KeyError(f"checkpoint has a stochastic-rounding generator {key!r} this model "
                               "does not have (bucket layout or DP size changed)")
            gen.set_state(gstate)
        loco_sd = state.get("loco")
        if self.loco is not None and loco_sd is not None:
            self.loco.load_state_dict(loco_sd, device=device)
        refs = state.get("reference_shards", {})
        updated = state.get("updated_buckets", {})
        for key in list(self.reference_shards):
            ref = refs.get(key)
            self.reference_shards[key] = None if ref is None else ref.to(device, copy=True)
            self.updated[key] = bool(updated.get(key, False))
        self.nonfinite_events = int(state.get("nonfinite_events", 0))


_GROUPS_CACHE: Dict[Tuple[Any, ...], TwoLevelGroups] = {}


def _two_level_groups_for(dp_group: Any, intra_size: int,
                          timeout: Optional[timedelta]) -> TwoLevelGroups:
    """Two-level groups of ``dp_group`` (cached; creating them is world-collective).

    Every rank learns every DP group's members (one all_gather_object over WORLD) so that all
    ranks create the same sub-groups in the same order.
    """
    my_ranks = tuple(dist.get_process_group_ranks(dp_group))
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, my_ranks)
    all_lists = sorted({tuple(r) for r in everyone})
    key = (tuple(all_lists), intra_size, my_ranks, timeout)
    cached = _GROUPS_CACHE.get(key)
    if cached is not None:
        return cached
    dp_groups = [dp_group if tuple(r) == my_ranks else None for r in all_lists]
    groups = build_two_level_groups_for_all([list(r) for r in all_lists], intra_size,
                                            dp_groups=dp_groups, timeout=timeout)
    _GROUPS_CACHE[key] = groups
    return groups


def build_runtime(config: QuantizationConfig,
                  dp_group: Optional[Any] = None) -> QuantizationRuntime:
    """Runtime for one model: two-level groups from megatron-core's DP(+CP) group, intra size
    from :meth:`QuantizationConfig.intra_node_size` (so ``--data-parallel-intra-node-size 2``
    makes 4 CPU ranks behave like 2 nodes x 2), agreed by every rank
    (:func:`.placement.agree_intra_node_size`); the communicators take the run's
    ``--distributed-timeout-minutes``. A placement that splits a node's ranks over several hosts
    is noted in ``runtime.startup_notes``."""
    if dp_group is None:
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    intra, hostnames = agree_intra_node_size(config, dp_group, tp_size)
    runtime = QuantizationRuntime(config, _two_level_groups_for(dp_group, intra,
                                                                config.communicator_timeout))
    note = placement_warning(hostnames, runtime.groups.dp_ranks, intra)
    if note is not None:
        runtime.startup_notes.append(note)
    return runtime


def build_expert_runtime(config: QuantizationConfig,
                         dense: QuantizationRuntime) -> Optional[QuantizationRuntime]:
    """Runtime for a MoE model's expert buffers: the two levels of megatron-core's expert-data-
    parallel group (its ranks per node from the dense groups' nodes,
    :func:`.topology.expert_intra_node_size`), or None when that group has one rank (nothing to
    send). Collective over the world, like :func:`build_runtime`."""
    group = parallel_state.get_expert_data_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == 1:  # the same on every rank: every expert-DP group has DP / EP ranks
        return None
    intra = expert_intra_node_size(dense.groups, ranks)
    return QuantizationRuntime(config, _two_level_groups_for(group, intra,
                                                             config.communicator_timeout),
                               name="expert")
