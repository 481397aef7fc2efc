"""Guards around ``--save``: one run per directory, checked at startup, clear write errors, and no
checkpoint-writer process outliving its rank.

Why: a checkpoint directory is where hours of training end up, and it used to be checked only
by the first save.  Four things now happen before (or around) it:

* **One run per ``--save``** (:class:`SaveLock`).  Global rank 0 takes an advisory lock at
  startup: ``fcntl.flock`` on ``{save}/.save.lock``, with the holder (host, pid, start time)
  written in the file.  A second run on the same directory is refused at startup with an error
  naming the holder -- before it loads anything from under the first run.  A lock file left by
  a process that died (``flock`` is released by the kernel, the text stays) is taken over with
  a logged note when that process was on this host and is gone.  On a file system where
  ``flock`` is not coherent between hosts the text is the lock: the holder refreshes the file's
  modification time every :data:`HEARTBEAT_S` seconds, and a lock of another host is stale once
  it is :data:`STALE_AFTER_S` seconds old -- or at once when it was written by an earlier run
  of the same SLURM job (a requeue after a SIGKILL mid-save).  The file is removed when the run
  ends.
* **Writable at startup** (:func:`check_writable`): the directory is created if missing and a
  probe file is written and removed, on global rank 0 and on the first rank of every other host
  (hosts may mount it differently); a read-only directory stops the run at startup naming it.
* **Free space** (:meth:`SaveDirGuard.check_free_space`): the size of one checkpoint (that of
  the newest checkpoint already in ``--save``, else an estimate from the parameter count, the
  optimizer state and the quantization state) against the free space; below two checkpoints'
  worth is a warning at startup.
* **ENOSPC / EACCES during a save** (:func:`describe_save_failure`): one error line naming the
  directory, the bytes the checkpoint needs and the bytes free, instead of torch's
  ``basic_ios::clear: iostream error``.  The tracker (``latest_checkpointed_iteration.txt``) is
  only replaced after every rank finished writing (:mod:`.checkpointing`), so it still names the
  previous complete checkpoint; the line says which.
* **No orphan writers**: megatron-core's ``torch_dist`` save starts helper processes from the
  rank, also for a synchronous save: writer workers forked per save
  (``FileSystemWriterAsync.write_preloaded_data_multiproc``, ``fork`` context) and, once per
  process, a spawned ``multiprocessing`` manager serving the write-results queue.  A rank killed
  with SIGKILL used to leave them behind (re-parented to init; the manager waits forever on its
  stop event, holding a re-imported trainer's memory).  Every process forked from a rank's main
  thread now asks the kernel for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``,
  :func:`install_fork_guard`) and exits at once if the parent died before it could ask; the
  manager is started by us, with the same request in its initializer
  (:func:`guard_torch_dist_writer_queue`).  (multiprocessing's resource tracker, also spawned,
  exits by itself when the last process holding its pipe is gone.)
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

LOCK_NAME = ".save.lock"
HEARTBEAT_S = 60.0
"""How often the holder refreshes the lock file's modification time."""
STALE_AFTER_S = 600.0
"""A lock written on another host and not refreshed for this long belongs to a dead run."""


class SaveDirBusy(RuntimeError):
    """Another live run holds the ``--save`` lock (the message names it)."""


class CheckpointWriteError(RuntimeError):
    """A save failed for lack of space or permission: the one-line message says where and how
    much."""


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024.0 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} TiB"


