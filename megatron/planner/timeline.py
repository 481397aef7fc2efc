"""One variant's iteration on the cluster, bucket by bucket: how long it takes and what is exposed.

Why a per-bucket timeline and not bytes / bandwidth: whether SDP4Bit pays off depends on how
much of the communication hides behind the backward and forward passes, which depends on the
bucket sizes, the order the backward pass fills them, and where the quantization kernels run.
The model follows the run: compute (with TP all-reduces and the 1F1B bubble), each bucket's
gradient reduce-scatter, the optimizer step, each bucket's weight gather, and the slowdown of
compute and collectives running at once (:func:`two_lanes`). See docs/planner.md ("The model").

Bytes per link come from :class:`~megatron.distributed.quant.accounting.CommAccounting`, recorded
through the same calls the collectives make.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron.distributed.quant.accounting import CommAccounting
from megatron.distributed.quant.config import QuantizationConfig
from megatron.distributed.quant.kernels.reference import QuantizedTensor
from megatron.distributed.quant.memory import layer_memory
from .calibration import Contention, DeviceRates
from .cluster import all_reduce_time, all_to_all_time, p2p_time, ring_time
from .workload import DPGroup, Workload, moe_layer_pattern

__all__ = ["BucketCost", "Prediction", "predict", "two_lanes", "OPTIMIZER_BYTES_PER_ELEMENT",
           "LOCO_BYTES_PER_ELEMENT"]

OPTIMIZER_BYTES_PER_ELEMENT = 30
"""Adam over fp32 main parameters: read + write parameter (8), moments (16), read the gradient
(4), write the bf16 model copy (2)."""
LOCO_BYTES_PER_ELEMENT = 24
"""LoCo's elementwise passes per element of a quantized hop (collectives.gradients, quantize_first):
compensate (read gradient and error, write h), dequantize the codes in input order, subtract,
update the stored error; memory-bound at the copy bandwidth."""


@dataclass(frozen=True)
class BucketCost:
    """One collective of one bucket: total seconds, and the part that is kernels."""

    seconds: float
    kernels: float = 0.0


@dataclass
class Prediction:
    """What the planner prints for one variant."""

    variant: str
    iteration_s: float
    """Seconds per iteration."""
    tflops_per_gpu: float
    """Model TFLOP/s per GPU at that speed (the trainer's --log-throughput count)."""
    compute_s: float
    """Forward + backward of every micro-batch, with TP all-reduces and the pipeline bubble."""
    grad_exposed_s: float
    """Gradient reduction the backward pass does not hide."""
    weight_exposed_s: float
    """Weight gathers the forward pass does not hide."""
    optimizer_s: float
    """The optimizer's update of the rank's shard."""
    contention_s: float
    """What overlapping compute and collectives cost each other (the measured slowdowns of
    :class:`~.calibration.Contention`), part of the exposed times."""
    grad_total_s: float
    """Every bucket's gradient reduction, hidden or not."""
    weight_total_s: float
    """Every bucket's weight gather, hidden or not."""
    bytes_per_link: Dict[str, float]
    """Bytes one rank sends per iteration, 'intra' and 'inter' (gradients + weights) for its dense
    buffers over the data-parallel group, 'expert_intra' and 'expert_inter' for its expert
    buffers over the expert-data-parallel group (0 for a dense model or EP 1)."""
    memory_bytes: float
    """Model states + the quantized layer's buffers + activations, one GPU."""
    notes: List[str] = field(default_factory=list)

    @property
    def exposed_s(self) -> float:
        return self.grad_exposed_s + self.weight_exposed_s


def _measured_or(measured: Optional[float], formula: Callable[[], float]) -> float:
    """A collective's time from the cluster's measurement where it has one, else the formula."""
    return formula() if measured is None else measured


def _wire(numel: float, bits: int, group_size: int) -> float:
    return QuantizedTensor.wire_bytes(int(numel), bits, group_size)


def grad_bucket_cost(n: int, w: Workload, cfg: QuantizationConfig, rates: DeviceRates,
                     group: Optional[DPGroup] = None) -> BucketCost:
    """One bucket's gradient reduce-scatter (module docstring) over ``group`` (default the dense
    data-parallel group; an MoE run's expert buffers: ``w.expert_group``)."""
    cl = w.cluster
    g = group or w.dense_group
    p, d, m = g.size, g.per_node, g.nodes
    groups_per_node = max(1, cl.gpus_per_node // d)
    in_bytes = w.grad_bytes(cfg.grad_accum_dtype)
    if p == 1:
        return BucketCost(0.0)
    if not cfg.quantized_gradients:
        return BucketCost(_measured_or(cl.measured_time("reduce_scatter", n * in_bytes, p, d),
                                       lambda: ring_time(n * in_bytes, p, m, groups_per_node, cl)))
    two_level = d > 1 and m > 1
    bits1, gs1 = ((cfg.gradient_quantization_bits_intra, cfg.gq_group_size_intra) if d > 1
                  else (cfg.gradient_quantization_bits_inter, cfg.gq_group_size_inter))
    first = rates.kernel("quantize_partitions_ht" if cfg.hadamard_transform else "quantize")
    hop1 = first.seconds(n * in_bytes + _wire(n, bits1, gs1))
    loco = 0.0
    if cfg.loco:
        loco = (n + (n // d if two_level else 0)) * LOCO_BYTES_PER_ELEMENT / rates.copy_bandwidth
    k = max(1, int(cfg.gradient_alltoall_pipeline))
    c = n / k   # one chunk
    q1 = _wire(c, bits1, gs1)
    if d > 1:
        a = _measured_or(cl.measured_time("all_to_all_intra", q1, d, d),
                         lambda: all_to_all_time((d - 1) / d * q1, cl.intra))
    else:
        a = _measured_or(cl.measured_time("all_to_all_inter", q1, m, 1),
                         lambda: all_to_all_time((m - 1) / m * q1, cl.inter, cl.gpus_per_node))
    if two_level:
        q2 = _wire(c / d, cfg.gradient_quantization_bits_inter, cfg.gq_group_size_inter)
        mid = rates.kernel("dequantize_sum_requantize").seconds(q1 + q2)
        inter = _measured_or(cl.measured_time("all_to_all_inter", q2, m, 1),
                             lambda: all_to_all_time((m - 1) / m * q2, cl.inter, cl.gpus_per_node))
        fin = rates.kernel("dequantize_sum").seconds(q2 + 4 * c / p)
        b = mid + inter + fin
        chunk_kernels = mid + fin
    else:
        fin = rates.kernel("dequantize_sum").seconds(q1 + 4 * c / p)
        b, chunk_kernels = fin, fin
    pipelined = a + b + (k - 1) * max(a, b)
    return BucketCost(hop1 + loco + pipelined, hop1 + loco + k * chunk_kernels)


def weight_bucket_cost(n: int, w: Workload, cfg: QuantizationConfig, rates: DeviceRates,
                       group: Optional[DPGroup] = None) -> BucketCost:
    """One bucket's parameter all-gather after the step, over ``group`` (as
    :func:`grad_bucket_cost`)."""
    cl = w.cluster
    g = group or w.dense_group
    p, d, m = g.size, g.per_node, g.nodes
    groups_per_node = max(1, cl.gpus_per_node // d)
    if p == 1:
        return BucketCost(0.0)
    if not cfg.quantized_weights:
        return BucketCost(_measured_or(cl.measured_time("all_gather", n * 2, p, d),
                                       lambda: ring_time(n * 2, p, m, groups_per_node, cl)))
    shard = n / p
    bits, gs = cfg.weight_quantization_bits, cfg.wq_group_size
    if cfg.weight_quantization_mode == "diff":
        send = rates.kernel("quantize_difference").seconds(6 * shard + _wire(shard, bits, gs))
        recv = rates.kernel("dequantize_add").seconds(_wire(n, bits, gs) + 4 * n)
    else:
        send = rates.kernel("quantize").seconds(4 * shard + _wire(shard, bits, gs))
        recv = rates.kernel("dequantize").seconds(_wire(n, bits, gs) + 4 * n)
    gathered = p * _wire(shard, bits, gs)
    gather = _measured_or(cl.measured_time("all_gather", gathered, p, d),
                          lambda: ring_time(gathered, p, m, groups_per_node, cl))
    return BucketCost(send + gather + recv, send + recv)


def padded_buckets(w: Workload, cfg: QuantizationConfig, expert: bool = False) -> Tuple[int, ...]:
    """The buckets as the quantized layer pads them (whole quantization groups per shard): the
    dense buffers', or with ``expert`` the expert buffers' over their own group."""
    buckets, g = (w.expert_buckets, w.expert_group) if expert else (w.buckets, w.dense_group)
    if not cfg.enabled or g.size == 1:
        return buckets
    from megatron.distributed.quant.collectives.common import required_padding_multiple_from_config

    mult = required_padding_multiple_from_config(cfg, g.size, g.per_node)
    return tuple(-(-n // mult) * mult for n in buckets)


def _record_bytes(w: Workload, cfg: QuantizationConfig, buckets: Sequence[int],
                  group: Optional[DPGroup] = None) -> Dict[str, float]:
    """Per-rank bytes on each link per iteration (``buckets`` padded as the layer pads them) over
    ``group`` (default the dense one), through the collectives' own accounting calls."""
    acc = CommAccounting()
    g = group or w.dense_group
    p, d = g.size, g.per_node
    if p > 1:
        in_bytes = w.grad_bytes(cfg.grad_accum_dtype)
        for i, n in enumerate(buckets):
            if cfg.quantized_gradients:
                acc.record_two_level_reduce_scatter(
                    f"g{i}", numel=n - n % p, elem_size=in_bytes, dp_size=p, intra_size=d,
                    intra=cfg.gradient_intra_hop, inter=cfg.gradient_inter_hop)
            else:
                acc.record_baseline(f"g{i}", kind="grad", numel=n - n % p, elem_size=in_bytes,
                                    dp_size=p, peers_intra=d - 1, peers_inter=p - d)
            shard = n // p
            if cfg.quantized_weights:
                shard -= shard % cfg.wq_group_size
                acc.record_quantized_all_gather(f"w{i}", shard_numel=shard, elem_size=2,
                                                spec=cfg.weight_hop, hops=[(d - 1, p - d)])
            else:
                acc.record_baseline(f"w{i}", kind="weight", numel=shard * p, elem_size=2,
                                    dp_size=p, peers_intra=d - 1, peers_inter=p - d)
    report = acc.totals()
    out = {"intra": 0.0, "inter": 0.0}
    for kind, quantized in (("grad", cfg.quantized_gradients), ("weight", cfg.quantized_weights)):
        for link in out:
            entry = report[kind][link]
            out[link] += entry["bytes"] if quantized else entry["baseline_bytes"]
    return out


def _memory(w: Workload, cfg: QuantizationConfig, buckets: Sequence[int],
            expert_buckets: Sequence[int] = ()) -> float:
    from megatron.distributed.quant.paro.cost import activation_memory

    a = w.args
    rp = w.rank_parameters
    # fp32 main parameters and Adam moments (12 bytes) sharded over each buffer's own group
    states = (rp * (2 + w.grad_bytes(cfg.grad_accum_dtype)) + 12 * w.rank_dense_parameters / w.dp
              + 12 * w.rank_expert_parameters / w.expert_dp)
    layer = transient = 0.0
    if cfg.enabled and w.dp > 1:
        dense = layer_memory(cfg, list(buckets), w.dp, w.dp_per_node)
        layer, transient = dense.persistent_bytes, dense.transient_bytes
        if expert_buckets and w.expert_dp > 1:
            ex = layer_memory(cfg, list(expert_buckets), w.expert_dp, w.expert_dp_per_node)
            layer += ex.persistent_bytes
            transient = max(transient, ex.transient_bytes)   # one reduction's scratch at a time
    layer += transient
    recompute = getattr(a, "recompute_granularity", None)
    ffn = a.ffn_hidden_size
    if w.moe:   # a token's MLP activations: its top-k experts' and the shared expert's
        width = a.moe_ffn_hidden_size or ffn or 4 * a.hidden_size
        ffn = (min(a.moe_router_topk or 2, a.num_experts) * width
               + (getattr(a, "moe_shared_expert_intermediate_size", None) or 0))
    act = activation_memory(seq_length=a.seq_length, micro_batch_size=a.micro_batch_size,
                            hidden_size=a.hidden_size, num_layers=max(1, a.num_layers // w.pp),
                            num_attention_heads=a.num_attention_heads,
                            vocab_size=a.padded_vocab_size, ffn_hidden_size=ffn,
                            gated_mlp=bool(getattr(a, "swiglu", False)), attention_scores=False,
                            recompute=recompute) / w.tp
    in_flight = min(w.pp, w.micro_batches)   # 1F1B keeps pp micro-batches on the first stage
    return states + layer + act * in_flight


def two_lanes(compute: Sequence[float], jobs: Sequence[float], job_after: Sequence[int],
              compute_after: Sequence[int], contention: Contention = Contention()
              ) -> Tuple[float, float]:
    """(end of the compute, end of the jobs) of two lanes that run at once: the compute's pieces
    in order, piece i not before job ``compute_after[i]`` has finished; the collectives' jobs in
    order (one at a time, as the communication stage runs them), job j not before compute piece
    ``job_after[j]`` has finished (-1: no such wait). While both lanes are busy each runs at its
    measured slowdown (:class:`~.calibration.Contention`); alone, at full speed. Durations are
    each one's seconds alone."""
    left_c = list(compute)
    left_j = list(jobs)
    t = end_c = end_j = 0.0
    i = j = 0   # each lane finishes in order: pieces before i and jobs before j are done

    while i < len(compute) or j < len(jobs):
        run_c = i < len(compute) and compute_after[i] < j
        run_j = j < len(jobs) and job_after[j] < i
        if not (run_c or run_j):
            raise ValueError("two_lanes: each lane waits for the other (a cycle in the waits)")
        slow_c = contention.compute if run_j else 1.0
        slow_j = contention.communication if run_c else 1.0
        dt_c = left_c[i] * slow_c if run_c else math.inf
        dt_j = left_j[j] * slow_j if run_j else math.inf
        step = min(dt_c, dt_j)
        t += step
        if run_c:
            left_c[i] -= step / slow_c
            if dt_c <= step:
                end_c, i = t, i + 1
        if run_j:
            left_j[j] -= step / slow_j
            if dt_j <= step:
                end_j, j = t, j + 1
    return end_c, end_j


def _micro_batch_seconds(w: Workload, rates: DeviceRates) -> float:
    """One micro-batch's forward + backward on a rank at the measured rate nearest this model."""
    return w.flops_per_rank / (rates.tflops_for(w.compute_parameters).tflops * 1e12) / w.micro_batches


def _ends(buckets: Sequence[int]) -> List[float]:
    """Where in the backward pass each bucket of one buffer is full: the fraction of the buffer's
    parameters filled by then (the pass spread over a buffer by parameter count)."""
    total = float(sum(buckets)) or 1.0
    out, acc = [], 0
    for n in buckets:
        acc += n
        out.append(acc / total)
    return out


def _ep_all_to_all_seconds(w: Workload) -> float:
    """One micro-batch's token dispatch and combine across the expert-parallel group, forward and
    backward (4 all-to-alls per MoE layer of the stage, bf16 hidden states of each token's top-k
    copies), not overlapped with compute: megatron-core's alltoall dispatcher waits for them."""
    a, cl = w.args, w.cluster
    if w.ep == 1:
        return 0.0
    moe_layers = sum(moe_layer_pattern(a)) / w.pp
    tokens = a.micro_batch_size * a.seq_length
    sent = tokens * min(a.moe_router_topk or 2, a.num_experts) * a.hidden_size * 2 * (w.ep - 1) / w.ep
    span = w.ep * w.tp
    if cl.nodes > 1 and span > cl.gpus_per_node:   # the EP group crosses nodes
        ep_nodes = span // cl.gpus_per_node
        one = all_to_all_time(sent * (ep_nodes - 1) / ep_nodes * w.ep / (w.ep - 1), cl.inter,
                              cl.gpus_per_node)
    else:
        one = all_to_all_time(sent, cl.intra)
    return 4 * moe_layers * one


def predict(variant: str, w: Workload, cfg: QuantizationConfig, rates: DeviceRates) -> Prediction:
    """The iteration of ``w`` with the collectives of ``cfg`` on ``rates`` (module docstring). An
    MoE run with EP > 1 has two kinds of buffers: the dense ones over the data-parallel group and
    the expert ones over the expert-data-parallel group, each with its own two levels; their
    buckets' collectives share one queue, in the order the backward fills them (the forward
    uses them)."""
    cl, a = w.cluster, w.args
    notes: List[str] = []
    mb = _micro_batch_seconds(w, rates)
    tp_comm = 0.0
    if w.tp > 1:
        act = a.micro_batch_size * a.seq_length * a.hidden_size * 2
        tp_comm = 4 * (a.num_layers / w.pp) * all_reduce_time(act, w.tp, 1, 1, cl)
    ep_comm = _ep_all_to_all_seconds(w)
    slot = mb + tp_comm + ep_comm
    compute = (w.micro_batches + w.pp - 1) * slot
    if w.pp > 1:
        act = a.micro_batch_size * a.seq_length * a.hidden_size * 2 / w.tp
        crosses = cl.nodes > 1 and w.tp * w.dp >= cl.gpus_per_node
        link = cl.inter if crosses else cl.intra
        compute += 2 * (w.micro_batches + w.pp - 1) * p2p_time(act, link, cl.gpus_per_node if crosses else 1)

    buckets = padded_buckets(w, cfg)
    expert_buckets = padded_buckets(w, cfg, expert=True)
    eg = w.expert_group
    grads = ([grad_bucket_cost(n, w, cfg, rates) for n in buckets]
             + [grad_bucket_cost(n, w, cfg, rates, eg) for n in expert_buckets])
    weights = ([weight_bucket_cost(n, w, cfg, rates) for n in buckets]
               + [weight_bucket_cost(n, w, cfg, rates, eg) for n in expert_buckets])
    # each bucket's end in the backward (fraction of it), both buffers spread over the layers
    ends = _ends(w.buckets) + _ends(w.expert_buckets)
    backward = 2 * slot / 3
    contention = 0.0
    if w.overlap_grad_reduce and w.dp > 1:
        # the last micro-batch's backward fills bucket j at its end; its reduction then starts
        order = sorted(range(len(grads)), key=lambda j: (ends[j], j))
        marks = [ends[j] for j in order]
        pieces = [(x - y) * backward for x, y in zip(marks, [0.0] + marks[:-1])]

        def grad_phase(slowdowns: Contention) -> float:
            return max(two_lanes(pieces, [grads[j].seconds for j in order], list(range(len(order))),
                                 [-1] * len(pieces), slowdowns))

        kind = "quantized" if cfg.quantized_gradients else "plain"
        grad_exposed = max(0.0, grad_phase(rates.contention_for(kind)) - backward)
        contention += grad_exposed - max(0.0, grad_phase(Contention()) - backward)
    else:
        grad_exposed = sum(c.seconds for c in grads)

    shard = w.rank_dense_parameters / w.dp + w.rank_expert_parameters / w.expert_dp
    optimizer = (shard * rates.optimizer_seconds_per_element if rates.optimizer_seconds_per_element
                 else shard * OPTIMIZER_BYTES_PER_ELEMENT / rates.copy_bandwidth)
    forward = slot / 3
    if w.overlap_param_gather and w.dp > 1:
        # forward meets the first layers first: bucket j's parameters from 1 - end_j on
        order = sorted(range(len(weights)), key=lambda j: (1 - ends[j], -j))
        marks = [1 - ends[j] for j in order] + [1.0]
        pieces = [(y - x) * forward for x, y in zip(marks[:-1], marks[1:])]
        # bucket k's forward waits for its gather; megatron-core's pre-hook dispatches gather k
        # when bucket k-1's forward starts (one ahead: after gather k-1 and forward k-2), the
        # trainer's --overlap-param-gather-with-optimizer-step all of them at the step's end
        all_after_step = bool(getattr(a, "overlap_param_gather_with_optimizer_step", False))
        job_after = [-1 if all_after_step else k - 2 for k in range(len(order))]

        def weight_phase(slowdowns: Contention) -> float:
            return max(two_lanes(pieces, [weights[j].seconds for j in order], job_after,
                                 list(range(len(order))), slowdowns))

        kind = "quantized" if cfg.quantized_weights else "plain"
        weight_exposed = max(0.0, weight_phase(rates.contention_for(kind)) - forward)
        contention += weight_exposed - max(0.0, weight_phase(Contention()) - forward)
    else:
        weight_exposed = sum(c.seconds for c in weights)

    total = compute + grad_exposed + optimizer + weight_exposed
    if w.tp > 1:
        notes.append(f"TP all-reduces {1e3 * tp_comm:.1f} ms per micro-batch, not overlapped")
    if ep_comm:
        notes.append(f"EP token all-to-alls {1e3 * ep_comm:.1f} ms per micro-batch, not overlapped")
    link_bytes = _record_bytes(w, cfg, buckets)
    expert_bytes = (_record_bytes(w, cfg, expert_buckets, eg) if expert_buckets
                    else {"intra": 0.0, "inter": 0.0})
    link_bytes.update({f"expert_{k}": v for k, v in expert_bytes.items()})
    return Prediction(
        variant=variant, iteration_s=total,
        tflops_per_gpu=w.flops_per_rank / total / 1e12 if total > 0 else 0.0,
        compute_s=compute, grad_exposed_s=grad_exposed, weight_exposed_s=weight_exposed,
        optimizer_s=optimizer, contention_s=contention,
        grad_total_s=sum(c.seconds for c in grads), weight_total_s=sum(c.seconds for c in weights),
        bytes_per_link=link_bytes, memory_bytes=_memory(w, cfg, buckets, expert_buckets),
        notes=notes)


def predict_paro(strategy: str, w: Workload,
                 rates: DeviceRates) -> Tuple[Optional[Prediction], Optional[str]]:
    """A PaRO strategy's iteration: its per-micro-step collectives (paro_cost's volumes) hidden
    behind the micro-batch's compute as far as it lasts (the engine prefetches the next layer's
    gather), its once-per-step collectives exposed. Returns the prediction and, when the strategy
    does not apply to this layout, why."""
    from megatron.distributed.quant.paro.cost import StateBytes, communication_volume, model_state_memory
    from megatron.distributed.quant.paro.strategy import as_strategy

    cl = w.cluster
    if w.tp > 1 or w.pp > 1:
        return None, "PaRO runs with TP = PP = 1"
    if w.moe:
        from megatron.distributed.quant.paro.strategy import uses_engine

        if uses_engine(strategy):
            return None, ("the PaRO engine does not shard expert parameters (the trainer refuses "
                          "--num-experts with it)")
        if w.rank_expert_parameters:
            return None, "megatron-core's DDP with expert buffers: the baseline rows price it"
    grad_b = w.grad_bytes()
    sb = StateBytes(param=2, grad=grad_b, optim=12)
    vol = communication_volume(strategy, w.parameters, cl.world_size, cl.gpus_per_node,
                               micro_steps=w.micro_batches, state_bytes=sb)

    def link_time(intra: float, inter: float) -> float:
        return intra / cl.intra.bandwidth + inter * cl.gpus_per_node / cl.inter.bandwidth

    mb = _micro_batch_seconds(w, rates)
    micro = link_time(vol.micro_intra, vol.micro_inter)
    once = link_time(vol.once_intra, vol.once_inter)
    exposed = w.micro_batches * max(0.0, micro - mb) + once
    mem = model_state_memory(strategy, w.parameters, cl.world_size, cl.gpus_per_node, state_bytes=sb)
    divisor = as_strategy(strategy).optim.divisor(cl.gpus_per_node, cl.world_size)
    optimizer = w.parameters * OPTIMIZER_BYTES_PER_ELEMENT / rates.copy_bandwidth / divisor
    total = w.micro_batches * mb + exposed + optimizer
    return Prediction(
        variant=f"PaRO {strategy}", iteration_s=total, tflops_per_gpu=w.flops_per_rank / total / 1e12,
        compute_s=w.micro_batches * mb, grad_exposed_s=exposed, weight_exposed_s=0.0,
        optimizer_s=optimizer, contention_s=0.0,
        grad_total_s=w.micro_batches * micro + once, weight_total_s=0.0,
        bytes_per_link={"intra": vol.intra, "inter": vol.inter, "expert_intra": 0.0,
                        "expert_inter": 0.0}, memory_bytes=mem.total,
        notes=["exposed = per-micro-step collectives beyond the compute + the once-per-step ones"]), None
