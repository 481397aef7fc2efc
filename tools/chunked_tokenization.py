"""Tokenizing long documents in pieces, with exactly the whole document's tokens
(``tools/preprocess_data.py --tokenize-chunk-chars``).

Why: one 30 MB document passed to a HF tokenizer in one call peaks at several GB (per-byte
alignment tables and per-token strings); cut where the tokens provably do not change (the
reasoning below), memory stays bounded and the ``.bin/.idx`` files are byte-identical.
"""

import re
from typing import Any, Iterator, Optional

import numpy

from megatron.training.data.tokenizer import SENTENCEPIECE_TYPES


# --------------------------------------------------------------------------------------------
# Tokenizing long documents in pieces.
#
# Why the pieces give exactly the whole-document tokens: GPT-2's byte-level BPE first splits the
# text with the regex
#     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# and then merges within each pre-token only.  Cut at a position p where text[p] is an ASCII
# space, text[p-1] is not whitespace and text[p+1] is not whitespace ("word| next"):
#   * the pre-token containing text[p-1] ends at p: only the whitespace alternatives can continue
#     across a space, and text[p-1] is not whitespace (a space is allowed only as the first char
#     of the other alternatives);
#   * the pre-token starting at p is " " + the run after it (the " ?" prefix; "\s+(?!\S)" cannot
#     match a single space before a non-space), and the regex has no look-behind or anchors, so
#     matching at p does not depend on the text before p; the regex only looks ahead within a
#     whitespace run, which ends before p-1 on the left of the cut.
# So both halves pre-tokenize into exactly the whole text's pre-tokens.  A run of several spaces
# or newlines is never cut (no cut next to whitespace on either side).  "Not whitespace" uses
# Python's str.isspace, a superset of the Unicode White_Space set the regex's \s matches, so the
# check is conservative.  Other tokenizers normalize whitespace or search globally (SentencePiece
# adds a dummy prefix and collapses spaces; unigram is a whole-string Viterbi search), so they
# are not cut: see chunking_unsafe_reason.
# --------------------------------------------------------------------------------------------

# A space with a non-whitespace character on both sides: the only places a document is cut.
_CUT_RE = re.compile(r"(?<=\S) (?=\S)")

# Tricky text checked at startup (whole vs. pieces) before chunking is enabled for a tokenizer:
# a cheap guard against a tokenizer configuration this module's reasoning does not cover.
_PROBE_TEXT = ("Hello world!  Two  spaces,\tTABS\t\tand\n\nnewlines \n trailing  \n"
               "It's we'll they've I'm 'quoted' \"dq\" x=1+2 12345 67.89 café naïve 東京 都 "
               "emoji 🎉 🎉🎉 nbsp\u00a0here ideo\u3000space sep\u2028line "
               "<|endoftext|> <s> </s> [CLS] end.   ")


def _last_cut(text: str, lo: int, hi: int) -> int:
    """The largest cut position p with lo <= p <= hi, or -1.  Scans backwards from hi in growing
    windows so that a normal text (cut points every few characters) costs a few hundred chars."""
    window = 256
    while True:
        a = max(lo, hi - window)
        last = -1
        for m in _CUT_RE.finditer(text, a, hi + 2):  # endpos hi+2: the look-ahead may see hi+1
            last = m.start()
        if last >= 0 or a == lo:
            return last
        window *= 4


def iter_text_pieces(text: str, chunk_chars: int) -> Iterator[str]:
    """Split ``text`` into consecutive pieces (their concatenation is ``text``) of at most
    ``chunk_chars`` characters where possible, cut only before a space that has a non-whitespace
    character on both sides (see the comment above for why the tokens then do not change).

    A stretch longer than ``chunk_chars`` with no such space (minified JSON, base64, a huge run of
    whitespace) stays one piece: cutting it elsewhere could change the tokens.
    """
    if chunk_chars <= 0:
        yield text
        return
    n, start = len(text), 0
    while n - start > chunk_chars:
        p = _last_cut(text, start + 1, start + chunk_chars)
        if p < 0:
            m = _CUT_RE.search(text, start + chunk_chars + 1)
            if m is None:
                break
            p = m.start()
        yield text[start:p]
        start = p
    yield text[start:]


def _backend_tokenizer(tokenizer: Any) -> Any:
    """The HF ``tokenizers.Tokenizer`` behind one of the trainer's wrappers, or None."""
    inner = getattr(tokenizer, "_tok", None)
    if inner is None:
        return None
    backend = getattr(inner, "backend_tokenizer", None)  # transformers fast tokenizer
    if backend is None:
        backend = getattr(inner, "_tokenizer", None)  # tokenizers' ByteLevelBPETokenizer
    return backend


