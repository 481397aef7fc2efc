"""tools/checkpoint/convert_from_hf.py: Hugging Face models imported into our trainer compute
HF's logits and loss, and export back (convert_to_hf.py) to the very same tensors.

Models: tiny random fp32 HF models built from a config (every weight drawn at random, norms and
biases included, so a swapped or transposed tensor shows), one per family and attention kind:
GPT-2 (MHA, tied, gelu_new), Llama (GQA, untied, rope_theta 500000), Llama 3.1 (llama3 RoPE
scaling, MQA, tied), Mistral (GQA, head_dim != hidden/heads, sliding window >= sequence), Qwen2
(QKV bias, tied), Mixtral (GQA, untied, 4 experts top-2: megatron-core's MoE layer with the
alltoall dispatcher and the sequential expert MLPs; round trip against the tensors HF's
``save_pretrained`` writes, ``block_sparse_moe.experts.E.w1/w2/w3``).  Vocabulary 100 -> padded to 128 (256 at TP=2): the padding logits are masked
(``--mask-padded-vocab-logits``), or the loss would differ.

Per family (in this process, a gloo world of one): the trainer's own model (flags derived by the
importer, built with ``build_transformer_config`` / ``model_provider``) with the imported
weights: max |logit diff| <= 1e-4, the trainer's loss (``step.loss_func`` over the model's
per-token loss) within 1e-5 of HF's; and the export mapping gives back HF's tensors bit for bit.
The same for every family at TP=2 PP=2 in one 4-rank gloo job (spawned once): each rank builds
its stage and TP shard with the converter's functions and runs megatron-core's forward-only
pipeline schedule (Llama 3.1's single KV head included: megatron-core replicates it over TP;
Mixtral with --sequence-parallel, which megatron-core's MoE layer needs at TP > 1, and the
allgather dispatcher, the one gloo runs at TP > 1: its router replicated, each expert's MLP
split like the dense one).

End to end (``pretrain_gpt.py`` under torchrun, this file as the entry point: after the trainer's
own ``load_checkpoint`` every rank computes logits on fixed tokens, and the first training
batches are recorded): Llama imported at TP=1 PP=1 (torch_dist) and Qwen2 at TP=2 PP=2 on 4
ranks (torch): logits, the logged loss of iteration 1 against HF's loss on the recorded batches,
convert_to_hf.py's export bit-identical to the HF weights; then SDP4Bit + LoCo continued
pretraining of the imported Llama on 2 data-parallel ranks, starting at HF's loss.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
VOCAB = 100
SEQ = 32
OUT_ENV = "CONVERT_FROM_HF_OUT"
RESULTS: Dict[str, Dict[str, Any]] = {}


# ----------------------------------------------------------------------------- HF models
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm weights around 1), so that no mapping mistake hides behind
    a zero bias or a unit norm."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            norm = "norm" in name or ".ln_" in name
            p.copy_(1 + 0.1 * noise if norm and name.endswith("weight") else 0.08 * noise)


def hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                              MistralConfig, MistralForCausalLM, MixtralConfig,
                              MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    llama_like = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6)
    if family == "gpt2":
        cfg, cls = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                              activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                              attn_pdrop=0.0), GPT2LMHeadModel
    elif family == "llama":
        cfg, cls = LlamaConfig(**llama_like, num_key_value_heads=2, tie_word_embeddings=False,
                               rope_parameters=dict(rope, rope_theta=500000.0)), LlamaForCausalLM
    elif family == "llama3.1":
        cfg, cls = LlamaConfig(**llama_like, num_key_value_heads=1, tie_word_embeddings=True,
                               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 8192}
                               ), LlamaForCausalLM
    elif family == "mistral":
        cfg, cls = MistralConfig(**llama_like, num_key_value_heads=2, head_dim=32,
                                 sliding_window=64, tie_word_embeddings=False,
                                 rope_parameters=rope), MistralForCausalLM
    elif family == "qwen2":
        cfg, cls = Qwen2Config(**llama_like, num_key_value_heads=2, tie_word_embeddings=True,
                               rope_parameters=rope), Qwen2ForCausalLM
    elif family == "mixtral":
        cfg, cls = MixtralConfig(**llama_like, num_key_value_heads=2, num_local_experts=4,
                                 num_experts_per_tok=2, tie_word_embeddings=False,
                                 rope_parameters=dict(rope, rope_theta=1e6)), MixtralForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    _randomize(model, seed)
    if getattr(cfg, "tie_word_embeddings", False):
        model.tie_weights()
    return model


def hf_checkpoint_tensors(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` writes: the model's state dict, except Mixtral in
    transformers >= 5, whose in-memory fused experts are saved under the checkpoint names
    (``block_sparse_moe.experts.E.w1/w2/w3``) -- the names the converters read and write."""
    if model.config.model_type != "mixtral":
        return {k: v.clone() for k, v in model.state_dict().items()}
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return load_file(os.path.join(d, "model.safetensors"))


def save_hf(model: torch.nn.Module, path: Path, tokenizer: bool = True) -> Path:
    model.save_pretrained(path)
    if tokenizer:
        tiny_tokenizer(path)
    return path


def tiny_tokenizer(path: Path) -> None:
    """A word-level HF tokenizer of exactly VOCAB tokens, id 0 = <eos>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)


def tokens(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def hf_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
            mask: torch.Tensor) -> Tuple[float, float]:
    """(sum of the masked per-token cross entropies, token count) on HF's logits."""
    logits = hf_logits(model, ids)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           labels.reshape(-1), reduction="none")
    m = mask.reshape(-1).float()
    return float((ce.double() * m).sum()), float(m.sum())


