"""A MoE model trained by pretrain_gpt.py on 4 CPU ranks: SDP4Bit + LoCo on the expert buffers
resumes bit-exactly, torch_dist reshards across expert-parallel sizes, the per-rank format
refuses another one naming the flag, and the load-balancing loss is logged.

Why: the expert buffers add quantization state of their own (a second runtime: LoCo errors,
generators, qWD references over the expert-data-parallel group) and expert weights that differ
between EP ranks; a resume that dropped either, or a checkpoint that kept one EP rank's experts,
would train on with no error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
       "--moe-token-dispatcher-type", "alltoall", "--moe-ffn-hidden-size", "96",
       "--disable-bias-linear", "--swiglu"]
BASE = ["--global-batch-size", "8", "--train-iters", "8", "--lr", "3e-3", "--bf16",
        "--use-distributed-optimizer", "--log-interval", "1", "--eval-interval", "100",
        "--eval-iters", "1", "--data-parallel-intra-node-size", "2"] + MOE
SDP4BIT_LOCO = ["--quantized-weights", "--quantized-gradients", "--hadamard-transform", "--loco",
                "--overlap-grad-reduce", "--overlap-param-gather"]


def _records(path: Path) -> List[Dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == "train"]


def _losses(path: Path) -> Dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in _records(path)}


def _ok(res) -> None:
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]


def _ep(n: int) -> List[str]:
    return ["--expert-model-parallel-size", str(n)]


def test_moe_sdp4bit_loco_resume_is_bit_exact(tmp_path: Path, run_pretrain) -> None:
    """EP 2 x expert-DP 2, torch format: saved at 4, resumed to 8 = the uninterrupted run."""
    full, resumed, ckpt = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl", tmp_path / "ckpt"
    args = BASE + SDP4BIT_LOCO + _ep(2)
    res = run_pretrain(args + ["--jsonl-log", str(full), "--save", str(ckpt),
                               "--save-interval", "4"], nproc=4, timeout=300)
    _ok(res)
    assert "mixture of experts: 4 experts, top-2, alltoall dispatcher, EP=2, expert DP=2" in res.stdout
    records = _records(full)
    assert all(0.5 < r["load_balancing_loss"] < 2.0 for r in records), records[0]
    assert all(r["expert_grad_inter_bits_per_element"] == 4.25 for r in records)
    # each EP rank's experts are in the file of its expert-DP rank 0 (DP rank = EP rank)
    files = sorted(p.name for p in (ckpt / "iter_0000004").glob("mp_rank_*.pt"))
    assert files == [f"mp_rank_00_000_dp_{d:03d}.pt" for d in range(4)]
    import torch

    held = [("model" in torch.load(ckpt / "iter_0000004" / f, weights_only=False)) for f in files]
    assert held == [True, True, False, False]
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    res = run_pretrain(args + ["--jsonl-log", str(resumed), "--load", str(ckpt)], nproc=4,
                       timeout=300)
    _ok(res)
    assert "quantization state re-derived" not in res.stdout
    a, b = _losses(full), _losses(resumed)
    assert sorted(b) == [5, 6, 7, 8]
    assert all(a[it] == b[it] for it in b), (a, b)
    # the per-rank format holds EP 2's experts per file: another EP size is refused by name
    res = run_pretrain(BASE + SDP4BIT_LOCO + _ep(4) + ["--load", str(ckpt)], nproc=4,
                       timeout=300)
    assert res.returncode != 0
    assert "--expert-model-parallel-size 2 -> 4" in res.stdout + res.stderr


def test_moe_torch_dist_reshards_across_expert_parallel_sizes(tmp_path: Path,
                                                              run_pretrain) -> None:
    """Saved at EP 2, resumed at EP 4 and at EP 1 (experts as dense parameters): the loss goes
    on from where it was; the log names both layouts."""
    full, ckpt = tmp_path / "full.jsonl", tmp_path / "ckpt"
    _ok(run_pretrain(BASE + SDP4BIT_LOCO + _ep(2) + [
        "--ckpt-format", "torch_dist", "--jsonl-log", str(full), "--save", str(ckpt),
        "--save-interval", "4", "--exit-interval", "6"], nproc=4, timeout=300))
    a = _losses(full)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    for ep in (4, 1):
        resumed = tmp_path / f"ep{ep}.jsonl"
        res = run_pretrain(BASE + SDP4BIT_LOCO + _ep(ep) + [
            "--ckpt-format", "torch_dist", "--jsonl-log", str(resumed), "--load", str(ckpt),
            "--exit-interval", "6"], nproc=4, timeout=300)
        _ok(res)
        assert (f"DP=4, EP=2; this run has TP=1, PP=1, DP=4, EP={ep}: model and optimizer "
                "states resharded") in res.stdout, res.stdout[-3000:]
        assert "quantization state re-derived for the new layout" in res.stdout
        b = _losses(resumed)
        assert sorted(b) == [5, 6]
        # other experts per rank route and sum in another order: close, not identical; a fresh
        # model would start near ln(128) = 4.85
        for it in (5, 6):
            assert abs(b[it] - a[it]) < 0.02 * a[it], (ep, it, a[it], b[it])
        assert b[5] < a[1] - 0.3
