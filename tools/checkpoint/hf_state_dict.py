"""Megatron <-> Hugging Face state dicts, both directions from one name table per family.

Families: ``gpt2`` (GPT2LMHeadModel), ``llama`` (LlamaForCausalLM; Mistral has the same tensors),
``qwen2`` (Qwen2ForCausalLM: Llama plus biases on q/k/v only) and ``mixtral``
(MixtralForCausalLM: Llama attention, a router and ``num_local_experts`` SwiGLU experts per
layer -- megatron-core's MoE layer with the sequential expert MLPs).  :data:`FAMILIES` lists, per
family, which megatron-core tensor is which HF tensor(s) and how they are laid out
(:class:`TensorMap`); :func:`to_hf` (tools/checkpoint/convert_to_hf.py) and :func:`from_hf`
(tools/checkpoint/convert_from_hf.py) walk the same table, so a name or a layout is written down
once.  Both check that no tensor is left over.
"""

from __future__ import annotations

import argparse
import re
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.training.model.rope_scaling import MCORE_LLAMA3_FIXED
from tools.checkpoint.megatron_checkpoint_reader import ConversionError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The --dtype choices of the HF converters, both ways."""

HF_MODEL_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|gguf|ckpt|msgpack|h5)$|^config\.json$|"
                            r"^generation_config\.json$|.*\.index\.json$")
"""The files of a HF model directory that are not its tokenizer (weights in any framework's
format, configs, shard indices): never copied as tokenizer files, both ways."""


# ----------------------------------------------------------------------------- layouts
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


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
             num_groups: int, head_dim: int) -> torch.Tensor:
    """The inverse of :func:`split_qkv`: (q, k, v) in head order -> the fused ``linear_qkv``."""
    per_group = num_heads // num_groups
    rest = tuple(q.shape[1:])
    for name, t, heads in (("q", q, num_heads), ("k", k, num_groups), ("v", v, num_groups)):
        if t.shape[0] != heads * head_dim:
            raise ConversionError(f"the {name} projection has {t.shape[0]} rows, expected "
                                  f"{heads} heads x {head_dim}")
    return torch.cat([q.reshape(num_groups, per_group, head_dim, *rest),
                      k.reshape(num_groups, 1, head_dim, *rest),
                      v.reshape(num_groups, 1, head_dim, *rest)], dim=1
                     ).reshape(num_groups * (per_group + 2) * head_dim, *rest)


@dataclass(frozen=True)
class Shape:
    """Attention shape: query heads, key/value groups, head size."""
    heads: int
    groups: int
    head_dim: int


@dataclass(frozen=True)
class TensorMap:
    """One megatron-core tensor and the HF tensor(s) it is.

    ``kind``: ``copy``; ``transpose`` (GPT-2's Conv1D stores [in, out]); ``qkv`` (fused
    ``linear_qkv`` <-> separate q, k, v); ``qkv_conv1d`` (GPT-2's fused ``c_attn``: [q | k | v]
    columns of a Conv1D weight, or the bias); ``glu`` (SwiGLU ``linear_fc1`` = [gate; up]).
    ``when``: which models have the tensor -- ``always``, ``linear_bias`` (all linear biases:
    ``--add-bias-linear``), ``qkv_bias`` (``--add-bias-linear`` or ``--add-qkv-bias``).
    ``zeros``: an HF bias slot that is zeros when the Megatron model has no bias (GPT-2 always
    has biases).  In a family's ``experts`` entries ``{e}`` is the expert's index (the same
    on both sides: conversion is at expert-parallel size 1, where local = global index)."""
    megatron: str
    hf: Tuple[str, ...]
    kind: str = "copy"
    when: str = "always"
    zeros: bool = False


def _m(megatron: str, *hf: str, kind: str = "copy", when: str = "always",
       zeros: bool = False) -> TensorMap:
    return TensorMap(megatron, tuple(hf), kind, when, zeros)


_LLAMA_LAYER = (
    _m("input_layernorm.weight", "input_layernorm.weight"),
    _m("self_attention.linear_qkv.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
       "self_attn.v_proj.weight", kind="qkv"),
    _m("self_attention.linear_qkv.bias", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
       "self_attn.v_proj.bias", kind="qkv", when="qkv_bias"),
    _m("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    _m("self_attention.linear_proj.bias", "self_attn.o_proj.bias", when="linear_bias"),
    _m("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    _m("mlp.linear_fc1.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", kind="glu"),
    _m("mlp.linear_fc1.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias", kind="glu",
       when="linear_bias"),
    _m("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
    _m("mlp.linear_fc2.bias", "mlp.down_proj.bias", when="linear_bias"),
)
_LLAMA_GLOBAL = (
    _m("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    _m("decoder.final_layernorm.weight", "model.norm.weight"),
)

# Mixtral: the Llama attention (no biases), the router (megatron-core's TopKRouter) and per
# expert SwiGLU's [w1 (gate); w3 (up)] fused in linear_fc1, w2 in linear_fc2, as in the Llama MLP.
_MIXTRAL_LAYER = tuple(tm for tm in _LLAMA_LAYER
                       if tm.when == "always" and not tm.megatron.startswith("mlp.")) + (
    _m("mlp.router.weight", "block_sparse_moe.gate.weight"),
)
_MIXTRAL_EXPERT = (
    _m("mlp.experts.local_experts.{e}.linear_fc1.weight", "block_sparse_moe.experts.{e}.w1.weight",
       "block_sparse_moe.experts.{e}.w3.weight", kind="glu"),
    _m("mlp.experts.local_experts.{e}.linear_fc2.weight", "block_sparse_moe.experts.{e}.w2.weight"),
)

FAMILIES: Dict[str, Dict[str, Any]] = {
    "gpt2": dict(
        hf_class="GPT2LMHeadModel", layer_prefix="transformer.h.{}.",
        layer=(
            _m("input_layernorm.weight", "ln_1.weight"),
            _m("input_layernorm.bias", "ln_1.bias"),
            _m("self_attention.linear_qkv.weight", "attn.c_attn.weight", kind="qkv_conv1d"),
            _m("self_attention.linear_qkv.bias", "attn.c_attn.bias", kind="qkv_conv1d",
               zeros=True),
            _m("self_attention.linear_proj.weight", "attn.c_proj.weight", kind="transpose"),
            _m("self_attention.linear_proj.bias", "attn.c_proj.bias", zeros=True),
            _m("pre_mlp_layernorm.weight", "ln_2.weight"),
            _m("pre_mlp_layernorm.bias", "ln_2.bias"),
            _m("mlp.linear_fc1.weight", "mlp.c_fc.weight", kind="transpose"),
            _m("mlp.linear_fc1.bias", "mlp.c_fc.bias", zeros=True),
            _m("mlp.linear_fc2.weight", "mlp.c_proj.weight", kind="transpose"),
            _m("mlp.linear_fc2.bias", "mlp.c_proj.bias", zeros=True),
        ),
        glob=(
            _m("embedding.word_embeddings.weight", "transformer.wte.weight"),
            _m("embedding.position_embeddings.weight", "transformer.wpe.weight"),
            _m("decoder.final_layernorm.weight", "transformer.ln_f.weight"),
            _m("decoder.final_layernorm.bias", "transformer.ln_f.bias"),
        )),
    "llama": dict(hf_class="LlamaForCausalLM", layer_prefix="model.layers.{}.",
                  layer=_LLAMA_LAYER, glob=_LLAMA_GLOBAL),
    "qwen2": dict(hf_class="Qwen2ForCausalLM", layer_prefix="model.layers.{}.",
                  layer=_LLAMA_LAYER, glob=_LLAMA_GLOBAL),
    "mixtral": dict(hf_class="MixtralForCausalLM", layer_prefix="model.layers.{}.",
                    layer=_MIXTRAL_LAYER, experts=_MIXTRAL_EXPERT, glob=_LLAMA_GLOBAL),
}
OUTPUT = _m("output_layer.weight", "lm_head.weight")


def _to_hf_tensors(tm: TensorMap, t: torch.Tensor, shape: Shape) -> List[torch.Tensor]:
    if tm.kind == "copy":
        return [t]
    if tm.kind == "transpose":
        return [t.t()]
    if tm.kind == "qkv":
        return list(split_qkv(t, shape.heads, shape.groups, shape.head_dim))
    if tm.kind == "qkv_conv1d":
        fused = torch.cat(split_qkv(t, shape.heads, shape.groups, shape.head_dim), 0)
        return [fused.t() if fused.dim() == 2 else fused]
    if tm.kind == "glu":
        return list(t.chunk(2, dim=0))
    raise AssertionError(tm.kind)


def _from_hf_tensors(tm: TensorMap, ts: List[torch.Tensor], shape: Shape) -> torch.Tensor:
    if tm.kind == "copy":
        return ts[0]
    if tm.kind == "transpose":
        return ts[0].t()
    if tm.kind == "qkv":
        return fuse_qkv(*ts, shape.heads, shape.groups, shape.head_dim)
    if tm.kind == "qkv_conv1d":
        fused = ts[0].t() if ts[0].dim() == 2 else ts[0]
        q_rows = shape.heads * shape.head_dim
        kv_rows = shape.groups * shape.head_dim
        q, k, v = fused.split([q_rows, kv_rows, kv_rows], dim=0)
        return fuse_qkv(q, k, v, shape.heads, shape.groups, shape.head_dim)
    if tm.kind == "glu":
        return torch.cat(ts, dim=0)
    raise AssertionError(tm.kind)


def _expert_maps(family: str, num_experts: int) -> List[TensorMap]:
    """The family's per-expert entries for experts 0 .. num_experts - 1 (none: dense)."""
    return [TensorMap(tm.megatron.format(e=e), tuple(n.format(e=e) for n in tm.hf), tm.kind,
                      tm.when, tm.zeros)
            for e in range(num_experts) for tm in FAMILIES[family].get("experts", ())]


