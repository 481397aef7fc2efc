"""The quantized reduce-scatter's temporaries: at most two bucket-sized fp32 buffers on any path,
and the startup estimate (memory.py) against what the collectives really allocate (issue 36,
item 5).

Why: with LoCo the first hop of a bucket held about five fp32 copies of it at once (the
compensated gradient, the dequantized codes in slot order, their un-permuted copy, the residual
and the read-back error): 0.8 GB at megatron-core's default 40M-element bucket, in the stage
stream's allocator pool. Measured here with a dispatch mode that counts every fresh allocation
of the collective (its outputs, as the caching allocator hands out blocks), with the C++ kernels
(their internal scratch is freed inside the op, as a fused GPU kernel's registers are).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Tuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron.distributed.quant.collectives import common, gradients
from megatron.distributed.quant.config import HopSpec, QuantizationConfig
from megatron.distributed.quant.loco import LoCoErrorFeedback
from megatron.distributed.quant.memory import layer_memory
from megatron.distributed.quant.topology import TwoLevelGroups

GS = 128


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the blocks allocated inside the mode and still alive (all, and fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = {"all": 0, "fp32": 0}
        self.peak = {"all": 0, "fp32": 0}
        self._seen: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        operands = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs or {}))
                    if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in operands or ptr in self._seen or storage.nbytes() == 0:
                continue
            kinds = ("all", "fp32") if t.dtype == torch.float32 else ("all",)
            self._seen.add(ptr)
            for k in kinds:
                self.live[k] += storage.nbytes()
                self.peak[k] = max(self.peak[k], self.live[k])
            weakref.finalize(storage, self._free, ptr, storage.nbytes(), kinds)
        return out

    def _free(self, ptr: int, nbytes: int, kinds: Tuple[str, ...]) -> None:
        self._seen.discard(ptr)
        for k in kinds:
            self.live[k] -= nbytes


class _Group:
    def __init__(self, size: int) -> None:
        self.size = size


class Loopback:
    """Peers that send what this rank sends (sizes and lifetimes matter here, not values)."""

    ReduceOp = torch.distributed.ReduceOp

    def get_world_size(self, group: Any = None) -> int:
        return group.size

    def get_rank(self, group: Any = None) -> int:
        return 0

    def all_to_all_single(self, out, inp, group=None, async_op=False):  # noqa: ANN001
        out.copy_(inp)


def _groups(d: int, m: int) -> TwoLevelGroups:
    return TwoLevelGroups(dp_group=_Group(d * m), intra_group=_Group(d) if d > 1 else None,
                          inter_group=_Group(m) if m > 1 else None, dp_size=d * m, dp_rank=0,
                          intra_size=d, inter_size=m, node=0, local=0,
                          dp_ranks=list(range(d * m)))


def _measure(monkeypatch, d: int, m: int, loco: bool, hadamard: bool,
             pipeline: int) -> Tuple[Dict[str, int], int, QuantizationConfig]:
    monkeypatch.setenv("QUANT_KERNELS", "cpp")
    transport = Loopback()
    for module in (common, gradients):   # where the reduce-scatter looks ``dist`` up
        monkeypatch.setattr(module, "dist", transport)
    cfg = QuantizationConfig(quantized_gradients=True, loco=loco, hadamard_transform=hadamard,
                             gq_group_size_intra=GS, gq_group_size_inter=GS,
                             gradient_alltoall_pipeline=pipeline)
    n = d * m * GS * 256
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    out = torch.empty(n // (d * m))
    ef = LoCoErrorFeedback().bucket(0) if loco else None
    peak: Dict[str, int] = {}
    for _ in range(2):   # the second call reads back the stored errors
        mode = LiveBytes()
        with mode:
            gradients.two_level_reduce_scatter(
                x, out, _groups(d, m), intra=HopSpec(8, GS, hadamard=hadamard),
                inter=HopSpec(4, GS, hadamard=hadamard), generator=torch.Generator().manual_seed(1),
                nonfinite_flag=torch.zeros(1, dtype=torch.int32), error_feedback=ef,
                pipeline=pipeline)
        peak = dict(mode.peak)
    return peak, n, cfg


LAYOUTS = [(2, 2, True, True, 1), (2, 2, True, False, 2), (2, 2, False, True, 2),
           (4, 1, True, True, 1), (1, 4, True, False, 1), (2, 4, False, False, 1)]


@pytest.mark.parametrize("d,m,loco,hadamard,pipeline", LAYOUTS)
def test_at_most_two_fp32_copies_of_a_bucket(monkeypatch, d, m, loco, hadamard,
                                             pipeline) -> None:
    peak, n, _ = _measure(monkeypatch, d, m, loco, hadamard, pipeline)
    scales = n // GS * 4 * 4     # a few fp32 scale vectors beside the buffers
    assert peak["fp32"] <= 2 * n * 4 + scales, (peak["fp32"] / (n * 4))


@pytest.mark.parametrize("d,m,loco,hadamard,pipeline", LAYOUTS)
def test_the_startup_estimate_covers_what_is_allocated(monkeypatch, d, m, loco, hadamard,
                                                       pipeline) -> None:
    """The estimate is an upper bound, and not a loose one (within 1.6x of the measurement)."""
    peak, n, cfg = _measure(monkeypatch, d, m, loco, hadamard, pipeline)
    estimate = layer_memory(cfg, [n], d * m, d).transient_bytes
    assert peak["all"] <= estimate <= 1.6 * peak["all"], (peak["all"], estimate)


def test_persistent_memory_is_loco_errors_and_qwd_shards() -> None:
    cfg = QuantizationConfig(quantized_gradients=True, quantized_weights=True, loco=True,
                             gq_group_size_intra=GS, gq_group_size_inter=GS)
    n, p, d = 40_000_000 // (8 * GS) * (8 * GS), 16, 8
    mem = layer_memory(cfg, [n, n], p, d, param_bytes=2)
    per_bucket = (n + n // GS * 4) + (n // d + n // d // GS * 4) + n // p * 2
    assert mem.persistent_bytes == 2 * per_bucket
    assert "383.8 MiB while" in mem.describe() and "40.0M elements" in mem.describe()
    assert "GiB held" in layer_memory(cfg, [n] * 40, p, d).describe()
    assert layer_memory(QuantizationConfig(), [n], p, d).transient_bytes == 0
