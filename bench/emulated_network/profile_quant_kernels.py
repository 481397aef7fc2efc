"""Single-process CPU cost of the quantization kernels (ns per element), the numbers behind the
"quantizer CPU time vs wire time" analysis in docs/emulated_network.md.

    OMP_NUM_THREADS=1 python3 bench/emulated_network/profile_quant_kernels.py [--numel 2097152]
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
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    import torch
    from megatron.distributed.quant.kernels import (dequantize_add, dequantize_sum,
                                                    dequantize_sum_requantize, quantize,
                                                    quantize_difference, quantize_partitions)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    n = args.numel
    x = torch.randn(n)
    g = torch.Generator().manual_seed(0)
    ref = x.to(torch.bfloat16)
    q8 = quantize(x, 8, 128, stochastic=False, check_finite=False)
    q4 = quantize(x, 4, 2048, stochastic=False, check_finite=False)
    cases = [
        ("quantize_partitions 8-bit g128 Hadamard SR", lambda: quantize_partitions(
            x, 4, [0, 2, 1, 3], 8, 128, stochastic=True, generator=g, hadamard=True,
            hadamard_block=32, check_finite=False)),
        ("quantize 4-bit g128 SR", lambda: quantize(x, 4, 128, stochastic=True, generator=g,
                                                    check_finite=False)),
        ("dequantize_sum 2 sources Hadamard", lambda: dequantize_sum(q8, 2, hadamard=True,
                                                                     hadamard_block=32)),
        ("dequantize_sum_requantize 8->4-bit", lambda: dequantize_sum_requantize(
            q8, 2, 4, group_size_out=128, stochastic=True, generator=g)),
        ("quantize_difference 4-bit g2048 SR", lambda: quantize_difference(
            x, ref, 4, 2048, stochastic=True, generator=g, check_finite=False)),
        ("dequantize_add bf16", lambda: dequantize_add(q4, ref)),
        ("torch.rand (reference point)", lambda: torch.rand(n, generator=g)),
    ]
    print(f"numel {n:,}, threads {torch.get_num_threads()}")
    for name, fn in cases:
        fn()
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            fn()
        dt = (time.perf_counter() - t0) / args.repeats
        print(f"{name:45s} {dt * 1e3:8.1f} ms  {dt / n * 1e9:6.1f} ns/elem")


if __name__ == "__main__":
    main()
