"""Command-line flags of the quantized communication layer, and which flag needs which switch.

Names and defaults follow the SDP4Bit reference (`--quantized-weights`, `--gq-group-size-intra`, ...)
plus our own additions (`--quantized-grad-bits`, `--data-parallel-intra-node-size`, LoCo,
`--grad-accum-dtype`). :meth:`QuantizationConfig.from_args` turns them into the one config object.

A sub-flag (``--hadamard-transform``) without the switch that turns its path on
(``--quantized-gradients``) would silently do nothing, so :func:`check_flag_dependencies` refuses it
at parse time; :data:`REQUIRES` is the one table of which flag needs which switch.
"""

from __future__ import annotations

import argparse
from typing import AbstractSet, Any, Callable, Dict, List, Tuple


def add_quantization_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="quantized communication (SDP4Bit / LoCo)")
    group.add_argument("--quantized-weights", action="store_true",
                       help="Quantize the distributed optimizer's parameter all-gather "
                            "(qWD: weight differences; see --weight-quantization-mode).")
    group.add_argument("--weight-quantization-bits", type=int, default=4, choices=(2, 4, 8),
                       help="Bits per weight(-difference) element on the wire (needs "
                            "--quantized-weights).")
    group.add_argument("--wq-group-size", type=int, default=2048,
                       help="Elements per weight quantization group (one fp32 scale each; needs "
                            "--quantized-weights).")
    group.add_argument("--weight-quantization-mode", choices=("diff", "direct"), default="diff",
                       help="'diff' = qWD (quantize new - reconstructed weights, SDP4Bit); "
                            "'direct' = qW / ZeRO++ qwZ (quantize the weights themselves). Needs "
                            "--quantized-weights.")
    group.add_argument("--quantized-gradients", action="store_true",
                       help="Replace the gradient reduce-scatter by the two-level quantized "
                            "all-to-all (TLq).")
    group.add_argument("--quantized-grad-bits", type=int, default=None, choices=(2, 4, 8),
                       help="Short form: turn on --quantized-gradients with N bits on the "
                            "inter-node hop.")
    group.add_argument("--gradient-quantization-bits-intra", type=int, default=8, choices=(2, 4, 8),
                       help="Bits on the intra-node hop (needs --quantized-gradients).")
    group.add_argument("--gq-group-size-intra", type=int, default=512,
                       help="Group size of the intra-node hop (needs --quantized-gradients).")
    group.add_argument("--gradient-quantization-bits-inter", type=int, default=4, choices=(2, 4, 8),
                       help="Bits on the inter-node hop (needs --quantized-gradients).")
    group.add_argument("--gq-group-size-inter", type=int, default=128,
                       help="Group size of the inter-node hop (really used, unlike the reference; "
                            "needs --quantized-gradients).")
    group.add_argument("--hadamard-transform", action="store_true",
                       help="Walsh-Hadamard smoothing of gradients before quantization (TLq-HS; "
                            "needs --quantized-gradients).")
    group.add_argument("--hadamard-block-size", type=int, default=32,
                       help="Hadamard block (power of two dividing both gradient group sizes; "
                            "needs --hadamard-transform).")
    group.add_argument("--gradient-alltoall-pipeline", type=int, default=1,
                       help="Split each bucket's quantized reduce-scatter into K chunks so the "
                            "intra-node exchange of chunk i+1 overlaps the inter-node exchange of "
                            "chunk i (the SDP4Bit reference's name; numerics do not depend on K; "
                            "needs --quantized-gradients).")
    group.add_argument("--gradients-quantization-start-iteration", type=int, default=0,
                       help="Use the exact reduce-scatter before this iteration (needs "
                            "--quantized-gradients).")
    group.add_argument("--data-parallel-intra-node-size", type=int, default=None,
                       help="Data-parallel ranks per node for two-level grouping "
                            "(default LOCAL_WORLD_SIZE // tensor-model-parallel-size); must divide "
                            "the data-parallel size. Set it to emulate several nodes on one host, "
                            "e.g. 4 ranks as 2 nodes x 2.")
    group.add_argument("--no-stochastic-rounding", dest="stochastic_rounding", action="store_false",
                       help="Round to nearest instead of seeded stochastic rounding (needs "
                            "--quantized-weights or --quantized-gradients).")
    group.add_argument("--loco", action="store_true",
                       help="LoCo error-feedback compensation of low-bit gradients (needs "
                            "--quantized-gradients).")
    group.add_argument("--loco-error-beta", type=float, default=0.8,
                       help="Moving-average coefficient of the stored compression error (needs "
                            "--loco).")
    group.add_argument("--loco-reset-interval", type=int, default=1024,
                       help="Zero the error buffers every this many optimizer steps (needs --loco).")
    group.add_argument("--loco-error-bits", type=int, default=8, choices=(8, 32),
                       help="Storage precision of the error buffers (8 = int8 with per-group "
                            "scales; needs --loco).")
    group.add_argument("--quantization-error-interval", type=int, default=0, metavar="N",
                       help="Every N iterations also run the exact reduce-scatter beside each "
                            "quantized one (and compare the quantized weight gather with the exact "
                            "weights) and log the relative error and cosine (quant_error_* in the "
                            "log line, tensorboard and jsonl); those iterations run without "
                            "communication overlap. 0 = off. Needs --quantized-weights or "
                            "--quantized-gradients.")
    group.add_argument("--grad-accum-dtype", choices=("fp32", "bf16"), default=None,
                       help="dtype micro-batch gradients accumulate in, independent of the wire "
                            "format (default: megatron-core's, fp32 for --bf16).")
    return parser


