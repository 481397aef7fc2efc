"""The HF state dicts of a pretrain_gpt.py model (tools/checkpoint/convert_to_hf.py): which HF
architecture the run's flags are (GPT-2 or Llama), and its weights renamed, split (fused QKV) and
checked so that nothing of the Megatron state dict is left over.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from tools.checkpoint.megatron_checkpoint_reader import ConversionError



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
    from megatron.training.model.fusions import resolve_fusions

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
