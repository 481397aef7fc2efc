"""Megatron-LM's ``--profile`` flags and memory report (issue 23, item 3).

Why: there was no way to see where a step's time goes (Megatron-LM's ``--profile
--use-pytorch-profiler --profile-step-start/-end --profile-ranks``) and no memory report. On the
CPU the torch profiler traces the CPU operators; on a GPU the same run adds CUDA kernels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.training.arguments import parse_args
from megatron.training.arguments.validation import ArgumentError, validate_args


def test_profiled_iterations_leave_a_trace_and_a_top_operator_table(tmp_path: Path,
                                                                    run_pretrain) -> None:
    tb = tmp_path / "tb"
    res = run_pretrain(["--global-batch-size", "2", "--train-iters", "4", "--lr", "1e-3",
                        "--log-interval", "2", "--eval-iters", "0", "--tensorboard-dir", str(tb),
                        "--profile", "--use-pytorch-profiler", "--profile-step-start", "2",
                        "--profile-step-end", "4"], nproc=1)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    traces = list(tb.glob("trace_rank0_iter2-3.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any("aten::mm" in str(e.get("name")) or "aten::addmm" in str(e.get("name"))
               for e in events)
    assert " > profile of iterations 2-3 (rank 0):" in res.stdout
    assert "CPU total" in res.stdout          # the operator table
    assert "[Rank 0] (after 2 iterations) memory (MB) | host peak RSS:" in res.stdout
    assert res.stdout.count("memory (MB)") == 1


@pytest.mark.parametrize("extra,message", [
    (["--profile"], "cudaProfilerStart/Stop, which needs CUDA; add --use-pytorch-profiler"),
    (["--profile", "--use-pytorch-profiler", "--profile-step-start", "5",
      "--profile-step-end", "5"], "need 1 <= start < end"),
])
def test_profile_flags_that_cannot_work_stop_the_launch(extra, message) -> None:
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
            "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
            "--mock-data", "--vocab-size", "64", "--device", "cpu"] + extra
    with pytest.raises(ArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_args(parse_args(argv, validate=False))
