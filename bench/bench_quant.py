#!/usr/bin/env python
"""Throughput and error of the quantization kernels (torch reference vs Triton / C++ CPU).

Examples::

    python bench/bench_quant.py --sizes 1M --device cpu
    python bench/bench_quant.py --sizes 16M,128M --device cuda --bits 4,8

For every kernel and size it prints the time per call, throughput in GB/s of *input* bytes, the
bytes moved (read + written) per second, and the error of the round trip (relative L2 and max
abs).  Triton runs only on CUDA; the fused C++ backend (``cpp``) only on CPU.  On CUDA the device-to-device copy bandwidth (``dst.copy_(src)``
of the fp32 tensor, counted as read + write) is measured too and each kernel's moved-bytes
bandwidth is printed as a fraction of it: these kernels are memory bound, so that fraction is the
figure of merit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron.distributed.quant.kernels import reference as R  # noqa: E402

NUM_SOURCES = 4


def parse_size(s: str) -> int:
    """'1M' -> 1048576, '64K' -> 65536, '1000' -> 1000."""
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], object], dev: str, iters: int, warmup: int = 1) -> float:
    """Median seconds per call."""
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


def _err(y: torch.Tensor, x: torch.Tensor) -> Tuple[float, float]:
    d = y.float() - x.float()
    return (d.norm() / x.float().norm().clamp_min(1e-30)).item(), d.abs().max().item()


def cases(impl, n: int, bits: int, gs: int, dev: str, gen: torch.Generator):
    """(name, fn, input_bytes, moved_bytes, error_fn) for every kernel."""
    x = torch.randn(n, device=dev, generator=gen)
    qb = n * bits // 8 + 4 * (n // gs)                       # packed bytes of n elements
    out: List[tuple] = []

    def q_err(hadamard: bool):
        return lambda: _err(impl.dequantize(impl.quantize(x, bits, gs, hadamard=hadamard,
                                                          generator=gen), hadamard=hadamard), x)

    out.append(("quantize", lambda: impl.quantize(x, bits, gs, generator=gen),
                4 * n, 4 * n + qb, q_err(False)))
    out.append(("quantize+HT32", lambda: impl.quantize(x, bits, gs, hadamard=True, generator=gen),
                4 * n, 4 * n + qb, q_err(True)))
    order = [0, 2, 1, 3]
    if n % (4 * gs) == 0:
        out.append(("quantize_partitions(4)+HT",
                    lambda: impl.quantize_partitions(x, 4, order, bits, gs, hadamard=True,
                                                     generator=gen),
                    4 * n, 4 * n + qb, q_err(True)))
    q = R.quantize(x, bits, gs, stochastic=False)
    q = type(q)(q.codes.to(dev), q.scales.to(dev), q.bits, q.group_size, q.numel)
    xq = R.dequantize(q)
    out.append(("dequantize", lambda: impl.dequantize(q), qb, qb + 4 * n,
                lambda: _err(impl.dequantize(q), xq)))
    if n % (NUM_SOURCES * gs) == 0:
        m = n // NUM_SOURCES
        exact = xq.view(NUM_SOURCES, m).sum(0)
        mb = m * bits // 8 + 4 * (m // gs)
        out.append((f"dequant_sum_requant(S={NUM_SOURCES})",
                    lambda: impl.dequantize_sum_requantize(q, NUM_SOURCES, bits, generator=gen),
                    qb, qb + mb,
                    lambda: _err(R.dequantize(impl.dequantize_sum_requantize(
                        q, NUM_SOURCES, bits, generator=gen)), exact)))
        dst = torch.empty(m, device=dev)
        out.append((f"dequant_sum(S={NUM_SOURCES})",
                    lambda: impl.dequantize_sum(q, NUM_SOURCES, out=dst),
                    qb, qb + 4 * m, lambda: _err(impl.dequantize_sum(q, NUM_SOURCES), exact)))
    ref = x.bfloat16()
    new = x + 1e-3 * torch.randn(n, device=dev, generator=gen)
    out.append(("quantize_difference(bf16)",
                lambda: impl.quantize_difference(new, ref, bits, gs, generator=gen),
                6 * n, 6 * n + qb,
                lambda: _err(impl.dequantize_add(impl.quantize_difference(new, ref, bits, gs,
                                                                          generator=gen), ref),
                             new.bfloat16())))
    qd = R.quantize_difference(new, ref, bits, gs, stochastic=False)
    qd = type(qd)(qd.codes.to(dev), qd.scales.to(dev), qd.bits, qd.group_size, qd.numel)
    dd = R.dequantize_add(qd, ref)
    out.append(("dequantize_add(bf16)", lambda: impl.dequantize_add(qd, ref),
                qb + 2 * n, qb + 4 * n, lambda: _err(impl.dequantize_add(qd, ref), dd)))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M", help="comma-separated element counts, e.g. 1M,16M")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--bits", default="4,8", help="comma-separated bit widths (2, 4, 8)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--iters", type=int, default=0, help="timed iterations (default: 3 cpu, 20 cuda)")
    args = ap.parse_args(argv)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda requested but CUDA is not available")
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
            from megatron.distributed.quant.kernels import triton_kernels as T
            backends["triton"] = T
        except Exception as exc:  # pragma: no cover
            print(f"# triton unavailable: {exc!r}")

    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"# device={dev} ({torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}), "
          f"group_size={args.group_size}, iters={iters}")
    hdr = (f"{'kernel':<28} {'backend':<7} {'bits':>4} {'numel':>10} {'ms':>9} {'in GB/s':>8} "
           f"{'mv GB/s':>8} {'%copy':>6} {'relL2':>9} {'maxabs':>9}")
    for n in sizes:
        copy_bw = None
        if dev == "cuda":
            src = torch.randn(n, device=dev)
            dst = torch.empty_like(src)
            t = time_fn(lambda: dst.copy_(src), dev, iters)
            copy_bw = 8 * n / t / 1e9
            print(f"# n={n}: device-to-device copy {copy_bw:.1f} GB/s (read+write)")
        print(hdr)
        for bits in bits_list:
            for bname, impl in backends.items():
                for name, fn, in_b, mv_b, err_fn in cases(impl, n, bits, args.group_size, dev, gen):
                    t = time_fn(fn, dev, iters)
                    rel, mx = err_fn()
                    mv = mv_b / t / 1e9
                    frac = f"{100 * mv / copy_bw:5.1f}" if copy_bw else "   - "
                    print(f"{name:<28} {bname:<7} {bits:>4} {n:>10} {1e3 * t:>9.3f} "
                          f"{in_b / t / 1e9:>8.2f} {mv:>8.2f} {frac:>6} {rel:>9.2e} {mx:>9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