def gradients_quantized(args: Any) -> bool:
    """``--quantized-gradients`` or its short form ``--quantized-grad-bits N`` is given."""
    return bool(args.quantized_gradients) or args.quantized_grad_bits is not None


SWITCHES: Dict[str, Tuple[str, Callable[[Any], bool]]] = {
    "weights": ("--quantized-weights", lambda a: bool(a.quantized_weights)),
    "gradients": ("--quantized-gradients (or --quantized-grad-bits N)", gradients_quantized),
    "any": ("--quantized-weights or --quantized-gradients",
            lambda a: bool(a.quantized_weights) or gradients_quantized(a)),
    "hadamard": ("--hadamard-transform", lambda a: bool(a.hadamard_transform)),
    "loco": ("--loco", lambda a: bool(a.loco)),
}
"""Switch name -> (how to turn it on, is it on for these args)."""

REQUIRES: Dict[str, Tuple[str, str]] = {
    "weight_quantization_bits": ("--weight-quantization-bits", "weights"),
    "wq_group_size": ("--wq-group-size", "weights"),
    "weight_quantization_mode": ("--weight-quantization-mode", "weights"),
    "gradient_quantization_bits_intra": ("--gradient-quantization-bits-intra", "gradients"),
    "gradient_quantization_bits_inter": ("--gradient-quantization-bits-inter", "gradients"),
    "gq_group_size_intra": ("--gq-group-size-intra", "gradients"),
    "gq_group_size_inter": ("--gq-group-size-inter", "gradients"),
    "hadamard_transform": ("--hadamard-transform", "gradients"),
    "gradient_alltoall_pipeline": ("--gradient-alltoall-pipeline", "gradients"),
    "gradients_quantization_start_iteration": ("--gradients-quantization-start-iteration",
                                               "gradients"),
    "loco": ("--loco", "gradients"),
    "hadamard_block_size": ("--hadamard-block-size", "hadamard"),
    "loco_error_beta": ("--loco-error-beta", "loco"),
    "loco_reset_interval": ("--loco-reset-interval", "loco"),
    "loco_error_bits": ("--loco-error-bits", "loco"),
    "stochastic_rounding": ("--no-stochastic-rounding", "any"),
    "quantization_error_interval": ("--quantization-error-interval", "any"),
}
"""Sub-flag dest -> (its option string, the switch in :data:`SWITCHES` it only acts under).
``--data-parallel-intra-node-size`` and ``--grad-accum-dtype`` are not here: they describe the
machine / the accumulation and mean the same with or without quantization."""


def check_flag_dependencies(args: Any, given: AbstractSet[str]) -> None:
    """Refuse sub-flags given (``given``: dests passed on the command line) without their switch,
    and a ``--quantized-grad-bits`` that contradicts ``--gradient-quantization-bits-inter``.

    Raises ValueError naming every offending flag and the switch to add, e.g.
    ``--hadamard-transform acts only with --quantized-gradients (or --quantized-grad-bits N): add
    it, or drop --hadamard-transform``.
    """
    missing: Dict[str, List[str]] = {}
    for dest in sorted(given):
        if dest in REQUIRES:
            flag, switch = REQUIRES[dest]
            if not SWITCHES[switch][1](args):
                missing.setdefault(switch, []).append(flag)
    problems = []
    for switch, flags in missing.items():
        listed = ", ".join(flags)
        problems.append(f"{listed} {'acts' if len(flags) == 1 else 'act'} only with "
                        f"{SWITCHES[switch][0]}: add it, or drop {listed}")
    bits = getattr(args, "quantized_grad_bits", None)
    if (bits is not None and "gradient_quantization_bits_inter" in given
            and args.gradient_quantization_bits_inter != bits):
        problems.append(f"--quantized-grad-bits {bits} sets the inter-node bits, "
                        f"--gradient-quantization-bits-inter {args.gradient_quantization_bits_inter} "
                        f"contradicts it: give only one")
    if problems:
        raise ValueError("; ".join(problems))