def _present(tm: TensorMap, linear_bias: bool, qkv_bias: bool) -> bool:
    return {"always": True, "linear_bias": linear_bias, "qkv_bias": qkv_bias or linear_bias}[tm.when]


# ----------------------------------------------------------------------------- architecture
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
    """'gpt2', 'llama', 'qwen2' or 'mixtral' from the training flags, else a ConversionError
    naming the flags.  Qwen2: the Llama architecture with ``--add-qkv-bias`` and no other linear
    bias; Mixtral: the Llama architecture with ``--num-experts`` (see :func:`mixtral_checks`)."""
    moe = getattr(args, "num_experts", None) is not None
    norm = getattr(args, "normalization", "LayerNorm")
    pos = getattr(args, "position_embedding_type", "learned_absolute")
    swiglu = bool(getattr(args, "swiglu", False))
    if getattr(args, "qk_layernorm", False):
        raise ConversionError("--qk-layernorm has no GPT-2 / Llama equivalent")
    if getattr(args, "apply_layernorm_1p", False):
        raise ConversionError("--apply-layernorm-1p has no GPT-2 / Llama / Qwen2 equivalent")
    if pos == "learned_absolute":
        if moe:
            raise ConversionError(f"--num-experts exports as Mixtral, which needs "
                                  f"--position-embedding-type rope (got {pos})")
        if norm != "LayerNorm" or swiglu:
            raise ConversionError(
                f"--position-embedding-type learned_absolute exports as GPT-2, which needs "
                f"--normalization LayerNorm and no --swiglu (got --normalization {norm}"
                f"{' --swiglu' if swiglu else ''})")
        if getattr(args, "add_qkv_bias", False) and not getattr(args, "add_bias_linear", True):
            raise ConversionError("--add-qkv-bias with --disable-bias-linear: GPT-2 has biases "
                                  "on every linear layer or none")
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
        if moe:
            mixtral_checks(args)
            return "mixtral"
        if getattr(args, "add_qkv_bias", False) and not getattr(args, "add_bias_linear", True):
            return "qwen2"
        return "llama"
    raise ConversionError(f"--position-embedding-type {pos} is not supported")


