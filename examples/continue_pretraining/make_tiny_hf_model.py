#!/usr/bin/env python3
"""A tiny Llama-style Hugging Face model (random weights, built from a config) and a byte-level
BPE tokenizer trained on a few sentences: a stand-in for a downloaded model, so that the
continued-pretraining example runs offline in seconds.  Replace it by any local HF directory
(``config.json`` + safetensors + tokenizer files) of a GPT-2, Llama, Mistral or Qwen2 model.
"""

from __future__ import annotations

import argparse
import os

import torch

TEXT = ["The quick brown fox jumps over the lazy dog.",
        "Communication is the bottleneck of data-parallel training.",
        "Quantized weights and gradients cut the bytes sent per step.",
        "Error feedback keeps the compression error from accumulating."] * 50


def build(output: str, seed: int = 0) -> None:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXT, vocab_size=320, special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<|endoftext|>",
                                  eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=176,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(config)
    model.save_pretrained(output)
    tok.save_pretrained(output)
    print(f"tiny Llama ({sum(p.numel() for p in model.parameters())} "
          f"parameters, vocabulary {len(tok)}) written to {output}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--output", required=True)
    a = p.parse_args()
    os.makedirs(a.output, exist_ok=True)
    build(a.output)
