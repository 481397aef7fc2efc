"""Interrupted + resumed training reproduces the uninterrupted run exactly.

Why: checkpoints must capture everything that influences the next step -- fp32 main params
and Adam state of the distributed optimizer shards, LR scheduler, every RNG (dropout is on),
and the data position -- and be written atomically (a crash mid-save must not corrupt
``--load``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Tuple

ARGS = ["--global-batch-size", "8", "--train-iters", "8", "--lr", "3e-3", "--bf16",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--position-embedding-type",
        "rope", "--swiglu", "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "1"]


def _losses(path: Path, kind: str = "train") -> List[Tuple[int, float]]:
    return [(r["iteration"], r["lm_loss"]) for r in map(json.loads, path.read_text().splitlines())
            if r["type"] == kind]


def test_resume_reproduces_uninterrupted_run(tmp_path: Path, run_pretrain) -> None:
    full, resumed, ckpt = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl", tmp_path / "ckpt"
    res = run_pretrain(ARGS + ["--jsonl-log", str(full)])
    assert res.returncode == 0, res.stderr[-3000:]

    res = run_pretrain(ARGS + ["--jsonl-log", str(resumed), "--save", str(ckpt),
                               "--save-interval", "2", "--exit-interval", "4"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "exit_reason: exit interval 4" in res.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]  # no temp dirs
    assert sorted(p.name for p in (ckpt / "iter_0000004").iterdir()) == [
        "checkpoint_writer.json", "manifest.json",
        "mp_rank_00_000_dp_000.pt", "mp_rank_00_000_dp_001.pt"]

    res = run_pretrain(ARGS + ["--jsonl-log", str(resumed), "--save", str(ckpt),
                               "--load", str(ckpt)])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "loaded checkpoint from" in res.stdout

    a, b = _losses(full), _losses(resumed)
    assert [i for i, _ in a] == list(range(1, 9)) and [i for i, _ in b] == list(range(1, 9))
    assert a == b  # bit-exact, including the first steps after the resume
    assert _losses(full, "valid") == _losses(resumed, "valid")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "8"
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]