def mixtral_checks(args: argparse.Namespace) -> None:
    """ConversionError naming the flag where an MoE model is not a Mixtral: every layer MoE,
    softmax routing to the top k renormalised (megatron-core's default: top k of the logits,
    softmax over those k -- the same function), no shared expert, no biases."""
    freq = getattr(args, "moe_layer_freq", 1)
    if freq != 1 and not (isinstance(freq, list) and all(v == 1 for v in freq)):
        raise ConversionError(f"--moe-layer-freq {freq}: Mixtral has an MoE MLP in every layer")
    if getattr(args, "moe_shared_expert_intermediate_size", None):
        raise ConversionError("--moe-shared-expert-intermediate-size: Mixtral has no shared "
                              "expert")
    if getattr(args, "moe_router_score_function", "softmax") != "softmax":
        raise ConversionError(f"--moe-router-score-function {args.moe_router_score_function}: "
                              "Mixtral routes with a softmax")
    if getattr(args, "moe_router_pre_softmax", False):
        raise ConversionError("--moe-router-pre-softmax: Mixtral renormalises the top-k "
                              "probabilities (megatron-core's default order), the pre-softmax "
                              "router does not")
    if getattr(args, "add_bias_linear", True) or getattr(args, "add_qkv_bias", False):
        raise ConversionError("Mixtral has no linear biases: export needs --disable-bias-linear "
                              "and no --add-qkv-bias")
    if getattr(args, "moe_expert_capacity_factor", None) is not None:
        warnings.warn(f"--moe-expert-capacity-factor {args.moe_expert_capacity_factor}: training "
                      "dropped tokens over an expert's capacity; Mixtral never drops")


