"""bench/virtual_cuda_ranks.py's CPU side (issue 25 item 1): the harness that runs several ranks
on one GPU compares against exactly this run, so here it must itself be right: every rank agrees
to skip the NaN step, a resume before the last step continues bit-identically, and the
comparison notices a different run.  The CUDA side runs on a GPU (docs/performance.md)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "bench")]

import virtual_cuda_ranks as V  # noqa: E402


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