# ----------------------------------------------------------------------------- per family
def _trainer_args(plan: Any, tp: int = 1, pp: int = 1, micro_batch: int = 2,
                  global_batch: Optional[int] = None,
                  vocab_divisible_by: int = 128) -> argparse.Namespace:
    """The trainer's args for the importer's model flags (as the converter's writers parse them)."""
    from megatron.training.arguments import parse_args

    batch = [] if global_batch is None else ["--global-batch-size", str(global_batch)]
    return parse_args([*plan.model_flags, "--seq-length", str(SEQ), "--micro-batch-size",
                       str(micro_batch), *batch, "--train-iters", "1", "--lr", "0.0",
                       "--mock-data", "--device", "cpu", "--vocab-size", str(VOCAB),
                       "--make-vocab-size-divisible-by", str(vocab_divisible_by),
                       "--mask-padded-vocab-logits", "--tensor-model-parallel-size", str(tp),
                       "--pipeline-model-parallel-size", str(pp),
                       *(["--sequence-parallel", "--moe-token-dispatcher-type", "allgather"]
                         if plan.num_experts and tp > 1 else [])])


def _exported_model(family: str, config: Dict[str, Any],
                    sd: Dict[str, torch.Tensor]) -> torch.nn.Module:
    """The HF model convert_to_hf.py's config kwargs and tensors describe."""
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                              MixtralConfig, MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    cfg_cls, cls = {"gpt2": (GPT2Config, GPT2LMHeadModel), "llama": (LlamaConfig, LlamaForCausalLM),
                    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                    "mixtral": (MixtralConfig, MixtralForCausalLM)}[family]
    if family == "mixtral":  # checkpoint names: loaded as from a checkpoint (transformers >= 5
        import tempfile      # fuses the experts on load)

        from huggingface_hub import save_torch_state_dict

        with tempfile.TemporaryDirectory() as d:
            cfg_cls(**config).save_pretrained(d)
            save_torch_state_dict({k: v.clone() for k, v in sd.items()}, d)
            return cls.from_pretrained(d).float().eval()
    model = cls(cfg_cls(**config)).float().eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    if config["tie_word_embeddings"]:
        model.tie_weights()
    return model


@pytest.mark.parametrize("family", ["gpt2", "llama", "llama3.1", "mistral", "qwen2", "mixtral"])
def test_family_logits_loss_and_round_trip(family: str) -> None:
    """Import mapping + derived flags: HF's logits and loss from the trainer's model, and the
    export mapping (convert_to_hf's) gives back HF's tensors bit for bit."""
    from dist_harness import model_parallel_world_of_one
    from megatron.training.arguments.parser import padded_vocab_size
    from megatron.training.components import model_provider
    from megatron.training.model.config_builders import build_transformer_config
    from megatron.training.step import loss_func
    from tools.checkpoint.convert_from_hf import (ConversionError, _copy_shard,
                                                  _normalize_hf_names, plan_import, refuse_unused)
    from tools.checkpoint.hf_state_dict import from_hf, hf_config, to_hf

    hf = hf_model(family)
    plan = plan_import(hf.config, SEQ)
    hf_sd = hf_checkpoint_tensors(hf)
    full = from_hf(plan.family, _normalize_hf_names(plan.family, hf_sd), plan.num_layers,
                   plan.shape, plan.linear_bias, plan.qkv_bias, plan.tied, plan.num_experts)
    if family == "mixtral":  # transformers >= 5's in-memory names import the same
        in_memory = _normalize_hf_names(plan.family, dict(hf.state_dict()))
        assert sorted(in_memory) == sorted(hf_sd)
        assert all(torch.equal(in_memory[k], hf_sd[k]) for k in hf_sd)
    seq = tokens()
    ids, labels = seq[:, :-1], seq[:, 1:]
    with model_parallel_world_of_one(seed=0):
        args = _trainer_args(plan)
        args.model_vocab_size = VOCAB
        args.padded_vocab_size = padded_vocab_size(VOCAB, args)
        assert args.padded_vocab_size == 128
        gpt = model_provider(args, build_transformer_config(args), args.padded_vocab_size,
                             pre_process=True, post_process=True)
        used = _copy_shard(gpt, full, args, plan.tied)
        assert used == set(full)   # every converted HF tensor has its parameter
        stray = dict(full, **{"decoder.layers.0.mlp.extra.weight": torch.zeros(2)})
        with pytest.raises(ConversionError, match=r"1 HF tensor\(s\) have no parameter in the "
                                                  r"trainer's model and would be dropped: "
                                                  r"decoder\.layers\.0\.mlp\.extra\.weight"):
            refuse_unused(stray, [used])
        gpt.eval()
        positions = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
        with torch.no_grad():
            ours = gpt(ids, positions, None)
            per_token = gpt(ids, positions, None, labels=labels)
        loss_sum, count, _ = loss_func(torch.ones_like(labels), per_token)
        our_sd = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
        exported_family, exported = to_hf(args, our_sd)
    ref = hf_logits(hf, ids)
    assert ours.shape == (2, SEQ, 128)
    assert torch.isneginf(ours[..., VOCAB:]).all()  # the padding rows, masked
    diff = (ours[..., :VOCAB] - ref).abs().max().item()
    assert ref.std() > 0.1 and diff <= 1e-4, diff
    ours_loss = float(loss_sum) / int(count)
    hf_sum, hf_count = hf_loss(hf, ids, labels, torch.ones_like(labels))
    assert abs(ours_loss - hf_sum / hf_count) <= 1e-5, (ours_loss, hf_sum / hf_count)
    # Control: without the mask the zero padding rows give logits 0, which count in the softmax
    unmasked = ours.clone()
    unmasked[..., VOCAB:] = 0.0
    ce = torch.nn.functional.cross_entropy(unmasked.reshape(-1, 128), labels.reshape(-1))
    assert abs(float(ce) - ours_loss) > 1e-3

    assert exported_family == {"mistral": "llama", "llama3.1": "llama"}.get(family, family)
    weights = {k: v for k, v in hf_sd.items() if not (plan.tied and k == "lm_head.weight")}
    assert sorted(exported) == sorted(weights)
    identical = all(torch.equal(exported[k], weights[k]) for k in weights)
    assert identical
    # the exported config (RoPE base and scaling, eps, activation, biases, head_dim) rebuilds
    # the same model
    rebuilt = _exported_model(exported_family, hf_config(exported_family, args, VOCAB), exported)
    assert torch.equal(hf_logits(rebuilt, ids), ref)
    RESULTS[f"{family} TP1 PP1 (in process)"] = {
        "max |logit diff|": diff, "first-step loss": ours_loss, "HF loss": hf_sum / hf_count,
        "round trip bit-identical": identical}
    print(f"{family}: max |logit diff| {diff:.3g}, loss {ours_loss:.7f} vs HF "
          f"{hf_sum / hf_count:.7f}, round trip bit-identical {identical}")


