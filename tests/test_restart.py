"""A worker lost mid-run: torchrun restarts the workers, they resume from the last checkpoint,
and the job ends as the uninterrupted run does (issue 46, item 1).

Why: with ``torchrun --max-restarts N`` the restarted workers rendezvous on the agent's store,
where the dead attempt's keys still are: gloo's full-mesh connect read the dead ranks'
addresses ("Connection refused") or waited out the timeout, and the failure beacon found the
dead attempt's failure. Each attempt now has a key space of its own
(megatron/training/attempt.py).

The runs: ``torchrun --standalone --nproc-per-node 2 --max-restarts 1``, SDP4Bit + LoCo with
both overlaps, a checkpoint every 3 iterations; rank 1 SIGKILLed (or raising, the failure
beacon's path) after iteration 4 of the first attempt only (fault_injection.py's restart
field). The restarted attempt loads iteration 3, retrains 4 and ends at 6: status 0, every
logged loss and the final checkpoint's parameters, optimizer, quantization and RNG state
bit-identical to an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import psutil
import pytest
import torch
import torch.distributed as dist

from conftest import REPO, TINY_GPT, run_in_own_session

FLAGS = ["--global-batch-size", "8", "--train-iters", "6", "--lr", "3e-3", "--bf16",
         "--use-distributed-optimizer", "--log-interval", "1", "--eval-iters", "0",
         "--quantized-weights", "--quantized-gradients", "--hadamard-transform", "--loco",
         "--overlap-grad-reduce", "--overlap-param-gather", "--save-interval", "3",
         "--distributed-timeout-minutes", "5"]


def _torchrun(tmp: Path, name: str, fmt: str, fault: str = "") -> Tuple[Any, Path, Path]:
    """One job under ``torchrun --standalone --max-restarts 1``; (result, --save dir, log)."""
    ckpt, log = tmp / f"{name}_ckpt", tmp / f"{name}.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore",
               QUANT_FAILURE_POLL_S="0.5")
    env.pop("MEGATRON_FAULT_INJECTION", None)
    if fault:
        env["MEGATRON_FAULT_INJECTION"] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.2",
           str(REPO / "pretrain_gpt.py"), *TINY_GPT, *FLAGS, "--ckpt-format", fmt,
           "--save", str(ckpt), "--load", str(ckpt), "--jsonl-log", str(log)]
    return _run_merged(cmd, env, timeout=300), ckpt, log


def _run_merged(cmd: List[str], env: Dict[str, str], timeout: float) -> Any:
    """conftest's ``run_in_own_session`` with stderr into stdout, in the order written: what attempt 1
    printed comes before attempt 2's startup line."""
    try:
        res = run_in_own_session(cmd, env, timeout, stderr=subprocess.STDOUT)
        return subprocess.CompletedProcess(cmd, res.returncode, res.stdout, "")
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the job did not end in {timeout} s:\n{(exc.output or '')[-5000:]}"
                             ) from None


def _losses(path: Path) -> List[Tuple[int, float]]:
    return [(r["iteration"], r["lm_loss"]) for r in map(json.loads, path.read_text().splitlines())
            if r["type"] == "train"]


def _final_state(ckpt: Path, fmt: str, tmp: Path) -> Dict[str, Any]:
    """Everything the last checkpoint holds that training produced (not its args or paths)."""
    it = ckpt / f"iter_{int((ckpt / 'latest_checkpointed_iteration.txt').read_text()):07d}"
    out: Dict[str, Any] = {}
    if fmt == "torch":
        for f in sorted(it.glob("mp_rank_*.pt")):
            sd = torch.load(f, weights_only=False)
            out[f.name] = {k: v for k, v in sd.items() if k != "args"}
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        flat = tmp / f"{ckpt.name}.pt"
        dcp_to_torch_save(str(it), str(flat))
        out["sharded"] = {k: v for k, v in torch.load(flat, weights_only=False).items()
                          if "args" not in k}
        for f in sorted((it / "rank_state").glob("*.pt")):
            out[f.name] = torch.load(f, weights_only=False)
    return out


