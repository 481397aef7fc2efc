"""SDPA core attention (megatron/training/model/sdpa_attention.py) and ``--attention-backend``.

Why: without Transformer Engine, megatron-core 0.16.1's only attention is the unfused
``DotProductAttention`` (most of a GPU step's time). ``SDPAttention`` replaces it in the local
spec on ``torch.nn.functional.scaled_dot_product_attention``; these tests pin that it computes
the same thing, on CPU, against megatron-core's module itself:

* fp32, forward and the gradients of query/key/value: max |diff| <= 1e-5 x max |reference|
  (measured <= 3.5e-7: fp32 rounding of differently ordered sums), for causal attention, GQA
  (8 query heads on 2 groups), query-key layer scaling, an explicit softmax scale, a padding
  mask with GQA and an explicit causal mask;
* bf16: both modules' error against an fp64 run of ``DotProductAttention`` is of the same size
  (SDPA's <= 2x the reference's + 1e-3; measured 0.6-1.4x, ~8e-3 of max |value|), and the two
  differ by <= 2e-2 x max |reference| (measured <= 8.6e-3);
* dropout: the same keep rate (1 - p within 5 standard deviations), the 1/(1-p) scaling, no
  dropout in eval mode, draws from the tensor-parallel RNG tracker (the default generator is left
  as it was), the same mask under the same seed and another under another seed;
* selective recompute re-draws the same dropout mask (bit-identical gradients, and the core
  attention really ran twice);
* the layer spec, the state dict (identical keys, interchangeable weights), one training run on
  CPU with the SDPA spec, and a resume from a checkpoint written under megatron-core's attention.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import Iterator, List

import pytest
import torch
import torch.distributed as dist

from dist_harness import model_parallel_world_of_one
from megatron.training.model import layer_specs


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def world1() -> Iterator[None]:
    """A gloo world of one with megatron-core's model-parallel groups, in scoped CPU mode; the
    seed adds the tensor-parallel RNG tracker's state (dropout forks it)."""
    with model_parallel_world_of_one(seed=0):
        yield


def _seed(seed: int) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _config(**kw):
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=2, hidden_size=128, num_attention_heads=8, attention_dropout=0.0,
                masked_softmax_fusion=False, use_cpu_initialization=True)
    base.update(kw)
    return TransformerConfig(**base)


def _pair(cfg, mask_type, layer_number: int = 2, **kw):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron.training.model.sdpa_attention import SDPAttention

    return (DotProductAttention(cfg, layer_number, mask_type, "self", **kw),
            SDPAttention(cfg, layer_number, mask_type, "self", **kw))


def _run(module, q, k, v, mask, dout, dtype) -> List[torch.Tensor]:
    """Output and gradients of query, key, value (as fp64) for inputs cast to ``dtype``."""
    ts = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
    out = module(*ts, mask)
    out.backward(dout.to(dtype))
    return [out.detach().double()] + [t.grad.double() for t in ts]


def _rel(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    """max over tensors of max |a - b| / max |b|."""
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))


# ------------------------------------------------------------------------------------ resolver
def _args(**kw) -> argparse.Namespace:
    base = dict(attention_backend="auto", device="cpu", bf16=True, fp16=False,
                attention_dropout=0.1)
    base.update(kw)
    return argparse.Namespace(**base)


def test_resolver_rules(monkeypatch) -> None:
    resolve = layer_specs.resolve_attention
    monkeypatch.setattr(layer_specs, "_have_te", lambda: False)
    impl = {b: resolve(_args(device="cuda", attention_backend=b)).impl
            for b in layer_specs.ATTENTION_BACKENDS}
    assert impl == {"auto": "sdpa", "flash": "sdpa-flash", "fused": "sdpa-fused",
                    "unfused": "local", "local": "local"}
    assert resolve(_args()).impl == "sdpa"  # CPU: auto is SDPA too
    assert resolve(_args(attention_backend="flash", attention_dropout=0.0)).impl == "sdpa-flash"
    for bad, flag in ((_args(attention_backend="fused"), "--attention-backend fused"),
                      (_args(attention_backend="flash"), "--attention-dropout"),
                      (_args(device="cuda", attention_backend="flash", bf16=False), "--bf16")):
        with pytest.raises(ValueError, match=flag):
            resolve(bad)
    monkeypatch.setattr(layer_specs, "_have_te", lambda: True)
    for b in ("auto", "flash", "fused", "unfused"):
        assert resolve(_args(device="cuda", attention_backend=b)).impl == "transformer_engine"
    assert resolve(_args(device="cuda", attention_backend="local")).impl == "local"
    assert resolve(_args()).impl == "sdpa"  # TE's spec is for CUDA only, as before
    from megatron.core.transformer.enums import AttnBackend

    assert layer_specs.config_attention_backend(
        _args(device="cuda", attention_backend="flash")) is AttnBackend.flash
    monkeypatch.setattr(layer_specs, "_have_te", lambda: False)
    assert layer_specs.config_attention_backend(
        _args(device="cuda", attention_backend="flash")) is AttnBackend.auto


