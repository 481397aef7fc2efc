"""The training layer's only entry points into the quantized communication layer.

`megatron/training` uses only these (besides :mod:`.mcore_compat` and ``failures``), so the trainer
does not know how quantization and PaRO are wired into megatron-core: flags, the data-parallel
wrapper and optimizer, per-iteration and checkpoint hooks, reports. With quantization off and no
PaRO engine strategy every function is plain megatron-core behaviour (bit-identical). Heavy modules
are imported inside the functions that need them; PaRO building is in :mod:`.paro.integration`,
the reports in :mod:`.reports`.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import TYPE_CHECKING, AbstractSet, Any, Dict, Iterator, List, Optional

import torch

from .arguments import gradients_quantized  # noqa: F401 (re-export)
from .config import QuantizationConfig, TopologyUnknownError  # noqa: F401 (re-export)
from .chunks import engine_chunks as _engine_chunks
from .chunks import nobody_to_talk_to  # noqa: F401 (re-export)
from .chunks import runtimes_of as _runtimes
from .grad_accum import apply_grad_accum_dtype, resolve_grad_dtypes  # noqa: F401 (re-export)
from .reports import (communication_report, memory_report, startup_warnings,  # noqa: F401
                      strategy_report)

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

__all__ = [
    "add_arguments", "build_quantization_config", "check_strategy_args", "uses_sharded_engine",
    "gradients_quantized", "wrap_model", "wrap_model_with_ddp", "resolve_auto_strategy",
    "build_optimizer", "on_optimizer_built", "finalize_model_grads_func", "set_iteration",
    "on_step_skipped", "on_loss_scale_changed", "full_model_params", "quantization_state_dict",
    "load_quantization_state_dict", "reset_quantization_state", "strategy_report",
    "communication_report", "resolve_grad_dtypes", "TopologyUnknownError", "nobody_to_talk_to",
    "activation_bytes_estimate", "QuantizationConfig",
]


# ----------------------------------------------------------------------------- flags
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the quantized-communication flags and the PaRO flags (``--paro-*``)."""
    from .arguments import add_paro_args, add_quantization_args

    add_quantization_args(parser)
    add_paro_args(parser)
    return parser


def build_quantization_config(args: argparse.Namespace,
                              given: AbstractSet[str]) -> QuantizationConfig:
    """The one :class:`QuantizationConfig` of the run, PaRO settings included
    (:attr:`QuantizationConfig.paro`: the strategy's canonical name and group size, which the
    trainer records as ``args.paro_strategy`` / ``args.paro_group_size``), after checking that
    every quantization sub-flag in ``given`` (the dests set on the command line) has its switch.
    Needs the validated parallel sizes. After this the layer reads nothing of ``args``.
    ValueError."""
    import dataclasses

    from .arguments import check_flag_dependencies

    check_flag_dependencies(args, given)
    config = QuantizationConfig.from_args(args)
    return dataclasses.replace(
        config, paro=config.paro.resolved(bool(args.use_distributed_optimizer)))


def check_strategy_args(args: argparse.Namespace) -> None:
    """Accept or refuse the strategy of ``args.quant_config`` against the rest of the command
    line (ValueError with the fix); part of argument validation, writes nothing."""
    from .arguments import check_paro_args

    check_paro_args(args, args.quant_config)


def uses_sharded_engine(strategy: Optional[str]) -> bool:
    """True when ``strategy`` (``--paro-strategy``, any spelling) trains on the PaRO engine
    rather than megatron-core's DDP; ``'auto'`` counts (it may pick one), None does not."""
    from .paro.strategy import uses_engine

    return uses_engine(strategy)


def wait_param_gathers_in_flight(model_chunks: List[torch.nn.Module]) -> None:
    """Wait for the weight all-gathers still in flight (end of training: with
    ``--overlap-param-gather-with-optimizer-step`` the last step leaves them running, and the
    process group must not be destroyed under them). Starts none."""
    from megatron.distributed.mcore_compat import ddp_buckets

    for chunk in model_chunks:
        if hasattr(chunk, "bucket_groups"):
            ddp_buckets.wait_param_gathers_in_flight(chunk)


def weight_quantization_dtype_error(quant_config: QuantizationConfig,
                                    params_dtype: Any) -> Optional[str]:
    """Why ``--quantized-weights`` cannot train with ``params_dtype`` parameters on megatron-core's
    distributed optimizer (fp32: no separate master copy), or None; see
    :func:`.ddp.weight_quantization_dtype_error` (the wrapper raises the same at build time)."""
    from .ddp import weight_quantization_dtype_error as check

    return check(quant_config, params_dtype)


