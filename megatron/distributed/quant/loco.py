"""LoCo error feedback for the quantized gradient reduce-scatter (see ../shared/research/loco.md).

At each compensated quantization ``h = x + e``, ``q = Q(h)``, and the error state becomes a moving
average of compression residuals, ``e := beta*e + (1-beta)*(h - deQ(q))`` (fp32). Summed over
steps the output error telescopes to ``(e_0 - e_T)/(1-beta)``: it stays bounded instead of
growing like a random walk (stochastic rounding) or linearly (biased rounding).

Two buffers per bucket: ``e1`` (the local gradient before the first quantization, input layout,
N elements) and ``e2`` (the intra-node sum before the inter-node requantization, N/D elements,
middle-hop receive layout). Stored between steps at ``error_bits`` 8 (int8 + fp32 group scales),
16 (bf16) or 32 (fp32); reset and scaling deliberately differ from DeepSpeed's.
"""
# See [Note: LoCo differs from DeepSpeed] in docs/architecture.md

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Hashable, Optional

import torch

from .kernels.dispatch import QuantizedTensor, dequantize, quantize
from .streams import used_on_this_stage

__all__ = ["LoCoErrorFeedback", "LoCoBucketErrors"]

LOCO_ERROR_BITS = (8, 16, 32)
"""Storage of the error buffers: 8-bit codes + scales, bf16 or fp32 (the one definition; the
config validates ``--loco-error-bits`` against it)."""
_WHICH = ("e1", "e2")


@dataclass
class _StoredError:
    """One compressed error buffer: ``q`` (8-bit) or ``dense`` (bf16 / fp32)."""

    numel: int
    group_size: int
    q: Optional[QuantizedTensor] = None
    dense: Optional[torch.Tensor] = None

    def nbytes(self) -> int:
        if self.q is not None:
            return self.q.nbytes
        return self.dense.numel() * self.dense.element_size()


