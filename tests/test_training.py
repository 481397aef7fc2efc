"""End-to-end: 2 CPU ranks train a tiny GPT through pretrain_gpt.py (torchrun, gloo).

Why: proves the whole training layer (args -> init -> GPTModel/Float16Module -> DDP via the
quantization integration -> distributed optimizer -> schedule -> logging) works together, and
pins the Megatron-style log line that users' log parsers depend on.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

LOG_RE = re.compile(
    r" iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \| elapsed time per iteration "
    r"\(ms\): [\d.]+ \| learning rate: [\d.E+-]+ \| global batch size:\s+8 \| lm loss: "
    r"([\d.E+-]+) \| loss scale: [\d.]+ \| grad norm: [\d.]+ \| number of skipped iterations:"
    r"\s+0 \| number of nan iterations:\s+0 \| throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \| "
    r"throughput \(tokens/s\): [\d.]+ \|")


def test_two_rank_cpu_training_loss_falls(tmp_path: Path, run_pretrain) -> None:
    jsonl = tmp_path / "log.jsonl"
    tb = tmp_path / "tb"
    res = run_pretrain([
        "--global-batch-size", "8", "--train-iters", "16", "--lr", "3e-3",
        "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
        "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
        "--overlap-param-gather", "--log-interval", "4", "--eval-interval", "8",
        "--eval-iters", "2", "--log-throughput", "--jsonl-log", str(jsonl),
        "--tensorboard-dir", str(tb), "--log-validation-ppl-to-tensorboard",
        "--timing-log-level", "2"])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = [m for m in LOG_RE.finditer(res.stdout)]
    assert [int(m.group(1)) for m in lines] == [4, 8, 12, 16], res.stdout[-3000:]
    assert [int(m.group(3)) for m in lines] == [32, 64, 96, 128]
    losses = [float(m.group(4)) for m in lines]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses  # mock data is learnable
    assert "validation loss at iteration 8 | lm loss value:" in res.stdout
    assert " training summary | iterations: 16 |" in res.stdout
    assert res.stdout.count(" iteration        4/") == 1  # only rank 0 logs

    records = [json.loads(l) for l in jsonl.read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    valid = [r for r in records if r["type"] == "valid"]
    assert [r["iteration"] for r in train] == [4, 8, 12, 16]
    assert [r["lm_loss"] for r in train] == losses or all(
        abs(a - b) <= 1e-6 * abs(a) for a, b in zip([r["lm_loss"] for r in train], losses))
    assert [r["iteration"] for r in valid] == [8, 16]
    assert valid[-1]["ppl"] == math.exp(valid[-1]["lm_loss"])
    assert records[-1]["type"] == "summary" and records[-1]["nan_iterations"] == 0
    assert train[0]["lr"] > train[-1]["lr"] >= 1e-4  # cosine decay to min-lr
    assert list(tb.glob("events.out.tfevents.*")), "no tensorboard event file"
    # --timing-log-level 2: a timers line after each iteration line, the parts inside the step
    timer_lines = re.findall(r" timers \(ms per iteration, slowest rank\) \| (.*) \|\n",
                             res.stdout)
    assert len(timer_lines) == 4, res.stdout[-3000:]
    for r in train:
        t = r["timers_ms"]
        assert list(t) == ["forward-backward", "optimizer", "batch-generator", "zero-grad"]
        assert all(t[k] > 0 for k in t), t   # each one wired to its part of the step
        # each timer is one rank's slowest and the iteration time rank 0's: a little slack
        assert t["forward-backward"] + t["optimizer"] + t["zero-grad"] <= 1.2 * r["ms_per_iteration"]


def _nan_skip_worker(rank: int, port: int, out: str) -> None:
    """One gloo rank: a NaN gradient must be skipped by optimizer_step, not applied."""
    import os

    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.model.config_builders import build_transformer_config
    from megatron.training.components import get_model, get_optimizer_and_scheduler
    from megatron.training.step import optimizer_step

    args = parse_args(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                       "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "2",
                       "--lr", "1e-2", "--mock-data", "--vocab-size", "64", "--device", "cpu",
                       "--bf16", "--use-distributed-optimizer"])
    initialize_megatron(args)
    model = get_model(args, build_transformer_config(args), 128)
    opt, _ = get_optimizer_and_scheduler(args, model)
    before = [p.detach().clone() for p in model[0].parameters()]
    for p in model[0].parameters():
        p.main_grad.fill_(float("nan"))
    ok, norm, reason = optimizer_step(opt)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model[0].parameters()))
    for p in model[0].parameters():
        p.main_grad.fill_(0.01)
    ok2, norm2, reason2 = optimizer_step(opt)
    changed = any(not torch.equal(a, b) for a, b in zip(before, model[0].parameters()))
    Path(out).write_text(json.dumps({"ok": ok, "norm": str(norm), "reason": reason,
                                     "unchanged": unchanged, "ok2": ok2, "reason2": reason2,
                                     "changed": changed}))
    torch.distributed.destroy_process_group()


def test_nan_gradient_step_is_skipped(tmp_path: Path, free_port: int) -> None:
    import torch.multiprocessing as mp

    out = tmp_path / "nan.json"
    mp.spawn(_nan_skip_worker, args=(free_port, str(out)), nprocs=1, join=True)
    r = json.loads(out.read_text())
    assert (r["ok"], r["reason"], r["norm"], r["unchanged"]) == (False, "nan", "nan", True)
    assert (r["ok2"], r["reason2"], r["changed"]) == (True, "", True)


def test_tflops_per_gpu_counts_every_matmul() -> None:
    """Megatron-LM's model-FLOPs convention, checked against its paper's closed form
    72 B s L h^2 (1 + s/(6h) + V/(12 L h)) (multi-head attention, 4h MLP), and the gated-MLP
    term by hand."""
    import argparse

    from megatron.training.model.flops import tflops_per_gpu, training_flops_per_iteration

    args = argparse.Namespace(hidden_size=2048, seq_length=2048, num_layers=24,
                              num_attention_heads=16, ffn_hidden_size=None, swiglu=False,
                              padded_vocab_size=50304, global_batch_size=512, world_size=64)
    b, s, l, h, v = 512, 2048, 24, 2048, 50304
    expected = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert abs(training_flops_per_iteration(args) - expected) <= 1e-9 * expected
    # SwiGLU with ffn f: the MLP costs 3 h f instead of 2 h f multiply-adds per token.
    gated = argparse.Namespace(**{**vars(args), "swiglu": True, "ffn_hidden_size": 5504})
    extra = 6 * b * s * l * (3 - 2) * h * 5504 + 6 * b * s * l * 2 * h * (5504 - 4 * h)
    assert abs(training_flops_per_iteration(gated) - expected - extra) <= 1e-9 * expected
    assert abs(tflops_per_gpu(args, 10.0) - expected / (10.0 * 64 * 1e12)) <= 1e-9


def test_run_ending_with_gathers_in_flight_exits_cleanly(tmp_path: Path, run_pretrain) -> None:
    """--overlap-param-gather-with-optimizer-step leaves the last step's (quantized) weight
    gathers running; with no final evaluation or save nothing else waits for them before the
    process group is destroyed. The run must end cleanly and report that traffic in its final
    interval (the log intervals add up to the totals)."""
    jsonl = tmp_path / "log.jsonl"
    res = run_pretrain([
        "--global-batch-size", "8", "--train-iters", "5", "--lr", "3e-3", "--bf16",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--overlap-param-gather-with-optimizer-step", "--quantized-weights",
        "--quantized-gradients", "--data-parallel-intra-node-size", "1", "--log-interval", "4",
        "--eval-iters", "0", "--jsonl-log", str(jsonl)])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    final = [r for r in records if r["type"] == "final_interval"]
    assert len(final) == 1 and final[0]["iterations"] == 1
    assert final[0]["weight_total_bytes"] > 0  # the gather started after step 5
    summary = records[-1]
    assert summary["type"] == "summary" and summary["iterations"] == 5
    logged = sum(r.get("weight_total_bytes", 0) for r in records if r["type"] == "train")
    assert logged + final[0]["weight_total_bytes"] == summary["weight_total_bytes"]


def test_log_interval_rates_count_the_iterations_run() -> None:
    """The first log line after a resume from iteration 1003 with --log-interval 10 covers 7
    iterations: ms/iteration and tokens/s are per iteration run (the loop divided the
    interval's time by --log-interval, over-reporting throughput by 10/7)."""
    from megatron.training.log import LogInterval

    interval = LogInterval()
    for i in range(7):
        interval.add(loss=2.0 + i, seconds=0.5, skipped=(i == 3), is_nan=False)
    assert interval.iterations == 7
    assert interval.ms_per_iteration() == pytest.approx(500.0)
    assert interval.tokens_per_s(1000) == pytest.approx(2000.0)
    assert interval.mean_loss() == pytest.approx(5.0) and interval.skipped == 1
    interval.add(loss=float("nan"), seconds=0.5, skipped=True, is_nan=True)
    assert interval.mean_loss() == pytest.approx(5.0) and (interval.skipped, interval.nan) == (2, 1)
    assert LogInterval().ms_per_iteration() == 0.0 and math.isnan(LogInterval().mean_loss())


def test_step_timers_levels_and_report() -> None:
    """Level 0 times nothing; level 1 the two main parts; each report is per iteration and
    resets; an unknown timer name is an error, not a silent zero."""
    import time

    from megatron.training.step_timers import StepTimers

    off = StepTimers(0)
    with off.time("forward-backward"):
        pass
    assert off.report(1) == {}
    timers = StepTimers(1)
    for _ in range(2):
        with timers.time("forward-backward"):
            time.sleep(0.01)
        with timers.time("batch-generator"):   # a level-2 timer: not shown at level 1
            pass
    got = timers.report(2)
    assert list(got) == ["forward-backward", "optimizer"]
    assert got["forward-backward"] >= 10.0 and got["optimizer"] == 0.0
    assert timers.report(1) == {"forward-backward": 0.0, "optimizer": 0.0}
    with pytest.raises(KeyError, match="unknown timer"):
        with timers.time("forward_backward"):
            pass
    with pytest.raises(ValueError, match="--timing-log-level"):
        StepTimers(3)