def _differences(a: Any, b: Any, where: str = "") -> List[str]:
    """Where two nested states differ (tensors bit for bit, NaNs equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if where.endswith("opt_param_scheduler"):   # the schedule's values, not its spelling
            a, b = ({k: d[k] for k in set(a) & set(b)} for d in (a, b))
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8) if a.is_floating_point() else a,
            b.reshape(-1).view(torch.uint8) if b.is_floating_point() else b)
        return [] if same else [f"{where}: tensors differ"]
    if hasattr(a, "__dict__") and type(a) is type(b) and not isinstance(a, type):
        return _differences(vars(a), vars(b), where)
    try:
        import numpy as np

        if isinstance(a, np.ndarray):
            return [] if np.array_equal(a, b) else [f"{where}: arrays differ"]
    except ImportError:
        pass
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


_REFERENCE: Dict[str, Tuple[List[Tuple[int, float]], Dict[str, Any]]] = {}


def _reference(tmp_path_factory: Any, fmt: str) -> Tuple[List[Tuple[int, float]], Dict[str, Any]]:
    """The uninterrupted run's losses and final state (once per format)."""
    if fmt not in _REFERENCE:
        tmp = tmp_path_factory.mktemp(f"uninterrupted_{fmt}")
        res, ckpt, log = _torchrun(tmp, "full", fmt)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        _REFERENCE[fmt] = _losses(log), _final_state(ckpt, fmt, tmp)
    return _REFERENCE[fmt]


def _check_restarted(res: Any, ckpt: Path, log: Path, fmt: str, tmp: Path,
                     reference: Tuple[List[Tuple[int, float]], Dict[str, Any]]) -> str:
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    # two attempts, the second resumed from the checkpoint of iteration 3
    assert " > attempt 1 of run " in out and " > attempt 2 of run " in out, out[-5000:]
    second = out[out.index(" > attempt 2 of run "):]
    assert "restart 1 of at most 1" in second.splitlines()[0]
    assert f"loaded checkpoint from {ckpt} at iteration 3" in second, second[-3000:]
    assert f" > attempt 2 resumes from the checkpoint of iteration 3 in {ckpt}: training " \
        "continues at iteration 4" in second
    assert second.index(" iteration        4/       6 |") < second.index(" iteration        5/")
    assert "stopping: " not in second   # the dead attempt's failure line is not seen again
    losses, state = reference
    restarted = _losses(log)
    # iterations 1..4 of the first attempt, then 4..6 again from the checkpoint of 3
    assert [i for i, _ in restarted] == [1, 2, 3, 4, 4, 5, 6], restarted
    assert restarted[:4] + restarted[5:] == losses   # bit for bit, the redone 4 included
    assert restarted[3] == restarted[4]
    assert _differences(_final_state(ckpt, fmt, tmp), state) == []
    return second


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_worker_sigkilled_after_a_checkpoint_restarts_and_finishes_as_uninterrupted(
        tmp_path: Path, tmp_path_factory: Any, fmt: str) -> None:
    reference = _reference(tmp_path_factory, fmt)
    res, ckpt, log = _torchrun(tmp_path, "restarted", fmt, "kill:iteration-end:4:1:0")
    _check_restarted(res, ckpt, log, fmt, tmp_path, reference)


def test_failure_the_trainer_reports_then_restart(tmp_path: Path, tmp_path_factory: Any) -> None:
    """rank 1 raises (the failure beacon posts it, every rank stops with its line); the
    restarted attempt must not find that line in the store and stop again."""
    reference = _reference(tmp_path_factory, "torch")
    res, ckpt, log = _torchrun(tmp_path, "raised", "torch", "raise:iteration-end:4:1:0")
    out = res.stdout + res.stderr
    first = out[:out.index(" > attempt 2 of run ")] if " > attempt 2 of run " in out else out
    assert "error: rank 1: the training loop: InjectedFault: injected fault at iteration-end, " \
           "iteration 4, rank 1" in first, out[-5000:]
    _check_restarted(res, ckpt, log, "torch", tmp_path, reference)