def test_flags_parse_validate_and_reach_the_config(capsys) -> None:
    from megatron.training.arguments import parse_args
    from megatron.training.model.config_builders import build_transformer_config

    base = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--mock-data", "--device", "cpu"]
    args = parse_args(base)
    assert (args.attention_backend, args.attention_impl) == ("auto", "sdpa")
    args = parse_args(base + ["--attention-backend", "local", "--group-query-attention",
                              "--num-query-groups", "2"])
    assert args.attention_impl == "local"
    assert build_transformer_config(args).num_query_groups == 2
    assert build_transformer_config(parse_args(base)).num_query_groups == 4  # MHA
    for extra, message in ((["--attention-backend", "fused"], "--attention-backend fused needs CUDA"),
                           (["--group-query-attention", "--num-query-groups", "3"],
                            "divisible by --num-query-groups")):
        with pytest.raises(SystemExit):
            parse_args(base + extra)
        assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------------ numerics
CASES = {  # name: (num_query_groups, mask type name, mask kind, config extras, module kwargs)
    "causal": (8, "causal", None, {}, {}),
    "causal-gqa": (2, "causal", None, {}, {}),
    "qk-layer-scaling": (8, "causal", None, {"apply_query_key_layer_scaling": True}, {}),
    "softmax-scale": (8, "causal", None, {}, {"softmax_scale": 0.05}),
    "padding-mask-gqa": (2, "padding", "random", {}, {}),
    "explicit-causal-mask": (8, "causal", "causal+random", {}, {}),
}


def _inputs(groups: int, mask_kind, sq: int = 48, b: int = 2):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sq, b, 8, 16, generator=g, dtype=torch.float64)
    k = torch.randn(sq, b, groups, 16, generator=g, dtype=torch.float64)
    v = torch.randn(sq, b, groups, 16, generator=g, dtype=torch.float64)
    dout = torch.randn(sq, b, 128, generator=g, dtype=torch.float64)
    mask = None
    if mask_kind is not None:  # megatron's convention: True = masked out; the diagonal stays
        mask = torch.rand(b, 1, sq, sq, generator=g) < 0.3
        mask[..., torch.arange(sq), torch.arange(sq)] = False
        if mask_kind == "causal+random":
            mask |= torch.ones(sq, sq, dtype=torch.bool).triu(1)
    return q, k, v, mask, dout


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_dot_product_attention(world1, case: str) -> None:
    from megatron.core.transformer.enums import AttnMaskType

    groups, mask_type, mask_kind, cfg_kw, mod_kw = CASES[case]
    q, k, v, mask, dout = _inputs(groups, mask_kind)
    # fp32
    ref, new = _pair(_config(num_query_groups=groups, **cfg_kw), AttnMaskType[mask_type],
                     **mod_kw)
    r32, n32 = (_run(m, q, k, v, mask, dout, torch.float32) for m in (ref, new))
    assert _rel(n32, r32) <= 1e-5, _rel(n32, r32)
    # bf16 (megatron's softmax in fp32, as by default), against an fp64 run of the reference
    ref, new = _pair(_config(num_query_groups=groups, bf16=True, params_dtype=torch.bfloat16,
                             **cfg_kw), AttnMaskType[mask_type], **mod_kw)
    rb, nb = (_run(m, q, k, v, mask, dout, torch.bfloat16) for m in (ref, new))
    ref.scale_mask_softmax.input_in_bf16 = ref.scale_mask_softmax.input_in_float16 = False
    exact = _run(ref, q, k, v, mask, dout, torch.float64)
    assert _rel(nb, exact) <= 2 * _rel(rb, exact) + 1e-3, (_rel(nb, exact), _rel(rb, exact))
    assert _rel(nb, rb) <= 2e-2, _rel(nb, rb)


