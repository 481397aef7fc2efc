"""tools/checkpoint/convert_to_hf.py: checkpoints of pretrain_gpt.py load in HF transformers and
compute the same logits as our model.

How the reference logits are made: this file is also the training entry point (run by torchrun,
``__main__`` below).  It runs ``pretrain_gpt.main`` unchanged except that, right after the
trainer's own ``save_checkpoint``, every rank copies its live (trained, bf16) megatron-core
GPTModel into an fp32 twin built with the trainer's own builders (``build_transformer_config``,
``model_provider``) and runs a forward on fixed token ids; tensor-parallel logits are gathered,
pipeline stages pass the hidden states on.  So the reference is the very model that was saved,
independent of how the converter reads files, in any TP/PP layout, at no extra launch.

Tolerance: the export is fp32 (``--dtype fp32``) of the bf16 weights (exact: bf16 widens to
fp32 without rounding), and the twin computes in fp32 too, so the only differences are fp32
rounding in differently ordered ops (SDPA vs megatron-core's baddbmm/softmax, RoPE cos/sin
tables): measured 2-3e-7 here, ~1e-7 relative.  We require max |diff| < 1e-5 x max(1, max |logit|)
(40x margin).  Layout mistakes move these logits far more, even on this barely trained model
(measured on the TP=2 GQA export: gate/up swapped 2e-2, k/v swapped 0.9, query heads permuted
inside their groups 8e-3), and so does a wrong RoPE base (3e-3: the control in the torch_dist
test).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
REFERENCE_ENV = "CONVERT_TO_HF_REFERENCE_LOGITS"
SEQ = 32
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
        "--micro-batch-size", "2", "--mock-data", "--vocab-size", "128",
        "--make-vocab-size-divisible-by", "8", "--device", "cpu",
        "--global-batch-size", "4", "--train-iters", "3", "--lr", "3e-3", "--lr-decay-style",
        "constant", "--bf16", "--log-interval", "1", "--eval-iters", "0"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--ffn-hidden-size", "96"]
MIXTRAL = LLAMA + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type",
                   "alltoall", "--group-query-attention", "--num-query-groups", "2"]


# ----------------------------------------------------------------------------- helpers
def _train(tmp_path: Path, extra: List[str]) -> Path:
    """Train 3 iterations on 2 CPU ranks with --save; returns the checkpoint root.  The
    reference logits land in tmp_path / "reference.pt"."""
    sys.path.insert(0, str(Path(__file__).parent))
    from dist_harness import free_port

    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    env[REFERENCE_ENV] = str(tmp_path / "reference.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", __file__,
           *TINY, *extra, "--save", str(ckpt)]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-8000:]
    assert "saved checkpoint at iteration       3" in res.stdout
    return ckpt


def _convert(ckpt: Path, out: Path, *flags: str) -> Dict:
    from tools.checkpoint import convert_to_hf

    a = convert_to_hf.build_parser().parse_args(["--load", str(ckpt), "--output", str(out),
                                                 *flags])
    return convert_to_hf.convert(a.load, a.output, iteration=a.iteration, dtype=a.dtype,
                                 vocab_size=a.vocab_size, tokenizer_dir=a.tokenizer_dir,
                                 auto_tokenizer=not a.no_tokenizer, log=lambda _m: None)


def _hf_logits(out: Path, tokens: torch.Tensor, architecture: Optional[str] = None,
               vocab: Optional[int] = None, rope_theta: Optional[float] = None) -> torch.Tensor:
    """Logits of the export loaded with AutoModelForCausalLM (optionally with another RoPE
    base); checks the class and vocabulary size when given."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(out)
    if rope_theta is not None:
        if getattr(config, "rope_parameters", None):  # transformers >= 5
            config.rope_parameters = {**config.rope_parameters, "rope_theta": rope_theta}
        else:
            config.rope_theta = rope_theta
    model = AutoModelForCausalLM.from_pretrained(out, config=config)
    if architecture is not None:
        assert type(model).__name__ == architecture
    if vocab is not None:
        assert model.config.vocab_size == vocab
    with torch.no_grad():
        return model.float().eval()(input_ids=tokens).logits.float()