# ----------------------------------------------------------------------------- model, optimizer
def wrap_model(config: "TransformerConfig", ddp_config: "DistributedDataParallelConfig",
               model_chunks: List[torch.nn.Module], quant_config: QuantizationConfig, *,
               strategy: Optional[str] = None, group_size: Optional[int] = None,
               engine: Optional[bool] = None) -> List[torch.nn.Module]:
    """Wrap the model chunks for data parallelism under ``strategy`` (``--paro-strategy``,
    resolved: not ``'auto'``).

    No strategy, NNN or NNG: megatron-core DDP (:func:`wrap_model_with_ddp`, a quantizing
    subclass when enabled). Any other strategy: the PaRO engine over groups of ``group_size``
    data-parallel ranks (quantizing through the same runtime when enabled). ``engine=True``
    forces the engine (e.g. to measure NNN / NNG on it)."""
    from .paro.strategy import AUTO

    if strategy == AUTO:
        raise ValueError("--paro-strategy auto must be resolved first (resolve_auto_strategy)")
    if not (uses_sharded_engine(strategy) if engine is None else engine):
        return wrap_model_with_ddp(config, ddp_config, model_chunks, quant_config)
    from .paro.integration import wrap_with_engine

    if strategy is None or group_size is None:
        raise ValueError("the PaRO engine needs a strategy and a group size")
    return wrap_with_engine(config, ddp_config, model_chunks, quant_config, strategy, group_size)


def resolve_auto_strategy(quant_config: QuantizationConfig, num_params: int,
                          activation_bytes: float) -> Optional[Any]:
    """``--paro-strategy auto``: choose the strategy (cheapest modelled communication that fits in
    memory, one micro-batch's ``activation_bytes`` kept free by default) and return it for the
    trainer to record: a :class:`.paro.integration.AutoStrategy` (``config`` with the chosen
    strategy, the ``use_distributed_optimizer`` it needs or None, ``note`` saying why); None for
    any other strategy. Collective."""
    from .paro.integration import resolve_auto_strategy as resolve

    return resolve(quant_config, num_params, activation_bytes)


def activation_bytes_estimate(*, seq_length: int, micro_batch_size: int, hidden_size: int,
                              num_layers: int, num_attention_heads: int, vocab_size: int,
                              ffn_hidden_size: Optional[int] = None, gated_mlp: bool = False,
                              bytes_per_value: float = 2.0, attention_scores: bool = True,
                              recompute: Optional[str] = None,
                              recompute_num_layers: int = 1) -> float:
    """One micro-batch's estimated activation bytes for a model of this shape
    (:func:`.paro.cost.activation_memory`): what the trainer passes to
    :func:`resolve_auto_strategy`. Plain values, computed by the trainer from its flags."""
    from .paro.cost import activation_memory

    return activation_memory(
        seq_length=seq_length, micro_batch_size=micro_batch_size, hidden_size=hidden_size,
        num_layers=num_layers, num_attention_heads=num_attention_heads, vocab_size=vocab_size,
        ffn_hidden_size=ffn_hidden_size, gated_mlp=gated_mlp, bytes_per_value=bytes_per_value,
        attention_scores=attention_scores, recompute=recompute,
        recompute_num_layers=recompute_num_layers)


def wrap_model_with_ddp(
    config: "TransformerConfig",
    ddp_config: "DistributedDataParallelConfig",
    model_chunks: List[torch.nn.Module],
    quant_config: QuantizationConfig,
) -> List["DistributedDataParallel"]:
    """Wrap each model chunk in megatron-core DDP (a quantizing subclass when enabled).

    ``--grad-accum-dtype`` (if given) sets ``ddp_config.grad_reduce_in_fp32`` first, whether or not
    communication is quantized. All chunks of a model share one runtime (groups, accounting,
    LoCo, iteration counter).
    """
    from megatron.core.distributed import DistributedDataParallel

    params_dtype = getattr(config, "params_dtype", None) or torch.float32
    apply_grad_accum_dtype(ddp_config, quant_config, params_dtype)
    if not quant_config.enabled or nobody_to_talk_to():
        return [
            DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                    disable_bucketing=(i > 0))
            for i, chunk in enumerate(model_chunks)
        ]
    from .ddp import QuantizedDistributedDataParallel
    from .runtime import build_expert_runtime, build_runtime

    runtime = build_runtime(quant_config)
    # Decided from the config, the same on every rank (group creation is world-collective),
    # also on a pipeline stage without MoE layers.
    expert_runtime = (build_expert_runtime(quant_config, runtime)
                      if getattr(config, "num_moe_experts", None)
                      and getattr(config, "expert_model_parallel_size", 1) > 1 else None)
    return [
        QuantizedDistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                         quant_config=quant_config, disable_bucketing=(i > 0),
                                         runtime=runtime, chunk_id=i,
                                         expert_runtime=expert_runtime)
        for i, chunk in enumerate(model_chunks)
    ]


