"""What ``--load`` loads, decided the same on every rank -- or why nothing is loaded.

Why a module of its own: this is the one decision of a resume that is not about a format. A
wrong ``--load`` (a file, an empty folder, a folder of iteration folders without a tracker) is
refused naming what was found; a missing one starts from scratch only where Megatron-LM's
"same command for the first launch and every restart" needs it; and the ranks, each reading the
tracker on its own, must agree on one iteration (:func:`agreed_checkpoint_to_load`) before any
of them reads a file.  The readers of the formats (:mod:`.torch_format`,
:mod:`.torch_dist_format`) only read the :class:`LoadTarget` decided here.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from typing import List, Optional

import torch

from megatron.training.checkpoint import integrity as checkpoint_integrity
from megatron.training.checkpoint.layout import (MEGATRON_LM_MODEL_FILE, RELEASE, TRACKER,
                                                 checkpoint_dir, read_tracker, release_dir,
                                                 tracker_entry)
from megatron.training.errors import StartupError


@dataclass(frozen=True)
class LoadTarget:
    """What ``--load`` resolved to: one iteration directory."""

    root: str
    """The directory holding the ``iter_*`` folders (where the previous checkpoint is looked
    for when this one is damaged)."""
    iteration: int
    directory: str
    """``{root}/iter_{iteration:07d}``."""
    by_folder: bool = False
    """``--load`` named the iteration folder itself (not its parent)."""
    release: bool = False
    """Megatron-LM's ``release`` checkpoint (``{root}/release``, tracker ``release``): weights
    only, loaded as with ``--finetune`` (iteration 0, no optimizer or RNG state)."""

    def load_flag(self, iteration: int) -> str:
        """The flags that load another iteration, in the form the user gave ``--load``."""
        return (f"--load {checkpoint_dir(self.root, iteration)}" if self.by_folder
                else checkpoint_integrity.ckpt_step_flag(iteration))


_ITER_NAME = re.compile(r"iter_(\d+)$")


def _holds_checkpoint_files(path: str) -> bool:
    """An iteration directory's own files: either format's, a manifest, or Megatron-LM's torch
    layout (``mp_rank_XX[_YYY]/model_optim_rng.pt``)."""
    names = os.listdir(path)
    return any(n in ("metadata.json", checkpoint_integrity.MANIFEST) or
               (n.startswith("mp_rank_") and n.endswith(".pt")) or
               (n.startswith("mp_rank_") and
                os.path.isfile(os.path.join(path, n, MEGATRON_LM_MODEL_FILE))) for n in names)


def _fresh_start(args: argparse.Namespace, reason: str) -> None:
    """Training starts from iteration 0 although ``--load`` was given: say so once, loudly, or
    refuse (``--exit-on-missing-checkpoint``, or a ``--save`` whose tracker would go back)."""
    from megatron.training.logging_utils import print_rank_0

    if getattr(args, "exit_on_missing_checkpoint", False):
        raise StartupError(f"--load {args.load}: no checkpoint to resume from ({reason}) and "
                           "--exit-on-missing-checkpoint is set")
    existing = read_tracker(args.save) if args.save and os.path.isdir(args.save) else None
    if existing:
        raise StartupError(f"--load {args.load} has no checkpoint ({reason}), so this run would "
                           f"start at iteration 0, but --save {args.save} holds a checkpoint at "
                           f"iteration {existing} whose tracker the first save would move "
                           "backwards: fix --load, or --save to a new directory")
    print_rank_0(f"WARNING: --load {args.load}: no checkpoint found ({reason}); training starts "
                 "from iteration 0 (--exit-on-missing-checkpoint makes this an error)")


def _saves_into(args: argparse.Namespace, root: str) -> bool:
    """Whether this run's ``--save`` is the directory ``root``."""
    return bool(args.save) and os.path.realpath(args.save) == os.path.realpath(root)


def _newer_complete_checkpoints(root: str, iteration: int) -> List[int]:
    """Iterations after ``iteration`` under ``root`` whose directory has a manifest (a
    checkpoint the save completed: the manifest is written before the rename)."""
    return [i for i in checkpoint_integrity.iterations_in(root) if i > iteration and
            os.path.isfile(os.path.join(checkpoint_dir(root, i), checkpoint_integrity.MANIFEST))]


def _warn_if_saves_replace_newer(args: argparse.Namespace, root: str, iteration: int) -> None:
    """``--ckpt-step N`` into the ``--save`` directory that holds later complete checkpoints:
    the user chose N, so it loads, but the saves that replace the later ones are said."""
    if not _saves_into(args, root):
        return
    newer = _newer_complete_checkpoints(root, iteration)
    if newer:
        from megatron.training.logging_utils import print_rank_0

        print_rank_0(f"WARNING: resuming from iteration {iteration} in --save {args.save}, which "
                     f"holds the later checkpoints {', '.join(map(str, newer))}: this run's saves "
                     "at those iterations will replace them")


