"""Llama 3.x RoPE frequency scaling as megatron-core computes it (``--use-rope-scaling``).

Why a module of its own: megatron-core 0.16.1's ``RotaryEmbedding`` takes only the scaling
factor (``--rope-scaling-factor``) and hard-codes the rest; the flag's help, the Hugging Face
import (which refuses other values) and the export (which writes them to ``config.json``) must
all name the same values, so they read them from here.
"""

from __future__ import annotations

from typing import Dict

MCORE_LLAMA3_FIXED: Dict[str, float] = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192}
"""What megatron-core 0.16.1's ``RotaryEmbedding._apply_scaling`` hard-codes, in Hugging Face's
``rope_scaling`` names (only the factor is an argument)."""


def describe() -> str:
    """The fixed values in words, for the flag's help."""
    fixed = MCORE_LLAMA3_FIXED
    return (f"low/high frequency factors {fixed['low_freq_factor']:g} and "
            f"{fixed['high_freq_factor']:g}, {fixed['original_max_position_embeddings']:g} "
            "original positions")
