"""What the wrapped model chunks hold: their quantization runtimes, which of them are PaRO
engine chunks, and whether the data-parallel group has anyone to talk to. Read by
:mod:`.integration` (the trainer's entry) and :mod:`.reports` alike."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

__all__ = ["runtimes_of", "engine_chunks", "nobody_to_talk_to"]


def runtimes_of(model_chunks: List[torch.nn.Module]) -> List[Any]:
    """Distinct QuantizationRuntime objects of the (quantized) chunks, in chunk order, each
    chunk's dense runtime before its expert one."""
    seen: Dict[int, Any] = {}
    for chunk in model_chunks:
        for rt in (getattr(chunk, "quant_runtime", None),
                   getattr(chunk, "expert_quant_runtime", None)):
            if rt is not None and id(rt) not in seen:
                seen[id(rt)] = rt
    return list(seen.values())


def engine_chunks(model_chunks: List[torch.nn.Module]) -> List[torch.nn.Module]:
    """The chunks wrapped by the PaRO engine (none for megatron-core DDP)."""
    from .paro.integration import is_engine

    return [chunk for chunk in model_chunks if is_engine(chunk)]


def nobody_to_talk_to() -> bool:
    """True when the data-parallel group (with context parallelism) has one rank: nothing is
    sent, so quantizing would only lose precision. The model then gets megatron-core's own DDP
    (bit-identical to the baseline) whatever the quantization flags say."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size(with_context_parallel=True) == 1