def _compare(out: Path, tmp_path: Path, architecture: str, vocab: int) -> Dict[str, float]:
    """Load the export with AutoModelForCausalLM and check its logits against the reference."""
    ref = torch.load(tmp_path / "reference.pt")
    tokens, ref_logits = ref["tokens"], ref["logits"][..., :vocab]
    logits = _hf_logits(out, tokens, architecture, vocab)
    assert logits.shape == ref_logits.shape == (2, SEQ, vocab)
    diff = (logits - ref_logits).abs().max().item()
    scale = ref_logits.abs().max().item()
    print(f"{architecture}: max |logits diff| = {diff:.3g} (max |logit| {scale:.3g})")
    assert ref_logits.std() > 0.05  # a real, position-dependent prediction, not a constant
    assert diff < 1e-5 * max(1.0, scale), (diff, scale)
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
    return {"diff": diff, "scale": scale}


def _safetensors_dtypes(out: Path) -> set:
    from safetensors import safe_open

    dtypes = set()
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            dtypes |= {st.get_tensor(k).dtype for k in st.keys()}
    return dtypes


# ----------------------------------------------------------------------------- end to end
def test_gpt2_style_pipeline_parallel_2_torch_format_exports_gpt2(tmp_path: Path) -> None:
    """SDP4Bit GPT recipe architecture (LayerNorm, learned positions, GELU, biases, tied
    embeddings), --ckpt-format torch with PP=2 (layers renumbered per stage; the tied output
    copy on stage 1 is dropped for the embedding) -> GPT2LMHeadModel, with a HF tokenizer
    directory copied in."""
    ckpt = _train(tmp_path, ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"])
    assert sorted(os.listdir(ckpt / "iter_0000003")) == [
        "checkpoint_writer.json", "manifest.json",
        "mp_rank_00_000_dp_000.pt", "mp_rank_00_001_dp_000.pt"]
    tok_dir = tmp_path / "tokenizer"
    _tiny_tokenizer(tok_dir)
    summary = _convert(ckpt, tmp_path / "hf", "--dtype", "fp32", "--tokenizer-dir", str(tok_dir))
    assert summary["checkpoint_format"] == "torch" and summary["iteration"] == 3
    assert summary["pipeline_model_parallel_size"] == 2
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["activation_function"] == "gelu"  # CPU-trained: exact GELU, no fused tanh
    assert config["tie_word_embeddings"] is True and config["n_inner"] == 256
    assert config["n_layer"] == 2
    _compare(tmp_path / "hf", tmp_path, "GPT2LMHeadModel", vocab=128)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.eos_token == "<|endoftext|>" and config["eos_token_id"] == tok.eos_token_id == 0


def test_llama_style_torch_dist_exports_llama(tmp_path: Path) -> None:
    """LoCo recipe architecture (RMSNorm, SwiGLU, RoPE with --rotary-base, untied, no biases),
    --ckpt-format torch_dist, a padded vocabulary (125 -> 128) trimmed with --vocab-size; the
    export runs as the command line the README shows."""
    ckpt = _train(tmp_path, LLAMA + ["--use-distributed-optimizer", "--vocab-size", "125",
                                     "--rotary-base", "500000", "--layernorm-epsilon", "1e-6",
                                     "--ckpt-format", "torch_dist"])
    assert (ckpt / "iter_0000003" / "metadata.json").is_file()
    out = tmp_path / "hf"
    res = subprocess.run([sys.executable, "tools/checkpoint/convert_to_hf.py", "--load",
                          str(ckpt), "--output", str(out), "--dtype", "fp32", "--vocab-size",
                          "125"], cwd=REPO, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "vocab 125, trimmed (--vocab-size)" in res.stdout
    config = json.loads((out / "config.json").read_text())
    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    assert theta == 500000.0 and config["rms_norm_eps"] == 1e-6
    assert config["tie_word_embeddings"] is False and config["attention_bias"] is False
    assert config["eos_token_id"] == 124  # NullTokenizer's EOD
    cmp = _compare(out, tmp_path, "LlamaForCausalLM", vocab=125)

    # Control: the same weights with HF's default RoPE base give visibly different logits, so
    # the comparison above does see the rotary base (and would see a layout mistake).
    ref = torch.load(tmp_path / "reference.pt")
    wrong = _hf_logits(out, ref["tokens"], rope_theta=10000.0)
    wrong_diff = (wrong - ref["logits"][..., :125]).abs().max().item()
    print(f"control, RoPE base 10000 instead of 500000: max |logits diff| = {wrong_diff:.3g}")
    assert wrong_diff > 100 * cmp["diff"] + 1e-3


def test_llama_style_gqa_tensor_parallel_2_torch_format(tmp_path: Path) -> None:
    """TP=2 shards merged (vocab-parallel embedding/output, QKV per query group, SwiGLU [gate; up]
    per shard, row-parallel proj/fc2) with grouped-query attention (``--group-query-attention
    --num-query-groups 2``: 2 groups of 2 heads); the padded vocabulary (125 -> 128, divisible by
    8 x TP) kept by default; bf16 export (default) is the fp32 export rounded by nothing."""
    ckpt = _train(tmp_path, LLAMA + ["--tensor-model-parallel-size", "2", "--vocab-size", "125",
                                     "--group-query-attention", "--num-query-groups", "2"])
    assert sorted(os.listdir(ckpt / "iter_0000003")) == [
        "checkpoint_writer.json", "manifest.json",
        "mp_rank_00_000_dp_000.pt", "mp_rank_01_000_dp_000.pt"]
    _convert(ckpt, tmp_path / "hf", "--dtype", "fp32")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["num_attention_heads"] == 4
    _compare(tmp_path / "hf", tmp_path, "LlamaForCausalLM", vocab=128)

    summary = _convert(ckpt, tmp_path / "hf_bf16")
    assert summary["dtype"] == "bfloat16" and summary["vocab"] == "padded rows kept"
    assert _safetensors_dtypes(tmp_path / "hf_bf16") == {torch.bfloat16}
    from safetensors.torch import load_file

    fp32, bf16 = load_file(tmp_path / "hf" / "model.safetensors"), \
        load_file(tmp_path / "hf_bf16" / "model.safetensors")
    assert sorted(fp32) == sorted(bf16)
    assert all(torch.equal(bf16[k].float(), fp32[k]) for k in fp32)


def test_mixtral_style_expert_parallel_2_torch_dist_exports_mixtral(tmp_path: Path) -> None:
    """The Llama layout with --num-experts 4 --moe-router-topk 2 trained at
    --expert-model-parallel-size 2 (each rank holds 2 experts), --ckpt-format torch_dist: the
    experts are stored globally, so the export reads all 4 -> MixtralForCausalLM (router ->
    block_sparse_moe.gate, each expert's [gate; up] linear_fc1 -> w1 / w3, linear_fc2 -> w2)
    computing the trained model's logits; its config carries the MoE flags."""
    ckpt = _train(tmp_path, MIXTRAL + ["--expert-model-parallel-size", "2", "--ckpt-format",
                                       "torch_dist", "--moe-aux-loss-coeff", "0.01",
                                       "--moe-ffn-hidden-size", "48"])
    _convert(ckpt, tmp_path / "hf", "--dtype", "fp32")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_local_experts"], config["num_experts_per_tok"],
            config["intermediate_size"], config["router_aux_loss_coef"],
            config["num_key_value_heads"]) == (4, 2, 48, 0.01, 2)
    from safetensors.torch import load_file

    names = load_file(tmp_path / "hf" / "model.safetensors")
    assert names["model.layers.1.block_sparse_moe.experts.3.w1.weight"].shape == (48, 64)
    assert names["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (64, 48)
    assert names["model.layers.1.block_sparse_moe.gate.weight"].shape == (4, 64)
    _compare(tmp_path / "hf", tmp_path, "MixtralForCausalLM", vocab=128)


def test_torch_format_with_expert_parallelism_is_refused_naming_the_flag(tmp_path: Path) -> None:
    """A --ckpt-format torch checkpoint written at --expert-model-parallel-size 2: each file
    holds only its rank's experts; refused in one line naming the flag and torch_dist."""
    from tools.checkpoint.convert_to_hf import ConversionError
    from tools.checkpoint.megatron_checkpoint_reader import read_torch_format

    args = argparse.Namespace(num_layers=2, tensor_model_parallel_size=1,
                              pipeline_model_parallel_size=1, expert_model_parallel_size=2,
                              num_experts=4)
    torch.save({"args": args, "model": [{}]}, tmp_path / "mp_rank_00_000_dp_000.pt")
    with pytest.raises(ConversionError, match=r"--expert-model-parallel-size 2 in --ckpt-format "
                                              r"torch: .* export a --ckpt-format torch_dist"):
        read_torch_format(str(tmp_path))


# ----------------------------------------------------------------------------- units
def test_split_qkv_follows_megatron_core_group_layout() -> None:
    """linear_qkv rows per query group g: [q heads of g, k_g, v_g] (megatron-core's
    SelfAttention.get_query_key_value_tensors view [ng, (nq/ng + 2) * hd])."""
    from tools.checkpoint.convert_to_hf import split_qkv

    nq, ng, hd = 4, 2, 3
    rows = []
    for g in range(ng):
        rows += [("q", g * (nq // ng) + j) for j in range(nq // ng)] + [("k", g), ("v", g)]
    code = {"q": 0, "k": 100, "v": 200}
    w = torch.tensor([[code[kind] + head] * 5 for kind, head in rows for _ in range(hd)],
                     dtype=torch.float32)
    q, k, v = split_qkv(w, nq, ng, hd)
    assert q[:, 0].tolist() == [h for h in range(nq) for _ in range(hd)]
    assert k[:, 0].tolist() == [100 + g for g in range(ng) for _ in range(hd)]
    assert v[:, 0].tolist() == [200 + g for g in range(ng) for _ in range(hd)]
    with pytest.raises(ValueError, match="expected 24"):
        split_qkv(w[:-1], nq, ng, hd)


def test_tensor_parallel_merge_rules() -> None:
    from tools.checkpoint.convert_to_hf import merge_tensor_parallel

    g0, u0, g1, u1 = (torch.full((2, 3), float(i)) for i in range(4))
    fc1 = merge_tensor_parallel("decoder.layers.0.mlp.linear_fc1.weight",
                                [torch.cat([g0, u0]), torch.cat([g1, u1])], swiglu=True)
    assert fc1[:, 0].tolist() == [0, 0, 2, 2, 1, 1, 3, 3]  # [gate_0; gate_1; up_0; up_1]
    proj = merge_tensor_parallel("decoder.layers.0.self_attention.linear_proj.weight",
                                 [torch.zeros(4, 2), torch.ones(4, 2)], swiglu=True)
    assert proj.shape == (4, 4) and proj[0].tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="QK layernorm"):
        merge_tensor_parallel("decoder.layers.0.self_attention.q_layernorm.weight",
                              [torch.zeros(2), torch.zeros(2)], swiglu=True)


def test_gelu_flavour_follows_the_fusion_that_ran() -> None:
    """The exported activation is what training ran: the fused bias-GELU (tanh approximation)
    only where the resolver turned it on; --no-bias-gelu-fusion on CUDA ran exact GELU (the
    export said gelu_new before, about 1e-3 off per activation)."""
    from megatron.training.arguments import parse_args
    from tools.checkpoint.convert_to_hf import gelu_flavour

    def saved(*extra: str) -> argparse.Namespace:
        return parse_args(TINY[:TINY.index("--device")] + list(extra), validate=False)

    assert gelu_flavour(saved("--device", "cuda")) == "gelu_new"
    assert gelu_flavour(saved("--device", "cuda", "--no-bias-gelu-fusion")) == "gelu"
    assert gelu_flavour(saved("--device", "cuda", "--disable-bias-linear")) == "gelu"
    assert gelu_flavour(saved("--device", "cpu")) == "gelu"
    legacy = saved("--device", "cuda")
    del legacy.device, legacy.bias_gelu_fusion           # older checkpoints: a GPU run, fused
    assert gelu_flavour(legacy) == "gelu_new"


@pytest.mark.parametrize("flags,message", [
    (dict(normalization="RMSNorm"), "needs --normalization LayerNorm"),
    (dict(position_embedding_type="rope", normalization="LayerNorm", swiglu=True),
     "needs --normalization RMSNorm and --swiglu"),
    (dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
          rotary_percent=0.5), "--rotary-percent 0.5"),
    (dict(num_experts=4), "--num-experts exports as Mixtral"),
    (dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_experts=4,
          add_bias_linear=False, moe_layer_freq=2), "--moe-layer-freq 2"),
    (dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_experts=4,
          add_bias_linear=False, moe_router_pre_softmax=True), "--moe-router-pre-softmax"),
    (dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_experts=4,
          add_bias_linear=False, moe_shared_expert_intermediate_size=64), "no shared expert"),
    (dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_experts=4),
     "Mixtral has no linear biases"),
])
def test_unsupported_architectures_are_refused_naming_the_flag(flags, message) -> None:
    from tools.checkpoint.convert_to_hf import ConversionError, architecture

    args = argparse.Namespace(**{"normalization": "LayerNorm", "swiglu": False,
                                 "position_embedding_type": "learned_absolute",
                                 "rotary_percent": 1.0, **flags})
    with pytest.raises(ConversionError, match=message.replace("-", r"\-").replace(".", r"\.")):
        architecture(args)


