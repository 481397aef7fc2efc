"""The training layer's only entry points into the quantized communication layer.

`megatron/training` calls these functions and nothing else from `megatron.distributed.quant`, so
the trainer stays unaware of how quantization is wired into megatron-core. With quantization off
every function reduces to plain megatron-core behaviour (bit-identical results): the model chunks
are plain ``DistributedDataParallel`` objects and every hook below is a no-op for them.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig

from .config import QuantizationConfig
from .grad_accum import apply_grad_accum_dtype, resolve_grad_dtypes  # noqa: F401 (re-export)

__all__ = [
    "wrap_model_with_ddp", "on_optimizer_built", "set_iteration", "on_step_skipped",
    "on_loss_scale_changed", "quantization_state_dict", "load_quantization_state_dict",
    "reset_quantization_state",
    "communication_report", "resolve_grad_dtypes",
]


def _runtimes(model_chunks: List[torch.nn.Module]) -> List[Any]:
    """Distinct QuantizationRuntime objects of the (quantized) chunks, in chunk order."""
    seen: Dict[int, Any] = {}
    for chunk in model_chunks:
        rt = getattr(chunk, "quant_runtime", None)
        if rt is not None and id(rt) not in seen:
            seen[id(rt)] = rt
    return list(seen.values())


def wrap_model_with_ddp(
    config: TransformerConfig,
    ddp_config: DistributedDataParallelConfig,
    model_chunks: List[torch.nn.Module],
    quant_config: QuantizationConfig,
) -> List[DistributedDataParallel]:
    """Wrap each model chunk in megatron-core DDP (a quantizing subclass when enabled).

    ``--grad-accum-dtype`` (if given) sets ``ddp_config.grad_reduce_in_fp32`` first, whether or not
    communication is quantized. All chunks of a model share one runtime (groups, accounting,
    LoCo, iteration counter).
    """
    params_dtype = getattr(config, "params_dtype", None) or torch.float32
    apply_grad_accum_dtype(ddp_config, quant_config, params_dtype)
    if not quant_config.enabled:
        return [
            DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                    disable_bucketing=(i > 0))
            for i, chunk in enumerate(model_chunks)
        ]
    from .ddp import QuantizedDistributedDataParallel
    from .runtime import build_runtime

    runtime = build_runtime(quant_config)
    return [
        QuantizedDistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                         quant_config=quant_config, disable_bucketing=(i > 0),
                                         runtime=runtime, chunk_id=i)
        for i, chunk in enumerate(model_chunks)
    ]


def on_optimizer_built(optimizer: Any, model_chunks: List[torch.nn.Module],
                       quant_config: QuantizationConfig) -> None:
    """Hook called once the megatron-core optimizer exists (qWD reference snapshots, non-finite
    quantized gradients reported as ``found_inf``)."""
    if not _runtimes(model_chunks):
        return
    from .ddp import install_optimizer_hooks

    install_optimizer_hooks(optimizer, model_chunks)


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
    for rt, sd in zip(rts, saved):
        rt.load_state_dict(sd)


def reset_quantization_state(model_chunks: List[torch.nn.Module], iteration: int) -> None:
    """Start the quantization state afresh at ``iteration`` when a checkpoint's cannot be used
    (written under another layout, or without quantization): the freshly built runtime already
    has generators seeded from ``--seed``, zero LoCo error buffers and no qWD reference (the
    loaded model weights are the reference); only the iteration counters follow the checkpoint."""
    for rt in _runtimes(model_chunks):
        rt.set_iteration(iteration)


def _flatten(report: Dict[str, Any]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for kind in ("grad", "weight"):
        entry = report.get(kind)
        if not entry or not entry.get("calls"):
            continue
        for link in ("intra", "inter", "total"):
            s = entry[link]
            if not s["bytes"] and not s["baseline_bytes"]:
                continue
            out[f"{kind}_{link}_bytes"] = float(s["bytes"])
            out[f"{kind}_{link}_baseline_bytes"] = float(s["baseline_bytes"])
            for metric in ("bits_per_element", "baseline_bits_per_element", "ratio_vs_baseline"):
                if s[metric] is not None:
                    out[f"{kind}_{link}_{metric}"] = float(s[metric])
        if entry["bits_per_model_element"] is not None:
            out[f"{kind}_bits_per_model_element"] = float(entry["bits_per_model_element"])
        out[f"{kind}_calls"] = float(entry["calls"])
    return out


def communication_report(model_chunks: List[torch.nn.Module], reset: bool = True,
                         totals: bool = False) -> Dict[str, float]:
    """Bytes/bits per element on each link since the last call (empty when quantization is off);
    with ``totals``, over the whole run instead (for the end-of-run summary; resets nothing).

    Keys ``{grad|weight}_{intra|inter|total}_{bytes|bits_per_element|ratio_vs_baseline|...}``,
    ``{kind}_bits_per_model_element`` (bytes on all links per bucket element), ``{kind}_calls``,
    ``nonfinite_events`` (quantized collectives that met NaN/Inf in the interval),
    ``comm_{grad_intra|grad_inter|grad_exposed|weight|weight_exposed}_ms`` (per iteration: time
    the collectives took vs time the training thread waited for them, streams.CommTiming) and, with LoCo,
    ``loco_error_bytes_per_param`` (error-buffer memory on this rank per local parameter).
    """
    rts = _runtimes(model_chunks)
    if not rts:
        return {}
    merged: Dict[str, float] = {}
    nonfinite = 0
    for rt in rts:
        report = rt.accounting.totals() if totals else rt.accounting.interval_report()
        for k, v in _flatten(report).items():
            if "bits" in k or "ratio" in k:
                merged.setdefault(k, v)  # one runtime per model in practice
            else:
                merged[k] = merged.get(k, 0.0) + v
        nonfinite += rt.nonfinite_events if totals else rt.nonfinite_events_interval
        if not totals:  # total vs exposed communication ms per iteration (one runtime per model)
            merged.update(rt.timing.interval_report(reset=reset))
        if reset and not totals:
            rt.accounting.reset_interval()
            rt.nonfinite_events_interval = 0
    merged["nonfinite_events"] = float(nonfinite)
    locos = [rt.loco for rt in rts if rt.loco is not None]
    if locos:
        # LoCo's memory overhead on this rank, per local model parameter (int8 codes + scales).
        n_params = sum(p.numel() for chunk in model_chunks for p in chunk.parameters())
        merged["loco_error_bytes_per_param"] = sum(l.memory_bytes() for l in locos) / max(1, n_params)
    return merged
