"""A rank killed while megatron-core's torch_dist writer processes run leaves nothing behind.

Why: ``--ckpt-format torch_dist`` saves through megatron-core's ``FileSystemWriterAsync``, which
forks writer processes from the rank for every save (``fork`` context, also for a synchronous
save) and spawns, once, a ``multiprocessing`` manager for their results.  When the rank was
killed with SIGKILL, the dead rank's helpers were re-parented to init and lived on (one was found
hung in a futex wait, holding 350 MB).  The trainer now makes every process it forks die with it
(``writer_processes.install_fork_guard``: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` in the child)
and starts the manager itself with the same request
(``writer_processes.guard_torch_dist_writer_queue``).

The moment is made deterministic with ``MEGATRON_TEST_HOLD_FORKED_CHILD=0:DIR``: rank 0's
writer processes announce themselves in DIR (their parent's pid inside) and wait, so rank 0 is
killed exactly while its writers exist.  Every process of the run carries a token in its
environment; within a bounded time none may be left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import List, Tuple

REPO = Path(__file__).resolve().parent.parent
TOKEN_VAR = "ORPHAN_WRITER_TEST_TOKEN"
DEADLINE_S = 60.0
"""How long the launcher may take to notice the dead rank and stop the others."""


def _processes_with(token: str) -> List[Tuple[int, str]]:
    """(pid, command line) of every live process whose environment holds the token."""
    needle = f"{TOKEN_VAR}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()[:160]
            found.append((int(entry), f"ppid {ppid} state {state}: {cmd}"))
        except OSError:  # gone meanwhile, or a zombie
            continue
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_for(predicate, deadline_s: float, what: str, log: Path):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} within {deadline_s:.0f} s\n{log.read_text()[-3000:]}")


def test_sigkilled_rank_leaves_no_checkpoint_writer(tmp_path: Path) -> None:
    from dist_harness import free_port

    token, held, log = uuid.uuid4().hex, tmp_path / "held", tmp_path / "run.log"
    held.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore",
               MEGATRON_TEST_HOLD_FORKED_CHILD=f"0:{held}", **{TOKEN_VAR: token})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(REPO / "pretrain_gpt.py"),
           "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
           "--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "8",
           "--device", "cpu", "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3",
           "--bf16", "--use-distributed-optimizer", "--eval-iters", "0",
           "--ckpt-format", "torch_dist", "--save", str(tmp_path / "ckpt"),
           "--save-interval", "2"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        def writer_held():
            assert proc.poll() is None, f"the run ended before its save:\n{log.read_text()[-3000:]}"
            names = [n for n in os.listdir(held) if n.startswith("held-")]
            return names or None

        names = _wait_for(writer_held, 600, "no checkpoint writer of rank 0 started", log)
        writers = [int(n.split("-")[1]) for n in names]
        rank0 = int((held / names[0]).read_text())
        alive = {pid for pid, _ in _processes_with(token)}
        assert set(writers) <= alive and rank0 in alive
        os.kill(rank0, signal.SIGKILL)  # kill -9 of rank 0 while its writers run

        _wait_for(lambda: not _processes_with(token) and proc.poll() is not None, DEADLINE_S,
                  f"processes of the run still alive: {_processes_with(token)}", log)
        assert proc.returncode != 0  # torchrun reports the failed rank
        assert not [p for p in writers if _alive(p)]
        assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()
    finally:
        for pid, _ in _processes_with(token):  # never leave anything behind, even on failure
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
