"""Checkpoints that survive changes: torch_dist resharding, quantization switched at resume,
clear refusals for the per-rank format, missing checkpoints, and a rank killed mid-save.

Why: a user moves a run to another number of nodes, enables SDP4Bit on a run started without
it, mistypes ``--load``, or loses a node while a checkpoint is written; none of these may end
in a raw traceback, a silent restart from iteration 0, or a corrupt checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

BASE = ["--global-batch-size", "8", "--train-iters", "8", "--lr", "3e-3", "--bf16",
        "--use-distributed-optimizer", "--log-interval", "1", "--eval-interval", "4",
        "--eval-iters", "1"]
SDP4BIT_LOCO = ["--quantized-weights", "--quantized-gradients", "--hadamard-transform", "--loco"]


def _losses(path: Path) -> List[Tuple[int, float]]:
    return [(r["iteration"], r["lm_loss"]) for r in map(json.loads, path.read_text().splitlines())
            if r["type"] == "train"]


def _ok(res) -> None:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.fixture(scope="module")
def sdp4bit_loco_2_ranks(tmp_path_factory, run_pretrain) -> Tuple[List[Tuple[int, float]], Path]:
    """One uninterrupted 2-rank SDP4Bit+LoCo run (2 nodes x 1), torch_dist checkpoints at 4 and
    8: (its losses, its checkpoint directory). Three tests start from it; a test that changes
    the checkpoint works on its own copy."""
    work = tmp_path_factory.mktemp("sdp4bit_loco_2_ranks")
    log, ckpt = work / "full.jsonl", work / "ckpt"
    _ok(run_pretrain(BASE + SDP4BIT_LOCO + ["--data-parallel-intra-node-size", "1",
                                            "--ckpt-format", "torch_dist", "--jsonl-log",
                                            str(log), "--save", str(ckpt), "--save-interval",
                                            "4"]))
    return _losses(log), ckpt


def test_torch_dist_resume_is_bit_exact_with_sdp4bit_loco(tmp_path: Path, run_pretrain,
                                                          sdp4bit_loco_2_ranks) -> None:
    """Same layout: every piece of state (LoCo errors, generators, Adam, RNG) comes back. The
    weight gathers start right after each step, so the save at 4 may meet them in flight (it
    waits for them first). The reference is the same run without the overlaps (which never
    change the numbers)."""
    args = BASE + SDP4BIT_LOCO + ["--data-parallel-intra-node-size", "1",
                                  "--overlap-grad-reduce", "--overlap-param-gather",
                                  "--overlap-param-gather-with-optimizer-step",
                                  "--ckpt-format", "torch_dist"]
    full, _ = sdp4bit_loco_2_ranks
    resumed, ckpt = tmp_path / "resumed.jsonl", tmp_path / "ckpt"
    _ok(run_pretrain(args + ["--jsonl-log", str(resumed), "--save", str(ckpt),
                             "--save-interval", "4", "--exit-interval", "4"]))
    assert (ckpt / "iter_0000004" / "metadata.json").is_file()  # megatron-core's format
    assert sorted(os.listdir(ckpt / "iter_0000004" / "rank_state")) == [
        "tp00_pp000_dp00000.pt", "tp00_pp000_dp00001.pt"]
    res = run_pretrain(args + ["--jsonl-log", str(resumed), "--load", str(ckpt)])
    _ok(res)
    assert "loaded checkpoint from" in res.stdout and "resharded" not in res.stdout
    assert full == _losses(resumed)


def _layout(n: int) -> List[str]:
    return ["--data-parallel-intra-node-size", str(2 if n == 4 else 1)]


def _reshard(tmp_path: Path, run_pretrain, n_from: int, n_to: int,
             trained: Optional[Tuple[List[Tuple[int, float]], Path]] = None) -> None:
    """Train SDP4Bit+LoCo on n_from ranks (as n_from/2 x 2 or 2 x 1 nodes), save at 4, resume
    on n_to ranks: the loss continues from where it was, not from a fresh model. ``trained``:
    that run's (losses, checkpoint) if it exists already (it is copied, not changed)."""
    resumed, ckpt = tmp_path / "resumed.jsonl", tmp_path / "ckpt"
    if trained is None:
        full = tmp_path / "full.jsonl"
        _ok(run_pretrain(BASE + SDP4BIT_LOCO + _layout(n_from) + [
            "--ckpt-format", "torch_dist", "--jsonl-log", str(full), "--save", str(ckpt),
            "--save-interval", "4"], nproc=n_from))
        full_losses = _losses(full)
    else:
        full_losses, source = trained
        shutil.copytree(source, ckpt)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")  # resume from the middle
    res = run_pretrain(BASE + SDP4BIT_LOCO + _layout(n_to) + [
        "--jsonl-log", str(resumed), "--load", str(ckpt)], nproc=n_to)
    _ok(res)
    print(res.stdout)
    assert (f"DP={n_from}, EP=1; this run has TP=1, PP=1, DP={n_to}, EP=1: model and "
            "optimizer states resharded") in res.stdout
    assert "quantization state re-derived for the new layout" in res.stdout
    a, b = dict(full_losses), dict(_losses(resumed))
    assert sorted(b) == [5, 6, 7, 8]
    # Another DP size sums the gradients in another order and quantizes other partitions, so
    # the continuation is close, not identical; a fresh model would start near ln(128) = 4.85.
    for it in (5, 6, 7, 8):
        assert abs(b[it] - a[it]) < 0.02 * a[it], (it, a[it], b[it])
    assert b[5] < a[1] - 0.4


def test_torch_dist_sdp4bit_loco_4_ranks_resumed_on_2(tmp_path: Path, run_pretrain) -> None:
    _reshard(tmp_path, run_pretrain, 4, 2)


