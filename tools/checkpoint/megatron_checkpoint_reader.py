"""Reading a pretrain_gpt.py checkpoint for export (tools/checkpoint/convert_to_hf.py): which
iteration ``--load`` names, the per-rank torch format or torch_dist, verified against its
manifest, tensor-parallel shards merged into one state dict of the whole model.

Why its own module: reading is what any exporter needs; the HF layouts
(:mod:`tools.checkpoint.hf_state_dict`) and the CLI (:mod:`tools.checkpoint.convert_to_hf`) build
on it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import tempfile
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from megatron.training.checkpoint import integrity as checkpoint_integrity
from megatron.training.model.layer_specs import canonical_layer_key

TRACKER = "latest_checkpointed_iteration.txt"


class ConversionError(ValueError):
    """The checkpoint cannot be exported; the message says why and which flag decides it."""



# ----------------------------------------------------------------------------- locate + read
def resolve_iteration_dir(load: str, iteration: Optional[int]) -> Tuple[str, Optional[int]]:
    """``--load`` root (+ tracker or ``--iteration``) or an ``iter_N`` directory -> (dir, N)."""
    load = os.path.abspath(load)
    if os.path.isfile(load):
        raise ConversionError(f"--load {load} is a file, not a checkpoint directory: pass the "
                              "--save directory of a run or one of its iter_NNNNNNN folders")
    if not os.path.isdir(load):
        raise ConversionError(f"--load {load}: no such directory")
    if _is_iteration_dir(load) and not os.path.isfile(os.path.join(load, TRACKER)):
        if iteration is not None:
            raise ConversionError(f"--load {load} is already an iteration directory; drop "
                                  f"--iteration {iteration} or pass the checkpoint root")
        m = re.match(r"iter_(\d+)$", os.path.basename(load))
        return load, int(m.group(1)) if m else None
    if iteration is None:
        tracker = os.path.join(load, TRACKER)
        if not os.path.isfile(tracker):
            found = sorted(n for n in os.listdir(load) if n.startswith("iter_"))
            raise ConversionError(f"--load {load} has no {TRACKER}"
                                  + (f"; pass --iteration N (found {', '.join(found[-3:])})"
                                     if found else " and no iter_* directory: not a checkpoint "
                                     "written by pretrain_gpt.py --save"))
        text = open(tracker, encoding="utf-8").read().strip()
        if text == "release":
            return os.path.join(load, "release"), None
        try:
            iteration = int(text)
        except ValueError:
            raise ConversionError(f"corrupt tracker {tracker}: {text!r}") from None
    path = os.path.join(load, f"iter_{iteration:07d}")
    if not os.path.isdir(path):
        raise ConversionError(f"--load {load}: iteration {iteration} has no directory {path}")
    return path, iteration


def _is_iteration_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "metadata.json")) or any(
        n.startswith("mp_rank_") for n in os.listdir(path))


def checkpoint_format(path: str) -> str:
    return "torch_dist" if os.path.isfile(os.path.join(path, "metadata.json")) else "torch"


def _torch_load(path: str) -> Dict[str, Any]:
    try:  # mmap: the optimizer state in the same file is never read into memory
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except RuntimeError:  # legacy (non-zip) serialization -- or a damaged file
        try:
            return checkpoint_integrity.torch_load(path, os.path.dirname(path), _iteration_flag,
                                                   map_location="cpu", weights_only=False)
        except checkpoint_integrity.CheckpointIntegrityError as exc:
            raise ConversionError(str(exc)) from None


def _iteration_flag(iteration: int) -> str:
    return f"--iteration {iteration}"


def _read_by_converter(fmt: str) -> Callable[[str], bool]:
    """The files this tool reads (only these are verified): the DP-rank-0 files of the torch
    format (the weights); everything of torch_dist but the per-rank RNG/quantization files."""
    if fmt == "torch":
        return lambda name: re.fullmatch(r"mp_rank_\d+_\d+_dp_000\.pt", name) is not None
    return lambda name: not name.startswith("rank_state/")


def verify_checkpoint(path: str, fmt: str, by_folder: bool = False) -> bool:
    """Check the files the export reads against the checkpoint's manifest; ConversionError
    naming a damaged file and the previous complete checkpoint.  False when the checkpoint has
    no manifest (written before manifests existed): nothing to check against."""
    root = os.path.dirname(path)
    load_flag = ((lambda m: f"--load {os.path.join(root, f'iter_{m:07d}')}") if by_folder
                 else _iteration_flag)
    try:
        manifest = checkpoint_integrity.require_manifest(path, load_flag)
        if manifest is None:
            return False
        found = checkpoint_integrity.verify(path, manifest, select=_read_by_converter(fmt))
    except checkpoint_integrity.CheckpointIntegrityError as exc:
        raise ConversionError(str(exc)) from None
    if found is not None:
        raise ConversionError(checkpoint_integrity.damaged(path, *found, load_flag))
    return True


def _as_namespace(args: Any) -> argparse.Namespace:
    """Saved args: a Namespace (torch format) or a plain dict with dtypes as strings (torch_dist)."""
    if args is None:
        raise ConversionError("the checkpoint has no 'args': cannot tell the architecture")
    ns = argparse.Namespace(**(vars(args) if isinstance(args, argparse.Namespace) else dict(args)))
    dtype = getattr(ns, "params_dtype", None)
    if isinstance(dtype, str):
        ns.params_dtype = {"torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}.get(
            dtype, torch.float32)
    elif dtype is None:
        ns.params_dtype = torch.bfloat16 if getattr(ns, "bf16", False) else (
            torch.float16 if getattr(ns, "fp16", False) else torch.float32)
    return ns


def _clean_chunk(sd: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Tensors of one model chunk: ``_extra_state`` dropped, a Float16Module ``module.`` prefix
    removed, fused layernorm names mapped to ``input_layernorm`` / ``pre_mlp_layernorm``."""
    out: Dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key.endswith("_extra_state") or not torch.is_tensor(value):
            continue
        if key.startswith("module."):
            key = key[len("module."):]
        m = re.match(r"decoder\.layers\.(\d+)\.(.+)$", key)
        if m:
            key = f"decoder.layers.{m.group(1)}.{canonical_layer_key(m.group(2))}"
        out[key] = value
    return out


