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

A bad record (a line that is not UTF-8 or not a JSON object, a missing or non-string
``--json-keys`` field) stops the run with the file and its 1-based line number (record number
for parquet / HF inputs) and what is wrong; ``--skip-bad-records`` skips such records instead
and reports how many, and the first few numbers, at the end.

Tokenizers (all loaded from local files, no network access needed):

* ``GPT2BPETokenizer``: GPT-2 byte-level BPE from ``--vocab-file`` (vocab.json) and
  ``--merge-file`` (merges.txt); end-of-document token ``<|endoftext|>``.
* ``HuggingFaceTokenizer``: ``--tokenizer-model`` = a local directory saved with
  ``save_pretrained`` (or a hub name already in the local cache); EOD = ``eos_token``.
* ``SentencePieceTokenizer``: ``--tokenizer-model`` = a ``.model`` file; EOD = ``eos`` id.

The tokenizers are the trainer's own (``megatron/training/tokenizer.py``), so the ids written
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
import gzip
import json
import multiprocessing
import os
import sys
import time
from typing import List

# Run as a script, sys.path[0] is tools/: make the repository root importable for megatron.training.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from megatron.training.tokenizer import TokenizerError, build_tokenizer_from  # noqa: E402

TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer")


class PreprocessError(Exception):
    """A user-facing error (bad input, bad arguments); printed without a traceback."""


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


# --------------------------------------------------------------------------------------------
# Input readers: each yields (record_number, payload) where payload is a raw JSON line (bytes,
# decoded in the worker so that a bad byte is reported with its line number instead of failing
# the whole stream) or an already-decoded dict.  Record numbers are 1-based (= line numbers for
# JSON lines).
# --------------------------------------------------------------------------------------------


def detect_input_format(path):
    if not os.path.exists(path):
        raise PreprocessError(f"input {path!r} does not exist")
    if os.path.isdir(path):
        markers = ("dataset_info.json", "dataset_dict.json", "state.json")
        if any(os.path.exists(os.path.join(path, m)) for m in markers):
            return "hf"
        raise PreprocessError(
            f"input directory {path!r} is not a HF datasets save_to_disk directory (no {' / '.join(markers)})"
        )
    if not os.access(path, os.R_OK):
        raise PreprocessError(f"input {path!r} is not readable")
    if path.endswith(".parquet"):
        return "parquet"
    return "jsonl"


