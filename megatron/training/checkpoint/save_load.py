"""Checkpoint save and load: the atomic save protocol and the order of a resume, over two
formats (``--ckpt-format``: :mod:`.torch_format`, :mod:`.torch_dist_format`).

Layout::

    {save}/latest_checkpointed_iteration.txt      # "N", replaced atomically
    {save}/iter_{N:07d}/mp_rank_{tp:02d}_{pp:03d}_dp_{dp:03d}.pt      # torch (default)
    {save}/iter_{N:07d}/metadata.json, *.distcp, common.pt, rank_state/  # torch_dist

Why atomic: a job killed while saving must never leave a directory ``--load`` would pick up.
Ranks write into ``{save}/.tmp_iter_{N:07d}``; rank 0 writes the manifest (:mod:`.integrity`),
renames the directory and then replaces the tracker (:mod:`.layout`); a crash before the rename
leaves a hidden temp dir the next save removes. What ``--load`` loads: :mod:`.discovery`. See
"Checkpoints" in docs/architecture.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.distributed.quant import integration

from megatron.training.checkpoint import integrity as checkpoint_integrity
from megatron.training.checkpoint import torch_format as checkpoint_torch_format
from megatron.training.checkpoint import torch_dist_format as dist_checkpoint
from megatron.training.checkpoint import megatron_lm_format
from megatron.training import fault_injection
from megatron.training.checkpoint.discovery import LoadTarget, agreed_checkpoint_to_load, stop_if_any_rank_failed
from megatron.training.checkpoint.integrity import CheckpointIntegrityError, FileDigest
from megatron.training.checkpoint.layout import (checkpoint_dir, fsync_dir, padded_vocab_problem,
                                                 write_tracker)
from megatron.training.checkpoint.quantization_state import restore_quantization_state
from megatron.training.errors import StartupError
from megatron.training.lr_schedule import resume_schedule, scheduler_state_dict
from megatron.training.model.layer_specs import attention_resume_note
from megatron.training.checkpoint.rng_state import get_rng_state, set_rng_state


# ----------------------------------------------------------------------------- save
def _sync_params_for_save(model: List[torch.nn.Module]) -> None:
    """With --overlap-param-gather the model weights lag the optimizer until the next forward;
    finish the all-gather (Megatron-LM's disable/enable forward pre-hook dance)."""
    for chunk in model:
        if getattr(chunk, "use_forward_hook", False):
            chunk.disable_forward_pre_hook(param_sync=True)
            chunk.enable_forward_pre_hook()


def save_checkpoint(args: argparse.Namespace, iteration: int, model: List[torch.nn.Module],
                    optimizer: Any, scheduler: Any, train_state: Dict[str, Any]) -> str:
    """Collective: every rank calls it.  Returns the final directory.

    ``--ckpt-format torch`` (default): one ``torch.save`` file per rank; ``torch_dist``:
    megatron-core's dist_checkpointing (:mod:`.torch_dist_format`), reshardable on load."""
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
    _sync_params_for_save(model)
    common: Dict[str, Any] = {
        "iteration": iteration,
        "train_state": dict(train_state),
        "args": argparse.Namespace(**{k: v for k, v in vars(args).items()}),
        "checkpoint_version": 1,
    }
    if not args.no_save_optim:
        common["opt_param_scheduler"] = scheduler_state_dict(scheduler, args)
    per_rank: Dict[str, Any] = {"quantization": integration.quantization_state_dict(model)}
    if not args.no_save_rng:
        per_rank["rng_state"] = get_rng_state()
    if args.ckpt_format == "torch_dist":
        digests = dist_checkpoint.save(tmp, args, model, optimizer, common, per_rank)
    else:
        digests = checkpoint_torch_format.save_rank_file(tmp, args, model, optimizer, common,
                                                         per_rank)
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
            fsync_dir(directory)
        if os.path.exists(final):  # re-saving the same iteration: replace it
            old = os.path.join(root, f".old_iter_{iteration:07d}")
            if os.path.exists(old):
                shutil.rmtree(old)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        fsync_dir(root)
        write_tracker(root, iteration)
        fsync_dir(root)
    torch.distributed.barrier()
    return final


# ----------------------------------------------------------------------------- load
def load_checkpoint(args: argparse.Namespace, model: List[torch.nn.Module], optimizer: Any,
                    scheduler: Any) -> Tuple[int, Dict[str, Any]]:
    """Restore from ``args.load``; returns (iteration, train_state).  (0, {}) if nothing there.

    The format is read from the directory (``torch`` or ``torch_dist``), whatever
    ``--ckpt-format`` (the save format) says."""
    from megatron.training.logging_utils import print_rank_0

    target = agreed_checkpoint_to_load(args)
    if target is None:
        return 0, {}
    iteration, ckpt = target.iteration, target.directory
    foreign = megatron_lm_format.is_megatron_lm_checkpoint(ckpt)
    if getattr(args, "verify_checkpoint", True):
        verify_checkpoint(target, print_rank_0,
                          foreign or megatron_lm_format.is_megatron_lm_torch_dist(ckpt))
    # a release checkpoint (Megatron-LM's): weights only, iteration 0, as with --finetune
    finetune = getattr(args, "finetune", False) or target.release
    load_optim = not finetune and not args.no_load_optim
    if foreign:  # Megatron-LM's torch layout: the model weights only
        state = megatron_lm_format.load(target, args, model, finetune, print_rank_0)
        optimizer_loaded, same_layout = False, True
    elif dist_checkpoint.is_torch_dist_checkpoint(ckpt):
        if integration.uses_sharded_engine(getattr(args, "paro_strategy", None)):
            raise StartupError(f"{ckpt} is a torch_dist checkpoint; PaRO engine strategies "
                               f"(--paro-strategy {args.paro_strategy}) load --ckpt-format torch")
        state, problem = {}, None
        try:
            state = dist_checkpoint.load(ckpt, args, model, optimizer, load_optim, print_rank_0,
                                         finetune=finetune)
        except CheckpointIntegrityError as exc:  # an unreadable per-rank file, on some ranks
            problem = str(exc)
        stop_if_any_rank_failed(problem)
        optimizer_loaded = state["optimizer_loaded"]
        if optimizer_loaded:
            for opt in checkpoint_torch_format.sub_optimizers(optimizer):
                checkpoint_torch_format.unalias_step_tensors(opt)
        same_layout = state["same_layout"]
    else:
        state, optimizer_loaded = _load_torch_format(target, args, model, optimizer,
                                                     load_optim)
        same_layout = True
    if not finetune:
        # The schedule follows the iteration the run continues at, with or without the
        # optimizer state (--no-load-optim; Megatron-LM's checkpoints): the checkpoint's
        # scheduler state, checked against this run's (StartupError), or this run's schedule
        # advanced to the consumed samples.
        consumed = state.get("train_state", {}).get("consumed_train_samples",
                                                    iteration * args.global_batch_size)
        print_rank_0(f" > {resume_schedule(args, scheduler, state, int(consumed))}")
    if not optimizer_loaded and (args.use_distributed_optimizer or args.bf16 or args.fp16
          or integration.uses_sharded_engine(getattr(args, "paro_strategy", None))):
        # Main (fp32) params must follow the freshly loaded model weights.
        for opt in checkpoint_torch_format.sub_optimizers(optimizer):
            if hasattr(opt, "reload_model_params"):
                opt.reload_model_params()
    if not finetune and not args.no_load_rng and "rng_state" in state:
        set_rng_state(state["rng_state"], print_rank_0)
    attention_note = attention_resume_note(state.get("args"), args)  # same weights, other kernel
    if attention_note:
        print_rank_0(attention_note)
    restore_quantization_state(args, model, state, iteration, same_layout, print_rank_0)
    if target.release and not foreign:
        print_rank_0(f" > loaded the release checkpoint {ckpt}: model weights only, training "
                     "starts at iteration 0 (as with --finetune)")
    torch.distributed.barrier()
    if finetune:
        return 0, {}
    return iteration, state.get("train_state", {})


def verify_checkpoint(target: LoadTarget, log: Any, foreign: bool = False) -> None:
    """Collective: check the files of ``target`` against its manifest, split over the ranks.

    A missing, truncated, unreadable or changed file stops every rank with one error naming the
    file, the checkpoint and the previous complete checkpoint (``--ckpt-step N``).  A checkpoint
    without manifest (written before manifests existed, or ``foreign``: Megatron-LM's layout)
    loads with a note."""
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
    stop_if_any_rank_failed(problem)
    if manifest is None:
        log(megatron_lm_format.UNVERIFIED_NOTE.format(path=ckpt) if foreign else
            f" > checkpoint {ckpt} has no {checkpoint_integrity.MANIFEST} (written before "
            "checkpoint manifests): its files are not verified")
        return
    total = sum(f.size for f in manifest.files)
    log(f" > verified checkpoint {ckpt}: {len(manifest.files)} files, {total / 1e6:.1f} MB "
        f"({manifest.algorithm}; rank 0's share in {elapsed:.2f} s)")


def _load_torch_format(target: LoadTarget, args: argparse.Namespace,
                       model: List[torch.nn.Module], optimizer: Any, load_optim: bool
                       ) -> Tuple[Dict[str, Any], bool]:
    """Per-rank ``torch.save`` files (same layout only).  Returns (state, optimizer loaded).

    Every rank reads its files first and the ranks agree before anything is applied: a file
    only one rank reads (unreadable with ``--no-verify-checkpoint``, or missing) stops all."""
    problem = None
    try:
        state, model_state = checkpoint_torch_format.read_rank_files(target, args)
    except StartupError as exc:
        problem = str(exc)
    stop_if_any_rank_failed(problem)
    vocab = padded_vocab_problem(target.directory, state.get("args"), args)
    if vocab:   # the same saved args on every rank: every rank stops
        raise StartupError(vocab)
    for chunk, sd in zip(model, model_state["model"]):
        integration.load_model_state_dict(chunk, sd)   # PaRO engine: into its shard directly
    del model_state
    if load_optim and "optimizer" in state:
        checkpoint_torch_format.load_optimizer_state(optimizer, state["optimizer"])
        return state, True
    return state, False
