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
import os
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
        """A document's ids, as Megatron-LM's tokenizer of the same type gives them."""
        raise NotImplementedError

    def tokenize_text(self, text: str) -> List[int]:
        """The ids of ``text`` alone, without the special tokens :meth:`tokenize` frames a
        document with (``tokenize == prefix + tokenize_text + suffix``, see
        :meth:`document_affixes`): what a document's pieces are tokenized with."""
        return self.tokenize(text)

    def document_affixes(self) -> "tuple[List[int], List[int]] | None":
        """(ids before, ids after) the text of every :meth:`tokenize` result; None when they
        cannot be told apart (then a document is only tokenized whole)."""
        return [], []

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError


class TokenizerError(ValueError):
    """A tokenizer could not be built from the given files (message says which and why)."""


def _require_file(path: str | None, what: str, flag: str) -> str:
    if not path:
        raise TokenizerError(f"{what} is required: pass {flag}")
    if not os.path.isfile(path):
        raise TokenizerError(f"{what} {path!r} ({flag}) does not exist or is not a file")
    return path


class GPT2BPETokenizer(_TokenizerBase):
    """Byte-level BPE from GPT-2 style ``vocab.json`` + ``merges.txt`` (HF ``tokenizers``).

    Like Megatron-LM's GPT-2 tokenizer, a literal ``<|endoftext|>`` inside a document is ordinary
    text; document boundaries come only from the EOD id appended at preprocessing time.
    """

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        super().__init__(vocab_file, merge_file)
        from tokenizers import ByteLevelBPETokenizer

        with open(vocab_file, encoding="utf-8") as f:
            try:
                vocab = json.load(f)
            except json.JSONDecodeError as exc:
                raise TokenizerError(f"vocab file {vocab_file!r} is not valid JSON: {exc}") from None
        if EOD_TOKEN not in vocab:
            raise TokenizerError(f"vocab file {vocab_file!r} has no {EOD_TOKEN!r} token")
        try:
            self._tok = ByteLevelBPETokenizer(vocab_file, merge_file, add_prefix_space=False)
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise TokenizerError(f"cannot load BPE from {vocab_file!r} / {merge_file!r}: {exc}") from None
        self._eod = vocab[EOD_TOKEN]

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class HuggingFaceTokenizer(_TokenizerBase):
    """``transformers.AutoTokenizer`` from a local directory (``local_files_only``: no network).

    EOD is the eos token, else the sep token.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path)
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:
            raise TokenizerError(f"cannot load HuggingFace tokenizer {path!r}: {exc}") from None
        eod = self._tok.eos_token_id if self._tok.eos_token_id is not None else self._tok.sep_token_id
        if eod is None:
            raise TokenizerError(f"HuggingFace tokenizer {path!r} defines neither eos nor sep token "
                                 "to use as end-of-document")
        self._eod = int(eod)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> List[int]:
        """With the tokenizer's special tokens, as Megatron-LM's ``_HuggingFaceTokenizer``: a
        Llama tokenizer starts every document with its BOS (GPT-2's adds nothing)."""
        return self._tok(text)["input_ids"]

    def tokenize_text(self, text: str) -> List[int]:
        return self._tok(text, add_special_tokens=False)["input_ids"]

    def document_affixes(self) -> "tuple[List[int], List[int]] | None":
        """Found once on a probe text: where its plain ids sit inside its framed ids."""
        if not hasattr(self, "_affixes"):
            probe = "affix probe"
            framed, plain = self.tokenize(probe), self.tokenize_text(probe)
            self._affixes = None
            for i in range(len(framed) - len(plain) + 1):
                if framed[i:i + len(plain)] == plain:
                    self._affixes = (framed[:i], framed[i + len(plain):])
                    break
        return self._affixes

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


class GPTSentencePieceTokenizer(_TokenizerBase):
    """A SentencePiece ``.model`` as Megatron-LM's ``GPTSentencePieceTokenizer``: the model's own
    pieces only (vocabulary = its piece count), EOD = its eos id, no special tokens added."""

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file)
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except Exception as exc:
            raise TokenizerError(f"cannot load SentencePiece model {model_file!r}: {exc}") from None
        if self._sp.eos_id() < 0:
            raise TokenizerError(f"SentencePiece model {model_file!r} has no eos piece")

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


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron-LM's ``Llama2Tokenizer``: a SentencePiece model whose documents start with its BOS
    (EOD = eos, vocabulary = the piece count)."""

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file)
        if self._sp.bos_id() < 0:
            raise TokenizerError(f"SentencePiece model {model_file!r} has no bos piece")

    def tokenize(self, text: str) -> List[int]:
        return [self._sp.bos_id()] + self._sp.encode(text)

    def tokenize_text(self, text: str) -> List[int]:
        return self._sp.encode(text)

    def document_affixes(self) -> "tuple[List[int], List[int]]":
        return [self._sp.bos_id()], []


class SentencePieceTokenizer(GPTSentencePieceTokenizer):
    """Megatron-LM's ``SentencePieceTokenizer``: the model's pieces plus ``<CLS>``, ``<SEP>``,
    ``<EOD>``, ``<MASK>`` and the pad / bos / eos pieces as special tokens (appended after the
    model's pieces when it lacks them), written as their ids where they occur in the text; EOD =
    ``<EOD>``. So the ``.bin`` files Megatron-LM writes with this type hold the same ids here,
    and the vocabulary covers them (an id past the embedding fails on a GPU)."""

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file)
        sp = self._sp
        self._vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
        self._special: "OrderedDict[str, int]" = OrderedDict()

        def add(piece: str) -> int:
            if piece not in self._vocab:
                self._vocab[piece] = len(self._vocab)
            self._special[piece] = self._vocab[piece]
            return self._vocab[piece]

        def model_piece(index: int, fallback: str) -> str:
            return sp.id_to_piece(index) if 0 <= index < sp.get_piece_size() else fallback

        for piece in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            add(piece)
        add(model_piece(sp.pad_id(), "<PAD>"))
        add(model_piece(sp.bos_id(), "<BOS>"))
        add(model_piece(sp.eos_id(), "<EOS>"))
        self._eod_id = self._special["<EOD>"]
        self._pieces_of = {i: p for p, i in self._special.items()}

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def eod(self) -> int:
        return self._eod_id

    def tokenize(self, text: str) -> List[int]:
        """The text's pieces, a special token's text becoming its id (leftmost first, as
        Megatron-LM splits it)."""
        ids: List[int] = []
        start = 0
        while True:
            hits = [(text.find(piece, start), piece) for piece in self._special]
            hits = [(at, piece) for at, piece in hits if at >= 0]
            if not hits:
                break
            at, piece = min(hits, key=lambda hit: hit[0])
            ids.extend(self._sp.encode(text[start:at]))
            ids.append(self._special[piece])
            start = at + len(piece)
        ids.extend(self._sp.encode(text[start:]))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        out, run = [], []
        for i in ids:
            if int(i) in self._pieces_of:
                out.append(self._sp.decode(run))
                out.append(self._pieces_of[int(i)])
                run = []
            else:
                run.append(int(i))
        out.append(self._sp.decode(run))
        return "".join(out)


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


SENTENCEPIECE_TYPES = {"SentencePieceTokenizer": SentencePieceTokenizer,
                       "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
                       "Llama2Tokenizer": Llama2Tokenizer}
"""Megatron-LM's SentencePiece tokenizer types, each with its semantics (see the classes)."""
TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", *SENTENCEPIECE_TYPES,
                   "NullTokenizer")


