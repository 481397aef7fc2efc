"""Checkpoint save/load, written atomically, in two formats (``--ckpt-format``).

Layout::

    {save}/latest_checkpointed_iteration.txt      # "N", replaced atomically
    {save}/iter_{N:07d}/mp_rank_{tp:02d}_{pp:03d}_dp_{dp:03d}.pt      # torch (default)
    {save}/iter_{N:07d}/metadata.json, *.distcp, common.pt, rank_state/  # torch_dist

``torch``: every rank writes its own file: optimizer state (for the distributed optimizer its
local shard via megatron-core's ``dp_reshardable`` parameter state -- no communication, works on
gloo CPU; for the PaRO engine its fp32 master shard, Adam moments and step), scheduler, RNG
(python/numpy/torch/cuda + the TP RNG tracker), quantization state (error buffers are per rank),
iteration and consumed samples.  The model weights are identical over data-parallel ranks, so
only DP rank 0 of each (TP, PP) stores them (PaRO strategies that partition parameters gather
them first).  Resuming needs the same TP/PP/DP layout and bucket padding; another layout is
refused at load naming what differs.

``torch_dist``: megatron-core's dist_checkpointing (:mod:`.dist_checkpoint`), reshardable to
another DP size and with quantization switched on or off; the megatron-core path only.

``--load`` reads either format (detected from the directory): a ``--save`` directory (the tracker,
or ``--ckpt-step N``, picks the iteration) or one ``iter_NNNNNNN`` folder
(:func:`find_checkpoint_to_load` says what is loaded, and what is refused).

Integrity (:mod:`.checkpoint_integrity`): every file's size and digest go into the iteration's
``manifest.json`` -- computed by the rank that wrote the file -- before the rename and the
tracker move; a load checks them first (``--no-verify-checkpoint`` skips it), so a flipped or
truncated file stops the run naming the file and the previous complete checkpoint.

Why atomic: a job killed while saving must never leave a directory that ``--load`` would pick
up.  Ranks write into ``{save}/.tmp_iter_{N:07d}``; once every rank's digests reached it, rank 0
writes the manifest, renames the directory to ``iter_{N:07d}`` and then replaces the tracker
file (temp file + ``os.replace``).  A crash before the rename leaves only a hidden temp dir,
which the next save removes.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from megatron.distributed.quant import integration

from . import checkpoint_integrity, dist_checkpoint, fault_injection
from .checkpoint_integrity import CheckpointIntegrityError, FileDigest
from .errors import StartupError
from .layer_specs import attention_layout_diff, attention_resume_note

TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rank_filename() -> str:
    from megatron.core import parallel_state as ps

    return (f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}_"
            f"{ps.get_pipeline_model_parallel_rank():03d}_dp_{ps.get_data_parallel_rank():03d}.pt")


def _model_filename() -> str:
    """The DP-rank-0 file of this (TP, PP) rank: the one that holds the weights."""
    from megatron.core import parallel_state as ps

    return (f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}_"
            f"{ps.get_pipeline_model_parallel_rank():03d}_dp_000.pt")


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


def _write_tracker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, f".{TRACKER}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))


def _fsync_dir(path: str) -> None:
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


def get_rng_state() -> Dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _tracker_states_fit(saved: Dict[str, torch.Tensor],
                        current: Dict[str, torch.Tensor]) -> bool:
    """Whether the saved tensor-parallel RNG states are states of this run's generator kind.

    On a GPU the tracker holds CUDA generator states (16 bytes); in CPU mode, CPU generator
    states (5056 bytes). megatron-core's ``set_states`` checks nothing, and a state of the other
    kind fails at the first dropout after the resume ("RNG state is wrong size")."""
    return all(name not in current or saved[name].numel() == current[name].numel()
               for name in saved)


def set_rng_state(state: Dict[str, Any], log: Any = print) -> None:
    """Restore the generators of a checkpoint. The tensor-parallel tracker's states (dropout)
    are restored only when they come from the same kind of generator: a checkpoint written on
    CPU and resumed on a GPU (or the reverse) keeps the tracker states seeded from ``--seed``,
    with a line saying so, instead of failing at the first dropout."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = get_cuda_rng_tracker()
    if _tracker_states_fit(state["tracker"], tracker.get_states()):
        tracker.set_states(state["tracker"])
    else:
        log(" > the checkpoint's tensor-parallel RNG states (dropout) come from another kind of "
            "generator (saved on CPU and resumed on a GPU, or the reverse): not restored; they "
            "stay seeded from --seed, so dropout masks differ from an uninterrupted run")


