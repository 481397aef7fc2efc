"""scripts/gpu_selfcheck.sh: the first command on a GPU machine, checked here without one.

``--dry-run`` prints every step's command and runs what needs no GPU: the environment probe, the
AOT tool's specialisation list, the kernel tests' collection, bench_quant.py's flags, the
trainer's flag validation (pretrain_gpt.py --dry-run) for the 1-GPU and both 2-rank runs, and a
self-test of the NCCL-vs-gloo loss comparison. Without ``--dry-run`` on a machine without CUDA it
must stop at the environment step with the reason, not fail later in a confusing way.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_selfcheck.sh"
STEPS = ("env", "aot", "kernel-tests", "bench", "smoke", "nccl-vs-gloo")


def _run(tmp_path: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, SELFCHECK_DIR=str(tmp_path / "run"), PYTHONWARNINGS="ignore")
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_dry_run_prints_every_step_and_checks_what_runs_on_cpu(tmp_path: Path) -> None:
    report = tmp_path / "report.md"
    res = _run(tmp_path, "--dry-run", "--out", str(report))
    out = res.stdout
    assert res.returncode == 0, out[-5000:] + res.stderr[-3000:]
    commands = {}
    for i, step in enumerate(STEPS, 1):
        lines = re.findall(rf"^\[selfcheck\] step {i}/6 {step}: (.+)$", out, re.M)
        assert lines, f"step {step} not printed:\n{out[-3000:]}"
        commands[step] = " || ".join(lines)
        assert re.search(rf"^\[selfcheck\] {step}: DRY \(", out, re.M), f"{step} did not report DRY"
    assert "bench/triton_aot.py --quick --targets sm_" in commands["aot"]
    assert "pytest" in commands["kernel-tests"] and "tests/test_triton_kernels.py" in commands["kernel-tests"]
    assert "bench/bench_quant.py" in commands["bench"] and "--device cuda" in commands["bench"]
    sdp4bit = ("--bf16", "--quantized-weights", "--quantized-gradients", "--hadamard-transform",
               "--data-parallel-intra-node-size 1", "--mock-data")
    assert "--nproc-per-node 1" in commands["smoke"] and "--device cuda" in commands["smoke"]
    assert all(flag in commands["smoke"] for flag in sdp4bit), commands["smoke"]
    pair = commands["nccl-vs-gloo"]
    assert pair.count("--nproc-per-node 2") == 2 and all(f in pair for f in sdp4bit)
    assert "--device cuda --distributed-backend nccl" in pair
    assert "--device cpu --distributed-backend gloo" in pair
    assert pair.count("--no-stochastic-rounding") == 2 and pair.count("--use-cpu-initialization") == 2
    # what really ran on the CPU
    m = re.search(r"aot: DRY \(specialisations found: (\d+)", out)
    assert m and int(m.group(1)) >= 3, out[-3000:]          # one per entry kernel (--quick --list)
    assert re.search(r"kernel-tests: DRY \(\d+ tests collected", out)
    for name, world, device, backend, sr in (("smoke", 1, "cuda", "nccl", True),
                                             ("nccl", 2, "cuda", "nccl", False),
                                             ("gloo", 2, "cpu", "gloo", False)):
        assert (f"{name}: flags parse (world {world}, device {device}, backend {backend}, qWD True, "
                f"TLq True 8/4 bits, Hadamard True, stochastic rounding {sr})") in out, out[-3000:]
    assert "accepts equal logs and rejects a 10% gap" in out
    assert "all steps passed (dry run)" in out
    md = report.read_text()
    assert md.startswith("### GPU self-check") and "DRY RUN" in md
    for step in STEPS:
        assert re.search(rf"^\| {step} \| DRY \|", md, re.M), md


def test_without_cuda_it_stops_at_the_env_step(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the real run would run every step")
    report = tmp_path / "report.md"
    res = _run(tmp_path, "--out", str(report), timeout=120)
    assert res.returncode == 1, res.stdout[-3000:]
    assert "env: FAIL (torch sees no CUDA device" in res.stdout
    assert "stopping: every later step needs a GPU" in res.stdout
    for step in STEPS[1:]:
        assert f"{step}: SKIP (not run: no GPU)" in res.stdout
    assert "| env | FAIL |" in report.read_text()


def test_unknown_argument_is_refused(tmp_path: Path) -> None:
    res = _run(tmp_path, "--dryrun", timeout=60)
    assert res.returncode == 2
    assert "unknown argument '--dryrun'" in res.stderr
