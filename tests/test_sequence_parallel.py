"""--sequence-parallel with TP = 2 on 4 ranks (2 data-parallel "nodes"), every quantization mode.

Why: Megatron-LM users pair tensor parallelism with sequence parallelism. Under it each
tensor-parallel rank normalizes only its slice of the sequence, so the norm weights' gradients
must be all-reduced over the tensor-parallel group after the (possibly quantized) data-parallel
reduction; if they were not, the replicas of those weights would drift apart across TP ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import pytest
import torch

ARGS = ["--global-batch-size", "8", "--train-iters", "3", "--lr", "3e-3", "--bf16",
        "--use-distributed-optimizer", "--tensor-model-parallel-size", "2",
        "--log-interval", "1", "--eval-iters", "0", "--split", "100,0,0"]
MODES = {
    "baseline": [],
    "qw": ["--quantized-weights", "--weight-quantization-mode", "direct",
           "--weight-quantization-bits", "8"],
    "tlq": ["--quantized-gradients"],
    "sdp4bit-loco": ["--quantized-weights", "--quantized-gradients", "--hadamard-transform",
                     "--loco"],
}


def _losses(path: Path) -> List[float]:
    return [r["lm_loss"] for r in map(json.loads, path.read_text().splitlines())
            if r["type"] == "train"]


def _norm_weights(ckpt_dir: Path, tp_rank: int) -> dict:
    state = torch.load(ckpt_dir / "iter_0000003" / f"mp_rank_{tp_rank:02d}_000_dp_000.pt",
                       map_location="cpu", weights_only=False)
    return {k: v for k, v in state["model"][0].items() if "layernorm" in k or "final_norm" in k}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_sequence_parallel_trains_and_keeps_norms_in_sync(tmp_path: Path, run_pretrain,
                                                          mode: str) -> None:
    flags = MODES[mode] + (["--data-parallel-intra-node-size", "1"] if MODES[mode] else [])
    log, ckpt = tmp_path / "sp.jsonl", tmp_path / "ckpt"
    res = run_pretrain(ARGS + flags + ["--sequence-parallel", "--jsonl-log", str(log),
                                       "--save", str(ckpt)], nproc=4)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    losses = _losses(log)
    assert len(losses) == 3 and all(map(lambda x: x == x, losses)) and losses[-1] < losses[0]
    norms0, norms1 = _norm_weights(ckpt, 0), _norm_weights(ckpt, 1)
    assert norms0 and norms0.keys() == norms1.keys()
    for key in norms0:  # replicated over TP, and moved away from their initial 1 / 0
        assert torch.equal(norms0[key], norms1[key]), key
    assert any(not torch.all(v == v.flatten()[0]) for v in norms0.values())
    if mode == "baseline":
        plain = tmp_path / "plain.jsonl"
        res = run_pretrain(ARGS + ["--jsonl-log", str(plain)], nproc=4)
        assert res.returncode == 0, res.stderr[-3000:]
        # Same model and data; only the TP reduction order differs (bf16): within 1 %.
        for a, b in zip(_losses(plain), losses):
            assert abs(a - b) < 0.01 * a, (a, b)