def _sub_optimizers(optimizer: Any) -> List[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _optimizer_state(optimizer: Any) -> List[Dict[str, Any]]:
    """Per sub-optimizer: common state + (distributed optimizer) this rank's shard."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    out = []
    for opt in _sub_optimizers(optimizer):
        sd = opt.state_dict()
        if isinstance(opt, DistributedOptimizer):
            param_state = opt.get_parameter_state_dp_reshardable()
            # megatron-core's loader skips padding entries; ours has none but needs the key.
            for gbuf_idx, per_dtype in param_state.items():
                if not isinstance(gbuf_idx, int):
                    continue
                for buckets in per_dtype.values():
                    for bucket in buckets:
                        for entry in bucket:
                            entry["padding"] = False
            sd["param_state"] = param_state
            sd["param_state_sharding_type"] = "dp_reshardable"
        out.append(sd)
    return out


def _load_optimizer_state(optimizer: Any, states: List[Dict[str, Any]]) -> None:
    from megatron.distributed.quant.mcore_compat.optimizer import (optimizer_bucket_layout,
                                                                   saved_bucket_layout)

    subs = _sub_optimizers(optimizer)
    if len(subs) != len(states):
        raise RuntimeError(f"checkpoint has {len(states)} optimizer(s), model has {len(subs)}")
    for opt, sd in zip(subs, states):
        saved = saved_bucket_layout(sd.get("param_state"))
        current = optimizer_bucket_layout(opt)
        if saved is not None and current is not None and saved != current:
            raise StartupError(
                "the checkpoint's distributed-optimizer state is laid out in other gradient "
                f"buckets ({saved} per buffer and dtype) than this run's ({current}): "
                "--ddp-bucket-size or --overlap-grad-reduce (which buckets the gradients) differ "
                "from the run that saved it. Resume with its settings, or save with --ckpt-format "
                "torch_dist, which reshards on load")
        # No autograd: without --bf16/--fp16 the distributed optimizer's main params are views
        # of the model's leaf parameters, which an in-place copy under grad mode refuses.
        with torch.no_grad():
            opt.load_state_dict(sd)
        _unalias_step_tensors(opt)


def _unalias_step_tensors(opt: Any) -> None:
    """Give every parameter its own Adam ``step`` tensor again.

    Why: without Apex/TE, megatron-core 0.16.1's ``DistributedOptimizer.load_state_dict`` puts
    one shared ``step`` tensor into every parameter's state; torch's Adam then increments it once
    per parameter per step, corrupting the bias correction after a resume (losses drift from the
    uninterrupted run from the second resumed step on).
    """
    inner = getattr(opt, "optimizer", None)
    state = getattr(inner, "state", None)
    if not state:
        return
    for param_state in state.values():
        step = param_state.get("step") if isinstance(param_state, dict) else None
        if torch.is_tensor(step):
            param_state["step"] = step.detach().clone()


def _sync_params_for_save(model: List[torch.nn.Module]) -> None:
    """With --overlap-param-gather the model weights lag the optimizer until the next forward;
    finish the all-gather (Megatron-LM's disable/enable forward pre-hook dance)."""
    for chunk in model:
        if getattr(chunk, "use_forward_hook", False):
            chunk.disable_forward_pre_hook(param_sync=True)
            chunk.enable_forward_pre_hook()


def _model_state_dicts(model: List[torch.nn.Module], keep: bool) -> List[Dict[str, Any]]:
    """Full weights of every chunk (only when ``keep``).

    PaRO-engine chunks hold only a shard of partitioned parameters: their full weights are
    gathered bucket by bucket (collective, every rank takes part) and copied to the host
    (:func:`~megatron.distributed.quant.integration.model_state_dict_for_save`).
    """
    out: List[Dict[str, Any]] = []
    for chunk in model:
        sd = integration.model_state_dict_for_save(chunk, keep)
        if keep:
            out.append(sd)
    return out


def save_checkpoint(args: argparse.Namespace, iteration: int, model: List[torch.nn.Module],
                    optimizer: Any, scheduler: Any, train_state: Dict[str, Any]) -> str:
    """Collective: every rank calls it.  Returns the final directory.

    ``--ckpt-format torch`` (default): one ``torch.save`` file per rank; ``torch_dist``:
    megatron-core's dist_checkpointing (:mod:`.dist_checkpoint`), reshardable on load."""
    root = args.save
    final = checkpoint_dir(root, iteration)
    tmp = os.path.join(root, f".tmp_iter_{iteration:07d}")
    rank = torch.distributed.get_rank()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # left over from a crashed save (one save at a time)
            if name.startswith((".tmp_iter_", ".old_iter_")):
                shutil.rmtree(os.path.join(root, name))
        os.makedirs(tmp)
    torch.distributed.barrier()

    try:
        return _save_into(args, iteration, model, optimizer, scheduler, train_state, root, tmp,
                          final, rank)
    except BaseException:
        # A failed save (no space, no permission, a killed writer) leaves no temporary
        # directory behind to keep the disk full; the next save would remove it anyway.
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_into(args: argparse.Namespace, iteration: int, model: List[torch.nn.Module],
               optimizer: Any, scheduler: Any, train_state: Dict[str, Any], root: str, tmp: str,
               final: str, rank: int) -> str:
    """:func:`save_checkpoint`'s writing, into ``tmp``, then the rename to ``final``."""
    from megatron.core import parallel_state as ps

    _sync_params_for_save(model)
    common: Dict[str, Any] = {
        "iteration": iteration,
        "train_state": dict(train_state),
        "args": argparse.Namespace(**{k: v for k, v in vars(args).items()}),
        "checkpoint_version": 1,
    }
    if not args.no_save_optim:
        common["opt_param_scheduler"] = scheduler.state_dict()
    per_rank: Dict[str, Any] = {"quantization": integration.quantization_state_dict(model)}
    if not args.no_save_rng:
        per_rank["rng_state"] = get_rng_state()
    if args.ckpt_format == "torch_dist":
        digests = dist_checkpoint.save(tmp, args, model, optimizer, common, per_rank)
    else:
        state = {**common, **per_rank}
        model_sd = _model_state_dicts(model, keep=ps.get_data_parallel_rank() == 0)
        if ps.get_data_parallel_rank() == 0:
            state["model"] = model_sd
        if not args.no_save_optim:
            state["optimizer"] = _optimizer_state(optimizer)
        digests = [checkpoint_integrity.save_torch(state, os.path.join(tmp, _rank_filename()),
                                                   tmp)]
    fault_injection.point("checkpoint-written", iteration)
    # Every rank's digests at rank 0 (this is also the "all files written" barrier).
    everyone: Optional[List[List[FileDigest]]] = \
        [None] * torch.distributed.get_world_size() if rank == 0 else None
    torch.distributed.gather_object(digests, everyone, dst=0)

    if rank == 0:
        checkpoint_integrity.write_manifest(tmp, iteration, [d for ds in everyone for d in ds])
        # The files are fsynced by their writers; their directory entries (the temporary
        # directory's and its subdirectories') must be durable before the rename publishes them,
        # or a power loss could leave a published checkpoint without some of its files.
        for directory, _, _ in os.walk(tmp):
            _fsync_dir(directory)
        if os.path.exists(final):  # re-saving the same iteration: replace it
            old = os.path.join(root, f".old_iter_{iteration:07d}")
            if os.path.exists(old):
                shutil.rmtree(old)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        _write_tracker(root, iteration)
        _fsync_dir(root)
    torch.distributed.barrier()
    return final


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

    def load_flag(self, iteration: int) -> str:
        """The flags that load another iteration, in the form the user gave ``--load``."""
        return (f"--load {checkpoint_dir(self.root, iteration)}" if self.by_folder
                else checkpoint_integrity.ckpt_step_flag(iteration))


_ITER_NAME = re.compile(r"iter_(\d+)$")


def _holds_checkpoint_files(path: str) -> bool:
    """An iteration directory's own files: either format's, or a manifest."""
    names = os.listdir(path)
    return any(n in ("metadata.json", checkpoint_integrity.MANIFEST) or
               (n.startswith("mp_rank_") and n.endswith(".pt")) for n in names)


def _fresh_start(args: argparse.Namespace, reason: str) -> None:
    """Training starts from iteration 0 although ``--load`` was given: say so once, loudly, or
    refuse (``--exit-on-missing-checkpoint``, or a ``--save`` whose tracker would go back)."""
    from .logging_utils import print_rank_0

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
        from .logging_utils import print_rank_0

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
      ``--ckpt-step N``'s (Megatron-LM's flag; the tracker is then not needed).
    * Errors naming what was found: a file; a directory with ``iter_*`` folders but no tracker
      (which one was meant?); a directory holding anything else.
    * Training from scratch, with a WARNING line: ``DIR`` does not exist, or ``DIR`` is also
      ``--save`` and holds nothing but hidden leftovers (``.tmp_iter_*`` of a save that never
      completed, a lock file) or nothing at all.  ``--exit-on-missing-checkpoint`` turns
      these into errors too.

    Why this choice, rather than making ``--exit-on-missing-checkpoint`` the default: a
    Megatron-LM user launches the first run and every restart of a job with the same command,
    ``--save D --load D``, and Megatron-LM starts the first launch from scratch (with a warning)
    because ``D`` does not exist yet -- scripts that ``mkdir -p D`` first, or a first save that
    was killed, leave it empty.  That must keep working.  Anything else without a checkpoint is
    a wrong path (issue 26: ``--load`` on an iteration folder or a ``.pt`` file trained from
    iteration 0 with exit 0), so it is refused before hours are spent on a run nobody wanted.
    Starting from scratch while ``--save`` holds a later checkpoint is refused as well: the
    first save of this run would move that directory's tracker backwards."""
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
    iteration = read_tracker(load)
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
            from .logging_utils import print_rank_0

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


def _check_same_layout(path: str, saved: Optional[argparse.Namespace],
                       args: argparse.Namespace) -> None:
    """The ``torch`` format loads only into the layout it was written by: name what differs."""
    if saved is None:
        return
    diffs = []
    for flag, name in (("--tensor-model-parallel-size", "tensor_model_parallel_size"),
                       ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
                       ("data-parallel size", "data_parallel_size"),
                       ("--use-distributed-optimizer", "use_distributed_optimizer"),
                       ("--paro-strategy", "paro_strategy")):
        old, new = getattr(saved, name, None), getattr(args, name, None)
        if old != new:
            diffs.append(f"{flag} {old} -> {new}")
    if integration.uses_sharded_engine(getattr(args, "paro_strategy", None)):
        # the PaRO engine's shards: rank r's slice of a bucket sits at local(r) * S/m +
        # group(r) * S/n, so the same DP size with another group size m swaps ranks' regions
        # (m follows LOCAL_WORLD_SIZE by default: a requeue on another node shape changes it)
        old, new = getattr(saved, "paro_group_size", None), getattr(args, "paro_group_size", None)
        if old != new:
            diffs.append(f"--paro-group-size {old} -> {new}")
    if args.use_distributed_optimizer:  # the optimizer shards follow the bucket padding
        old_q = _padding_fields(getattr(saved, "quant_config", None))
        new_q = _padding_fields(args.quant_config)
        diffs += [f"{k.replace('_', '-')} {old_q.get(k)} -> {new_q.get(k)}"
                  for k in sorted(set(old_q) | set(new_q)) if old_q.get(k) != new_q.get(k)]
    diffs += [d for d in (attention_layout_diff(saved, args),) if d]  # TE spec <-> local spec
    if diffs:
        raise StartupError(f"checkpoint {path} (--ckpt-format torch) was written with another "
                           f"layout: {'; '.join(diffs)}. Resume with the same layout, or save with "
                           "--ckpt-format torch_dist, which reshards on load")


def _padding_fields(cfg: Any) -> Dict[str, Any]:
    """The quantization settings that decide the buckets' padding (so the optimizer shards)."""
    if cfg is None or not cfg.enabled:
        return {"quantized_communication": False}
    return {"quantized_communication": True, "quantized_gradients": cfg.quantized_gradients,
            "quantized_weights": cfg.quantized_weights,
            "gq_group_size_intra": cfg.gq_group_size_intra if cfg.quantized_gradients else None,
            "gq_group_size_inter": cfg.gq_group_size_inter if cfg.quantized_gradients else None,
            "wq_group_size": cfg.wq_group_size if cfg.quantized_weights else None,
            "data_parallel_intra_node_size": cfg.data_parallel_intra_node_size}


def load_checkpoint(args: argparse.Namespace, model: List[torch.nn.Module], optimizer: Any,
                    scheduler: Any) -> Tuple[int, Dict[str, Any]]:
    """Restore from ``args.load``; returns (iteration, train_state).  (0, {}) if nothing there.

    The format is read from the directory (``torch`` or ``torch_dist``), whatever
    ``--ckpt-format`` (the save format) says."""
    from .logging_utils import print_rank_0

    target = agreed_checkpoint_to_load(args)
    if target is None:
        return 0, {}
    iteration, ckpt = target.iteration, target.directory
    if getattr(args, "verify_checkpoint", True):
        verify_checkpoint(target, print_rank_0)
    finetune = getattr(args, "finetune", False)
    load_optim = not finetune and not args.no_load_optim
    if dist_checkpoint.is_torch_dist_checkpoint(ckpt):
        if integration.uses_sharded_engine(getattr(args, "paro_strategy", None)):
            raise StartupError(f"{ckpt} is a torch_dist checkpoint; PaRO engine strategies "
                               f"(--paro-strategy {args.paro_strategy}) load --ckpt-format torch")
        state, problem = {}, None
        try:
            state = dist_checkpoint.load(ckpt, args, model, optimizer, load_optim, print_rank_0)
        except CheckpointIntegrityError as exc:  # an unreadable per-rank file, on some ranks
            problem = str(exc)
        _agreed(problem)
        optimizer_loaded = state["optimizer_loaded"]
        if optimizer_loaded:
            for opt in _sub_optimizers(optimizer):
                _unalias_step_tensors(opt)
        same_layout = state["same_layout"]
    else:
        state, optimizer_loaded = _load_torch_format(target, args, model, optimizer,
                                                     load_optim)
        same_layout = True
    if optimizer_loaded:
        if "opt_param_scheduler" in state:
            scheduler.load_state_dict(state["opt_param_scheduler"])
    elif (args.use_distributed_optimizer or args.bf16 or args.fp16
          or integration.uses_sharded_engine(getattr(args, "paro_strategy", None))):
        # Main (fp32) params must follow the freshly loaded model weights.
        for opt in _sub_optimizers(optimizer):
            if hasattr(opt, "reload_model_params"):
                opt.reload_model_params()
    if not finetune and not args.no_load_rng and "rng_state" in state:
        set_rng_state(state["rng_state"], print_rank_0)
    attention_note = attention_resume_note(state.get("args"), args)  # same weights, other kernel
    if attention_note:
        print_rank_0(attention_note)
    _load_quantization_state(args, model, state, iteration, same_layout, print_rank_0)
    torch.distributed.barrier()
    if finetune:
        return 0, {}
    return iteration, state.get("train_state", {})


def _agreed(problem: Optional[str]) -> None:
    """Raise :class:`StartupError` on every rank when any rank found ``problem`` (so no rank
    is left in a collective its failed peer never joins)."""
    from .data import collective_device, raise_if_any_rank_failed

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
    _agreed(problem)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        it = -1 if target is None else target.iteration
        from .data import collective_device

        bounds = torch.tensor([it, -it], dtype=torch.int64, device=collective_device())
        torch.distributed.all_reduce(bounds, op=torch.distributed.ReduceOp.MAX)
        newest, oldest = int(bounds[0]), -int(bounds[1])
        if newest != oldest:
            def name(i: int) -> str:
                return "none (a fresh start)" if i < 0 else f"iteration {i}"
            raise StartupError(
                f"--load {args.load}: the ranks found different checkpoints to load ({name(oldest)}"
                f" on some, {name(newest)} on others): another job may be saving there, or some "
                f"nodes see a stale copy of {TRACKER} on the shared filesystem. Pass --ckpt-step "
                f"N to choose one, or resume once the directory is settled")
    return target


def verify_checkpoint(target: LoadTarget, log: Any) -> None:
    """Collective: check the files of ``target`` against its manifest, split over the ranks.

    A missing, truncated, unreadable or changed file stops every rank with one error naming the
    file, the checkpoint and the previous complete checkpoint (``--ckpt-step N``).  A checkpoint
    without manifest (written before manifests existed) loads with a note."""
    ckpt = target.directory
    start = time.time()
    manifest, problem = None, None
    try:
        manifest = checkpoint_integrity.require_manifest(ckpt, target.load_flag)
        if manifest is not None:
            found = checkpoint_integrity.verify(ckpt, manifest, torch.distributed.get_rank(),
                                                torch.distributed.get_world_size())
            if found is not None:
                problem = checkpoint_integrity.damaged(ckpt, *found, target.load_flag)
    except StartupError as exc:
        problem = str(exc)
    elapsed = time.time() - start  # this rank's share, before waiting for the others
    _agreed(problem)
    if manifest is None:
        log(f" > checkpoint {ckpt} has no {checkpoint_integrity.MANIFEST} (written before "
            "checkpoint manifests): its files are not verified")
        return
    total = sum(f.size for f in manifest.files)
    log(f" > verified checkpoint {ckpt}: {len(manifest.files)} files, {total / 1e6:.1f} MB "
        f"({manifest.algorithm}; rank 0's share in {elapsed:.2f} s)")


def _read_torch_format(target: LoadTarget, args: argparse.Namespace
                       ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(this rank's state, the state holding its (TP, PP) rank's weights), or StartupError."""
    ckpt = target.directory
    own_path = os.path.join(ckpt, _rank_filename())
    any_path = os.path.join(ckpt, _model_filename())
    if not os.path.isfile(own_path):
        probe = any_path if os.path.isfile(any_path) else None
        if probe is not None:
            saved = checkpoint_integrity.torch_load(
                probe, ckpt, target.load_flag, map_location="cpu", weights_only=False).get("args")
            _check_same_layout(ckpt, saved, args)
        raise StartupError(f"{own_path} is missing: the checkpoint was written with a different "
                           "parallel layout (TP/PP/DP must match with --ckpt-format torch) or is "
                           "incomplete")
    state = checkpoint_integrity.torch_load(own_path, ckpt, target.load_flag,
                                            map_location="cpu", weights_only=False)
    _check_same_layout(ckpt, state.get("args"), args)
    model_state = state if "model" in state else checkpoint_integrity.torch_load(
        any_path, ckpt, target.load_flag, map_location="cpu", weights_only=False)
    return state, model_state


def _load_torch_format(target: LoadTarget, args: argparse.Namespace,
                       model: List[torch.nn.Module], optimizer: Any, load_optim: bool
                       ) -> Tuple[Dict[str, Any], bool]:
    """Per-rank ``torch.save`` files (same layout only).  Returns (state, optimizer loaded).

    Every rank reads its files first and the ranks agree before anything is applied: a file
    only one rank reads (unreadable with ``--no-verify-checkpoint``, or missing) stops all."""
    problem = None
    try:
        state, model_state = _read_torch_format(target, args)
    except StartupError as exc:
        problem = str(exc)
    _agreed(problem)
    for chunk, sd in zip(model, model_state["model"]):
        integration.load_model_state_dict(chunk, sd)   # PaRO engine: into its shard directly
    del model_state
    if load_optim and "optimizer" in state:
        _load_optimizer_state(optimizer, state["optimizer"])
        return state, True
    return state, False


def _load_quantization_state(args: argparse.Namespace, model: List[torch.nn.Module],
                             state: Dict[str, Any], iteration: int, same_layout: bool,
                             log: Any) -> None:
    """Restore the quantization state where it still applies, else say why it starts afresh."""
    saved = state.get("quantization") or {}
    if not args.quant_config.enabled:
        if saved:
            log(" > the checkpoint holds quantization state; this run does not quantize: ignored")
        return
    if not saved:
        log(" > the checkpoint has no quantization state (written without quantization): "
            "stochastic-rounding generators start from --seed, LoCo error buffers from zero")
        integration.reset_quantization_state(model, iteration)
        return
    changed = _changed_quantization_settings(saved, args.quant_config)
    misfit = None if (not same_layout or changed) else \
        integration.quantization_state_difference(model, saved)
    if not same_layout or changed or misfit:
        why = ("the new layout" if not same_layout else
               f"changed settings ({', '.join(changed)})" if changed else
               f"a changed layout: {misfit}")
        log(f" > quantization state re-derived for {why}: stochastic-rounding generators "
            "restart from --seed, qWD references are the loaded weights, LoCo error buffers "
            "restart from zero (they belong to the old ranks' gradient streams)")
        integration.reset_quantization_state(model, iteration)
    else:
        integration.load_quantization_state_dict(model, saved)


STATE_SHAPING_SETTINGS = (
    "quantized_gradients", "quantized_weights", "weight_quantization_mode", "gq_group_size_intra",
    "gq_group_size_inter", "wq_group_size", "hadamard_transform", "hadamard_block_size", "loco",
    "loco_error_bits", "data_parallel_intra_node_size")
"""Quantization settings that change the saved state's buckets, shapes or meaning (LoCo errors
in the Hadamard domain or not): a checkpoint saved under others is re-derived, not loaded."""


def _changed_quantization_settings(saved: Dict[str, Any], cfg: Any) -> List[str]:
    """``--flag old -> new`` for each state-shaping setting that differs from the checkpoint's."""
    saved_cfg = (saved.get("runtimes") or [{}])[0].get("config") or {}
    return [f"--{k.replace('_', '-')} {saved_cfg[k]} -> {getattr(cfg, k)}"
            for k in STATE_SHAPING_SETTINGS if k in saved_cfg and saved_cfg[k] != getattr(cfg, k)]
