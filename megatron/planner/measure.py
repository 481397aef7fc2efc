"""``tools/planner.py --measure``: time the user's own launch, so the prediction is for their cluster.

Why measure and not ask: a user rarely knows the latency and usable bandwidth of their links, or
the rate their GPUs reach on their model; under a minute of timing on the real launch gives all
three. Every rank times the collectives as the run calls them (:data:`PROBE_SIZES` and the largest
bucket), the quantization kernels, the model's compute and optimizer update, and the compute
beside a collective (contention); each repeat counts at its slowest rank. What is measured and
how: docs/planner.md ("The model", ``measure.py``).

Rank 0 writes the result as JSON (:func:`write_measurement`, read back by
:func:`read_measurement`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .calibration import (SOURCES, ComputeRate, Contention, DeviceRates, KernelRate, fit_kernel,
                          moved_bytes)
from .cluster import Cluster, Link, MeasuredCollective

__all__ = ["measure", "measure_collectives", "beside_jobs", "probe_sizes", "write_measurement",
           "read_measurement", "fit_link", "median_seconds", "slowest_rank_median"]


def fit_link(samples: List[Tuple[float, float]], concurrent: int = 1) -> Link:
    """A link through (bytes each rank sent, seconds) at the smallest and largest size: latency =
    the intercept, bandwidth = ``concurrent`` senders' bytes over the slope."""
    (b0, t0), (b1, t1) = sorted(samples)[0], sorted(samples)[-1]
    slope = (t1 - t0) / (b1 - b0) if b1 > b0 and t1 > t0 else t1 / max(b1, 1)
    latency = max(0.0, t0 - b0 * slope)
    return Link(bandwidth=concurrent / slope, latency=latency)


def median_seconds(fn: Callable[[], Any], repeats: int, sync: Callable[[], None],
                   align: Callable[[], None] = lambda: None) -> float:
    """Median seconds of ``fn`` through ``sync`` (the device's), each call started after
    ``align`` (a barrier: every rank starts together, as in training)."""
    times = []
    for _ in range(repeats):
        sync()
        align()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def slowest_rank_median(fn: Callable[[], Any], repeats: int, sync: Callable[[], None],
                        device: torch.device) -> float:
    """Median over ``repeats`` of the slowest rank's seconds of ``fn``, every rank running it at
    once after a barrier (a collective call: every rank calls it with the same ``repeats``).

    Why the slowest rank of each repeat and not each rank's median: a synchronous step waits at
    each collective for the last rank, and ranks do not run at an even pace, so the larger of
    the ranks' medians is the pace of none of them."""
    times = []
    for _ in range(repeats):
        sync()
        dist.barrier()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)   # NCCL: on the device
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


BACK_TO_BACK_BYTES = 64 << 20
"""A probe repeats a small collective back to back until about this many bytes have gone: in
training the buckets' collectives follow each other, so the link is busy, not idle; a single call
after an idle pause rides on the link's burst allowance and can time 2-4x faster than training
(docs/planner.md)."""


PROBE_SIZES = (1 << 16, 1 << 20, 1 << 24)
"""Bytes per call ``--measure`` times every collective at: latency; a pipelined chunk or a small
bucket; a large bucket."""
MAX_PROBE_BYTES = 1 << 28
"""The largest call ``--measure`` times (a 64M-element fp32 bucket)."""


def probe_sizes(largest_call: int) -> Tuple[int, ...]:
    """:data:`PROBE_SIZES`, and the run's largest call where it is larger (up to
    :data:`MAX_PROBE_BYTES`): a whole-model bucket's call can cost more per byte than the line
    through smaller sizes says (docs/planner.md)."""
    largest = min(MAX_PROBE_BYTES, int(largest_call))
    return PROBE_SIZES + ((largest,) if largest > PROBE_SIZES[-1] else ())


