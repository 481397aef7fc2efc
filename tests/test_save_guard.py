"""``--save`` guarded at startup and while saving (megatron/training/checkpoint/save_guard.py, save_lock.py).

Why: a second run on the same ``--save`` used to load from under the first and delete its
temporary folders; a read-only ``--save`` failed at the first save, hours in; a full disk gave
torch's ``basic_ios::clear: iostream error``.  Now: one run per directory (an advisory lock
naming its holder, a dead holder's lock taken over with a note), the directory created and
probed at startup, its free space compared with the size of a checkpoint, and a save that meets
ENOSPC / EACCES / EROFS is one error line naming the directory, the bytes needed and free, with
the tracker still naming the previous checkpoint.

The end-to-end test runs the trainer in one process three times (lock held by another process,
read-only ``--save``, disk full at the second save).  Where unprivileged user namespaces work
(``unshare -Urm``) the read-only directory is a read-only tmpfs and the full disk a tmpfs
smaller than two checkpoints: the real kernel errors.  Elsewhere the read-only case uses
``chmod`` (skipped as root, who may write anyway) and the full disk is an ``OSError(ENOSPC)``
raised by the checkpoint writer.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron.training.checkpoint import save_guard  # noqa: E402
from megatron.training.checkpoint import lock as save_lock  # noqa: E402
from megatron.training.checkpoint.lock import SaveDirBusy, SaveLock  # noqa: E402

HOLDER = ("import sys; sys.path.insert(0, {repo!r}); from megatron.training.checkpoint.lock import "
          "SaveLock; lock = SaveLock({d!r}); lock.acquire(); print('locked', flush=True); "
          "sys.stdin.read(); lock.release()")


def _hold_lock(directory: Path) -> subprocess.Popen:
    """Another process holding the lock of ``directory`` until its stdin closes."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER.format(repo=str(REPO), d=str(directory))],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_second_run_is_refused_naming_the_holder(tmp_path: Path) -> None:
    holder = _hold_lock(tmp_path)
    try:
        with pytest.raises(SaveDirBusy) as exc:
            SaveLock(str(tmp_path)).acquire()
        msg = str(exc.value)
        info = json.loads((tmp_path / save_lock.LOCK_NAME).read_text())
        assert f"host {info['host']}, pid {holder.pid}, started {info['started']}" in msg
        assert f"--save {tmp_path} is in use by another run" in msg
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert not (tmp_path / save_lock.LOCK_NAME).exists()  # released: the file is gone
    lock = SaveLock(str(tmp_path))
    assert lock.acquire() is None  # free now, nothing stale to report
    lock.release()


