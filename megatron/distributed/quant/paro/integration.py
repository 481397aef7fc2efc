"""The PaRO side of :mod:`..integration`: build the engine, resolve ``auto``, the startup report.

Only :mod:`..integration` calls this module (the trainer never does). NNN / NNG (and no
``--paro-strategy``) stay on megatron-core's DDP; every other strategy wraps the model chunk in
:class:`.engine.ParoDataParallel` and uses :class:`.optimizer.ParoOptimizer`. What the run's
flags say comes from the config (:class:`..config.ParoConfig`, read once at argument
validation), never from the trainer's ``args``; ``auto`` is returned as a new config
(:class:`AutoStrategy`) for the trainer to record.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

from ..config import ParoConfig, QuantizationConfig

__all__ = ["is_engine", "wrap_with_engine", "build_engine_optimizer", "resolve_auto_strategy",
           "AutoStrategy", "reserved_bytes_for_auto", "strategy_report"]


def is_engine(chunk: Any) -> bool:
    """True for a model chunk wrapped by the PaRO engine."""
    from .engine import ParoDataParallel

    return isinstance(chunk, ParoDataParallel)


def wrap_with_engine(config: Any, ddp_config: Any, model_chunks: List[torch.nn.Module],
                     quant_config: QuantizationConfig, strategy: str,
                     group_size: int) -> List[torch.nn.Module]:
    """Wrap the (single) model chunk in the PaRO engine over this rank's data-parallel group.

    The engine takes what megatron-core's DDP would: the gradient-accumulation dtype
    (``ddp_config.grad_reduce_in_fp32`` after ``--grad-accum-dtype``, else the parameter dtype) and
    the bucket-size cap (``ddp_config.bucket_size``; None: one bucket per layer), and
    ``--overlap-grad-reduce`` (``ddp_config.overlap_grad_reduce``: the gradient reduce-scatters on
    the communication stages, over a second set of groups) and ``--overlap-param-gather``
    (``ddp_config.overlap_param_gather``, parameters at level I / G: the parameter gathers on the
    ``weights`` stage one bucket ahead, over a third set)."""
    from megatron.core import parallel_state as ps

    from ..grad_accum import apply_grad_accum_dtype
    from ..placement import agree_across_ranks
    from .comm import build_paro_groups
    from .engine import ParoDataParallel
    from .strategy import Level, PaRoStrategy

    if len(model_chunks) != 1:
        raise ValueError(f"the PaRO engine wraps one model chunk, got {len(model_chunks)} "
                         "(no virtual pipeline parallelism)")
    params_dtype = getattr(config, "params_dtype", None) or torch.float32
    grad_dtype = apply_grad_accum_dtype(ddp_config, quant_config, params_dtype)
    dp_ranks = torch.distributed.get_process_group_ranks(ps.get_data_parallel_group())
    # the group size follows each rank's LOCAL_WORLD_SIZE by default: agreed before the groups
    agree_across_ranks(group_size, "the PaRO group size", "--paro-group-size")
    timeout = quant_config.communicator_timeout
    groups = build_paro_groups(group_size, dp_ranks=dp_ranks, timeout=timeout)
    parsed = PaRoStrategy.from_string(strategy)
    # --overlap-grad-reduce / --overlap-param-gather (p = I / G): the stages' own communicators
    # (one communicator per stream)
    grad_groups = (build_paro_groups(group_size, dp_ranks=dp_ranks, timeout=timeout)
                   if ddp_config.overlap_grad_reduce else None)
    param_groups = (build_paro_groups(group_size, dp_ranks=dp_ranks, timeout=timeout)
                    if ddp_config.overlap_param_gather and parsed.params != Level.N else None)
    return [ParoDataParallel(config, model_chunks[0], parsed, groups,
                             grad_dtype=grad_dtype, quant_config=quant_config,
                             bucket_numel=ddp_config.bucket_size, grad_groups=grad_groups,
                             param_groups=param_groups)]


def build_engine_optimizer(optimizer_config: Any, model_chunks: List[torch.nn.Module]) -> Any:
    """The PaRO engine's optimizer (AdamW / SGD on the engine's flat fp32 shards)."""
    from .optimizer import ParoOptimizer

    return ParoOptimizer(model_chunks[0], optimizer_config)


def _state_bytes(paro: ParoConfig) -> Any:
    """Bytes per element of parameters / gradients as this run stores them (K = 12 for Adam)."""
    from .cost import StateBytes

    return StateBytes(param=paro.param_bytes, grad=paro.grad_bytes)


def _memory_for_auto(paro: ParoConfig) -> float:
    """Bytes per rank that --paro-strategy auto may fill: the flag, else the device's memory (CPU:
    host memory shared by the ranks of this node); the minimum over all ranks (collective).
    :func:`reserved_bytes_for_auto` says how much of it is kept free."""
    if paro.gpu_memory_gb is not None:
        mem = paro.gpu_memory_gb * 1e9
    elif paro.device == "cuda":
        mem = float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    else:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        mem = host / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    dev = torch.device("cuda", torch.cuda.current_device()) if paro.device == "cuda" else None
    t = torch.tensor([mem], dtype=torch.float64, device=dev)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return float(t.item())


def reserved_bytes_for_auto(paro: ParoConfig, memory_bytes: float,
                            activation_bytes: float) -> Tuple[float, str]:
    """(bytes of ``memory_bytes`` that ``auto`` keeps free, how that was decided).

    ``--paro-reserved-memory-gb`` when given. Else, when the memory is the device's own (no
    ``--paro-gpu-memory-gb``): :data:`.cost.DEVICE_RESERVE_FRACTION` of it (CUDA context,
    NCCL buffers, workspaces, fragmentation) plus ``activation_bytes`` (one micro-batch's,
    :func:`..integration.activation_bytes_estimate`), so the model states ``auto`` plans leave room for the first
    forward. An explicit ``--paro-gpu-memory-gb`` already says what model states may fill.
    """
    from .cost import DEVICE_RESERVE_FRACTION

    if paro.reserved_memory_gb is not None:
        return paro.reserved_memory_gb * 1e9, "--paro-reserved-memory-gb"
    if paro.gpu_memory_gb is not None:
        return 0.0, "none by default with --paro-gpu-memory-gb"
    fixed = DEVICE_RESERVE_FRACTION * memory_bytes
    return fixed + activation_bytes, (
        f"{DEVICE_RESERVE_FRACTION:.0%} of {memory_bytes / 1e9:.2f} GB for context and workspace "
        f"+ {activation_bytes / 1e9:.2f} GB estimated activations of a micro-batch")


@dataclass(frozen=True)
class AutoStrategy:
    """What ``--paro-strategy auto`` chose, for the trainer to record (the layer writes nothing
    of the trainer's)."""

    config: QuantizationConfig
    """The run's config with ``paro.strategy`` the chosen canonical name."""
    use_distributed_optimizer: Optional[bool]
    """The ``--use-distributed-optimizer`` the choice needs (NNN / NNG on megatron-core), or None
    (a PaRO-engine strategy: the engine has its own optimizer)."""
    note: str
    """The choice with its reasons (the startup log line)."""


def resolve_auto_strategy(quant_config: QuantizationConfig, num_params: int,
                          activation_bytes: float) -> Optional[AutoStrategy]:
    """``--paro-strategy auto``: the cheapest modelled communication that fits (spec §3), with
    one micro-batch's ``activation_bytes`` kept free by default (:func:`reserved_bytes_for_auto`).

    Returns the choice (a new config, the optimizer setting it needs, why); None for any other
    strategy. Collective (the memory budget is the minimum over the ranks)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    from .cost import choose_strategy_auto
    from .strategy import AUTO, MEGATRON_CORE_STRATEGIES

    paro = quant_config.paro
    if paro.strategy != AUTO:
        return None
    memory = _memory_for_auto(paro)
    reserved, why = reserved_bytes_for_auto(paro, memory, activation_bytes)
    choice = choose_strategy_auto(
        num_params, paro.data_parallel_size, paro.group_size, memory,
        paro.intra_bandwidth_gbs * 1e9, paro.inter_bandwidth_gbs * 1e9,
        micro_steps=get_num_microbatches(), state_bytes=_state_bytes(paro),
        reserved_bytes=reserved)
    name = choice.strategy.name
    return AutoStrategy(
        config=dataclasses.replace(quant_config, paro=dataclasses.replace(paro, strategy=name)),
        use_distributed_optimizer=MEGATRON_CORE_STRATEGIES.get(name),
        note=f"{choice.explanation} Reserved {reserved / 1e9:.2f} GB ({why}).")


def strategy_report(quant_config: QuantizationConfig, model_chunks: List[torch.nn.Module],
                    optimizer: Any) -> Optional[str]:
    """The startup report of ``--paro-strategy`` (memory and communication per rank, from the
    cost model; for the engine also the resident bytes it measures), or None without one."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    from .cost import format_report, paro_report

    paro = quant_config.paro
    if paro.strategy is None:
        return None
    chunk = model_chunks[0]
    # This rank's model-parallel share: what its data-parallel group holds and moves (the
    # figures are per rank; the whole model's count overstated them TP x PP times), as auto uses.
    n_total = sum(p.numel() for p in chunk.parameters())
    engine = is_engine(chunk)
    if engine:
        n_total = chunk.padded_numel  # what the engine allocates and sends (padded to n)
    text = format_report(paro_report(
        paro.strategy, n_total, paro.data_parallel_size, paro.group_size,
        micro_steps=get_num_microbatches(), quant_config=quant_config,
        state_bytes=_state_bytes(paro)))
    mp = paro.tensor_model_parallel_size * paro.pipeline_model_parallel_size
    if mp > 1:
        text += (f"\n > Ψ is this rank's share of the model (tensor x pipeline parallel = {mp}): "
                 "its data-parallel group holds and moves that")
    if engine:
        from .optimizer import model_state_bytes

        mem = model_state_bytes(chunk, optimizer)
        text += (f"\n > PaRO engine, resident model states on rank 0: parameters "
                 f"{mem['params']} B, gradients {mem['grads']} B, optimizer states "
                 f"{mem['optimizer_states']} B, total {mem['total']} B (padded to "
                 f"{chunk.padded_numel} elements)")
    return text