def build_optimizer(optimizer_config: Any, model_chunks: List[torch.nn.Module],
                    quant_config: QuantizationConfig) -> Any:
    """The optimizer of the wrapped chunks: megatron-core's ``get_megatron_optimizer`` (then
    :func:`on_optimizer_built`), or the PaRO engine's own optimizer for engine chunks."""
    if _engine_chunks(model_chunks):
        from .paro.integration import build_engine_optimizer

        return build_engine_optimizer(optimizer_config, model_chunks)
    import dataclasses

    from megatron.core.optimizer import get_megatron_optimizer

    gather_after_step = getattr(optimizer_config, "overlap_param_gather_with_optimizer_step", False)
    if gather_after_step:
        # megatron-core implements it only for interleaved pipelines (its optimizer for the
        # first chunk alone fails with one chunk): build without it, dispatch ourselves below.
        optimizer_config = dataclasses.replace(optimizer_config,
                                               overlap_param_gather_with_optimizer_step=False)
    optimizer = get_megatron_optimizer(optimizer_config, model_chunks)
    on_optimizer_built(optimizer, model_chunks, quant_config)
    if gather_after_step:
        install_gather_after_step(optimizer, model_chunks)
    return optimizer


def install_gather_after_step(optimizer: Any, model_chunks: List[torch.nn.Module]) -> None:
    """``--overlap-param-gather-with-optimizer-step``: right after every successful optimizer
    step, start all weight all-gathers of the next forward (quantized or exact; dense bucket
    groups in forward order, then expert ones), so the link carries the weights while the step
    ends, the log line is written and the next batch loads; the forward pre-hooks then only
    wait (on demand after a skipped step). Numbers are unchanged; only the error monitor samples
    iteration N's weight update at N instead of N+1."""
    from megatron.distributed.mcore_compat.ddp_buckets import dispatch_param_gathers_after_step
    from megatron.distributed.mcore_compat.optimizer import wrap_step_with_ready_grads

    def dispatch() -> None:
        for chunk in model_chunks:
            dispatch_param_gathers_after_step(chunk)

    wrap_step_with_ready_grads(optimizer, dispatch)


def on_optimizer_built(optimizer: Any, model_chunks: List[torch.nn.Module],
                       quant_config: QuantizationConfig) -> None:
    """Hook called once the megatron-core optimizer exists (qWD reference snapshots, non-finite
    quantized gradients reported as ``found_inf``); :func:`build_optimizer` calls it. Nothing to
    do for PaRO-engine chunks (their optimizer is the engine's own)."""
    if not _runtimes(model_chunks) or _engine_chunks(model_chunks):
        return
    from .ddp import install_optimizer_hooks

    install_optimizer_hooks(optimizer, model_chunks)


def finalize_model_grads_func(model_chunks: List[torch.nn.Module]) -> Any:
    """What megatron-core's schedule calls at the accumulation boundary
    (``config.finalize_model_grads_func``): megatron-core's ``finalize_model_grads``, or the PaRO
    engine's gradient sync (gradient level -> optimizer-state level)."""
    engines = _engine_chunks(model_chunks)
    if engines:
        return engines[0].finalize_model_grads
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads


# ----------------------------------------------------------------------------- per iteration
def set_iteration(model_chunks: List[torch.nn.Module], iteration: int) -> None:
    """Called at the start of every training iteration (start-iteration switch, LoCo resets)."""
    for rt in _runtimes(model_chunks):
        rt.set_iteration(iteration)


def on_step_skipped(model_chunks: List[torch.nn.Module], loss_scale_ratio: Optional[float]) -> None:
    """Called when the optimizer skipped a step (NaN/Inf or fp16 overflow): LoCo buffers may hold
    garbage from the skipped reduction and are dropped (they restart from zero)."""
    for rt in _runtimes(model_chunks):
        rt.on_step_skipped(loss_scale_ratio)


