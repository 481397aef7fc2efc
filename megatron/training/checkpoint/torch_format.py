"""The ``torch`` checkpoint format: one ``torch.save`` file per rank, read back into the same
parallel layout only.

Layout of one iteration folder: ``mp_rank_{tp:02d}_{pp:03d}_dp_{dp:03d}.pt`` per rank, holding
the optimizer state (for the distributed optimizer this rank's shard via megatron-core's
``dp_reshardable`` parameter state -- no communication, works on gloo CPU; for the PaRO engine
its fp32 master shard, Adam moments and step), the scheduler, RNG and quantization state,
iteration and consumed samples.  The model weights are identical over data-parallel ranks, so
only DP rank 0 of each (TP, PP) stores them (PaRO strategies that partition parameters gather
them first); with expert parallelism the first DP rank of each EP rank, DP rank = EP rank.

Why a module of its own: this is what the format writes and reads, and what it cannot do --
load into another TP/PP/DP layout, bucket padding or gradient bucketing -- named field by field
(:func:`_check_same_layout`).  What to load and when the ranks agree is decided elsewhere
(:mod:`.discovery`, :mod:`.save_load`).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.distributed.quant import integration

from megatron.training.checkpoint import integrity as checkpoint_integrity
from megatron.training.checkpoint.discovery import LoadTarget
from megatron.training.checkpoint.integrity import FileDigest
from megatron.training.errors import StartupError
from megatron.training.model.layer_specs import attention_layout_diff


def rank_filename() -> str:
    """This rank's file: its optimizer shard, RNG and quantization state (and, on DP rank 0,
    the weights)."""
    from megatron.core import parallel_state as ps

    return (f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}_"
            f"{ps.get_pipeline_model_parallel_rank():03d}_dp_{ps.get_data_parallel_rank():03d}.pt")


def _holds_weights() -> bool:
    """This rank writes its chunk's weights: DP rank 0 of its (TP, PP) rank, or with expert
    parallelism the expert-DP rank 0 of every EP rank (each holds other experts)."""
    from megatron.core import parallel_state as ps

    if ps.get_expert_model_parallel_world_size() > 1:
        return ps.get_expert_data_parallel_rank() == 0
    return ps.get_data_parallel_rank() == 0


def _weights_dp_rank() -> int:
    """The DP rank whose file holds this rank's weights: 0, or with expert parallelism the EP
    rank (megatron-core takes EP fastest out of the DP ranks: expert-DP rank 0 of EP rank e is
    DP rank e)."""
    from megatron.core import parallel_state as ps

    if ps.get_expert_model_parallel_world_size() > 1:
        return ps.get_expert_model_parallel_rank()
    return 0


def model_filename() -> str:
    """The file of this rank's (TP, PP[, EP]) rank that holds the weights."""
    from megatron.core import parallel_state as ps

    return (f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}_"
            f"{ps.get_pipeline_model_parallel_rank():03d}_dp_{_weights_dp_rank():03d}.pt")


def sub_optimizers(optimizer: Any) -> List[Any]:
    """The leaf optimizers of ``optimizer`` (a chained optimizer's, or itself); the
    ``torch_dist`` load walks them too."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _optimizer_state(optimizer: Any) -> List[Dict[str, Any]]:
    """Per sub-optimizer: common state + (distributed optimizer) this rank's shard."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    out = []
    for opt in sub_optimizers(optimizer):
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


def load_optimizer_state(optimizer: Any, states: List[Dict[str, Any]]) -> None:
    from megatron.distributed.mcore_compat.optimizer import (optimizer_bucket_layout,
                                                                   saved_bucket_layout)

    subs = sub_optimizers(optimizer)
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
        unalias_step_tensors(opt)


def unalias_step_tensors(opt: Any) -> None:
    """Give every parameter its own Adam ``step`` tensor again (after a load in either format).

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


def save_rank_file(directory: str, args: argparse.Namespace, model: List[torch.nn.Module],
                   optimizer: Any, common: Dict[str, Any],
                   per_rank: Dict[str, Any]) -> List[FileDigest]:
    """Write this rank's file into ``directory``; returns its digest (for the manifest)."""
    from megatron.core import parallel_state as ps

    state = {**common, **per_rank}
    keep = _holds_weights()
    if keep and ps.get_data_parallel_rank() != _weights_dp_rank():
        raise RuntimeError(f"DP rank {ps.get_data_parallel_rank()} holds the weights of EP rank "
                           f"{_weights_dp_rank()}: megatron-core's expert rank order changed")
    model_sd = _model_state_dicts(model, keep=keep)
    if keep:
        state["model"] = model_sd
    if not args.no_save_optim:
        state["optimizer"] = _optimizer_state(optimizer)
    return [checkpoint_integrity.save_torch(state, os.path.join(directory, rank_filename()),
                                            directory)]


def read_rank_files(target: LoadTarget, args: argparse.Namespace
                    ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(this rank's state, the state holding its (TP, PP) rank's weights), or StartupError."""
    ckpt = target.directory
    own_path = os.path.join(ckpt, rank_filename())
    any_path = os.path.join(ckpt, model_filename())
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
                       ("--paro-strategy", "paro_strategy"),
                       ("--num-experts", "num_experts"),
                       ("--expert-model-parallel-size", "expert_model_parallel_size")):
        default = 1 if name == "expert_model_parallel_size" else None  # saved before MoE
        old, new = getattr(saved, name, default), getattr(args, name, default)
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
