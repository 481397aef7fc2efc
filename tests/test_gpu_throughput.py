"""bench/gpu_throughput.py and bench/reference_gpt.py, on the CPU at toy size (issue 23, item 5).

The benchmark is meant for one GPU (``--shapes 125m,350m,1.3b``); here it runs the same code path
on the toy shape: the 125M recipe's command (``ECHO_ONLY=1``) with the model flags shrunk, under
torchrun, for the baseline and SDP4Bit, and the plain PyTorch reference. Checked: every row of
the table with positive numbers, the ratio column equal to ms/iteration over the reference's, the
comparison like for like (the same parameter count as megatron-core's ``GPTModel`` for the
recipes' shapes, built on the meta device; the same FLOP count as the trainer's own
``tflops_per_gpu``), and the FLOP count equal to Megatron-LM's formula.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import gpu_throughput  # noqa: E402
import reference_gpt  # noqa: E402
from megatron.training.model.flops import tflops_per_gpu, training_flops_per_iteration  # noqa: E402

RUNS = ["baseline", "sdp4bit", "reference"]


def _bench(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """gpu_throughput.py ARGS; on a timeout it is sent SIGTERM, which stops its torchrun run."""
    cmd = [sys.executable, str(REPO / "bench" / "gpu_throughput.py"), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONWARNINGS="ignore"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s:\n{out[-3000:]}{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """One ``--device cpu --toy`` run shared by the tests: (process, JSON written by --out)."""
    tmp = tmp_path_factory.mktemp("gpu_throughput")
    out = tmp / "toy.json"
    res = _bench("--device", "cpu", "--toy", "--iters", "3", "--warmup", "1", "--timeout", "900",
                 "--work-dir", str(tmp / "work"), "--out", str(out), timeout=3000)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return res, json.loads(out.read_text())


def _table(stdout: str) -> list:
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in stdout.splitlines() if line.startswith("| toy |")]
    header = next(line for line in stdout.splitlines() if line.startswith("| shape |"))
    assert header == ("| shape | run | ms/iteration | TFLOP/s | peak memory GiB | "
                      "ours/reference |"), header
    return rows


def test_toy_table_has_every_row_and_consistent_ratios(toy: tuple) -> None:
    res, data = toy
    rows = _table(res.stdout)
    assert [r[1] for r in rows] == RUNS, res.stdout
    values = {r[1]: [float(x) for x in r[2:]] for r in rows}
    for run, nums in values.items():
        assert all(x > 0 for x in nums), (run, nums)
    ref_ms = values["reference"][0]
    assert rows[-1][5] == "1.00"
    for run, (ms, tflops, mem, ratio) in values.items():
        # the printed ratio is the printed ms over the reference's, up to their rounding
        assert abs(ratio - ms / ref_ms) <= 0.005 + ms / ref_ms * (0.05 / ms + 0.05 / ref_ms), run
    # The JSON rows: the same numbers, unrounded.
    by_run = {r["run"]: r for r in data["rows"]}
    assert list(by_run) == RUNS and data["table"] in res.stdout
    ref = by_run["reference"]
    for run, r in by_run.items():
        assert not r.get("error") and r["exit"] == 0
        assert r["ratio_to_reference"] == pytest.approx(r["ms_per_iteration"] / ref["ms_per_iteration"], rel=1e-12)
        assert f"{r['ratio_to_reference']:.2f}" == rows[RUNS.index(run)][5]
        assert f"{r['ms_per_iteration']:.1f}" == rows[RUNS.index(run)][2]
        assert r["tflops_per_gpu"] == pytest.approx(
            r["flops_per_iteration"] / (r["ms_per_iteration"] / 1000.0) / 1e12, rel=1e-12)
        assert r["peak_memory_bytes"] > 0 and r["peak_memory_kind"].startswith("peak RSS")
        assert (r["micro_batch_size"], r["global_batch_size"]) == (2, 4)  # 2 micro-batches
    # ours ran the recipe (torchrun, mock data) with and without the SDP4Bit flags
    for run in ("baseline", "sdp4bit"):
        cmd = by_run[run]["command"]
        assert "torch.distributed.run --nproc-per-node 1" in cmd and "--mock-data" in cmd
        assert "--bf16 --use-distributed-optimizer" in cmd and "--recompute" not in cmd
        assert "--save" not in cmd and by_run[run]["source"] == "jsonl"
        assert ("--quantized-weights" in cmd and "--quantized-gradients" in cmd
                and "--hadamard-transform" in cmd) == (run == "sdp4bit")


def test_toy_runs_are_like_for_like(toy: tuple) -> None:
    """Same parameters (ours from the trainer's log, the reference's from its model), same FLOP
    count: the trainer's own per-iteration TFLOP/s (jsonl) is the benchmark's at the same ms."""
    _, data = toy
    shape = reference_gpt.SHAPES["toy"]
    fargs = reference_gpt.flops_args(shape, shape["global_batch_size"])
    for r in data["rows"]:
        assert r["parameters"] == reference_gpt.parameter_count(shape) == 169_728, r["run"]
        assert r["flops_per_iteration"] == training_flops_per_iteration(fargs)
        assert len(r["ms_per_iteration_all"]) == 4  # 1 warm-up + 3 measured
    for run in ("baseline", "sdp4bit"):
        r = next(r for r in data["rows"] if r["run"] == run)
        trainer = r["trainer_tflops_per_gpu"]
        assert len(trainer) == 4
        for (it, tf), ms in zip(sorted(trainer.items(), key=lambda kv: int(kv[0])),
                                r["ms_per_iteration_all"]):
            assert tf == pytest.approx(tflops_per_gpu(fargs, ms / 1000.0), rel=1e-9), (run, it)


def _megatron_lm_flops(b: int, s: int, layers: int, h: int, heads: int, ffn: int, vocab: int,
                       kv_channels: int, query_groups: int, swiglu: bool = False) -> float:
    """Megatron-LM's ``num_floating_point_operations`` (megatron/training/pretrain.py), dense
    GPT branch (no MoE, no MTP), transcribed."""
    query_projection_to_hidden_size_ratio = kv_channels * heads / h
    gated_linear_multiplier = 3 / 2 if swiglu else 1
    return (12 * b * s * layers * h * h * (
        ((1 + query_groups / heads + s / h) * query_projection_to_hidden_size_ratio)
        + (ffn / h) * 1 * gated_linear_multiplier
        + vocab / (2 * layers * h)))


@pytest.mark.parametrize("shape_name", ["125m", "350m", "1.3b"])
def test_flops_are_megatron_lms_formula(shape_name: str) -> None:
    shape = reference_gpt.SHAPES[shape_name]
    fargs = reference_gpt.flops_args(shape, 16)
    h, heads = shape["hidden_size"], shape["num_attention_heads"]
    want = _megatron_lm_flops(16, shape["seq_length"], shape["num_layers"], h, heads, 4 * h,
                              50304, h // heads, heads)
    assert fargs.padded_vocab_size == 50304
    assert training_flops_per_iteration(fargs) == pytest.approx(want, rel=1e-12)
    # issue 23's figures for ours (global batch 16): 1.3B 1984 ms = 150 TFLOP/s, 717 ms = 414;
    # 125M 664 ms = 48
    if shape_name == "1.3b":
        assert round(tflops_per_gpu(fargs, 1.984)) == 150 and int(tflops_per_gpu(fargs, 0.717)) == 414
    if shape_name == "125m":
        assert round(tflops_per_gpu(fargs, 0.664)) == 48


def test_parameter_counts_match_megatron_core(tmp_path: Path) -> None:
    """The reference of the recipes' 125M and 1.3B shapes has exactly the parameters of our
    model for the recipe's flags (megatron-core ``GPTModel`` via the trainer's model_provider,
    both on the meta device)."""
    for name in ("125m", "350m", "1.3b"):
        with torch.device("meta"):
            model = reference_gpt.GPT(**reference_gpt.SHAPES[name])
        assert sum(p.numel() for p in model.parameters()) == \
            reference_gpt.parameter_count(reference_gpt.SHAPES[name])
    out = tmp_path / "params.json"
    res = _bench("--count-parameters", "--shapes", "125m,1.3b", "--out", str(out), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {r["shape"]: r for r in json.loads(out.read_text())["parameters"]}
    assert rows["125m"]["ours"] == rows["125m"]["reference"] == 125_262_336
    assert rows["1.3b"]["ours"] == rows["1.3b"]["reference"] == 1_315_819_520
    assert "| 1.3b | 1,315,819,520 | 1,315,819,520 | 1,315,819,520 |" in res.stdout


def test_log_parsing_memory_report_and_failed_rows(tmp_path: Path) -> None:
    """Without a jsonl the ms come from Megatron's log lines; Megatron-LM's memory report is kept
    when the trainer prints one; a failed run is a row that says so."""
    log = "\n".join([
        " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): 1234",
        *[f" iteration {i:8d}/       4 | consumed samples:  {4 * i} | elapsed time per iteration "
          f"(ms): {ms} | learning rate: 1.0E-04 |" for i, ms in enumerate((900.0, 30.0, 10.0, 20.0), 1)],
        "[Rank 0] (after 1 iterations) memory (MB) | allocated: 100.5 | max allocated: 200.25 | "
        "reserved: 300.0 | max reserved: 400.0",
        "[Rank 0] (after 1 iterations) memory (MB) | host peak RSS: 499.3"])
    parsed = gpu_throughput.parse_ours(log, tmp_path / "missing.jsonl", warmup=1)
    assert parsed["source"] == "log" and parsed["ms_per_iteration"] == 20.0  # median of 30, 10, 20
    assert parsed["parameters"] == 1234
    assert parsed["trainer_memory_report"]["max_allocated_mb"] == 200.25
    assert parsed["trainer_memory_report"]["host_peak_rss_mb"] == 499.3
    rows = [{"shape": "toy", "run": "baseline", "error": "exit 1"},
            {"shape": "toy", "run": "reference", "ms_per_iteration": 10.0, "tflops_per_gpu": 1.5,
             "peak_memory_bytes": 2 ** 30}]
    gpu_throughput.add_ratios(rows)
    table = gpu_throughput.markdown_table(rows)
    assert "| toy | baseline | failed | n/a | n/a | n/a |" in table
    assert "| toy | reference | 10.0 | 1.50 | 1.00 | 1.00 |" in table