# ----------------------------------------------------------------------------- the lock
def _boot_id() -> Optional[str]:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def _proc_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22): tells a
    reused pid from the process that wrote a lock."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder_info() -> Dict[str, Any]:
    """What this process writes into the lock file."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "boot_id": _boot_id(),
            "proc_start": _proc_start(os.getpid()), "command": " ".join(sys.argv)[:300],
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": _int_or_none(os.environ.get("SLURM_RESTART_COUNT", "0"))}


def _int_or_none(text: Optional[str]) -> Optional[int]:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _earlier_incarnation_of_this_job(info: Dict[str, Any], me: Dict[str, Any]) -> bool:
    """Whether the lock's holder was an earlier run of this very SLURM job, which SLURM
    requeued (same job id, a higher restart count now): SLURM runs one incarnation of a job at a
    time, so that holder is gone. The case that matters: a preempted job SIGKILLed while saving
    leaves a fresh lock, and its requeue (usually on other nodes) would wait out the staleness
    period."""
    if not me.get("slurm_job_id") or info.get("slurm_job_id") != me["slurm_job_id"]:
        return False
    theirs, mine = info.get("slurm_restart_count"), me.get("slurm_restart_count")
    return isinstance(theirs, int) and isinstance(mine, int) and mine > theirs


def describe_holder(info: Dict[str, Any]) -> str:
    return (f"host {info.get('host', '?')}, pid {info.get('pid', '?')}, "
            f"started {info.get('started', '?')}")


class SaveLock:
    """The advisory lock of one ``--save`` directory (see the module docstring).

    ``acquire()`` returns a note to log (a stale lock taken over) or None, and raises
    :class:`SaveDirBusy` naming the holder when another run has it.  ``release()`` removes the
    file and drops the lock; it is idempotent."""

    def __init__(self, directory: str, heartbeat_s: float = HEARTBEAT_S,
                 stale_after_s: float = STALE_AFTER_S) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.fd: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- acquire
    def acquire(self) -> Optional[str]:
        import fcntl

        for _ in range(5):  # the file may be replaced between open and flock: retry
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    info = self._read(fd)
                    os.close(fd)
                    raise SaveDirBusy(self._busy_message(info)) from None
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    os.close(fd)
                    raise
                # No flock here (some network file systems): the file's text is the lock.
            try:
                same_file = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same_file = False
            if not same_file:  # the previous holder removed it after we opened it
                os.close(fd)
                continue
            try:
                note = self._check_previous(self._read(fd))
            except SaveDirBusy:
                os.close(fd)
                raise
            self.fd = fd
            self._write(holder_info())
            self._start_heartbeat()
            return note
        raise SaveDirBusy(f"--save {self.directory}: could not take {self.path} (it kept "
                          "being replaced by another process)")

    @staticmethod
    def _read(fd: int) -> Dict[str, Any]:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            text = os.read(fd, 65536).decode("utf-8", "replace").strip()
            return json.loads(text) if text else {}
        except (OSError, ValueError):
            return {"host": "?", "pid": "?", "started": "? (unreadable lock file)"}

    def _busy_message(self, info: Dict[str, Any], extra: str = "") -> str:
        return (f"--save {self.directory} is in use by another run ({describe_holder(info)}; "
                f"lock file {self.path}{extra}): two runs on one --save overwrite each other's "
                "checkpoints. Wait for that run to end or stop it, or give this run another "
                "--save")

    def _check_previous(self, info: Dict[str, Any]) -> Optional[str]:
        """The lock is ours at the ``flock`` level; is the text of a live holder?"""
        if not info:
            return None
        me = holder_info()
        pid = info.get("pid")
        if info.get("host") == me["host"]:
            rebooted = info.get("boot_id") and me["boot_id"] and info["boot_id"] != me["boot_id"]
            alive = (not rebooted and isinstance(pid, int) and _pid_alive(pid)
                     and (info.get("proc_start") is None
                          or _proc_start(pid) == info.get("proc_start")))
            if alive:  # flock did not see it (a file system without working flock)
                raise SaveDirBusy(self._busy_message(info))
            return (f" > --save {self.directory}: took over a stale lock of a run that is no "
                    f"longer alive ({describe_holder(info)})")
        if _earlier_incarnation_of_this_job(info, me):
            return (f" > --save {self.directory}: took over the lock of this SLURM job's previous "
                    f"run (job {me['slurm_job_id']}, restart {info.get('slurm_restart_count')} -> "
                    f"{me['slurm_restart_count']}; {describe_holder(info)})")
        try:
            age = time.time() - os.stat(self.path).st_mtime
        except OSError:
            age = float("inf")
        if age < self.stale_after_s:
            raise SaveDirBusy(self._busy_message(
                info, f", refreshed {age:.0f} s ago; if that run is gone, delete the lock file"))
        return (f" > --save {self.directory}: took over a stale lock of a run on another host "
                f"({describe_holder(info)}), not refreshed for {age:.0f} s")

    def _write(self, info: Dict[str, Any]) -> None:
        os.lseek(self.fd, 0, os.SEEK_SET)
        os.ftruncate(self.fd, 0)
        os.write(self.fd, (json.dumps(info) + "\n").encode())
        os.fsync(self.fd)

    def _start_heartbeat(self) -> None:
        if self.heartbeat_s <= 0:
            return

        def beat() -> None:
            while not self._stop.wait(self.heartbeat_s):
                try:
                    os.utime(self.path)
                except OSError:
                    pass

        self._thread = threading.Thread(target=beat, name="save-lock-heartbeat", daemon=True)
        self._thread.start()

    # -- release
    def release(self) -> None:
        if self.fd is None:
            return
        self._stop.set()
        try:
            if os.path.samestat(os.fstat(self.fd), os.stat(self.path)):
                os.unlink(self.path)  # while still holding the flock (see acquire's retry)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


# ----------------------------------------------------------------------------- writability
def check_writable(directory: str, create: bool = True) -> Optional[str]:
    """None when ``directory`` exists (created if ``create``) and a file can be written in it;
    else the one-line reason."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        return f"--save {directory} is not a directory"
    if create:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            return (f"--save {directory} cannot be created ({exc.strerror}): checkpoints could "
                    "not be saved; create it, fix its permissions or choose another directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write_probe.", dir=directory)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        return (f"--save {directory} is not writable ({exc.strerror}, errno "
                f"{errno.errorcode.get(exc.errno, exc.errno)}): checkpoints could not be saved; "
                "fix its permissions or mount, or choose another directory")
    return None