def build_tokenizer_from(tokenizer_type: str, *, vocab_file: str | None = None,
                         merge_file: str | None = None, tokenizer_model: str | None = None,
                         vocab_size: int | None = None) -> _TokenizerBase:
    """The one tokenizer factory, shared by the trainer and ``tools/preprocess_data.py``.

    Raises :class:`TokenizerError` naming the missing/bad file and the flag that sets it.
    """
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_require_file(vocab_file, "GPT2BPETokenizer vocab file", "--vocab-file"),
                                _require_file(merge_file, "GPT2BPETokenizer merges file", "--merge-file"))
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise TokenizerError("HuggingFaceTokenizer requires --tokenizer-model (a local directory)")
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        model = _require_file(tokenizer_model, f"{tokenizer_type} SentencePiece model",
                              "--tokenizer-model")
        return SENTENCEPIECE_TYPES[tokenizer_type](model)
    if tokenizer_type == "NullTokenizer":
        if not vocab_size:
            raise TokenizerError("NullTokenizer requires --vocab-size")
        return NullTokenizer(vocab_size)
    raise TokenizerError(f"unknown --tokenizer-type {tokenizer_type!r}; choose from {', '.join(TOKENIZER_TYPES)}")


def build_tokenizer(args: argparse.Namespace) -> _TokenizerBase:
    """The tokenizer named by ``--tokenizer-type`` (paths validated in ``validate_args``)."""
    return build_tokenizer_from(args.tokenizer_type, vocab_file=args.vocab_file,
                                merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                                vocab_size=getattr(args, "vocab_size", None))
