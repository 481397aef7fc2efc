#!/usr/bin/env python3
"""Export a checkpoint written by ``pretrain_gpt.py`` to a Hugging Face ``transformers`` directory.

    python tools/checkpoint/convert_to_hf.py --load runs/sdp4bit/gpt-125m-baseline/checkpoints \\
        --output hf/gpt-125m
    python tools/checkpoint/convert_to_hf.py --load runs/loco/llama-0.8b-loco/checkpoints \\
        --output hf/llama-0.8b --tokenizer-dir data/llama2-tokenizer

The result loads with ``AutoModelForCausalLM.from_pretrained(output)``.  Two architectures, picked
from the flags the checkpoint was trained with (its saved ``args``):

* GPT recipes (``examples/sdp4bit``: LayerNorm, ``--position-embedding-type learned_absolute``,
  GELU MLP) -> ``GPT2LMHeadModel``.  Linear biases are exported (zeros with
  ``--disable-bias-linear``); tied or untied (``--untie-embeddings-and-output-weights``) output
  weights.  The GELU is the exact (erf) one, except for checkpoints trained on CUDA with biases,
  where megatron-core's fused bias-GELU (the tanh approximation) ran: ``gelu_new`` then.
* LoCo recipes (``examples/loco``: ``--normalization RMSNorm --swiglu --position-embedding-type
  rope``, usually ``--untie-embeddings-and-output-weights --disable-bias-linear``) ->
  ``LlamaForCausalLM`` with ``rope_theta = --rotary-base``, ``rms_norm_eps = --layernorm-epsilon``;
  grouped-query attention (Megatron-LM's ``--group-query-attention --num-query-groups``, when the
  saved args carry them) -> ``num_key_value_heads``.

Anything else (e.g. RMSNorm with learned positions, ``--rotary-percent`` < 1, virtual pipeline
chunks, QK layernorm) is refused with the flag that prevents it.

Checkpoint formats (see ``megatron/training/checkpointing.py``), both read from ``--load`` (the
``--save`` root: the tracker ``latest_checkpointed_iteration.txt`` picks the iteration unless
``--iteration N``; an ``iter_NNNNNNN`` directory itself is accepted too):

* ``--ckpt-format torch``: ``iter_N/mp_rank_{tp:02d}_{pp:03d}_dp_000.pt``.  Tensor- and
  pipeline-parallel shards are merged: vocabulary / column-parallel weights (embedding, output
  layer, ``linear_qkv``, ``linear_fc1``) along dim 0 -- SwiGLU's ``linear_fc1`` shard by shard as
  [gate; up] halves --, row-parallel weights (``linear_proj``, ``linear_fc2``) along dim 1,
  the rest replicated; pipeline stage p holds layers ``p*L/PP ... (p+1)*L/PP - 1``.
* ``--ckpt-format torch_dist``: megatron-core ``dist_checkpointing``; the model tensors (not the
  optimizer's) are read with its ``load`` in their global shape -- whatever TP/PP wrote them,
  the layout is that of TP = PP = 1 (layers stacked along a leading axis).  It needs a process
  group: a single-process gloo group is created for the read (file store, no port) and
  destroyed afterwards.

Layouts handled: megatron-core's fused QKV (``linear_qkv.weight`` is, per query group,
[the group's query heads, its key head, its value head], i.e. ``[ng, nq/ng + 2, head_dim, hidden]``)
split into q / k / v; fused layernorm names (``linear_qkv.layer_norm_weight`` /
``linear_fc1.layer_norm_weight``, TE spec and torch_dist) and the local spec's
``input_layernorm`` / ``pre_mlp_layernorm`` alike.

Integrity: the files read are first checked against the checkpoint's ``manifest.json`` (sizes and
digests written at save, see ``megatron/training/checkpoint_integrity.py``): a damaged file is
refused naming it and the previous complete checkpoint (``--iteration N``);
``--no-verify-checkpoint`` skips the check.  An unreadable ``.pt`` is one error naming the file.

Vocabulary: the embedding and output layer have ``args.padded_vocab_size`` rows
(``--make-vocab-size-divisible-by`` x TP).  By default all of them are exported and the HF config's
``vocab_size`` is the padded size (the extra ids are never produced by the tokenizer);
``--vocab-size N`` trims to the first N rows (the tokenizer's size).

Dtype: ``--dtype auto`` (default) keeps the trained parameters' dtype (bf16 for ``--bf16``: the
weights the model computed with, no rounding); ``fp32`` / ``bf16`` / ``fp16`` convert.

Tokenizer: ``--tokenizer-dir DIR`` copies the tokenizer files of a HF tokenizer directory; without
it the checkpoint's own tokenizer is saved when its files still exist (``GPT2BPETokenizer``:
``--vocab-file`` + ``--merge-file``; ``HuggingFaceTokenizer``: ``--tokenizer-model`` directory);
``--no-tokenizer`` skips both.  The config's eos/bos ids come from that tokenizer (NullTokenizer:
its EOD id, ``--vocab-size`` - 1).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the saved args unpickle megatron.distributed.quant classes
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from megatron.training import checkpoint_integrity  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|gguf|ckpt)$|^config\.json$|"
                           r"^generation_config\.json$|.*\.index\.json$")


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


_FUSED_NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def _canonical_layer_key(rest: str) -> str:
    return _FUSED_NORM_NAMES.get(rest, rest)


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
            key = f"decoder.layers.{m.group(1)}.{_canonical_layer_key(m.group(2))}"
        out[key] = value
    return out


def _merge_rule(key: str, swiglu: bool) -> str:
    """How the TP shards of ``key`` (canonical name) combine: cat0 | cat1 | glu | same."""
    if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "cat0"
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
    raise ConversionError(f"tensor {key!r} is not part of the GPT-2 / Llama layouts this tool "
                          "exports (e.g. QK layernorm, MoE): cannot merge its tensor-parallel "
                          "shards")


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
            for i in range(args.num_layers):
                full[f"decoder.layers.{i}.{_canonical_layer_key(m.group(1))}"] = value[i]
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


# ----------------------------------------------------------------------------- architecture
def split_qkv(w: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron-core's fused ``linear_qkv`` weight or bias -> (q, k, v) in head order.

    Rows are grouped per query group g: [q heads of g (nq/ng of them), k head g, v head g], each
    ``head_dim`` rows: shape ``[ng * (nq/ng + 2) * head_dim, ...]``."""
    per_group = num_heads // num_groups
    rest = tuple(w.shape[1:])
    expected = num_groups * (per_group + 2) * head_dim
    if w.shape[0] != expected:
        raise ConversionError(f"linear_qkv has {w.shape[0]} rows, expected {expected} = "
                              f"{num_groups} groups x ({per_group} + 2) heads x {head_dim}")
    x = w.reshape(num_groups, per_group + 2, head_dim, *rest)
    q = x[:, :per_group].reshape(num_heads * head_dim, *rest)
    k = x[:, per_group].reshape(num_groups * head_dim, *rest)
    v = x[:, per_group + 1].reshape(num_groups * head_dim, *rest)
    return q, k, v


