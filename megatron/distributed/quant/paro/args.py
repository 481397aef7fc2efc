"""The PaRO flags (``--paro-*``) and their checks against the rest of the command line.

:func:`add_paro_args` registers them (the trainer's parser calls it through
:func:`..integration.add_arguments`); :meth:`..config.ParoConfig.from_args` reads them into the
run's config and :meth:`..config.ParoConfig.resolved` finishes them (canonical name, group size);
:func:`check_paro_args` is the one place a strategy is accepted or refused against the rest of
the command line, with the reason and the fix. See docs/paro.md.
"""

from __future__ import annotations

import argparse

from ..config import QuantizationConfig
from .strategy import AUTO, Level, PaRoStrategy, uses_engine

__all__ = ["add_paro_args", "check_paro_args"]


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


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_paro_args(args: argparse.Namespace, quant: QuantizationConfig) -> None:
    """Accept or refuse the strategy of ``quant.paro`` for this run (ValueError with the fix).

    ``quant`` is the run's config (``integration.build_quantization_config``: the strategy's
    spelling and group size already resolved); ``args`` the rest of the command line, read here
    at argument validation and never written. NNN / NNG run on megatron-core (with the matching
    ``--use-distributed-optimizer``, checked when the strategy was parsed); the other 12 on the
    PaRO engine, which needs pure data parallelism, bf16 or fp32, ``--overlap-param-gather`` only
    where parameters are partitioned (p = I / G), ``--ckpt-format torch``, and quantization only
    where the engine supports it (``engine.quantization_support_error``).
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
            from .engine import quantization_support_error

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
