"""The training layer's only entry points into the quantized communication layer.

`megatron/training` calls these functions and nothing else from `megatron.distributed.quant`, so
the trainer stays unaware of how quantization is wired into megatron-core. With quantization off
every function reduces to plain megatron-core behaviour (bit-identical results).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig

from .config import QuantizationConfig


def wrap_model_with_ddp(
    config: TransformerConfig,
    ddp_config: DistributedDataParallelConfig,
    model_chunks: List[torch.nn.Module],
    quant_config: QuantizationConfig,
) -> List[DistributedDataParallel]:
    """Wrap each model chunk in megatron-core DDP (a quantizing subclass when enabled)."""
    if quant_config.enabled:
        raise NotImplementedError("quantized communication is not wired into DDP yet")
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                disable_bucketing=(i > 0))
        for i, chunk in enumerate(model_chunks)
    ]


def on_optimizer_built(optimizer: Any, model_chunks: List[torch.nn.Module],
                       quant_config: QuantizationConfig) -> None:
    """Hook called once the megatron-core optimizer exists (attach quantized weight gather)."""


def set_iteration(model_chunks: List[torch.nn.Module], iteration: int) -> None:
    """Called at the start of every training iteration (start-iteration switch, LoCo resets)."""


def on_step_skipped(model_chunks: List[torch.nn.Module], loss_scale_ratio: Optional[float]) -> None:
    """Called when the optimizer skipped a step (NaN/Inf or fp16 overflow)."""


def quantization_state_dict(model_chunks: List[torch.nn.Module]) -> Dict[str, Any]:
    """Every piece of quantization state (error buffers, RNG) for the checkpoint of this rank."""
    return {}


def load_quantization_state_dict(model_chunks: List[torch.nn.Module], state: Dict[str, Any]) -> None:
    """Restore what :func:`quantization_state_dict` returned."""


def communication_report(model_chunks: List[torch.nn.Module], reset: bool = True) -> Dict[str, float]:
    """Bytes/bits per element on each link since the last call (empty when quantization is off)."""
    return {}
