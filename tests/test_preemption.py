"""Preemption: ``--exit-signal-handler`` (``--exit-signal``), ``--exit-duration-in-mins``,
``--exit-interval`` stop every rank at the same iteration, save, exit 0, and the resumed run is
bit-exact against an uninterrupted one.

Why: SLURM (and torchrun, which forwards it) sends SIGTERM before it kills a job; without a
handler the ranks died at once and everything since the last save was lost.  A signal reaches
the ranks at different moments (or only some of them), so the stop is agreed by an all-reduce at
the iteration boundary (megatron/training/exit_conditions.py).

* ``test_every_rank_stops_at_the_same_boundary``: 4 gloo ranks, the signal raised on one rank
  only (and a time budget spent on one rank only): all four stop after the same iteration.
* ``test_sigterm_to_torchrun_saves_and_resumes_bit_exactly``: 4 ranks of SDP4Bit+LoCo under
  torchrun; SIGTERM goes to the torchrun process (as from SLURM or ``kill``), which forwards it
  to its workers' process groups; every worker finishes its iteration, the checkpoint is saved
  (with the quantization state) and each worker's ``main`` returns 0.  The resumed run's
  per-iteration losses, joined to the interrupted run's, equal an uninterrupted run's bit for
  bit.  torchrun itself exits 1 after forwarding a signal (it re-raises it), whatever its
  workers did; its SIGKILL escalation (after ``--shutdown-timeout``) must not be needed.

The uninterrupted and the resumed runs are launched by :func:`fork_launch` (this file run as a
script): one process imports the trainer once and forks the 4 ranks, instead of torchrun's 4
fresh interpreters each importing torch and megatron-core -- on a 2-core machine that import is
most of a tiny run's time.
"""

from __future__ import annotations

import argparse

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Tuple

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent

WORLD = 4
SHUTDOWN_TIMEOUT_S = 300
"""torchrun's wait between the forwarded SIGTERM and its SIGKILL (default 30 s). It must cover
the current iteration, the save and the workers' interpreter exit; on a loaded 2-core machine
the exit alone (Python's final garbage collection over torch and megatron-core) can take longer
than 30 s, after the checkpoint is complete."""
TRAIN_ITERS = 7
ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "8",
        "--device", "cpu", "--global-batch-size", "8", "--train-iters", str(TRAIN_ITERS),
        "--lr", "3e-3", "--bf16", "--use-distributed-optimizer", "--log-interval", "1",
        "--eval-iters", "0", "--quantized-weights", "--quantized-gradients",
        "--hadamard-transform", "--loco", "--data-parallel-intra-node-size", "2"]


# ----------------------------------------------------------------------------- agreement
def _agreement_worker(rank: int, world: int) -> Dict[str, Any]:
    from megatron.training.exit_conditions import ExitConditions

    def stop_iteration(cond: ExitConditions, poke) -> Tuple[int, str]:
        try:
            for it in range(1, 20):
                poke(it)
                reason = cond.check(it)
                if reason:
                    return it, reason
            return -1, ""
        finally:
            cond.release()

    base = dict(exit_interval=None, exit_duration_in_mins=None, exit_signal_handler=False,
                exit_signal="SIGTERM")
    out: Dict[str, Any] = {}
    # A signal on rank 2 only, during iteration 3.
    cond = ExitConditions(SimpleNamespace(**dict(base, exit_signal_handler=True,
                                                 exit_signal="SIGUSR1")), 0.0, rank=rank)
    out["signal"] = stop_iteration(
        cond, lambda it: os.kill(os.getpid(), signal.SIGUSR1) if (rank, it) == (2, 3) else None)
    # A time budget spent on rank 1 only (its clock started earlier), at iteration 5.
    cond = ExitConditions(SimpleNamespace(**dict(base, exit_duration_in_mins=1e6)), time.time())

    def spend(it: int) -> None:
        if (rank, it) == (1, 5):
            cond.deadline = 0.0
    out["duration"] = stop_iteration(cond, spend)
    # --exit-interval: no communication needed.
    cond = ExitConditions(SimpleNamespace(**dict(base, exit_interval=4)), 0.0)
    out["interval"] = stop_iteration(cond, lambda it: None) + (cond.needs_agreement,)
    out["handler_restored"] = signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    return out


def test_every_rank_stops_at_the_same_boundary(tmp_path: Path) -> None:
    from dist_harness import run_distributed

    results = run_distributed(WORLD, _agreement_worker, tmp_path)
    for r in results:
        assert r["signal"] == (3, "exit signal SIGUSR1"), results
        assert r["duration"] == (5, "exit duration 1000000.0 min"), results
        assert r["interval"] == (4, "exit interval 4", False)
        assert r["handler_restored"]


def test_exit_signal_flags(capsys) -> None:
    import pytest

    from megatron.training.arguments import parse_args

    base = ARGS[:ARGS.index("--global-batch-size")] + ["--train-iters", "2", "--lr", "1e-3"]
    args = parse_args(base + ["--exit-signal-handler", "--exit-signal", "SIGUSR1"])
    assert (args.exit_signal_handler, args.exit_signal) == (True, "SIGUSR1")
    assert parse_args(base).exit_signal == "SIGTERM" and not parse_args(base).exit_signal_handler
    for bad, why in ((["--exit-signal", "SIGUSR2"], "--exit-signal acts under "
                      "--exit-signal-handler: add it"),
                     (["--exit-signal-handler", "--exit-signal", "SIGKILL"], "invalid choice"),
                     (["--exit-interval", "0"], "--exit-interval must be positive")):
        with pytest.raises(SystemExit):
            parse_args(base + bad)
        assert why in capsys.readouterr().err


