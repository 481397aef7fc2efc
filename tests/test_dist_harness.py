"""tests/dist_harness.py: ranks forked from a fork server still see the test's environment and
import path at the time of each ``run_distributed`` call (the server keeps the environment of its
start; multiprocessing sends the import path), and the preloaded imports left no CUDA context
for them to inherit."""

from __future__ import annotations

import os
import sys

from dist_harness import run_distributed


def _environment_of_rank(rank: int, world: int) -> dict:
    import torch

    return {"value": os.environ.get("DIST_HARNESS_PROBE"), "world": world,
            "torch_preloaded": "megatron.core" in sys.modules,
            "cuda_initialized": torch.cuda.is_initialized()}


def test_each_job_gets_the_environment_and_import_path_of_its_call(tmp_path, monkeypatch):
    monkeypatch.delenv("DIST_HARNESS_PROBE", raising=False)
    first = run_distributed(2, _environment_of_rank, tmp_path)  # the server is up now
    assert [r["value"] for r in first] == [None, None]
    assert all(r["torch_preloaded"] and not r["cuda_initialized"] for r in first)

    # a variable set and a module made importable only after the server started
    monkeypatch.setenv("DIST_HARNESS_PROBE", "set-after-the-server-started")
    (tmp_path / "late_module").mkdir()
    (tmp_path / "late_module" / "late_rank_job.py").write_text(
        "import os\n\ndef job(rank, world):\n"
        "    return {'value': os.environ['DIST_HARNESS_PROBE'], 'rank': rank}\n")
    monkeypatch.syspath_prepend(str(tmp_path / "late_module"))
    import late_rank_job

    second = run_distributed(2, _environment_of_rank, tmp_path)
    assert [r["value"] for r in second] == ["set-after-the-server-started"] * 2
    late = run_distributed(2, late_rank_job.job, tmp_path)
    assert late == [{"value": "set-after-the-server-started", "rank": r} for r in (0, 1)]
