"""Where checkpoints live in a ``--save`` directory: the ``iter_NNNNNNN`` folders and the tracker
file that names the latest complete one.

Why a module of its own: the save (which replaces the tracker last, atomically), the discovery
of what ``--load`` loads (which reads it) and the ``--save`` guards (which name the last complete
checkpoint in an error) must agree on these names and on what a damaged tracker means.
"""

from __future__ import annotations

import os
from typing import Optional

from megatron.training.checkpoint import integrity as checkpoint_integrity
from megatron.training.errors import StartupError

TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    """Iteration named by the tracker file, or None when there is no checkpoint.

    A tracker that is not a non-negative number (random bytes, empty, text) is a
    :class:`StartupError` naming the file and the way out, raised where the ranks agree on what
    to load (every rank stops together), not a decoding traceback on the ranks that read it."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read(64)
    try:
        text = raw.decode("ascii").strip()
        if text.isdigit():
            return int(text)
    except UnicodeDecodeError:
        pass
    iterations = checkpoint_integrity.iterations_in(root)
    way_out = (f"pass --ckpt-step N to load one of the checkpoints there (iterations "
               f"{', '.join(map(str, iterations[-3:]))}), e.g. --ckpt-step {iterations[-1]}, or "
               f"rewrite {TRACKER} with that number" if iterations else
               f"it holds no iter_* folder: remove {TRACKER} to start from scratch")
    raise StartupError(f"{path} is damaged: it holds {raw[:32]!r}, not an iteration number; "
                       f"{way_out}")


def write_tracker(root: str, iteration: int) -> None:
    """Name ``iteration`` in the tracker: a temporary file, fsynced, then ``os.replace``."""
    tmp = os.path.join(root, f".{TRACKER}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))


def fsync_dir(path: str) -> None:
    """Make ``path``'s directory entries durable (best effort: errors are ignored)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
