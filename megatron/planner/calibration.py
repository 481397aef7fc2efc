"""Device rates the planner predicts from: model compute, quantization kernels, memory copy, and
what overlap costs.

Why measured rates and not peak figures: a GPT step reaches 40-50 % of a GPU's peak and the
quantization kernels 6-85 % of its copy bandwidth (docs/performance.md), so a prediction from
spec sheets would be off by 2x before the network enters. Every rate carries its source (device,
date, command). Three ways in:

* the defaults: what the project measured on one H200 on 2026-11-27 (docs/performance.md, "GPU
  kernels (Triton)" and "GPU throughput"), the kernel rows converted to seconds per call with the
  bytes ``bench/bench_quant.py`` counts for each kernel;
* ``--compute-json`` (``bench/gpu_throughput.py --out``) and ``--kernels-json``
  (``bench/bench_quant.py --json``): the user's own measurements;
* ``tools/planner.py --measure``: timed on the user's launch (:mod:`.measure`), the only source
  of what overlap costs (:class:`Contention`): the defaults and the JSON files carry none.

A kernel's time is ``fixed + moved bytes / bandwidth``, fitted to its smallest and largest
measured sizes (launch and per-call costs dominate small buckets). Compute is model TFLOP/s per
GPU (Megatron's formula, ``megatron/training/model/flops.py``) of the shape measured nearest in
size to the planned model; another GPU is reached by the ratio of the two GPUs' dense bf16 peaks,
a stated assumption (:data:`PEAK_TFLOPS`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from megatron.distributed.quant.kernels.reference import QuantizedTensor

__all__ = ["KernelRate", "ComputeRate", "Contention", "CONTENTION_KINDS", "DeviceRates",
           "PEAK_TFLOPS", "KERNELS", "SOURCES", "MEASURED_SOURCES", "moved_bytes", "default_rates", "fit_kernel",
           "load_compute_json", "load_kernels_json", "for_gpu"]

PEAK_TFLOPS: Dict[str, float] = {
    "H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0,
}
"""Dense bf16 tensor-core peaks (vendor data sheets, SXM parts), only used to carry a measured
compute rate from one GPU to another."""

KERNELS = ("quantize", "quantize_ht", "quantize_partitions_ht", "dequantize_sum_requantize",
           "dequantize_sum", "quantize_difference", "dequantize", "dequantize_add")
"""The kernels a step calls, by the name :mod:`.timeline` uses."""

_BENCH_NAMES = {
    "quantize": "quantize", "quantize+HT32": "quantize_ht",
    "quantize_partitions(4)+HT": "quantize_partitions_ht",
    "dequant_sum_requant": "dequantize_sum_requantize", "dequant_sum": "dequantize_sum",
    "quantize_difference(bf16)": "quantize_difference", "dequantize": "dequantize",
    "dequantize_add(bf16)": "dequantize_add",
}
"""bench_quant.py's row names (without the slot count ``(S=...)``) -> :data:`KERNELS`."""


def bench_kernel_name(row_name: str) -> Optional[str]:
    """The :data:`KERNELS` name of a bench_quant.py row name ('dequant_sum(S=8)' ->
    'dequantize_sum'); None for a row the planner does not use."""
    return _BENCH_NAMES.get(re.sub(r"\(S=\d+\)$", "", row_name))


@dataclass(frozen=True)
class KernelRate:
    """One kernel's cost: ``fixed_s + moved_bytes / bandwidth``."""

    fixed_s: float
    """Seconds per call independent of size (launch, per-call work)."""
    bandwidth: float
    """Marginal bytes moved (read + write) per second."""

    def seconds(self, moved_bytes: float) -> float:
        return self.fixed_s + moved_bytes / self.bandwidth if moved_bytes > 0 else 0.0


@dataclass(frozen=True)
class ComputeRate:
    """Model TFLOP/s per GPU of one measured shape."""

    shape: str
    """The shape's name ('1.3b'; 'measured' for ``--measure``)."""
    parameters: int
    """Its parameters, to pick the measured shape nearest a planned model."""
    tflops: float
    """Model TFLOP/s per GPU: of a whole step at DP 1 (bench/gpu_throughput.py: forward, backward,
    optimizer) or of forward + backward alone (``--measure``, which times the optimizer apart)."""


