"""The fusion resolver (megatron/training/model/fusions.py): one decision from what is installed.

Why (issue 23): the trainer set ``persist_layer_norm`` and ``masked_softmax_fusion`` whenever it
ran on CUDA. Without Apex megatron-core's torch norm asserts at model build, and without Megatron's
fused softmax extensions the first forward fails: no CUDA run without Apex could start. Here the
packages are simulated absent or present (``have``), the plan is checked switch by switch, and the
CUDA settings of a machine without Apex/TE build a model and run a training step on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from dist_harness import model_parallel_world_of_one
from megatron.training.arguments import parse_args
from megatron.training.arguments.validation import ArgumentError, validate_args
from megatron.training.model.fusions import apply_optimizer_fusions, fusion_plan, resolve_fusions

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
        "--mock-data", "--vocab-size", "128", "--tokenizer-type", "NullTokenizer"]

NOTHING = frozenset()
APEX = frozenset({"apex", "apex.normalization.fused_layer_norm",
                  "apex.contrib.layer_norm.layer_norm", "fused_weight_gradient_mlp_cuda",
                  "apex.optimizers", "amp_C", "scaled_masked_softmax_cuda",
                  "scaled_upper_triang_masked_softmax_cuda"})
TE = frozenset({"transformer_engine"})


def _args(device: str, extra=(), **kw) -> argparse.Namespace:
    args = parse_args(BASE + ["--device", device] + list(extra), validate=False)
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def _plan(device, installed, *, te_spec=False, local_attention=False, extra=(), **kw):
    return resolve_fusions(_args(device, extra, **kw), uses_te_spec=te_spec,
                           local_attention=local_attention, have=installed.__contains__)


def test_cpu_fuses_nothing() -> None:
    plan = _plan("cpu", APEX | TE)
    assert not any(plan.transformer_config_kwargs().values())
    assert (plan.optimizer, plan.multi_tensor, plan.fallbacks) == ("torch", "megatron-core", ())


def test_cuda_without_apex_or_te_is_buildable_and_says_what_falls_back() -> None:
    """The H100 of issue 23: torch + triton only."""
    plan = _plan("cuda", NOTHING)
    assert plan.persist_layer_norm is False and plan.masked_softmax_fusion is False
    assert plan.gradient_accumulation_fusion is False and plan.apply_rope_fusion is False
    assert plan.bias_activation_fusion and plan.bias_dropout_fusion      # jit: no package
    assert (plan.optimizer, plan.multi_tensor) == ("torch-fused", "torch-foreach")
    line = plan.summary()
    assert "fused: bias_activation_fusion, bias_dropout_fusion" in line
    assert "persist_layer_norm (needs Apex" in line and "gradient_accumulation_fusion" in line
    # SDPA fuses its own softmax: nothing to report for masked_softmax_fusion
    assert "masked_softmax_fusion" not in line
    # with megatron-core's local attention the softmax does fall back, and says why
    local = _plan("cuda", NOTHING, local_attention=True)
    assert "masked_softmax_fusion (needs Megatron's fused softmax" in local.summary()


def test_cuda_with_apex_on_the_local_spec() -> None:
    plan = _plan("cuda", APEX, local_attention=True)
    assert plan.persist_layer_norm and plan.masked_softmax_fusion
    assert plan.gradient_accumulation_fusion and plan.optimizer == "apex"
    assert plan.fallbacks == ()


def test_cuda_with_te_spec() -> None:
    plan = _plan("cuda", TE | APEX, te_spec=True, position_embedding_type="rope")
    assert plan.persist_layer_norm is False and plan.masked_softmax_fusion is False
    assert plan.gradient_accumulation_fusion and plan.apply_rope_fusion
    assert (plan.optimizer, plan.multi_tensor) == ("transformer_engine", "transformer_engine")
    assert plan.fallbacks == ()


def _output_layer_with(**config_kw) -> None:
    """Build the GPT output layer as megatron-core's GPTModel does under every spec."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    with model_parallel_world_of_one():
        cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                                use_cpu_initialization=True, **config_kw)
        ColumnParallelLinear(64, 128, config=cfg, init_method=cfg.init_method, bias=False,
                             skip_bias_add=False, gather_output=False)


