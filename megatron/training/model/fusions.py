"""Which fused kernels the run uses, decided once from what is installed.

Why: each of megatron-core's ``TransformerConfig`` fusion switches assumes a package; set blindly
on, a machine without it fails to build or at the first forward, set blindly off, a run pays for
what it could have had. :func:`resolve_fusions` decides them from the device, the attention
implementation and which packages import; :meth:`FusionPlan.summary` is the startup line. An
explicit flag that cannot be honoured is an error naming the missing package; ``--no-*`` always
turns a fusion off. See [Note: what each fusion needs] in docs/architecture.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from typing import Any, Callable, Dict, List, Tuple

import torch

__all__ = ["FusionPlan", "resolve_fusions", "fusion_plan", "apply_optimizer_fusions",
           "module_importable", "FUSION_FLAGS"]


def module_importable(name: str) -> bool:
    """True if ``import name`` succeeds (an installed package whose CUDA extension fails to load
    counts as absent, as megatron-core's own ``try: import`` does)."""
    try:
        importlib.import_module(name)
        return True
    except Exception:  # noqa: BLE001 -- ImportError, OSError of a broken extension, ...
        return False


APEX_PERSIST_LN = "apex.contrib.layer_norm.layer_norm"
APEX_FUSED_LN = "apex.normalization.fused_layer_norm"
APEX_WGRAD = "fused_weight_gradient_mlp_cuda"
APEX_OPTIMIZERS = "apex.optimizers"
APEX_MULTI_TENSOR = "amp_C"
SOFTMAX_EXTENSIONS = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda")
TE = "transformer_engine"

FUSION_FLAGS: Dict[str, str] = {
    "persist_layer_norm": "--no-persist-layer-norm",
    "masked_softmax_fusion": "--no-masked-softmax-fusion",
    "bias_activation_fusion": "--no-bias-gelu-fusion / --no-bias-swiglu-fusion",
    "bias_dropout_fusion": "--no-bias-dropout-fusion",
    "gradient_accumulation_fusion": "--no-gradient-accumulation-fusion",
    "apply_rope_fusion": "--no-rope-fusion",
}
"""The Megatron-LM flag that turns each fusion off."""


@dataclasses.dataclass(frozen=True)
class FusionPlan:
    """The fusions of one run (:func:`resolve_fusions`); the ``TransformerConfig`` switches and
    the optimizer / multi-tensor implementations."""

    persist_layer_norm: bool = False
    """Apex's persistent fused layer norm (local spec on CUDA)."""
    masked_softmax_fusion: bool = False
    """Megatron's fused scale-mask-softmax (only megatron-core's ``DotProductAttention`` uses it)."""
    bias_activation_fusion: bool = False
    """jit-fused bias + GeLU / SwiGLU."""
    bias_dropout_fusion: bool = False
    """jit-fused bias + dropout + residual add."""
    gradient_accumulation_fusion: bool = False
    """Weight-gradient GEMM accumulating straight into ``main_grad``."""
    apply_rope_fusion: bool = False
    """Transformer Engine's fused rotary embedding."""
    optimizer: str = "torch"
    """Adam implementation: ``transformer_engine``, ``apex``, ``torch-fused`` (torch AdamW with
    ``fused=True``) or ``torch`` (megatron-core's fallback: torch's default)."""
    multi_tensor: str = "megatron-core"
    """Grad-norm / scale kernels: ``transformer_engine``, ``apex``, ``torch-foreach`` or
    ``megatron-core`` (its per-tensor fallback)."""
    fallbacks: Tuple[Tuple[str, str], ...] = ()
    """``(switch, why it is off)`` for each fusion the run does not get."""

    def transformer_config_kwargs(self) -> Dict[str, bool]:
        """The ``TransformerConfig`` switches."""
        return {name: getattr(self, name) for name in FUSION_FLAGS}

    def summary(self) -> str:
        """One startup line: what is fused, what falls back and why."""
        on = [name for name in FUSION_FLAGS if getattr(self, name)]
        parts = [f"fused: {', '.join(on) if on else 'none'}",
                 f"optimizer: {self.optimizer}", f"multi-tensor: {self.multi_tensor}"]
        if self.fallbacks:
            parts.append("off: " + "; ".join(f"{k} ({why})" for k, why in self.fallbacks))
        return " > fusions | " + " | ".join(parts)


def _given(args: argparse.Namespace, name: str, default: bool = True) -> bool:
    return bool(getattr(args, name, default))


def _trains_on_paro_engine(args: argparse.Namespace) -> bool:
    """Whether ``--paro-strategy`` may train on the PaRO engine: its hooks take each weight
    gradient from ``param.grad``, and a fused weight-gradient GEMM (TE's or Apex's) writes it
    into megatron-core's ``main_grad`` buffers instead, which the engine does not have."""
    from megatron.distributed.quant.integration import uses_sharded_engine

    return uses_sharded_engine(getattr(args, "paro_strategy", None))


def resolve_fusions(args: argparse.Namespace, *, uses_te_spec: bool, local_attention: bool,
                    have: Callable[[str], bool] = module_importable) -> FusionPlan:
    """The one decision of every fusion (see [Note: what each fusion needs]).

    ``uses_te_spec`` / ``local_attention``: the layer spec and attention that
    :func:`~.layer_specs.resolve_attention` chose. ``have(module)`` says whether a module imports
    (tests pass a fake to simulate Apex / TE / the softmax extensions absent or present).
    Raises ``ValueError`` naming the flag and the package when an explicit request cannot be
    honoured."""
    cuda = getattr(args, "device", "cpu") == "cuda"
    fallbacks = []

    def decide(name: str, requested: bool, needs: str, available: bool) -> bool:
        if not requested:
            fallbacks.append((name, f"{FUSION_FLAGS[name].split(' / ')[0]} given"))
            return False
        if not cuda:
            return False            # CPU: nothing fused, nothing to report per switch
        if not available:
            fallbacks.append((name, f"needs {needs}"))
            return False
        return True

    apex = have("apex")
    persist = decide("persist_layer_norm", _given(args, "persist_layer_norm"),
                     "Apex (apex.contrib.layer_norm) on the local spec",
                     not uses_te_spec and apex and have(APEX_FUSED_LN) and have(APEX_PERSIST_LN))
    if uses_te_spec and cuda and persist is False and _given(args, "persist_layer_norm"):
        fallbacks.pop()             # TE's spec has its own norms: nothing falls back
    softmax = decide("masked_softmax_fusion", _given(args, "masked_softmax_fusion"),
                     "Megatron's fused softmax extensions (scaled_masked_softmax_cuda)",
                     local_attention and all(have(m) for m in SOFTMAX_EXTENSIONS))
    if not local_attention and cuda and _given(args, "masked_softmax_fusion") and not softmax:
        fallbacks.pop()             # SDPA / TE attention fuse the softmax themselves
    has_bias_or_glu = _given(args, "swiglu", False) or _given(args, "add_bias_linear", True)
    bias_act = decide("bias_activation_fusion",
                      _given(args, "bias_gelu_fusion") and _given(args, "bias_swiglu_fusion"),
                      "a bias or --swiglu", has_bias_or_glu)
    if cuda and not has_bias_or_glu and fallbacks and fallbacks[-1][0] == "bias_activation_fusion":
        fallbacks.pop()             # nothing to fuse
    bias_dropout = decide("bias_dropout_fusion", _given(args, "bias_dropout_fusion"), "CUDA", True)
    if _trains_on_paro_engine(args):
        wgrad = decide("gradient_accumulation_fusion", _given(args, "gradient_accumulation_fusion"),
                       "megatron-core's gradient buffers (--paro-strategy "
                       f"{args.paro_strategy} may train on the PaRO engine, which reads "
                       "param.grad)", False)
    else:
        wgrad = decide("gradient_accumulation_fusion", _given(args, "gradient_accumulation_fusion"),
                       "Apex's fused_weight_gradient_mlp_cuda (megatron-core's output layer "
                       "uses it under every spec)", have(APEX_WGRAD))
    rope = getattr(args, "position_embedding_type", "learned_absolute") == "rope"
    explicit_rope = bool(getattr(args, "apply_rope_fusion_explicit", False))
    if explicit_rope and not (cuda and have(TE)):
        raise ValueError("--apply-rope-fusion needs Transformer Engine (transformer_engine) on "
                         "CUDA; it is not installed or this is not a CUDA run: drop the flag")
    rope_fusion = False
    if rope:
        rope_fusion = decide("apply_rope_fusion", _given(args, "apply_rope_fusion"),
                             "Transformer Engine", have(TE))

    if have(TE) and cuda:
        optimizer, multi = "transformer_engine", "transformer_engine"
    elif apex and have(APEX_OPTIMIZERS) and have(APEX_MULTI_TENSOR) and cuda:
        optimizer, multi = "apex", "apex"
    elif cuda:
        optimizer, multi = "torch-fused", "torch-foreach"
    else:
        optimizer, multi = "torch", "megatron-core"
    return FusionPlan(persist_layer_norm=persist, masked_softmax_fusion=softmax,
                      bias_activation_fusion=bias_act, bias_dropout_fusion=bias_dropout,
                      gradient_accumulation_fusion=wgrad, apply_rope_fusion=rope_fusion,
                      optimizer=optimizer, multi_tensor=multi, fallbacks=tuple(fallbacks))


def fusion_plan(args: argparse.Namespace,
                have: Callable[[str], bool] = module_importable) -> FusionPlan:
    """:func:`resolve_fusions` for a parsed command line (the attention and spec from
    :func:`~.layer_specs.attention_choice`)."""
    from megatron.training.model.layer_specs import attention_choice

    choice = attention_choice(args)
    return resolve_fusions(args, uses_te_spec=choice.uses_te,
                           local_attention=choice.impl == "local", have=have)


def _steps_to_param_devices(adam: torch.optim.Optimizer, group: Dict[str, Any]) -> bool:
    """Put each parameter's ``step`` on the parameter's device as fp32, as torch's fused Adam
    makes it. A checkpoint written without ``fused`` (a CPU run, an older version) loads its
    steps as host scalars, and so does megatron-core's distributed optimizer without Apex/TE;
    torch's fused kernel does not check, and would be handed a host pointer."""
    moved = False
    for p in group["params"]:
        state = adam.state.get(p)
        step = state.get("step") if state else None
        if torch.is_tensor(step) and (step.device != p.device or step.dtype != torch.float32):
            state["step"] = step.detach().to(device=p.device, dtype=torch.float32)
            moved = True
    return moved


def apply_optimizer_fusions(plan: FusionPlan, optimizer: Any) -> List[str]:
    """Make the built optimizer use what ``plan`` chose; returns what it changed (for tests and
    the log). Called after the optimizer is built and again after a checkpoint load (a loaded
    param group brings the saved ``fused`` setting back).

    * ``torch-fused``: megatron-core built torch's AdamW/Adam with torch's default (the for-each
      kernels); its ``fused=True`` kernel does the whole update in one launch per dtype/device
      group. Set per param group before the first step (the state's ``step`` tensors are then
      made on the device, as fused needs); after a load, host ``step`` tensors move to their
      parameter's device.
    * ``torch-foreach``: megatron-core's grad-norm / scale fallbacks become ``_foreach`` ops
      (:func:`~megatron.distributed.mcore_compat.ops.install_foreach_multi_tensor_ops`)."""
    from megatron.distributed.mcore_compat.ops import install_foreach_multi_tensor_ops
    from megatron.distributed.mcore_compat.optimizer import leaf_optimizers

    changed: List[str] = []
    if plan.optimizer == "torch-fused":
        for leaf in leaf_optimizers(optimizer):
            inner = getattr(leaf, "optimizer", None)
            if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
                for group in inner.param_groups:
                    if not group.get("fused"):
                        group["fused"], group["foreach"] = True, False
                        changed.append("adam:fused")
                    if _steps_to_param_devices(inner, group):
                        changed.append("adam:step-to-device")
    if plan.multi_tensor == "torch-foreach":
        install_foreach_multi_tensor_ops()
        changed.append("multi-tensor:foreach")
    return changed
