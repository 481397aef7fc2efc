"""megatron-core's DDP bucket hooks on the CUDA stage path, without a GPU (issue 25, item 1).

Why: bench/virtual_cuda_ranks.py runs the quantized collectives on CUDA stages the way ddp.py
calls them, but not through megatron-core's own ``DistributedDataParallel`` (its bucket groups,
backward hooks, ``finish_grad_sync``, forward pre-hooks of ``--overlap-param-gather``): that
wiring had only ever run with CPU worker-thread stages. Here 4 gloo ranks (2 "nodes" of 2) train
the tiny bf16 GPT through megatron-core's DDP and distributed optimizer with SDP4Bit + LoCo,
``--overlap-grad-reduce --overlap-param-gather`` and ``--gradient-alltoall-pipeline 3``, once with
the CPU thread stages and once with every runtime's stages on CUDA streams -- the fake
``torch.cuda`` of fake_cuda.py over CPU tensors, with its allocation check -- and a NaN step in
between. The two must agree bit for bit (streams never change the numbers), and no tensor made on
one stage may be read by another stage without ``record_stream`` (review item 1's bug class).
"""

from __future__ import annotations

import os
from typing import Any, Dict

import pytest
import torch

from fake_cuda import FakeCuda, StreamAllocationCheck
from test_integration_ddp import build, run_distributed, same_on_all_ranks, train

STEPS = 3
QUANT = {"quantized_gradients": True, "quantized_weights": True, "hadamard_transform": True,
         "loco": True, "gq_group_size_intra": 128, "gq_group_size_inter": 128,
         "wq_group_size": 128, "data_parallel_intra_node_size": 2,
         "gradient_alltoall_pipeline": 3}
DDP = {"overlap_grad_reduce": True, "overlap_param_gather": True, "bucket_size": 3000}


def _train(rank: int, nan_step: int) -> Dict[str, Any]:
    """STEPS steps; rank 1's first gradient is NaN in step ``nan_step`` (a tensor hook, so it is
    in place before the overlapped reduce-scatter reads the bucket)."""
    chunks, opt, _ = build(QUANT, DDP)
    poison = {"on": False}
    first = next(p for p in chunks[0].module.parameters() if p.requires_grad)
    if rank == 1:
        first.register_hook(lambda g: torch.full_like(g, float("nan")) if poison["on"] else None)

    def after_step(it: int) -> None:
        poison["on"] = it + 1 == nan_step
    return train(chunks, opt, rank, STEPS, on_step=after_step)


def _worker(rank: int, world: int) -> Dict[str, Any]:
    from megatron.distributed.quant import streams as streams_mod

    os.environ["QUANT_KERNELS"] = "torch"   # every allocation through the dispatcher
    threads = _train(rank, nan_step=1)
    mp = pytest.MonkeyPatch()
    fake = FakeCuda()
    fake.install(mp, names=iter(lambda: "stage", None))   # named by the stage below
    kinds = []

    def cuda_stages(cls, device):   # every runtime's overlap stages on (fake) CUDA streams
        st = cls("cuda", torch.device("cuda", 0))
        kinds.append(st.kind)
        return st
    mp.setattr(streams_mod.CommStreams, "for_device", classmethod(cuda_stages))
    original_stage = streams_mod._CudaStage.__init__

    def named_stage(self, name, device):   # the fake stream carries the stage's name
        original_stage(self, name, device)
        self.stream.name = name
    mp.setattr(streams_mod._CudaStage, "__init__", named_stage)
    check = StreamAllocationCheck(fake)
    unprotected = StreamAllocationCheck(fake)
    try:
        with check:
            streamed = _train(rank, nan_step=1)
        # the same run with the stages' record_stream hand-over disabled (the code before the
        # fix of review item 1): the check must see the middle hop's codes
        from megatron.distributed.quant.collectives import gradients
        mp.setattr(gradients, "used_on_this_stage", lambda *tensors: None)
        with unprotected:
            _train(rank, nan_step=1)
    finally:
        mp.undo()
    crossing = {n for _, alloc, reader, n in check.reads if (alloc, reader) == ("intra", "inter")}
    return {
        "kinds": sorted(set(kinds)),
        "losses_equal": threads["losses"] == streamed["losses"],
        "oks": streamed["oks"], "oks_threads": threads["oks"],
        "params_equal": torch.equal(threads["params"], streamed["params"]),
        "same_on_ranks": same_on_all_ranks(streamed["params"]),
        "hazards": check.hazards(), "crossing": len(crossing),
        "hazards_without_hand_over": sorted(set(unprotected.hazards())),
        "stage_ops": sorted({r for _, _, r, _ in check.reads} - {"default"}),
    }


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 4)


def test_cuda_stages_under_megatron_core_ddp_equal_the_thread_stages(results) -> None:
    for r in results:
        assert r["kinds"] == ["cuda"]
        assert r["stage_ops"] == ["inter", "intra", "weights"]   # every stage ran work
        assert r["losses_equal"] and r["params_equal"] and r["same_on_ranks"], r
        assert r["oks"] == r["oks_threads"] == [True, False, True]   # the NaN step skipped


def test_no_tensor_crosses_stages_without_record_stream(results) -> None:
    for r in results:
        assert r["crossing"] > 0          # the middle hop's codes did cross intra -> inter
        assert r["hazards"] == [], r["hazards"]
        assert r["hazards_without_hand_over"] == [("intra", "inter")]
