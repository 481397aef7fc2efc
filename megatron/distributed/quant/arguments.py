"""Command-line flags of the quantized communication layer.

Names and defaults follow the SDP4Bit reference (`--quantized-weights`, `--gq-group-size-intra`, ...)
plus our own additions (`--quantized-grad-bits`, `--data-parallel-intra-node-size`, LoCo,
`--grad-accum-dtype`). :meth:`QuantizationConfig.from_args` turns them into the one config object.
"""

from __future__ import annotations

import argparse


def add_quantization_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="quantized communication (SDP4Bit / LoCo)")
    group.add_argument("--quantized-weights", action="store_true",
                       help="Quantize the distributed optimizer's parameter all-gather "
                            "(qWD: weight differences; see --weight-quantization-mode).")
    group.add_argument("--weight-quantization-bits", type=int, default=4, choices=(2, 4, 8),
                       help="Bits per weight(-difference) element on the wire.")
    group.add_argument("--wq-group-size", type=int, default=2048,
                       help="Elements per weight quantization group (one fp32 scale each).")
    group.add_argument("--weight-quantization-mode", choices=("diff", "direct"), default="diff",
                       help="'diff' = qWD (quantize new - reconstructed weights, SDP4Bit); "
                            "'direct' = qW / ZeRO++ qwZ (quantize the weights themselves).")
    group.add_argument("--quantized-gradients", action="store_true",
                       help="Replace the gradient reduce-scatter by the two-level quantized "
                            "all-to-all (TLq).")
    group.add_argument("--quantized-grad-bits", type=int, default=None, choices=(2, 4, 8),
                       help="Short form: turn on --quantized-gradients with N bits on the "
                            "inter-node hop.")
    group.add_argument("--gradient-quantization-bits-intra", type=int, default=8, choices=(2, 4, 8))
    group.add_argument("--gq-group-size-intra", type=int, default=512)
    group.add_argument("--gradient-quantization-bits-inter", type=int, default=4, choices=(2, 4, 8))
    group.add_argument("--gq-group-size-inter", type=int, default=128,
                       help="Group size of the inter-node hop (really used, unlike the reference).")
    group.add_argument("--hadamard-transform", action="store_true",
                       help="Walsh-Hadamard smoothing of gradients before quantization (TLq-HS).")
    group.add_argument("--hadamard-block-size", type=int, default=32,
                       help="Hadamard block (power of two dividing both gradient group sizes).")
    group.add_argument("--gradients-quantization-start-iteration", type=int, default=0,
                       help="Use the exact reduce-scatter before this iteration.")
    group.add_argument("--data-parallel-intra-node-size", type=int, default=None,
                       help="Data-parallel ranks per node for two-level grouping "
                            "(default LOCAL_WORLD_SIZE // tensor-model-parallel-size). Set it to "
                            "emulate several nodes on one host, e.g. 4 ranks as 2 nodes x 2.")
    group.add_argument("--no-stochastic-rounding", dest="stochastic_rounding", action="store_false",
                       help="Round to nearest instead of seeded stochastic rounding.")
    group.add_argument("--loco", action="store_true",
                       help="LoCo error-feedback compensation of low-bit gradients.")
    group.add_argument("--loco-error-beta", type=float, default=0.8,
                       help="Moving-average coefficient of the stored compression error.")
    group.add_argument("--loco-reset-interval", type=int, default=1024,
                       help="Zero the error buffers every this many optimizer steps.")
    group.add_argument("--loco-error-bits", type=int, default=8, choices=(8, 32),
                       help="Storage precision of the error buffers (8 = int8 with per-group scales).")
    group.add_argument("--grad-accum-dtype", choices=("fp32", "bf16"), default=None,
                       help="dtype micro-batch gradients accumulate in, independent of the wire "
                            "format (default: megatron-core's, fp32 for --bf16).")
    return parser
