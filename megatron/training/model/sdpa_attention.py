"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` (SDPA).

Why: megatron-core 0.16.1's attention without Transformer Engine (``DotProductAttention``)
materializes the score matrix and runs mask / softmax / dropout as separate kernels; SDPA's fused
kernels never store it. :class:`SDPAttention` is a drop-in ``core_attention`` for the local spec
(same signatures, no parameters, same state dict); :class:`SDPAttentionFlash` /
:class:`SDPAttentionFused` restrict torch's kernel choice for ``--attention-backend flash`` /
``fused``. See [Note: SDPA matches DotProductAttention] in docs/architecture.md.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

try:  # torch >= 2.3
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # pragma: no cover - older torch: no kernel restriction possible
    SDPBackend = None
    sdpa_kernel = None

__all__ = ["SDPAttention", "SDPAttentionFlash", "SDPAttentionFused", "HAVE_ENABLE_GQA",
           "sdpa_class"]

HAVE_ENABLE_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")
"""torch >= 2.5: SDPA broadcasts key/value groups itself (``enable_gqa=True``)."""


def _refuse(what: str, flag: str) -> ValueError:
    return ValueError(f"{what} is not supported by the SDPA core attention "
                      f"(torch scaled_dot_product_attention): {flag} needs Transformer Engine's "
                      "attention (install transformer_engine and use --attention-backend auto on "
                      "CUDA), or drop the flag")