def gelu_flavour(args: argparse.Namespace) -> str:
    """HF activation matching what training ran: ``--openai-gelu`` or megatron-core's fused
    bias-GELU (tanh approximation) when the fusion resolver turned it on for the saved arguments
    (CUDA, a bias, no ``--no-bias-gelu-fusion``) -> ``gelu_new``, else torch's exact GELU."""
    from megatron.training.model.fusions import resolve_fusions

    if getattr(args, "openai_gelu", False):
        return "gelu_new"
    saved = argparse.Namespace(**vars(args))
    saved.device = getattr(args, "device", "cuda")   # checkpoints before --device: GPU runs
    saved.apply_rope_fusion_explicit = False         # TE's; not the activation's business
    plan = resolve_fusions(saved, uses_te_spec=False, local_attention=False,
                           have=lambda module: False)   # the bias-GELU needs no package
    return "gelu_new" if plan.bias_activation_fusion else "gelu"


# ----------------------------------------------------------------------------- Megatron -> HF
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

    def left(self) -> List[str]:
        return sorted(set(self.sd) - self.used)


def default_export_vocab(args: argparse.Namespace, padded: int) -> int:
    """Rows exported without ``--vocab-size``: the model's own vocabulary where the padding rows
    were masked out of the loss (``--mask-padded-vocab-logits``: they are meaningless), else
    all ``padded`` rows."""
    if getattr(args, "mask_padded_vocab_logits", False) and getattr(args, "model_vocab_size", None):
        return int(args.model_vocab_size)
    return padded


