"""One run per ``--save`` directory: the advisory lock global rank 0 takes at startup.

Why: two runs on one ``--save`` overwrite each other's checkpoints. Rank 0 takes ``fcntl.flock``
on ``{save}/.save.lock`` and writes the holder (host, pid, start time) in it; a second run is
refused at startup naming the holder. A dead holder's lock on this host is taken over with a note.
Where ``flock`` is not coherent between hosts the text is the lock: the holder refreshes its
modification time every :data:`HEARTBEAT_S` seconds, another host's lock is stale after
:data:`STALE_AFTER_S`, or at once when an earlier run of the same job wrote it
(:func:`earlier_run_of_this_job`). The file is removed when the run ends.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Dict, Optional

from megatron.training.attempt import int_or_none

LOCK_NAME = ".save.lock"
HEARTBEAT_S = 60.0
"""How often the holder refreshes the lock file's modification time."""
STALE_AFTER_S = 600.0
"""A lock written on another host and not refreshed for this long belongs to a dead run."""


class SaveDirBusy(RuntimeError):
    """Another live run holds the ``--save`` lock (the message names it)."""


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
            "slurm_restart_count": int_or_none(os.environ.get("SLURM_RESTART_COUNT", "0")),
            "torchelastic_run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
            "torchelastic_restart_count": int_or_none(
                os.environ.get("TORCHELASTIC_RESTART_COUNT")),
            "attempt": _attempt_number()}


def _attempt_number() -> Optional[int]:
    """The agreed attempt number of this job's store (megatron/training/attempt.py), once the
    process group exists."""
    from megatron.training import attempt

    current = attempt.current()
    return None if current is None else current.number


def _newer(mine: Any, theirs: Any) -> bool:
    return isinstance(theirs, int) and isinstance(mine, int) and mine > theirs


def earlier_run_of_this_job(info: Dict[str, Any], me: Dict[str, Any]) -> Optional[str]:
    """How the lock's holder is an earlier run of this very job (a note), or None.

    The same job: the same ``SLURM_JOB_ID``, or the same ``TORCHELASTIC_RUN_ID`` (torchrun's
    ``--rdzv-id``; a uuid of its own under ``--standalone``). Earlier: a higher
    ``SLURM_RESTART_COUNT`` now (SLURM requeued the job), or, within one SLURM run (or outside
    SLURM), a later torchrun attempt -- the attempt number the ranks agree on through the job's
    store (:mod:`megatron.training.attempt`), which grows with every rendezvous round whichever
    node rank 0 is on, or else this agent's ``TORCHELASTIC_RESTART_COUNT``. A launcher runs one
    incarnation of a job at a time, so that holder is gone; without this, the restart of a
    SIGKILLed rank 0 (usually on another host) would wait out the staleness period."""
    same_slurm = bool(me.get("slurm_job_id")) and info.get("slurm_job_id") == me["slurm_job_id"]
    if same_slurm and _newer(me.get("slurm_restart_count"), info.get("slurm_restart_count")):
        return (f"this SLURM job's previous run (job {me['slurm_job_id']}, restart "
                f"{info.get('slurm_restart_count')} -> {me['slurm_restart_count']}")
    if same_slurm and info.get("slurm_restart_count") != me.get("slurm_restart_count"):
        return None    # a later SLURM run holds it: this one is the stale one
    run_id = me.get("torchelastic_run_id")
    if not run_id or info.get("torchelastic_run_id") != run_id:
        return None
    for key, what in (("attempt", "attempt"), ("torchelastic_restart_count", "restart")):
        if _newer(me.get(key), info.get(key)):
            return (f"this torchrun job's previous attempt (run {run_id}, {what} "
                    f"{info.get(key)} -> {me.get(key)}")
    return None


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
        earlier = earlier_run_of_this_job(info, me)
        if earlier:
            return (f" > --save {self.directory}: took over the lock of {earlier}; "
                    f"{describe_holder(info)})")
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
