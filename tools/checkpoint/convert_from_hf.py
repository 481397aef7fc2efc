#!/usr/bin/env python3
"""Import a Hugging Face ``transformers`` causal LM into a checkpoint ``pretrain_gpt.py`` loads.

    python tools/checkpoint/convert_from_hf.py --hf-dir hf/llama --save ckpt/llama-imported \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    torchrun --nproc-per-node 4 pretrain_gpt.py --model-args-file ckpt/llama-imported/model_args.txt \\
        --load ckpt/llama-imported --finetune --save ckpt/llama-continued \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 ...

The counterpart of ``convert_to_hf.py``; both use the one name table of
:mod:`tools.checkpoint.hf_state_dict`.  Families (``config.json``'s ``model_type``):

* ``gpt2`` -> LayerNorm, learned positions, GELU (``--openai-gelu`` for ``gelu_new``), biases.
* ``llama`` (Llama 2/3/3.1/3.2) -> ``--normalization RMSNorm --swiglu --position-embedding-type
  rope --rotary-base <rope_theta>``; ``rope_type: llama3`` -> ``--use-rope-scaling
  --rope-scaling-factor <factor>`` (megatron-core 0.16.1 fixes ``low_freq_factor`` 1,
  ``high_freq_factor`` 4 and ``original_max_position_embeddings`` 8192: other values, and other
  rope types, are refused naming the field); ``attention_bias`` with ``mlp_bias`` ->
  biases (one without the other is refused).
* ``mistral`` -> the Llama flags; a ``sliding_window`` shorter than ``--seq-length`` is refused
  (megatron-core attends over the whole sequence).
* ``qwen2`` -> the Llama flags plus ``--add-qkv-bias --disable-bias-linear``.
* ``mixtral`` -> the Llama flags (a ``sliding_window`` as for Mistral) plus ``--num-experts
  <num_local_experts> --moe-router-topk <num_experts_per_tok> --moe-ffn-hidden-size
  <intermediate_size> --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff
  <router_aux_loss_coef>`` (``router_jitter_noise`` -> ``--moe-input-jitter-eps``; megatron-core
  jitters the router's input only).  Mixtral's router (softmax over all experts, top k,
  renormalised) is megatron-core's default (top k of the logits, softmax over those k; no
  ``--moe-router-pre-softmax``): the same function.  The experts are written at
  expert-parallel size 1 (``--expert-model-parallel-size`` > 1 is refused here): a
  ``--ckpt-format torch_dist`` checkpoint then loads at any ``--expert-model-parallel-size``
  (torch_dist reshards the experts); ``torch`` only at 1.  At TP > 1 the writers run with
  ``--sequence-parallel`` (megatron-core's MoE layer needs it; so does training at TP > 1) and,
  on gloo, the allgather dispatcher (no weights: the checkpoint is the same; training at
  TP > 1 on CPU needs ``--moe-token-dispatcher-type allgather`` too).

Multi-, grouped- (``--group-query-attention --num-query-groups``) and single-KV-head attention,
``head_dim`` (``--kv-channels``), tied and untied embeddings.

How the checkpoint is written: by the trainer itself.  The derived flags first pass the
trainer's argument validation here (a layout it refuses stops the import naming the flag), then
``TP x PP`` gloo processes on this machine each parse them, build the model with the
trainer's builders (``get_model``), copy their shard of the HF weights in (the TP split is the
inverse of the merge rules of ``megatron_checkpoint_reader``) and call the trainer's
``save_checkpoint`` at iteration 0, without optimizer or RNG state; a converted HF tensor no
rank's model takes is refused by name, never dropped.  So ``--load SAVE`` (with
``--finetune``, or as is) starts at iteration 0 with the HF weights.  ``--ckpt-format torch_dist`` (default) reshards on load (any
DP size, another TP/PP); ``torch`` loads only into the same TP/PP and data-parallel size 1.

Vocabulary: ``config.vocab_size`` rows padded as the trainer pads them
(``--make-vocab-size-divisible-by`` x TP); the padding rows are zeros and
``--mask-padded-vocab-logits`` (written to model_args.txt when there are any) sets their logits
to -inf, so the loss is HF's.  Loading at another TP needs the same padded size: the checkpoint's
saved args record it, and a load that pads otherwise is refused naming
``--make-vocab-size-divisible-by`` and ``--tensor-model-parallel-size`` with their import values.

Written next to the checkpoint: ``model_args.txt`` (the model and tokenizer flags, one per line,
for ``pretrain_gpt.py --model-args-file``; values given on the command line win, switches in
the file stay on), ``tokenizer/`` (the HF tokenizer files, for ``--tokenizer-type HuggingFaceTokenizer``; without any: NullTokenizer) and
``convert_from_hf.json`` (what was converted).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from megatron.training.model.rope_scaling import MCORE_LLAMA3_FIXED  # noqa: E402
from tools.checkpoint.hf_state_dict import DTYPES, HF_MODEL_FILES, Shape, from_hf  # noqa: E402
from tools.checkpoint.megatron_checkpoint_reader import (  # noqa: E402
    TRACKER, ConversionError, split_tensor_parallel)

__all__ = ["ImportPlan", "plan_import", "read_hf_state_dict", "convert", "build_parser", "main"]

_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


@dataclass(frozen=True)
class ImportPlan:
    """What an HF config becomes: the family, the trainer's model flags and the shapes."""
    family: str
    model_flags: Tuple[str, ...]
    num_layers: int
    shape: Shape
    vocab_size: int
    linear_bias: bool
    qkv_bias: bool
    tied: bool
    num_experts: int = 0