def test_cli_reports_a_directory_without_checkpoint(tmp_path: Path, capsys) -> None:
    from tools.checkpoint.convert_to_hf import main

    (tmp_path / "iter_0000005").mkdir()
    assert main(["--load", str(tmp_path), "--output", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "latest_checkpointed_iteration.txt" in err and "--iteration N" in err
    assert main(["--load", str(tmp_path), "--iteration", "7", "--output", str(tmp_path / "x")]) == 2
    assert "iteration 7 has no directory" in capsys.readouterr().err


def test_checkpoint_gpt2_bpe_tokenizer_is_exported_as_trained(tmp_path: Path) -> None:
    """--tokenizer-type GPT2BPETokenizer: the vocab/merges the run read become a HF tokenizer
    that encodes text exactly as the trainer's tokenizer did."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoTokenizer

    from megatron.training.data.tokenizer import GPT2BPETokenizer
    from tools.checkpoint.convert_to_hf import install_tokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog, twice."] * 20,
                            vocab_size=300, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(tmp_path))
    args = argparse.Namespace(tokenizer_type="GPT2BPETokenizer",
                              vocab_file=str(tmp_path / "vocab.json"),
                              merge_file=str(tmp_path / "merges.txt"))
    out = tmp_path / "hf"
    out.mkdir()
    assert install_tokenizer(args, str(out), None, True, lambda _m: None) is not None
    hf, ours = AutoTokenizer.from_pretrained(out), GPT2BPETokenizer(args.vocab_file, args.merge_file)
    text = "The lazy fox, twice  over: 42 dogs!"
    assert hf(text).input_ids == ours.tokenize(text) and len(ours.tokenize(text)) > 5
    assert hf.eos_token_id == ours.eod == 0 and hf.decode(hf(text).input_ids) == text
    assert install_tokenizer(args, str(out), None, False, lambda _m: None) is None  # --no-tokenizer


def _tiny_tokenizer(path: Path) -> None:
    """A 128-token word-level HF tokenizer whose id 0 is <|endoftext|>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, 128)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>").save_pretrained(path)


# ----------------------------------------------------------------------------- torchrun side
def _reference_logits(args: argparse.Namespace, model: List[torch.nn.Module], path: str) -> None:
    """Collective: the live model's logits on fixed tokens, computed by an fp32 twin."""
    from hf_helpers import pipeline_logits
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    from megatron.training.model.config_builders import build_transformer_config
    from megatron.training.components import model_provider

    live = model[0].module
    live = live.module if isinstance(live, Float16Module) else live
    fp32_args = argparse.Namespace(**vars(args))
    fp32_args.bf16, fp32_args.fp16, fp32_args.params_dtype = False, False, torch.float32
    twin = model_provider(fp32_args, build_transformer_config(fp32_args), args.padded_vocab_size,
                          pre_process=ps.is_pipeline_first_stage(),
                          post_process=ps.is_pipeline_last_stage())
    twin.load_state_dict({k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                          for k, v in live.state_dict().items()}, strict=True)
    twin.eval()
    tokens = torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    logits = pipeline_logits(twin, tokens, positions, args.hidden_size)
    if (logits is not None and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0):
        torch.save({"tokens": tokens, "logits": logits}, path)


def _training_main(argv: List[str]) -> int:
    """pretrain_gpt.main, plus the reference logits after the checkpoint is written."""
    import pretrain_gpt
    from megatron.training.checkpoint import save_load as checkpointing

    save = checkpointing.save_checkpoint

    def save_then_reference(args, iteration, model, *rest, **kwargs):
        final = save(args, iteration, model, *rest, **kwargs)
        _reference_logits(args, model, os.environ[REFERENCE_ENV])
        return final

    checkpointing.save_checkpoint = save_then_reference
    return pretrain_gpt.main(argv)


if __name__ == "__main__":
    sys.exit(_training_main(sys.argv[1:]))
