"""What a resume does with the checkpoint's quantization state: restore it where it still
applies, else re-derive it and say why.

Why a module of its own: the state (stochastic-rounding generators, qWD references, LoCo error
buffers, per rank) belongs to the gradient streams of the run that saved it.  Whether it still
fits this run -- same layout, same state-shaping settings (:data:`STATE_SHAPING_SETTINGS`), same
buckets -- is one decision, the same for both checkpoint formats.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional

import torch

from megatron.distributed.quant import integration
from megatron.training.checkpoint.layout import saved_arg


RE_DERIVED = ("stochastic-rounding generators restart from --seed, qWD references are the loaded "
              "weights, LoCo error buffers restart from zero (they belong to the old ranks' "
              "gradient streams)")
"""What a re-derived quantization state is, in the resume's log line."""


def restore_quantization_state(args: argparse.Namespace, model: List[torch.nn.Module],
                               state: Dict[str, Any], iteration: int, same_layout: bool,
                               log: Any) -> None:
    """Restore the quantization state where it still applies, else say why it starts afresh."""
    saved = state.get("quantization") or {}
    if not args.quant_config.enabled:
        if saved:
            log(" > the checkpoint holds quantization state; this run does not quantize: ignored")
        return
    if not saved:
        written = _written_layout(state.get("args"))
        if not same_layout and written is not None:
            # torch_dist keeps each rank's state only for the layout that wrote it
            log(f" > quantization state re-derived: the checkpoint's was written for another "
                f"layout ({written}): {RE_DERIVED}")
        else:
            log(" > the checkpoint has no quantization state (written without quantization): "
                "stochastic-rounding generators start from --seed, LoCo error buffers from zero")
        integration.reset_quantization_state(model, iteration)
        return
    changed = _changed_quantization_settings(saved, args.quant_config)
    misfit = None if (not same_layout or changed) else \
        integration.quantization_state_difference(model, saved)
    if not same_layout or changed or misfit:
        why = ("the new layout" if not same_layout else
               f"changed settings ({', '.join(changed)})" if changed else
               f"a changed layout: {misfit}")
        log(f" > quantization state re-derived for {why}: {RE_DERIVED}")
        integration.reset_quantization_state(model, iteration)
    else:
        integration.load_quantization_state_dict(model, saved)


STATE_SHAPING_SETTINGS = (
    "quantized_gradients", "quantized_weights", "weight_quantization_mode", "gq_group_size_intra",
    "gq_group_size_inter", "wq_group_size", "hadamard_transform", "hadamard_block_size", "loco",
    "loco_error_bits", "data_parallel_intra_node_size")
"""Quantization settings that change the saved state's buckets, shapes or meaning (LoCo errors
in the Hadamard domain or not): a checkpoint saved under others is re-derived, not loaded."""


def _changed_quantization_settings(saved: Dict[str, Any], cfg: Any) -> List[str]:
    """``--flag old -> new`` for each state-shaping setting that differs from the checkpoint's."""
    saved_cfg = (saved.get("runtimes") or [{}])[0].get("config") or {}
    return [f"--{k.replace('_', '-')} {saved_cfg[k]} -> {getattr(cfg, k)}"
            for k in STATE_SHAPING_SETTINGS if k in saved_cfg and saved_cfg[k] != getattr(cfg, k)]


def _written_layout(saved_args: Any) -> Optional[str]:
    """``TP=.., PP=.., DP=..`` of a checkpoint written with quantized communication (its saved
    arguments say so), else None."""
    def get(name: str) -> Any:
        return saved_arg(saved_args, name)

    if saved_args is None or not any(get(k) for k in ("quantized_gradients", "quantized_weights")):
        return None
    return (f"TP={get('tensor_model_parallel_size')}, PP={get('pipeline_model_parallel_size')}, "
            f"DP={get('data_parallel_size')}")
