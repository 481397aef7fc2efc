"""A 2-rank run prints each library notice at most once and nothing per rank before training.

Why: every rank used to print megatron-core's Transformer Engine/Apex fallback warnings and
torch's deprecation notices for renamed collectives: ~40 lines of noise before the first log
line of a 2-rank run, more with more ranks.
"""

from __future__ import annotations

import collections
from pathlib import Path


def test_two_rank_run_repeats_no_warning(tmp_path: Path, run_pretrain) -> None:
    res = run_pretrain(["--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3",
                        "--bf16", "--use-distributed-optimizer", "--quantized-gradients",
                        "--quantized-weights", "--data-parallel-intra-node-size", "1",
                        "--log-interval", "1", "--eval-iters", "1"],
                       show_warnings=True)
    assert res.returncode == 0, res.stderr[-3000:]
    out = (res.stdout + res.stderr).splitlines()
    warning_lines = [l for l in out if "Warning:" in l]
    repeated = [l for l, n in collections.Counter(warning_lines).items() if n > 1]
    assert not repeated, repeated
    assert not [l for l in out if "FutureWarning" in l or "DeprecationWarning" in l], out
    assert len(warning_lines) <= 4, warning_lines  # the TE/Apex fallbacks, once each
    before_training = out[:next(i for i, l in enumerate(out) if " iteration        1/" in l)]
    assert len(before_training) <= 20, "\n".join(before_training)
