"""``tools/planner.py --measure``: time the user's own launch, so the prediction is for their cluster.

Why measure and not ask: a user rarely knows the latency and usable bandwidth of their links, or
the rate their GPUs reach on their model; under a minute of timing on the real launch (torchrun
across the nodes, the run's own flags) gives all three. Every rank takes part:

* **links**: the all-to-all the quantized hops call (``all_to_all_single`` of uint8 codes), on
  the layer's two-level groups (:func:`~megatron.distributed.quant.topology.build_two_level_groups_for_all`:
  the ranks of a node; the same local rank across nodes), all groups at once as in training, at a
  small and a large size; latency and bandwidth are fitted through the two (medians of repeats);
* **kernels**: each quantization kernel the step calls, on the backend the trainer picks, at two
  sizes (``fixed + bytes / bandwidth``), and a device copy;
* **compute**: the model's forward and backward for a few micro-batches on every rank at once,
  with no gradient communication, giving the model TFLOP/s the timeline scales; and the
  optimizer's update of the rank's shard, per element.

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
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from .calibration import SOURCES, ComputeRate, DeviceRates, KernelRate, fit_kernel, moved_bytes
from .cluster import Cluster, Link

__all__ = ["measure", "write_measurement", "read_measurement", "fit_link", "median_seconds"]


def fit_link(samples: List[Tuple[float, float]], concurrent: int = 1) -> Link:
    """A link through (bytes each rank sent, seconds) at two sizes: latency = the intercept,
    bandwidth = ``concurrent`` senders' bytes over the slope."""
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