def _merge_rule(key: str, swiglu: bool) -> str:
    """How the TP shards of ``key`` (canonical name) combine: cat0 | cat1 | glu | same.
    MoE: the router is replicated; each expert's MLP is split like the dense MLP (expert TP =
    --tensor-model-parallel-size)."""
    if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "cat0"
    if key.endswith(".mlp.router.weight"):
        return "same"
    key = re.sub(r"\.mlp\.experts\.local_experts\.\d+\.(linear_fc[12]\.(weight|bias))$",
                 r".mlp.\1", key)
    if key in ("embedding.position_embeddings.weight", "decoder.final_layernorm.weight",
               "decoder.final_layernorm.bias") or \
            re.search(r"\.(input|pre_mlp)_layernorm\.(weight|bias)$", key):
        return "same"
    for suffix, rule in ((".self_attention.linear_qkv.weight", "cat0"),
                         (".self_attention.linear_qkv.bias", "cat0"),
                         (".self_attention.linear_proj.weight", "cat1"),
                         (".self_attention.linear_proj.bias", "same"),
                         (".mlp.linear_fc1.weight", "glu" if swiglu else "cat0"),
                         (".mlp.linear_fc1.bias", "glu" if swiglu else "cat0"),
                         (".mlp.linear_fc2.weight", "cat1"),
                         (".mlp.linear_fc2.bias", "same")):
        if key.endswith(suffix):
            return rule
    raise ConversionError(f"tensor {key!r} is not part of the GPT-2 / Llama / Mixtral layouts "
                          "this tool exports (e.g. QK layernorm, a shared expert): cannot merge "
                          "its tensor-parallel shards")


