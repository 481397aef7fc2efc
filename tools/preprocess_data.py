#!/usr/bin/env python3
"""Tokenize a text corpus into megatron-core's indexed dataset format (.bin/.idx).

Command-line interface follows Megatron-LM's ``tools/preprocess_data.py``::

    python tools/preprocess_data.py \
        --input data/corpus.jsonl --json-keys text \
        --output-prefix data/my-gpt2 \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 2

For every key ``K`` in ``--json-keys`` this writes ``{output_prefix}_{K}_document.bin`` and
``.idx``, readable with ``megatron.core.datasets.indexed_dataset.IndexedDataset`` and usable as
``--data-path {output_prefix}_{K}_document`` for training.

Inputs: a JSON-lines file (``.jsonl``/``.json``, optionally ``.gz``), a ``.parquet`` file, or a
directory written by HF ``datasets``' ``save_to_disk`` (a ``DatasetDict`` uses its ``train``
split unless ``--split`` names another).

The SDP4Bit reference's command line (from Megatron-DeepSpeed) is accepted as written::

    python tools/preprocess_data.py --input pile.jsonl --split train --columns text \
        --output-prefix pile --vocab-file vocab.json --merge-file merges.txt --dataset-impl mmap \
        --tokenizer-type GPT2BPETokenizer --append-eod --torch-backend mpi

``--columns`` is ``--json-keys``; ``--split`` picks a HF ``DatasetDict`` split (a single file has
one split, so ``train`` is a no-op there).  ``--dataset-impl mmap`` and ``--torch-backend`` no
longer mean anything and parse with a one-line note each, so that old scripts keep working:
the mmap ``.bin/.idx`` pair is the only format megatron-core reads (any other
``--dataset-impl`` is refused rather than silently written as mmap), and tokenization runs in
this process plus its ``--workers`` without torch.distributed.

A bad record (a line that is not UTF-8 or not a JSON object, a missing, ``null`` or non-string
``--json-keys`` field) stops the run with the file and its 1-based line number (record number
for parquet / HF inputs) and what is wrong; ``--skip-bad-records`` skips such records instead
and reports how many, and the first few numbers, at the end.

Tokenizers (all loaded from local files, no network access needed):

* ``GPT2BPETokenizer``: GPT-2 byte-level BPE from ``--vocab-file`` (vocab.json) and
  ``--merge-file`` (merges.txt); end-of-document token ``<|endoftext|>``.
* ``HuggingFaceTokenizer``: ``--tokenizer-model`` = a local directory saved with
  ``save_pretrained`` (or a hub name already in the local cache); EOD = ``eos_token``.
* ``SentencePieceTokenizer``, ``GPTSentencePieceTokenizer``, ``Llama2Tokenizer``:
  ``--tokenizer-model`` = a ``.model`` file, each as Megatron-LM's type of that name (see
  :mod:`megatron.training.data.tokenizer`): special tokens added and EOD = ``<EOD>``; the model's
  pieces and EOD = ``eos``; the same with a BOS at every document start.

Long documents are tokenized in pieces of about ``--tokenize-chunk-chars`` characters (default
1,000,000) so that memory stays bounded: one 30 MB document passed to a HF tokenizer in one call
peaks at several GB (per-byte alignment tables and per-token strings).  The pieces are cut only
where the tokens provably do not change (see :func:`iter_text_pieces`), so the ``.bin/.idx``
files are byte-identical to whole-document tokenization; tokenizers for which that cannot be
guaranteed (SentencePiece, HF tokenizers that are not GPT-2-style byte-level BPE) tokenize each
document whole, and the startup line says so.  The final line reports the peak resident memory.

The tokenizers are the trainer's own (``megatron/training/data/tokenizer.py``), so the ids written
here are exactly what ``pretrain_gpt.py`` assumes. megatron-core 0.16.1's wrappers are not used:
its ``GPT2BPETokenizer`` path always resolves the hub model ``gpt2`` (fails offline) and its
SentencePiece wrapper has no ``eod`` and rewrites runs of whitespace, which would corrupt
source-code corpora.

``build_tokenizer`` is importable without side effects::

    from tools.preprocess_data import build_tokenizer
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=..., merge_file=...)
    tok.tokenize("hello"), tok.eod, tok.vocab_size
"""

