"""megatron-core's configs from the trainer's flags: TransformerConfig, DistributedDataParallelConfig
and OptimizerConfig (and, for ``--dry-run``, all of them as JSON-friendly dicts).

Why a module of its own: these are the one translation of Megatron-LM flag names into
megatron-core's config fields, used by the training run, by ``--dry-run`` (which builds nothing
else) and by the tools and benchmarks that build the trainer's model outside a run.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict

from megatron.training.arguments import moe
from megatron.training.model.fusions import fusion_plan
from megatron.training.model.layer_specs import attention_choice, config_attention_backend


def build_transformer_config(args: argparse.Namespace):
    """Megatron-LM flags -> megatron-core TransformerConfig (fusions from :mod:`.fusions`)."""
    from megatron.core.transformer import TransformerConfig

    cpu = args.device == "cpu"
    kwargs: Dict[str, Any] = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        num_query_groups=(args.num_query_groups
                          if getattr(args, "group_query_attention", False) else None),
        attention_backend=config_attention_backend(args),
        init_method_std=args.init_method_std, layernorm_epsilon=args.layernorm_epsilon,
        normalization=args.normalization, gated_linear_unit=args.swiglu,
        add_bias_linear=args.add_bias_linear,
        bf16=args.bf16, fp16=args.fp16, params_dtype=args.params_dtype,
        pipeline_dtype=args.params_dtype,
        use_cpu_initialization=args.use_cpu_initialization or cpu,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        calculate_per_token_loss=getattr(args, "calculate_per_token_loss", False),
        # Fused kernels: what is installed decides (fusions.py; none on CPU).
        **fusion_plan(args).transformer_config_kwargs(),
    )
    if args.swiglu:
        import torch.nn.functional as F

        kwargs["activation_func"] = F.silu
    kwargs.update(_imported_model_kwargs(args))
    kwargs.update(moe.transformer_config_kwargs(args))
    return TransformerConfig(**kwargs)


def openai_gelu(x):
    """GELU's tanh approximation (``--openai-gelu``; HF's ``gelu_new``)."""
    import torch.nn.functional as F

    return F.gelu(x, approximate="tanh")


def _imported_model_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """TransformerConfig fields of the flags imported architectures need (--kv-channels,
    --add-qkv-bias, --apply-layernorm-1p, --openai-gelu); ``getattr``: namespaces saved before
    these flags existed build as before."""
    kwargs: Dict[str, Any] = {}
    if getattr(args, "kv_channels", None) is not None:
        kwargs["kv_channels"] = args.kv_channels
    if getattr(args, "add_qkv_bias", False):
        kwargs["add_qkv_bias"] = True
    if getattr(args, "apply_layernorm_1p", False):
        kwargs["layernorm_zero_centered_gamma"] = True
    # with --swiglu refused by arguments/validation.py; the guard keeps older saved args' build
    if getattr(args, "openai_gelu", False) and not args.swiglu:
        kwargs["activation_func"] = openai_gelu
        kwargs["bias_activation_fusion"] = False  # the fusion only knows the exact GELU's flag
    return kwargs


def build_ddp_config(args: argparse.Namespace):
    """Gradient buffer and bucket flags -> megatron-core DistributedDataParallelConfig."""
    from megatron.core.distributed import DistributedDataParallelConfig

    kwargs = dict(grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
                  overlap_grad_reduce=args.overlap_grad_reduce,
                  overlap_param_gather=args.overlap_param_gather,
                  use_distributed_optimizer=args.use_distributed_optimizer,
                  reduce_scatter_with_fp32_accumulation=(
                      args.ddp_reduce_scatter_with_fp32_accumulation),
                  average_in_collective=args.ddp_average_in_collective,
                  check_for_nan_in_grad=False)
    if args.ddp_bucket_size is not None:
        kwargs["bucket_size"] = args.ddp_bucket_size
    return DistributedDataParallelConfig(**kwargs)


def build_optimizer_config(args: argparse.Namespace):
    """Optimizer, precision and loss-scaling flags -> megatron-core OptimizerConfig."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr,
        weight_decay=args.weight_decay, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps, sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad,
        bf16=args.bf16, fp16=args.fp16, params_dtype=args.params_dtype,
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis, use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
        overlap_param_gather_with_optimizer_step=args.overlap_param_gather_with_optimizer_step,
        decoupled_lr=getattr(args, "decoupled_lr", None),
        decoupled_min_lr=getattr(args, "decoupled_min_lr", None))


def config_summary(args: argparse.Namespace) -> Dict[str, Any]:
    """Every config the run would build (for --dry-run), as JSON-friendly dicts."""
    from dataclasses import fields

    def as_dict(cfg: Any) -> Dict[str, Any]:
        out = {}
        for f in fields(cfg):
            v = getattr(cfg, f.name, None)
            out[f.name] = v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
        return out

    return {"transformer": as_dict(build_transformer_config(args)),
            "ddp": as_dict(build_ddp_config(args)),
            "optimizer": as_dict(build_optimizer_config(args)),
            "layer_spec": "transformer_engine" if attention_choice(args).uses_te else "local",
            "attention": attention_choice(args).impl}