def merge_tensor_parallel(key: str, shards: List[torch.Tensor], swiglu: bool) -> torch.Tensor:
    """One tensor from its TP shards (in TP-rank order), in the TP = 1 layout."""
    if len(shards) == 1:
        return shards[0]
    rule = _merge_rule(key, swiglu)
    if rule == "same":
        return shards[0]
    if rule == "cat1":
        return torch.cat(shards, dim=1)
    if rule == "glu":  # each shard is [its gate rows; its up rows]
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0)


def split_tensor_parallel(key: str, full: torch.Tensor, tp: int, rank: int,
                          swiglu: bool) -> torch.Tensor:
    """TP rank ``rank``'s shard of ``full`` (TP = 1 layout): the inverse of
    :func:`merge_tensor_parallel`, by the same rules."""
    if tp == 1:
        return full
    rule = _merge_rule(key, swiglu)
    if rule == "same":
        return full
    dim = 1 if rule == "cat1" else 0
    if full.shape[dim] % tp:
        raise ConversionError(f"{key}: {full.shape[dim]} rows/columns do not split over "
                              f"--tensor-model-parallel-size {tp}")
    if rule == "glu":  # each shard is [its gate rows; its up rows]
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    return full.chunk(tp, dim=dim)[rank]


def read_torch_format(path: str) -> Tuple[argparse.Namespace, Dict[str, torch.Tensor]]:
    """``mp_rank_{tp}_{pp}_dp_000.pt`` files -> (args, full TP=1/PP=1 state dict)."""
    first = os.path.join(path, "mp_rank_00_000_dp_000.pt")
    if not os.path.isfile(first):
        found = sorted(n for n in os.listdir(path) if n.endswith(".pt"))[:4]
        raise ConversionError(f"{path}: no mp_rank_00_000_dp_000.pt (a --ckpt-format torch "
                              f"checkpoint of pretrain_gpt.py); found {found or 'no .pt files'}")
    state = _torch_load(first)
    args = _as_namespace(state.get("args"))
    tp = int(getattr(args, "tensor_model_parallel_size", 1))
    pp = int(getattr(args, "pipeline_model_parallel_size", 1))
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    if ep > 1:
        raise ConversionError(f"{path} was written with --expert-model-parallel-size {ep} in "
                              "--ckpt-format torch: each expert-parallel rank's file holds its "
                              "own experts; export a --ckpt-format torch_dist checkpoint (any "
                              "expert-parallel size) or one written at --expert-model-parallel-"
                              "size 1")
    layers_per_stage = args.num_layers // pp
    swiglu = bool(getattr(args, "swiglu", False))
    full: Dict[str, torch.Tensor] = {}
    for pp_rank in range(pp):
        shards: List[Dict[str, torch.Tensor]] = []
        for tp_rank in range(tp):
            name = os.path.join(path, f"mp_rank_{tp_rank:02d}_{pp_rank:03d}_dp_000.pt")
            if not os.path.isfile(name):
                raise ConversionError(f"{name} is missing: the checkpoint was written with "
                                      f"--tensor-model-parallel-size {tp} "
                                      f"--pipeline-model-parallel-size {pp} and is incomplete")
            st = state if (tp_rank, pp_rank) == (0, 0) else _torch_load(name)
            chunks = st.get("model")
            if not chunks:
                raise ConversionError(f"{name} holds no model weights")
            if len(chunks) != 1:
                raise ConversionError(f"{name} holds {len(chunks)} model chunks (virtual "
                                      "pipeline parallelism): not supported")
            shards.append(_clean_chunk(chunks[0]))
        keys = list(shards[0])
        for tp_rank, sd in enumerate(shards[1:], 1):
            if set(sd) != set(keys):
                raise ConversionError(f"TP rank {tp_rank} of stage {pp_rank} has other tensors "
                                      f"than TP rank 0: {sorted(set(sd) ^ set(keys))[:4]}")
        for key in keys:
            merged = merge_tensor_parallel(key, [sd[key] for sd in shards], swiglu)
            m = re.match(r"decoder\.layers\.(\d+)\.(.+)$", key)
            if m:  # stage-local layer index -> global
                local = int(m.group(1))
                if local >= layers_per_stage:
                    raise ConversionError(f"stage {pp_rank} has layer {local} but "
                                          f"{layers_per_stage} layers per stage")
                key = f"decoder.layers.{pp_rank * layers_per_stage + local}.{m.group(2)}"
            elif key in full:
                raise ConversionError(f"{key} is on more than one pipeline stage")
            full[key] = merged
    return args, full