def _probe(group: Any, size: int, nbytes: int, device: torch.device, repeats: int,
           sync: Callable[[], None]) -> float:
    """Median seconds of an all-to-all in which each rank sends ``nbytes`` split over ``size``."""
    per = max(1, nbytes // size)
    send = torch.zeros(per * size, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)

    def run() -> None:
        dist.all_to_all_single(recv, send, group=group)

    run()   # the communicator's first call sets it up
    return median_seconds(run, repeats, sync, align=dist.barrier)


def measure_links(device: torch.device, gpus_per_node: int, sizes: Tuple[int, int], repeats: int,
                  sync: Callable[[], None]) -> Tuple[Link, Link]:
    from megatron.distributed.quant.topology import build_two_level_groups_for_all

    world = dist.get_world_size()
    groups = build_two_level_groups_for_all([list(range(world))], gpus_per_node)
    d, m = groups.intra_size, groups.inter_size
    intra = inter = None
    if d > 1:
        intra = fit_link([((d - 1) / d * b, _probe(groups.intra_group, d, b, device, repeats, sync))
                          for b in sizes])
    if m > 1:
        inter = fit_link([((m - 1) / m * b, _probe(groups.inter_group, m, b, device, repeats, sync))
                          for b in sizes], concurrent=gpus_per_node)
    return intra, inter


def measure_kernels(device: torch.device, sizes: Tuple[int, int], sync: Callable[[], None],
                    repeats: int = 3) -> Tuple[Dict[str, KernelRate], float]:
    """Each kernel's fitted rate on this device's backend, and the copy bandwidth."""
    from megatron.distributed.quant import kernels as K

    gen = torch.Generator(device=device).manual_seed(0)
    samples: Dict[str, List[Tuple[float, float]]] = {}
    copy: List[float] = []
    bits, gs = 4, 128
    for n in sizes:
        n -= n % (SOURCES * 2048)
        x = torch.randn(n, device=device, generator=gen)
        y = torch.empty_like(x)
        copy.append(8 * n / median_seconds(lambda: y.copy_(x), repeats, sync))
        ref = x.bfloat16()
        q = K.quantize(x, bits, gs, generator=gen)
        qd = K.quantize_difference(x, ref, bits, gs, generator=gen)
        calls = {
            "quantize": lambda: K.quantize(x, bits, gs, generator=gen),
            "quantize_ht": lambda: K.quantize(x, bits, gs, hadamard=True, generator=gen),
            "quantize_partitions_ht": lambda: K.quantize_partitions(
                x, SOURCES, [0, 2, 1, 3], bits, gs, hadamard=True, generator=gen),
            "dequantize_sum_requantize": lambda: K.dequantize_sum_requantize(q, SOURCES, bits,
                                                                             generator=gen),
            "dequantize_sum": lambda: K.dequantize_sum(q, SOURCES),
            "quantize_difference": lambda: K.quantize_difference(x, ref, bits, gs, generator=gen),
            "dequantize": lambda: K.dequantize(q),
            "dequantize_add": lambda: K.dequantize_add(qd, ref),
        }
        for name, fn in calls.items():
            fn()
            samples.setdefault(name, []).append((float(moved_bytes(name, n, bits, gs)),
                                                 median_seconds(fn, repeats, sync)))
    return {k: fit_kernel(v) for k, v in samples.items()}, max(copy)


def write_measurement(path: str, cluster: Cluster, rates: DeviceRates) -> None:
    data = {"cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
                        "name": cluster.name, "intra": asdict(cluster.intra),
                        "inter": asdict(cluster.inter)},
            "rates": {"device": rates.device, "source": rates.source,
                      "compute": [asdict(c) for c in rates.compute],
                      "kernels": {k: asdict(v) for k, v in rates.kernels.items()},
                      "copy_bandwidth": rates.copy_bandwidth,
                      "kernels_share_compute": rates.kernels_share_compute,
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
        cluster = Cluster(nodes=int(c["nodes"]), gpus_per_node=int(c["gpus_per_node"]),
                          intra=Link(**c["intra"]), inter=Link(**c["inter"]), name=c.get("name", ""))
        rates = DeviceRates(
            device=r["device"], source=r["source"],
            compute=tuple(ComputeRate(**x) for x in r["compute"]),
            kernels={k: KernelRate(**v) for k, v in r["kernels"].items()},
            copy_bandwidth=float(r["copy_bandwidth"]),
            kernels_share_compute=bool(r["kernels_share_compute"]), peak_tflops=r.get("peak_tflops"),
            optimizer_seconds_per_element=r.get("optimizer_seconds_per_element"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a planner measurement (tools/planner.py --measure --out): "
                         f"{e}") from None
    return cluster, rates


def measure(args: argparse.Namespace, *,
            compute_seconds: Callable[[argparse.Namespace, int], Tuple[float, float, float]],
            link_sizes: Tuple[int, int] = (1 << 16, 1 << 24),
            kernel_sizes: Tuple[int, int] = (1 << 18, 1 << 22), repeats: int = 3,
            compute_steps: int = 3) -> Tuple[Cluster, DeviceRates]:
    """Everything :mod:`.timeline` needs, timed on this launch (module docstring). The process
    group must be initialised; ``compute_seconds(args, steps)`` returns (seconds per
    micro-batch's forward + backward, model FLOPs per micro-batch, seconds of the optimizer's
    update of the rank's shard) on this rank."""
    world = dist.get_world_size()
    gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % gpus_per_node:
        raise ValueError(f"world size {world} is not a multiple of LOCAL_WORLD_SIZE {gpus_per_node}")
    cuda = args.device == "cuda" if hasattr(args, "device") else torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    intra, inter = measure_links(device, gpus_per_node, link_sizes, repeats, sync)
    kernels, copy_bw = measure_kernels(device, kernel_sizes, sync)
    seconds, flops, optimizer = compute_seconds(args, compute_steps)
    # every rank's compute ran at once; the slowest sets the pace of a synchronous step
    t = torch.tensor([seconds, optimizer], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    tflops = flops / t[0].item() / 1e12
    from .workload import count_parameters

    parameters = count_parameters(args)
    shard = parameters / (args.tensor_model_parallel_size * args.pipeline_model_parallel_size) / (
        world // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size))
    nodes = world // gpus_per_node
    name = torch.cuda.get_device_name(device) if cuda else f"CPU ranks ({os.cpu_count()} cores)"
    absent = Link(bandwidth=float("inf"), latency=0.0)   # one node, or one rank per node
    cluster = Cluster(nodes=nodes, gpus_per_node=gpus_per_node, intra=intra or absent,
                      inter=inter or absent, name=f"measured {time.strftime('%Y-%m-%d %H:%M')}")
    rates = DeviceRates(
        device=name, source=f"tools/planner.py --measure, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        compute=(ComputeRate("measured", parameters, tflops),),
        kernels=kernels, copy_bandwidth=copy_bw, kernels_share_compute=not cuda,
        optimizer_seconds_per_element=t[1].item() / shard)
    return cluster, rates
