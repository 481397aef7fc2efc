"""What a training run is built from: the GPT model chunks (data-parallel wrapped), the optimizer
and its learning-rate scheduler, the schedule's hooks and the datasets.

What it builds, in order: GPTModel from the TransformerConfig (:mod:`.config_builders`; TE spec
when transformer_engine is importable and we are on GPU, else megatron-core's local spec) ->
Float16Module (bf16/fp16) -> data-parallel wrapper via ``integration.wrap_model`` (megatron-core
DDP, or the PaRO engine for ``--paro-strategy`` other than NNN / NNG; the loop is the same) ->
optimizer via ``integration.build_optimizer`` + OptimizerParamScheduler.  Data come from
megatron-core's BlendedMegatronDatasetBuilder (GPTDataset, or MockGPTDataset with --mock-data),
checked first by :mod:`.data`.

Why a module of its own: the run (:mod:`.training`), the tests and the tools that train a few
steps outside a run build the same pieces the same way.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List

import torch

from megatron.distributed.quant import integration

from megatron.training.model.config_builders import build_ddp_config, build_optimizer_config
from megatron.training.model.fusions import apply_optimizer_fusions, fusion_plan
from megatron.training.model.layer_specs import gpt_layer_spec
from megatron.training.logging_utils import print_rank_0


def model_provider(args: argparse.Namespace, config: Any, vocab_size: int,
                   pre_process: bool, post_process: bool) -> torch.nn.Module:
    """This pipeline stage's GPTModel (embedding with ``pre_process``, output layer and loss with
    ``post_process``)."""
    from megatron.core.models.gpt import GPTModel

    if getattr(args, "num_experts", None) is not None:
        from megatron.distributed.mcore_compat.moe import install_moe_fixes

        install_moe_fixes(cpu=args.device == "cpu")
    model = GPTModel(config=config, transformer_layer_spec=gpt_layer_spec(args, config),
                     vocab_size=vocab_size,
                     max_sequence_length=args.max_position_embeddings,
                     pre_process=pre_process, post_process=post_process,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type,
                     rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                     rope_scaling=getattr(args, "use_rope_scaling", False),
                     rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0))
    if post_process and getattr(args, "mask_padded_vocab_logits", False):
        unpadded = getattr(args, "model_vocab_size", None)
        if unpadded is None:
            raise ValueError("--mask-padded-vocab-logits: args.model_vocab_size (the vocabulary "
                             "before padding) is not set")
        mask_padded_vocab_logits(model, unpadded, vocab_size)
    return model


def mask_padded_vocab_logits(model: torch.nn.Module, unpadded: int, padded: int) -> None:
    """``--mask-padded-vocab-logits``: the output layer's logits of ids >= ``unpadded`` become
    -inf (a forward hook), so softmax and loss see only the real vocabulary, as the unpadded
    model (e.g. the Hugging Face one it was imported from) does.  Works on this rank's
    vocabulary shard (tensor parallelism) or on gathered logits."""
    if unpadded >= padded:
        return

    def hook(module: torch.nn.Module, _inputs: Any, output: Any) -> Any:
        from megatron.core import parallel_state as ps

        logits, bias = output
        local = logits.shape[-1]
        start = 0 if local == padded else ps.get_tensor_model_parallel_rank() * local
        ids = torch.arange(start, start + local, device=logits.device)
        return logits.masked_fill(ids >= unpadded, float("-inf")), bias

    model.output_layer.register_forward_hook(hook)


def keeps_attention_scores(args: argparse.Namespace) -> bool:
    """Whether the attention kernel materialises the s x s scores: megatron-core's local kernel
    (and an unknown one: assume it does), and Transformer Engine's unfused backend -- asked for
    with ``--attention-backend unfused``, or TE's fallback for fp32, which its flash and fused
    kernels do not take. SDPA and TE's flash / fused kernels do not."""
    impl = getattr(args, "attention_impl", "local")
    if impl in ("local", None):
        return True
    if impl == "transformer_engine":
        half = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
        return getattr(args, "attention_backend", None) == "unfused" or not half
    return False


def activation_shape(args: argparse.Namespace) -> Dict[str, Any]:
    """One micro-batch's shape, precision, attention kernel and recomputation, as the keywords of
    ``integration.activation_bytes_estimate`` (the layer reads no ``args``)."""
    vocab = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None) or 0
    return dict(
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads, vocab_size=vocab,
        ffn_hidden_size=getattr(args, "ffn_hidden_size", None),
        gated_mlp=bool(getattr(args, "swiglu", False)),
        bytes_per_value=2.0 if (args.bf16 or args.fp16) else 4.0,
        attention_scores=keeps_attention_scores(args),
        recompute=getattr(args, "recompute_granularity", None),
        recompute_num_layers=getattr(args, "recompute_num_layers", None) or 1)


def get_model(args: argparse.Namespace, config: Any, vocab_size: int) -> List[torch.nn.Module]:
    """One model chunk (no virtual pipeline), mixed-precision wrapped, DDP via the integration."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    chunk = model_provider(args, config, vocab_size,
                           pre_process=ps.is_pipeline_first_stage(),
                           post_process=ps.is_pipeline_last_stage())
    if args.device == "cuda":
        chunk.cuda(torch.cuda.current_device())
    if args.bf16 or args.fp16:
        chunk = Float16Module(config, chunk)
    auto = integration.resolve_auto_strategy(args.quant_config,
                                             sum(p.numel() for p in chunk.parameters()),
                                             integration.activation_bytes_estimate(
                                                 **activation_shape(args)))
    if auto is not None:  # --paro-strategy auto: the trainer records what the layer chose
        args.quant_config, args.paro_strategy = auto.config, auto.config.paro.strategy
        if auto.use_distributed_optimizer is not None:
            args.use_distributed_optimizer = auto.use_distributed_optimizer
        print_rank_0(f" > --paro-strategy {auto.note}")
    return integration.wrap_model(config, build_ddp_config(args), [chunk], args.quant_config,
                                  strategy=args.paro_strategy, group_size=args.paro_group_size)


def configure_schedule(args: argparse.Namespace, config: Any, model: List[torch.nn.Module],
                       optimizer: Any) -> None:
    """The hooks megatron-core's schedule calls: loss scaling, gradient finalization, no_sync."""
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = integration.finalize_model_grads_func(model)
    config.no_sync_func = model[0].no_sync
    if args.overlap_grad_reduce:
        config.grad_sync_func = model[0].start_grad_sync
    config.timers = None


def get_optimizer_and_scheduler(args: argparse.Namespace, model: List[torch.nn.Module]):
    """The optimizer of the wrapped chunks and its learning-rate scheduler (megatron-core's
    OptimizerParamScheduler, :mod:`megatron.training.lr_schedule`)."""
    from megatron.training.lr_schedule import build_scheduler

    optimizer = integration.build_optimizer(build_optimizer_config(args), model, args.quant_config)
    apply_optimizer_fusions(fusion_plan(args), optimizer)
    return optimizer, build_scheduler(args, optimizer)


# ----------------------------------------------------------------------------- data
def build_datasets(args: argparse.Namespace, tokenizer: Any):
    """(train, validation, None) for the whole run: see :mod:`megatron.training.data.datasets`, which
    checks the .bin/.idx files and the --split before megatron-core builds (no hang, clear error)."""
    from megatron.training.data.datasets import build_datasets as build_checked_datasets

    return build_checked_datasets(args, tokenizer)