def test_rope_scaling_changes_logits_so_the_check_sees_it() -> None:
    """Control: the Llama 3.1 model with its RoPE scaling removed computes other logits, so the
    equality above does test --use-rope-scaling (and its factor)."""
    hf = hf_model("llama3.1")
    plain = hf_model("llama3.1")
    plain.config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    from transformers import LlamaForCausalLM

    unscaled = LlamaForCausalLM(plain.config).eval()
    unscaled.load_state_dict(hf.state_dict())
    ids = tokens()[:, :-1]
    assert (hf_logits(hf, ids) - hf_logits(unscaled, ids)).abs().max() > 1e-3


def test_mixtral_router_is_megatron_core_default_router() -> None:
    """Mixtral's router (softmax over all experts, top k, renormalised) and megatron-core's
    default TopKRouter (top k of the logits, softmax over those k; the importer writes no
    --moe-router-pre-softmax) give the same experts and weights: max |diff| <= 1e-6 over 4096
    tokens, with the router weight of the tiny Mixtral.  Control: --moe-router-pre-softmax
    (softmax over all experts, not renormalised) does not."""
    from dist_harness import model_parallel_world_of_one

    from tools.checkpoint.convert_from_hf import plan_import

    hf = hf_model("mixtral")
    gate = hf.model.layers[0].mlp.gate
    moe = list(plan_import(hf.config, SEQ).model_flags)
    moe = moe[moe.index("--num-experts"):moe.index("--num-experts") + 10]
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, scores, indices = gate(x)
        expected = torch.zeros(4096, 4).scatter(1, indices, scores)
    results = {}
    with model_parallel_world_of_one(seed=0):
        for extra in ([], ["--moe-router-pre-softmax"]):
            _, m = _tiny_model("--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
                               "--ffn-hidden-size", "96", *moe, *extra)
            router = m.decoder.layers[0].mlp.router
            with torch.no_grad():
                router.weight.copy_(gate.weight)
                probs, routing_map = router(x.unsqueeze(1))
            results[bool(extra)] = (probs.float(), routing_map)
    probs, routing_map = results[False]
    assert torch.equal(routing_map, expected > 0)
    diff = (probs - expected).abs().max().item()
    assert diff <= 1e-6, diff
    pre_softmax, _ = results[True]
    assert (pre_softmax - expected).abs().max().item() > 1e-2
    RESULTS["mixtral router vs megatron-core's default"] = {"max |prob diff|": diff}


# ----------------------------------------------------------------------------- TP2 PP2, in process
TP2_PP2_FAMILIES = ("gpt2", "llama", "llama3.1", "mistral", "qwen2", "mixtral")
TP2_VOCAB_DIVISIBLE_BY = 64
"""Vocabulary 100 -> 128 rows at TP=2, 64 per TP rank, so both ranks hold real tokens (with the
default 128 x TP = 256, TP rank 1's rows would all be padding and its split go untested)."""


def _keep_logits(output: torch.Tensor, non_loss_data: bool = False) -> torch.Tensor:
    """The schedule's "loss function" with ``collect_non_loss_data``: keeps the last stage's
    (vocabulary-sharded) logits."""
    assert non_loss_data
    return output.detach().clone()


def _logits_step(data_iterator: Any, model: torch.nn.Module) -> Tuple[torch.Tensor, Any]:
    """forward_step of the logits pass: the model without labels (its logits)."""
    b = next(data_iterator)
    return model(b["tokens"], b["position_ids"], None), _keep_logits