def test_a_signal_torchrun_does_not_forward_is_warned_about(monkeypatch) -> None:
    """Issue 32, item 8: ``kill -USR1`` on torchrun with ``--exit-signal SIGUSR1`` killed
    torchrun and the workers trained on as orphans. torchrun exports the signals it forwards;
    the trainer names the flag that adds the one it waits for."""
    from megatron.training.exit_conditions import ExitConditions, launcher_forwarding_warning

    default = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"   # torchrun's default --signals-to-handle
    note = launcher_forwarding_warning("SIGUSR1", {"TORCHELASTIC_SIGNALS_TO_HANDLE": default})
    assert note is not None and "--signals-to-handle SIGHUP,SIGINT,SIGQUIT,SIGTERM,SIGUSR1" in note
    assert launcher_forwarding_warning("SIGTERM", {"TORCHELASTIC_SIGNALS_TO_HANDLE": default}) \
        is None
    assert launcher_forwarding_warning("SIGUSR1", {}) is None          # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", default)
    args = argparse.Namespace(exit_signal_handler=True, exit_signal="SIGUSR1")
    exits = ExitConditions(args, 0.0)
    try:
        assert exits.warning == note
    finally:
        exits.release()


# ----------------------------------------------------------------------------- end to end
def _env() -> Dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")


def _losses(path: Path) -> List[Tuple[int, float]]:
    return [(r["iteration"], r["lm_loss"]) for r in map(json.loads, path.read_text().splitlines())
            if r["type"] == "train"]


def _fork_run(args: List[str]) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "fork", str(WORLD),
                          *ARGS, *args], cwd=REPO, env=_env(), capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def test_sigterm_to_torchrun_saves_and_resumes_bit_exactly(tmp_path: Path) -> None:
    from dist_harness import free_port

    full, first, second = (tmp_path / f"{n}.jsonl" for n in ("full", "first", "second"))
    ckpt, rcs = tmp_path / "ckpt", tmp_path / "rc"
    rcs.mkdir()
    _fork_run(["--jsonl-log", str(full)])

    # The interrupted run, under torchrun; SIGTERM to torchrun once iteration 2 is logged.
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}",
           str(Path(__file__).resolve()), "entry", str(rcs), *ARGS, "--jsonl-log", str(first),
           "--save", str(ckpt), "--exit-signal-handler"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(600, proc.kill)
    watchdog.start()
    lines, sent = [], False
    try:
        for line in proc.stdout:
            lines.append(line)
            if not sent and line.startswith(" iteration        2/"):
                proc.send_signal(signal.SIGTERM)
                sent = True
        torchrun_rc = proc.wait()
    finally:
        watchdog.cancel()
    log = "".join(lines)
    assert sent, log[-3000:]
    stopped = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= stopped < TRAIN_ITERS, log[-3000:]
    assert f"exit signal SIGTERM: stopping after iteration {stopped}, saving to {ckpt}" in log
    assert "exit_reason: exit signal SIGTERM" in log
    assert "forcefully exiting via" not in log  # no SIGKILL from torchrun was needed
    assert {p.name: p.read_text() for p in rcs.iterdir()} == {
        f"rank{r}.rc": "0" for r in range(WORLD)}, log[-3000:]  # every worker's main: 0
    assert torchrun_rc == 1, log[-3000:]  # torchrun re-raises the signal it forwarded
    assert not (ckpt / ".save.lock").exists()  # released at exit
    assert [i for i, _ in _losses(first)] == list(range(1, stopped + 1))

    res = _fork_run(["--jsonl-log", str(second), "--load", str(ckpt), "--save", str(ckpt)])
    assert f"loaded checkpoint from {ckpt} at iteration {stopped}" in res.stdout
    assert "quantization state re-derived" not in res.stdout  # restored as saved
    assert _losses(first) + _losses(second) == _losses(full)  # bit for bit
    assert [i for i, _ in _losses(full)] == list(range(1, TRAIN_ITERS + 1))


# ----------------------------------------------------------------------------- launchers
def fork_launch(world: int, argv: List[str]) -> int:
    """Import the trainer once, fork ``world`` ranks on 127.0.0.1 (gloo), each running
    ``pretrain_gpt.main(argv)``; the first rank that fails takes the others down."""
    sys.path.insert(0, str(REPO))
    import pretrain_gpt  # quiets the libraries' warnings before they load
    import megatron.training.pretrain  # noqa: F401 -- the heavy imports, once
    from megatron.core.models.gpt import GPTModel  # noqa: F401
    from dist_harness import free_port

    port = free_port()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                                  LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(port))
                code = pretrain_gpt.main(argv)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    status = 0
    alive = set(pids)
    while alive:
        pid, st = os.wait()
        alive.discard(pid)
        code = os.waitstatus_to_exitcode(st)
        if code != 0 and status == 0:
            status = 1
            for other in alive:
                os.kill(other, signal.SIGKILL)
    return status


def entry(rc_dir: str, argv: List[str]) -> int:
    """torchrun's entry point: ``pretrain_gpt.main(argv)``, its return code written to
    ``rc_dir/rank{RANK}.rc`` (what the worker returned, as opposed to being killed)."""
    sys.path.insert(0, str(REPO))
    import pretrain_gpt

    code = pretrain_gpt.main(argv)
    path = os.path.join(rc_dir, f"rank{os.environ['RANK']}.rc")
    with open(path + ".part", "w", encoding="ascii") as f:
        f.write(str(code))
    os.replace(path + ".part", path)
    return code


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    if sys.argv[1] == "fork":
        sys.exit(fork_launch(int(sys.argv[2]), sys.argv[3:]))
    if sys.argv[1] == "entry":
        sys.exit(entry(sys.argv[2], sys.argv[3:]))
