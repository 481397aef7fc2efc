"""Tokenizers for the trainer, built from local files only (no network).

Why our own small classes: megatron-core 0.16.1's new ``megatron.core.tokenizers`` API wants a
``metadata.json`` next to the tokenizer and its legacy base class logs a deprecation warning per
instance; Megatron-LM's ``build_tokenizer`` lives outside the wheel.  The GPT dataset only needs
``vocab_size``, ``eod`` and ``unique_identifiers`` (duck-typed), so thin wrappers around the HF
``tokenizers`` / ``transformers`` / ``sentencepiece`` libraries are enough and stay offline.
``pad`` is deliberately absent: megatron-core then uses its own out-of-vocabulary pad id (-1).
"""

from __future__ import annotations

import argparse
import json
from collections import OrderedDict
from typing import Any, List, Sequence

import numpy

EOD_TOKEN = "<|endoftext|>"


class _TokenizerBase:
    """Shared bits: identifiers for megatron-core's dataset cache hash."""

    def __init__(self, *paths: str, **options: Any) -> None:
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = list(paths)
        for key, value in options.items():
            self.unique_identifiers[key] = str(value)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def eod(self) -> int:
        raise NotImplementedError

    @property
    def eos(self) -> int:
        return self.eod

    def tokenize(self, text: str) -> List[int]:
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError


class GPT2BPETokenizer(_TokenizerBase):
    """Byte-level BPE from GPT-2 style ``vocab.json`` + ``merges.txt`` (HF ``tokenizers``)."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        super().__init__(vocab_file, merge_file)
        from tokenizers import ByteLevelBPETokenizer

        self._tok = ByteLevelBPETokenizer(vocab_file, merge_file, add_prefix_space=False)
        eod = self._tok.token_to_id(EOD_TOKEN)
        if eod is None:
            raise ValueError(f"{vocab_file} has no {EOD_TOKEN!r} token")
        self._eod = eod

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


class HuggingFaceTokenizer(_TokenizerBase):
    """``transformers.AutoTokenizer`` from a local directory (``local_files_only``)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eod(self) -> int:
        eos = self._tok.eos_token_id
        if eos is None:
            raise ValueError("HuggingFace tokenizer has no eos token to use as end-of-document")
        return eos

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


class SentencePieceTokenizer(_TokenizerBase):
    """SentencePiece ``.model`` file; EOD = the model's eos id."""

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file)
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))


class NullTokenizer(_TokenizerBase):
    """Text is whitespace-separated token ids; EOD is the last id.  For mock data / tests."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size=vocab_size)
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._vocab_size - 1

    def tokenize(self, text: str) -> List[int]:
        return [int(t) for t in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in numpy.asarray(ids).reshape(-1))


def build_tokenizer(args: argparse.Namespace) -> _TokenizerBase:
    """The tokenizer named by ``--tokenizer-type`` (validated paths, see ``validate_args``)."""
    kind = args.tokenizer_type
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(args.vocab_file, args.merge_file)
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(args.tokenizer_model)
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(args.tokenizer_model)
    if kind == "NullTokenizer":
        return NullTokenizer(args.vocab_size)
    raise ValueError(f"unknown --tokenizer-type {kind!r}")