def _tp2_pp2_job(rank: int, world: int, jobs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One of 4 gloo ranks (TP=2 x PP=2).  Per family: the trainer's model for the importer's
    flags (``get_model``, as the converter's writers build it), this rank's shard copied in by
    the converter's ``_copy_shard``, then megatron-core's forward-only pipeline schedule twice:
    for the logits (``collect_non_loss_data``; gathered over TP on the last stage) and for the
    loss, through the trainer's own ``step.evaluate`` / ``forward_step`` / ``loss_func``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    from functools import partial

    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training.arguments.parser import padded_vocab_size
    from megatron.training.components import get_model
    from megatron.training.initialize import initialize_megatron
    from megatron.training.model.config_builders import build_transformer_config
    from megatron.training.step import evaluate, forward_step

    from tools.checkpoint.convert_from_hf import _copy_shard, _unwrap, refuse_unused

    out: Dict[str, Any] = {}
    for i, job in enumerate(jobs):
        plan, full, batches = job["plan"], job["full"], job["batches"]
        args = _trainer_args(plan, tp=2, pp=2, micro_batch=1, global_batch=len(batches),
                             vocab_divisible_by=TP2_VOCAB_DIVISIBLE_BY)
        if i == 0:
            initialize_megatron(args)  # gloo is up: megatron-core's TP2 PP2 groups, once for all
        args.model_vocab_size = VOCAB
        args.padded_vocab_size = padded_vocab_size(VOCAB, args)
        model = get_model(args, build_transformer_config(args), args.padded_vocab_size)
        used = _copy_shard(_unwrap(model[0]), full, args, plan.tied)
        everyone: List[Any] = [None] * world
        torch.distributed.all_gather_object(everyone, used)
        refuse_unused(full, everyone)  # every converted HF tensor is on some rank
        for chunk in model:
            chunk.eval()
        with torch.no_grad():
            logits = get_forward_backward_func()(
                forward_step_func=_logits_step, data_iterator=iter(batches), model=model,
                num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=1,
                decoder_seq_length=SEQ, forward_only=True, collect_non_loss_data=True)
        args.eval_iters = 1
        qkv = _unwrap(model[0]).decoder.layers[0].self_attention.linear_qkv.weight
        rec: Dict[str, Any] = {
            "loss": evaluate(args, partial(forward_step, args), iter(batches), model, None),
            "padded_vocab_size": args.padded_vocab_size, "qkv rows": qkv.shape[0]}
        if ps.is_pipeline_last_stage():
            local = torch.cat(logits, dim=0)   # the micro-batches: [batch, seq, vocab / TP]
            parts = [torch.empty_like(local)
                     for _ in range(ps.get_tensor_model_parallel_world_size())]
            torch.distributed.all_gather(parts, local.contiguous(),
                                         group=ps.get_tensor_model_parallel_group())
            rec["logits"] = torch.cat(parts, dim=-1)
        out[job["family"]] = rec
    return out


def test_every_family_tp2_pp2_logits_and_loss_in_process(tmp_path: Path) -> None:
    """Every family at TP=2 PP=2 in one 4-rank gloo job: the trainer's pipeline computes HF's
    logits (max |diff| <= 1e-4, gathered from the last stage) and HF's loss (within 1e-5; two
    micro-batches of one sequence, part of the second masked out as an SFT prompt would be).
    The HF side and the import mapping (``plan_import``, ``from_hf``) run here; the TP split
    and the model build in the ranks, by the converter's functions."""
    import time

    from dist_harness import run_distributed

    from tools.checkpoint.convert_from_hf import _normalize_hf_names, plan_import
    from tools.checkpoint.hf_state_dict import from_hf

    seq = tokens(seed=11)
    ids, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    mask = torch.ones(labels.shape)
    mask[1, :7] = 0.0
    positions = torch.arange(SEQ).unsqueeze(0)
    batches = [{"tokens": ids[i:i + 1], "labels": labels[i:i + 1], "loss_mask": mask[i:i + 1],
                "position_ids": positions} for i in range(2)]
    jobs: List[Dict[str, Any]] = []
    hfs: Dict[str, torch.nn.Module] = {}
    for family in TP2_PP2_FAMILIES:
        hf = hfs[family] = hf_model(family, seed=5)
        plan = plan_import(hf.config, SEQ)
        full = from_hf(plan.family, _normalize_hf_names(plan.family, hf_checkpoint_tensors(hf)),
                       plan.num_layers, plan.shape, plan.linear_bias, plan.qkv_bias, plan.tied,
                       plan.num_experts)
        jobs.append({"family": family, "plan": plan, "batches": batches,
                     "full": {k: v.detach().clone() for k, v in full.items()}})
    start = time.monotonic()
    results = run_distributed(4, _tp2_pp2_job, tmp_path, jobs)
    elapsed = time.monotonic() - start
    last = [r for r in results if "logits" in r["gpt2"]]
    assert len(last) == 2  # the last stage's two TP ranks
    for family, hf in hfs.items():
        ours = last[0][family]["logits"]
        assert torch.equal(ours, last[1][family]["logits"])
        assert last[0][family]["padded_vocab_size"] == 128 and ours.shape == (2, SEQ, 128)
        assert torch.isneginf(ours[..., VOCAB:]).all()  # the padding rows, masked
        ref = hf_logits(hf, ids)
        diff = (ours[..., :VOCAB] - ref).abs().max().item()
        assert ref.std() > 0.1 and diff <= 1e-4, (family, diff)
        losses = {r[family]["loss"] for r in results}
        assert len(losses) == 1, (family, losses)  # broadcast from the last stage to every rank
        loss = losses.pop()
        hf_sum, hf_count = hf_loss(hf, ids, labels, mask)
        assert hf_count == 2 * SEQ - 7
        assert abs(loss - hf_sum / hf_count) <= 1e-5, (family, loss, hf_sum / hf_count)
        heads = hf.config.num_attention_heads if family != "gpt2" else hf.config.n_head
        kv = getattr(hf.config, "num_key_value_heads", None) or heads
        rows = {r[family]["qkv rows"] for r in results}
        RESULTS[f"{family}, TP2 PP2, in process (4 ranks)"] = {
            "max |logit diff|": diff, "loss": loss, "HF loss": hf_sum / hf_count,
            "|loss diff|": abs(loss - hf_sum / hf_count), "query/KV heads": f"{heads}/{kv}", "QKV rows per TP rank": sorted(rows),
            "job s": elapsed}
        print(f"{family} TP2 PP2: max |logit diff| {diff:.3g}, loss {loss:.7f} vs HF "
              f"{hf_sum / hf_count:.7f} ({heads} query / {kv} KV heads, QKV rows per TP rank "
              f"{sorted(rows)})")
    print(f"TP2 PP2, {len(TP2_PP2_FAMILIES)} families, 4 ranks: {elapsed:.1f} s")


# ----------------------------------------------------------------------------- model flags
def _tiny_model(*flags: str, vocab: int = 100) -> Tuple[argparse.Namespace, torch.nn.Module]:
    """The trainer's GPTModel for TINY flags + ``flags`` (in a world of one set up by the caller)."""
    from megatron.training.arguments import parse_args
    from megatron.training.arguments.parser import padded_vocab_size
    from megatron.training.components import model_provider
    from megatron.training.model.config_builders import build_transformer_config

    args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                       "--seq-length", str(SEQ), "--micro-batch-size", "1", "--train-iters", "1",
                       "--lr", "0.0", "--mock-data", "--device", "cpu", "--vocab-size", str(vocab),
                       "--make-vocab-size-divisible-by", "128", *flags])
    args.model_vocab_size = vocab
    args.padded_vocab_size = padded_vocab_size(vocab, args)
    model = model_provider(args, build_transformer_config(args), args.padded_vocab_size,
                           pre_process=True, post_process=True)
    return args, model.eval()