def _attention_shape(args: argparse.Namespace) -> Tuple[int, int, int]:
    heads = args.num_attention_heads
    # Megatron-LM's rule: --num-query-groups counts only with --group-query-attention (its
    # default, 1, is stored in every checkpoint's args).
    groups = int(args.num_query_groups) if getattr(args, "group_query_attention", False) else heads
    head_dim = getattr(args, "kv_channels", None) or args.hidden_size // heads
    if heads % groups:
        raise ConversionError(f"--num-attention-heads {heads} is not a multiple of "
                              f"--num-query-groups {groups}")
    return heads, groups, int(head_dim)


def architecture(args: argparse.Namespace) -> str:
    """'gpt2' or 'llama' from the training flags, else a ConversionError naming the flags."""
    norm = getattr(args, "normalization", "LayerNorm")
    pos = getattr(args, "position_embedding_type", "learned_absolute")
    swiglu = bool(getattr(args, "swiglu", False))
    if getattr(args, "qk_layernorm", False):
        raise ConversionError("--qk-layernorm has no GPT-2 / Llama equivalent")
    if pos == "learned_absolute":
        if norm != "LayerNorm" or swiglu:
            raise ConversionError(
                f"--position-embedding-type learned_absolute exports as GPT-2, which needs "
                f"--normalization LayerNorm and no --swiglu (got --normalization {norm}"
                f"{' --swiglu' if swiglu else ''})")
        return "gpt2"
    if pos == "rope":
        if norm != "RMSNorm" or not swiglu:
            raise ConversionError(
                f"--position-embedding-type rope exports as Llama, which needs --normalization "
                f"RMSNorm and --swiglu (got --normalization {norm}"
                f"{' --swiglu' if swiglu else ', no --swiglu'})")
        rotary_percent = float(getattr(args, "rotary_percent", 1.0))
        if rotary_percent != 1.0:
            raise ConversionError(f"--rotary-percent {rotary_percent}: Llama rotates the whole "
                                  "head; only --rotary-percent 1.0 exports")
        if getattr(args, "rotary_interleaved", False):
            raise ConversionError("--rotary-interleaved: HF Llama uses the non-interleaved "
                                  "(rotate-half) RoPE")
        return "llama"
    raise ConversionError(f"--position-embedding-type {pos} is not supported")


