"""bench/virtual_cuda_ranks.py's CPU side (issue 25 item 1): the harness that runs several ranks
on one GPU compares against exactly this run, so here it must itself be right: every rank agrees
to skip the NaN step, a resume before the last step continues bit-identically, and the
comparison notices a different run.  The CUDA side runs on a GPU (docs/performance.md); in the
suite it runs on CPU tensors under the fake ``torch.cuda`` of fake_cuda.py, with the allocation
check that catches review item 1."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "bench")]

import virtual_cuda_ranks as V  # noqa: E402
from fake_cuda import FakeCuda, StreamAllocationCheck  # noqa: E402
from megatron.distributed.quant.collectives import gradients  # noqa: E402
from megatron.distributed.quant.streams import STAGES  # noqa: E402


def test_cpu_side_skips_the_nan_step_everywhere_and_resumes_bit_exactly() -> None:
    rec = V.run_layout(2, 2, ["cpu"], 8192, 4, seed=3)["cpu"]
    assert rec["skips"] == [False, True, False, False]
    assert V.resume_mismatches(rec, 4, "cpu") == []
    assert "resumed" in rec and len(rec["resumed"][0]) == 4


def test_comparison_accepts_the_same_run_and_flags_another() -> None:
    a = V.run_layout(2, 2, ["cpu"], 8192, 3, seed=3)["cpu"]
    b = V.run_layout(2, 2, ["cpu"], 8192, 3, seed=3)["cpu"]
    c = V.run_layout(2, 2, ["cpu"], 8192, 3, seed=4)["cpu"]
    assert V.compare(2, 2, {"cuda": a, "cpu": b}, 3) == []
    bad = V.compare(2, 2, {"cuda": c, "cpu": b}, 3)
    assert any("reduce-scatter shard differs" in x for x in bad)
    assert any("gathered parameters differ" in x for x in bad)


# -- the same harness on the CUDA stream path without a GPU (tests/fake_cuda.py) ----------------

def _fake_cuda(monkeypatch, p: int):
    """The fake ``torch.cuda`` and an allocation check entered in every rank's thread. Streams
    are named in :class:`V.Ranks`' creation order: each rank's compute stream ("default", the
    caller's, as in tests/test_cuda_stream_lifetimes.py), then each rank's three stages."""
    monkeypatch.setenv("QUANT_KERNELS", "torch")   # every allocation through the dispatcher

    def names():
        while True:
            yield from ["default"] * p + list(STAGES) * p
    fake = FakeCuda()
    fake.install(monkeypatch, names=names())
    return StreamAllocationCheck(fake)


def test_fake_cuda_stages_equal_the_cpu_run_with_every_cross_stage_tensor_handed_over(
        monkeypatch) -> None:
    """Issue 25 item 1, in the suite: the harness's CUDA side (per-rank compute streams, the
    runtimes' CUDA stages, LoCo, qWD, pipelined hops, the NaN step, the resume) runs on CPU
    tensors under the fake; its results equal the plain CPU run bit for bit, and no tensor made
    on one stage is read by another without ``record_stream``."""
    m, d, steps = 2, 2, 4
    check = _fake_cuda(monkeypatch, m * d)
    # one check entered in every rank's thread: torch keeps the dispatch-mode stack per thread,
    # and the check's records are plain containers shared by the ranks
    streamed = V.run_layout(m, d, ["cpu"], 8192, steps, seed=5, streamed=True,
                            rank_context=lambda: check)["cpu"]
    monkeypatch.undo()
    monkeypatch.setenv("QUANT_KERNELS", "torch")
    plain = V.run_layout(m, d, ["cpu"], 8192, steps, seed=5)["cpu"]
    assert V.compare(m, d, {"cuda": streamed, "cpu": plain}, steps) == []
    assert streamed["skips"] == [False, True, False, False]
    stages_used = {(alloc, reader) for _, alloc, reader, _ in check.reads}
    assert ("intra", "inter") in stages_used          # the middle hop's codes crossed
    assert check.hazards() == []


def test_fake_cuda_harness_catches_the_middle_hop_use_after_free(monkeypatch) -> None:
    """With the stages' ``record_stream`` hand-over disabled (the code of review item 1), the
    harness run flags the middle hop's codes: made on ``intra``, read on ``inter``."""
    check = _fake_cuda(monkeypatch, 4)
    monkeypatch.setattr(gradients, "used_on_this_stage", lambda *tensors: None)
    V.run_layout(2, 2, ["cpu"], 8192, 2, seed=5, streamed=True, rank_context=lambda: check)
    assert ("intra", "inter") in set(check.hazards())
