#!/usr/bin/env python3
"""Train a GPT-2 style byte-level BPE tokenizer on a JSON-lines corpus (HF ``tokenizers``).

Writes ``vocab.json`` and ``merges.txt`` (GPT-2 file format, usable with
``--tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ...``).  The special token
``<|endoftext|>`` is always part of the vocabulary and is the end-of-document token.

Example:
    python tools/train_tokenizer.py --input data/quickstart/corpus.jsonl \
        --output-dir data/quickstart/tokenizer --vocab-size 8192
"""

import argparse
import json
import os
import sys

EOD_TOKEN = "<|endoftext|>"


def iter_texts(path, key):
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e})") from None
            if key not in rec:
                raise KeyError(f"{path}:{lineno}: record has no key {key!r} (keys: {sorted(rec)})")
            if rec[key]:
                yield rec[key]


def train(input_path, output_dir, vocab_size=8192, min_frequency=2, key="text"):
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(
        iter_texts(input_path, key),
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN],
        show_progress=False,
    )
    os.makedirs(output_dir, exist_ok=True)
    tok.save_model(output_dir)  # vocab.json + merges.txt
    return os.path.join(output_dir, "vocab.json"), os.path.join(output_dir, "merges.txt"), tok.get_vocab_size()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="JSON-lines corpus")
    p.add_argument("--json-key", default="text")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--min-frequency", type=int, default=2)
    args = p.parse_args(argv)
    if not os.path.isfile(args.input):
        print(f"error: input {args.input!r} not found", file=sys.stderr)
        return 1
    vocab, merges, n = train(args.input, args.output_dir, args.vocab_size, args.min_frequency, args.json_key)
    print(f"trained byte-level BPE, vocab size {n}: {vocab} {merges}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