def gelu_flavour(args: argparse.Namespace) -> str:
    """HF activation matching what training ran: megatron-core's fused bias-GELU (tanh
    approximation) when the fusion resolver turned it on for the saved arguments (CUDA, a bias,
    no ``--no-bias-gelu-fusion``), else torch's exact GELU."""
    from megatron.training.fusions import resolve_fusions

    saved = argparse.Namespace(**vars(args))
    saved.device = getattr(args, "device", "cuda")   # checkpoints before --device: GPU runs
    saved.apply_rope_fusion_explicit = False         # TE's; not the activation's business
    plan = resolve_fusions(saved, uses_te_spec=False, local_attention=False,
                           have=lambda module: False)   # the bias-GELU needs no package
    return "gelu_new" if plan.bias_activation_fusion else "gelu"


class _Taker:
    """Hands out tensors of the Megatron state dict once; ``left()`` lists the unused ones."""

    def __init__(self, sd: Dict[str, torch.Tensor]) -> None:
        self.sd, self.used = sd, set()

    def __call__(self, key: str, required: bool = True) -> Optional[torch.Tensor]:
        if key not in self.sd:
            if required:
                raise ConversionError(f"the checkpoint has no tensor {key!r}")
            return None
        self.used.add(key)
        return self.sd[key]

    def bias_or_zeros(self, key: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The bias ``key``, or zeros of length ``n`` where the model was trained without one
        (``--disable-bias-linear``) but the HF layout has a bias slot."""
        b = self(key, required=False)
        return b if b is not None else torch.zeros(n, dtype=dtype)

    def left(self) -> List[str]:
        return sorted(set(self.sd) - self.used)


def _vocab_rows(t: torch.Tensor, vocab: int) -> torch.Tensor:
    return t[:vocab]


def _common(args: argparse.Namespace, sd: Dict[str, torch.Tensor], vocab_size: Optional[int]
            ) -> Tuple[_Taker, int, bool, torch.Tensor, Optional[torch.Tensor]]:
    take = _Taker(sd)
    emb = take("embedding.word_embeddings.weight")
    padded = emb.shape[0]
    vocab = padded if vocab_size is None else int(vocab_size)
    if not 0 < vocab <= padded:
        raise ConversionError(f"--vocab-size {vocab}: must be in 1..{padded} (the checkpoint's "
                              f"padded vocabulary)")
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    out = None
    if tied:
        copy = take("output_layer.weight", required=False)
        if copy is not None and not torch.equal(copy, emb):  # PP > 1: the last stage's copy
            warnings.warn("tied embeddings: the last pipeline stage's output_layer.weight "
                          "differs from the word embeddings; the word embeddings are exported")
    else:
        out = _vocab_rows(take("output_layer.weight"), vocab)
    return take, vocab, tied, _vocab_rows(emb, vocab), out


def to_gpt2(args: argparse.Namespace, sd: Dict[str, torch.Tensor],
            vocab_size: Optional[int] = None) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """(GPT2Config kwargs, GPT2LMHeadModel state dict)."""
    heads, groups, head_dim = _attention_shape(args)
    h = args.hidden_size
    if groups != heads:
        raise ConversionError(f"GPT-2 has no grouped-query attention (--num-query-groups {groups})")
    if head_dim * heads != h:
        raise ConversionError(f"GPT-2 needs --kv-channels = hidden/heads ({h // heads}), got "
                              f"{head_dim}")
    take, vocab, tied, emb, out = _common(args, sd, vocab_size)
    ffn = args.ffn_hidden_size
    hf: Dict[str, torch.Tensor] = {"transformer.wte.weight": emb,
                                   "transformer.wpe.weight": take("embedding.position_embeddings.weight")}

    def bias(key: str, n: int) -> torch.Tensor:
        return take.bias_or_zeros(key, n, emb.dtype)

    for i in range(args.num_layers):
        p, o = f"decoder.layers.{i}.", f"transformer.h.{i}."
        hf[o + "ln_1.weight"] = take(p + "input_layernorm.weight")
        hf[o + "ln_1.bias"] = take(p + "input_layernorm.bias")
        q, k, v = split_qkv(take(p + "self_attention.linear_qkv.weight"), heads, groups, head_dim)
        hf[o + "attn.c_attn.weight"] = torch.cat([q, k, v], 0).t()  # Conv1D: [in, out]
        qkv_b = take(p + "self_attention.linear_qkv.bias", required=False)
        hf[o + "attn.c_attn.bias"] = (torch.cat(split_qkv(qkv_b, heads, groups, head_dim), 0)
                                      if qkv_b is not None else torch.zeros(3 * h, dtype=emb.dtype))
        hf[o + "attn.c_proj.weight"] = take(p + "self_attention.linear_proj.weight").t()
        hf[o + "attn.c_proj.bias"] = bias(p + "self_attention.linear_proj.bias", h)
        hf[o + "ln_2.weight"] = take(p + "pre_mlp_layernorm.weight")
        hf[o + "ln_2.bias"] = take(p + "pre_mlp_layernorm.bias")
        hf[o + "mlp.c_fc.weight"] = take(p + "mlp.linear_fc1.weight").t()
        hf[o + "mlp.c_fc.bias"] = bias(p + "mlp.linear_fc1.bias", ffn)
        hf[o + "mlp.c_proj.weight"] = take(p + "mlp.linear_fc2.weight").t()
        hf[o + "mlp.c_proj.bias"] = bias(p + "mlp.linear_fc2.bias", h)
    hf["transformer.ln_f.weight"] = take("decoder.final_layernorm.weight")
    hf["transformer.ln_f.bias"] = take("decoder.final_layernorm.bias")
    if out is not None:
        hf["lm_head.weight"] = out
    _no_leftovers(take)
    dropout = float(getattr(args, "hidden_dropout", 0.1))
    config = dict(architectures=["GPT2LMHeadModel"], vocab_size=vocab,
                  n_positions=args.max_position_embeddings, n_embd=h, n_layer=args.num_layers,
                  n_head=heads, n_inner=ffn, activation_function=gelu_flavour(args),
                  resid_pdrop=dropout, embd_pdrop=dropout,
                  attn_pdrop=float(getattr(args, "attention_dropout", 0.1)),
                  layer_norm_epsilon=float(args.layernorm_epsilon),
                  initializer_range=float(getattr(args, "init_method_std", 0.02)),
                  scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                  reorder_and_upcast_attn=False, tie_word_embeddings=tied)
    return config, hf


def to_llama(args: argparse.Namespace, sd: Dict[str, torch.Tensor],
             vocab_size: Optional[int] = None) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """(LlamaConfig kwargs, LlamaForCausalLM state dict)."""
    heads, groups, head_dim = _attention_shape(args)
    take, vocab, tied, emb, out = _common(args, sd, vocab_size)
    ffn = args.ffn_hidden_size
    bias_linear = bool(getattr(args, "add_bias_linear", True))
    hf: Dict[str, torch.Tensor] = {"model.embed_tokens.weight": emb}

    def bias_or_zeros(key: str, n: int) -> torch.Tensor:
        return take.bias_or_zeros(key, n, emb.dtype)

    for i in range(args.num_layers):
        p, o = f"decoder.layers.{i}.", f"model.layers.{i}."
        hf[o + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        q, k, v = split_qkv(take(p + "self_attention.linear_qkv.weight"), heads, groups, head_dim)
        hf[o + "self_attn.q_proj.weight"] = q
        hf[o + "self_attn.k_proj.weight"] = k
        hf[o + "self_attn.v_proj.weight"] = v
        hf[o + "self_attn.o_proj.weight"] = take(p + "self_attention.linear_proj.weight")
        hf[o + "post_attention_layernorm.weight"] = take(p + "pre_mlp_layernorm.weight")
        gate, up = take(p + "mlp.linear_fc1.weight").chunk(2, dim=0)  # megatron-core: [gate; up]
        hf[o + "mlp.gate_proj.weight"] = gate
        hf[o + "mlp.up_proj.weight"] = up
        hf[o + "mlp.down_proj.weight"] = take(p + "mlp.linear_fc2.weight")
        if bias_linear:
            qkv_b = take(p + "self_attention.linear_qkv.bias", required=False)
            if qkv_b is None:
                qkv_b = torch.zeros((heads + 2 * groups) * head_dim, dtype=emb.dtype)
            qb, kb, vb = split_qkv(qkv_b, heads, groups, head_dim)
            hf[o + "self_attn.q_proj.bias"] = qb
            hf[o + "self_attn.k_proj.bias"] = kb
            hf[o + "self_attn.v_proj.bias"] = vb
            hf[o + "self_attn.o_proj.bias"] = bias_or_zeros(p + "self_attention.linear_proj.bias",
                                                            args.hidden_size)
            gb, ub = bias_or_zeros(p + "mlp.linear_fc1.bias", 2 * ffn).chunk(2, dim=0)
            hf[o + "mlp.gate_proj.bias"] = gb
            hf[o + "mlp.up_proj.bias"] = ub
            hf[o + "mlp.down_proj.bias"] = bias_or_zeros(p + "mlp.linear_fc2.bias",
                                                         args.hidden_size)
    hf["model.norm.weight"] = take("decoder.final_layernorm.weight")
    if out is not None:
        hf["lm_head.weight"] = out
    _no_leftovers(take)
    config = dict(architectures=["LlamaForCausalLM"], vocab_size=vocab,
                  hidden_size=args.hidden_size, intermediate_size=ffn,
                  num_hidden_layers=args.num_layers, num_attention_heads=heads,
                  num_key_value_heads=groups, head_dim=head_dim, hidden_act="silu",
                  max_position_embeddings=args.max_position_embeddings,
                  rms_norm_eps=float(args.layernorm_epsilon),
                  rope_theta=float(getattr(args, "rotary_base", 10000)),
                  attention_bias=bias_linear, mlp_bias=bias_linear,
                  attention_dropout=float(getattr(args, "attention_dropout", 0.0)),
                  initializer_range=float(getattr(args, "init_method_std", 0.02)),
                  tie_word_embeddings=tied)
    return config, hf


def _no_leftovers(take: _Taker) -> None:
    left = take.left()
    if left:
        raise ConversionError(f"the checkpoint has tensors this export would drop: {left[:6]}"
                              f"{' ...' if len(left) > 6 else ''} (an architecture feature "
                              "GPT-2 / Llama cannot express)")


# ----------------------------------------------------------------------------- tokenizer
def install_tokenizer(args: argparse.Namespace, output: str, tokenizer_dir: Optional[str],
                       auto: bool, log: Callable[[str], None]) -> Optional[Any]:
    """Put a tokenizer into ``output``; returns the loaded HF tokenizer or None."""
    from transformers import AutoTokenizer

    if tokenizer_dir:
        if not os.path.isdir(tokenizer_dir):
            raise ConversionError(f"--tokenizer-dir {tokenizer_dir}: no such directory")
        copied = []
        for name in sorted(os.listdir(tokenizer_dir)):
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src) and not _WEIGHT_FILES.match(name):
                shutil.copy2(src, os.path.join(output, name))
                copied.append(name)
        log(f" tokenizer files copied from {tokenizer_dir}: {', '.join(copied) or '(none)'}")
        try:
            return AutoTokenizer.from_pretrained(output)
        except Exception as exc:  # noqa: BLE001 -- any loader failure is reported the same way
            raise ConversionError(f"--tokenizer-dir {tokenizer_dir}: AutoTokenizer cannot load the "
                                  f"copied files ({type(exc).__name__}: {exc})") from None
    if not auto:
        return None
    kind = getattr(args, "tokenizer_type", None)
    try:
        if kind == "GPT2BPETokenizer" and all(os.path.isfile(p or "") for p in
                                              (args.vocab_file, args.merge_file)):
            # The very tokenizer the trainer built (megatron/training/tokenizer.py), wrapped.
            from tokenizers import ByteLevelBPETokenizer
            from transformers import PreTrainedTokenizerFast

            bpe = ByteLevelBPETokenizer(args.vocab_file, args.merge_file, add_prefix_space=False)
            tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer,
                                          bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                          unk_token="<|endoftext|>")
        elif kind == "HuggingFaceTokenizer" and os.path.isdir(args.tokenizer_model or ""):
            tok = AutoTokenizer.from_pretrained(args.tokenizer_model)
        else:
            if kind not in (None, "NullTokenizer"):
                log(f" tokenizer not exported ({kind} files not found where training read them); "
                    "pass --tokenizer-dir")
            return None
    except Exception as exc:  # noqa: BLE001
        log(f" tokenizer not exported ({type(exc).__name__}: {exc}); pass --tokenizer-dir")
        return None
    tok.save_pretrained(output)
    log(f" tokenizer saved from the checkpoint's --tokenizer-type {kind}")
    return tok


def _special_ids(args: argparse.Namespace, tok: Any) -> Dict[str, Optional[int]]:
    if tok is not None:
        eos = tok.eos_token_id
        bos = tok.bos_token_id if tok.bos_token_id is not None else eos
        return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": tok.pad_token_id}
    if getattr(args, "tokenizer_type", None) == "NullTokenizer" and getattr(args, "vocab_size", None):
        eod = int(args.vocab_size) - 1  # NullTokenizer's EOD
        return {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": None}
    return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


# ----------------------------------------------------------------------------- export
def convert(load: str, output: str, iteration: Optional[int] = None, dtype: str = "auto",
            vocab_size: Optional[int] = None, tokenizer_dir: Optional[str] = None,
            auto_tokenizer: bool = True, force: bool = False, max_shard_size: str = "5GB",
            log: Callable[[str], None] = print, verify: bool = True) -> Dict[str, Any]:
    """Export; returns a summary dict (also written to ``output/megatron_export.json``)."""
    from huggingface_hub import save_torch_state_dict
    from transformers import GPT2Config, LlamaConfig

    if os.path.isdir(output) and any(_WEIGHT_FILES.match(n) for n in os.listdir(output)) \
            and not force:
        raise ConversionError(f"--output {output} already holds a model; pass --force to "
                              "overwrite")
    args, sd, info = load_megatron_checkpoint(load, iteration, verify=verify)
    arch = architecture(args)
    log(f" read {info['format']} checkpoint {info['path']} (iteration {info['iteration']}, "
        f"TP={getattr(args, 'tensor_model_parallel_size', 1)}, "
        f"PP={getattr(args, 'pipeline_model_parallel_size', 1)}): {len(sd)} tensors, "
        + ("files verified against manifest.json" if info["verified"] else
           "files not verified (--no-verify-checkpoint)" if not verify else
           "files not verified (the checkpoint has no manifest.json)"))
    config_kwargs, hf_sd = (to_gpt2 if arch == "gpt2" else to_llama)(args, sd, vocab_size)
    if dtype == "auto":
        target = args.params_dtype
    elif dtype in DTYPES:
        target = DTYPES[dtype]
    else:
        raise ConversionError(f"--dtype {dtype}: choose auto, {', '.join(DTYPES)}")
    # Own storage per tensor (q/k/v and gate/up are views of one fused tensor; safetensors
    # refuses shared storage), contiguous (transposed Conv1D weights).
    hf_sd = {k: v.detach().to(target, copy=True).contiguous() for k, v in hf_sd.items()}

    os.makedirs(output, exist_ok=True)
    for name in os.listdir(output):  # --force: no stale shards of an earlier export
        if name.endswith((".safetensors", ".safetensors.index.json")):
            os.remove(os.path.join(output, name))
    tok = install_tokenizer(args, output, tokenizer_dir, auto_tokenizer, log)
    if tok is not None and len(tok) > config_kwargs["vocab_size"]:
        raise ConversionError(f"the tokenizer has {len(tok)} tokens but the exported vocabulary "
                              f"{config_kwargs['vocab_size']} rows (--vocab-size too small, or "
                              "the wrong tokenizer)")
    config_kwargs.update(_special_ids(args, tok))
    config_cls = GPT2Config if arch == "gpt2" else LlamaConfig
    dtype_name = str(target).replace("torch.", "")
    # transformers >= 4.56 calls it dtype, older versions torch_dtype.
    dtype_key = "dtype" if "dtype" in inspect.signature(config_cls.__init__).parameters \
        else "torch_dtype"
    config = config_cls(**config_kwargs, **{dtype_key: dtype_name})
    config.save_pretrained(output)
    save_torch_state_dict(hf_sd, output, max_shard_size=max_shard_size)
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(output):  # safetensors writes 0600; the export is meant to be shared
        if name.endswith(".safetensors"):
            os.chmod(os.path.join(output, name), 0o666 & ~umask)
    padded = int(sd["embedding.word_embeddings.weight"].shape[0])
    summary = {"source": info["path"], "iteration": info["iteration"],
               "checkpoint_format": info["format"], "architecture": config.architectures[0],
               "dtype": dtype_name, "vocab_size": config_kwargs["vocab_size"],
               "padded_vocab_size": padded,
               "vocab": "trimmed (--vocab-size)" if config_kwargs["vocab_size"] < padded
               else "padded rows kept",
               "tensor_model_parallel_size": int(getattr(args, "tensor_model_parallel_size", 1)),
               "pipeline_model_parallel_size": int(getattr(args, "pipeline_model_parallel_size", 1)),
               "tokenizer": tok is not None}
    with open(os.path.join(output, "megatron_export.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    log(f" wrote {summary['architecture']} ({dtype_name}, vocab {summary['vocab_size']}, "
        f"{summary['vocab']}) to {output}")
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--load", required=True,
                   help="checkpoint root (pretrain_gpt.py --save DIR; the tracker file picks the "
                        "iteration) or one iter_NNNNNNN directory")
    p.add_argument("--iteration", type=int, default=None, help="iteration to export (default: "
                   "the tracker's)")
    p.add_argument("--output", required=True, help="directory for the HF model")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="weights' dtype (auto: the trained parameters', bf16 for --bf16)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="trim the padded vocabulary to N rows (the tokenizer's size); default: "
                        "keep args.padded_vocab_size rows")
    p.add_argument("--tokenizer-dir", default=None,
                   help="HF tokenizer directory whose files are copied into --output")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="do not export the checkpoint's own tokenizer")
    p.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    p.add_argument("--force", action="store_true", help="overwrite a model in --output")
    p.add_argument("--no-verify-checkpoint", dest="verify_checkpoint", action="store_false",
                   help="do not check the checkpoint's files against its manifest.json")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    from megatron.training.logging_utils import quiet_library_warnings

    quiet_library_warnings(0)  # megatron-core import notices once, as pretrain_gpt.py prints them
    try:
        convert(a.load, a.output, iteration=a.iteration, dtype=a.dtype, vocab_size=a.vocab_size,
                tokenizer_dir=a.tokenizer_dir, auto_tokenizer=not a.no_tokenizer, force=a.force,
                max_shard_size=a.max_shard_size, verify=a.verify_checkpoint)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