@dataclass(frozen=True)
class Contention:
    """How much slower the compute and an overlapped collective run when they run at once, each
    against itself alone (1.0: no interference). Measured by ``--measure``
    (:mod:`.compute_probe`): on CPU ranks the collective's kernels, gloo's transport and the
    model share the rank's cores; on a GPU the collective's kernels take SMs and memory
    bandwidth from the model's."""

    compute: float = 1.0
    """The model's forward + backward, seconds beside the collective over seconds alone."""
    communication: float = 1.0
    """The collective (with its kernels), seconds beside the compute over seconds alone."""

    def __post_init__(self) -> None:
        for name in ("compute", "communication"):
            x = getattr(self, name)
            if not (math.isfinite(x) and x >= 1.0):
                raise ValueError(f"a contention slowdown is a finite number >= 1, got {name}={x}")

    @property
    def worse_than_serial(self) -> bool:
        """Each lane's speed beside the other, summed, below one lane alone: together they would
        take longer than one after the other, which sharing a device cannot do. A probe reads
        this when something else takes the device (more ranks than cores descheduling each
        other: 161x and 13x were read with 4 CPU ranks on 2 cores)."""
        return 1.0 / self.compute + 1.0 / self.communication < 1.0

    def bounded(self) -> "Contention":
        """At worst the two lanes serialise: a reading :attr:`worse_than_serial` scaled down, in
        its own proportion, to the slowdowns at which they just do (1/compute + 1/communication
        = 1)."""
        if not self.worse_than_serial:
            return self
        return Contention(compute=1.0 + self.compute / self.communication,
                          communication=1.0 + self.communication / self.compute)


CONTENTION_KINDS = ("quantized", "plain")
"""What overlaps the compute: 'quantized': a quantized hop (kernel, all-to-all of the codes,
kernel); 'plain': megatron-core's reduce-scatter / all-gather of the unquantized buffers."""


@dataclass(frozen=True)
class DeviceRates:
    """Everything the timeline needs to know about the device."""

    device: str
    """What was measured, e.g. 'NVIDIA H200'."""
    source: str
    """Date and command of the measurement."""
    compute: Tuple[ComputeRate, ...]
    """Measured shapes; :meth:`tflops_for` picks the nearest in parameters."""
    kernels: Mapping[str, KernelRate]
    """Quantization kernels by :data:`KERNELS` name."""
    copy_bandwidth: float
    """Device memory copy, bytes moved (read + write) per second: the optimizer step and LoCo's
    elementwise passes run near it."""
    contention: Mapping[str, Contention] = field(default_factory=dict)
    """By :data:`CONTENTION_KINDS`: what overlap costs the compute and the collective, measured
    (``--measure``); a kind not measured runs as if alone (:meth:`contention_for`)."""
    peak_tflops: Optional[float] = None
    """The measured device's dense bf16 peak, to carry the compute rate to another GPU."""
    optimizer_seconds_per_element: Optional[float] = None
    """The optimizer's update per element of a rank's shard, measured (``--measure``); None: the
    timeline's copy-bandwidth estimate."""

    def tflops_for(self, parameters: float) -> ComputeRate:
        """The measured shape nearest (by log of parameters) to a model of ``parameters``."""
        return min(self.compute, key=lambda c: abs(math.log(max(c.parameters, 1) / max(parameters, 1))))

    def contention_for(self, kind: str) -> Contention:
        """The measured slowdowns of ``kind`` overlapping the compute, at worst serial
        (:meth:`Contention.bounded`); none measured: 1.0."""
        if kind not in CONTENTION_KINDS:
            raise ValueError(f"unknown contention kind {kind!r}; choose from {CONTENTION_KINDS}")
        return self.contention.get(kind, Contention()).bounded()

    def kernel(self, name: str) -> KernelRate:
        try:
            return self.kernels[name]
        except KeyError:
            raise KeyError(f"no rate for the kernel {name!r}; measured: {sorted(self.kernels)}") from None