def _iter_jsonl(path):
    """Lines as bytes: text mode would raise on the first non-UTF-8 byte with a position inside
    its read buffer and no line number; the Encoder decodes each line and names it instead."""
    opener = gzip.open if path.endswith(".gz") else open
    lineno = 0
    try:
        with opener(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield lineno, line
    except (OSError, EOFError) as e:  # unreadable, or a corrupt / truncated .gz
        raise PreprocessError(f"cannot read input {path!r} after line {lineno}: {e}") from None


def _iter_parquet(path, keys):
    try:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
    except Exception as e:
        raise PreprocessError(f"cannot read parquet input {path!r}: {e}") from None
    names = set(pf.schema_arrow.names)
    missing = [k for k in keys if k not in names]
    if missing:
        raise PreprocessError(f"parquet input {path!r} has no column {missing[0]!r} (columns: {sorted(names)})")
    n = 0
    try:
        for batch in pf.iter_batches(columns=list(keys), batch_size=1024):
            for row in batch.to_pylist():
                n += 1
                yield n, row
    except Exception as e:  # noqa: BLE001 -- arrow raises many types for a corrupt file
        raise PreprocessError(f"cannot read parquet input {path!r} after record {n}: {e}") from None


def _iter_hf(path, keys, split):
    try:
        import datasets

        ds = datasets.load_from_disk(path)
    except Exception as e:
        raise PreprocessError(f"cannot load HF datasets directory {path!r}: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            split = "train" if "train" in ds else sorted(ds)[0]
        if split not in ds:
            raise PreprocessError(f"HF dataset {path!r} has no split {split!r} (splits: {sorted(ds)})")
        ds = ds[split]
    missing = [k for k in keys if k not in ds.column_names]
    if missing:
        raise PreprocessError(f"HF dataset {path!r} has no column {missing[0]!r} (columns: {ds.column_names})")
    ds = ds.select_columns(list(keys))
    n = 0
    try:
        for batch in ds.iter(batch_size=1024):
            for i in range(len(batch[keys[0]])):
                n += 1
                yield n, {k: batch[k][i] for k in keys}
    except Exception as e:  # noqa: BLE001 -- arrow raises many types for a corrupt file
        raise PreprocessError(f"cannot read HF dataset {path!r} after record {n}: {e}") from None


def iter_records(path, keys, split=None):
    fmt = detect_input_format(path)
    if fmt == "jsonl":
        return fmt, _iter_jsonl(path)
    if fmt == "parquet":
        return fmt, _iter_parquet(path, keys)
    return fmt, _iter_hf(path, keys, split)


# --------------------------------------------------------------------------------------------
# Encoding (runs in worker processes when --workers > 1)
# --------------------------------------------------------------------------------------------


class Encoder:
    """Turns one record into {key: token ids or None (empty)}; errors are returned, not raised,
    so that the parent process can report them with the record number."""

    def __init__(self, tokenizer_kwargs, keys, append_eod, unit):
        self.tokenizer_kwargs = tokenizer_kwargs
        self.keys = keys
        self.append_eod = append_eod
        self.unit = unit
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
        else:
            rec = payload
            nbytes = 0
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
            if text is None:
                text = ""
            if not isinstance(text, str):
                return recno, None, nbytes, f"{self.unit} {recno}: value of {key!r} is {type(text).__name__}, not a string"
            if not isinstance(payload, str):
                nbytes += len(text.encode("utf-8"))
            if not text.strip():
                out[key] = None
                continue
            ids = self.tokenizer.tokenize(text)
            if not ids:
                out[key] = None
                continue
            if self.append_eod:
                ids = list(ids)
                ids.append(self.tokenizer.eod)
            out[key] = ids
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
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be >= 1")
    if args.log_interval < 1:
        p.error("--log-interval must be >= 1")
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
    if args.torch_backend is not None:
        notes.append(f"note: --torch-backend {args.torch_backend} is ignored: tokenization runs in this "
                     f"process and its --workers, without torch.distributed (launch it once, not with "
                     f"mpirun); the flag can be dropped")
    return notes


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def preprocess(args):
    """Run the conversion; returns a summary dict. Raises PreprocessError on bad input."""
    import warnings

    import numpy

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

    encoder = Encoder(tok_kwargs, keys, args.append_eod, unit)
    pool = None
    if args.workers > 1:
        pool = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn").Pool(
            args.workers, initializer=encoder.initializer)
        encoded = pool.imap(encoder.encode, records, args.chunk_size)  # imap keeps input order
    else:
        encoder.tokenizer = tokenizer
        encoded = map(encoder.encode, records)

    _log(f"preprocess: input={args.input} ({fmt}) keys={keys} tokenizer={tokenizer!r} "
         f"dtype={numpy.dtype(dtype).name} workers={args.workers}")
    stats = {k: {"documents": 0, "tokens": 0, "empty": 0} for k in keys}
    empty_examples = {k: [] for k in keys}
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
                    continue
                builders[key].add_document(numpy.asarray(ids, dtype=numpy.int64), [len(ids)])
                stats[key]["documents"] += 1
                stats[key]["tokens"] += len(ids)
            if n_records % args.log_interval == 0:
                el = max(time.time() - start, 1e-9)
                _log(f"processed {n_records} documents ({n_records / el:.1f} docs/s, "
                     f"{total_bytes / el / 1e6:.2f} MB/s)")
        if n_bad and n_records == 0:
            raise PreprocessError(f"{args.input}: all {n_bad} records are bad, e.g. {bad[0][1]}")
        ok = True
    finally:
        if pool is not None:
            pool.terminate() if not ok else pool.close()
            pool.join()
        for key, b in builders.items():
            if ok:
                b.finalize(get_idx_path(prefixes[key]))
            else:
                b.data_file.close()
                for path in (get_bin_path(prefixes[key]), get_idx_path(prefixes[key])):
                    if os.path.exists(path):
                        os.remove(path)

    elapsed = max(time.time() - start, 1e-9)
    if n_records == 0:
        _log(f"warning: input {args.input!r} contained no records")
    if n_bad:
        _log(f"warning: skipped {n_bad} bad record(s) (--skip-bad-records), at {unit}s "
             f"{', '.join(str(r) for r, _ in bad)}{', ...' if n_bad > len(bad) else ''}; first: "
             f"{bad[0][1]}")
    for key in keys:
        if stats[key]["empty"]:
            _log(f"warning: skipped {stats[key]['empty']} empty document(s) for key {key!r} "
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
        "outputs": {k: dict(prefix=prefixes[k], **stats[k]) for k in keys},
    }
    for key in keys:
        s = stats[key]
        _log(f"done: {prefixes[key]}.bin/.idx: {s['documents']} documents, {s['tokens']} tokens, "
             f"{s['empty']} empty skipped")
    _log(f"done: {n_records} records, {total_bytes / 1e6:.2f} MB in {elapsed:.2f}s "
         f"({n_records / elapsed:.1f} docs/s, {total_bytes / elapsed / 1e6:.2f} MB/s)")
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
