"""The state the quantized bucket groups of one model share (:class:`QuantizationRuntime`).

One object per model (shared by its chunks): the config, the two-level process groups, the
iteration counter behind the start-iteration switch, the communication accounting and timing, the
LoCo error buffers, the stochastic-rounding generators and the once-per-step NaN/Inf agreement.
Kept apart from :mod:`.ddp`, which wires it into megatron-core's bucket groups, so that the
checkpoint, reporting and integration code reads the state without the megatron-core subclasses.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from .accounting import CommAccounting
from .config import QuantizationConfig
from .loco import LoCoErrorFeedback
from .streams import CommStreams, CommTiming
from .topology import TwoLevelGroups, build_two_level_groups_for_all

if TYPE_CHECKING:
    from .ddp import QuantizedBucketGroup

logger = logging.getLogger(__name__)

__all__ = ["QuantizationRuntime", "build_runtime"]

# ------------------------------------------------------------------------------------------------
# shared runtime state (one per model, shared by its chunks)
# ------------------------------------------------------------------------------------------------

class QuantizationRuntime:
    """Everything the quantized bucket groups of one model share.

    Holds the config, the two-level process groups, the iteration counter (start-iteration
    switch), the communication accounting, the LoCo error buffers and the non-finite bookkeeping.
    Stochastic-rounding generators live per bucket (see :class:`QuantizedBucketGroup`) but are
    registered here so the checkpoint state is collected in one place.
    """

    def __init__(self, config: QuantizationConfig, groups: TwoLevelGroups) -> None:
        config.validate()
        self.config = config
        self.groups = groups
        self.iteration = 0
        self.last_stepped_iteration: Optional[int] = None
        self.accounting = CommAccounting()
        self.loco: Optional[LoCoErrorFeedback] = (
            LoCoErrorFeedback.from_config(config) if config.loco else None)
        self.generators: Dict[str, torch.Generator] = {}
        self._nonfinite_flag: Optional[torch.Tensor] = None
        """1.0 on the device once a quantized collective of this step met NaN/Inf on this rank
        (:func:`~.collectives.note_nonfinite`); agreed and reset once per step by
        :meth:`agree_nonfinite`, so no bucket waits for the host."""
        self.nonfinite_events = 0
        self.nonfinite_events_interval = 0
        self.bucket_groups: List["QuantizedBucketGroup"] = []
        self.timing = CommTiming(CommStreams("inline"))
        """Total vs exposed communication time per iteration (the log line's ``comm_*_ms``)."""

    # -- where the collectives run ---------------------------------------------------------
    def overlap_streams(self, device: torch.device) -> CommStreams:
        """The stages the overlapped collectives run on (:mod:`.streams`; created once: worker
        threads for CPU buffers, CUDA streams for CUDA buffers)."""
        if self.timing.overlapped is None:
            self.timing.overlapped = CommStreams.for_device(device)
        return self.timing.overlapped

    # -- decisions ----------------------------------------------------------------------------
    @property
    def quantize_gradients_now(self) -> bool:
        """Quantized reduce-scatter this iteration (else megatron-core's exact one)."""
        c = self.config
        return c.quantized_gradients and self.iteration >= c.gradients_quantization_start_iteration

    @property
    def quantize_weights(self) -> bool:
        return self.config.quantized_weights

    # -- generators ---------------------------------------------------------------------------
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

    # -- accounting of the exact (megatron-core) collectives -------------------------------------
    def record_exact(self, name: str, kind: str, numel: int, elem_size: int) -> None:
        """Count an unquantized reduce-scatter / all-gather of ``numel`` elements: the same bytes
        as the baseline (N/P elements to each other peer), so reports cover every step."""
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
            self._nonfinite_flag = torch.zeros(1, dtype=torch.float32, device=device)
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
        refs: Dict[str, Optional[torch.Tensor]] = {}
        updated: Dict[str, bool] = {}
        for bg in self.bucket_groups:
            for idx, ref in enumerate(bg._reference_shards):
                refs[bg._bucket_key(idx)] = None if ref is None else ref.clone()
                updated[bg._bucket_key(idx)] = bool(bg._updated[idx])
        return {
            "iteration": self.iteration,
            "last_stepped_iteration": self.last_stepped_iteration,
            "generators": {k: g.get_state() for k, g in self.generators.items()},
            "loco": None if self.loco is None else self.loco.state_dict(),
            "reference_shards": refs,
            "updated_buckets": updated,
            "nonfinite_events": self.nonfinite_events,
            "config": self.config.to_dict(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
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
            self.loco.load_state_dict(loco_sd)
        refs = state.get("reference_shards", {})
        updated = state.get("updated_buckets", {})
        for bg in self.bucket_groups:
            for idx in range(len(bg.buckets)):
                ref = refs.get(bg._bucket_key(idx))
                bg._reference_shards[idx] = None if ref is None else ref.clone()
                bg._updated[idx] = bool(updated.get(bg._bucket_key(idx), False))
        self.nonfinite_events = int(state.get("nonfinite_events", 0))


_GROUPS_CACHE: Dict[Tuple[Any, ...], TwoLevelGroups] = {}


def _two_level_groups_for(dp_group: Any, intra_size: int) -> TwoLevelGroups:
    """Two-level groups of ``dp_group`` (cached; creating them is world-collective).

    Every rank learns every DP group's members (one all_gather_object over WORLD) so that all
    ranks create the same sub-groups in the same order.
    """
    my_ranks = tuple(dist.get_process_group_ranks(dp_group))
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, my_ranks)
    all_lists = sorted({tuple(r) for r in everyone})
    key = (tuple(all_lists), intra_size, my_ranks)
    cached = _GROUPS_CACHE.get(key)
    if cached is not None:
        return cached
    dp_groups = [dp_group if tuple(r) == my_ranks else None for r in all_lists]
    groups = build_two_level_groups_for_all([list(r) for r in all_lists], intra_size,
                                            dp_groups=dp_groups)
    _GROUPS_CACHE[key] = groups
    return groups


def build_runtime(config: QuantizationConfig,
                  dp_group: Optional[Any] = None) -> QuantizationRuntime:
    """Runtime for one model: two-level groups from megatron-core's DP(+CP) group, intra size
    from :meth:`QuantizationConfig.intra_node_size` (so ``--data-parallel-intra-node-size 2``
    makes 4 CPU ranks behave like 2 nodes x 2)."""
    if dp_group is None:
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dp_size = dist.get_world_size(dp_group)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    intra = config.intra_node_size(dp_size, tp_size)
    return QuantizationRuntime(config, _two_level_groups_for(dp_group, intra))