SOURCES = 8
"""Slots the middle and final hops' kernels sum when they are timed and no run says otherwise
(bench_quant.py ``--sources``; ``--measure`` takes the run's GPUs per node): the middle hop sums
the GPUs of a node, 8 on the nodes users run with TP 1."""

MEASURED_SOURCES = 4
"""Slots of the 2026-11-27 H200 measurements behind :func:`default_rates`."""


def moved_bytes(kernel: str, numel: int, bits: int = 4, group_size: int = 128,
                sources: int = SOURCES) -> int:
    """Bytes ``kernel`` reads and writes for ``numel`` input elements (fp32 gradients; fp32 new and
    bf16 reference weights for the difference; ``sources`` slots summed by the middle and final
    hops), as ``bench/bench_quant.py`` counts them: the one formula behind its GB/s column,
    ``--measure``'s fits and the H200 defaults."""
    codes = QuantizedTensor.wire_bytes(numel, bits, group_size)
    part = numel // sources
    return {
        "quantize": 4 * numel + codes, "quantize_ht": 4 * numel + codes,
        "quantize_partitions_ht": 4 * numel + codes,
        "dequantize_sum_requantize": codes + QuantizedTensor.wire_bytes(part, bits, group_size),
        "dequantize_sum": codes + 4 * part,
        "quantize_difference": 6 * numel + codes,
        "dequantize": codes + 4 * numel, "dequantize_add": codes + 4 * numel,
    }[kernel]


def fit_kernel(samples: Sequence[Tuple[float, float]]) -> KernelRate:
    """``fixed + bytes / bandwidth`` through the smallest and largest of ``(moved_bytes,
    seconds)`` samples (one sample: no fixed cost)."""
    pts = sorted(samples)
    if not pts:
        raise ValueError("no samples to fit a kernel rate to")
    (b0, t0), (b1, t1) = pts[0], pts[-1]
    if b1 <= b0 or t1 <= t0:
        return KernelRate(0.0, b1 / t1)
    bandwidth = (b1 - b0) / (t1 - t0)
    return KernelRate(max(0.0, t0 - b0 / bandwidth), bandwidth)


# What the project measured: docs/performance.md, 2026-11-27, one NVIDIA H200, 4-bit codes, group
# 128, `python bench/bench_quant.py --sizes 16M,64M,256M --device cuda --bits 4 --group-size 128`
# (one call + synchronize per timing, so the fixed costs include a host round trip the trainer
# does not pay). Rows: kernel -> ((numel, moved GB/s), ...), moved bytes as moved_bytes() counts them.
_H200_KERNEL_GBPS = {
    "quantize": ((16 << 20, 457.0), (256 << 20, 1674.0)),
    "quantize_ht": ((16 << 20, 478.0), (256 << 20, 1232.0)),
    "quantize_partitions_ht": ((16 << 20, 433.0), (256 << 20, 1166.0)),
    "dequantize_sum_requantize": ((16 << 20, 81.0), (256 << 20, 250.0)),
    "dequantize_sum": ((16 << 20, 440.0), (256 << 20, 1315.0)),
    "quantize_difference": ((16 << 20, 549.0), (256 << 20, 2137.0)),
    "dequantize": ((16 << 20, 1458.0), (256 << 20, 3511.0)),
    "dequantize_add": ((16 << 20, 1143.0), (256 << 20, 3404.0)),
}
_H200_COPY_GBPS = 4110.0   # device-to-device copy at 256M elements, same run
# docs/performance.md "GPU throughput", 2026-11-27, one H200, `python bench/gpu_throughput.py
# --shapes 125m,1.3b --runs baseline,reference --iters 8 --warmup 3 --device cuda`: ours, DP 1.
_H200_COMPUTE = (ComputeRate("125m", 125_262_336, 239.0), ComputeRate("1.3b", 1_315_819_520, 469.8))


