"""Walsh-Hadamard helpers (unnormalised Sylvester ordering, SDP4Bit §3.5).

The transform spreads an outlier over a whole block of ``block`` elements, which shrinks the
group's absmax relative to its typical magnitude and hence the quantization error of heavy-tailed
gradients.  ``H[a][c] = (-1)**popcount(a & c)``; ``H @ H = block * I``, so the inverse is
``H / block`` (an exact power-of-two scaling).

The transforms here run in PyTorch on any device; the fused Triton kernels apply the identical
butterfly (same fp32 add/sub sequence) inside quantize / dequantize_sum.
"""

from __future__ import annotations

import torch

from .reference import _check_hadamard, hadamard_transform, inverse_hadamard_transform

__all__ = ["hadamard_matrix", "hadamard_transform", "inverse_hadamard_transform"]


def hadamard_matrix(block: int = 32, dtype: torch.dtype = torch.float32,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Dense ±1 Sylvester Hadamard matrix of order ``block`` (for tests and analysis)."""
    _check_hadamard(block, block)
    idx = torch.arange(block, device=device)
    bits_and = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(bits_and)
    v = bits_and.clone()
    while bool((v > 0).any()):
        parity ^= v & 1
        v >>= 1
    return (1 - 2 * parity).to(dtype)
