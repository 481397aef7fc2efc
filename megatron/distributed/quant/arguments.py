"""Every command-line flag of the quantized communication layer, and the checks on them.

Registration: :func:`add_quantization_args` (SDP4Bit / LoCo, names and defaults of the SDP4Bit
reference plus ours) and :func:`add_paro_args` (``--paro-*``); :meth:`QuantizationConfig.from_args`
turns them into the one config object. Checks, both at argument validation:
:func:`check_flag_dependencies` refuses a sub-flag without the switch that turns its path on (it
would silently do nothing; :data:`REQUIRES` is the table), and :func:`check_paro_args` accepts or
refuses a PaRO strategy against the rest of the command line (see docs/paro.md).
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, AbstractSet, Any, Callable, Dict, List, Tuple

from .paro.strategy import AUTO, Level, PaRoStrategy, quantization_support_error, uses_engine

if TYPE_CHECKING:
    from .config import QuantizationConfig

__all__ = ["add_quantization_args", "add_paro_args", "gradients_quantized", "SWITCHES", "REQUIRES",
           "check_flag_dependencies", "check_paro_args"]


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


def add_paro_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the PaRO flags (the trainer's parser must call this; see docs/paro.md)."""
    group = parser.add_argument_group(title="PaRO (partial redundancy optimizer)")
    group.add_argument("--paro-strategy", type=str, default=None,
                       help="Partition levels of parameters, gradients, optimizer states, each "
                            "N (replicated), I (within a group) or G (global), e.g. NIG, IIG; "
                            "aliases ddp, zero1, zero2, zero3, mics; or 'auto' (cheapest modelled "
                            "communication that fits in memory). NNN and NNG (ZeRO-1, needs "
                            "--use-distributed-optimizer) run on megatron-core, the other 12 on the "
                            "PaRO engine (TP=PP=1, bf16/fp32); prints the memory/communication report.")
    group.add_argument("--paro-group-size", type=int, default=None,
                       help="Data-parallel ranks per PaRO group (default LOCAL_WORLD_SIZE // TP, "
                            "i.e. one node).")
    group.add_argument("--paro-gpu-memory-gb", type=float, default=None,
                       help="Memory per GPU (GB = 1e9 bytes) that --paro-strategy auto may fill "
                            "with model states, less --paro-reserved-memory-gb (default: the "
                            "device's total memory).")
    group.add_argument("--paro-reserved-memory-gb", type=float, default=None,
                       help="Memory per GPU kept for activations and workspace when choosing "
                            "automatically (default: none when --paro-gpu-memory-gb is given; "
                            "else a tenth of the device memory plus the estimated activations of "
                            "one micro-batch).")
    group.add_argument("--paro-intra-bandwidth-gbs", type=float, default=150.0,
                       help="Intra-group (NVLink) bandwidth per GPU in GB/s for the cost model.")
    group.add_argument("--paro-inter-bandwidth-gbs", type=float, default=12.5,
                       help="Inter-group (RDMA) bandwidth per GPU in GB/s for the cost model.")
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


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_paro_args(args: argparse.Namespace, quant: "QuantizationConfig") -> None:
    """Accept or refuse the strategy of ``quant.paro`` for this run (ValueError with the fix).

    ``quant`` is the run's config (``integration.build_quantization_config``: the strategy's
    spelling and group size already resolved); ``args`` the rest of the command line, read here
    at argument validation and never written. NNN / NNG run on megatron-core (with the matching
    ``--use-distributed-optimizer``, checked when the strategy was parsed); the other 12 on the
    PaRO engine, which needs pure data parallelism, bf16 or fp32, ``--overlap-param-gather`` only
    where parameters are partitioned (p = I / G), ``--ckpt-format torch``, and quantization only
    where the engine supports it (:func:`.paro.strategy.quantization_support_error`).
    """
    strategy, group_size = quant.paro.strategy, quant.paro.group_size
    if uses_engine(strategy):
        what = ("--paro-strategy auto (it may pick a PaRO-engine strategy)"
                if strategy == AUTO else f"--paro-strategy {strategy} (PaRO engine)")
        _require(args.tensor_model_parallel_size == 1 and args.pipeline_model_parallel_size == 1,
                 f"{what} needs --tensor-model-parallel-size 1 and "
                 f"--pipeline-model-parallel-size 1 (pure data parallelism)")
        _require(not args.fp16, f"{what} supports --bf16 and fp32, not --fp16 (no loss scaling)")
        _require(not args.overlap_param_gather_with_optimizer_step,
                 f"{what} gathers parameters in its hooks, not after the optimizer step: drop "
                 f"--overlap-param-gather-with-optimizer-step (--overlap-param-gather overlaps "
                 f"the hooks' gathers where parameters are partitioned)")
        if strategy != AUTO:
            _require(not args.overlap_param_gather
                     or PaRoStrategy.from_string(strategy).params != Level.N,
                     f"{what} keeps the full parameters on every rank (p = N): there are no "
                     f"per-micro-step gathers to overlap; drop --overlap-param-gather")
        if strategy == AUTO:
            _require(not quant.enabled,
                     "--paro-strategy auto cannot be combined with quantized communication "
                     "(not every strategy supports it): pass an explicit strategy")
        else:
            err = quantization_support_error(strategy, quant)
            _require(err is None, err or "")
            intra = quant.data_parallel_intra_node_size
            _require(not quant.enabled or intra is None or intra == group_size,
                     f"{what}: --data-parallel-intra-node-size {intra} differs from "
                     f"--paro-group-size {group_size}; the engine quantizes inside "
                     f"the PaRO groups")
        _require(args.ckpt_format != "torch_dist",
                 f"--ckpt-format torch_dist saves megatron-core's sharded state dicts; "
                 f"--paro-strategy {strategy} may train on the PaRO engine, which saves "
                 f"--ckpt-format torch")