def _found(names: List[str]) -> str:
    shown = ", ".join(sorted(names)[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def find_checkpoint_to_load(args: argparse.Namespace) -> Optional[LoadTarget]:
    """What ``--load`` loads, or None when training starts from scratch (logged once).

    * ``--load DIR/iter_NNNNNNN``: that iteration (``--ckpt-step``, if given, must agree).
    * ``--load DIR``: the iteration ``DIR/latest_checkpointed_iteration.txt`` names, or
      ``--ckpt-step N``'s (Megatron-LM's flag; the tracker is then not needed).  A tracker that
      says ``release`` names ``DIR/release`` (Megatron-LM's release checkpoint, as its converter
      writes it; ``--load DIR/release`` names it too): iteration 0, weights only.
    * Errors naming what was found: a file; a directory with ``iter_*`` folders but no tracker
      (which one was meant?); a directory holding anything else.
    * Training from scratch, with a WARNING line: ``DIR`` does not exist, or ``DIR`` is also
      ``--save`` and holds nothing but hidden leftovers (``.tmp_iter_*`` of a save that never
      completed, a lock file) or nothing at all.  ``--exit-on-missing-checkpoint`` turns
      these into errors too; so is a fresh start while ``--save`` holds a later checkpoint (the
      first save would move its tracker backwards).

    Why not refuse every missing checkpoint: Megatron-LM users launch the first run and every
    restart with the same ``--save D --load D``, and ``D`` may not exist yet or be empty. Any
    other ``--load`` without a checkpoint is a wrong path, refused before hours are spent."""
    load = args.load
    if not load:
        return None
    step = getattr(args, "ckpt_step", None)
    if os.path.isfile(load):
        parent = os.path.dirname(os.path.abspath(load))
        hint = (f"; to load the checkpoint it belongs to, pass --load {parent}"
                if _ITER_NAME.match(os.path.basename(parent)) else "")
        raise StartupError(f"--load {load} is a file ({os.path.getsize(load)} bytes), not a "
                           "checkpoint directory: pass the --save directory of a run (it holds "
                           f"{TRACKER}) or one of its iter_NNNNNNN folders{hint}")
    if not os.path.exists(load):
        if step is not None:
            raise StartupError(f"--load {load} does not exist, so --ckpt-step {step} cannot be "
                               "loaded")
        _fresh_start(args, "the directory does not exist")
        return None
    if not os.path.isdir(load):
        raise StartupError(f"--load {load} is neither a file nor a directory")

    m = _ITER_NAME.match(os.path.basename(os.path.normpath(load)))
    if m:
        iteration = int(m.group(1))
        if step is not None and step != iteration:
            raise StartupError(f"--load {load} is the folder of iteration {iteration} but "
                               f"--ckpt-step {step} asks for another: drop one of them")
        if not _holds_checkpoint_files(load):
            raise StartupError(f"--load {load} is named like an iteration folder but holds no "
                               f"checkpoint files (found: {_found(os.listdir(load)) or 'nothing'})")
        root = os.path.dirname(os.path.normpath(os.path.abspath(load)))
        return LoadTarget(root, iteration, os.path.normpath(load), by_folder=True)
    if os.path.basename(os.path.normpath(load)) == RELEASE and _holds_checkpoint_files(load):
        if step is not None:
            raise StartupError(f"--load {load} is a release checkpoint (weights, no iteration) "
                               f"but --ckpt-step {step} asks for an iteration: drop one of them")
        root = os.path.dirname(os.path.normpath(os.path.abspath(load)))
        return LoadTarget(root, 0, os.path.normpath(load), by_folder=True, release=True)
    if _holds_checkpoint_files(load):
        raise StartupError(f"--load {load} holds the files of one checkpoint but is not named "
                           "iter_NNNNNNN, so its iteration is unknown: rename it, or pass the "
                           "directory that holds the iter_* folders")

    iterations = checkpoint_integrity.iterations_in(load)
    if step is not None:
        if step not in iterations:
            raise StartupError(f"--ckpt-step {step}: {checkpoint_dir(load, step)} does not exist"
                               + (f" (--load {load} has iterations "
                                  f"{', '.join(map(str, iterations[-5:]))})" if iterations
                                  else f" and --load {load} holds no iter_* folder"))
        _warn_if_saves_replace_newer(args, load, step)
        return LoadTarget(load, step, checkpoint_dir(load, step))
    entry = tracker_entry(load)
    if entry == RELEASE:
        release = release_dir(load)
        if not os.path.isdir(release) or not _holds_checkpoint_files(release):
            found = _found(os.listdir(release)) if os.path.isdir(release) else ""
            raise StartupError(f"--load {load}: {TRACKER} says {RELEASE} (a release checkpoint, "
                               f"as Megatron-LM's converter writes) but {release} "
                               + (f"holds no checkpoint files (found: {found or 'nothing'})"
                                  if os.path.isdir(release) else "does not exist"))
        return LoadTarget(load, 0, release, release=True)
    iteration = entry
    if iteration is not None:
        ckpt = checkpoint_dir(load, iteration)
        if not os.path.isdir(ckpt):
            raise StartupError(f"--load {load}: {TRACKER} names iteration {iteration} but {ckpt} "
                               "does not exist")
        newer = _newer_complete_checkpoints(load, iteration)
        if newer:
            said = (f"--load {load}: {TRACKER} names iteration {iteration}, but the newer "
                    f"complete checkpoints {', '.join(map(str, newer))} are there too (a tracker "
                    "restored from a backup, or moved by hand?)")
            if _saves_into(args, load):
                raise StartupError(
                    f"{said}; this run's saves into --save {args.save} would replace them. Pass "
                    f"--ckpt-step {newer[-1]} to resume from the newest, or --ckpt-step "
                    f"{iteration} to resume from the tracker's")
            from megatron.training.logging_utils import print_rank_0

            print_rank_0(f"WARNING: {said}: loading iteration {iteration} (--ckpt-step "
                         f"{newer[-1]} loads the newest)")
        return LoadTarget(load, iteration, ckpt)
    if iterations:
        raise StartupError(f"--load {load} has no {TRACKER} but holds iteration folders "
                           f"({', '.join(f'iter_{i:07d}' for i in iterations[-3:])}): choose one "
                           f"with --ckpt-step N (e.g. --ckpt-step {iterations[-1]})")
    visible = [n for n in os.listdir(load) if not n.startswith(".")]
    hidden = sorted(n for n in os.listdir(load) if n.startswith("."))
    same_as_save = _saves_into(args, load)
    if not visible and same_as_save:
        _fresh_start(args, "the directory holds no checkpoint yet"
                     + (f", only {_found(hidden)}" if hidden else ""))
        return None
    raise StartupError(f"--load {load} holds no checkpoint (no {TRACKER}, no iter_* folder): "
                       + (f"found {_found(visible + hidden)}" if visible or hidden
                          else "it is empty")
                       + ". Pass the --save directory of a run or one of its iter_NNNNNNN "
                       "folders (a --load directory that does not exist starts from scratch)")


def stop_if_any_rank_failed(problem: Optional[str]) -> None:
    """Raise :class:`StartupError` on every rank when any rank found ``problem`` (so no rank
    is left in a collective its failed peer never joins)."""
    from megatron.training.data.datasets import collective_device, raise_if_any_rank_failed

    raise_if_any_rank_failed(problem, collective_device())


def agreed_checkpoint_to_load(args: argparse.Namespace) -> Optional[LoadTarget]:
    """Collective :func:`find_checkpoint_to_load`: every rank resolves ``--load`` itself, and
    the run stops on every rank when one failed or when they found different iterations.

    Why: each rank reads the tracker on its own; a ``--load`` directory another job is saving
    into, or a shared filesystem whose attribute cache is stale on some nodes, made ranks load
    different iterations without a word (the per-rank file checks pass), and a rank whose
    resolution failed left the others waiting in the next collective."""
    target, problem = None, None
    try:
        target = find_checkpoint_to_load(args)
    except StartupError as exc:
        problem = str(exc)
    stop_if_any_rank_failed(problem)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        it = -1 if target is None else -2 if target.release else target.iteration
        from megatron.training.data.datasets import collective_device

        bounds = torch.tensor([it, -it], dtype=torch.int64, device=collective_device())
        torch.distributed.all_reduce(bounds, op=torch.distributed.ReduceOp.MAX)
        newest, oldest = int(bounds[0]), -int(bounds[1])
        if newest != oldest:
            def name(i: int) -> str:
                return ("none (a fresh start)" if i == -1 else f"the {RELEASE} checkpoint"
                        if i == -2 else f"iteration {i}")
            raise StartupError(
                f"--load {args.load}: the ranks found different checkpoints to load ({name(oldest)}"
                f" on some, {name(newest)} on others): another job may be saving there, or some "
                f"nodes see a stale copy of {TRACKER} on the shared filesystem. Pass --ckpt-step "
                f"N to choose one, or resume once the directory is settled")
    return target
