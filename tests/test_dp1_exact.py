"""Data-parallel size 1 is exact (issue 23, item 4).

Why: with ``--quantized-weights`` and one data-parallel rank the weights were still quantized to 4
bits every step: nothing was sent, only precision was lost. With nobody to talk to the model now
gets megatron-core's own DDP, so SDP4Bit's flags train bit-identically to the baseline, and the
log says quantized communication is off.
"""

from __future__ import annotations

import json
from pathlib import Path

SDP4BIT = ["--quantized-weights", "--quantized-gradients", "--hadamard-transform", "--loco"]
COMMON = ["--global-batch-size", "4", "--train-iters", "6", "--lr", "3e-3", "--bf16",
          "--use-distributed-optimizer", "--log-interval", "1", "--eval-iters", "0"]


def _losses(tmp_path: Path, name: str, run_pretrain, extra) -> list:
    jsonl = tmp_path / f"{name}.jsonl"
    res = run_pretrain(COMMON + ["--jsonl-log", str(jsonl)] + extra, nproc=1)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    return res.stdout, [(r["iteration"], r["lm_loss"], r.get("grad_norm"))
                        for r in records if r["type"] == "train"]


def test_sdp4bit_flags_at_dp1_train_bit_identically_to_the_baseline(tmp_path: Path,
                                                                   run_pretrain) -> None:
    base_out, base = _losses(tmp_path, "baseline", run_pretrain, [])
    quant_out, quant = _losses(tmp_path, "sdp4bit", run_pretrain, SDP4BIT)
    assert len(base) == 6 and quant == base
    assert "quantized communication off: data-parallel size 1" in quant_out
    assert "quantized communication off" not in base_out