def test_imported_architecture_flags_act_as_in_megatron_lm() -> None:
    """--norm-epsilon (alias --layernorm-epsilon), --kv-channels, --add-qkv-bias,
    --use-rope-scaling / --rope-scaling-factor, --apply-layernorm-1p, --openai-gelu and
    --mask-padded-vocab-logits (off by default: the padded logits stay what the model computes)."""
    from dist_harness import model_parallel_world_of_one
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    with model_parallel_world_of_one(seed=0):
        for flag in ("--norm-epsilon", "--layernorm-epsilon"):
            args, m = _tiny_model(flag, "1e-6")
            assert args.layernorm_epsilon == 1e-6 and m.config.layernorm_epsilon == 1e-6

        _, m = _tiny_model("--kv-channels", "32", "--add-qkv-bias", "--disable-bias-linear")
        attn = m.decoder.layers[0].self_attention
        assert m.config.kv_channels == 32
        assert attn.linear_qkv.weight.shape == (3 * 4 * 32, 64)
        assert attn.linear_qkv.bias is not None and attn.linear_qkv.bias.shape == (3 * 4 * 32,)
        assert attn.linear_proj.weight.shape == (64, 4 * 32) and attn.linear_proj.bias is None
        assert m.decoder.layers[0].mlp.linear_fc1.bias is None

        rope = ["--position-embedding-type", "rope", "--rotary-base", "500000"]
        _, plain = _tiny_model(*rope)
        _, scaled = _tiny_model(*rope, "--use-rope-scaling", "--rope-scaling-factor", "16")
        hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                              "factor": 16.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192})
        hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
        ours = scaled.rotary_pos_emb.inv_freq
        assert torch.allclose(ours.double(), hf_inv_freq.double(), rtol=1e-6, atol=0)
        assert not torch.allclose(plain.rotary_pos_emb.inv_freq, ours)

        _, m = _tiny_model("--apply-layernorm-1p")
        norm = m.decoder.layers[0].input_layernorm
        assert m.config.layernorm_zero_centered_gamma and torch.all(norm.weight == 0)
        x = torch.randn(3, 64)
        with torch.no_grad():
            norm.weight.normal_()
            expected = torch.nn.functional.layer_norm(x, (64,), norm.weight + 1, norm.bias, 1e-5)
            assert torch.allclose(norm(x), expected)
            assert torch.all(m.decoder.final_layernorm.weight == 0)

        _, m = _tiny_model("--openai-gelu")
        x = torch.linspace(-3, 3, 7)
        assert torch.allclose(m.config.activation_func(x),
                              torch.nn.functional.gelu(x, approximate="tanh"))
        assert not m.config.bias_activation_fusion

        ids = torch.randint(0, 100, (1, SEQ))
        pos = torch.arange(SEQ).unsqueeze(0)
        _, m = _tiny_model()
        with torch.no_grad():
            assert torch.isfinite(m(ids, pos, None)[..., 100:]).all()  # default: untouched
        _, m = _tiny_model("--mask-padded-vocab-logits")
        with torch.no_grad():
            out = m(ids, pos, None)
        assert torch.isneginf(out[..., 100:]).all() and torch.isfinite(out[..., :100]).all()


def test_rope_scaling_needs_rope() -> None:
    from megatron.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                    "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "1",
                    "--lr", "0.1", "--mock-data", "--device", "cpu", "--use-rope-scaling"])


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("change,message", [
    (dict(sliding_window=16), "sliding_window 16 is shorter than --seq-length 32"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                           "low_freq_factor": 2.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}),
     "low_freq_factor = 2.0: megatron-core 0.16.1's llama3"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     "rope_type 'yarn'"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_unsupported_configs_are_refused_naming_the_field(change: Dict[str, Any],
                                                          message: str) -> None:
    from transformers import MistralConfig

    from tools.checkpoint.convert_from_hf import ConversionError, plan_import

    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, sliding_window=64)
    for k, v in change.items():
        setattr(cfg, k, v)
    with pytest.raises(ConversionError, match=message.replace("(", r"\(").replace(".", r"\.")):
        plan_import(cfg, SEQ)


