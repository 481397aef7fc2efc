"""The transformer layer spec the trainer builds GPTModel with.

Transformer Engine's spec on GPU when it imports, else megatron-core's local spec -- with one
addition: sequence parallelism on the local spec without Apex.  megatron-core 0.16.1's torch
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
from typing import Any

import torch


class SequenceParallelTorchNorm:
    """``torch.nn.LayerNorm`` / ``RMSNorm`` whose parameters carry ``sequence_parallel``
    (megatron-core's norm-module signature, so it drops into a ModuleSpec)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm") -> torch.nn.Module:
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}.get(
            config.normalization)
        if norm_cls is None:
            raise ValueError(f"--normalization {config.normalization} with --sequence-parallel "
                             "needs Transformer Engine or Apex")
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


def uses_transformer_engine(args: argparse.Namespace) -> bool:
    """The TE spec is used on GPU when transformer_engine imports."""
    return args.device == "cuda" and _have_te()


def gpt_layer_spec(args: argparse.Namespace, config: Any) -> Any:
    """ModuleSpec (or TransformerBlockSubmodules) for GPTModel's ``transformer_layer_spec``."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    if uses_transformer_engine(args):
        return specs.get_gpt_layer_with_transformer_engine_spec()
    spec = specs.get_gpt_layer_local_spec(normalization=args.normalization)
    if not (config.sequence_parallel and spec.submodules.input_layernorm is WrappedTorchNorm):
        return spec
    layer = dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, input_layernorm=SequenceParallelTorchNorm,
        pre_mlp_layernorm=SequenceParallelTorchNorm))
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelTorchNorm)
