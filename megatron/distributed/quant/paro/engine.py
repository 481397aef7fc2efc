"""PaRO training engine: every partition strategy that megatron-core's DDP cannot express.

Spec: ../shared/research/paro.md; cost model: :mod:`.cost`; PaRO-CC collectives:
:mod:`.comm`. NNG (ZeRO-1) and NNN (DDP) keep running on megatron-core's
``DistributedDataParallel`` (+ ``DistributedOptimizer``); this module trains the other twelve
strategies -- and, for testing, all fourteen -- with our own small data-parallel engine:

* :class:`ParoDataParallel` wraps one model chunk. It flattens the parameters into one buffer and
  keeps parameters, gradients and the optimizer's gradient input at the strategy's partition
  levels, issuing exactly the collectives of :func:`.cost.strategy_collectives`, and counts
  their bytes in a :class:`.comm.CommCounter` (so a step can be compared with
  :func:`.cost.communication_volume`).
* :class:`~.optimizer.ParoOptimizer` is a flat fp32 AdamW / SGD over this rank's optimizer-state shard, with
  the interface the trainer's ``optimizer_step`` / ``train_step`` and megatron-core's
  ``OptimizerParamScheduler`` use.

Flat layout: :mod:`.layout` (buckets of unit modules, local-major shards, so every PaRO
transition of a bucket is one plain collective on a contiguous slice); the collectives between
levels: :mod:`.transitions`; the optimizer: :mod:`.optimizer`.

Parameters at level I / G live persistently only as their shard; each bucket has its own full
buffer whose storage exists only while the bucket is gathered (``untyped_storage().resize_(0)``
otherwise, as FSDP does; the parameters are views into it). A forward pre-hook on the bucket's
owner module gathers it, a forward hook releases it after the (last) owner's forward -- or at the
next owner's forward when the module returns the parameter to its caller (megatron's
``skip_bias_add`` bias) -- and a hook on the owner's output gradient gathers it again right before
its backward; it is released when all its parameters got their gradient. A bucket with several
owners (tied embeddings) therefore stays gathered from the embedding to the output layer in the
forward pass and from the output layer to the embedding in the backward pass (still one forward
and one backward gather per micro-step, as the cost model counts). Gradients arrive through
per-parameter post-accumulate-grad hooks: level N adds them into a resident flat buffer; levels I /
G into a temporary full gradient of the bucket, which is reduce-scattered into the persistent shard
accumulator and freed as soon as the bucket's last gradient arrived; a callback at the end of every
micro-step's backward finishes any bucket left (same order on every rank). So the *peak* is the
persistent figure plus about one bucket's full parameters and gradients (``peak_bytes``), and the
*persistent* memory follows the PaRO formula. ``finalize_model_grads`` (called by megatron-core's
schedule after the last micro-batch) moves the gradients from their level to the optimizer-state
level and averages them over DP, like megatron-core's DDP.

With a QuantizationConfig the engine owns the model's :class:`~..runtime.QuantizationRuntime` (the
object megatron-core's bucket groups use) and SDP4Bit runs inside the PaRO groups through it:
gradient reduce-scatters (one hop for intra / inter, two-level TLq / TLq-HS for global, LoCo, the
start iteration, NaN/Inf agreement) and the post-step parameter sync as qWD with the codes
forwarded hop by hop (:func:`quantization_support_error` lists what is supported).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .comm import CommCounter, _size, hierarchical_all_reduce
from .layout import Bucket, output_tensors, plan_buckets
from .strategy import Level, PaRoStrategy
from .transitions import LevelCollectives
from ..runtime import QuantizationRuntime
from ..streams import CommStreams, used_on_this_stage

__all__ = ["ParoDataParallel", "quantization_support_error"]

logger = logging.getLogger(__name__)

GRAD_REDUCES_IN_FLIGHT = 2
"""Overlapped gradient reduce-scatters (``grad_groups``) started and not yet waited for: the hook
that starts another first finishes the oldest, so at most this many temporary full bucket
gradients (g = I / G) are alive beside the one being accumulated."""

PARAM_GATHERS_AHEAD = 1
"""``param_groups`` (``--overlap-param-gather``, p = I / G): buckets whose parameter gather a
hook has started ahead of their use (the next bucket in forward order, the previous one in
backward order) and nobody waited for yet: each is one bucket's full parameters beyond the
inline path's peak."""