import argparse
import json
import multiprocessing
import os
import resource
import sys
import threading
import time
from typing import Any, Iterator, List

import numpy

# Run as a script, sys.path[0] is tools/: make the repository root importable (megatron.training,
# and this script's own modules as tools.*).
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from megatron.training.data.tokenizer import (  # noqa: E402
    SENTENCEPIECE_TYPES, TokenizerError, build_tokenizer_from)
from tools.chunked_tokenization import (  # noqa: E402
    chunking_unsafe_reason, effective_chunk_chars, iter_text_pieces, tokenize_document)
from tools.corpus_readers import PreprocessError, detect_input_format, iter_records  # noqa: E402

__all__ = ["TOKENIZER_TYPES", "DEFAULT_TOKENIZE_CHUNK_CHARS", "PreprocessError", "build_tokenizer",
           "describe_tokenizer", "iter_text_pieces", "chunking_unsafe_reason", "tokenize_document",
           "effective_chunk_chars", "detect_input_format", "iter_records", "Encoder", "get_args",
           "preprocess", "main"]

TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", *SENTENCEPIECE_TYPES)
DEFAULT_TOKENIZE_CHUNK_CHARS = 1_000_000


def build_tokenizer(tokenizer_type, vocab_file=None, merge_file=None, tokenizer_model=None):
    """Build a tokenizer with ``.tokenize(text) -> list[int]``, ``.detokenize``, ``.eod``,
    ``.vocab_size`` (the unpadded vocabulary size, special tokens included)."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise PreprocessError(f"unsupported --tokenizer-type {tokenizer_type!r}; choose from "
                              f"{', '.join(TOKENIZER_TYPES)}")
    try:
        return build_tokenizer_from(tokenizer_type, vocab_file=vocab_file, merge_file=merge_file,
                                    tokenizer_model=tokenizer_model)
    except TokenizerError as e:
        raise PreprocessError(str(e)) from None


def describe_tokenizer(tokenizer: Any) -> str:
    """A one-line, human-readable description for the startup log.

    Why: the default ``repr`` (``<...GPT2BPETokenizer object at 0x7f...>``) says neither which
    files were loaded nor the vocabulary size, which is what one checks when a run's ids look wrong.
    """
    name = type(tokenizer).__name__
    paths = list(getattr(tokenizer, "unique_identifiers", {}).get("tokenizer_path", []))
    labels = {"GPT2BPETokenizer": ("vocab_file", "merge_file")}.get(name, ("model",))
    parts = [f"{label}={path}" for label, path in zip(labels, paths)]
    parts += [f"vocab_size={tokenizer.vocab_size}", f"eod={tokenizer.eod}"]
    return f"{name}({', '.join(parts)})"


# --------------------------------------------------------------------------------------------
# Encoding (runs in worker processes when --workers > 1)
# --------------------------------------------------------------------------------------------


class Encoder:
    """Turns one record into {key: token ids or None (empty)}; errors are returned, not raised,
    so that the parent process can report them with the record number."""

    def __init__(self, tokenizer_kwargs, keys, append_eod, unit, chunk_chars: int = 0):
        self.tokenizer_kwargs = tokenizer_kwargs
        self.keys = keys
        self.append_eod = append_eod
        self.unit = unit
        # Already checked against the tokenizer type by the parent (effective_chunk_chars): the
        # workers build the same tokenizer from the same files, so the check is not repeated.
        self.chunk_chars = chunk_chars
        self.tokenizer = None

    def initializer(self):
        self.tokenizer = build_tokenizer(**self.tokenizer_kwargs)

    def encode(self, item):
        recno, payload = item
        if self.tokenizer is None:
            self.initializer()
        if isinstance(payload, (bytes, str)):
            if isinstance(payload, bytes):
                nbytes = len(payload)
                try:
                    payload = payload.decode("utf-8")
                except UnicodeDecodeError as e:
                    return recno, None, nbytes, (
                        f"{self.unit} {recno}: not valid UTF-8 (byte 0x{payload[e.start]:02x} at byte "
                        f"{e.start + 1} of the line: {e.reason})")
            else:
                nbytes = len(payload.encode("utf-8"))
            try:
                rec = json.loads(payload)
            except json.JSONDecodeError as e:
                return recno, None, nbytes, f"{self.unit} {recno}: invalid JSON ({e.msg} at column {e.colno})"
            count_text_bytes = False  # the line's bytes are counted already
        else:
            rec = payload
            nbytes = 0
            count_text_bytes = True
        del payload  # a long line's decoded copy is not needed while its text is tokenized
        if not isinstance(rec, dict):
            return recno, None, nbytes, f"{self.unit} {recno}: expected a JSON object, got {type(rec).__name__}"
        out = {}
        for key in self.keys:
            if key not in rec:
                return recno, None, nbytes, (
                    f"{self.unit} {recno}: record has no key {key!r} (keys present: {sorted(rec)}); "
                    f"choose the text field with --json-keys"
                )
            text = rec[key]
            if not isinstance(text, str):
                # null is a bad record, not an empty document: it usually means a broken export,
                # which silently shrinking the corpus would hide.
                what = "null" if text is None else type(text).__name__
                return recno, None, nbytes, f"{self.unit} {recno}: value of {key!r} is {what}, not a string"
            if count_text_bytes:
                nbytes += len(text.encode("utf-8"))
            if not text.strip():
                out[key] = None
                continue
            ids = tokenize_document(self.tokenizer, text, self.chunk_chars,
                                    eod=self.tokenizer.eod if self.append_eod else None)
            out[key] = ids if len(ids) else None
        return recno, out, nbytes, None


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def output_prefix_for(output_prefix, key, level="document"):
    return f"{output_prefix}_{key}_{level}"


def get_args(argv=None):
    p = argparse.ArgumentParser(
        description="Tokenize a corpus into megatron-core .bin/.idx files",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSON-lines file, .parquet file, or HF save_to_disk directory")
    g.add_argument("--json-keys", "--columns", dest="json_keys", nargs="+", default=["text"],
                   help="fields/columns to tokenize (default: text); one output dataset per key")
    g.add_argument("--split", default=None,
                   help="split of a HF DatasetDict (default: train); a single file has one split")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    g.add_argument("--tokenizer-model", default=None, help="HF tokenizer dir/name or SentencePiece .model")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (output is identical for any value)")
    g.add_argument("--chunk-size", type=int, default=32, help="records per task sent to a worker")
    g.add_argument("--tokenize-chunk-chars", type=int, default=DEFAULT_TOKENIZE_CHUNK_CHARS, metavar="N",
                   help=f"tokenize a document longer than N characters in pieces of about N "
                        f"(default: {DEFAULT_TOKENIZE_CHUNK_CHARS:,}), bounding memory: one 30 MB "
                        f"document tokenized in one call needs several GB.  Pieces are cut only "
                        f"before a space that has a non-space character on both sides, where "
                        f"GPT-2 byte-level BPE gives exactly the whole-document tokens (output "
                        f"is byte-identical); a stretch of more than N characters without such a "
                        f"space stays one piece.  GPT2BPETokenizer and GPT-2-style byte-level "
                        f"BPE HuggingFaceTokenizer models are cut; SentencePieceTokenizer and "
                        f"other HF tokenizers always tokenize whole documents (the startup line "
                        f"says which).  0: never cut")
    g.add_argument("--log-interval", type=int, default=1000, help="report progress every N documents (stderr)")
    g.add_argument("--skip-bad-records", action="store_true",
                   help="skip records that are not valid UTF-8 / JSON objects or lack a --json-keys "
                        "string, and report how many (and which) at the end; default: stop at the "
                        "first one with its line (record) number")
    g = p.add_argument_group("legacy flags (accepted for old Megatron-LM / SDP4Bit scripts; no effect)")
    g.add_argument("--dataset-impl", default=None, metavar="mmap",
                   help="only mmap (.bin/.idx) is written; any other value is an error")
    g.add_argument("--torch-backend", default=None, metavar="BACKEND",
                   help="ignored: no torch.distributed here (use --workers for parallelism)")
    g.add_argument("--partitions", type=int, default=None, metavar="N",
                   help="ignored: Megatron-LM's input partitions only parallelize; --workers does "
                        "that here, with the same output")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="ignored: documents are always written in input order")
    g.add_argument("--split-sentences", action="store_true",
                   help="not supported (stops): one document per record is written; Megatron-LM "
                        "wrote one per sentence (nltk punkt) into *_sentence files")
    g.add_argument("--keep-newlines", action="store_true",
                   help="only acts with --split-sentences (not supported); newlines are always "
                        "kept in the text")
    g.add_argument("--lang", default=None, help="only acts with --split-sentences (not supported)")
    args = p.parse_args(argv)
    if args.split_sentences:
        p.error("--split-sentences is not supported: this tool writes one document per record "
                "(<prefix>_<key>_document.bin/.idx); split the text into sentences before, or drop "
                "the flag")
    if args.workers < 1:
        p.error("--workers must be >= 1")
    if args.log_interval < 1:
        p.error("--log-interval must be >= 1")
    if args.chunk_size < 1:
        p.error("--chunk-size must be >= 1")
    if args.tokenize_chunk_chars < 0:
        p.error("--tokenize-chunk-chars must be >= 0 (0: tokenize each document whole)")
    if len(set(args.json_keys)) != len(args.json_keys):
        p.error("--json-keys contains duplicates")
    if args.dataset_impl is not None and args.dataset_impl != "mmap":
        p.error(f"--dataset-impl {args.dataset_impl}: only the mmap format (megatron-core .bin/.idx, "
                f"what pretrain_gpt.py reads) is written; pass --dataset-impl mmap or drop the flag")
    args.legacy_notes = legacy_flag_notes(args)
    return args


def legacy_flag_notes(args: argparse.Namespace) -> List[str]:
    """One line per legacy flag given, saying why it has no effect.

    Why a note instead of silence: a user copying an old recipe should learn that the flag can go
    (and that ``--torch-backend mpi`` does not make ``mpirun`` split the work) without the tool
    refusing a command line that produces exactly the files they expect.
    """
    notes = []
    if args.dataset_impl == "mmap":
        notes.append("note: --dataset-impl mmap is the only format (megatron-core .bin/.idx) and the "
                     "default; the flag can be dropped")
    if args.partitions is not None or args.keep_sequential_samples:
        notes.append("note: --partitions / --keep-sequential-samples are ignored: --workers "
                     "parallelizes and documents are written in input order (the same files); "
                     "the flags can be dropped")
    if args.keep_newlines or args.lang is not None:
        notes.append("note: --keep-newlines / --lang act only with --split-sentences (not "
                     "supported); newlines are kept in the text; the flags can be dropped")
    if args.torch_backend is not None:
        notes.append(f"note: --torch-backend {args.torch_backend} is ignored: tokenization runs in this "
                     f"process and its --workers, without torch.distributed (launch it once, not with "
                     f"mpirun); the flag can be dropped")
    return notes


def _until(stop: threading.Event, records: Iterator) -> Iterator:
    """``records`` until ``stop`` is set: how a failed run stops feeding the worker pool."""
    for record in records:
        if stop.is_set():
            return
        yield record


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def peak_rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    """Peak resident set size in MB (``ru_maxrss``: KiB on Linux, bytes on macOS).

    Why report it: the memory a corpus needs is decided by its longest document, which is easy to
    miss; the number tells how much headroom --tokenize-chunk-chars / --workers leave.
    """
    rss = resource.getrusage(who).ru_maxrss
    return rss / 1e6 if sys.platform == "darwin" else rss * 1024 / 1e6


def preprocess(args):
    """Run the conversion; returns a summary dict. Raises PreprocessError on bad input."""
    import warnings

    with warnings.catch_warnings():  # megatron-core's import-time "Transformer Engine/Apex" notices
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.datasets.indexed_dataset import (
            DType,
            IndexedDatasetBuilder,
            get_bin_path,
            get_idx_path,
        )

    for note in getattr(args, "legacy_notes", ()):
        _log(note)
    keys = list(args.json_keys)
    tok_kwargs = dict(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                      merge_file=args.merge_file, tokenizer_model=args.tokenizer_model)
    tokenizer = build_tokenizer(**tok_kwargs)  # fail fast in the parent on bad tokenizer args
    fmt, records = iter_records(args.input, keys, args.split)
    unit = "line" if fmt == "jsonl" else "record"
    if fmt != "hf" and args.split not in (None, "train"):
        _log(f"note: --split {args.split} is ignored: a {fmt} file has one split, all of which is read")
    dtype = DType.optimal_dtype(tokenizer.vocab_size)

    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    prefixes = {k: output_prefix_for(args.output_prefix, k) for k in keys}
    builders = {k: IndexedDatasetBuilder(get_bin_path(prefixes[k]), dtype=dtype) for k in keys}

    chunk_chars, no_chunk_reason = effective_chunk_chars(
        tokenizer, getattr(args, "tokenize_chunk_chars", DEFAULT_TOKENIZE_CHUNK_CHARS))
    encoder = Encoder(tok_kwargs, keys, args.append_eod, unit, chunk_chars)
    pool = None
    stop_feeding = threading.Event()  # set on an error: the pool is given no more records
    if args.workers > 1:
        pool = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn").Pool(
            args.workers, initializer=encoder.initializer)
        # imap keeps input order; its task thread pulls records through _until(stop_feeding)
        encoded = pool.imap(encoder.encode, _until(stop_feeding, records), args.chunk_size)
    else:
        encoder.tokenizer = tokenizer
        encoded = map(encoder.encode, records)

    chunking = (f"{chunk_chars} chars" if chunk_chars else f"off, documents tokenized whole ({no_chunk_reason})")
    _log(f"preprocess: input={args.input} ({fmt}) keys={keys} tokenizer={describe_tokenizer(tokenizer)} "
         f"dtype={numpy.dtype(dtype).name} workers={args.workers} tokenize-chunk={chunking}")
    stats = {k: {"documents": 0, "tokens": 0, "empty": 0} for k in keys}
    empty_examples = {k: [] for k in keys}
    # One key: an empty document is skipped. Several keys: it is written, with no tokens (as
    # Megatron-LM writes an empty text: no EOD either), so that document i of every output is
    # record i.
    aligned = len(keys) > 1
    n_bad, bad = 0, []  # skipped bad records (--skip-bad-records): count, first 5 (number, message)
    n_records = total_bytes = 0
    start = time.time()
    ok = False
    try:
        for recno, out, nbytes, err in encoded:
            if err is not None:
                if not args.skip_bad_records:
                    raise PreprocessError(f"{args.input}: {err}; fix it, or pass --skip-bad-records "
                                          f"to skip bad records")
                n_bad += 1
                if len(bad) < 5:
                    bad.append((recno, err))
                continue
            n_records += 1
            total_bytes += nbytes
            for key, ids in out.items():
                if ids is None:
                    stats[key]["empty"] += 1
                    if len(empty_examples[key]) < 5:
                        empty_examples[key].append(recno)
                    if aligned:   # document i of every key's file is record i, as Megatron-LM
                        builders[key].add_document([], [0])
                    continue
                builders[key].add_document(ids, [len(ids)])
                stats[key]["documents"] += 1
                stats[key]["tokens"] += len(ids)
            if n_records % args.log_interval == 0:
                el = max(time.time() - start, 1e-9)
                _log(f"processed {n_records} documents ({n_records / el:.1f} docs/s, "
                     f"{total_bytes / el / 1e6:.2f} MB/s)")
        if n_bad and n_records == 0:
            raise PreprocessError(f"{args.input}: all {n_bad} records are bad, e.g. {bad[0][1]}")
        ok = True
    except Exception:
        # Not Pool.terminate(): it kills a worker that may be holding the result queue's lock
        # mid-write, and the pool's task thread then waits on that lock forever (CPython's pool;
        # hung 2 of ~770 runs here). The workers finish the chunks already queued and exit.
        stop_feeding.set()
        raise
    except BaseException:  # Ctrl-C: the workers got the signal too; don't wait for them
        if pool is not None:
            pool.terminate()
        raise
    finally:
        try:   # the outputs first: a Ctrl-C while the pool drains must not leave partial files
            for key, b in builders.items():
                if ok:
                    b.finalize(get_idx_path(prefixes[key]))
                else:
                    b.data_file.close()
                    for path in (get_bin_path(prefixes[key]), get_idx_path(prefixes[key])):
                        if os.path.exists(path):
                            os.remove(path)
        finally:
            if pool is not None:
                pool.close()
                pool.join()

    elapsed = max(time.time() - start, 1e-9)
    if n_records == 0:
        _log(f"warning: input {args.input!r} contained no records")
    if n_bad:
        _log(f"warning: skipped {n_bad} bad record(s) (--skip-bad-records), at {unit}s "
             f"{', '.join(str(r) for r, _ in bad)}{', ...' if n_bad > len(bad) else ''}; first: "
             f"{bad[0][1]}")
    for key in keys:
        if stats[key]["empty"]:
            verb, why = (("wrote", " (kept: every key's document i is record i)") if aligned
                         else ("skipped", ""))
            _log(f"warning: {verb} {stats[key]['empty']} empty document(s) for key {key!r}{why} "
                 f"(e.g. {unit}s {', '.join(map(str, empty_examples[key]))})")
        if stats[key]["documents"] == 0:
            _log(f"warning: no documents written for key {key!r}; {prefixes[key]} is empty")
    summary = {
        "input": args.input,
        "format": fmt,
        "records": n_records,
        "bad_records_skipped": n_bad,
        "bad_record_numbers": [r for r, _ in bad],  # the first 5
        "bytes": total_bytes,
        "seconds": round(elapsed, 3),
        "docs_per_s": round(n_records / elapsed, 1),
        "mb_per_s": round(total_bytes / elapsed / 1e6, 3),
        "vocab_size": tokenizer.vocab_size,
        "eod": tokenizer.eod,
        "tokenize_chunk_chars": chunk_chars,  # 0: documents were tokenized whole
        "outputs": {k: dict(prefix=prefixes[k], **stats[k]) for k in keys},
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    # The workers' peak: ru_maxrss of the largest child this process has waited for (the pool was
    # joined above); in a long-lived caller it may include earlier children too.
    rss = f"peak RSS {summary['peak_rss_mb']:.0f} MB"
    if pool is not None:
        summary["peak_rss_mb_workers"] = round(peak_rss_mb(resource.RUSAGE_CHILDREN), 1)
        rss += f" (largest worker {summary['peak_rss_mb_workers']:.0f} MB)"
    for key in keys:
        s = stats[key]
        _log(f"done: {prefixes[key]}.bin/.idx: {s['documents']} documents, {s['tokens']} tokens, "
             f"{s['empty']} empty {'written' if aligned else 'skipped'}")
    _log(f"done: {n_records} records, {total_bytes / 1e6:.2f} MB in {elapsed:.2f}s "
         f"({n_records / elapsed:.1f} docs/s, {total_bytes / elapsed / 1e6:.2f} MB/s), {rss}")
    return summary


def main(argv=None):
    args = get_args(argv)
    try:
        preprocess(args)
    except PreprocessError as e:
        _log(f"error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
