"""scripts/gpu_selfcheck.sh: the first command on a GPU machine, checked here without one.

``--dry-run`` prints every step's command and runs what needs no GPU: the environment probe, the
AOT tool's specialisation list, the kernel tests' collection, bench_quant.py's flags, the
trainer's flag validation (pretrain_gpt.py --dry-run) for the 1-GPU and both 2-rank runs, and a
self-test of the NCCL-vs-gloo loss comparison, and bench/gpu_throughput.py's commands and flags.
Without ``--dry-run`` on a machine without CUDA it must stop at the environment step with the
reason, not fail later in a confusing way.

No variable of the script may shadow the environment its programs read (issue 23, item 6: the
script's ``CC=90``, the compute capability, replaced the exported C compiler, and Triton built its
launcher with the "compiler" 90). Every run here exports ``CC=gcc`` and sentinels for the other
names, and starts the script with ``PYTHON`` set to a wrapper that records what each Python step
the script starts sees.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_selfcheck.sh"
STEPS = ("env", "aot", "kernel-tests", "bench", "smoke", "nccl-vs-gloo", "throughput")
# Exported names a build or a launcher reads, and every name the script once used for its own
# variables: the programs the script starts must see these values unchanged.
SENTINELS = {"CC": "gcc", "CXX": "g++", "CUDA_HOME": "/opt/sentinel-cuda", "OUT": "sentinel-out",
             "RUN_DIR": "sentinel-run-dir", "ITERS": "sentinel-iters", "SIZES": "sentinel-sizes",
             "RTOL": "sentinel-rtol", "ROOT": "/sentinel-root", "DRY_RUN": "sentinel-dry-run",
             "FAILED": "sentinel-failed", "NGPU": "sentinel-ngpu", "CUDA_OK": "sentinel-cuda-ok"}


def _python_wrapper(tmp_path: Path) -> tuple:
    """A ``PYTHON`` that appends the sentinel variables it sees to a log, then runs Python."""
    log = tmp_path / "python_env.log"
    wrapper = tmp_path / "python_wrapper.sh"
    lines = "".join(f"printf '%s=%s\\n' {k} \"${{{k}-<unset>}}\" >> '{log}'\n" for k in SENTINELS)
    wrapper.write_text(f"#!/bin/sh\necho --- >> '{log}'\n{lines}exec '{sys.executable}' \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper, log


def _seen_env(log: Path) -> list:
    """One dict per Python process the script started."""
    return [dict(line.split("=", 1) for line in block.strip().splitlines())
            for block in log.read_text().split("---") if block.strip()]


def _run(tmp_path: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    wrapper, _ = _python_wrapper(tmp_path)
    env = dict(os.environ, SELFCHECK_DIR=str(tmp_path / "run"), PYTHONWARNINGS="ignore",
               PYTHON=str(wrapper), **SENTINELS)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """One ``--dry-run`` for the tests below: (result, report path, Python env log)."""
    tmp_path = tmp_path_factory.mktemp("selfcheck_dry")
    report = tmp_path / "report.md"
    res = _run(tmp_path, "--dry-run", "--out", str(report))
    return res, report, tmp_path / "python_env.log"


def test_dry_run_prints_every_step_and_checks_what_runs_on_cpu(dry_run: tuple) -> None:
    res, report, _ = dry_run
    out = res.stdout
    assert res.returncode == 0, out[-5000:] + res.stderr[-3000:]
    commands = {}
    for i, step in enumerate(STEPS, 1):
        lines = re.findall(rf"^\[selfcheck\] step {i}/{len(STEPS)} {step}: (.+)$", out, re.M)
        assert lines, f"step {step} not printed:\n{out[-3000:]}"
        commands[step] = " || ".join(lines)
        assert re.search(rf"^\[selfcheck\] {step}: DRY \(", out, re.M), f"{step} did not report DRY"
    assert "bench/triton_aot.py --quick --targets sm_" in commands["aot"]
    assert "pytest" in commands["kernel-tests"] and "tests/test_triton_kernels.py" in commands["kernel-tests"]
    assert "bench/bench_quant.py" in commands["bench"] and "--device cuda" in commands["bench"]
    sdp4bit = ("--bf16", "--quantized-weights", "--quantized-gradients", "--hadamard-transform",
               "--mock-data")
    assert "--nproc-per-node 1" in commands["smoke"] and "--device cuda" in commands["smoke"]
    assert all(flag in commands["smoke"] for flag in sdp4bit), commands["smoke"]
    assert "--data-parallel-intra-node-size 1" in commands["smoke"]
    pair = commands["nccl-vs-gloo"]
    # 4 ranks as 2 nodes x 2 GPUs, so both hops run; the virtual ranks with fewer GPUs
    assert pair.count("--nproc-per-node 4") == 2 and all(f in pair for f in sdp4bit)
    assert pair.count("--data-parallel-intra-node-size 2") == 2
    assert "bench/virtual_cuda_ranks.py --layouts 2x2,2x4" in pair
    assert "--device cuda --distributed-backend nccl" in pair
    assert "--device cpu --distributed-backend gloo" in pair
    assert pair.count("--no-stochastic-rounding") == 2 and pair.count("--use-cpu-initialization") == 2
    # what really ran on the CPU
    m = re.search(r"aot: DRY \(specialisations found: (\d+)", out)
    assert m and int(m.group(1)) >= 3, out[-3000:]          # one per entry kernel (--quick --list)
    assert re.search(r"kernel-tests: DRY \(\d+ tests collected", out)
    for name, world, device, backend, sr in (("smoke", 1, "cuda", "nccl", True),
                                             ("nccl", 4, "cuda", "nccl", False),
                                             ("gloo", 4, "cpu", "gloo", False)):
        assert (f"{name}: flags parse (world {world}, device {device}, backend {backend}, qWD True, "
                f"TLq True 8/4 bits, Hadamard True, stochastic rounding {sr})") in out, out[-3000:]
    assert "accepts equal logs and rejects a 10% gap; virtual ranks' CPU side runs" in out
    throughput = commands["throughput"]
    assert "bench/gpu_throughput.py" in throughput and "--device cuda" in throughput
    assert "--shapes 125m " in throughput, throughput            # the default: one shape
    assert "--runs baseline,reference" in throughput   # sdp4bit at DP=1 is the baseline's step
    assert "throughput: DRY (dry run: 2 commands, all flags parse)" in out, out[-3000:]
    assert '"megatron_core": "0.16.1"' in out        # steps 5-7 need it on the GPU machine
    assert "all steps passed (dry run)" in out
    md = report.read_text()
    assert md.startswith("### GPU self-check") and "DRY RUN" in md
    for step in STEPS:
        assert re.search(rf"^\| {step} \| DRY \|", md, re.M), md


def test_no_script_variable_shadows_the_environment(dry_run: tuple) -> None:
    """CC=gcc (and the other sentinels) exported: every Python step of the dry run (the env probe,
    triton_aot.py --list, the kernel tests' collection, pretrain_gpt.py --dry-run, the loss
    comparison, gpu_throughput.py --dry-run) sees them unchanged. The old script's ``CC=90``
    reached all of them."""
    res, _, log = dry_run
    assert res.returncode == 0, res.stdout[-3000:]
    seen = _seen_env(log)
    assert len(seen) >= 8, seen  # every step above starts at least one
    for env in seen:
        assert env == SENTINELS, {k: v for k, v in env.items() if SENTINELS[k] != v}


def test_script_assigns_only_its_own_variables() -> None:
    """Statically: every global the script assigns is SC_* (or PYTHON, which it reads from the
    environment and only defaults)."""
    text = SCRIPT.read_text()
    code = re.sub(r"<<'PY'\n.*?\nPY\n", "", text, flags=re.S)   # Python heredocs
    assigned = set(re.findall(r"^\s*(?:export |local )?([A-Za-z_][A-Za-z0-9_]*)(?:\[[^]]*\])?\+?[=(]",
                              code, re.M))
    for names in re.findall(r"(?:declare -A|read -r(?: -d '')?) ((?:[A-Za-z_][A-Za-z0-9_]* ?)+)", code):
        assigned |= set(names.split())
    upper = {n for n in assigned if n.upper() == n}
    foreign = sorted(n for n in upper if not n.startswith("SC_")
                     and n not in {"PYTHON", "PYTHONPATH"})
    assert not foreign, f"script variables that may shadow the environment: {foreign}"
    assert {"SC_SM", "SC_OUT", "SC_STEPS", "SC_STATUS", "SC_PY_ENV", "SC_CUDA_OK"} <= upper, upper


def test_without_cuda_it_stops_at_the_env_step(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the real run would run every step")
    report = tmp_path / "report.md"
    res = _run(tmp_path, "--out", str(report), timeout=600)
    assert res.returncode == 1, res.stdout[-3000:]
    assert "env: FAIL (torch sees no CUDA device" in res.stdout
    assert "stopping: every later step needs a GPU" in res.stdout
    for step in STEPS[1:]:
        assert f"{step}: SKIP (not run: no GPU)" in res.stdout
    assert "| env | FAIL |" in report.read_text()
    seen = _seen_env(tmp_path / "python_env.log")
    assert seen, "the env probe did not run through $PYTHON"
    for env in seen:   # CC=gcc (not the script's compute capability) reached the probe
        assert env == SENTINELS, {k: v for k, v in env.items() if SENTINELS[k] != v}


def test_unknown_argument_is_refused(tmp_path: Path) -> None:
    res = _run(tmp_path, "--dryrun", timeout=60)
    assert res.returncode == 2
    assert "unknown argument '--dryrun'" in res.stderr