# ----------------------------------------------------------------------------- sizes
def directory_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def rank_checkpoint_bytes(args: Any, local_params: int, dp_rank: int, dp_size: int) -> int:
    """Estimated bytes this rank writes per checkpoint.

    Model weights in the parameter dtype (``torch``: by data-parallel rank 0; ``torch_dist``:
    shared out over the data-parallel ranks); optimizer state (fp32 master weights under
    bf16/fp16, Adam's two moments or SGD's momentum), per shard with the distributed optimizer
    (or ``torch_dist``), whole on every rank otherwise; LoCo error buffers per rank."""
    import torch

    elem = torch.tensor([], dtype=getattr(args, "params_dtype", torch.float32)).element_size()
    dist_fmt = getattr(args, "ckpt_format", "torch") == "torch_dist"
    n = float(local_params)
    total = 0.0
    if dist_fmt:
        total += n * elem / dp_size
    elif dp_rank == 0:
        total += n * elem
    if not getattr(args, "no_save_optim", False):
        per_param = 4.0 if (getattr(args, "bf16", False) or getattr(args, "fp16", False)) else 0.0
        if getattr(args, "optimizer", "adam") == "adam":
            per_param += 8.0
        elif getattr(args, "sgd_momentum", 0.0):
            per_param += 4.0
        sharded = dist_fmt or getattr(args, "use_distributed_optimizer", False)
        total += n * per_param / (dp_size if sharded else 1)
    qcfg = getattr(args, "quant_config", None)
    if qcfg is not None and getattr(qcfg, "enabled", False) and getattr(qcfg, "loco", False):
        total += n * getattr(qcfg, "loco_error_bits", 8) / 8.0
    return int(total)


# ----------------------------------------------------------------------------- save failures
NO_SPACE = {errno.ENOSPC: "no space left on device (ENOSPC)",
            errno.EDQUOT: "disk quota exceeded (EDQUOT)"}
NO_ACCESS = {errno.EACCES: "permission denied (EACCES)", errno.EPERM: "not permitted (EPERM)",
             errno.EROFS: "read-only file system (EROFS)"}
_TEXT = [(re.compile(r"No space left on device|\[Errno 28\]"), NO_SPACE[errno.ENOSPC]),
         (re.compile(r"Disk quota exceeded|\[Errno 122\]"), NO_SPACE[errno.EDQUOT]),
         (re.compile(r"Permission denied|\[Errno 13\]"), NO_ACCESS[errno.EACCES]),
         (re.compile(r"Read-only file system|\[Errno 30\]"), NO_ACCESS[errno.EROFS])]
_TORCH_WRITER = re.compile(r"iostream error|unexpected pos|PytorchStreamWriter|file write failed")
LOW_SPACE_BYTES = 16 << 20
"""Free space below which an unexplained write error of torch's stream writer is "no space"."""


def _exception_chain(exc: BaseException) -> List[BaseException]:
    seen: List[BaseException] = []
    todo = [exc]
    while todo and len(seen) < 32:
        e = todo.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's per-rank errors
        if isinstance(failures, dict):
            todo += [v for v in failures.values() if isinstance(v, BaseException)]
        todo += [a for a in getattr(e, "args", ()) if isinstance(a, BaseException)]
    return seen