class SDPAttention(MegatronModule):
    """megatron-core core attention on ``torch.nn.functional.scaled_dot_product_attention``.

    Same constructor and forward signatures as megatron-core 0.16.1's ``DotProductAttention``;
    see the module docstring for the semantics and what is refused.
    """

    kernels: Optional[Tuple[str, ...]] = None
    """SDPBackend names the kernel choice is restricted to (None: torch chooses)."""
    backend_name = "sdpa"
    """Name recorded in the startup line and the checkpoint's args."""

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config=config)
        self.config: TransformerConfig = config
        if config.context_parallel_size > 1:
            raise _refuse(f"context parallelism (context_parallel_size="
                          f"{config.context_parallel_size})", "--context-parallel-size > 1")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise _refuse(f"softmax_type {config.softmax_type!r}", "--softmax-type")
        if is_layer_window_attention(getattr(config, "window_size", None),
                                     getattr(config, "window_attn_skip_freq", None),
                                     layer_number):
            raise _refuse("sliding-window attention", "--window-size")
        if self.kernels is not None and sdpa_kernel is None:
            raise ValueError(f"restricting SDPA to {self.kernels} needs torch >= 2.3 "
                             "(torch.nn.attention.sdpa_kernel)")

        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_comm_type = cp_comm_type

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        elif not hasattr(pg_collection, "tp"):
            raise ValueError("SDPAttention's pg_collection must have a tp process group")
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        world_size = pg_collection.tp.size()

        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)

        # DotProductAttention's bookkeeping: softmax_scale is what its baddbmm uses (divided by
        # the layer number under query-key layer scaling), the softmax multiplies by `coeff`.
        self.softmax_scale = (1.0 / math.sqrt(self.hidden_size_per_attention_head)
                              if softmax_scale is None else softmax_scale)
        coeff = 1.0
        if config.apply_query_key_layer_scaling:
            coeff = float(self.layer_number)
            self.softmax_scale /= coeff
        self.scale = self.softmax_scale * coeff
        """The scale SDPA applies: the product of the two."""
        self.dropout_p = float(config.attention_dropout if attention_dropout is None
                               else attention_dropout)
        self._sdpa_backends = (None if self.kernels is None
                               else [getattr(SDPBackend, k) for k in self.kernels])

    # ------------------------------------------------------------------ helpers
    def _use_enable_gqa(self, query: Tensor) -> bool:
        """Let SDPA broadcast key/value groups where the chosen kernel supports it: torch's
        flash kernels (CUDA for fp16/bf16, CPU) and the math fallback do; the memory-efficient
        and cuDNN kernels of the releases we know do not (torch would fall back to math), so the
        ``fused`` kernels get expanded keys and values."""
        if not HAVE_ENABLE_GQA:
            return False
        if self.kernels is not None and "FLASH_ATTENTION" not in self.kernels:
            return False
        if query.device.type == "cuda":
            return query.dtype in (torch.float16, torch.bfloat16)
        return True

    def _sdpa_mask(self, attention_mask: Optional[Tensor], mask_type: AttnMaskType,
                   sq: int, sk: int, device: torch.device) -> Tuple[Optional[Tensor], bool]:
        """(SDPA attn_mask, is_causal) for megatron's mask (True = masked out) and mask type."""
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal,
                               AttnMaskType.causal_bottom_right)
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise TypeError("SDPAttention expects megatron-core's boolean attention mask "
                                f"(True = masked out), got dtype {attention_mask.dtype}")
            allowed = attention_mask.logical_not()
            if mask_type == AttnMaskType.padding_causal:
                allowed = allowed & torch.ones(sq, sk, dtype=torch.bool, device=device).tril(
                    sk - sq)
            return allowed, False
        if not causal or sq == 1:  # one query (KV-cache decode) sees every key, as in mcore
            return None, False
        if mask_type == AttnMaskType.causal_bottom_right and sq != sk:
            return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq), False
        if sq != sk:
            raise ValueError(f"causal attention needs as many queries as keys (got sq={sq}, "
                             f"sk={sk}), as in megatron-core's DotProductAttention")
        return None, True

    # ------------------------------------------------------------------ forward
    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                attention_mask: Optional[Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> Tensor:
        """[sq, b, np, hn] query, [sk, b, ng, hn] key/value -> [sq, b, np * hn] context."""
        if packed_seq_params is not None:
            raise _refuse("packed sequences (THD format, packed_seq_params)",
                          "packed-sequence training")
        if attention_bias is not None:
            raise _refuse("an attention_bias", "a model with attention bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, b, np_, hn = query.shape
        sk = key.size(0)
        groups = key.size(2)
        if np_ % groups:
            raise ValueError(f"{np_} query heads are not a multiple of {groups} key/value groups")

        enable_gqa = False
        if groups != np_:
            if self._use_enable_gqa(query):
                enable_gqa = True
            else:
                key = key.repeat_interleave(np_ // groups, dim=2)
                value = value.repeat_interleave(np_ // groups, dim=2)

        attn_mask, is_causal = self._sdpa_mask(attention_mask, mask_type, sq, sk, query.device)
        dropout_p = self.dropout_p if self.training else 0.0
        kwargs = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                      scale=self.scale)
        if enable_gqa:
            kwargs["enable_gqa"] = True

        # [s, b, h, d] -> [b, h, s, d] (views; SDPA takes strided inputs)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = self._sdpa(q, k, v, kwargs)
        else:
            context = self._sdpa(q, k, v, kwargs)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, kwargs: dict) -> Tensor:
        if self._sdpa_backends is None:
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
        try:
            with sdpa_kernel(self._sdpa_backends):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
        except RuntimeError as e:
            if "kernel" not in str(e) and "backend" not in str(e):
                raise
            raise RuntimeError(
                f"--attention-backend {self.backend_name.split('-')[-1]}: torch has no "
                f"{'/'.join(self.kernels)} attention kernel for these inputs (device "
                f"{q.device.type}, dtype {q.dtype}, head size {q.size(-1)}, dropout "
                f"{kwargs['dropout_p']}, mask {'yes' if kwargs['attn_mask'] is not None else 'no'}"
                f"): use --attention-backend auto, which lets torch choose ({e})") from None


class SDPAttentionFlash(SDPAttention):
    """SDPA restricted to torch's flash-attention kernel (``--attention-backend flash``)."""

    kernels = ("FLASH_ATTENTION",)
    backend_name = "sdpa-flash"


class SDPAttentionFused(SDPAttention):
    """SDPA restricted to torch's cuDNN and memory-efficient kernels
    (``--attention-backend fused``)."""

    kernels = ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
    backend_name = "sdpa-fused"


def sdpa_class(backend: str) -> type:
    """The SDPAttention class for an ``--attention-backend`` value (auto, flash, fused)."""
    return {"auto": SDPAttention, "flash": SDPAttentionFlash, "fused": SDPAttentionFused}[backend]