def test_te_without_apex_keeps_the_output_layer_buildable() -> None:
    """TE's linear layers fuse the weight-gradient accumulation themselves, but the GPT output
    layer is megatron-core's ColumnParallelLinear under every spec, and its constructor raises
    without Apex's fused_weight_gradient_mlp_cuda: a pip install of TE alone could not build the
    model on CUDA. Off, and the line says why."""
    plan = _plan("cuda", TE, te_spec=True, position_embedding_type="rope")
    assert plan.gradient_accumulation_fusion is False and plan.apply_rope_fusion
    assert "gradient_accumulation_fusion (needs Apex's fused_weight_gradient_mlp_cuda" \
        in plan.summary()
    from megatron.core.tensor_parallel import layers
    if not layers._grad_accum_fusion_available:      # what the plan avoids, on this machine
        with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
            _output_layer_with(gradient_accumulation_fusion=True)
    _output_layer_with(gradient_accumulation_fusion=plan.gradient_accumulation_fusion)


@pytest.mark.parametrize("strategy", ["auto", "NIG"])
def test_paro_engine_runs_without_gradient_accumulation_fusion(strategy: str) -> None:
    """Issue 25 item 10: TE's (or Apex's) fused weight-gradient GEMM writes into megatron-core's
    ``main_grad`` buffers and leaves ``param.grad`` empty; the PaRO engine's hooks read
    ``param.grad``, so the fusion would drop every weight gradient. Off, and the line says why."""
    for installed, te_spec in ((TE | APEX, True), (APEX, False)):
        plan = _plan("cuda", installed, te_spec=te_spec, paro_strategy=strategy)
        assert plan.gradient_accumulation_fusion is False
        assert ("gradient_accumulation_fusion (needs megatron-core's gradient buffers"
                in plan.summary())
        ddp = _plan("cuda", installed, te_spec=te_spec)
        assert ddp.gradient_accumulation_fusion      # only that switch changes
        assert dataclasses.replace(plan, gradient_accumulation_fusion=True, fallbacks=()) == ddp
    for megatron_core_ddp in (None, "NNG"):
        assert _plan("cuda", TE | APEX, te_spec=True,
                     paro_strategy=megatron_core_ddp).gradient_accumulation_fusion


def test_no_flags_turn_fusions_off_with_the_flag_as_reason() -> None:
    plan = _plan("cuda", APEX, local_attention=True,
                 extra=["--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
                        "--no-bias-dropout-fusion"])
    assert not (plan.persist_layer_norm or plan.gradient_accumulation_fusion
                or plan.bias_dropout_fusion)
    assert dict(plan.fallbacks) == {
        "persist_layer_norm": "--no-persist-layer-norm given",
        "gradient_accumulation_fusion": "--no-gradient-accumulation-fusion given",
        "bias_dropout_fusion": "--no-bias-dropout-fusion given"}


def test_explicit_rope_fusion_without_te_stops_the_launch() -> None:
    argv = BASE + ["--device", "cpu", "--position-embedding-type", "rope", "--apply-rope-fusion"]
    with pytest.raises(ArgumentError, match="--apply-rope-fusion needs Transformer Engine"):
        validate_args(parse_args(argv, validate=False))