def classify_save_failure(exc: BaseException, directory: str,
                          needed: Optional[int] = None) -> Optional[str]:
    """"no space ..." / "permission denied ..." when ``exc`` (or what caused it) is one, else
    None.  torch's C++ writer reports a full disk as ``basic_ios::clear: iostream error`` or
    ``unexpected pos``: those count as no space when the directory's file system is (nearly)
    full."""
    chain = _exception_chain(exc)
    for e in chain:
        if isinstance(e, OSError) and e.errno in NO_SPACE:
            return NO_SPACE[e.errno]
        if isinstance(e, OSError) and e.errno in NO_ACCESS:
            return NO_ACCESS[e.errno]
    for e in chain:
        text = str(e)
        for pattern, what in _TEXT:
            if pattern.search(text):
                return what
    if any(_TORCH_WRITER.search(str(e)) for e in chain):
        free = _free_bytes(directory)
        if free is not None and (free < LOW_SPACE_BYTES or (needed and free < needed)):
            return NO_SPACE[errno.ENOSPC]
        if check_writable(directory, create=False) is not None:
            return NO_ACCESS[errno.EACCES]
    return None


def _free_bytes(directory: str) -> Optional[int]:
    path = directory
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


def describe_save_failure(exc: BaseException, directory: str, iteration: int,
                          needed: Optional[int]) -> Optional[CheckpointWriteError]:
    """The one-line :class:`CheckpointWriteError` for a save that failed for lack of space or
    permission, or None for any other failure (re-raise it as it is)."""
    what = classify_save_failure(exc, directory, needed)
    if what is None:
        return None
    from .checkpointing import TRACKER, read_tracker

    free = _free_bytes(directory)
    try:
        previous = read_tracker(directory)
    except Exception:  # noqa: BLE001 -- the message must not fail
        previous = None
    tracker = (f"{TRACKER} still names iteration {previous}, the last complete checkpoint"
               if previous is not None else f"no {TRACKER} was written (no complete checkpoint)")
    need = f"about {needed} bytes ({_human(needed)})" if needed else "an unknown number of bytes"
    have = f"{free} bytes ({_human(free)})" if free is not None else "unknown"
    return CheckpointWriteError(
        f"checkpoint save at iteration {iteration} failed: {what} in --save {directory}: "
        f"the checkpoint needs {need}, {have} free; {tracker}")