def quantization_support_error(strategy: str, quant_config: Any) -> Optional[str]:
    """Why the engine cannot run ``strategy`` with these quantization flags, or None.

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
    stages (:class:`ParoDataParallel`, ``grad_groups``); ``--overlap-param-gather`` (p = I / G)
    the per-bucket parameter gathers, one bucket ahead (``param_groups``).
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


class ParoDataParallel(LevelCollectives, torch.nn.Module):
    """Data parallelism with PaRO partition levels for parameters, gradients and optimizer input.

    ``module`` is one model chunk (GPTModel or its Float16Module); ``groups`` a
    :class:`~megatron.distributed.quant.topology.TwoLevelGroups` from
    :func:`.comm.build_paro_groups` (DP rank r = group * m + local). ``grad_dtype`` is the dtype of
    gradient accumulation and reduction (fp32 for bf16 training, like megatron-core's
    ``grad_reduce_in_fp32``). ``bucket_numel`` caps a bucket: a unit module larger than that is
    split into its children (default: one bucket per unit module, see :func:`.layout._units`). The object
    mimics what megatron-core's schedule and our trainer read from a DDP chunk: ``module``,
    ``config``, ``no_sync``, ``zero_grad_buffer`` and ``finalize_model_grads`` (to be set as
    ``config.finalize_model_grads_func``).

    ``grad_groups`` (``--overlap-grad-reduce``): a second set of the same groups, communicators of
    their own. The gradient reduce-scatter of each bucket (g = I / G) then runs on the
    communication stages (:mod:`..streams`: worker threads on CPU, CUDA streams on a GPU) while
    the backward pass goes on, and is waited for at the end of the micro-step's backward (at most
    :data:`GRAD_REDUCES_IN_FLIGHT` buckets at once, so their temporary full gradients stay
    bounded). The stages drive only ``grad_groups``; the parameter gathers of the hooks drive
    ``groups`` from the main thread: one communicator per stream. The numbers are those of the
    inline path, bit for bit.

    ``param_groups`` (``--overlap-param-gather``, p = I / G): a third set of the same groups. The
    parameter gathers of the hooks then run on the ``weights`` stage over it, and each hook
    starts the gather of the bucket it will need next (forward: the next bucket; backward: the
    previous one) before its module computes, so the gather travels while the module runs
    (:data:`PARAM_GATHERS_AHEAD` buckets ahead at most). Exact copies: the numbers do not change.
    """

    def __init__(self, config: Any, module: torch.nn.Module, strategy: PaRoStrategy, groups: Any,
                 grad_dtype: Optional[torch.dtype] = None, quant_config: Any = None,
                 bucket_numel: Optional[int] = None, grad_groups: Any = None,
                 param_groups: Any = None) -> None:
        super().__init__()
        self.config = config
        self.module = module
        self.strategy = strategy
        self.groups = groups
        self.intra_group = groups.intra_group
        self.inter_group = groups.inter_group
        self.m = _size(self.intra_group)
        self.g = _size(self.inter_group)
        self.n = self.m * self.g
        if self.n != groups.dp_size:
            raise ValueError(f"groups cover {self.n} ranks but the DP group has {groups.dp_size}")
        self.local, self.group_index = groups.local, groups.node
        self.counter = CommCounter()

        named = [(name, p) for name, p in module.named_parameters()]
        frozen = [name for name, p in named if not p.requires_grad]
        if frozen:
            raise NotImplementedError(
                f"the PaRO engine trains every parameter; frozen parameters are not supported yet "
                f"({frozen[:3]}...)")
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise NotImplementedError(f"the PaRO engine needs one parameter dtype, got {dtypes}")
        self.param_dtype = dtypes.pop()
        self.grad_dtype = grad_dtype or self.param_dtype
        device = named[0][1].device
        self.quant = quant_config if (quant_config is not None and quant_config.enabled) else None
        unit = self.n
        if self.quant is not None:
            err = quantization_support_error(strategy.name, self.quant)
            if err:
                raise NotImplementedError(err)
            from ..collectives import required_padding_multiple_from_config

            unit = math.lcm(unit, required_padding_multiple_from_config(self.quant, self.n, self.m))
        if grad_groups is not None and (grad_groups.dp_size, grad_groups.intra_size) != (
                groups.dp_size, groups.intra_size):
            raise ValueError("grad_groups must have the layout of groups")
        self.grad_groups = grad_groups
        """Communicators of the overlapped gradient reduce-scatters (None: inline, on
        ``groups``)."""
        if param_groups is not None and (param_groups.dp_size, param_groups.intra_size) != (
                groups.dp_size, groups.intra_size):
            raise ValueError("param_groups must have the layout of groups")
        if param_groups is not None and strategy.params == Level.N:
            raise ValueError(f"{strategy.name} keeps full parameters (p = N): no gathers to "
                             f"overlap, so no param_groups")
        self.param_groups = param_groups
        """Communicators of the overlapped parameter gathers (None: inline in the hooks, on
        ``groups``)."""
        self._param_stages: Optional[CommStreams] = None
        self._gathering: Dict[int, Any] = {}
        """Bucket index -> handle of its parameter gather started ahead and not waited for."""
        self._grad_stages: Optional[CommStreams] = None
        self._pending: List[Tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        """(handle, reduced shard, accumulator slice, input kept alive) per reduce in flight."""
        self.quant_runtime: Optional[QuantizationRuntime] = (
            QuantizationRuntime(self.quant, groups if grad_groups is None else grad_groups)
            if self.quant is not None else None)
        """The model's quantized communication (the same object megatron-core's bucket groups
        use): generators, LoCo, accounting, start iteration, NaN/Inf agreement; the trainer's
        hooks (integration.set_iteration, checkpoints, reports) find it under this name."""
        self.padding_unit = unit

        # Buckets: unit modules in module order; a parameter used by several units (or passed to
        # a module at call time, tied embeddings) gets a bucket of its own owned by all of them.
        self.params, self.slots, self.buckets, start = plan_buckets(module, bucket_numel, unit)
        self.num_params = sum(s.numel for s in self.slots)
        self.padded_numel = start
        """Sum of the padded bucket sizes: what the engine allocates and sends."""
        S = self.padded_numel
        self._bucket_of = [0] * len(self.params)
        for b in self.buckets:
            for i in b.params:
                self._bucket_of[i] = b.index
            if self.quant_runtime is not None:
                self.quant_runtime.register(self._bucket_key(b), b.index, b.size)

        # Parameters: p = N: one persistent flat buffer, the buckets are views of it;
        # p = I / G: the persistent shard (concatenation of the buckets' shards) plus, per bucket,
        # a full buffer with its own storage that exists only while the bucket is gathered.
        p_level = strategy.params
        self.param_buffer: Optional[torch.Tensor] = None
        if p_level == Level.N:
            self.param_buffer = torch.zeros(S, dtype=self.param_dtype, device=device)
        self.param_shard: Optional[torch.Tensor] = None
        if p_level != Level.N:
            self.param_shard = torch.zeros(S // self.level_ranks(p_level), dtype=self.param_dtype,
                                           device=device)
        with torch.no_grad():
            for b in self.buckets:
                if self.param_buffer is not None:
                    b.full = self.param_buffer[b.start:b.start + b.size]
                else:
                    b.full = torch.zeros(b.size, dtype=self.param_dtype, device=device)
                for i in b.params:
                    slot, p = self.slots[i], self.params[i]
                    view = b.full[slot.offset - b.start:slot.offset - b.start + slot.numel]
                    view = view.view(slot.shape)
                    view.copy_(p.data)
                    p.data = view
                if self.param_shard is not None:
                    a, e = self._local_range(b, p_level)
                    k = self.level_ranks(p_level)
                    b.shard(self.param_shard, k).copy_(b.full[a:e])
        self.release_params()

        # Gradients: persistent full buffer (g = N) or persistent shard accumulator (g = I / G).
        self.grad_buffer: Optional[torch.Tensor] = None
        self.grad_shard: Optional[torch.Tensor] = None
        if strategy.grads == Level.N:
            self.grad_buffer = torch.zeros(S, dtype=self.grad_dtype, device=device)
        else:
            self.grad_shard = torch.zeros(S // self.level_ranks(strategy.grads),
                                          dtype=self.grad_dtype, device=device)
        self.peak_bytes = 0
        """Largest parameter + gradient bytes resident at once (gathered buckets and the temporary
        full gradients of g = I / G raise it above the persistent figure)."""
        self._track_peak()
        self.main_grad: Optional[torch.Tensor] = None
        """fp32 gradient at the optimizer-state level, DP-averaged (set by finalize_model_grads)."""
        self._in_backward = False
        self._pre_backward_done = False
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._make_grad_hook(i))
        self._hook_handles = []
        self._deferred: List[Bucket] = []
        if p_level != Level.N:
            owned: Dict[int, Tuple[torch.nn.Module, List[Bucket]]] = {}
            for b in self.buckets:
                for mod in b.owners:
                    owned.setdefault(id(mod), (mod, []))[1].append(b)
            for mod, bs in owned.values():
                self._hook_handles.append(mod.register_forward_pre_hook(self._make_pre_hook(bs)))
                self._hook_handles.append(mod.register_forward_hook(self._make_post_hook(mod, bs)))

    # ------------------------------------------------------------------ layout
    def level_ranks(self, level: Level) -> int:
        """Ranks sharing one element's state at ``level`` (1, m or n)."""
        return {Level.N: 1, Level.I: self.m, Level.G: self.n}[level]

    def _local_range(self, b: Bucket, level: Level) -> Tuple[int, int]:
        """[start, end) of this rank's shard at ``level`` inside bucket ``b`` (local-major:
        I-shard l, and within it G sub-chunk k)."""
        if level == Level.N:
            return 0, b.size
        i_start = self.local * (b.size // self.m)
        if level == Level.I:
            return i_start, i_start + b.size // self.m
        g_start = i_start + self.group_index * (b.size // self.n)
        return g_start, g_start + b.size // self.n

    def level_indices(self, level: Level) -> torch.Tensor:
        """Flat-buffer indices of this rank's shard at ``level``, in shard order (the buckets'
        shards one after another).

        int64, 8 bytes per shard element on the host: for tests and debugging only. The engine
        keeps no index tensors (contiguous ranges per bucket, :meth:`_local_range`, say the
        same), so its host memory does not grow with the model."""
        parts = []
        for b in self.buckets:
            a, e = self._local_range(b, level)
            parts.append(torch.arange(b.start + a, b.start + e))
        return torch.cat(parts)

    def _pieces(self, coarse: Level, fine: Level) -> Iterator[Tuple[int, int, int]]:
        """Per bucket: (offset in the coarse-level shard, offset in the fine-level shard, length)
        of the fine shard, fine at least as partitioned as coarse."""
        kc, kf = self.level_ranks(coarse), self.level_ranks(fine)
        for b in self.buckets:
            ca, _ = self._local_range(b, coarse)
            fa, fe = self._local_range(b, fine)
            yield b.shard_offset(kc) + fa - ca, b.shard_offset(kf), fe - fa

    @staticmethod
    def _decays(name: str, shape: torch.Size) -> bool:
        """megatron-core's default parameter groups: no weight decay for biases and 1-D
        parameters (norm weights)."""
        return not (len(shape) == 1 or name.endswith(".bias"))

    def weight_decay_mask(self, level: Level = Level.N,
                          device: Optional[torch.device] = None) -> torch.Tensor:
        """Per element of this rank's shard at ``level``, in shard order (level N: the whole flat
        buffer): True where weight decay applies (megatron-core's default parameter groups, see
        :meth:`_decays`); padding is excluded too.

        Built at the shard's size directly on ``device`` (default: CPU), one slice fill per
        decayed parameter piece inside the shard. Why: the optimizer used to take
        ``weight_decay_mask()[level_indices(level)]`` on the host -- a model-sized bool mask, int64
        indices (per-bucket aranges and their concatenation, alive together) and the indexed
        copy: 18 bytes per model element at os = N at the peak (~126 GB per rank for 7B).
        Now the only allocation is the 1-byte-per-shard-element mask itself, where it is used.
        """
        k = self.level_ranks(level)
        mask = torch.zeros(self.padded_numel // k, dtype=torch.bool, device=device)
        for b in self.buckets:
            a, e = self._local_range(b, level)
            base = b.shard_offset(k) - a  # bucket offset x -> shard index base + x
            for i in b.params:
                slot = self.slots[i]
                if not self._decays(slot.name, slot.shape):
                    continue
                lo = max(slot.offset - b.start, a)
                hi = min(slot.offset - b.start + slot.numel, e)
                if lo < hi:
                    mask[base + lo:base + hi] = True
        return mask

    # ------------------------------------------------------------------ parameters
    @torch.no_grad()
    def _gather_bucket(self, b: Bucket) -> None:
        """Rebuild bucket ``b``'s full parameters from the shards (collective; p = I / G), or
        wait for the gather a hook started ahead (:meth:`_prefetch`)."""
        if b.gathered:
            return
        handle = self._gathering.pop(b.index, None)
        if handle is None:
            handle = self._start_gather(b)
        if handle is not None:
            handle.wait()
        b.gathered = True
        self._track_peak()

    def _start_gather(self, b: Bucket) -> Any:
        """Allocate bucket ``b``'s full storage and gather it: inline on ``groups`` (returns
        None), or on the ``weights`` stage over ``param_groups`` (returns the job; counted here,
        in the hook's thread, as the inline path counts)."""
        storage = b.full.untyped_storage()
        need = b.size * b.full.element_size()
        if storage.nbytes() != need:
            storage.resize_(need)
        p = self.strategy.params
        shard = b.shard(self.param_shard, self.level_ranks(p))
        scope = "intra" if p == Level.I else "global"
        self._count_exact_gather(b.full, scope)
        if self.param_groups is None:
            self._exact_gather(b.full, shard, scope)
            return None
        if self._param_stages is None:
            self._param_stages = CommStreams.for_device(b.full.device)
        full, groups = b.full, self.param_groups
        # The full buffer was allocated here, on the caller's stream; the stage waits on that
        # stream before it writes, and the buffer is freed only after the wait (_release_bucket).
        return self._param_stages.submit(
            "weights", lambda: self._exact_gather(full, shard, scope, groups))

    def _prefetch(self, index: int) -> None:
        """Start the gather of bucket ``index`` ahead of its use (``param_groups`` only): not
        past the ends, not one gathered or in flight, not one whose backward is over, and at
        most :data:`PARAM_GATHERS_AHEAD` in flight. The order is the buckets' (module order),
        the same on every rank."""
        if self.param_groups is None or not 0 <= index < len(self.buckets):
            return
        b = self.buckets[index]
        if b.gathered or b.index in self._gathering or (self._in_backward and b.reduced):
            return
        if len(self._gathering) >= PARAM_GATHERS_AHEAD:
            return
        self._gathering[b.index] = self._start_gather(b)
        self._track_peak()

    def _release_bucket(self, b: Bucket) -> None:
        """Free bucket ``b``'s full parameter storage (p = I / G); the views stay valid. A gather
        still in flight into it is waited for first (its stage writes the storage)."""
        handle = self._gathering.pop(b.index, None)
        if handle is not None:
            handle.wait()
            b.gathered = True
        if self.strategy.params == Level.N or not b.gathered:
            return
        b.full.untyped_storage().resize_(0)
        b.gathered = False

    def gather_params(self) -> None:
        """Gather every bucket (collective; no-op for p = N)."""
        for b in self.buckets:
            self._gather_bucket(b)

    def release_params(self) -> None:
        """Release every bucket (p = I / G)."""
        for b in self.buckets:
            self._release_bucket(b)

    def _release_deferred(self, keep: Sequence[Bucket] = ()) -> None:
        still = []
        for b in self._deferred:
            if any(b is k for k in keep):
                still.append(b)
            else:
                self._release_bucket(b)
        self._deferred = still

    def _make_pre_hook(self, buckets: List[Bucket]):
        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            self._release_deferred(keep=buckets)
            for b in buckets:
                self._gather_bucket(b)
            self._prefetch(max(b.index for b in buckets) + 1)   # travels while this computes
        return pre_hook

    def _make_post_hook(self, module: torch.nn.Module, buckets: List[Bucket]):
        def post_hook(mod: torch.nn.Module, args: Any, output: Any) -> None:
            outs = list(output_tensors(output))
            if torch.is_grad_enabled():  # regather right before this module's backward
                tensors = [t for t in outs if t.requires_grad and t.grad_fn is not None]
                if not tensors:  # no handle on its backward: keep its buckets until then
                    return
                hook = self._make_output_grad_hook(buckets)
                for t in tensors:
                    t.register_hook(hook)
            if self._in_backward:  # re-run forward (activation recomputation) inside backward
                return
            # A parameter returned for the caller to apply (megatron's skip_bias_add: linear_proj /
            # linear_fc2 return their bias): release at the next owner's forward instead.
            returned = {t.untyped_storage().data_ptr() for t in outs}
            for b in buckets:
                if b.owners[-1] is module:
                    if b.full.untyped_storage().data_ptr() in returned:
                        self._deferred.append(b)
                    else:
                        self._release_bucket(b)
        return post_hook

    def _make_output_grad_hook(self, buckets: List[Bucket]):
        def hook(grad: torch.Tensor) -> None:
            self._begin_backward()
            for b in buckets:
                if not b.reduced:
                    self._gather_bucket(b)
            self._prefetch(min(b.index for b in buckets) - 1)   # the next backward's bucket
        return hook

    @contextlib.contextmanager
    def full_params(self, writeback: bool = False) -> Iterator[None]:
        """Full parameters inside the block (collective); with ``writeback`` the block's changes
        (e.g. ``load_state_dict``) are copied back into this rank's shard before releasing."""
        self.gather_params()
        try:
            yield
        finally:
            if writeback and self.param_shard is not None:
                p = self.strategy.params
                k = self.level_ranks(p)
                for b in self.buckets:
                    a, e = self._local_range(b, p)
                    b.shard(self.param_shard, k).copy_(b.full[a:e])
            self.release_params()

    def _param_keys(self, sd: Dict[str, Any]) -> Dict[int, List[str]]:
        """Parameter index -> its keys in ``sd``, a ``state_dict(keep_vars=True)`` of the module
        (the parameter objects themselves: their data is not read while released; several keys
        for tied weights)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        keys_of: Dict[int, List[str]] = {}
        for key, value in sd.items():
            if torch.is_tensor(value) and id(value) in index:
                keys_of.setdefault(index[id(value)], []).append(key)
        return keys_of

    @torch.no_grad()
    def host_state_dict(self, keep: bool = True) -> Optional[Dict[str, Any]]:
        """``self.module.state_dict()`` with every tensor copied to the CPU, for a checkpoint;
        collective for p = I / G (every rank of the DP group calls it; ``keep=False`` on ranks
        that do not store the weights: they take part in the gathers and return None).

        Same keys, order, dtypes, shapes and values as the old save path (``state_dict()`` inside
        :meth:`full_params`, then ``.detach().clone()`` of every tensor), but the buckets are
        gathered one at a time, copied to the host and released. Why: the old path held every
        bucket's full parameters *and* a device clone of them at once -- twice the model's
        parameters on the GPU on top of the shards, at a moment the caching allocator's
        activation blocks may still be reserved. Now the device holds at most one gathered bucket
        above the persistent state (none for p = N) and nothing is cloned on it.
        """
        sd = self.module.state_dict(keep_vars=True)
        keys_of = self._param_keys(sd)
        params = {key for keys in keys_of.values() for key in keys}
        out: Dict[str, Any] = {}
        for key, value in sd.items():
            if key in params:
                out[key] = None  # filled bucket by bucket below; keeps the key order
            elif keep:
                out[key] = value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
        for b in self.buckets:
            wanted = [i for i in b.params if i in keys_of]
            if not wanted:
                continue
            was_gathered = b.gathered
            self._gather_bucket(b)
            if keep:
                for i in wanted:
                    for key in keys_of[i]:
                        out[key] = self.params[i].detach().to("cpu", copy=True)
            if not was_gathered:
                self._release_bucket(b)
        return out if keep else None

    @torch.no_grad()
    def load_host_state_dict(self, sd: Dict[str, Any]) -> None:
        """``self.module.load_state_dict(sd, strict=True)`` for a full (host) state dict, written
        straight into this rank's parameter shard: no gather, no collective.

        Same result as the old load path (``load_state_dict`` inside ``full_params(writeback=
        True)``: the shard's slice of every parameter, tied weights taking their last key's
        value, padding untouched), but the old path gathered every bucket at once -- the whole
        model's parameters on the device on top of the shards, at least what a p = I / G
        strategy was chosen to avoid. Now each parameter's piece inside the shard is copied from
        the host tensor and nothing model-sized is allocated."""
        if self.param_shard is None:           # p = N: the parameters are always full
            self.module.load_state_dict(sd, strict=True)
            return
        current = self.module.state_dict(keep_vars=True)
        missing = [k for k in current if k not in sd]
        unexpected = [k for k in sd if k not in current]
        if missing or unexpected:
            raise RuntimeError(f"Error(s) in loading state_dict for "
                               f"{type(self.module).__name__}: missing keys {missing}, "
                               f"unexpected keys {unexpected}")
        keys_of = self._param_keys(current)
        params = {key for keys in keys_of.values() for key in keys}
        others = {key: sd[key] for key in current if key not in params}
        for i, keys in keys_of.items():
            for key in keys:
                if tuple(sd[key].shape) != tuple(self.slots[i].shape):
                    raise RuntimeError(
                        f"size mismatch for {key}: copying a param with shape "
                        f"{tuple(sd[key].shape)} from checkpoint, the shape in current model is "
                        f"{tuple(self.slots[i].shape)}")
        self.module.load_state_dict(others, strict=False)   # buffers, extra state
        p = self.strategy.params
        k = self.level_ranks(p)
        for b in self.buckets:
            a, e = self._local_range(b, p)
            shard = b.shard(self.param_shard, k)
            for i in b.params:
                slot = self.slots[i]
                lo = max(slot.offset - b.start, a)           # bucket-local, inside the shard
                hi = min(slot.offset - b.start + slot.numel, e)
                if lo >= hi or i not in keys_of:
                    continue
                first = lo - (slot.offset - b.start)         # element of the parameter
                for key in keys_of[i]:                       # tied: the last key wins
                    shard[lo - a:hi - a].copy_(sd[key].reshape(-1)[first:first + hi - lo])
            if b.gathered:                  # stale now: the next use gathers the new values
                self._release_bucket(b)

    def param_level_storage(self) -> torch.Tensor:
        """The persistent parameter tensor at the p level (full buffer for N, else the shard)."""
        return self.param_buffer if self.param_shard is None else self.param_shard

    def params_at_level(self, level: Level) -> torch.Tensor:
        """This rank's parameters at ``level`` >= p, in shard order (a copy, no communication)."""
        src = self.param_level_storage()
        out = torch.empty(self.padded_numel // self.level_ranks(level), dtype=src.dtype,
                          device=src.device)
        for c, f, length in self._pieces(self.strategy.params, level):
            out[f:f + length].copy_(src[c:c + length])
        return out

    @torch.no_grad()
    def sync_params(self, os_params: torch.Tensor) -> None:
        """After the optimizer step: spread the updated os-level shard to the p level (spec §3,
        phase 4 -- copy, inter AG, intra AG or global AG), bucket by bucket."""
        o, p = self.strategy.optim, self.strategy.params
        if o != p and self.quant_runtime is not None and self.quant_runtime.quantize_weights:
            # qWD (or qW): each bucket's updated shard quantized once against the last synced
            # weights (``target``, identical on every rank) and its codes forwarded hop by hop
            # (inter, then intra for a global gather: the local-major layout).
            rt = self.quant_runtime
            hops = {(Level.G, Level.I): ["inter"], (Level.G, Level.N): ["inter", "intra"],
                    (Level.I, Level.N): ["intra"]}[(o, p)]
            ko, kp = self.level_ranks(o), self.level_ranks(p)
            target_all = self.param_level_storage()
            for b in self.buckets:
                src = b.shard(os_params, ko)
                target = b.shard(target_all, kp)
                before = rt.accounting.link_bytes("weight")
                handle = rt.all_gather(src, target, key=self._bucket_key(b), index=b.index,
                                       reference=target, hops=hops, streams=rt.timing.inline)
                if handle is not None:   # ran inline: timed as exposed, its error raised here
                    rt.timing.wait("weight", handle)
                self._count_quantized("weight", "+".join(hops), "quantized_all_gather",
                                      target.numel(), ko // kp, before)
            return
        src = os_params.to(self.param_dtype)
        if o == p:
            self.param_level_storage().copy_(src)
        elif (o, p) in ((Level.G, Level.I), (Level.G, Level.N), (Level.I, Level.N)):
            self._gather_to(self.param_level_storage(), src, o, p)
        else:  # pragma: no cover - excluded by the validity rule
            raise AssertionError(f"os level {o.name} coarser than p level {p.name}")

    # ------------------------------------------------------------------ forward / backward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The buckets are gathered and released by the owner modules' forward hooks; the hook on
        the model output marks the start of this chunk's backward."""
        out = self.module(*args, **kwargs)
        self._release_deferred()
        if torch.is_grad_enabled():
            self._pre_backward_done = False
            for t in output_tensors(out):
                if t.requires_grad:
                    t.register_hook(self._pre_backward_hook)
        return out

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        """Gradient of the model output arrived: the backward of this chunk starts now."""
        if not self._pre_backward_done:
            self._pre_backward_done = True
            self._begin_backward()

    def _begin_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        for b in self.buckets:
            b.pending, b.reduced = len(b.params), False
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _make_grad_hook(self, index: int):
        slot = self.slots[index]
        b = self.buckets[self._bucket_of[index]]

        def hook(param: torch.Tensor) -> None:
            if param.grad is None:
                return
            self._begin_backward()
            if self.grad_buffer is not None:
                self.grad_buffer[slot.offset:slot.offset + slot.numel].view(slot.shape).add_(
                    param.grad)
            else:
                if b.tmp_grad is None:  # g = I / G: this bucket's full gradient, this backward
                    b.tmp_grad = torch.zeros(b.size, dtype=self.grad_dtype, device=param.device)
                    self._track_peak()
                o = slot.offset - b.start
                b.tmp_grad[o:o + slot.numel].view(slot.shape).add_(param.grad)
            param.grad = None
            b.pending -= 1
            if b.pending == 0:  # the bucket's backward is over
                self._finish_bucket(b)

        return hook

    @torch.no_grad()
    def _finish_bucket(self, b: Bucket) -> None:
        """All of ``b``'s gradients of this micro-step are in: reduce-scatter them (g = I / G)
        into the shard accumulator, free the temporary and release the parameters (p = I / G).
        With ``grad_groups`` the reduce-scatter is only started here
        (:meth:`_start_grad_reduce`)."""
        if b.reduced:
            return
        b.reduced = True
        if self.grad_shard is not None:
            full = b.tmp_grad
            if full is None:  # no gradient arrived (unused parameters): contribute zeros
                full = torch.zeros(b.size, dtype=self.grad_dtype, device=self.grad_shard.device)
            b.tmp_grad = None
            k = self.level_ranks(self.strategy.grads)
            acc = b.shard(self.grad_shard, k)
            if self.grad_groups is not None:
                self._start_grad_reduce(b, full, acc)
            else:
                if self.strategy.grads == Level.I:
                    shard = torch.empty_like(acc)
                    self._rs(shard, full, "intra", b)
                else:
                    shard = self._global_rs(full, b)
                del full
                acc.add_(shard)
        self._release_bucket(b)

    def _start_grad_reduce(self, b: Bucket, full: torch.Tensor, acc: torch.Tensor) -> None:
        """Start bucket ``b``'s gradient reduce-scatter on the stages (``grad_groups``); the sum
        lands in ``acc`` when :meth:`_finish_grad_reduces` waits for it. Counted here, in the
        hook's thread, as the inline path counts it."""
        if self._grad_stages is None:   # the runtime's, when it has one: its timing sees them
            self._grad_stages = (self.quant_runtime.overlap_streams(full.device)
                                 if self.quant_runtime is not None
                                 else CommStreams.for_device(full.device))
        shard = torch.empty_like(acc)
        scope = "intra" if self.strategy.grads == Level.I else "global"
        if self._quantize_gradients_now():
            handle, keep = self._quantized_rs(shard, full, scope, b, streams=self._grad_stages)
        else:
            self._count_exact_reduce(full, scope)   # here, in the hook's thread, as _rs counts

            def reduce() -> None:
                used_on_this_stage(full)
                self._exact_reduce(shard, full, scope, self.grad_groups)
            handle = self._grad_stages.submit("intra", reduce)
            keep = full
        self._pending.append((handle, shard, acc, keep))
        self._track_peak()   # the reduced shard and the kept input count while in flight
        while len(self._pending) > GRAD_REDUCES_IN_FLIGHT:
            self._finish_oldest_grad_reduce()

    def _finish_oldest_grad_reduce(self) -> None:
        handle, shard, acc, _ = self._pending.pop(0)
        if handle is not None:
            if self.quant_runtime is not None:   # the wait is the runtime's exposed time
                self.quant_runtime.timing.wait("grad", handle)
            else:
                handle.wait()
        acc.add_(shard)

    def _finish_grad_reduces(self) -> None:
        """Wait for every gradient reduce-scatter in flight and add it to its accumulator."""
        while self._pending:
            self._finish_oldest_grad_reduce()

    @torch.no_grad()
    def _end_backward(self) -> None:
        """End of one micro-step's backward (safety net): every bucket not finished yet is reduced
        and released, in bucket order, so every rank issues the same collectives."""
        for b in self.buckets:
            self._finish_bucket(b)
        self._finish_grad_reduces()
        self.release_params()
        self._in_backward = False

    def start_grad_sync(self, *unused: Any) -> None:
        """megatron-core's ``grad_sync_func`` (set with ``--overlap-grad-reduce``): nothing to
        start, the hooks start each bucket's reduce-scatter as soon as its gradients are in."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """megatron-core's schedule wraps all but the last micro-batch in this; the engine's
        per-micro-step reductions are part of the strategy, so there is nothing to defer."""
        return contextlib.nullcontext()

    def zero_grad_buffer(self) -> None:
        """Start of a global step: clear the gradient accumulators."""
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
        else:
            self.grad_shard.zero_()
        self.main_grad = None

    @torch.no_grad()
    def finalize_model_grads(self, model: Sequence[torch.nn.Module] = (), num_tokens: Any = None,
                             pg_collection: Any = None, force_all_reduce: bool = False) -> None:
        """Gradient sync at the accumulation boundary, g level -> os level (spec §3 phase 3),
        then the DP average (sum / n, as megatron-core's DDP with per-sample losses)."""
        if num_tokens is not None:
            raise NotImplementedError("the PaRO engine does not support calculate_per_token_loss")
        g, o = self.strategy.grads, self.strategy.optim
        src = self.grad_buffer if self.grad_buffer is not None else self.grad_shard
        if (g, o) == (Level.N, Level.N):
            out = src.clone()
            hierarchical_all_reduce(out, self.intra_group, self.inter_group, counter=self.counter)
        elif (g, o) == (Level.N, Level.I):
            out = self._reduce_to(src, Level.N, Level.I)
            self._ar(out, "inter")
        elif (g, o) == (Level.N, Level.G):
            out = self._reduce_to(src, Level.N, Level.G)
        elif (g, o) == (Level.I, Level.I):
            out = src.clone()
            self._ar(out, "inter")
        elif (g, o) == (Level.I, Level.G):
            out = self._reduce_to(src, Level.I, Level.G)
        else:  # G -> G: already reduced every micro-step
            out = src.clone()
        out = out.float()
        out.mul_(1.0 / self.n)
        self.main_grad = out

    # ------------------------------------------------------------------ accounting
    def _track_peak(self) -> None:
        b = self.model_state_bytes()
        self.peak_bytes = max(self.peak_bytes, b["params"] + b["grads"])

    def model_state_bytes(self) -> Dict[str, int]:
        """Bytes of the parameter and gradient tensors resident right now (storage sizes)."""
        params = 0
        for t in (self.param_buffer, self.param_shard):
            if t is not None:
                params += t.untyped_storage().nbytes()
        if self.param_buffer is None:  # p = I / G: the gathered buckets
            params += sum(b.full.untyped_storage().nbytes() for b in self.buckets)
        grads = 0
        in_flight = [t for _, shard, _, kept in self._pending for t in (shard, kept)]
        temporaries = [b.tmp_grad for b in self.buckets] + in_flight
        for t in [self.grad_buffer, self.grad_shard] + temporaries:
            if t is not None:
                grads += t.untyped_storage().nbytes()
        return {"params": params, "grads": grads}

    def bucket_bytes(self) -> List[Dict[str, int]]:
        """Per bucket: elements (padded), owner modules, and the parameter / gradient bytes it adds
        above the persistent figure while it is in use (full parameters for p = I / G, a full
        temporary gradient for g = I / G)."""
        pe = torch.empty(0, dtype=self.param_dtype).element_size()
        ge = torch.empty(0, dtype=self.grad_dtype).element_size()
        return [{"size": b.size, "owners": len(b.owners),
                 "params": b.size * pe * (self.strategy.params != Level.N),
                 "grads": b.size * ge * (self.strategy.grads != Level.N)} for b in self.buckets]