def to_hf(args: argparse.Namespace, sd: Dict[str, torch.Tensor],
          vocab_size: Optional[int] = None) -> Tuple[str, Dict[str, torch.Tensor]]:
    """(family, HF state dict) of a full (TP = PP = 1 layout) Megatron state dict."""
    family = architecture(args)
    fam = FAMILIES[family]
    heads, groups, head_dim = _attention_shape(args)
    shape = Shape(heads, groups, head_dim)
    if family == "gpt2":
        if groups != heads:
            raise ConversionError(f"GPT-2 has no grouped-query attention (--num-query-groups "
                                  f"{groups})")
        if head_dim * heads != args.hidden_size:
            raise ConversionError(f"GPT-2 needs --kv-channels = hidden/heads "
                                  f"({args.hidden_size // heads}), got {head_dim}")
    take = _Taker(sd)
    padded = int(take("embedding.word_embeddings.weight").shape[0])
    vocab = default_export_vocab(args, padded) if vocab_size is None else int(vocab_size)
    if not 0 < vocab <= padded:
        raise ConversionError(f"--vocab-size {vocab}: must be in 1..{padded} (the checkpoint's "
                              f"padded vocabulary)")
    linear_bias = bool(getattr(args, "add_bias_linear", True))
    qkv_bias = bool(getattr(args, "add_qkv_bias", False))
    dtype = sd["embedding.word_embeddings.weight"].dtype
    hf: Dict[str, torch.Tensor] = {}

    def convert(tm: TensorMap, src: str, dst_prefix: str) -> None:
        present = family == "gpt2" or _present(tm, linear_bias, qkv_bias)
        if not present:
            return
        t = take(src, required=not tm.zeros)
        if t is None:   # a bias slot of GPT-2 / biased Llama without a trained bias
            t = torch.zeros(_bias_rows(args, tm), dtype=dtype)
        for name, tensor in zip(tm.hf, _to_hf_tensors(tm, t, shape)):
            hf[dst_prefix + name] = tensor

    for i in range(args.num_layers):
        for tm in fam["layer"]:
            if tm.when != "always" and family != "gpt2":
                tm = TensorMap(tm.megatron, tm.hf, tm.kind, tm.when, zeros=True)
            convert(tm, f"decoder.layers.{i}.{tm.megatron}", fam["layer_prefix"].format(i))
        for tm in _expert_maps(family, int(getattr(args, "num_experts", None) or 0)):
            convert(tm, f"decoder.layers.{i}.{tm.megatron}", fam["layer_prefix"].format(i))
    for tm in fam["glob"]:
        convert(tm, tm.megatron, "")
    for name in ("model.embed_tokens.weight", "transformer.wte.weight"):
        if name in hf:
            hf[name] = hf[name][:vocab]
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    if tied:
        copy = take("output_layer.weight", required=False)
        if copy is not None and not torch.equal(copy, sd["embedding.word_embeddings.weight"]):
            warnings.warn("tied embeddings: the last pipeline stage's output_layer.weight "
                          "differs from the word embeddings; the word embeddings are exported")
    else:
        hf[OUTPUT.hf[0]] = take(OUTPUT.megatron)[:vocab]
    _no_leftovers(take)
    return family, hf


def _bias_rows(args: argparse.Namespace, tm: TensorMap) -> int:
    """Length of a Megatron bias that is absent (``--disable-bias-linear``)."""
    heads, groups, head_dim = _attention_shape(args)
    return {"self_attention.linear_qkv.bias": (heads + 2 * groups) * head_dim,
            "self_attention.linear_proj.bias": args.hidden_size,
            "mlp.linear_fc1.bias": args.ffn_hidden_size * (2 if args.swiglu else 1),
            "mlp.linear_fc2.bias": args.hidden_size}[tm.megatron]


def hf_config(family: str, args: argparse.Namespace, vocab: int) -> Dict[str, Any]:
    """The HF config kwargs of the exported model."""
    heads, groups, head_dim = _attention_shape(args)
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    common = dict(architectures=[FAMILIES[family]["hf_class"]], vocab_size=vocab,
                  initializer_range=float(getattr(args, "init_method_std", 0.02)),
                  tie_word_embeddings=tied)
    if family == "gpt2":
        dropout = float(getattr(args, "hidden_dropout", 0.1))
        return dict(common, n_positions=args.max_position_embeddings, n_embd=args.hidden_size,
                    n_layer=args.num_layers, n_head=heads, n_inner=args.ffn_hidden_size,
                    activation_function=gelu_flavour(args), resid_pdrop=dropout,
                    embd_pdrop=dropout,
                    attn_pdrop=float(getattr(args, "attention_dropout", 0.1)),
                    layer_norm_epsilon=float(args.layernorm_epsilon), scale_attn_weights=True,
                    scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)
    bias_linear = bool(getattr(args, "add_bias_linear", True))
    rope: Dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(getattr(args, "rotary_base", 10000))}
    if getattr(args, "use_rope_scaling", False):
        # megatron-core's RotaryEmbedding fixes everything but the factor
        rope = dict(rope, rope_type="llama3", factor=float(args.rope_scaling_factor),
                    **MCORE_LLAMA3_FIXED)
    config = dict(common, hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size,
                  num_hidden_layers=args.num_layers, num_attention_heads=heads,
                  num_key_value_heads=groups, head_dim=head_dim, hidden_act="silu",
                  max_position_embeddings=args.max_position_embeddings,
                  rms_norm_eps=float(args.layernorm_epsilon),
                  attention_dropout=float(getattr(args, "attention_dropout", 0.0)))
    config.update(_rope_config_kwargs(rope))
    if family == "llama":
        config.update(attention_bias=bias_linear, mlp_bias=bias_linear)
    if family == "mixtral":
        config.update(intermediate_size=int(args.moe_ffn_hidden_size or args.ffn_hidden_size),
                      num_local_experts=int(args.num_experts),
                      num_experts_per_tok=int(args.moe_router_topk),
                      router_aux_loss_coef=float(getattr(args, "moe_aux_loss_coeff", 0.0) or 0.0),
                      router_jitter_noise=float(getattr(args, "moe_input_jitter_eps", None)
                                                or 0.0),
                      sliding_window=None)
    return config


