#!/usr/bin/env python
"""Throughput and error of the quantization kernels (torch reference vs Triton / C++ CPU).

Examples::

    python bench/bench_quant.py --sizes 1M --device cpu
    python bench/bench_quant.py --sizes 16M,128M --device cuda --bits 4,8
    git show HEAD~1:megatron/distributed/quant/kernels/triton_launch.py > /tmp/prev.py
    python bench/bench_quant.py --sizes 64M --device cuda --compare-kernels /tmp/prev.py

For every kernel and size it prints the time per call, throughput in GB/s of *input* bytes, the
bytes moved (read + written) per second, and the error of the round trip (relative L2 and max
abs).  Triton runs only on CUDA; the fused C++ backend (``cpp``) only on CPU.  On CUDA the
device-to-device copy bandwidth (``dst.copy_(src)`` of the fp32 tensor, counted as read + write)
is measured too and each kernel's moved-bytes bandwidth is printed as a fraction of it: these
kernels are memory bound, so that fraction is the figure of merit.

The kernels are called as the trainer calls them: the stochastic-rounding seed comes from a host
(CPU) generator and the quantizing calls add their NaN/Inf count into a device counter, so no
call reads anything back.  On CUDA, ``--timing device`` (the default) is the kernel's GPU time:
``triton.testing.do_bench``'s median of CUDA-event timings, with L2 flushed before each call and
the host running ahead of the GPU; the ``host us`` column is the host's enqueue time per call
(back-to-back calls, no synchronisation), which bounds a call from below when it exceeds the GPU
time.  ``--timing per-call-sync`` is what the kernel tables of 2026-11-27 in docs/performance.md
measured: the wall time of one call followed by ``torch.cuda.synchronize()``, with the seed
drawn from a CUDA generator and the non-finite count read back (two host round trips per call,
which the trainer never pays).
``--compare-kernels FILE`` also benchmarks another version of ``triton_launch.py`` (for example
a previous commit's, from ``git show``; ``triton_kernels.py`` before issue 44) in the same
process, against the same copy bandwidth. The file is loaded as a module of the kernels package:
a version from before the jit kernels moved out of the launchers holds its own kernels, a later
one imports the current ``triton_device.py`` (so it compares launchers only), also under its
earlier name ``triton_jit``.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron.distributed.quant.kernels import reference as R  # noqa: E402
from megatron.planner.calibration import SOURCES, moved_bytes  # noqa: E402

TIMINGS = ("device", "per-call-sync")


def parse_size(s: str) -> int:
    """'1M' -> 1048576, '64K' -> 65536, '1000' -> 1000."""
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


@dataclass(frozen=True)
class Timing:
    """Time per call of one benchmarked function."""

    seconds: float
    """GPU time per call (CUDA, ``--timing device``), else wall time per call."""
    host_seconds: Optional[float] = None
    """Host enqueue time per call of back-to-back calls (CUDA, ``--timing device`` only)."""


@dataclass(frozen=True)
class CallConvention:
    """How the benchmark calls the kernels: as the trainer does, or as the old tables did."""

    seed_generator: torch.Generator
    """Generator the stochastic-rounding seeds are drawn from (the trainer's is a host one)."""
    nonfinite_counter: Optional[torch.Tensor]
    """Device int32 counter the quantizing calls add their NaN/Inf count into (the trainer's
    convention: nothing read back); None: each call reads its count back and raises on one."""

    def quantizing_kwargs(self, fn: Callable) -> dict:
        """Keyword arguments for a quantizing call of ``fn``. A backend whose function takes no
        device counter (the torch reference) runs with ``check_finite=False`` under the trainer's
        convention: it has no way to count without reading back."""
        if self.nonfinite_counter is None:
            return {}
        if "nonfinite_counter" in inspect.signature(fn).parameters:
            return {"nonfinite_counter": self.nonfinite_counter}
        return {"check_finite": False}


def call_convention(dev: str, timing: str, data_generator: torch.Generator) -> CallConvention:
    """The trainer's convention (host seed generator, device counter), or with
    ``per-call-sync`` on CUDA the old tables' one (seeds from the device generator, the count
    read back by each call)."""
    if dev == "cuda" and timing == "per-call-sync":
        return CallConvention(data_generator, None)
    return CallConvention(torch.Generator().manual_seed(0),
                          torch.zeros(1, dtype=torch.int32, device=dev))


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def _wall_per_call(fn: Callable[[], object], dev: str, iters: int, warmup: int = 1) -> float:
    """Median wall seconds of one call followed by a device synchronisation."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _host_enqueue_per_call(fn: Callable[[], object], calls: int) -> float:
    """Host seconds per call to enqueue ``calls`` back-to-back calls (no synchronisation between
    them: the GPU works behind the host, as in a training step)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / calls


def time_fn(fn: Callable[[], object], dev: str, iters: int, timing: str = "device") -> Timing:
    """Time per call of ``fn`` on ``dev`` (see the module docstring for the two timings)."""
    if dev != "cuda" or timing == "per-call-sync":
        return Timing(_wall_per_call(fn, dev, iters))
    from triton.testing import do_bench
    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
    return Timing(ms / 1e3, _host_enqueue_per_call(fn, iters))


DEVICE_KERNELS_EARLIER_NAMES = ("triton_jit",)
"""Names under which earlier versions of the launchers import the device kernels
(``from .triton_jit import ...``): while such a file loads, they name the current
``triton_device`` module."""


def load_kernels(path: str):
    """Another version of ``triton_launch.py`` as a module of the kernels package (so its
    relative imports resolve, :data:`DEVICE_KERNELS_EARLIER_NAMES` included), named after the
    file: ``triton@<file stem>``."""
    stem = os.path.splitext(os.path.basename(path))[0]
    ident = "".join(c if c.isalnum() else "_" for c in stem)
    name = f"megatron.distributed.quant.kernels._bench_{ident}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--compare-kernels: cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    from megatron.distributed.quant.kernels import triton_device
    package = "megatron.distributed.quant.kernels"
    aliases = [f"{package}.{old}" for old in DEVICE_KERNELS_EARLIER_NAMES
               if f"{package}.{old}" not in sys.modules]
    for alias in aliases:
        sys.modules[alias] = triton_device
    try:
        spec.loader.exec_module(module)
    finally:
        for alias in aliases:
            sys.modules.pop(alias, None)
    return f"triton@{stem}", module


def _err(y: torch.Tensor, x: torch.Tensor) -> Tuple[float, float]:
    d = y.float() - x.float()
    return (d.norm() / x.float().norm().clamp_min(1e-30)).item(), d.abs().max().item()


def cases(impl, n: int, bits: int, gs: int, dev: str, data_gen: torch.Generator,
          conv: CallConvention, sources: int = SOURCES):
    """(name, fn, input_bytes, moved_bytes, error_fn) for every kernel; the middle and final
    hops sum ``sources`` slots (the GPUs of a node)."""
    x = torch.randn(n, device=dev, generator=data_gen)
    qb = n * bits // 8 + 4 * (n // gs)                       # packed bytes of n elements
    gen = conv.seed_generator
    if impl is R and dev == "cuda":
        # the torch reference draws all n noise values from the generator: on a host generator
        # its rows would time the CPU's RNG and a copy, not the device (the trainer never runs
        # the reference on CUDA; these rows are a comparison only)
        gen = data_gen
    qkw = conv.quantizing_kwargs(impl.quantize)
    pkw = conv.quantizing_kwargs(impl.quantize_partitions)
    dkw = conv.quantizing_kwargs(impl.quantize_difference)
    out: List[tuple] = []

    def q_err(hadamard: bool):
        return lambda: _err(impl.dequantize(impl.quantize(x, bits, gs, hadamard=hadamard,
                                                          generator=gen), hadamard=hadamard), x)

    out.append(("quantize", lambda: impl.quantize(x, bits, gs, generator=gen, **qkw),
                4 * n, moved_bytes("quantize", n, bits, gs), q_err(False)))
    out.append(("quantize+HT32", lambda: impl.quantize(x, bits, gs, hadamard=True, generator=gen,
                                                       **qkw),
                4 * n, moved_bytes("quantize_ht", n, bits, gs), q_err(True)))
    order = [0, 2, 1, 3]
    if n % (4 * gs) == 0:
        out.append(("quantize_partitions(4)+HT",
                    lambda: impl.quantize_partitions(x, 4, order, bits, gs, hadamard=True,
                                                     generator=gen, **pkw),
                    4 * n, moved_bytes("quantize_partitions_ht", n, bits, gs), q_err(True)))
    q = R.quantize(x, bits, gs, stochastic=False)
    q = type(q)(q.codes.to(dev), q.scales.to(dev), q.bits, q.group_size, q.numel)
    xq = R.dequantize(q)
    out.append(("dequantize", lambda: impl.dequantize(q), qb, moved_bytes("dequantize", n, bits, gs),
                lambda: _err(impl.dequantize(q), xq)))
    S = sources
    if n % (S * gs) == 0:
        m = n // S
        exact = xq.view(S, m).sum(0)
        out.append((f"dequant_sum_requant(S={S})",
                    lambda: impl.dequantize_sum_requantize(q, S, bits, generator=gen),
                    qb, moved_bytes("dequantize_sum_requantize", n, bits, gs, S),
                    lambda: _err(R.dequantize(impl.dequantize_sum_requantize(
                        q, S, bits, generator=gen)), exact)))
        dst = torch.empty(m, device=dev)
        out.append((f"dequant_sum(S={S})",
                    lambda: impl.dequantize_sum(q, S, out=dst),
                    qb, moved_bytes("dequantize_sum", n, bits, gs, S),
                    lambda: _err(impl.dequantize_sum(q, S), exact)))
    ref = x.bfloat16()
    new = x + 1e-3 * torch.randn(n, device=dev, generator=data_gen)
    out.append(("quantize_difference(bf16)",
                lambda: impl.quantize_difference(new, ref, bits, gs, generator=gen, **dkw),
                6 * n, moved_bytes("quantize_difference", n, bits, gs),
                lambda: _err(impl.dequantize_add(impl.quantize_difference(new, ref, bits, gs,
                                                                          generator=gen), ref),
                             new.bfloat16())))
    qd = R.quantize_difference(new, ref, bits, gs, stochastic=False)
    qd = type(qd)(qd.codes.to(dev), qd.scales.to(dev), qd.bits, qd.group_size, qd.numel)
    dd = R.dequantize_add(qd, ref)
    out.append(("dequantize_add(bf16)", lambda: impl.dequantize_add(qd, ref),
                qb + 2 * n, moved_bytes("dequantize_add", n, bits, gs),
                lambda: _err(impl.dequantize_add(qd, ref), dd)))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M", help="comma-separated element counts, e.g. 1M,16M")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--bits", default="4,8", help="comma-separated bit widths (2, 4, 8)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--sources", type=int, default=SOURCES,
                    help=f"slots the middle and final hops sum: the run's GPUs per node "
                         f"(default {SOURCES}; the 2026-11-27 tables used 4)")
    ap.add_argument("--iters", type=int, default=0,
                    help="timed calls for wall timings and the host enqueue column "
                         "(default: 3 cpu, 20 cuda)")
    ap.add_argument("--timing", choices=TIMINGS, default="device",
                    help="CUDA only: 'device' = GPU time per call, as the trainer calls the "
                         "kernels (default); 'per-call-sync' = wall time of one call + "
                         "synchronize with two read-backs per call (the kernel tables of "
                         "2026-11-27)")
    ap.add_argument("--compare-kernels", default="", metavar="FILE[,FILE]",
                    help="other versions of triton_launch.py to benchmark beside the current "
                         "one (CUDA), e.g. from `git show REV:megatron/distributed/quant/"
                         "kernels/triton_launch.py` (triton_kernels.py before issue 44)")
    ap.add_argument("--backends", default="",
                    help="comma-separated subset of the backends to run (torch, triton, cpp, "
                         "triton@<file stem>); default all")
    ap.add_argument("--json", default="", metavar="FILE",
                    help="also write every row (kernel, backend, bits, numel, seconds, moved "
                         "bytes, copy GB/s) to FILE, the form tools/planner.py --kernels-json reads")
    args = ap.parse_args(argv)
    if args.sources < 1:
        ap.error(f"--sources must be at least 1, got {args.sources}")
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda requested but CUDA is not available")
    if args.compare_kernels and dev != "cuda":
        ap.error("--compare-kernels needs --device cuda (the Triton kernels run on CUDA)")
    iters = args.iters or (3 if dev == "cpu" else 20)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    bits_list = [int(b) for b in args.bits.split(",") if b.strip()]

    backends: Dict[str, object] = {"torch": R}
    if dev == "cpu":
        from megatron.distributed.quant.kernels import cpu_kernels as C
        if C.available():
            backends["cpp"] = C
        else:
            print(f"# C++ CPU kernels unavailable: {C.build_error()!r}")
    if dev == "cuda":
        try:
            from megatron.distributed.quant.kernels import triton_launch as T
        except Exception as exc:  # the product refuses CUDA without Triton too
            ap.error(f"--device cuda: the Triton kernels cannot be imported: {exc!r}")
        backends["triton"] = T
        for path in filter(None, args.compare_kernels.split(",")):
            label, module = load_kernels(path)
            backends[label] = module
    if args.backends:
        wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
        unknown = sorted(set(wanted) - set(backends))
        if unknown:
            ap.error(f"--backends: {unknown} not among the available {sorted(backends)}")
        backends = {k: v for k, v in backends.items() if k in wanted}

    data_gen = torch.Generator(device=dev).manual_seed(0)
    conv = call_convention(dev, args.timing, data_gen)
    timing = args.timing if dev == "cuda" else "wall"
    print(f"# device={dev} ({torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}), "
          f"group_size={args.group_size}, timing={timing}, iters={iters}")
    rows: List[dict] = []
    width = max(7, *(len(b) for b in backends))
    hdr = (f"{'kernel':<28} {'backend':<{width}} {'bits':>4} {'numel':>10} {'ms':>9} "
           f"{'host us':>8} {'in GB/s':>8} {'mv GB/s':>8} {'%copy':>6} {'relL2':>9} {'maxabs':>9}")
    for n in sizes:
        copy_bw = None
        if dev == "cuda":
            src = torch.randn(n, device=dev)
            dst = torch.empty_like(src)
            copy_bw = 8 * n / time_fn(lambda: dst.copy_(src), dev, iters, args.timing).seconds / 1e9
            print(f"# n={n}: device-to-device copy {copy_bw:.1f} GB/s (read+write)")
        print(hdr)
        for bits in bits_list:
            for bname, impl in backends.items():
                for name, fn, in_b, mv_b, err_fn in cases(impl, n, bits, args.group_size, dev,
                                                          data_gen, conv, args.sources):
                    t = time_fn(fn, dev, iters, args.timing)
                    rel, mx = err_fn()
                    mv = mv_b / t.seconds / 1e9
                    rows.append({"kernel": name, "backend": bname, "bits": bits, "numel": n,
                                 "group_size": args.group_size, "seconds": t.seconds,
                                 "moved_bytes": mv_b, "copy_gbps": copy_bw})
                    frac = f"{100 * mv / copy_bw:5.1f}" if copy_bw else "   - "
                    host = f"{1e6 * t.host_seconds:8.1f}" if t.host_seconds is not None else "       -"
                    print(f"{name:<28} {bname:<{width}} {bits:>4} {n:>10} {1e3 * t.seconds:>9.3f} "
                          f"{host} {in_b / t.seconds / 1e9:>8.2f} {mv:>8.2f} {frac:>6} "
                          f"{rel:>9.2e} {mx:>9.2e}")
        if conv.nonfinite_counter is not None and int(conv.nonfinite_counter.item()):
            print(f"# WARNING: the kernels counted {int(conv.nonfinite_counter.item())} non-finite "
                  f"inputs (expected none)")
    if args.json:
        name = torch.cuda.get_device_name() if dev == "cuda" else f"CPU ({os.cpu_count()} cores)"
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"device": name, "timing": timing, "rows": rows},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