class LoCoBucketErrors:
    """E1/E2 error buffers of one bucket; pass it as ``error_feedback`` to the reduce-scatter.

    Buffers are created lazily (zero) on first use and cleared to "absent" (= zero) by resets.
    """

    def __init__(self, owner: "LoCoErrorFeedback") -> None:
        self._owner = owner
        self._buf: Dict[str, Optional[_StoredError]] = {k: None for k in _WHICH}
        self._group_size: Dict[str, int] = {}
        """Group size announced by the last compensate() (storage grouping of a fresh buffer)."""

    # -- used by the collective ----------------------------------------------------------------
    def error(self, which: str, numel: int, device: torch.device) -> torch.Tensor:
        """The current error as fp32 (zeros if absent)."""
        st = self._get(which, numel)
        if st is None:
            return torch.zeros(numel, dtype=torch.float32, device=device)
        # On a CUDA stage the stored buffer may come from the compute stream's pool (a resume
        # copies it there, an inline monitoring iteration makes it there); the caller replaces
        # it right after this read, so the pool must wait for this stage's pending kernels.
        if st.q is not None:
            used_on_this_stage(st.q.codes, st.q.scales)
            return dequantize(st.q)
        used_on_this_stage(st.dense)
        return st.dense.to(torch.float32)

    def compensate(self, which: str, x: torch.Tensor, *, group_size: int) -> torch.Tensor:
        """``h = x + e`` in fp32 (a new tensor; ``x`` is untouched)."""
        self._check_which(which)
        flat = x.reshape(-1)
        if group_size <= 0 or flat.numel() % group_size:
            raise ValueError(f"LoCo {which}: {flat.numel()} elements not divisible by group size {group_size}")
        self._group_size[which] = group_size
        h = flat.to(torch.float32)
        st = self._get(which, flat.numel())
        if st is None:
            return h.clone() if h.data_ptr() == flat.data_ptr() else h
        if st.group_size != group_size:
            raise ValueError(f"LoCo {which}: stored with group size {st.group_size}, now used with "
                             f"{group_size}; the bucket's quantization changed (drop() first)")
        return h + self.error(which, flat.numel(), flat.device)

    def update(self, which: str, h: torch.Tensor, sent: torch.Tensor) -> None:
        """``e := beta*e + (1-beta)*(h - sent)`` (fp32), then store compressed.

        ``sent`` is the dequantized value of what was transmitted, in the same layout as ``h``.
        """
        self._check_which(which)
        h = h.reshape(-1)
        sent = sent.reshape(-1)
        if h.numel() != sent.numel():
            raise ValueError(f"LoCo {which}: h has {h.numel()} elements but sent has {sent.numel()}")
        self.update_residual(which, h.to(torch.float32) - sent.to(torch.float32))

    def update_residual(self, which: str, residual: torch.Tensor) -> None:
        """:meth:`update` from the residual ``h - sent`` (fp32, flat), which this call may scale
        in place. Why: the collective computes the residual into the buffer of the dequantized
        codes and drops ``h`` first, so no more than two bucket-sized fp32 buffers are alive at
        once (the residual and the previous error), not four."""
        self._check_which(which)
        beta = self._owner.beta
        st = self._get(which, residual.numel())
        if st is None:
            e = residual.mul_(1.0 - beta)
            group_size = self._group_size.get(which)
        else:
            e = self.error(which, residual.numel(), residual.device).mul_(beta).add_(
                residual, alpha=1.0 - beta)
            group_size = st.group_size
        if group_size is None:
            raise ValueError(f"LoCo {which}: update() before compensate()")
        self._buf[which] = self._owner._store(e, group_size)

    # -- maintenance ---------------------------------------------------------------------------
    def clear(self) -> None:
        self._buf = {k: None for k in _WHICH}

    def rescale(self, factor: float) -> None:
        for st in self._buf.values():
            if st is None:
                continue
            if st.q is not None:
                st.q.scales.mul_(factor)
            else:
                st.dense.mul_(factor)

    def memory_bytes(self) -> int:
        return sum(st.nbytes() for st in self._buf.values() if st is not None)

    def state_dict(self) -> Dict[str, Any]:
        """Host copies of the buffers (a clone on a GPU would hold a second copy of every
        bucket's errors on the device just to hand it to ``torch.save``)."""
        def host(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to("cpu", copy=True)

        out: Dict[str, Any] = {}
        for k, st in self._buf.items():
            if st is None:
                out[k] = None
            elif st.q is not None:
                out[k] = {"numel": st.numel, "group_size": st.group_size, "codes": host(st.q.codes),
                          "scales": host(st.q.scales), "bits": st.q.bits}
            else:
                out[k] = {"numel": st.numel, "group_size": st.group_size, "dense": host(st.dense)}
        return out

    def load_state_dict(self, sd: Dict[str, Any], device: Optional[torch.device] = None) -> None:
        """Restore :meth:`state_dict`'s output onto ``device`` (None: where the tensors are)."""
        for k in _WHICH:
            v = sd.get(k)
            if v is None:
                self._buf[k] = None
            elif "codes" in v:
                if self._owner.error_bits != 8:
                    raise ValueError(f"LoCo state holds 8-bit errors but error_bits={self._owner.error_bits}")
                q = QuantizedTensor(v["codes"].to(device, copy=True),
                                    v["scales"].to(device, copy=True), int(v["bits"]),
                                    int(v["group_size"]), int(v["numel"]))
                q.validate()
                self._buf[k] = _StoredError(int(v["numel"]), int(v["group_size"]), q=q)
            else:
                dense = v["dense"].to(device, copy=True)
                if dense.dtype != self._owner._dense_dtype():
                    raise ValueError(f"LoCo state holds {dense.dtype} errors but error_bits="
                                     f"{self._owner.error_bits}")
                self._buf[k] = _StoredError(int(v["numel"]), int(v["group_size"]), dense=dense)

    # -- internals -----------------------------------------------------------------------------
    @staticmethod
    def _check_which(which: str) -> None:
        if which not in _WHICH:
            raise ValueError(f"error buffer must be one of {_WHICH}, got {which!r}")

    def _get(self, which: str, numel: int) -> Optional[_StoredError]:
        self._check_which(which)
        st = self._buf[which]
        if st is not None and st.numel != numel:
            raise ValueError(f"LoCo {which}: buffer holds {st.numel} elements but the bucket now has "
                             f"{numel}; bucket layout changed (drop() first)")
        return st


class LoCoErrorFeedback:
    """All LoCo error buffers of a model (one :class:`LoCoBucketErrors` per bucket) and the
    shared reset schedule.

    Call :meth:`bucket` to get the per-bucket object for the reduce-scatter, :meth:`step` once per
    successful optimizer step, :meth:`drop` on a skipped (NaN/overflow) step and :meth:`rescale`
    when the loss scale changes by ``factor = new/old``.
    """

    def __init__(self, beta: float = 0.8, reset_interval: int = 1024, error_bits: int = 8) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"LoCo beta must be in [0, 1), got {beta}")
        if reset_interval <= 0:
            raise ValueError(f"LoCo reset interval must be positive, got {reset_interval}")
        if error_bits not in LOCO_ERROR_BITS:
            raise ValueError(f"LoCo error bits must be one of {LOCO_ERROR_BITS}, got {error_bits}")
        self.beta = float(beta)
        self.reset_interval = int(reset_interval)
        self.error_bits = int(error_bits)
        self.steps_since_reset = 0
        self._buckets: Dict[Hashable, LoCoBucketErrors] = {}

    @classmethod
    def from_config(cls, cfg) -> "LoCoErrorFeedback":
        """Build from a :class:`QuantizationConfig` (loco_error_beta / _reset_interval / _bits)."""
        return cls(beta=cfg.loco_error_beta, reset_interval=cfg.loco_reset_interval,
                   error_bits=cfg.loco_error_bits)

    def bucket(self, key: Hashable) -> LoCoBucketErrors:
        """The error buffers of bucket ``key`` (created on first request)."""
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = LoCoBucketErrors(self)
        return b

    def step(self) -> bool:
        """Count one optimizer step; clear all buffers every ``reset_interval`` steps.
        Returns True when this call reset them."""
        self.steps_since_reset += 1
        if self.steps_since_reset >= self.reset_interval:
            self._clear_all()
            return True
        return False

    def drop(self) -> None:
        """Discard all errors (NaN/overflow step: the buffers may hold garbage); restarts the
        reset schedule since the buffers are fresh."""
        self._clear_all()

    def rescale(self, factor: float) -> None:
        """Loss scale changed by ``factor``: keep the stored errors in the new loss-scaled units
        (8-bit: multiply the group scales; dense: multiply the values)."""
        if not (factor > 0.0 and factor < float("inf")):
            raise ValueError(f"LoCo rescale factor must be positive and finite, got {factor}")
        for b in self._buckets.values():
            b.rescale(factor)

    def memory_bytes(self) -> int:
        """Bytes currently held by all error buffers (codes + scales or dense values)."""
        return sum(b.memory_bytes() for b in self._buckets.values())

    def state_dict(self) -> Dict[str, Any]:
        return {
            "beta": self.beta, "reset_interval": self.reset_interval, "error_bits": self.error_bits,
            "steps_since_reset": self.steps_since_reset,
            "buckets": {k: b.state_dict() for k, b in self._buckets.items()},
        }

    def load_state_dict(self, sd: Dict[str, Any], device: Optional[torch.device] = None) -> None:
        """Restore :meth:`state_dict`'s output; tensors go to ``device`` (None: stay where the
        checkpoint loader put them)."""
        if int(sd["error_bits"]) != self.error_bits:
            raise ValueError(f"checkpoint LoCo error_bits={sd['error_bits']} but configured {self.error_bits}")
        self.beta = float(sd["beta"])
        self.reset_interval = int(sd["reset_interval"])
        self.steps_since_reset = int(sd["steps_since_reset"])
        self._buckets = {}
        for k, bsd in sd["buckets"].items():
            self.bucket(k).load_state_dict(bsd, device=device)

    # -- internals -----------------------------------------------------------------------------
    def _clear_all(self) -> None:
        for b in self._buckets.values():
            b.clear()
        self.steps_since_reset = 0

    def _dense_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.error_bits == 16 else torch.float32

    def _store(self, e: torch.Tensor, group_size: int) -> _StoredError:
        if self.error_bits == 8:
            q = quantize(e, 8, group_size, stochastic=False, check_finite=False)
            return _StoredError(e.numel(), group_size, q=q)
        return _StoredError(e.numel(), group_size, dense=e.to(self._dense_dtype()))
