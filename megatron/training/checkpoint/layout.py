"""Where checkpoints live in a ``--save`` directory: the ``iter_NNNNNNN`` folders and the tracker
file that names the latest complete one.

Why a module of its own: the save (which replaces the tracker last, atomically), the discovery
of what ``--load`` loads (which reads it) and the ``--save`` guards (which name the last complete
checkpoint in an error) must agree on these names and on what a damaged tracker means.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

from megatron.training.checkpoint import integrity as checkpoint_integrity
from megatron.training.errors import StartupError

TRACKER = "latest_checkpointed_iteration.txt"
MEGATRON_LM_MODEL_FILE = "model_optim_rng.pt"
"""The per-rank file of Megatron-LM's torch layout (``mp_rank_XX[_YYY]/model_optim_rng.pt``)."""
RELEASE = "release"
"""What Megatron-LM's tracker says (and the folder it names) for a checkpoint that is a set of
weights rather than a point of a run, e.g. one made by Megatron-LM's converter: it loads as
``--finetune`` does (iteration 0, no optimizer or RNG state)."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def release_dir(root: str) -> str:
    return os.path.join(root, RELEASE)


def _tracker_text(root: str) -> Optional[bytes]:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read(64)


def tracker_entry(root: str) -> Union[int, str, None]:
    """What the tracker file of ``root`` names, read once: an iteration, :data:`RELEASE`
    (Megatron-LM's release checkpoint), or None (no tracker).

    A tracker that is not a non-negative number (random bytes, empty, text) is a
    :class:`StartupError` naming the file and the way out, raised where the ranks agree on what
    to load (every rank stops together), not a decoding traceback on the ranks that read it."""
    path = os.path.join(root, TRACKER)
    raw = _tracker_text(root)
    if raw is None:
        return None
    if raw.strip() == RELEASE.encode():
        return RELEASE
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


def read_tracker(root: str) -> Optional[int]:
    """Iteration named by the tracker file, or None when there is no checkpoint or the tracker
    says ``release`` (no iteration: a save replaces it); see :func:`tracker_entry`."""
    entry = tracker_entry(root)
    return entry if isinstance(entry, int) else None


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


def saved_arg(saved_args: Any, name: str, default: Any = None) -> Any:
    """One of a checkpoint's saved args (a dict in torch_dist, a Namespace in torch and in
    Megatron-LM's checkpoints); ``default`` when absent or there are none."""
    if saved_args is None:
        return default
    if isinstance(saved_args, dict):
        return saved_args.get(name, default)
    return getattr(saved_args, name, default)


def padded_vocab_problem(directory: str, saved_args: Any, args: Any) -> Optional[str]:
    """Why this run's padded vocabulary does not fit the checkpoint's (None when it does, or the
    checkpoint does not record it), in one line naming both flags that decide it and the values
    the checkpoint was written with -- before the load, where the difference would surface as
    a shape error of the embedding, naming neither."""
    saved = saved_arg(saved_args, "padded_vocab_size")
    mine = getattr(args, "padded_vocab_size", None)
    if not isinstance(saved, int) or not isinstance(mine, int) or saved == mine:
        return None
    div, tp = (saved_arg(saved_args, "make_vocab_size_divisible_by"),
               saved_arg(saved_args, "tensor_model_parallel_size"))
    run_div, run_tp = args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
    hint = ""
    if isinstance(div, int) and isinstance(tp, int) and (div * tp) % run_tp == 0 \
            and div * tp // run_tp != run_div:
        hint = (f"; run with --make-vocab-size-divisible-by {div * tp // run_tp} at "
                f"--tensor-model-parallel-size {run_tp} to pad as the checkpoint does")
    vocab = saved_arg(saved_args, "model_vocab_size")
    return (f"checkpoint {directory} has a padded vocabulary of {saved} rows"
            + (f" ({vocab} tokens)" if isinstance(vocab, int) else "")
            + f", written with --make-vocab-size-divisible-by {div} and "
            f"--tensor-model-parallel-size {tp}; this run pads to {mine} rows "
            f"(--make-vocab-size-divisible-by {run_div} x --tensor-model-parallel-size {run_tp})"
            + hint)