def _probe(collective: str, group: Any, size: int, nbytes: int, device: torch.device,
           repeats: int, sync: Callable[[], None], grad_dtype: torch.dtype = torch.float32) -> float:
    """Seconds per call of ``collective`` (:data:`~.cluster.COLLECTIVES`, ``nbytes`` as defined
    there) on ``group`` of ``size`` ranks, through the same torch calls the run makes (the
    reduce-scatter sums ``grad_dtype``, the run's gradient buffers): the median over ``repeats``
    of back-to-back runs (:data:`BACK_TO_BACK_BYTES`, at most 64 calls), each divided by its
    calls."""
    from megatron.distributed.quant.collectives.common import all_gather_flat, reduce_scatter_flat

    per = max(1, nbytes // size)
    if collective == "reduce_scatter":   # the gradient buffer's elements, summed
        n = max(1, per // grad_dtype.itemsize)
        inp = torch.ones(n * size, dtype=grad_dtype, device=device)
        out = torch.empty(n, dtype=grad_dtype, device=device)

        def run() -> None:
            reduce_scatter_flat(out, inp, group)
    elif collective == "all_gather":
        inp = torch.zeros(per, dtype=torch.uint8, device=device)
        out = torch.empty(per * size, dtype=torch.uint8, device=device)

        def run() -> None:
            all_gather_flat(out, inp, group)
    else:
        send = torch.zeros(per * size, dtype=torch.uint8, device=device)

        def run() -> None:   # a new receive buffer per call, as the layer's hops allocate one
            dist.all_to_all_single(torch.empty_like(send), send, group=group)

    run()   # the communicator's first call sets it up
    calls = max(1, min(64, BACK_TO_BACK_BYTES // max(1, nbytes)))

    def back_to_back() -> None:
        for _ in range(calls):
            run()

    return slowest_rank_median(back_to_back, repeats, sync, device) / calls


def measure_collectives(device: torch.device, gpus_per_node: int, groups: Any,
                        sizes: Tuple[int, ...], repeats: int, sync: Callable[[], None],
                        data_parallel_group: Any = None, grad_dtype: torch.dtype = torch.float32
                        ) -> Tuple[Optional[Link], Optional[Link], Dict[str, MeasuredCollective]]:
    """(intra link, inter link, every :data:`~.cluster.COLLECTIVES` entry that applies) on this
    launch, ``groups`` the layer's two-level groups over it; a link is None where the launch has
    none (one rank per node, or one node). Each time is the slowest rank's (a collective ends
    when its last rank does)."""
    dp_group = data_parallel_group if data_parallel_group is not None else dist.group.WORLD
    dp = dist.get_world_size(dp_group)
    d, m = groups.intra_size, groups.inter_size
    node = dist.get_rank() // gpus_per_node
    dp_per_node = sum(1 for r in dist.get_process_group_ranks(dp_group) if r // gpus_per_node == node)
    plan = [("all_to_all_intra", groups.intra_group, d, d),
            ("all_to_all_inter", groups.inter_group, m, 1),
            ("reduce_scatter", dp_group, dp, dp_per_node), ("all_gather", dp_group, dp, dp_per_node)]
    plan = [p for p in plan if p[2] > 1]
    seconds = torch.tensor([[_probe(name, group, size, b, device, repeats, sync, grad_dtype)
                             for b in sizes] for name, group, size, _ in plan], dtype=torch.float64)
    curves: Dict[str, MeasuredCollective] = {
        name: MeasuredCollective(ranks=size, ranks_per_node=per_node,
                                 points=tuple((float(b), t) for b, t in zip(sizes, row.tolist())))
        for (name, _, size, per_node), row in zip(plan, seconds)}

    def link(name: str, size: int, concurrent: int = 1) -> Optional[Link]:
        if name not in curves:
            return None
        pts = curves[name].points
        return fit_link([((size - 1) / size * b, t) for b, t in (pts[0], pts[-1])], concurrent)

    return link("all_to_all_intra", d), link("all_to_all_inter", m, gpus_per_node), curves


PROBE_BITS, PROBE_GROUP_SIZE = 4, 128
"""The quantized hop the probes time: SDP4Bit's inter-node gradients (4 bits, groups of 128)."""


def first_hop_kernel(x: torch.Tensor, generator: torch.Generator,
                     sources: int = SOURCES) -> Any:
    """The first hop's kernel as the probes time it: Hadamard, then :data:`PROBE_BITS`-bit codes
    of ``sources`` partitions in a swizzled order (even slots, then odd)."""
    from megatron.distributed.quant.kernels import dispatch as K

    order = list(range(0, sources, 2)) + list(range(1, sources, 2))
    return K.quantize_partitions(x, sources, order, PROBE_BITS, PROBE_GROUP_SIZE,
                                 hadamard=True, generator=generator)


def measure_kernels(device: torch.device, sizes: Tuple[int, int], sync: Callable[[], None],
                    repeats: int = 3, sources: int = SOURCES) -> Tuple[Dict[str, KernelRate], float]:
    """Each kernel's fitted rate on this device's backend, and the copy bandwidth: every rank
    runs each kernel at once, as in a step, and each repeat counts at its slowest rank
    (:func:`slowest_rank_median`; a collective call). The middle and final hops sum ``sources``
    slots (the run's GPUs per node)."""
    from megatron.distributed.quant.kernels import dispatch as K

    gen = torch.Generator(device=device).manual_seed(0)
    samples: Dict[str, List[Tuple[float, float]]] = {}
    copy: List[float] = []
    bits, gs = PROBE_BITS, PROBE_GROUP_SIZE
    for n in sizes:
        n -= n % (sources * 2048)
        x = torch.randn(n, device=device, generator=gen)
        y = torch.empty_like(x)
        copy.append(8 * n / slowest_rank_median(lambda: y.copy_(x), repeats, sync, device))
        ref = x.bfloat16()
        q = K.quantize(x, bits, gs, generator=gen)
        qd = K.quantize_difference(x, ref, bits, gs, generator=gen)
        calls = {
            "quantize": lambda: K.quantize(x, bits, gs, generator=gen),
            "quantize_ht": lambda: K.quantize(x, bits, gs, hadamard=True, generator=gen),
            "quantize_partitions_ht": lambda: first_hop_kernel(x, gen, sources),
            "dequantize_sum_requantize": lambda: K.dequantize_sum_requantize(q, sources, bits,
                                                                             generator=gen),
            "dequantize_sum": lambda: K.dequantize_sum(q, sources),
            "quantize_difference": lambda: K.quantize_difference(x, ref, bits, gs, generator=gen),
            "dequantize": lambda: K.dequantize(q),
            "dequantize_add": lambda: K.dequantize_add(qd, ref),
        }
        for name, fn in calls.items():
            fn()
            samples.setdefault(name, []).append((float(moved_bytes(name, n, bits, gs, sources)),
                                                 slowest_rank_median(fn, repeats, sync,
                                                                     device)))
    return {k: fit_kernel(v) for k, v in samples.items()}, max(copy)


def beside_jobs(device: torch.device, groups: Any, numel: int, data_parallel_group: Any,
                grad_dtype: torch.dtype) -> Dict[str, Callable[[], None]]:
    """One bucket's gradient collective of ``numel`` elements as an overlapped run runs it on its
    communication stage, by :data:`~.calibration.CONTENTION_KINDS`, each a call that returns when
    it is done (on CUDA on a side stream, synchronised): 'quantized' = the first hop's kernel
    (Hadamard, 4 bits), the all-to-all of the codes on the slower of the layer's two-level groups,
    the final hop's dequantize-and-sum (``groups``: the layer's two-level groups); 'plain' =
    megatron-core's reduce-scatter on the data-parallel group, in the run's gradient dtype."""
    from megatron.distributed.quant.kernels import dispatch as K
    from megatron.distributed.quant.collectives.common import reduce_scatter_flat
    from megatron.distributed.quant.kernels.reference import QuantizedTensor

    group, size = ((groups.inter_group, groups.inter_size) if groups.inter_size > 1
                   else (groups.intra_group, groups.intra_size))
    dp = dist.get_world_size(data_parallel_group)
    bits, gs = PROBE_BITS, PROBE_GROUP_SIZE
    whole_groups = SOURCES * 2048 * dp   # every partition and shard in whole quantization groups
    numel = max(whole_groups, numel - numel % whole_groups)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(numel, device=device, generator=gen).to(grad_dtype)
    whole = K.quantize(x, bits, gs, generator=gen)   # what the final hop sums
    per = -(-QuantizedTensor.wire_bytes(numel, bits, gs) // size)
    send = torch.zeros(per * size, dtype=torch.uint8, device=device)
    out = torch.empty(numel // dp, dtype=grad_dtype, device=device)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))

    def on_side(fn: Callable[[], None]) -> Callable[[], None]:
        if side is None:
            return fn

        def run() -> None:   # on the probe's thread, whose current device is not set
            with torch.cuda.device(device), torch.cuda.stream(side):
                fn()
            side.synchronize()
        return run

    def quantized() -> None:
        first_hop_kernel(x, gen)
        if size > 1:
            dist.all_to_all_single(torch.empty_like(send), send, group=group)   # as the layer
        K.dequantize_sum(whole, SOURCES)

    def plain() -> None:
        reduce_scatter_flat(out, x, data_parallel_group)

    jobs = {"quantized": on_side(quantized)}
    if dp > 1:
        jobs["plain"] = on_side(plain)
    return jobs


def write_measurement(path: str, cluster: Cluster, rates: DeviceRates) -> None:
    data = {"cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
                        "name": cluster.name, "intra": asdict(cluster.intra),
                        "inter": asdict(cluster.inter),
                        "collectives": {k: {"ranks": v.ranks, "ranks_per_node": v.ranks_per_node,
                                            "points": [list(p) for p in v.points]}
                                        for k, v in cluster.measured.items()}},
            "rates": {"device": rates.device, "source": rates.source,
                      "compute": [asdict(c) for c in rates.compute],
                      "kernels": {k: asdict(v) for k, v in rates.kernels.items()},
                      "copy_bandwidth": rates.copy_bandwidth,
                      "contention": {k: asdict(v) for k, v in rates.contention.items()},
                      "peak_tflops": rates.peak_tflops,
                      "optimizer_seconds_per_element": rates.optimizer_seconds_per_element}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_measurement(path: str) -> Tuple[Cluster, DeviceRates]:
    """The cluster and rates :func:`write_measurement` stored."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        c, r = data["cluster"], data["rates"]
        if "kernels_share_compute" in r and "contention" not in r:
            raise ValueError("made before --measure timed what overlap costs; measure again")
        cluster = Cluster(nodes=int(c["nodes"]), gpus_per_node=int(c["gpus_per_node"]),
                          intra=Link(**c["intra"]), inter=Link(**c["inter"]), name=c.get("name", ""),
                          measured={k: MeasuredCollective(ranks=int(v["ranks"]),
                                                          ranks_per_node=int(v["ranks_per_node"]),
                                                          points=tuple(tuple(p) for p in v["points"]))
                                    for k, v in c.get("collectives", {}).items()})
        rates = DeviceRates(
            device=r["device"], source=r["source"],
            compute=tuple(ComputeRate(**x) for x in r["compute"]),
            kernels={k: KernelRate(**v) for k, v in r["kernels"].items()},
            copy_bandwidth=float(r["copy_bandwidth"]),
            contention={k: Contention(**v) for k, v in r.get("contention", {}).items()},
            peak_tflops=r.get("peak_tflops"),
            optimizer_seconds_per_element=r.get("optimizer_seconds_per_element"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a planner measurement (tools/planner.py --measure --out): "
                         f"{e}") from None
    return cluster, rates


def _machine_id() -> str:
    """What tells two ranks apart as machines: the kernel's boot id where there is one (network
    namespaces share it, so emulated nodes on one machine count as one), else the host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import socket

        return socket.gethostname()


def _cores() -> frozenset:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def oversubscription(cpu: bool) -> Optional[str]:
    """For CPU ranks: a warning when the compute threads of the ranks on a machine outnumber the
    cores they may run on together (collective over all ranks; None where they do not). The
    planner's premise is one rank per device: an over-subscribed rank is descheduled while its
    peers wait in each blocking exchange, which no probe with aligned ranks sees."""
    me = _machine_id()
    ids: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ids, (me, torch.get_num_threads(), _cores()))
    if not cpu:
        return None
    mine = [(threads, cores) for machine, threads, cores in ids if machine == me]
    threads = sum(t for t, _ in mine)
    cores = len(frozenset().union(*(c for _, c in mine)))
    if threads <= cores:
        return None
    return (f"{len(mine)} ranks ({threads} compute threads) on {cores} cores of one machine: "
            f"over-subscribed, ranks wait for descheduled peers in each exchange; predictions are "
            f"optimistic")


def _workload(args: argparse.Namespace, world: int, gpus_per_node: int) -> Any:
    """The run's :class:`~.workload.Workload` on this launch's layout: its parameters and buckets
    (neither depends on the links, so they stand in)."""
    from .workload import Workload

    stand_in = Link(bandwidth=1.0, latency=0.0)
    cluster = Cluster(nodes=world // gpus_per_node, gpus_per_node=gpus_per_node, intra=stand_in,
                      inter=stand_in)
    return Workload.from_args(argparse.Namespace(**vars(args)), cluster)


def measure(args: argparse.Namespace, *,
            compute_seconds: Callable[..., Any],
            link_sizes: Optional[Tuple[int, ...]] = None,
            kernel_sizes: Optional[Tuple[int, int]] = None, repeats: int = 3,
            compute_steps: int = 8) -> Tuple[Cluster, DeviceRates]:
    """Everything :mod:`.timeline` needs, timed on this launch (module docstring). The process
    group must be initialised; ``compute_seconds(args, steps, beside)`` returns the
    :class:`~.compute_probe.ComputeProbe` (:func:`~.compute_probe.forward_backward_seconds`)."""
    world = dist.get_world_size()
    gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % gpus_per_node:
        raise ValueError(f"world size {world} is not a multiple of LOCAL_WORLD_SIZE {gpus_per_node}")
    cuda = args.device == "cuda" if hasattr(args, "device") else torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    from megatron.core import parallel_state

    from megatron.distributed.quant.topology import build_two_level_groups_for_all

    dp_group = (parallel_state.get_data_parallel_group()
                if parallel_state.model_parallel_is_initialized() else dist.group.WORLD)
    groups = build_two_level_groups_for_all([list(range(world))], gpus_per_node)
    grad_dtype = torch.bfloat16 if getattr(args, "grad_reduce_in_bf16", False) else torch.float32
    work = _workload(args, world, gpus_per_node)
    if link_sizes is None:
        link_sizes = probe_sizes(max(work.buckets) * grad_dtype.itemsize)
    intra, inter, curves = measure_collectives(device, gpus_per_node, groups, link_sizes, repeats,
                                               sync, dp_group, grad_dtype)
    if kernel_sizes is None:   # the largest call the run makes: a bucket (CPU caches, page faults)
        kernel_sizes = (1 << 18, min(1 << 26, max(1 << 22, max(work.buckets))))
    kernels, copy_bw = measure_kernels(device, kernel_sizes, sync,
                                       sources=gpus_per_node if gpus_per_node > 1 else SOURCES)
    beside = beside_jobs(device, groups, min(1 << 24, max(1 << 20, max(work.buckets))), dp_group,
                         grad_dtype)
    probe = compute_seconds(args, compute_steps, beside)
    crowded = oversubscription(not cuda)
    # the step times are each step's slowest rank's already (the same on every rank); the
    # contention readings are each rank's: the slowest sets the pace of a synchronous step
    kinds = sorted(probe.contention)
    slowest = torch.tensor([x for k in kinds for x in (probe.contention[k].compute,
                                                       probe.contention[k].communication)],
                           dtype=torch.float64, device=device)  # NCCL: on the device
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    contention = {k: Contention(*slowest[2 * i:2 * i + 2].tolist()) for i, k in enumerate(kinds)}
    tflops = probe.flops / probe.forward_backward_s / 1e12
    parameters = work.parameters
    shard = parameters / (work.tp * work.pp) / work.dp
    nodes = world // gpus_per_node
    name = torch.cuda.get_device_name(device) if cuda else f"CPU ranks ({os.cpu_count()} cores)"
    absent = Link(bandwidth=float("inf"), latency=0.0)   # one node, or one rank per node
    cluster = Cluster(nodes=nodes, gpus_per_node=gpus_per_node, intra=intra or absent,
                      inter=inter or absent, name=f"measured {time.strftime('%Y-%m-%d %H:%M')}",
                      measured=curves)
    warnings = [crowded] if crowded else []
    warnings += [f"{k} beside the compute read {c.compute:.2f}x / {c.communication:.2f}x, worse "
                 f"than one after the other: something else takes the device; used at the serial "
                 f"bound" for k, c in sorted(contention.items()) if c.worse_than_serial]
    rates = DeviceRates(
        device=name,
        source=(f"tools/planner.py --measure, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
                + "".join(f"; warning: {w}" for w in warnings)),
        compute=(ComputeRate("measured", parameters, tflops),),
        kernels=kernels, copy_bandwidth=copy_bw, contention=contention,
        optimizer_seconds_per_element=probe.optimizer_s / shard)
    return cluster, rates