# ----------------------------------------------------------------------------- config -> flags
def _rope(config: Any) -> Tuple[float, Dict[str, Any]]:
    """(rope_theta, rope scaling dict or {}) for transformers 4 (rope_theta/rope_scaling) and 5
    (rope_parameters)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
        theta = params.pop("rope_theta", getattr(config, "rope_theta", 10000.0))
        return float(theta), params
    return float(getattr(config, "rope_theta", 10000.0)), dict(getattr(config, "rope_scaling",
                                                                       None) or {})


def _rope_flags(config: Any) -> List[str]:
    theta, scaling = _rope(config)
    if theta != int(theta):
        raise ConversionError(f"rope_theta {theta}: --rotary-base takes an integer")
    flags = ["--rotary-base", str(int(theta))]
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if kind == "default":
        return flags
    if kind != "llama3":
        raise ConversionError(f"rope_scaling rope_type {kind!r}: megatron-core 0.16.1 supports "
                              "only the llama3 scaling (--use-rope-scaling)")
    for key, fixed in MCORE_LLAMA3_FIXED.items():
        value = scaling.get(key)
        if value is None or float(value) != fixed:
            raise ConversionError(f"rope_scaling {key} = {value}: megatron-core 0.16.1's llama3 "
                                  f"RoPE scaling fixes it to {fixed:g}")
    return flags + ["--use-rope-scaling", "--rope-scaling-factor", repr(float(scaling["factor"]))]


def _moe_flags(config: Any) -> List[str]:
    """Mixtral's MoE fields -> the trainer's MoE flags (megatron-core's default router: top k
    of the logits, softmax over the k = Mixtral's softmax, top k, renormalised)."""
    experts, topk = int(config.num_local_experts), int(config.num_experts_per_tok)
    if not 1 <= topk <= experts:
        raise ConversionError(f"num_experts_per_tok {topk} must be in 1..num_local_experts "
                              f"{experts}")
    flags = ["--num-experts", str(experts), "--moe-router-topk", str(topk),
             "--moe-ffn-hidden-size", str(config.intermediate_size),
             "--moe-token-dispatcher-type", "alltoall",
             "--moe-aux-loss-coeff", repr(float(getattr(config, "router_aux_loss_coef", 0.0)
                                                or 0.0))]
    jitter = float(getattr(config, "router_jitter_noise", 0.0) or 0.0)
    if jitter > 0:
        flags += ["--moe-input-jitter-eps", repr(jitter)]
    return flags


def plan_import(config: Any, seq_length: int) -> ImportPlan:
    """The trainer's model flags for an HF config (``transformers`` config object), or a
    ConversionError naming the config field the trainer cannot express."""
    model_type = getattr(config, "model_type", None)
    tied = bool(getattr(config, "tie_word_embeddings", model_type == "gpt2"))
    flags: List[str] = []
    if model_type == "gpt2":
        heads, hidden = int(config.n_head), int(config.n_embd)
        shape = Shape(heads, heads, hidden // heads)
        act = config.activation_function
        if act not in ("gelu", *_TANH_GELUS):
            raise ConversionError(f"activation_function {act!r}: GPT-2 imports with gelu or "
                                  f"{'/'.join(_TANH_GELUS)}")
        if not getattr(config, "scale_attn_weights", True):
            raise ConversionError("scale_attn_weights false: megatron-core always scales "
                                  "attention by 1/sqrt(head_dim)")
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            raise ConversionError("scale_attn_by_inverse_layer_idx: not supported")
        if seq_length > config.n_positions:
            raise ConversionError(f"--seq-length {seq_length} > n_positions {config.n_positions}")
        flags += ["--num-layers", str(config.n_layer), "--hidden-size", str(hidden),
                  "--num-attention-heads", str(heads),
                  "--ffn-hidden-size", str(config.n_inner or 4 * hidden),
                  "--max-position-embeddings", str(config.n_positions),
                  "--position-embedding-type", "learned_absolute", "--normalization", "LayerNorm",
                  "--norm-epsilon", repr(float(config.layer_norm_epsilon)),
                  "--hidden-dropout", repr(float(config.resid_pdrop)),
                  "--attention-dropout", repr(float(config.attn_pdrop))]
        if act in _TANH_GELUS:
            flags.append("--openai-gelu")
        plan = dict(family="gpt2", num_layers=int(config.n_layer), shape=shape, linear_bias=True,
                    qkv_bias=False)
    elif model_type in ("llama", "mistral", "qwen2", "mixtral"):
        heads, hidden = int(config.num_attention_heads), int(config.hidden_size)
        groups = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        if heads % groups:
            raise ConversionError(f"num_attention_heads {heads} is not a multiple of "
                                  f"num_key_value_heads {groups}")
        if config.hidden_act != "silu":
            raise ConversionError(f"hidden_act {config.hidden_act!r}: only silu (SwiGLU) imports")
        linear_bias, qkv_bias = False, False
        if model_type == "llama":
            attention_bias = bool(getattr(config, "attention_bias", False))
            mlp_bias = bool(getattr(config, "mlp_bias", False))
            if attention_bias != mlp_bias:
                raise ConversionError(f"attention_bias {attention_bias} with mlp_bias {mlp_bias}: "
                                      "--add-bias-linear gives biases to all linear layers or "
                                      "none")
            linear_bias = attention_bias
        elif model_type == "qwen2":
            qkv_bias = True
        window = getattr(config, "sliding_window", None)
        uses_window = (model_type in ("mistral", "mixtral")
                       or getattr(config, "use_sliding_window", False))
        if uses_window and window is not None and int(window) < seq_length:
            raise ConversionError(f"sliding_window {window} is shorter than --seq-length "
                                  f"{seq_length}: megatron-core attends over the whole sequence "
                                  f"(import with --seq-length {window} or less)")
        shape = Shape(heads, groups, head_dim)
        flags += ["--num-layers", str(config.num_hidden_layers), "--hidden-size", str(hidden),
                  "--num-attention-heads", str(heads), "--kv-channels", str(head_dim),
                  "--ffn-hidden-size", str(config.intermediate_size),
                  "--max-position-embeddings", str(config.max_position_embeddings),
                  "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                  "--norm-epsilon", repr(float(config.rms_norm_eps)),
                  "--hidden-dropout", "0.0",
                  "--attention-dropout", repr(float(getattr(config, "attention_dropout", 0.0)))]
        flags += _rope_flags(config)
        if groups != heads:
            flags += ["--group-query-attention", "--num-query-groups", str(groups)]
        if not linear_bias:
            flags.append("--disable-bias-linear")
        if qkv_bias:
            flags.append("--add-qkv-bias")
        plan = dict(family="qwen2" if model_type == "qwen2" else "llama",
                    num_layers=int(config.num_hidden_layers), shape=shape,
                    linear_bias=linear_bias, qkv_bias=qkv_bias)
        if model_type == "mixtral":
            flags += _moe_flags(config)
            plan.update(family="mixtral", num_experts=int(config.num_local_experts))
    else:
        raise ConversionError(f"model_type {model_type!r}: imports gpt2, llama, mistral, qwen2 "
                              "and mixtral")
    if not tied:
        flags.append("--untie-embeddings-and-output-weights")
    if getattr(config, "initializer_range", None) is not None:
        flags += ["--init-method-std", repr(float(config.initializer_range))]
    return ImportPlan(model_flags=tuple(flags), vocab_size=int(config.vocab_size), tied=tied,
                      **plan)


# ----------------------------------------------------------------------------- weights
def read_hf_state_dict(hf_dir: str) -> Dict[str, torch.Tensor]:
    """Every tensor of the HF directory (safetensors or PyTorch ``.bin``, sharded or not)."""
    d = Path(hf_dir)
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = d / index_name
        files = ([d / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
                 if index.is_file() else [d / single] if (d / single).is_file() else [])
        if files:
            sd: Dict[str, torch.Tensor] = {}
            for f in files:
                if f.suffix == ".safetensors":
                    from safetensors.torch import load_file

                    sd.update(load_file(str(f)))
                else:
                    sd.update(torch.load(str(f), map_location="cpu", weights_only=True))
            return sd
    raise ConversionError(f"--hf-dir {hf_dir}: no model.safetensors(.index.json) or "
                          "pytorch_model.bin(.index.json)")


def _normalize_hf_names(family: str, sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """GPT2Model checkpoints (the original ``gpt2``) name tensors without ``transformer.``;
    Mixtral in transformers >= 5's in-memory layout (``mlp.gate.weight``,
    ``mlp.experts.gate_up_proj`` [E, 2I, H] = [w1; w3] per expert, ``mlp.experts.down_proj``
    [E, H, I]) -> the checkpoint names (``block_sparse_moe.gate.weight``,
    ``block_sparse_moe.experts.E.w1/w2/w3.weight``) that ``save_pretrained`` writes."""
    if family == "gpt2" and "transformer.wte.weight" not in sd and "wte.weight" in sd:
        return {(k if k.startswith("lm_head.") else "transformer." + k): v for k, v in sd.items()}
    if family == "mixtral":
        out: Dict[str, torch.Tensor] = {}
        for k, v in sd.items():
            m = re.match(r"(model\.layers\.\d+\.)mlp\.(gate\.weight|experts\.gate_up_proj|"
                         r"experts\.down_proj)$", k)
            if m is None:
                out[k] = v
            elif m.group(2) == "gate.weight":
                out[m.group(1) + "block_sparse_moe.gate.weight"] = v
            elif m.group(2) == "experts.down_proj":
                for e in range(v.shape[0]):
                    out[f"{m.group(1)}block_sparse_moe.experts.{e}.w2.weight"] = v[e]
            else:
                for e in range(v.shape[0]):
                    w1, w3 = v[e].chunk(2, dim=0)
                    out[f"{m.group(1)}block_sparse_moe.experts.{e}.w1.weight"] = w1
                    out[f"{m.group(1)}block_sparse_moe.experts.{e}.w3.weight"] = w3
        return out
    return sd


# ----------------------------------------------------------------------------- tokenizer
def install_tokenizer(src: Optional[str], dst: str, vocab_size: int,
                      log: Callable[[str], None]) -> Optional[int]:
    """Copy the HF tokenizer files of ``src`` into ``dst``; returns its length (None: none)."""
    if src is None or not os.path.isdir(src):
        return None
    names = [n for n in sorted(os.listdir(src))
             if os.path.isfile(os.path.join(src, n)) and not HF_MODEL_FILES.match(n)]
    if not any(n.startswith("tokenizer") or n in ("vocab.json", "merges.txt") for n in names):
        return None
    os.makedirs(dst, exist_ok=True)
    for n in names:
        shutil.copy2(os.path.join(src, n), os.path.join(dst, n))
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(dst, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 -- any loader failure is reported the same way
        raise ConversionError(f"the tokenizer files of {src} do not load with AutoTokenizer "
                              f"({type(exc).__name__}: {exc})") from None
    if len(tok) > vocab_size:
        raise ConversionError(f"the tokenizer of {src} has {len(tok)} tokens, more than the "
                              f"model's vocab_size {vocab_size}")
    log(f" tokenizer ({len(tok)} tokens) copied to {dst}: {', '.join(names)}")
    return len(tok)


# ----------------------------------------------------------------------------- per rank
def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel

    while not isinstance(module, GPTModel):
        module = module.module
    return module


def _copy_shard(gpt: torch.nn.Module, full: Dict[str, torch.Tensor], args: argparse.Namespace,
                tied: bool) -> Set[str]:
    """Copy this rank's shard of the full (TP = PP = 1) state dict into ``gpt``; returns the
    keys of ``full`` it took (:func:`refuse_unused` checks that the ranks took them all)."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    offset = ps.get_pipeline_model_parallel_rank() * (args.num_layers //
                                                      args.pipeline_model_parallel_size)
    used: Set[str] = set()
    with torch.no_grad():
        for key, param in gpt.named_parameters():
            m = re.match(r"decoder\.layers\.(\d+)\.(.+)$", key)
            global_key = f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else key
            if global_key == "output_layer.weight" and tied:
                global_key = "embedding.word_embeddings.weight"  # the last stage's tied copy
            src = full.get(global_key)
            if src is None:
                raise ConversionError(f"no HF weight for the model's {key} ({global_key})")
            used.add(global_key)
            if global_key in ("embedding.word_embeddings.weight", "output_layer.weight"):
                pad = args.padded_vocab_size - src.shape[0]
                src = torch.cat([src, src.new_zeros(pad, *src.shape[1:])]) if pad > 0 else src
            shard = split_tensor_parallel(global_key, src, tp, tp_rank, args.swiglu)
            if tuple(shard.shape) != tuple(param.shape):
                raise ConversionError(f"{key}: HF gives {tuple(shard.shape)}, the model has "
                                      f"{tuple(param.shape)}")
            param.copy_(shard)
    return used


def refuse_unused(full: Dict[str, torch.Tensor], used_by_rank: List[Set[str]]) -> None:
    """ConversionError naming the converted HF tensors no rank's model took: a weight the
    trainer's model has no parameter for would otherwise be dropped from the checkpoint."""
    used = set().union(*used_by_rank)
    unused = sorted(k for k in full if k not in used)
    if unused:
        raise ConversionError(
            f"{len(unused)} HF tensor(s) have no parameter in the trainer's model and would be "
            f"dropped: {', '.join(unused[:6])}{' ...' if len(unused) > 6 else ''} (the model "
            "flags in model_args.txt do not describe the HF model)")


def _rank_main(local_rank: int, world: int, port: int, argv: List[str], weights: str,
               vocab: int, tied: bool) -> None:
    """One gloo process: the trainer's model with its shard of the weights, then its save."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(world))
    from megatron.training.logging_utils import quiet_library_warnings

    quiet_library_warnings(local_rank)
    from megatron.training.arguments import parse_args
    from megatron.training.arguments.parser import padded_vocab_size
    from megatron.training.checkpoint.save_load import save_checkpoint
    from megatron.training.components import get_model
    from megatron.training.initialize import initialize_megatron
    from megatron.training.model.config_builders import build_transformer_config

    args = parse_args(argv)
    initialize_megatron(args)
    try:
        args.model_vocab_size = vocab
        args.padded_vocab_size = padded_vocab_size(vocab, args)
        model = get_model(args, build_transformer_config(args), args.padded_vocab_size)
        full = torch.load(weights, map_location="cpu", mmap=True, weights_only=True)
        used = _copy_shard(_unwrap(model[0]), full, args, tied)
        everyone: List[Any] = [None] * world
        torch.distributed.all_gather_object(everyone, used)
        refuse_unused(full, everyone)   # the same on every rank: all stop alike
        del full
        save_checkpoint(args, 0, model, None, None, {})
        torch.distributed.barrier()
    finally:
        # after a failure no barrier: leaving closes the connections, so the peers' pending
        # collective fails too instead of waiting
        torch.distributed.destroy_process_group()


def check_trainer_flags(argv: List[str], world: int) -> None:
    """ConversionError with the trainer's own message when ``argv`` (the writers' flags, in a
    world of ``world`` ranks) does not pass its argument validation."""
    import contextlib
    import io

    from megatron.training.arguments import parse_args

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_args(argv)
    except SystemExit:
        lines = err.getvalue().strip().splitlines() or ["invalid flags"]
        raise ConversionError(f"the trainer refuses this import: "
                              f"{lines[-1].split('error: ', 1)[-1]}") from None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------- import
def convert(hf_dir: str, save: str, tensor_parallel: int = 1, pipeline_parallel: int = 1,
            ckpt_format: str = "torch_dist", seq_length: Optional[int] = None,
            dtype: str = "fp32", make_vocab_size_divisible_by: int = 128,
            tokenizer_dir: Optional[str] = None, force: bool = False,
            log: Callable[[str], None] = print, expert_parallel: int = 1) -> Dict[str, Any]:
    """Import; returns a summary dict (also written to ``save/convert_from_hf.json``)."""
    from transformers import AutoConfig

    from megatron.training.arguments.parser import padded_vocab_size

    if expert_parallel != 1:
        raise ConversionError(f"--expert-model-parallel-size {expert_parallel}: the import writes "
                              "the experts at expert-parallel size 1; a --ckpt-format torch_dist "
                              "checkpoint loads at any --expert-model-parallel-size")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ConversionError(f"--hf-dir {hf_dir}: no config.json")
    if os.path.exists(os.path.join(save, TRACKER)) and not force:
        raise ConversionError(f"--save {save} already holds a checkpoint; pass --force to "
                              "overwrite")
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype}: choose {', '.join(DTYPES)}")
    config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    max_positions = int(getattr(config, "max_position_embeddings", None)
                        or getattr(config, "n_positions", 2048))
    seq_length = int(seq_length or min(max_positions, 4096))
    plan = plan_import(config, seq_length)
    padded = padded_vocab_size(plan.vocab_size, argparse.Namespace(
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        tensor_model_parallel_size=tensor_parallel))
    vocab_flags = ["--make-vocab-size-divisible-by", str(make_vocab_size_divisible_by)]
    if padded > plan.vocab_size:
        vocab_flags.append("--mask-padded-vocab-logits")
    writer_flags = [
        "--tensor-model-parallel-size", str(tensor_parallel),
        "--pipeline-model-parallel-size", str(pipeline_parallel), "--device", "cpu",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
        "--lr", "0.0", "--mock-data", "--save", os.path.abspath(save), "--ckpt-format",
        ckpt_format, "--no-save-optim", "--no-save-rng", "--seed", "1234"]
    if dtype != "fp32":
        writer_flags.append(f"--{dtype}")
    if plan.num_experts and tensor_parallel > 1:
        # megatron-core's MoE layer at TP > 1 needs sequence parallelism; the writers run on
        # gloo, where the alltoall dispatcher cannot at TP > 1 (the dispatcher holds no weights)
        writer_flags += ["--sequence-parallel", "--moe-token-dispatcher-type", "allgather"]
    # the trainer's own validation, once, before anything is read or written: a layout it
    # refuses (e.g. layers not dividing over PP) is its one line naming the flag, not
    # a failure inside every writer process
    check_trainer_flags([*plan.model_flags, "--seq-length", str(seq_length), *vocab_flags,
                         "--tokenizer-type", "NullTokenizer", "--vocab-size",
                         str(plan.vocab_size), *writer_flags], tensor_parallel * pipeline_parallel)
    hf_sd = _normalize_hf_names(plan.family, read_hf_state_dict(hf_dir))
    full = from_hf(plan.family, hf_sd, plan.num_layers, plan.shape, plan.linear_bias,
                   plan.qkv_bias, plan.tied, plan.num_experts)
    emb = full["embedding.word_embeddings.weight"]
    if emb.shape[0] != plan.vocab_size:
        raise ConversionError(f"the HF embedding has {emb.shape[0]} rows but config.json's "
                              f"vocab_size is {plan.vocab_size}")
    full = {k: v.to(DTYPES[dtype]).contiguous() for k, v in full.items()}
    del hf_sd

    save = os.path.abspath(save)
    os.makedirs(save, exist_ok=True)
    tok_dst = os.path.join(save, "tokenizer")
    if os.path.isdir(tok_dst):
        shutil.rmtree(tok_dst)
    tok_len = install_tokenizer(tokenizer_dir or hf_dir, tok_dst, plan.vocab_size, log)
    if tok_len is None:
        tokenizer_flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size",
                           str(plan.vocab_size)]
        log(" no tokenizer files found: model_args.txt names NullTokenizer (pass --tokenizer-dir)")
    else:
        tokenizer_flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok_dst]
        if tok_len < plan.vocab_size:  # more embedding rows than tokens (e.g. Qwen2)
            tokenizer_flags += ["--vocab-size", str(plan.vocab_size)]
    model_args = [*plan.model_flags, "--seq-length", str(seq_length), *vocab_flags,
                  *tokenizer_flags]

    world = tensor_parallel * pipeline_parallel
    run_argv = model_args + writer_flags
    log(f" {plan.family}: {plan.num_layers} layers, {plan.shape.heads} heads / "
        f"{plan.shape.groups} KV heads x {plan.shape.head_dim}"
        f"{f', {plan.num_experts} experts' if plan.num_experts else ''}, "
        f"vocab {plan.vocab_size} -> "
        f"{padded} rows; writing {ckpt_format} at TP={tensor_parallel} PP={pipeline_parallel}")
    with tempfile.TemporaryDirectory(prefix="convert_from_hf_", dir=save) as tmp:
        weights = os.path.join(tmp, "weights.pt")
        torch.save(full, weights)
        del full
        import multiprocessing

        import torch.multiprocessing as mp

        from megatron.training.initialize import free_port

        # A fork server imports torch and megatron-core once for all ranks (spawn: per rank).
        multiprocessing.get_context("forkserver").set_forkserver_preload(
            ["torch", "megatron.core"])
        try:
            mp.start_processes(_rank_main, args=(world, free_port(), run_argv, weights,
                                                 plan.vocab_size, plan.tied),
                               nprocs=world, join=True, start_method="forkserver")
        except mp.ProcessRaisedException as exc:
            last = str(exc).strip().splitlines()[-1]
            raise ConversionError(f"a writer process failed: {last}") from None
        except mp.ProcessExitedException as exc:
            raise ConversionError(f"a writer process exited: {exc}") from None

    with open(os.path.join(save, "model_args.txt"), "w", encoding="utf-8") as f:
        f.write(f"# pretrain_gpt.py --model-args-file: the architecture of {hf_dir} "
                f"({plan.family}).\n# Values given on the command line win; switches in "
                "this file stay on.\n")
        i = 0
        while i < len(model_args):  # a flag and its value(s) on one line
            j = i + 1
            while j < len(model_args) and not model_args[j].startswith("--"):
                j += 1
            f.write(" ".join(shlex.quote(a) for a in model_args[i:j]) + "\n")
            i = j
    summary = {"hf_dir": os.path.abspath(hf_dir), "family": plan.family,
               "model_type": config.model_type, "vocab_size": plan.vocab_size,
               "padded_vocab_size": padded,
               "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
               "tensor_model_parallel_size": tensor_parallel,
               "pipeline_model_parallel_size": pipeline_parallel, "ckpt_format": ckpt_format,
               "dtype": dtype, "seq_length": seq_length, "tokenizer": tok_len is not None,
               "num_experts": plan.num_experts, "expert_model_parallel_size": 1,
               "model_args": model_args}
    with open(os.path.join(save, "convert_from_hf.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    log(f" wrote {save} (iteration 0) and {os.path.join(save, 'model_args.txt')}")
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--hf-dir", required=True, help="HF model directory (config.json + weights)")
    p.add_argument("--save", required=True, help="checkpoint directory to write (--load of "
                   "pretrain_gpt.py)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="MoE (Mixtral): only 1 -- the experts are written at expert-parallel "
                        "size 1; a torch_dist checkpoint resumes at any "
                        "--expert-model-parallel-size (torch_dist reshards the experts)")
    p.add_argument("--ckpt-format", choices=("torch", "torch_dist"), default="torch_dist",
                   help="torch_dist (default): loads at any DP/TP/PP (and EP for MoE); torch: "
                        "the same TP/PP, DP 1, EP 1")
    p.add_argument("--seq-length", type=int, default=None,
                   help="training sequence length (default min(max_position_embeddings, 4096)); "
                        "checked against a sliding window")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                   help="weights' dtype in the checkpoint (bf16/fp16 also build the model so)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="vocabulary padding, as pretrain_gpt.py's flag (x TP)")
    p.add_argument("--tokenizer-dir", default=None,
                   help="HF tokenizer directory (default: --hf-dir's tokenizer files)")
    p.add_argument("--force", action="store_true", help="overwrite a checkpoint in --save")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    from megatron.training.logging_utils import quiet_library_warnings

    quiet_library_warnings(0)
    try:
        convert(a.hf_dir, a.save, a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                a.ckpt_format, a.seq_length, a.dtype, a.make_vocab_size_divisible_by,
                a.tokenizer_dir, a.force, expert_parallel=a.expert_model_parallel_size)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
