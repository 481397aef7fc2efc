#!/usr/bin/env python3
"""Export a checkpoint written by ``pretrain_gpt.py`` to a Hugging Face ``transformers`` directory.

    python tools/checkpoint/convert_to_hf.py --load runs/sdp4bit/gpt-125m-baseline/checkpoints \\
        --output hf/gpt-125m
    python tools/checkpoint/convert_to_hf.py --load runs/loco/llama-0.8b-loco/checkpoints \\
        --output hf/llama-0.8b --tokenizer-dir data/llama2-tokenizer

The result loads with ``AutoModelForCausalLM.from_pretrained(output)``.  The architecture is picked
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
* The Llama layout with ``--add-qkv-bias --disable-bias-linear`` (biases on q/k/v only) ->
  ``Qwen2ForCausalLM``; ``--use-rope-scaling`` -> Llama 3.x ``rope_type: llama3``.
* The Llama layout with ``--num-experts`` (no biases, an MoE MLP in every layer, softmax
  routing without ``--moe-router-pre-softmax``, no shared expert) -> ``MixtralForCausalLM``:
  ``mlp.router.weight`` -> ``block_sparse_moe.gate.weight``, each expert's SwiGLU
  ``linear_fc1`` -> ``w1`` (gate) / ``w3`` (up), ``linear_fc2`` -> ``w2``;
  ``num_local_experts``, ``num_experts_per_tok`` = ``--moe-router-topk``, ``intermediate_size``
  = ``--moe-ffn-hidden-size``, ``router_aux_loss_coef`` = ``--moe-aux-loss-coeff``.  A
  ``torch_dist`` checkpoint exports whatever ``--expert-model-parallel-size`` trained it (its
  experts are stored globally); a ``torch`` one only at expert-parallel size 1.

Anything else (e.g. RMSNorm with learned positions, ``--rotary-percent`` < 1, virtual pipeline
chunks, QK layernorm) is refused with the flag that prevents it.

Checkpoint formats (see ``megatron/training/checkpoint/save_load.py``), both read from ``--load`` (the
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
digests written at save, see ``megatron/training/checkpoint/integrity.py``): a damaged file is
refused naming it and the previous complete checkpoint (``--iteration N``);
``--no-verify-checkpoint`` skips the check.  An unreadable ``.pt`` is one error naming the file.

Vocabulary: the embedding and output layer have ``args.padded_vocab_size`` rows
(``--make-vocab-size-divisible-by`` x TP).  By default all of them are exported and the HF config's
``vocab_size`` is the padded size (the extra ids are never produced by the tokenizer), except
for runs with ``--mask-padded-vocab-logits`` (imported HF models, see convert_from_hf.py), whose
padding rows are dropped again (the export has the model's own vocabulary);
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
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the saved args unpickle megatron.distributed.quant classes
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tools.checkpoint.hf_state_dict import (  # noqa: E402
    DTYPES, HF_MODEL_FILES, architecture, gelu_flavour, hf_config, split_qkv, to_hf)
from tools.checkpoint.megatron_checkpoint_reader import (  # noqa: E402
    TRACKER, ConversionError, load_megatron_checkpoint, merge_tensor_parallel,
    resolve_iteration_dir)

__all__ = ["ConversionError", "TRACKER", "DTYPES", "resolve_iteration_dir", "merge_tensor_parallel",
           "load_megatron_checkpoint", "split_qkv", "architecture", "gelu_flavour", "to_hf",
           "hf_config", "install_tokenizer", "convert", "build_parser", "main"]


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
            if os.path.isfile(src) and not HF_MODEL_FILES.match(name):
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
            # The very tokenizer the trainer built (megatron/training/data/tokenizer.py), wrapped.
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
    from transformers import GPT2Config, LlamaConfig, MixtralConfig, Qwen2Config

    if os.path.isdir(output) and any(HF_MODEL_FILES.match(n) for n in os.listdir(output)) \
            and not force:
        raise ConversionError(f"--output {output} already holds a model; pass --force to "
                              "overwrite")
    args, sd, info = load_megatron_checkpoint(load, iteration, verify=verify)
    log(f" read {info['format']} checkpoint {info['path']} (iteration {info['iteration']}, "
        f"TP={getattr(args, 'tensor_model_parallel_size', 1)}, "
        f"PP={getattr(args, 'pipeline_model_parallel_size', 1)}): {len(sd)} tensors, "
        + ("files verified against manifest.json" if info["verified"] else
           "files not verified (--no-verify-checkpoint)" if not verify else
           "files not verified (the checkpoint has no manifest.json)"))
    arch, hf_sd = to_hf(args, sd, vocab_size)
    emb = hf_sd.get("model.embed_tokens.weight", hf_sd.get("transformer.wte.weight"))
    config_kwargs = hf_config(arch, args, int(emb.shape[0]))
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
    config_cls = {"gpt2": GPT2Config, "llama": LlamaConfig, "qwen2": Qwen2Config,
                  "mixtral": MixtralConfig}[arch]
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
               "vocab": ("trimmed (--vocab-size)" if vocab_size is not None else
                         "padding rows dropped (--mask-padded-vocab-logits)")
               if config_kwargs["vocab_size"] < padded else "padded rows kept",
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
