"""Guards around ``--save``: checked at startup, one run per directory, clear write errors.

Why: a checkpoint directory is where hours of training end up, so its problems must show before
the first save: one run per directory (:class:`~.lock.SaveLock`, taken by
:func:`prepare_save_dir`), writable on every host (:func:`check_writable`), room for a checkpoint
(:meth:`SaveDirGuard.check_free_space`: the newest checkpoint's size, else an estimate; a warning
below two), and a save that meets ENOSPC / EACCES stops with one line naming the directory, the
bytes needed and free, and the previous complete checkpoint (:func:`describe_save_failure`).
Writer processes of a ``torch_dist`` save: :mod:`.writer_processes`.
"""

from __future__ import annotations

import errno
import math
import os
import re
import shutil
import socket
import tempfile
from typing import Any, List, Optional, Tuple

from megatron.training.checkpoint.lock import SaveDirBusy, SaveLock


class CheckpointWriteError(RuntimeError):
    """A save failed for lack of space or permission: the one-line message says where and how
    much."""


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024.0 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} TiB"


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
    from megatron.training.checkpoint.layout import TRACKER, read_tracker

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
            from megatron.training.errors import StartupError

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
        from megatron.training.checkpoint.layout import checkpoint_dir, read_tracker

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

    from megatron.training.errors import StartupError

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