def default_rates() -> DeviceRates:
    """The H200 figures the project measured (module docstring)."""
    def moved(name: str, n: int) -> int:
        return moved_bytes(name, n, sources=MEASURED_SOURCES)

    kernels = {name: fit_kernel([(moved(name, n), moved(name, n) / (gbps * 1e9)) for n, gbps in rows])
               for name, rows in _H200_KERNEL_GBPS.items()}
    return DeviceRates(
        device="NVIDIA H200", peak_tflops=PEAK_TFLOPS["H200"],
        source=("measured 2026-11-27 (docs/performance.md): bench/gpu_throughput.py --shapes "
                "125m,1.3b --device cuda; bench/bench_quant.py --sizes 16M,64M,256M --bits 4"),
        compute=_H200_COMPUTE, kernels=kernels, copy_bandwidth=_H200_COPY_GBPS * 1e9)


def for_gpu(rates: DeviceRates, gpu: str) -> DeviceRates:
    """``rates`` carried to ``gpu`` (a :data:`PEAK_TFLOPS` key): compute scaled by the ratio of
    the dense bf16 peaks; kernels and copy by the same ratio when the GPU is slower (a stated
    first-order assumption: an A100's HBM is 2.0 of an H200's 4.8 TB/s)."""
    key = gpu.upper()
    if key not in PEAK_TFLOPS:
        raise ValueError(f"unknown GPU {gpu!r}; known: {sorted(PEAK_TFLOPS)}")
    if rates.peak_tflops is None:
        raise ValueError(f"the rates of {rates.device} carry no peak to scale from")
    ratio = PEAK_TFLOPS[key] / rates.peak_tflops
    if abs(ratio - 1.0) < 1e-9:
        return replace(rates, device=f"{key} (rates of {rates.device}, equal peak)")
    kernels = {k: KernelRate(v.fixed_s, v.bandwidth * min(1.0, ratio)) for k, v in rates.kernels.items()}
    return replace(rates, device=f"{key} (rates of {rates.device} x {ratio:.3f}, the peak ratio)",
                   compute=tuple(replace(c, tflops=c.tflops * ratio) for c in rates.compute),
                   kernels=kernels, copy_bandwidth=rates.copy_bandwidth * min(1.0, ratio),
                   peak_tflops=PEAK_TFLOPS[key])


def load_compute_json(path: str, base: DeviceRates) -> DeviceRates:
    """``base`` with the compute rates of a ``bench/gpu_throughput.py --out`` file (its
    'baseline' rows: ours)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    rows = [r for r in data.get("rows", []) if r.get("run") == "baseline" and r.get("tflops_per_gpu")]
    if not rows:
        raise ValueError(f"{path}: no 'baseline' row with tflops_per_gpu (a bench/gpu_throughput.py "
                         "--out file with --runs baseline)")
    compute = tuple(ComputeRate(r["shape"], int(r.get("parameters") or 0), float(r["tflops_per_gpu"]))
                    for r in rows)
    device = str(data.get("device", base.device))
    return replace(base, device=device, compute=compute,
                   source=f"{base.source}; compute from {path} ({data.get('header', '')})")


def load_kernels_json(path: str, base: DeviceRates) -> DeviceRates:
    """``base`` with the kernel rates of a ``bench/bench_quant.py --json`` file (the fastest
    backend per kernel and size, as the trainer picks it)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    samples: Dict[str, Dict[int, Tuple[float, float]]] = {}
    copy: List[float] = []
    for r in data.get("rows", []):
        name = bench_kernel_name(str(r.get("kernel")))
        if name is None:
            continue
        key = int(r["numel"])
        cur = samples.setdefault(name, {}).get(key)
        if cur is None or r["seconds"] < cur[1]:
            samples[name][key] = (float(r["moved_bytes"]), float(r["seconds"]))
        if r.get("copy_gbps"):
            copy.append(float(r["copy_gbps"]) * 1e9)
    if not samples:
        raise ValueError(f"{path}: no kernel rows (a bench/bench_quant.py --json file)")
    kernels = dict(base.kernels)
    kernels.update({k: fit_kernel(list(v.values())) for k, v in samples.items()})
    return replace(base, kernels=kernels, copy_bandwidth=max(copy) if copy else base.copy_bandwidth,
                   device=str(data.get("device", base.device)),
                   source=f"{base.source}; kernels from {path}")
