"""Host-sync budget of the quantized path: at most one per training step, none per bucket.

Why: on a GPU every ``.item()``, ``bool(tensor)``, ``float(tensor)``, ``.tolist()``, ``.cpu()``
of a device tensor blocks the host until the CUDA stream drains; one per bucket (or per hop)
serializes the communication that overlap is meant to hide.  There is no GPU here, so the calls
are counted on CPU ranks: every such call made from the quantized layer
(``megatron/distributed/quant``) during one training step is counted, whatever the tensor's
device, because on a GPU the same call would be on a device tensor -- except the seed draws of
``kernels.reference.draw_seed``, which read the trainer's host (CPU) generators even on a GPU
(asserted below).

Budget: 1 per step (the agreement on the device-side non-finite flag, in ``prepare_grads``),
independent of the number of buckets.  Measured before this budget existed, with 4 buckets:
21 per step (2 per bucket non-finite agreements + 3 per bucket seed draws from generators on the
buckets' device + the step agreement).
"""

from __future__ import annotations

import collections
import os
import traceback
from functools import partial
from typing import Any, Dict

import torch

from dist_harness import run_distributed
from test_paro_training import TINY, _batches, _build, _setup

BUDGET_PER_STEP = 1
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
QUANT_DIR = os.sep + os.path.join("megatron", "distributed", "quant") + os.sep
SDP4BIT_LOCO = ["--quantized-weights", "--quantized-gradients", "--hadamard-transform", "--loco",
                "--data-parallel-intra-node-size", "2", "--overlap-grad-reduce",
                "--overlap-param-gather"]


class HostSyncCounter:
    """Counts Tensor host-sync calls by (calling file, line) while active."""

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()
        self._saved: Dict[str, Any] = {}

    def __enter__(self) -> "HostSyncCounter":
        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counted(tensor, *args, _original=original, **kwargs):
                stack = traceback.extract_stack(limit=3)
                caller = stack[-2]
                if not any(frame.name == "draw_seed" for frame in stack):
                    self.calls[(caller.filename, caller.lineno)] += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)

    def in_quant_layer(self) -> int:
        return sum(n for (path, _), n in self.calls.items() if QUANT_DIR in path)


def _worker(rank: int, world: int) -> Dict[str, Any]:
    from megatron.distributed.quant import integration
    from megatron.training.arguments import parse_args
    from megatron.training.step import forward_step, train_step

    _setup(rank, world, ["--bf16"])
    out: Dict[str, Any] = {}
    for bucket_size in ("20000", "1000000"):  # 4 buckets, 1 bucket
        args = parse_args(TINY + ["--bf16", "--ddp-bucket-size", bucket_size] + SDP4BIT_LOCO)
        model, opt, sched = _build(args, "NNG", False)
        batches = _batches(rank, 0, 3)
        rt = model[0].quant_runtime
        per_step = []
        for it in range(3):
            integration.set_iteration(model, it + 1)
            with HostSyncCounter() as counter:
                _, ok, _, _ = train_step(args, partial(forward_step, args), batches, model,
                                         opt, sched, torch.device("cpu"))
            assert ok
            per_step.append({"quant": counter.in_quant_layer(),
                             "where": sorted(f"{os.path.basename(p)}:{l}" for (p, l), n
                                             in counter.calls.items() if QUANT_DIR in p)})
        out[bucket_size] = {
            "steps": per_step,
            "buckets": sum(len(bg.buckets) for bg in model[0].quantized_bucket_groups()),
            "generator_devices": sorted({g.device.type for g in rt.generators.values()}),
        }
    return out


def test_quantized_path_syncs_the_host_once_per_step(tmp_path) -> None:
    results = run_distributed(4, _worker, tmp_path)
    assert results[0]["20000"]["buckets"] >= 4  # the budget must not depend on this
    assert results[0]["1000000"]["buckets"] < results[0]["20000"]["buckets"]
    for rank, res in enumerate(results):
        for bucket_size, run in res.items():
            assert run["generator_devices"] == ["cpu"], run["generator_devices"]  # host draws
            for step in run["steps"]:
                assert step["quant"] <= BUDGET_PER_STEP, (rank, bucket_size, step)
            # The one sync is the step's non-finite agreement, present every step.
            assert all(step["quant"] == 1 for step in run["steps"]), (rank, bucket_size, run)