def test_converter_refuses_before_writing_anything(tmp_path: Path, capsys) -> None:
    """The CLI: a directory without config.json, and a Mistral whose sliding window is shorter
    than the --seq-length asked for, are one error line each (exit 2), and nothing is written."""
    from tools.checkpoint.convert_from_hf import main

    assert main(["--hf-dir", str(tmp_path), "--save", str(tmp_path / "a")]) == 2
    assert f"--hf-dir {tmp_path}: no config.json" in capsys.readouterr().err
    model = hf_model("mistral")
    model.config.sliding_window = 16
    save_hf(model, tmp_path / "hf", tokenizer=False)
    assert main(["--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "b"),
                 "--seq-length", "32"]) == 2
    assert "sliding_window 16 is shorter than --seq-length 32" in capsys.readouterr().err
    # a layout the trainer refuses: its own line naming the flag, before any writer starts
    save_hf(hf_model("llama"), tmp_path / "llama", tokenizer=False)
    assert main(["--hf-dir", str(tmp_path / "llama"), "--save", str(tmp_path / "c"),
                 "--pipeline-model-parallel-size", "3"]) == 2
    assert ("error: the trainer refuses this import: --num-layers must be divisible by "
            "--pipeline-model-parallel-size") in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in ("a", "b", "c"))


def test_mixtral_configs_the_trainer_cannot_represent_are_refused(tmp_path: Path,
                                                                  capsys) -> None:
    """Mixtral: a sliding window shorter than the sequence (as for Mistral) and a top k above
    the expert count are refused naming the field; the CLI refuses --expert-model-parallel-size
    > 1 in one line naming the flag, before anything is written."""
    from tools.checkpoint.convert_from_hf import ConversionError, main, plan_import

    hf = hf_model("mixtral")
    cfg = hf.config
    cfg.sliding_window = 16
    with pytest.raises(ConversionError, match="sliding_window 16 is shorter than --seq-length 32"):
        plan_import(cfg, SEQ)
    cfg.sliding_window, cfg.num_experts_per_tok = None, 5
    with pytest.raises(ConversionError, match="num_experts_per_tok 5 must be in "
                                              "1..num_local_experts 4"):
        plan_import(cfg, SEQ)
    cfg.num_experts_per_tok = 2
    save_hf(hf, tmp_path / "hf", tokenizer=False)
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "out"),
                 "--expert-model-parallel-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --expert-model-parallel-size 2: the "
                                               "import writes the experts at expert-parallel "
                                               "size 1"), err
    assert not (tmp_path / "out").exists()


def test_llama_attention_bias_without_mlp_bias_is_refused() -> None:
    from transformers import LlamaConfig

    from tools.checkpoint.convert_from_hf import ConversionError, plan_import

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, attention_bias=True, mlp_bias=False)
    with pytest.raises(ConversionError, match="attention_bias True with mlp_bias False"):
        plan_import(cfg, SEQ)