def test_torch_dist_sdp4bit_loco_2_ranks_resumed_on_4(tmp_path: Path, run_pretrain,
                                                      sdp4bit_loco_2_ranks) -> None:
    _reshard(tmp_path, run_pretrain, 2, 4, trained=sdp4bit_loco_2_ranks)


def test_torch_dist_quantization_switched_on_and_off_at_resume(tmp_path: Path,
                                                                run_pretrain) -> None:
    """Start unquantized, enable SDP4Bit at resume (bucket padding changes), and back."""
    plain, quant = tmp_path / "plain", tmp_path / "quant"
    _ok(run_pretrain(BASE + ["--ckpt-format", "torch_dist", "--save", str(plain),
                             "--save-interval", "4", "--exit-interval", "4"]))
    res = run_pretrain(BASE + SDP4BIT_LOCO + ["--data-parallel-intra-node-size", "1",
                                              "--ckpt-format", "torch_dist", "--load", str(plain),
                                              "--save", str(quant)])
    _ok(res)
    assert "has no quantization state (written without quantization)" in res.stdout
    assert "loaded checkpoint from" in res.stdout and "iterations: 8" in res.stdout
    # LoCo switched off: its error buffers do not apply to the new setting.
    res = run_pretrain(BASE + SDP4BIT_LOCO[:-1] + ["--data-parallel-intra-node-size", "1",
                                                   "--train-iters", "10", "--load", str(quant),
                                                   "--use-checkpoint-opt_param-scheduler",
                                                   "--save", str(quant), "--ckpt-format",
                                                   "torch_dist"])
    _ok(res)
    assert "quantization state re-derived for changed settings (--loco True -> False)" \
        in res.stdout
    res = run_pretrain(BASE + ["--train-iters", "12", "--load", str(quant),
                               "--use-checkpoint-opt_param-scheduler"])
    _ok(res)
    assert "this run does not quantize: ignored" in res.stdout
    assert " iteration       12/" in res.stdout


def test_torch_format_refuses_another_layout_naming_it(tmp_path: Path, run_pretrain) -> None:
    ckpt = tmp_path / "ckpt"
    _ok(run_pretrain(BASE + ["--save", str(ckpt), "--save-interval", "4",
                             "--exit-interval", "4"]))
    res = run_pretrain(BASE + ["--load", str(ckpt)], nproc=4)
    assert res.returncode != 0
    assert "data-parallel size 2 -> 4" in res.stderr and "--ckpt-format torch_dist" in res.stderr
    # One message from rank 0; no rank's traceback (torchrun still reports the exit status).
    assert "checkpointing.py" not in res.stderr and res.stderr.count("error: checkpoint") == 1
    res = run_pretrain(BASE + ["--load", str(ckpt), "--quantized-gradients",
                               "--data-parallel-intra-node-size", "1"])
    assert res.returncode != 0
    assert "quantized-communication False -> True" in res.stderr, res.stderr[-2000:]


def test_missing_checkpoint_is_said_once_and_can_be_an_error(tmp_path: Path,
                                                             run_pretrain) -> None:
    typo = tmp_path / "no_such_dir"
    res = run_pretrain(BASE + ["--train-iters", "1", "--load", str(typo)])
    _ok(res)
    assert res.stdout.count(f"--load {typo}: no checkpoint found (the directory does not "
                            "exist); training starts from iteration 0") == 1

    res = run_pretrain(BASE + ["--train-iters", "1", "--load", str(typo),
                               "--exit-on-missing-checkpoint"])
    assert res.returncode == 1
    assert res.stderr.count("no checkpoint to resume from (the directory does not exist) and "
                            "--exit-on-missing-checkpoint is set") == 1

    # A typo in --load next to a real --save: the run must not move that tracker backwards.
    real = tmp_path / "real"
    _ok(run_pretrain(BASE + ["--train-iters", "2", "--save", str(real)]))
    res = run_pretrain(BASE + ["--load", str(typo), "--save", str(real)])
    assert res.returncode == 1
    assert "holds a checkpoint at iteration 2 whose tracker the first save would move " \
           "backwards" in res.stderr
    assert (real / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_rank_killed_while_checkpoint_is_written_then_resume(tmp_path: Path, run_pretrain,
                                                             sdp4bit_loco_2_ranks) -> None:
    """kill -9 of rank 1 after it wrote its file of iteration 4, before the checkpoint was
    complete: iteration 4 must not be loadable, the resume starts from 2 and reproduces the
    uninterrupted losses bit for bit (those of the same run saving torch_dist checkpoints)."""
    args = BASE + SDP4BIT_LOCO + ["--data-parallel-intra-node-size", "1"]
    resumed, ckpt = tmp_path / "resumed.jsonl", tmp_path / "ckpt"
    os.environ["MEGATRON_FAULT_INJECTION"] = "kill:checkpoint-written:4:1"
    try:
        res = run_pretrain(args + ["--jsonl-log", str(resumed), "--save", str(ckpt),
                                   "--save-interval", "2"])
    finally:
        del os.environ["MEGATRON_FAULT_INJECTION"]
    assert res.returncode != 0
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not (ckpt / "iter_0000004").exists()
    res = run_pretrain(args + ["--jsonl-log", str(resumed), "--save", str(ckpt),
                               "--load", str(ckpt)])
    _ok(res)
    assert "loaded checkpoint from" in res.stdout and "at iteration 2" in res.stdout
    a = sdp4bit_loco_2_ranks[0]
    b = [r for r in _losses(resumed) if r[0] <= 2] + [r for r in _losses(resumed)[-6:]]
    assert a == b
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]  # temp dir cleaned up