def test_cuda_settings_without_apex_build_a_model_and_train_a_step_on_cpu(monkeypatch) -> None:
    """The transformer config a CUDA machine without Apex/TE gets, built and stepped on the CPU
    (megatron-core's jit-fused bias-GeLU / bias-dropout-add run on CPU tensors too)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from megatron.training.model.layer_specs import gpt_layer_spec

    plan = _plan("cuda", NOTHING)
    with model_parallel_world_of_one(seed=1):
        config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                   use_cpu_initialization=True, hidden_dropout=0.1,
                                   **plan.transformer_config_kwargs())
        model = GPTModel(config=config, transformer_layer_spec=gpt_layer_spec(_args("cpu"), config),
                         vocab_size=128, max_sequence_length=32)
        tokens = torch.randint(0, 128, (2, 32))
        position_ids = torch.arange(32).unsqueeze(0).expand(2, -1)
        loss = model(tokens, position_ids, None, labels=tokens).float().mean()
        loss.backward()
        assert torch.isfinite(loss)
        assert all(p.grad is not None and torch.isfinite(p.grad).all()
                   for p in model.parameters())


def test_fused_adamw_and_foreach_ops_match_the_unfused_step(monkeypatch) -> None:
    """``torch-fused`` sets torch AdamW's fused kernel on megatron-core's optimizer (which builds
    it with torch's default) and the ``_foreach`` grad-norm/scale replace megatron-core's loops:
    same update within fp32 rounding (fused and for-each AdamW order the arithmetic
    differently)."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    from megatron.distributed.mcore_compat import ops as mcore_compat_ops

    for module, name in ((clip_grads, "l2_norm_impl"), (clip_grads, "multi_tensor_scale_impl"),
                         (mcore_optimizer, "multi_tensor_scale_impl")):
        monkeypatch.setattr(module, name, getattr(module, name))   # restored after the test

    class Leaf:
        def __init__(self, opt):
            self.optimizer = opt

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    grads = [torch.randn_like(p) for p in params]
    fused_opt = torch.optim.AdamW(params, lr=1e-2)
    plain_opt = torch.optim.AdamW(twins, lr=1e-2)
    changed = apply_optimizer_fusions(_plan("cuda", NOTHING), Leaf(fused_opt))
    assert changed == ["adam:fused", "multi-tensor:foreach"]
    assert clip_grads.l2_norm_impl is mcore_compat_ops.foreach_multi_tensor_l2_norm
    for _ in range(3):
        for p, t, g in zip(params, twins, grads):
            p.grad, t.grad = g.clone(), g.clone()
        fused_opt.step()
        plain_opt.step()
    for p, t in zip(params, twins):
        torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)
    assert fused_opt.param_groups[0]["fused"] is True

    # after a load of a checkpoint written without fused (a CPU run): host fp64-or-fp32 steps
    # move to the parameters' device (meta here: the fused kernel would get a host pointer)
    on_device = [torch.nn.Parameter(torch.empty(8, device="meta"))]
    loaded = torch.optim.AdamW(on_device, lr=1e-2)
    loaded.state[on_device[0]]["step"] = torch.tensor(3.0, dtype=torch.float64)
    assert "adam:step-to-device" in apply_optimizer_fusions(_plan("cuda", NOTHING), Leaf(loaded))
    step = loaded.state[on_device[0]]["step"]
    assert (step.device.type, step.dtype) == ("meta", torch.float32)
    assert "adam:step-to-device" not in apply_optimizer_fusions(_plan("cuda", NOTHING),
                                                                Leaf(loaded))

    # the _foreach replacements against an fp64 norm and megatron-core's own scale
    tensors = [torch.randn(1000), torch.randn(37, 5)]
    ours, _ = mcore_compat_ops.foreach_multi_tensor_l2_norm(0, None, [tensors], False)
    ref = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in tensors]).double())
    assert ours.shape == (1,) and abs(ours.item() - ref.item()) <= 1e-5 * ref.item()
    a, b = [t.clone() for t in tensors], [torch.empty_like(t) for t in tensors]
    mcore_compat_ops.foreach_multi_tensor_scale(0, None, [a, b], 0.5)
    mcore_utils.local_multi_tensor_scale(0, None, [a, a], 0.5)      # in place, megatron-core's
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_foreach_scale_makes_its_products_a_group_at_a_time(monkeypatch) -> None:
    """fp16 training copies every main param into the model through the scale op each step: its
    out-of-place products were one temporary of all tensors at once (4 bytes per parameter at
    the step's peak). Now a bounded group at a time, the same values as megatron-core's
    per-tensor loop, and a scale of 1 makes none."""
    from megatron.core import utils as mcore_utils

    from megatron.distributed.mcore_compat import ops as mcore_compat_ops

    monkeypatch.setattr(mcore_compat_ops, "FOREACH_SCALE_GROUP_NUMEL", 1000)
    groups = []
    real_mul = torch._foreach_mul
    monkeypatch.setattr(torch, "_foreach_mul",
                        lambda ts, s: groups.append(sum(t.numel() for t in ts)) or real_mul(ts, s))
    src = [torch.randn(n) for n in (600, 300, 900, 2500, 50)]
    for scale in (0.5, 1.0):
        groups.clear()
        ours = [torch.empty(t.shape, dtype=torch.float16) for t in src]
        want = [torch.empty(t.shape, dtype=torch.float16) for t in src]
        mcore_compat_ops.foreach_multi_tensor_scale(0, None, [src, ours], scale)
        mcore_utils.local_multi_tensor_scale(0, None, [src, want], scale)
        assert all(torch.equal(x, y) for x, y in zip(ours, want))
        # a group holds whole tensors up to the bound (a larger tensor alone)
        assert groups == ([900, 900, 2500, 50] if scale != 1.0 else []), groups