# ----------------------------------------------------------------------------- startup
class SaveDirGuard:
    """What :func:`prepare_save_dir` set up for one run (release it at the end)."""

    def __init__(self, directory: str, lock: Optional[SaveLock]) -> None:
        self.directory = directory
        self.lock = lock
        self.checkpoint_bytes: Optional[int] = None

    def check_free_space(self, args: Any, local_params: int, device: Any = None) -> Optional[str]:
        """Collective.  Sets :attr:`checkpoint_bytes` (every rank) and returns the warning that
        rank 0 printed, if any."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        mine = rank_checkpoint_bytes(args, local_params, ps.get_data_parallel_rank(),
                                     ps.get_data_parallel_world_size())
        # the checkpoint's bytes over the ranks, and the least free space a rank sees (a
        # node-local --save, or one node's view of a shared one; a rank that cannot tell: inf)
        free_here = _free_bytes(self.directory)
        total = torch.tensor([float(mine)], dtype=torch.float64, device=device)
        least = torch.tensor([float("inf") if free_here is None else float(free_here)],
                             dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
            dist.all_reduce(least, op=dist.ReduceOp.MIN)
        needed = int(total.item())
        free = None if math.isinf(least.item()) else int(least.item())
        how = "estimated from the parameter count and optimizer state"
        latest = _latest_checkpoint_dir(self.directory)
        if latest is not None:
            measured = directory_bytes(latest)
            if measured > 0:
                needed, how = measured, f"the size of {latest}"
        self.checkpoint_bytes = needed
        if free is None or free >= 2 * needed:
            return None
        below_one = free < needed
        said = (f"--save {self.directory} has {free} bytes ({_human(free)}) free; one checkpoint "
                f"of this run needs about {needed} bytes ({_human(needed)}, {how})")
        if below_one and not getattr(args, "allow_low_disk_space", False):
            from .errors import StartupError

            raise StartupError(f"{said}: the first save, after --save-interval "
                               f"{args.save_interval} iterations, would fail. Free space there, "
                               "choose another --save, or pass --allow-low-disk-space to start "
                               "anyway")
        msg = (f"WARNING: {said}: " + ("less than one checkpoint, the first save will fail"
                                       if below_one else "less than two checkpoints' worth"))
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(msg, flush=True)
        return msg

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _latest_checkpoint_dir(directory: str) -> Optional[str]:
    try:
        from .checkpointing import checkpoint_dir, read_tracker

        it = read_tracker(directory)
    except Exception:  # noqa: BLE001 -- only a size hint
        return None
    if it is None:
        return None
    path = checkpoint_dir(directory, it)
    return path if os.path.isdir(path) else None


def prepare_save_dir(directory: str) -> SaveDirGuard:
    """Collective, after ``torch.distributed`` is initialized: create and probe ``directory``,
    take its lock on global rank 0.  Raises :class:`~.errors.StartupError` on every rank when
    any rank found a problem (the message names the host that saw it)."""
    import torch.distributed as dist

    from .errors import StartupError

    rank = dist.get_rank() if dist.is_initialized() else 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    problem: Optional[str] = None
    note: Optional[str] = None
    lock: Optional[SaveLock] = None
    if rank == 0 or local_rank == 0:  # one probe per host
        problem = check_writable(directory, create=True)
    if rank == 0 and problem is None:
        lock = SaveLock(directory)
        try:
            note = lock.acquire()
        except SaveDirBusy as exc:
            problem, lock = str(exc), None
    problems: List[Tuple[Optional[str], str, int]] = [(problem, socket.gethostname(), rank)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, problems[0])
        problems = gathered
    found = [(p, host, r) for p, host, r in problems if p]
    if found:
        if lock is not None:
            lock.release()
        p, host, r = found[0]
        raise StartupError(p if r == 0 else f"{p} (seen on host {host}, rank {r})")
    if note:
        print(note, flush=True)
    return SaveDirGuard(directory, lock)


# ----------------------------------------------------------------------------- orphan writers
PR_SET_PDEATHSIG = 1
HOLD_ENV = "MEGATRON_TEST_HOLD_FORKED_CHILD"
"""Tests only: ``RANK:DIR`` -- a process forked from that rank writes ``DIR/held-PID`` (its
parent's pid inside) and then waits until it is killed, so a test can kill the rank while its
checkpoint writer is alive, at a known moment."""

_installed = False
_parent_pid: Optional[int] = None
_forked_from_main = False


def _before_fork() -> None:
    global _parent_pid, _forked_from_main
    _parent_pid = os.getpid()
    _forked_from_main = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    """Runs in every child forked from this process: die with the parent."""
    if _forked_from_main:  # the signal follows the forking *thread*: only the main one lives on
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
        if _parent_pid is not None and os.getppid() != _parent_pid:
            os._exit(1)  # the parent died before the request took effect
    hold = os.environ.get(HOLD_ENV)
    if hold:
        rank, _, directory = hold.partition(":")
        if os.environ.get("RANK", "0") == rank:
            path = os.path.join(directory, f"held-{os.getpid()}")
            with open(path + ".part", "w", encoding="ascii") as f:
                f.write(str(os.getppid()))
            os.replace(path + ".part", path)
            while True:
                signal.pause()


def _die_with_parent(parent_pid: int) -> None:
    """Initializer of a spawned helper process: SIGKILL when ``parent_pid`` dies."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)


_writer_managers: List[Any] = []


def guard_torch_dist_writer_queue() -> bool:
    """Start megatron-core's torch_dist write-results queue ourselves, served by a manager
    process that dies with this rank.

    Why: megatron-core 0.16.1 creates it lazily at the first ``torch_dist`` save
    (``filesystem_async._get_write_results_queue``: ``mp.get_context("spawn").Manager()``).  That
    manager is a *spawned* process (fork + exec, so :func:`install_fork_guard` does not reach
    it), it re-imports the entry script (hundreds of MB) and it has no parent check: a rank
    killed with SIGKILL left it behind for good, waiting on its stop event (a futex).  Ours is
    the same spawn-context ``SyncManager``, started with an initializer that asks for SIGKILL
    when the rank dies.  Idempotent; returns whether the queue is ours."""
    if not sys.platform.startswith("linux"):
        return False
    from megatron.distributed.quant.mcore_compat.process_globals import (
        set_torch_dist_results_queue, torch_dist_results_queue)

    if torch_dist_results_queue() is not None:
        return bool(_writer_managers)
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=_die_with_parent, initargs=(os.getpid(),))
    _writer_managers.append(manager)
    set_torch_dist_results_queue(manager.Queue())
    return True


def install_fork_guard() -> bool:
    """Make every process later forked from this one's main thread die with it (Linux; once
    per process).  Returns whether the guard is active."""
    global _installed
    if not sys.platform.startswith("linux"):
        return False
    if not _installed:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _installed = True
    return True
