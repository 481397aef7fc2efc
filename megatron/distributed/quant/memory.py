"""What the quantized layer adds to a GPU's memory, from the run's settings and bucket sizes.

Why: the user sizes ``--ddp-bucket-size`` against the memory the model leaves. The layer adds
**transient** memory for one bucket's reduce-scatter at a time (codes per hop; with LoCo two
bucket-sized fp32 buffers) and **persistent** memory (LoCo's ``e1`` / ``e2`` buffers, qWD's
reference shard per bucket).

:func:`layer_memory` is the estimate the trainer prints at startup; tests/test_layer_memory.py
checks it against the bytes the collectives really allocate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .config import QuantizationConfig
from .kernels.reference import QuantizedTensor

__all__ = ["LayerMemory", "layer_memory"]

_FP32 = 4
_SMALL = 1024
"""Bytes of the one-element tensors beside the buffers (a seed, a count)."""


def _error_bytes(cfg: QuantizationConfig, numel: int, group_size: int) -> int:
    """One stored LoCo error buffer of ``numel`` elements at ``--loco-error-bits``."""
    if cfg.loco_error_bits == 8:
        return QuantizedTensor.wire_bytes(numel, 8, group_size)
    return numel * cfg.loco_error_bits // 8


@dataclass(frozen=True)
class LayerMemory:
    """Bytes the quantized layer adds on one GPU."""

    transient_bytes: int
    """Peak of one bucket's reduce-scatter temporaries (the largest bucket)."""
    persistent_bytes: int
    """LoCo error buffers and qWD reference shards of every bucket of this rank."""
    largest_bucket: int
    """Elements of the largest bucket (what the transient figure is for)."""

    def describe(self) -> str:
        return (f"quantized communication memory per GPU: {_size(self.transient_bytes)} while a "
                f"bucket's gradients are quantized (largest bucket "
                f"{self.largest_bucket / 1e6:.1f}M elements) + {_size(self.persistent_bytes)} "
                "held across steps (LoCo error buffers, qWD reference shards)")


def _size(nbytes: int) -> str:
    if nbytes >= 1024 ** 3:
        return f"{nbytes / 1024 ** 3:.2f} GiB"
    return f"{nbytes / 1024 ** 2:.1f} MiB"


def _reduce_scatter_peak(cfg: QuantizationConfig, n: int, p: int, d: int) -> int:
    """Peak temporaries of one bucket's two-level (or one-hop) reduce-scatter, phase by phase
    (collectives.gradients.two_level_reduce_scatter): the first quantization, the first
    exchange (codes sent, received, and a packed message each way on a hop that sends one), the
    middle requantization, the second exchange."""
    m = p // d
    if p == 1 or not cfg.quantized_gradients:
        return 0
    two_level = d > 1 and m > 1
    bits1, gs1 = ((cfg.gradient_quantization_bits_intra, cfg.gq_group_size_intra) if d > 1
                  else (cfg.gradient_quantization_bits_inter, cfg.gq_group_size_inter))
    one_message1 = d == 1                               # the first hop crosses nodes
    q1 = QuantizedTensor.wire_bytes(n, bits1, gs1)
    # with LoCo: h and the residual (then the read-back error and the residual), and the new
    # error being stored while the old one is still held
    first = q1 + (2 * n * _FP32 + _error_bytes(cfg, n, gs1) if cfg.loco else 0)
    exchange1 = q1 * (4 if one_message1 else 2)
    if not two_level:
        return max(first, exchange1 + (n // p) * _FP32) + _SMALL
    part = n // d                                       # the middle hop's elements
    q2 = QuantizedTensor.wire_bytes(part, cfg.gradient_quantization_bits_inter,
                                    cfg.gq_group_size_inter)
    middle = q1 + q2 + (3 * part * _FP32 + _error_bytes(cfg, part, cfg.gq_group_size_inter)
                        if cfg.loco else 0)             # sum, h2 / residual, error
    exchange2 = q2 * 4 + (n // p) * _FP32               # packed message each way, and the sum
    return max(first, exchange1, middle, exchange2) + _SMALL


def layer_memory(cfg: QuantizationConfig, bucket_numels: Sequence[int], dp_size: int,
                 intra_size: int, param_bytes: int = 2) -> LayerMemory:
    """The estimate for buckets of ``bucket_numels`` elements over ``dp_size`` data-parallel
    ranks, ``intra_size`` per node; ``param_bytes``: bytes of a model parameter (the qWD
    reference shard's dtype)."""
    p, d = dp_size, intra_size
    transient = max((_reduce_scatter_peak(cfg, n, p, d) for n in bucket_numels), default=0)
    persistent = 0
    for n in bucket_numels:
        if cfg.loco and cfg.quantized_gradients and p > 1:
            for numel, gs in ((n, cfg.gq_group_size_intra if d > 1 else cfg.gq_group_size_inter),
                              (n // d if d > 1 and p // d > 1 else 0, cfg.gq_group_size_inter)):
                if numel:
                    persistent += _error_bytes(cfg, numel, gs)
        if cfg.quantized_weights and cfg.weight_quantization_mode == "diff" and p > 1:
            persistent += n // p * param_bytes
    return LayerMemory(transient, persistent, max(bucket_numels, default=0))