def _rope_config_kwargs(rope: Dict[str, Any]) -> Dict[str, Any]:
    """transformers >= 5 takes ``rope_parameters``; older versions rope_theta + rope_scaling."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": rope}
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"rope_theta": rope["rope_theta"],
            "rope_scaling": None if scaling["rope_type"] == "default" else scaling}


def _no_leftovers(take: _Taker) -> None:
    left = take.left()
    if left:
        raise ConversionError(f"the checkpoint has tensors this export would drop: {left[:6]}"
                              f"{' ...' if len(left) > 6 else ''} (an architecture feature "
                              "GPT-2 / Llama / Qwen2 / Mixtral cannot express)")


# ----------------------------------------------------------------------------- HF -> Megatron
def from_hf(family: str, hf_sd: Dict[str, torch.Tensor], num_layers: int, shape: Shape,
            linear_bias: bool, qkv_bias: bool, tied: bool,
            num_experts: int = 0) -> Dict[str, torch.Tensor]:
    """The full (TP = PP = 1 layout, unpadded vocabulary; experts at expert-parallel size 1)
    Megatron state dict of an HF state dict; a ConversionError names a missing HF tensor or one
    that would be dropped."""
    fam = FAMILIES[family]
    left = set(hf_sd)
    out: Dict[str, torch.Tensor] = {}

    def convert(tm: TensorMap, dst: str, src_prefix: str) -> None:
        if not (family == "gpt2" or _present(tm, linear_bias, qkv_bias)):
            return
        names = [src_prefix + n for n in tm.hf]
        missing = [n for n in names if n not in hf_sd]
        if missing:
            raise ConversionError(f"the HF model has no tensor {missing[0]!r}")
        left.difference_update(names)
        out[dst] = _from_hf_tensors(tm, [hf_sd[n] for n in names], shape)

    for i in range(num_layers):
        for tm in fam["layer"]:
            convert(tm, f"decoder.layers.{i}.{tm.megatron}", fam["layer_prefix"].format(i))
        for tm in _expert_maps(family, num_experts):
            convert(tm, f"decoder.layers.{i}.{tm.megatron}", fam["layer_prefix"].format(i))
    for tm in fam["glob"]:
        convert(tm, tm.megatron, "")
    if not tied:
        convert(OUTPUT, OUTPUT.megatron, "")
    elif OUTPUT.hf[0] in hf_sd:  # tied: lm_head is the embedding (HF may list it anyway)
        left.discard(OUTPUT.hf[0])
    # buffers HF keeps in some versions' state dicts (not weights)
    left = {k for k in left if not k.endswith(("rotary_emb.inv_freq", "attn.bias",
                                               "attn.masked_bias"))}
    if left:
        raise ConversionError(f"the HF model has tensors the {family} import would drop: "
                              f"{sorted(left)[:6]}{' ...' if len(left) > 6 else ''}")
    return out