def chunking_unsafe_reason(tokenizer: Any) -> Optional[str]:
    """None if a document may be tokenized in pieces (:func:`iter_text_pieces`) with exactly the
    whole-document tokens, else why not (printed at startup; the document is then tokenized whole).

    Allowed: a HF ``tokenizers`` pipeline that is GPT-2 byte-level BPE -- no normalizer, the
    ``ByteLevel`` pre-tokenizer with its GPT-2 regex, a BPE model without dropout -- and added
    tokens that contain no whitespace and do not strip or require spaces around them (an
    ``rstrip`` token just before a cut would eat the space after the cut only when tokenized
    whole).  Then the pieces are also checked on a probe text.
    """
    name = type(tokenizer).__name__
    if name in SENTENCEPIECE_TYPES:
        return ("SentencePiece normalizes whitespace and adds a dummy prefix per call (and unigram "
                "segmentation is a whole-string search), so pieces could tokenize differently")
    backend = _backend_tokenizer(tokenizer)
    if backend is None:
        return f"{name} is not backed by a HF 'tokenizers' pipeline (a slow tokenizer?)"
    from tokenizers import models, pre_tokenizers

    if backend.normalizer is not None:
        return f"its normalizer ({type(backend.normalizer).__name__}) may act across a cut"
    pre = backend.pre_tokenizer
    if not isinstance(pre, pre_tokenizers.ByteLevel) or not pre.use_regex:
        return (f"its pre-tokenizer ({type(pre).__name__}) is not GPT-2's byte-level regex split; "
                f"only that one is known to be safe to cut")
    model = backend.model
    if not isinstance(model, models.BPE) or model.dropout:
        return f"its model ({type(model).__name__}) is not a deterministic BPE"
    for tok in backend.get_added_tokens_decoder().values():
        if tok.lstrip or tok.rstrip or tok.single_word or any(c.isspace() for c in tok.content):
            return (f"its added token {tok.content!r} contains whitespace or strips / requires "
                    f"spaces around it")
    affixes = tokenizer.document_affixes()
    if affixes is None:
        return "its special tokens around a document could not be told apart from the text's"
    whole = list(tokenizer.tokenize(_PROBE_TEXT))
    pieces = [i for piece in iter_text_pieces(_PROBE_TEXT, 8)
              for i in tokenizer.tokenize_text(piece)]
    if affixes[0] + pieces + affixes[1] != whole:
        return "tokenizing a probe text in pieces gave different tokens than tokenizing it whole"
    return None


def tokenize_document(tokenizer: Any, text: str, chunk_chars: int,
                      eod: Optional[int] = None) -> "numpy.ndarray":
    """Token ids of ``text`` (int64): ``tokenizer.tokenize(text)`` -- with the tokenizer's
    special tokens around the document (a Llama BOS), as Megatron-LM writes it -- computed in
    pieces of about ``chunk_chars`` characters (0: whole; the affixes once around the pieces),
    followed by ``eod`` if given -- unless the text has no tokens at all (an empty document stays
    empty).  Why int64 arrays per piece: a Python list of ints costs ~36 bytes per token, a few
    hundred MB for a 30 MB document; the arrays cost 8."""
    pieces = list(iter_text_pieces(text, chunk_chars))
    if len(pieces) == 1:
        parts = [numpy.asarray(tokenizer.tokenize(text), dtype=numpy.int64)]
        affixes = tokenizer.document_affixes()
        has_text = len(parts[0]) > (len(affixes[0]) + len(affixes[1]) if affixes else 0)
    else:
        before, after = tokenizer.document_affixes()
        parts = [numpy.asarray(tokenizer.tokenize_text(piece), dtype=numpy.int64)
                 for piece in pieces]
        has_text = any(len(p) for p in parts)
        parts = ([numpy.asarray(before, dtype=numpy.int64)] + parts
                 + [numpy.asarray(after, dtype=numpy.int64)])
    if not has_text:
        return numpy.zeros(0, dtype=numpy.int64)
    if eod is not None:
        parts.append(numpy.asarray([eod], dtype=numpy.int64))
    return parts[0] if len(parts) == 1 else numpy.concatenate(parts)


def effective_chunk_chars(tokenizer: Any, chunk_chars: int) -> "tuple[int, Optional[str]]":
    """``(chunk_chars to use, reason chunking is off or None)`` for this tokenizer."""
    if chunk_chars <= 0:
        return 0, "--tokenize-chunk-chars 0"
    reason = chunking_unsafe_reason(tokenizer)
    return (0, reason) if reason else (chunk_chars, None)