def test_stale_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path: Path) -> None:
    stale = dict(save_lock.holder_info(), pid=_dead_pid(), started="yesterday")
    (tmp_path / save_lock.LOCK_NAME).write_text(json.dumps(stale))
    lock = SaveLock(str(tmp_path))
    note = lock.acquire()
    try:
        assert note is not None and "took over a stale lock" in note
        assert f"pid {stale['pid']}" in note and "started yesterday" in note
        assert json.loads((tmp_path / save_lock.LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_lock_of_another_host_is_stale_only_when_not_refreshed(tmp_path: Path) -> None:
    """Where flock does not reach across hosts the text is the lock: a fresh one is refused."""
    path = tmp_path / save_lock.LOCK_NAME
    path.write_text(json.dumps({"host": "node-elsewhere", "pid": 4242, "started": "t0"}))
    with pytest.raises(SaveDirBusy, match=r"host node-elsewhere, pid 4242, started t0.*refreshed"):
        SaveLock(str(tmp_path)).acquire()
    old = time.time() - save_lock.STALE_AFTER_S - 60
    os.utime(path, (old, old))
    lock = SaveLock(str(tmp_path))
    try:
        assert "another host (host node-elsewhere, pid 4242" in lock.acquire()
    finally:
        lock.release()


def test_a_requeued_slurm_job_takes_over_its_previous_runs_fresh_lock(tmp_path: Path,
                                                                      monkeypatch) -> None:
    """A preempted job SIGKILLed while saving leaves a fresh lock on another host; its requeue
    (same SLURM_JOB_ID, higher SLURM_RESTART_COUNT) takes it over at once instead of waiting
    STALE_AFTER_S. Another job, or the same incarnation, still finds the lock busy."""
    path = tmp_path / save_lock.LOCK_NAME
    held = {"host": "node-elsewhere", "pid": 4242, "started": "t0", "slurm_job_id": "777",
            "slurm_restart_count": 0}
    path.write_text(json.dumps(held))
    for job, restart in (("778", "1"), ("777", "0")):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_RESTART_COUNT", restart)
        with pytest.raises(SaveDirBusy, match="refreshed"):
            SaveLock(str(tmp_path)).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock = SaveLock(str(tmp_path))
    try:
        assert "this SLURM job's previous run (job 777, restart 0 -> 1" in lock.acquire()
        assert json.loads(path.read_text())["slurm_restart_count"] == 1
    finally:
        lock.release()


def _job_env(monkeypatch, slurm_job: str = None, slurm_restart: str = "0", run_id: str = None,
             restart: str = None, attempt_number: int = None) -> None:
    """This process as a worker of a job: SLURM / torchrun variables and the agreed attempt."""
    from megatron.training import attempt

    for name, value in (("SLURM_JOB_ID", slurm_job), ("SLURM_RESTART_COUNT", slurm_restart),
                        ("TORCHELASTIC_RUN_ID", run_id),
                        ("TORCHELASTIC_RESTART_COUNT", restart)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(attempt, "_CURRENT", None if attempt_number is None else attempt.Attempt(
        attempt_number, f"megatron/attempt{attempt_number}/pg/", run_id))


def test_a_later_attempt_of_the_same_job_takes_over_on_any_host(tmp_path: Path,
                                                                 monkeypatch) -> None:
    """Issue 46, item 3: rank 0 of a torchrun job SIGKILLed (or its node lost) leaves a fresh
    lock; the restarted attempt, whose rank 0 may be on another host, takes it over at once --
    recognised by the run id and a later agreed attempt (or this agent's later restart count),
    also inside one SLURM run (``srun torchrun --max-restarts``). Another job, or the same
    attempt, is still refused until the lock is stale."""
    path = tmp_path / save_lock.LOCK_NAME
    held = {"host": "node-elsewhere", "pid": 4242, "started": "t0", "slurm_job_id": None,
            "slurm_restart_count": 0, "torchelastic_run_id": "job-a",
            "torchelastic_restart_count": 0, "attempt": 1}

    def acquire() -> str:
        lock = SaveLock(str(tmp_path))
        try:
            return lock.acquire()
        finally:
            lock.release()
            path.write_text(json.dumps(held))   # the holder's lock again, for the next case

    path.write_text(json.dumps(held))
    # 1. the same torchrun job, a later attempt (restart counts are each agent's own: the new
    #    rank 0's node may count 0) -> taken over
    _job_env(monkeypatch, run_id="job-a", restart="0", attempt_number=2)
    assert "this torchrun job's previous attempt (run job-a, attempt 1 -> 2; host " \
        "node-elsewhere, pid 4242" in acquire()
    _job_env(monkeypatch, run_id="job-a", restart="1")           # no agreed attempt known
    assert "(run job-a, restart 0 -> 1;" in acquire()
    # 2. the same SLURM job: requeued, or restarted by torchrun inside the same SLURM run
    held.update(slurm_job_id="777")
    path.write_text(json.dumps(held))
    _job_env(monkeypatch, slurm_job="777", slurm_restart="1", run_id="job-b", attempt_number=1)
    assert "this SLURM job's previous run (job 777, restart 0 -> 1;" in acquire()
    _job_env(monkeypatch, slurm_job="777", run_id="job-a", restart="0", attempt_number=3)
    assert "(run job-a, attempt 1 -> 3;" in acquire()
    # 3. another job, or not a later attempt -> refused
    for env in (dict(run_id="job-b", restart="1", attempt_number=2),         # another run id
                dict(slurm_job="778", run_id="job-c", attempt_number=5),     # another SLURM job
                dict(slurm_job="777", run_id="job-a", attempt_number=1),     # the same attempt
                dict(slurm_job="777", slurm_restart="0"),                    # no torchrun
                dict()):                                                     # no job at all
        _job_env(monkeypatch, **env)
        with pytest.raises(SaveDirBusy, match="host node-elsewhere, pid 4242.*refreshed"):
            SaveLock(str(tmp_path)).acquire()
    # a holder of a later SLURM run is never taken over by an earlier one's attempt
    held.update(slurm_restart_count=2)
    path.write_text(json.dumps(held))
    _job_env(monkeypatch, slurm_job="777", slurm_restart="1", run_id="job-a", attempt_number=9)
    with pytest.raises(SaveDirBusy):
        SaveLock(str(tmp_path)).acquire()


def test_writable_check_creates_the_directory_and_names_a_bad_one(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    assert save_guard.check_writable(str(target)) is None and target.is_dir()
    assert list(target.iterdir()) == []  # the probe is removed
    (tmp_path / "file").write_text("x")
    assert save_guard.check_writable(str(tmp_path / "file")) == \
        f"--save {tmp_path / 'file'} is not a directory"


def test_save_failures_become_one_line(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    d = str(tmp_path)
    err = save_guard.describe_save_failure(OSError(errno.ENOSPC, "No space left on device"), d,
                                           30, 123456789)
    msg = str(err)
    assert "\n" not in msg
    assert msg.startswith(f"checkpoint save at iteration 30 failed: no space left on device "
                          f"(ENOSPC) in --save {d}: the checkpoint needs about 123456789 bytes "
                          "(117.7 MiB), ")
    assert "bytes (" in msg.split("), ", 1)[1] and " free; " in msg
    assert msg.endswith("latest_checkpointed_iteration.txt still names iteration 20, the last "
                        "complete checkpoint")
    # torch's C++ writer on a full disk: no errno, the free space decides.
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 4096))
    torch_writer = RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos "
                                "128 vs 0")
    assert "no space left on device (ENOSPC)" in str(
        save_guard.describe_save_failure(torch_writer, d, 30, 10 << 20))
    assert "4096 bytes (4.0 KiB) free" in str(
        save_guard.describe_save_failure(torch_writer, d, 30, 10 << 20))
    # megatron-core / torch.distributed.checkpoint wrap the writer's error: found in the chain.
    try:
        try:
            raise PermissionError(errno.EACCES, "Permission denied", d + "/x.distcp")
        except PermissionError as inner:
            raise RuntimeError("CheckpointException ranks:dict_keys([1])") from inner
    except RuntimeError as wrapped:
        assert "permission denied (EACCES) in --save" in str(
            save_guard.describe_save_failure(wrapped, d, 30, None))
    assert save_guard.describe_save_failure(RuntimeError("NCCL timeout"), d, 30, 1) is None
    assert save_guard.describe_save_failure(ValueError("bad"), d, 30, 1) is None


# ----------------------------------------------------------------------------- end to end
def _userns_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        try:
            return subprocess.run(["unshare", "-Urm", "sh", "-c",
                                   f"mount -t tmpfs -o size=1m none {d}"], capture_output=True,
                                  timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False


def test_trainer_refuses_busy_or_read_only_save_and_reports_a_full_disk(tmp_path: Path) -> None:
    real = _userns_available()
    busy, ro, full = tmp_path / "busy", tmp_path / "ro", tmp_path / "full"
    for d in (busy, ro, full):
        d.mkdir()
    holder = _hold_lock(busy)
    script = [sys.executable, str(Path(__file__).resolve()), "driver", str(busy), str(ro),
              str(full), "real" if real else "simulated"]
    if real:  # ro: read-only tmpfs; full: a tmpfs with room for one checkpoint and a half
        script = ["unshare", "-Urm", "sh", "-c",
                  f"mount -t tmpfs -o size=1m none {ro} && mount -o remount,ro {ro} && "
                  f"mount -t tmpfs -o size={FULL_TMPFS_KB}k none {full} && exec \"$@\"", "sh",
                  *script]
    elif os.geteuid() != 0:
        ro.chmod(0o555)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    try:
        res = subprocess.run(script, cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=600)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])

    rc, err = results["busy"]
    info = json.loads((busy / save_lock.LOCK_NAME).read_text()) \
        if (busy / save_lock.LOCK_NAME).exists() else None
    assert rc == 1, out[-3000:]
    assert f"error: --save {busy} is in use by another run (host " in err
    assert f"pid {holder.pid}, started " in err
    assert info is None  # the holder released it when it ended
    assert not list(p for p in busy.iterdir())  # refused before writing anything

    if results.get("ro") is not None:
        rc, err = results["ro"]
        assert rc == 1
        assert f"error: --save {ro} is not writable (" in err
        assert ("Read-only file system" if real else "Permission denied") in err

    rc, err = results["full"]
    assert rc == 1, out[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(f"error: checkpoint save at iteration 4 failed: no space left on "
                               f"device (ENOSPC) in --save {full}: the checkpoint needs about ")
    assert " free; latest_checkpointed_iteration.txt still names iteration 2, the last " \
           "complete checkpoint" in lines[0]
    assert results["full_tracker"] == "2"  # untouched by the failed save
    assert results["full_leftovers"] == []  # the failed save's temporary directory is gone
    if real:  # the startup check saw it coming
        assert "less than two checkpoints' worth" in results["full_stdout"]


def test_free_space_below_one_checkpoint_is_refused_at_startup(tmp_path: Path,
                                                               monkeypatch) -> None:
    """Issue 32, item 7: below one checkpoint of free space the run warned, trained
    --save-interval iterations and then failed; now it is refused at startup naming the way
    out, and --allow-low-disk-space turns the refusal into the warning."""
    from dist_harness import model_parallel_world_of_one
    from megatron.training.arguments import parse_args
    from megatron.training.errors import StartupError

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    save = tmp_path / "s"
    args = parse_args(DRIVER_ARGS + ["--save", str(save)])
    with model_parallel_world_of_one():
        guard = save_guard.prepare_save_dir(str(save))
        try:
            monkeypatch.setattr(save_guard, "_free_bytes", lambda d: 1000)
            with pytest.raises(StartupError) as info:
                guard.check_free_space(args, 1_000_000)
            msg = str(info.value)
            assert f"--save {save} has 1000 bytes" in msg and "--allow-low-disk-space" in msg
            assert "after --save-interval 2 iterations, would fail" in msg
            args.allow_low_disk_space = True
            assert "the first save will fail" in guard.check_free_space(args, 1_000_000)
            monkeypatch.setattr(save_guard, "_free_bytes", lambda d: 10 ** 12)
            assert guard.check_free_space(args, 1_000_000) is None
        finally:
            guard.release()


FULL_TMPFS_KB = 2600
"""One checkpoint of DRIVER_ARGS on one rank is about 1.6 MB: the first fits, the second not."""
DRIVER_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
               "--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "8",
               "--device", "cpu", "--global-batch-size", "2", "--train-iters", "6", "--lr",
               "3e-3", "--bf16", "--use-distributed-optimizer", "--log-interval", "1",
               "--eval-iters", "0", "--save-interval", "2"]


def _driver(busy: str, ro: str, full: str, mode: str) -> None:
    """One process, three runs of ``pretrain_gpt.main`` (single rank); prints their results."""
    import contextlib
    import io

    import pretrain_gpt  # noqa: F401 -- quiets the libraries' warnings before they load
    import torch
    from megatron.core import parallel_state

    from dist_harness import free_port

    def run(save: str, patch_save=None):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
        out, err = io.StringIO(), io.StringIO()
        original = torch.save
        if patch_save is not None:
            torch.save = patch_save(original)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = pretrain_gpt.main(DRIVER_ARGS + ["--save", save])
        finally:
            torch.save = original
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            parallel_state.destroy_model_parallel()
        return rc, err.getvalue(), out.getvalue()

    def enospc_at_second_checkpoint(original):
        calls = {"n": 0}

        def save(obj, f, *a, **k):
            if isinstance(f, str) and "iter_" in f:
                calls["n"] += 1
                if calls["n"] == 2:
                    raise OSError(errno.ENOSPC, "No space left on device", f)
            return original(obj, f, *a, **k)
        return save

    results = {}
    results["busy"] = run(busy)[:2]
    results["ro"] = run(ro)[:2] if (mode == "real" or os.geteuid() != 0) else None
    rc, err, out = run(full, None if mode == "real" else enospc_at_second_checkpoint)
    results["full"], results["full_stdout"] = (rc, err), out
    with open(os.path.join(full, "latest_checkpointed_iteration.txt"), encoding="utf-8") as f:
        results["full_tracker"] = f.read()
    results["full_leftovers"] = [n for n in os.listdir(full) if n.startswith(".tmp_iter_")]
    print(json.dumps(results))


if __name__ == "__main__" and sys.argv[1:2] == ["driver"]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _driver(*sys.argv[2:6])
