"""Single-process CPU cost of the quantization kernels (ns per element), torch reference vs the
fused C++ backend: the numbers behind the "quantizer CPU time vs wire time" analysis in
docs/emulated_network.md and the CPU table in docs/performance.md.

    OMP_NUM_THREADS=1 python3 bench/emulated_network/profile_quant_kernels.py [--numel 2097152]
        [--backends torch,cpp] [--repeats 5]

Each case is timed with the public dispatcher under ``QUANT_KERNELS=<backend>``; the figure is
the median of ``--repeats`` calls divided by ``--numel`` (elements of the op's input tensor).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=int, default=2_097_152, help="multiple of 4*2048")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backends", default="torch,cpp", help="comma list of torch, cpp, triton")
    args = p.parse_args()
    import torch
    from megatron.distributed.quant.kernels import dispatch as K
    from megatron.distributed.quant.kernels.dispatch import (count_nonfinite, dequantize_add,
                                                    dequantize_sum, dequantize_sum_requantize,
                                                    quantize, quantize_difference,
                                                    quantize_partitions)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    n = args.numel
    x = torch.randn(n)
    g = torch.Generator().manual_seed(0)
    ref = (x + 0.01 * torch.randn(n)).to(torch.bfloat16)
    os.environ["QUANT_KERNELS"] = "torch"
    q8 = quantize(x, 8, 128, stochastic=False, check_finite=False)
    q4 = quantize(x, 4, 2048, stochastic=False, check_finite=False)
    out = torch.empty(n // 2)
    cases = [
        ("quantize_partitions 8-bit g128 Hadamard SR", lambda: quantize_partitions(
            x, 4, [0, 2, 1, 3], 8, 128, stochastic=True, generator=g, hadamard=True,
            hadamard_block=32, check_finite=False)),
        ("quantize_partitions 8-bit g128 Had. SR check", lambda: quantize_partitions(
            x, 4, [0, 2, 1, 3], 8, 128, stochastic=True, generator=g, hadamard=True,
            hadamard_block=32, check_finite=True)),
        ("quantize 4-bit g128 SR", lambda: quantize(x, 4, 128, stochastic=True, generator=g,
                                                    check_finite=False)),
        ("quantize 4-bit g128 RN", lambda: quantize(x, 4, 128, stochastic=False,
                                                    check_finite=False)),
        ("dequantize_sum 2 src Hadamard (n/elem in)", lambda: dequantize_sum(
            q8, 2, hadamard=True, hadamard_block=32, out=out)),
        ("dequantize_sum_requantize 8->4 SR (/elem in)", lambda: dequantize_sum_requantize(
            q8, 2, 4, group_size_out=128, stochastic=True, generator=g)),
        ("quantize_difference 4-bit g2048 SR bf16", lambda: quantize_difference(
            x, ref, 4, 2048, stochastic=True, generator=g, check_finite=False)),
        ("dequantize_add bf16 in place", lambda: dequantize_add(q4, ref, out=ref)),
        ("count_nonfinite (fp32)", lambda: count_nonfinite(x)),
        ("torch.isfinite(x).all() (reference point)", lambda: bool(torch.isfinite(x).all())),
        ("torch.rand (reference point)", lambda: torch.rand(n, generator=g)),
        ("x.to(bf16) (reference point)", lambda: x.to(torch.bfloat16)),
    ]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    res = {}
    for b in backends:
        os.environ["QUANT_KERNELS"] = b
        try:
            K.backend_for(x)
        except Exception as exc:  # backend not available here
            print(f"backend {b}: unavailable ({exc})")
            continue
        for name, fn in cases:
            fn()
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            times.sort()
            res[(name, b)] = times[len(times) // 2] / n * 1e9
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    done = [b for b in backends if any(k[1] == b for k in res)]
    print(f"numel {n:,}, threads {torch.get_num_threads()}, load average {load:.2f}")
    print("| kernel | " + " | ".join(f"{b} ns/elem" for b in done)
          + (" | speedup |" if len(done) == 2 else " |"))
    print("|---|" + "---:|" * (len(done) + (1 if len(done) == 2 else 0)))
    for name, _fn in cases:
        vals = [res.get((name, b)) for b in done]
        row = f"| {name} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in vals)
        if len(done) == 2 and None not in vals and "reference point" not in name:
            row += f" | {vals[0] / vals[1]:.1f}x |"
        else:
            row += " |" + (" |" if len(done) == 2 else "")
        print(row)


if __name__ == "__main__":
    main()
