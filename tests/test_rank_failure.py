"""One rank's failed communication job stops every rank soon, with one error naming the rank, the
bucket and the cause (issue 36, item 4).

Why: collectives pair by issue order. When rank 2's intra-node job of one bucket fails (an
out-of-memory at the LoCo / Hadamard peak is the likely one on a GPU), rank 2's stage stops and
its later collectives never run; its peers sat inside theirs until the timeout -- on NCCL the
watchdog's, here gloo's, 30 minutes by default for the layer's own communicators -- and the
cause was in rank 2's log only. Now the failure is posted to the job's store and every rank
stops with the same line.

The real trainer: ``torchrun`` with 4 gloo ranks as 2 nodes x 2, SDP4Bit + LoCo with
``--overlap-grad-reduce`` (the jobs on the worker-thread stages), through a wrapper that makes
rank 2's first quantization (in its intra-node job) raise at iteration 2 and then keeps rank 2's
process alive, as a rank blocked in NCCL's teardown would be: its peers must stop on their own.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

from conftest import REPO, TINY_GPT, run_in_own_session
from dist_harness import free_port

WRAPPER = r'''
import os, sys, time, traceback
sys.path.insert(0, {repo!r})
from megatron.distributed.quant.collectives import gradients

real = gradients.quantize_partitions
calls = {{"n": 0}}

def failing(*args, **kwargs):
    calls["n"] += 1
    if int(os.environ["RANK"]) == 2 and calls["n"] == 2:
        raise RuntimeError("injected: CUDA out of memory in the first quantization")
    return real(*args, **kwargs)

gradients.quantize_partitions = failing
import pretrain_gpt
try:
    status = pretrain_gpt.main(sys.argv[1:])
except BaseException:
    traceback.print_exc()
    status = 1
if int(os.environ["RANK"]) == 2:
    print("rank 2 stays alive", file=sys.stderr, flush=True)
    time.sleep(150)     # as if blocked: the peers must not wait for this process
sys.exit(status)
'''

FLAGS = ["--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-3", "--bf16",
         "--use-distributed-optimizer", "--log-interval", "1", "--eval-iters", "0",
         "--quantized-gradients", "--quantized-weights", "--hadamard-transform", "--loco",
         "--data-parallel-intra-node-size", "2", "--overlap-grad-reduce",
         "--distributed-timeout-minutes", "30"]


def test_a_failed_stage_job_on_one_rank_stops_every_rank_with_its_cause(tmp_path: Path) -> None:
    wrapper = tmp_path / "inject.py"
    wrapper.write_text(WRAPPER.format(repo=str(REPO)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--tee=3",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(wrapper),
           *TINY_GPT, *FLAGS]
    start = time.monotonic()
    # well under the 30-minute timeout of the run's collectives: a hang fails here
    res = run_in_own_session(cmd, env=env, timeout=400)
    elapsed = time.monotonic() - start
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-4000:]
    assert "rank 2 stays alive" in out, out[-4000:]
    # every rank's one error line: the failing rank, the bucket and hop, the cause
    lines = {}
    for rank, line in re.findall(r"\[default(\d)\]:(error: .*)", out):
        lines.setdefault(int(rank), line)
    assert sorted(lines) == [0, 1, 2, 3], out[-6000:]
    for rank, line in lines.items():
        assert line.startswith("error: rank 2: gradient reduce-scatter of chunk0/bucket"), line
        assert "intra-node hop" in line and "RuntimeError: injected: CUDA out of memory" in line
    assert len(set(lines.values())) == 1, lines
    # the traceback of the cause is printed on rank 2, where it happened, and only there
    assert re.search(r"\[default2\]:RuntimeError: injected", out), out[-4000:]
    assert not re.search(r"\[default[013]\]:RuntimeError: injected", out), out[-4000:]
    print(f"all ranks stopped {elapsed:.0f} s after the launch")


def test_a_peer_killed_without_torchrun_is_named_by_the_survivor(tmp_path: Path) -> None:
    """Issue 46, item 4: two ranks launched alone (no launcher to stop the survivor), SDP4Bit +
    LoCo with both overlaps; rank 1 SIGKILLed after iteration 2. Rank 0's collective fails with
    gloo's "Connection closed/reset by peer"; its error names rank 1 as the one that stopped
    answering (rank 1's heartbeat in the failure beacon's store stopped), then gloo's text."""
    import subprocess

    port = free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore",
                   RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), QUANT_FAILURE_POLL_S="0.5",
                   MEGATRON_FAULT_INJECTION="kill:iteration-end:2:1")
        procs.append(subprocess.Popen(
            [sys.executable, str(REPO / "pretrain_gpt.py"), *TINY_GPT, "--global-batch-size",
             "8", "--train-iters", "4", "--lr", "1e-3", "--bf16", "--use-distributed-optimizer",
             "--log-interval", "1", "--eval-iters", "0", "--quantized-gradients",
             "--quantized-weights", "--hadamard-transform", "--loco", "--overlap-grad-reduce",
             "--overlap-param-gather", "--distributed-timeout-minutes", "5"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        out0, err0 = procs[0].communicate(timeout=240)
        procs[1].communicate(timeout=30)
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == -9
    assert procs[0].returncode == 1, (out0 + err0)[-4000:]
    line = [ln for ln in err0.splitlines() if ln.startswith("error: ")]
    assert len(line) == 1, err0[-4000:]
    assert re.match(r"error: rank 1 stopped answering: rank 0 at .+: RuntimeError: .*"
                    r"Connection (closed|reset) by peer", line[0]), line[0]