class _SingleProcessGroup:
    """A one-rank gloo group for megatron-core's dist_checkpointing (unless one exists)."""

    def __enter__(self) -> "_SingleProcessGroup":
        self.created = not torch.distributed.is_initialized()
        if self.created:
            self.tmp = tempfile.mkdtemp(prefix="convert_to_hf_")
            store = torch.distributed.FileStore(os.path.join(self.tmp, "store"), 1)
            torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.created:
            torch.distributed.destroy_process_group()
            shutil.rmtree(self.tmp, ignore_errors=True)


def read_torch_dist_format(path: str) -> Tuple[argparse.Namespace, Dict[str, torch.Tensor]]:
    """megatron-core dist_checkpointing directory -> (args, full TP=1/PP=1 state dict)."""
    from megatron.core import dist_checkpointing

    with _SingleProcessGroup():
        common = dist_checkpointing.load_common_state_dict(path)
        args = _as_namespace(common.get("args"))
        metadata = dist_checkpointing.load_tensors_metadata(path)
        model_md = {k: v for k, v in metadata.items()
                    if k.startswith(("embedding.", "decoder.", "output_layer."))}
        if not model_md:
            raise ConversionError(f"{path}: no model tensors in the checkpoint "
                                  f"(found {sorted(metadata)[:4]})")
        with warnings.catch_warnings():  # torch DCP deprecation notices addressed to mcore
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            loaded = dist_checkpointing.load(model_md, path, validate_access_integrity=False)
    full: Dict[str, torch.Tensor] = {}
    for key in model_md:
        value = loaded[key]
        m = re.match(r"decoder\.layers\.(.+)$", key)
        if m:  # stacked over layers: [num_layers, ...]
            if value.shape[0] != args.num_layers:
                raise ConversionError(f"{key}: leading dim {value.shape[0]} != --num-layers "
                                      f"{args.num_layers}")
            # megatron-core's SequentialMLP saves its experts under mlp.experts.experts.*,
            # stacked over the global experts (any expert-parallel size): [layers, experts, ...]
            # (or mlp.experts.experts.E.* with singleton local shards)
            e = re.match(r"(mlp\.experts)\.experts\.(?:(\d+)\.)?(.+)$", m.group(1))
            for i in range(args.num_layers):
                if e and e.group(2) is not None:
                    full[f"decoder.layers.{i}.{e.group(1)}.local_experts.{e.group(2)}."
                         f"{e.group(3)}"] = value[i]
                elif e:
                    for j in range(value.shape[1]):
                        full[f"decoder.layers.{i}.{e.group(1)}.local_experts.{j}."
                             f"{e.group(3)}"] = value[i][j]
                else:
                    full[f"decoder.layers.{i}.{canonical_layer_key(m.group(1))}"] = value[i]
        else:
            full[key] = value
    return args, full


def load_megatron_checkpoint(load: str, iteration: Optional[int] = None, verify: bool = True
                             ) -> Tuple[argparse.Namespace, Dict[str, torch.Tensor], Dict[str, Any]]:
    """(args, full model state dict in the TP=1/PP=1 layout, info about the source).

    ``verify``: check the files against the manifest first (``info["verified"]`` says whether
    there was one)."""
    path, it = resolve_iteration_dir(load, iteration)
    fmt = checkpoint_format(path)
    verified = verify and verify_checkpoint(path, fmt,
                                            by_folder=path == os.path.abspath(load))
    args, sd = read_torch_dist_format(path) if fmt == "torch_dist" else read_torch_format(path)
    return args, sd, {"path": path, "iteration": it, "format": fmt, "verified": verified}