def test_flash_kernel_on_cpu_matches(world1) -> None:
    """--attention-backend flash on CPU (no dropout): torch's CPU flash kernel, same numbers."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.training.model.sdpa_attention import SDPAttentionFlash

    q, k, v, _, dout = _inputs(2, None)
    cfg = _config(num_query_groups=2)
    ref, _ = _pair(cfg, AttnMaskType.causal)
    flash = SDPAttentionFlash(cfg, 2, AttnMaskType.causal, "self")
    got, want = (_run(m, q, k, v, None, dout, torch.float32) for m in (flash, ref))
    assert _rel(got, want) <= 1e-5


def _dropout_probe(module, p: float, seed: int, sk: int = 32, b: int = 4, heads: int = 8):
    """Uniform attention (q = k = 0) over one-hot values: output [i, b, h, j] is 1/sk times the
    dropout mask of query i and key j, scaled by 1/(1-p)."""
    q = torch.zeros(sk, b, heads, sk)
    k = torch.zeros(sk, b, heads, sk)
    v = torch.eye(sk).reshape(sk, 1, 1, sk).expand(sk, b, heads, sk).contiguous()
    _seed(seed)
    with torch.no_grad():
        return module(q, k, v, None).reshape(sk, b, heads, sk) * sk * (1 - p)


def test_dropout_keep_rate_scaling_and_determinism(world1) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.enums import AttnMaskType

    p = 0.25
    cfg = _config(num_attention_heads=8, hidden_size=256, kv_channels=32, attention_dropout=p)
    ref, new = _pair(cfg, AttnMaskType.padding)
    n = 32 * 4 * 8 * 32
    for module in (ref, new):
        module.train()
        keep = _dropout_probe(module, p, seed=7)
        assert torch.allclose(keep, keep.round(), atol=1e-5)  # 0 or 1/(1-p) exactly scaled
        assert set(keep.round().unique().tolist()) == {0.0, 1.0}
        rate = keep.round().mean().item()
        assert abs(rate - (1 - p)) <= 5 * math.sqrt(p * (1 - p) / n), (type(module), rate)
        assert torch.equal(keep, _dropout_probe(module, p, seed=7))  # same seed, same mask
        assert not torch.equal(keep, _dropout_probe(module, p, seed=8))
        # Drawn from the tensor-parallel tracker's stream: the default generator is untouched.
        _seed(3)
        default, tracker = torch.get_rng_state(), get_cuda_rng_tracker().get_states()
        with torch.no_grad():
            module(torch.zeros(32, 4, 8, 32), torch.zeros(32, 4, 8, 32),
                   torch.zeros(32, 4, 8, 32), None)
        assert torch.equal(default, torch.get_rng_state())
        assert not all(torch.equal(tracker[n_], s) for n_, s in
                       get_cuda_rng_tracker().get_states().items())
        module.eval()
        assert torch.equal(_dropout_probe(module, 0.0, seed=7), torch.ones(32, 4, 8, 32))


def test_refuses_what_it_cannot_do(world1) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.training.model.sdpa_attention import SDPAttention

    with pytest.raises(ValueError, match="--context-parallel-size"):
        SDPAttention(_config(context_parallel_size=2), 1, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match="--softmax-type"):
        SDPAttention(_config(softmax_type="off-by-one"), 1, AttnMaskType.causal, "self")
    attn = SDPAttention(_config(), 1, AttnMaskType.causal, "self")
    q = torch.zeros(4, 1, 8, 16)
    with pytest.raises(ValueError, match="packed sequences"):
        attn(q, q, q, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    with pytest.raises(ValueError, match="attention_bias"):
        attn(q, q, q, None, attention_bias=torch.zeros(1, 8, 4, 4))


# ------------------------------------------------------------------------------------ model
def _gpt(backend: str, **cfg_kw):
    from megatron.core.models.gpt import GPTModel

    cfg = _config(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                  hidden_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
                  persist_layer_norm=False, gradient_accumulation_fusion=False, **cfg_kw)
    args = argparse.Namespace(device="cpu", attention_backend=backend, normalization="LayerNorm",
                              attention_dropout=cfg.attention_dropout, bf16=False, fp16=False)
    _seed(1234)
    spec = layer_specs.gpt_layer_spec(args, cfg)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=128,
                    max_sequence_length=32, position_embedding_type="rope")


def _core(model):
    return model.decoder.layers[0].self_attention.core_attention


def test_spec_and_state_dict_are_interchangeable(world1) -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron.training.model.sdpa_attention import SDPAttention

    sdpa, local = _gpt("auto"), _gpt("local")
    assert type(_core(sdpa)) is SDPAttention and type(_core(local)) is DotProductAttention
    assert type(_core(_gpt("unfused"))) is DotProductAttention
    assert list(_core(sdpa).parameters()) == [] and list(_core(sdpa).buffers()) == []
    assert sdpa.state_dict().keys() == local.state_dict().keys()
    sdpa.load_state_dict(local.state_dict(), strict=True)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(32).unsqueeze(0).expand(2, -1)
    sdpa.eval(), local.eval()
    with torch.no_grad():
        a, b = sdpa(tokens, pos, None), local(tokens, pos, None)
    assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5
    # Sequence parallelism swaps the norms in a block spec; the SDPA attention stays.
    cfg = _config(sequence_parallel=True, tensor_model_parallel_size=2)
    block = layer_specs.gpt_layer_spec(argparse.Namespace(
        device="cpu", attention_backend="auto", normalization="LayerNorm",
        attention_dropout=0.0, bf16=False, fp16=False), cfg)
    assert (block.layer_specs[0].submodules.self_attention.submodules.core_attention
            is SDPAttention)


def test_selective_recompute_redraws_the_same_dropout(world1) -> None:
    """``--recompute-granularity selective`` checkpoints the core attention: its recomputation
    must reproduce the dropout mask, so gradients equal those of the run without recompute."""
    from megatron.training.model.sdpa_attention import SDPAttention

    grads, calls = [], []
    for recompute in (None, "selective"):
        model = _gpt("auto", attention_dropout=0.3, recompute_granularity=recompute)
        model.train()
        count = [0]
        hook = _core(model).register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(32).unsqueeze(0).expand(2, -1)
        _seed(99)
        loss = model(tokens, pos, None, labels=tokens).float().mean()
        loss.backward()
        hook.remove()
        assert type(_core(model)) is SDPAttention
        grads.append([p.grad.clone() for p in model.parameters()])
        calls.append(count[0])
    assert calls == [1, 2]  # recomputed once in backward
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# ------------------------------------------------------------------------------------ trainer
def test_trains_with_sdpa_and_resumes_from_a_local_attention_checkpoint(tmp_path: Path,
                                                                        run_pretrain) -> None:
    """Train 2 iterations with megatron-core's attention and save; resume with the default
    (SDPA on CPU): the checkpoint records the implementation, the weights load unchanged, the
    log says what changed, and training continues."""
    common = ["--global-batch-size", "2", "--lr", "3e-3", "--log-interval", "1",
              "--eval-iters", "0", "--split", "100,0,0", "--bf16", "--group-query-attention",
              "--num-query-groups", "2"]
    ckpt = tmp_path / "ckpt"
    first = run_pretrain(common + ["--train-iters", "2", "--attention-backend", "local",
                                   "--save", str(ckpt), "--save-interval", "2"], nproc=1,
                         timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert " > attention: local (megatron-core's unfused DotProductAttention" in first.stdout
    saved = torch.load(next((ckpt / "iter_0000002").glob("mp_rank_*.pt")), map_location="cpu",
                       weights_only=False)["args"]
    assert (saved.attention_backend, saved.attention_impl) == ("local", "local")

    second = run_pretrain(common + ["--train-iters", "4", "--load", str(ckpt),
                                    "--use-checkpoint-opt_param-scheduler"], nproc=1,
                          timeout=300)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    out = second.stdout
    assert " > attention: sdpa (torch scaled_dot_product_attention" in out
    assert ("attention changed on resume: the checkpoint was written with local "
            "(--attention-backend local), this run uses sdpa (--attention-backend auto)") in out
    losses = [float(x) for x in re.findall(r"lm loss: ([\d.E+-]+)", out)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), out[-2000:]


def test_torch_format_checkpoint_names_a_te_to_local_switch() -> None:
    """TE's spec fuses the layer norms into its linear layers (other state-dict names): a
    ``--ckpt-format torch`` checkpoint of it cannot load into the local spec, and the layout
    check names the flag instead of a missing-keys error."""
    from megatron.training.checkpoint import torch_format as checkpoint_torch_format
    from megatron.training.errors import StartupError

    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              data_parallel_size=1, use_distributed_optimizer=False,
                              paro_strategy=None, attention_backend="auto",
                              attention_impl="sdpa")
    saved = argparse.Namespace(**{**vars(args), "attention_impl": "transformer_engine"})
    with pytest.raises(StartupError, match=r"--attention-backend auto \(transformer_engine\) -> "
                                           r"auto \(sdpa\)"):
        checkpoint_torch_format._check_same_layout("ckpt", saved, args)
    for impl in ("local", "sdpa-flash", None):  # same weights, or not recorded: loads
        checkpoint_torch_format._check_same_layout("ckpt", argparse.Namespace(
            **{**vars(args), "attention_impl": impl}), args)
    assert layer_specs.attention_resume_note({"attention_impl": "sdpa"}, args) is None
    assert layer_specs.attention_resume_note({}, args) is None  # older checkpoints
    note = layer_specs.attention_resume_note({"attention_impl": "transformer_engine",
                                              "attention_backend": "auto"}, args)
    assert "maps TE's and the local spec's layer-norm names" in note