def on_loss_scale_changed(model_chunks: List[torch.nn.Module], ratio: float) -> None:
    """Optional: the dynamic loss scale changed by ``ratio`` = new/old without a skipped step;
    LoCo errors are kept in loss-scaled units (DeepSpeed's ``_loco_err_buf_update``)."""
    for rt in _runtimes(model_chunks):
        rt.rescale_errors(ratio)


# ----------------------------------------------------------------------------- checkpoints
@contextlib.contextmanager
def full_model_params(model_chunks: List[torch.nn.Module],
                      writeback: bool = False) -> Iterator[bool]:
    """Every chunk's full parameters inside the block (``chunk.module.state_dict()`` /
    ``load_state_dict`` see the whole model). Yields True when some were gathered for the block
    only (PaRO engine with partitioned parameters: collective, and released on exit, so copy what
    you keep); with ``writeback`` the block's changes are copied back into this rank's shard.
    A no-op yielding False for megatron-core chunks, whose parameters are always full."""
    with contextlib.ExitStack() as stack:
        engines = _engine_chunks(model_chunks)
        for chunk in engines:
            stack.enter_context(chunk.full_params(writeback=writeback))
        yield bool(engines)


def model_state_dict_for_save(chunk: torch.nn.Module, keep: bool) -> Optional[Dict[str, Any]]:
    """The chunk's full weights for a checkpoint (None unless ``keep``). Collective for a PaRO
    engine chunk with partitioned parameters (every DP rank calls it): its buckets are gathered
    one at a time and copied to the host, never the whole model gathered and cloned on the
    device; a megatron-core chunk's own ``state_dict()`` (its parameters are always full)."""
    if _engine_chunks([chunk]):
        return chunk.host_state_dict(keep=keep)
    return chunk.module.state_dict() if keep else None


def load_model_state_dict(chunk: torch.nn.Module, sd: Dict[str, Any]) -> None:
    """Load a checkpoint's full weights (``strict``) into ``chunk``. A PaRO engine chunk writes
    each parameter's piece straight into this rank's shard (no gather of the model on the
    device); a megatron-core chunk loads in place."""
    if _engine_chunks([chunk]):
        chunk.load_host_state_dict(sd)
    else:
        chunk.module.load_state_dict(sd, strict=True)


def quantization_state_dict(model_chunks: List[torch.nn.Module]) -> Dict[str, Any]:
    """Every piece of quantization state (error buffers, RNG) for the checkpoint of this rank."""
    rts = _runtimes(model_chunks)
    if not rts:
        return {}
    return {"version": 1, "runtimes": [rt.state_dict() for rt in rts]}


def load_quantization_state_dict(model_chunks: List[torch.nn.Module], state: Dict[str, Any]) -> None:
    """Restore what :func:`quantization_state_dict` returned (an empty dict is a no-op, e.g. a
    checkpoint written without quantization)."""
    rts = _runtimes(model_chunks)
    if not state or not rts:
        return
    saved = state["runtimes"]
    if len(saved) != len(rts):
        raise ValueError(f"checkpoint holds {len(saved)} quantization runtimes, model has {len(rts)}")
    device = next((p.device for chunk in model_chunks for p in chunk.parameters()), None)
    for rt, sd in zip(rts, saved):
        rt.load_state_dict(sd, device=device)


def quantization_state_difference(model_chunks: List[torch.nn.Module],
                                  state: Dict[str, Any]) -> Optional[str]:
    """Why the checkpoint's quantization state (:func:`quantization_state_dict`) does not fit
    this model's runtimes (their buckets, group sizes), or None."""
    rts = _runtimes(model_chunks)
    saved = state.get("runtimes", []) if state else []
    if len(saved) != len(rts):
        return f"{len(saved)} quantized model chunk(s) -> {len(rts)}"
    for rt, sd in zip(rts, saved):
        why = rt.layout_difference(sd)
        if why:
            return why
    return None


def reset_quantization_state(model_chunks: List[torch.nn.Module], iteration: int) -> None:
    """Start the quantization state afresh at ``iteration`` when a checkpoint's cannot be used
    (written under another layout, or without quantization): the freshly built runtime already
    has generators seeded from ``--seed``, zero LoCo error buffers and no qWD reference (the
    loaded model weights are the reference); only the iteration counters follow the checkpoint."""
    for rt in _runtimes(model_chunks):
        rt.resume_at(iteration)