# ----------------------------------------------------------------------------- end to end
def _torchrun(nproc: int, out: Path, argv: List[str], timeout: int = 300,
              ok: bool = True) -> str:
    """The entry point under torchrun: its stdout (``ok``), or its stdout and stderr after it
    failed (``ok=False``)."""
    from dist_harness import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    env[OUT_ENV] = str(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", __file__, *argv]
    from conftest import run_in_own_session

    res = run_in_own_session(cmd, env, timeout)
    if not ok:
        assert res.returncode != 0, res.stdout[-3000:]
        return res.stdout + res.stderr
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return res.stdout


def _import(hf_dir: Path, save: Path, *flags: str) -> Dict[str, Any]:
    res = subprocess.run([sys.executable, "tools/checkpoint/convert_from_hf.py", "--hf-dir",
                          str(hf_dir), "--save", str(save), *flags], cwd=REPO,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return json.loads((save / "convert_from_hf.json").read_text())


def _losses(jsonl: Path) -> Dict[int, float]:
    out = {}
    for line in jsonl.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "train" and rec.get("lm_loss") is not None:
            out[int(rec["iteration"])] = float(rec["lm_loss"])
    return out


def _check_run(hf: torch.nn.Module, out: Path, layout: str, logits_tol: float = 1e-4,
               loss_tol: float = 1e-5) -> Dict[str, Any]:
    """Logits after the trainer's load and the logged loss of iteration 1 against HF."""
    ref = torch.load(out / "logits.pt")
    diff = (ref["logits"][..., :VOCAB].float() - hf_logits(hf, ref["tokens"])).abs().max().item()
    assert torch.isneginf(ref["logits"][..., VOCAB:]).all()
    assert diff <= logits_tol, diff
    total, count = 0.0, 0.0
    batches = sorted(out.glob("batch_dp*.pt"))
    assert batches
    for f in batches:
        for b in torch.load(f):
            s, c = hf_loss(hf, b["tokens"], b["labels"], b["loss_mask"])
            total, count = total + s, count + c
    losses = _losses(out / "log.jsonl")
    result = {"max |logit diff|": diff, "first-step loss": losses[1], "HF loss": total / count,
              "losses": [losses[i] for i in sorted(losses)]}
    print(f"{layout}: {result}")
    assert abs(losses[1] - total / count) <= loss_tol, (losses[1], total / count)
    return result


def _train_flags(save: Path, out: Path, iters: int = 1) -> List[str]:
    return ["--model-args-file", str(save / "model_args.txt"), "--load", str(save),
            "--finetune", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", str(iters), "--lr", "1e-3", "--lr-decay-style", "constant",
            "--mock-data", "--device", "cpu", "--log-interval", "1", "--eval-iters", "0",
            "--seq-length", str(SEQ), "--jsonl-log", str(out / "log.jsonl")]


def _round_trip(save: Path, hf: torch.nn.Module, out: Path, tied: bool) -> bool:
    weights = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    return _round_trip_tensors(save, weights, out)


def _round_trip_tensors(save: Path, weights: Dict[str, torch.Tensor], out: Path) -> bool:
    """convert_to_hf.py's export of ``save`` holds exactly ``weights``, bit for bit."""
    from safetensors.torch import load_file

    from tools.checkpoint import convert_to_hf

    summary = convert_to_hf.convert(str(save), str(out), dtype="fp32", auto_tokenizer=True,
                                    log=lambda _m: None)
    assert summary["vocab_size"] == VOCAB and summary["vocab"].startswith("padding rows dropped")
    exported = load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(weights)
    return all(torch.equal(exported[k], weights[k]) for k in weights)


@pytest.fixture(scope="module")
def imported_llama(tmp_path_factory) -> Tuple[torch.nn.Module, Path]:
    tmp = tmp_path_factory.mktemp("llama")
    hf = hf_model("llama", seed=1)
    with torch.no_grad():  # confident predictions: HF's loss far from ln(vocab)
        hf.lm_head.weight.mul_(6.0)
    summary = _import(save_hf(hf, tmp / "hf"), tmp / "ckpt")
    assert summary["ckpt_format"] == "torch_dist" and summary["padded_vocab_size"] == 128
    return hf, tmp / "ckpt"


def test_llama_import_end_to_end_tp1_pp1(imported_llama, tmp_path: Path) -> None:
    """pretrain_gpt.py --model-args-file ... --load ... --finetune: the imported Llama at
    iteration 0 computes HF's logits and, in its first training step, HF's loss; exported
    back, its tensors are HF's."""
    hf, save = imported_llama
    args_file = (save / "model_args.txt").read_text()
    assert "--mask-padded-vocab-logits" in args_file and "--tokenizer-type HuggingFaceTokenizer" \
        in args_file and "--group-query-attention" in args_file
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(save / "tokenizer")) == VOCAB
    _torchrun(1, tmp_path, _train_flags(save, tmp_path))
    result = _check_run(hf, tmp_path, "llama TP1 PP1")
    # another padding of the vocabulary: refused at load in one line naming both flags and the
    # values of the import, not a shape error inside the torch_dist load
    (tmp_path / "vocab").mkdir()
    refused = _torchrun(1, tmp_path / "vocab", _train_flags(save, tmp_path / "vocab") + [
        "--make-vocab-size-divisible-by", "8"], ok=False)
    assert (f"checkpoint {save / 'iter_0000000'} has a padded vocabulary of 128 rows (100 "
            "tokens), written with --make-vocab-size-divisible-by 128 and "
            "--tensor-model-parallel-size 1; this run pads to 104 rows "
            "(--make-vocab-size-divisible-by 8 x --tensor-model-parallel-size 1)") in refused
    result["round trip bit-identical"] = _round_trip(save, hf, tmp_path / "hf_out", tied=False)
    assert result["round trip bit-identical"]
    RESULTS["llama TP1 PP1 (end to end)"] = result


def test_qwen2_import_end_to_end_tp2_pp2_torch_format(tmp_path: Path) -> None:
    """Qwen2 (QKV bias, GQA, tied: the last stage's output-layer copy) imported at TP=2 PP=2 in
    the torch format, loaded by 4 trainer ranks: vocabulary 100 padded to 256 (128 x TP)."""
    hf = hf_model("qwen2", seed=2)
    summary = _import(save_hf(hf, tmp_path / "hf"), tmp_path / "ckpt", "--ckpt-format", "torch",
                      "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    assert summary["padded_vocab_size"] == 256
    assert sorted(p.name for p in (tmp_path / "ckpt" / "iter_0000000").glob("*.pt")) == [
        f"mp_rank_{t:02d}_{p:03d}_dp_000.pt" for t in range(2) for p in range(2)]
    _torchrun(4, tmp_path, _train_flags(tmp_path / "ckpt", tmp_path) + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--global-batch-size", "2"])
    result = _check_run(hf, tmp_path, "qwen2 TP2 PP2")
    result["round trip bit-identical"] = _round_trip(tmp_path / "ckpt", hf, tmp_path / "hf_out",
                                                     tied=True)
    assert result["round trip bit-identical"]
    RESULTS["qwen2 TP2 PP2 (end to end)"] = result


def test_mixtral_import_resumes_at_expert_parallel_2_end_to_end(tmp_path: Path) -> None:
    """Mixtral imported at expert-parallel size 1 (torch_dist, TP1 PP1), loaded by
    pretrain_gpt.py on 2 ranks at --expert-model-parallel-size 2 (each rank holds 2 of the 4
    experts: torch_dist reshards them): HF's logits, HF's loss in the first training step, and
    the export of the imported checkpoint gives back HF's tensors bit for bit."""
    hf = hf_model("mixtral", seed=3)
    summary = _import(save_hf(hf, tmp_path / "hf"), tmp_path / "ckpt")
    assert summary["num_experts"] == 4 and summary["expert_model_parallel_size"] == 1
    args_file = (tmp_path / "ckpt" / "model_args.txt").read_text().splitlines()
    for line in ("--num-experts 4", "--moe-router-topk 2", "--moe-ffn-hidden-size 96",
                 "--moe-token-dispatcher-type alltoall"):
        assert line in args_file, (line, args_file)
    out = tmp_path / "run"
    out.mkdir()
    _torchrun(2, out, _train_flags(tmp_path / "ckpt", out) + ["--expert-model-parallel-size", "2"])
    result = _check_run(hf, out, "mixtral EP2 (imported at EP1)")
    result["round trip bit-identical"] = _round_trip_tensors(
        tmp_path / "ckpt", hf_checkpoint_tensors(hf), tmp_path / "hf_out")
    assert result["round trip bit-identical"]
    RESULTS["mixtral TP1 PP1 import, loaded at EP2 (end to end)"] = result


def test_continued_pretraining_with_sdp4bit_and_loco_starts_at_hf_loss(imported_llama,
                                                                       tmp_path: Path) -> None:
    """The imported Llama trained on 2 data-parallel ranks with 4-bit weight and gradient
    communication (SDP4Bit + LoCo; --bf16, which the quantized weight gather needs): the first
    loss is HF's on those batches (to bf16 rounding) -- far from ln(vocab), where a fresh model
    starts (the fixture's output layer is scaled up to make the two differ) -- and training
    goes on from there."""
    hf, save = imported_llama
    _torchrun(2, tmp_path, _train_flags(save, tmp_path, iters=4) + [
        "--bf16", "--use-distributed-optimizer", "--quantized-weights", "--quantized-gradients",
        "--hadamard-transform", "--loco", "--save", str(tmp_path / "continued"),
        "--save-interval", "4"])
    result = _check_run(hf, tmp_path, "llama SDP4Bit+LoCo DP2", logits_tol=0.5, loss_tol=0.05)
    losses = result["losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(VOCAB)) > 1.0  # the HF model's loss, not a fresh model's
    result["ln(vocab)"] = math.log(VOCAB)
    RESULTS["llama continued pretraining SDP4Bit+LoCo, 2 ranks"] = result
    assert (tmp_path / "continued" / "iter_0000004").is_dir()


def test_model_args_file_flags_and_command_line_wins(tmp_path: Path) -> None:
    """--model-args-file: its flags parse as if given (quotes, comments), the command line
    wins, and a missing file is one clear error."""
    from megatron.training.arguments import parse_args

    f = tmp_path / "model_args.txt"
    f.write_text("# comment\n--num-layers 3 --hidden-size 64\n--num-attention-heads 4\n"
                 "--tokenizer-model 'a dir/x'  # trailing comment\n--swiglu\n")
    args = parse_args(["--model-args-file", str(f), "--num-layers", "5", "--seq-length", "8",
                       "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
                       "--mock-data"], validate=False)
    assert (args.num_layers, args.hidden_size, args.swiglu) == (5, 64, True)
    assert args.tokenizer_model == "a dir/x" and "num_attention_heads" in args.explicit_flags
    with pytest.raises(SystemExit):
        parse_args(["--model-args-file", str(tmp_path / "missing.txt")], validate=False)


def test_results_table() -> None:
    """Prints the per-family table of what the tests above measured (run with -s)."""
    for name, r in RESULTS.items():
        print(f"{name:50s} " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in r.items()))


# ----------------------------------------------------------------------------- torchrun side
def _record_logits(args: argparse.Namespace, model: List[torch.nn.Module], out: str) -> None:
    """Collective: logits of the loaded model on fixed tokens (TP gathered, PP passed on)."""
    from hf_helpers import pipeline_logits
    from megatron.core import parallel_state as ps

    from tools.checkpoint.convert_from_hf import _unwrap

    ids = tokens(seed=7)[:, :-1]
    positions = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    logits = pipeline_logits(_unwrap(model[0]), ids, positions, args.hidden_size)
    if (logits is not None and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0):
        torch.save({"tokens": ids, "logits": logits}, os.path.join(out, "logits.pt"))


def _training_main(argv: List[str]) -> int:
    """pretrain_gpt.main, plus the logits right after the load and the first step's batches."""
    import pretrain_gpt
    from megatron.core import parallel_state as ps
    from megatron.training import pretrain as pretrain_module
    from megatron.training.checkpoint import save_load

    out = os.environ[OUT_ENV]
    load = save_load.load_checkpoint

    def load_then_logits(args, model, *rest, **kwargs):
        result = load(args, model, *rest, **kwargs)
        _record_logits(args, model, out)
        return result

    forward_step = pretrain_module.forward_step
    seen: List[Dict[str, torch.Tensor]] = []

    def recording_forward_step(args, data_iterator, model):
        batch = next(data_iterator)
        first_step = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
        if model.training and len(seen) < first_step:
            seen.append({k: batch[k].clone() for k in ("tokens", "labels", "loss_mask")})
            if (len(seen) == first_step and ps.is_pipeline_last_stage()
                    and ps.get_tensor_model_parallel_rank() == 0):
                torch.save(seen, os.path.join(out, f"batch_dp{ps.get_data_parallel_rank()}.pt"))
        return forward_step(args, iter([batch]), model)

    save_load.load_checkpoint = load_then_logits
    pretrain_module.forward_step = recording_forward_step
    return pretrain_gpt.main(argv)


if __name__ == "__main__":
    sys.exit(_training_main(sys.argv[1:]))