def test_a_lost_node_resumes_on_the_remaining_one_with_dp_halved(tmp_path: Path) -> None:
    """Issue 46, item 2: two torchrun agents of 2 ranks each ("nodes") on loopback, c10d
    rendezvous with ``--nnodes 1:2`` (as the recipes' ELASTIC=1 launches them, with a store per
    round); one node is lost after iteration 4 (its ranks SIGKILL their agent, then
    themselves). The remaining agent restarts its workers alone: the job resumes from the
    torch_dist checkpoint of iteration 3 with DP 4 -> 2, the global batch kept (twice the
    micro-batches per rank), and finishes with status 0. This test hosts the rendezvous store,
    so either agent may be the one lost."""
    from dist_harness import free_port

    port = free_port()
    rdzv = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,
                         wait_for_workers=False)
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore",
               QUANT_FAILURE_POLL_S="0.5", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.pop("MEGATRON_FAULT_INJECTION", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=shrink",
           "--max-restarts=1", "--monitor-interval=0.2",
           # both agents start together and must meet in the first round (within the last
           # call); the lost one's rendezvous heartbeats lapse in about 2 s
           "--rdzv-conf=is_host=0,last_call_timeout=30,join_timeout=120,keep_alive_interval=1,"
           "keep_alive_max_attempt=2",
           str(REPO / "pretrain_gpt.py"), *TINY_GPT, *FLAGS, "--ckpt-format", "torch_dist",
           "--save", str(ckpt), "--load", str(ckpt), "--jsonl-log", str(log)]
    logs = [tmp_path / "kept.txt", tmp_path / "lost.txt"]
    agents = []
    try:
        for path, extra in zip(logs, ({}, {"MEGATRON_FAULT_INJECTION":
                                          "kill-node:iteration-end:4:*:0"})):
            with open(path, "w") as out:
                agents.append(subprocess.Popen(cmd, cwd=REPO, env=dict(env, **extra), stdout=out,
                                               stderr=subprocess.STDOUT, start_new_session=True))
        kept_rc = agents[0].wait(timeout=300)
        lost_rc = agents[1].wait(timeout=30)
    finally:
        for agent in agents:
            for child in psutil.Process(agent.pid).children(recursive=True) \
                    if agent.poll() is None else []:
                child.kill()
            agent.kill()
        del rdzv
    kept = logs[0].read_text()
    assert lost_rc == -signal.SIGKILL, logs[1].read_text()[-3000:]
    assert kept_rc == 0, kept[-5000:]
    second = kept[kept.index(" > attempt 2 of run shrink"):]
    assert ("written with TP=1, PP=1, DP=4, EP=1; this run has TP=1, PP=1, DP=2, EP=1: model "
            "and optimizer states resharded") in second, second[-3000:]
    assert f"loaded checkpoint from {ckpt} at iteration 3" in second
    assert f" > attempt 2 resumes from the checkpoint of iteration 3 in {ckpt}" in second
    records = [r for r in map(json.loads, log.read_text().splitlines()) if r["type"] == "train"]
    assert [(r["iteration"], r["consumed_samples"], r["global_batch_size"]) for r in records] == \
        [(1, 8, 8), (2, 16, 8), (3, 24, 8), (4, 32, 8), (4, 32, 8), (5, 40, 8), (6, 48, 8)]
    # the continuation on half the ranks is close to the 4-rank run's (another reduction order)
    assert abs(records[4]["lm_loss"] - records[3]["lm_loss"]) < 0.02 * records[3]["lm_loss"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
