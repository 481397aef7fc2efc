"""The transformer layer spec the trainer builds GPTModel with, and the attention it uses.

Attention (:func:`resolve_attention`, the one place ``--attention-backend`` is decided; the
values are megatron-core's ``AttnBackend`` names, as in Megatron-LM):

==============  ==========================================  ==========================================
value           CUDA with Transformer Engine                otherwise (CPU, or CUDA without TE)
==============  ==========================================  ==========================================
auto (default)  TE's spec; TE picks its kernel              local spec + SDPA (:mod:`.sdpa_attention`),
                                                            torch picks the kernel
flash           TE's spec, TE's flash attention             local spec + SDPA restricted to torch's
                                                            flash kernel (CPU: no attention dropout)
fused           TE's spec, TE's cuDNN fused attention       local spec + SDPA restricted to torch's
                                                            cuDNN / memory-efficient kernels
                                                            (CUDA only)
unfused         TE's spec, TE's unfused attention           local spec, megatron-core's
                                                            ``DotProductAttention``
local           local spec, megatron-core's ``DotProductAttention`` (also with TE installed)
==============  ==========================================  ==========================================

With TE, the kernel choice reaches TE through ``TransformerConfig.attention_backend`` (megatron-core
sets ``NVTE_FLASH_ATTN`` / ``NVTE_FUSED_ATTN`` / ``NVTE_UNFUSED_ATTN`` from it at model build).
The resolved implementation is stored as ``args.attention_impl`` (``transformer_engine``,
``sdpa``, ``sdpa-flash``, ``sdpa-fused`` or ``local``), so every checkpoint records it with the
args. Resuming under another implementation: SDPA and ``DotProductAttention`` have no parameters
(the state dicts are identical), so the run resumes and says so; TE's spec names its layer norms
differently, so a ``--ckpt-format torch`` checkpoint written with TE's spec does not load into the
local spec (or back) and :func:`attention_layout_diff` names the change for the layout check
(``torch_dist`` maps the names and resumes).

Layer norms: Transformer Engine's spec on GPU when it is used, else megatron-core's local spec --
with one addition: sequence parallelism on the local spec without Apex.  megatron-core 0.16.1's torch
fallback norm (``WrappedTorchNorm``) refuses ``sequence_parallel`` because a plain
``torch.nn.LayerNorm`` does not mark its parameters: under sequence parallelism each
tensor-parallel rank normalizes only its slice of the sequence, so the norm weights' gradients
are partial sums that megatron-core's ``finalize_model_grads`` must all-reduce over the
tensor-parallel group, which it does for parameters flagged ``sequence_parallel`` (as Apex's and
TE's norms flag theirs).  :class:`SequenceParallelTorchNorm` is the torch norm with that flag.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

import torch

from megatron.training.checkpoint.layout import saved_arg


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """``--apply-layernorm-1p``: scales by (1 + weight), the weight starting at 0."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1,
                                              self.bias, self.eps)


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """``--apply-layernorm-1p`` with ``--normalization RMSNorm``."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


class SequenceParallelTorchNorm:
    """``torch.nn.LayerNorm`` / ``RMSNorm`` whose parameters carry ``sequence_parallel``
    (megatron-core's norm-module signature, so it drops into a ModuleSpec); zero-centered
    (``--apply-layernorm-1p``), which megatron-core's torch fallback refuses, where configured."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm") -> torch.nn.Module:
        table = ({"LayerNorm": ZeroCenteredLayerNorm, "RMSNorm": ZeroCenteredRMSNorm}
                 if config.layernorm_zero_centered_gamma else
                 {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm})
        norm_cls = table.get(config.normalization)
        if norm_cls is None:
            raise ValueError(f"--normalization {config.normalization} with --sequence-parallel "
                             "or --apply-layernorm-1p needs Transformer Engine or Apex")
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401

        return True
    except Exception:
        return False


ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
"""``--attention-backend`` values (megatron-core 0.16.1's ``AttnBackend`` names)."""

ATTENTION_IMPLS = {
    "transformer_engine": "Transformer Engine's spec (TEDotProductAttention)",
    "sdpa": "torch scaled_dot_product_attention, kernel chosen by torch",
    "sdpa-flash": "torch scaled_dot_product_attention, flash kernel only",
    "sdpa-fused": "torch scaled_dot_product_attention, cuDNN / memory-efficient kernels only",
    "local": "megatron-core's unfused DotProductAttention",
}
"""``args.attention_impl`` values and what each runs."""


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
    """What :func:`resolve_attention` decided."""

    backend: str
    """``--attention-backend`` as given."""
    impl: str
    """One of :data:`ATTENTION_IMPLS`."""

    @property
    def uses_te(self) -> bool:
        return self.impl == "transformer_engine"

    def describe(self) -> str:
        return f"{self.impl} ({ATTENTION_IMPLS[self.impl]}; --attention-backend {self.backend})"


def resolve_attention(args: argparse.Namespace) -> AttentionChoice:
    """The one decision of which attention (and so which layer spec) the run uses.

    Reads ``args.attention_backend`` (default ``auto``), ``args.device``, the precision and
    ``args.attention_dropout``; raises ``ValueError`` naming the flag when the choice cannot run.
    Rules: see the table in this module's docstring.
    """
    backend = getattr(args, "attention_backend", None) or "auto"
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {backend!r}: choose one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    device = getattr(args, "device", None) or "cpu"
    if backend == "local":
        return AttentionChoice(backend, "local")
    if device == "cuda" and _have_te():
        return AttentionChoice(backend, "transformer_engine")
    if backend == "unfused":
        return AttentionChoice(backend, "local")
    if backend == "fused" and device != "cuda":
        raise ValueError("--attention-backend fused needs CUDA: without Transformer Engine it "
                         "means torch's cuDNN / memory-efficient attention kernels, which have no "
                         "CPU version; use --attention-backend auto (SDPA) or local on CPU")
    if backend == "flash":
        dropout = float(getattr(args, "attention_dropout", 0.0) or 0.0)
        if device != "cuda" and dropout > 0.0:
            raise ValueError(f"--attention-backend flash on CPU: torch's CPU flash kernel has no "
                             f"attention dropout (--attention-dropout {dropout}); use "
                             "--attention-dropout 0 or --attention-backend auto")
        if device == "cuda" and not (getattr(args, "bf16", False) or getattr(args, "fp16", False)):
            raise ValueError("--attention-backend flash without Transformer Engine means torch's "
                             "flash-attention kernel, which runs fp16/bf16 only: add --bf16 or "
                             "--fp16, or use --attention-backend auto")
    return AttentionChoice(backend, "sdpa" if backend == "auto" else f"sdpa-{backend}")


def attention_choice(args: argparse.Namespace) -> AttentionChoice:
    """The choice :func:`resolve_attention` recorded in ``args`` (``validate_args``), or a fresh
    resolution for a namespace built another way."""
    impl = getattr(args, "attention_impl", None)
    if impl in ATTENTION_IMPLS:
        return AttentionChoice(getattr(args, "attention_backend", None) or "auto", impl)
    return resolve_attention(args)


def config_attention_backend(args: argparse.Namespace) -> Any:
    """``TransformerConfig.attention_backend``: the flag's value where TE's spec runs (TE picks
    its kernel from it), megatron-core's default ``auto`` otherwise (the value only sets TE's
    ``NVTE_*`` variables, which nothing reads without TE; leaving them alone lets one process
    build models with different backends, as the tests do)."""
    from megatron.core.transformer.enums import AttnBackend

    choice = attention_choice(args)
    return AttnBackend[choice.backend] if choice.uses_te else AttnBackend.auto


def uses_transformer_engine(args: argparse.Namespace) -> bool:
    """The TE spec is used: on GPU when transformer_engine imports, unless
    ``--attention-backend local`` (see :func:`resolve_attention`)."""
    return attention_choice(args).uses_te


def attention_layout_diff(saved_args: Any, args: argparse.Namespace) -> Optional[str]:
    """For the ``--ckpt-format torch`` layout check: ``"--attention-backend OLD (IMPL) -> NEW
    (IMPL)"`` when the checkpoint was written with TE's spec and this run uses the local spec or
    back (their state dicts name the layer norms differently); None otherwise, and for
    checkpoints that do not record the implementation."""
    old = saved_arg(saved_args, "attention_impl")
    if old not in ATTENTION_IMPLS:
        return None
    new = attention_choice(args)
    if (old == "transformer_engine") == new.uses_te:
        return None
    return (f"--attention-backend {saved_arg(saved_args, 'attention_backend') or 'auto'} ({old}) -> "
            f"{new.backend} ({new.impl})")


def attention_resume_note(saved_args: Any, args: argparse.Namespace) -> Optional[str]:
    """One log line when the checkpoint was written with another attention implementation that
    loads unchanged (None when it is the same, or the checkpoint does not say)."""
    old = saved_arg(saved_args, "attention_impl")
    new = attention_choice(args)
    if old not in ATTENTION_IMPLS or old == new.impl:
        return None
    why = ("core attention has no parameters, so the weights load unchanged, and the math is "
           "the same up to rounding (dropout draws differ)")
    if (old == "transformer_engine") != new.uses_te:
        why = "the torch_dist checkpoint maps TE's and the local spec's layer-norm names; " + why
    return (f" > attention changed on resume: the checkpoint was written with {old} "
            f"(--attention-backend {saved_arg(saved_args, 'attention_backend') or 'auto'}), this run "
            f"uses {new.impl} (--attention-backend {new.backend}): {why}")


TE_FUSED_NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
"""Transformer Engine's spec fuses each layer norm into the linear after it; its weights are
the local spec's ``input_layernorm`` / ``pre_mlp_layernorm`` under another name (keys relative
to ``decoder.layers.N.``)."""


def canonical_layer_key(rest: str) -> str:
    """A layer's state-dict key (after ``decoder.layers.N.``) in the local spec's naming: one
    name for the same weight whichever spec wrote it."""
    return TE_FUSED_NORM_NAMES.get(rest, rest)


def gpt_layer_spec(args: argparse.Namespace, config: Any) -> Any:
    """ModuleSpec (or TransformerBlockSubmodules) for GPTModel's ``transformer_layer_spec``;
    with ``--num-experts`` megatron-core's decoder block spec (MoE layers where
    ``--moe-layer-freq`` puts them), each local layer with the same substitutions."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    choice = attention_choice(args)
    torch_norm = SequenceParallelTorchNorm if (
        config.sequence_parallel or config.layernorm_zero_centered_gamma) else None
    if getattr(args, "num_experts", None) is not None:
        block = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=choice.uses_te,
                                                 normalization=args.normalization)
        if choice.uses_te:
            return block
        layers = [_local_layer(layer, choice, torch_norm) for layer in block.layer_specs]
        norm = (torch_norm if torch_norm is not None and block.layer_norm is WrappedTorchNorm
                else block.layer_norm)
        return dataclasses.replace(block, layer_specs=layers, layer_norm=norm)
    if choice.uses_te:
        return specs.get_gpt_layer_with_transformer_engine_spec()
    spec = specs.get_gpt_layer_local_spec(normalization=args.normalization)
    layer = _local_layer(spec, choice, torch_norm)
    if layer.submodules.input_layernorm is spec.submodules.input_layernorm:
        return layer
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelTorchNorm)


def _local_layer(spec: Any, choice: AttentionChoice, torch_norm: Any) -> Any:
    """A local-spec layer with SDPA as its core attention (when chosen) and ``torch_norm`` for
    megatron-core's torch norms (when given: sequence parallel or zero-centered)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if choice.impl.startswith("sdpa"):
        from megatron.training.model.sdpa_attention import sdpa_class

        attn = spec.submodules.self_attention
        attn = dataclasses.replace(attn, submodules=dataclasses.replace(
            attn.submodules, core_attention=sdpa_class(choice.backend)))
        spec = dataclasses.replace(spec, submodules=dataclasses.replace(
            spec.submodules, self_attention=attn))
    if torch_norm is None or spec.submodules.input_layernorm is not WrappedTorchNorm:
        return spec
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, input_layernorm=torch_norm, pre_mlp_layernorm=torch_norm))
