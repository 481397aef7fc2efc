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
from typing import Any, List

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

    return GPTModel(config=config, transformer_layer_spec=gpt_layer_spec(args, config),
                    vocab_size=vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type,
                    rotary_percent=args.rotary_percent, rotary_base=args.rotary_base)


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
    note = integration.resolve_auto_strategy(args, sum(p.numel() for p in chunk.parameters()))
    if note:
        print_rank_0(f" > --paro-strategy {note}")
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
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = integration.build_optimizer(build_optimizer_config(args), model, args.quant_config)
    apply_optimizer_fusions(fusion_plan(args), optimizer)
    gbs = args.global_batch_size
    decay_steps = args.lr_decay_iters * gbs
    if args.lr_warmup_fraction is not None:
        warmup_steps = int(args.lr_warmup_fraction * decay_steps)
    else:
        warmup_steps = args.lr_warmup_iters * gbs
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=False)
    return optimizer, scheduler


# ----------------------------------------------------------------------------- data
def build_datasets(args: argparse.Namespace, tokenizer: Any):
    """(train, validation, None) for the whole run: see :mod:`megatron.training.data.datasets`, which
    checks the .bin/.idx files and the --split before megatron-core builds (no hang, clear error)."""
    from megatron.training.data.datasets import build_datasets as build_checked_datasets

    return build_checked_datasets(args, tokenizer)
