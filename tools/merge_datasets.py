#!/usr/bin/env python3
"""Merge every ``.bin/.idx`` pair in a directory into one megatron-core indexed dataset.

Command-line interface of Megatron-LM's ``tools/merge_datasets.py``::

    python tools/merge_datasets.py --input data/shards --output-prefix data/pile_text_document

Every prefix ``P`` with both ``P.bin`` and ``P.idx`` in ``--input`` is appended, in the order of
the prefixes' names (as strings: zero-pad shard numbers, ``part_02`` before ``part_10``), to
``{output_prefix}.bin/.idx``.  The result holds the inputs' documents one after another, with
their sequence lengths, token ids and document boundaries unchanged, and is usable as
``--data-path {output_prefix}``.

Why one merged file rather than listing the shards in ``--data-path``: with several paths and
no weights megatron-core samples each file's own split and blends them, so the train /
validation boundary (and the samples) depend on how the corpus was cut into shards.

The concatenation itself is megatron-core's ``IndexedDatasetBuilder.add_index``.  What this tool
adds is the checking that ``add_index`` does not do (it only asserts on a dtype mismatch, and
copies a truncated ``.bin`` without noticing): before anything is written, every input's ``.bin``
is checked against its ``.idx`` with the trainer's own startup check
(``megatron.training.data.datasets.check_indexed_files``), the inputs must share one token dtype, and the
output must not overwrite an input.  Each problem stops the run with the file(s) named.  An
input with no documents is skipped with a note.  A failed merge leaves no partial output.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

# Run as a script, sys.path[0] is tools/: make the repository root importable for megatron.training.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

SUFFIXES = (".bin", ".idx")


class MergeError(Exception):
    """A user-facing error (bad input directory, bad output prefix); printed without a traceback."""


@dataclass(frozen=True)
class MergeInput:
    """One input prefix, after its ``.bin`` was checked against its ``.idx``."""

    prefix: str
    sequences: int
    tokens: int
    dtype: str  # numpy type name, e.g. "uint16"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def find_prefixes(input_dir: str) -> List[str]:
    """The ``.bin/.idx`` prefixes in ``input_dir``, sorted by name.

    Only regular files ending in ``.bin`` / ``.idx`` are considered (a README or a cache folder next
    to the shards is fine); one half of a pair without the other is an error naming both files,
    because silently dropping a shard would silently drop part of the corpus.
    """
    if not os.path.exists(input_dir):
        raise MergeError(f"--input {input_dir} does not exist")
    if not os.path.isdir(input_dir):
        raise MergeError(f"--input {input_dir} is not a directory (give the directory holding the "
                         f".bin/.idx pairs)")
    found: Dict[str, set] = {}
    for name in os.listdir(input_dir):
        stem, ext = os.path.splitext(name)
        if ext in SUFFIXES and os.path.isfile(os.path.join(input_dir, name)):
            found.setdefault(stem, set()).add(ext)
    for stem in sorted(found):
        if len(found[stem]) == 1:
            (have,) = found[stem]
            missing = ".idx" if have == ".bin" else ".bin"
            base = os.path.join(input_dir, stem)
            raise MergeError(f"{base}{have} has no {base}{missing}: every input needs both files "
                             f"(remove it from {input_dir}, or re-run tools/preprocess_data.py)")
    if not found:
        raise MergeError(f"--input {input_dir} contains no .bin/.idx pairs to merge")
    return [os.path.join(input_dir, stem) for stem in sorted(found)]


def _is_empty_dataset(prefix: str) -> bool:
    """True when ``prefix`` is a consistent dataset without documents (an empty ``.bin`` whose
    ``.idx`` lists no sequences), which the trainer's check refuses but a merge can skip."""
    # The index alone: IndexedDataset cannot memory-map a 0-byte .bin.
    from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path
    from megatron.distributed.mcore_compat.data import read_index_summary

    try:
        if os.path.getsize(get_bin_path(prefix)) != 0:
            return False
        return read_index_summary(get_idx_path(prefix)).sequence_count == 0
    except Exception:  # noqa: BLE001 -- unreadable: not "empty", report the check's error instead
        return False


def check_inputs(prefixes: Sequence[str]) -> List[MergeInput]:
    """Check every input's ``.bin`` against its ``.idx`` and that all share one dtype.

    Returns the non-empty inputs in order.  The ``.bin``/``.idx`` check is the trainer's own
    (:func:`megatron.training.data.datasets.check_indexed_files`): a merge of a truncated shard would
    otherwise produce a file that only fails (or reads garbage) at training time.  The dtype must
    match because the merged ``.bin`` has one dtype; megatron-core's ``add_index`` only asserts.
    """
    from megatron.core.datasets.indexed_dataset import get_idx_path
    from megatron.training.data.datasets import check_indexed_files
    from megatron.training.errors import StartupError

    inputs: List[MergeInput] = []
    for prefix in prefixes:
        try:
            info = check_indexed_files(prefix)
        except StartupError as e:
            if _is_empty_dataset(prefix):
                _log(f"note: {prefix} has no documents; skipped")
                continue
            raise MergeError(f"input {prefix}: {e}") from None
        if inputs and info.dtype != inputs[0].dtype:
            first = inputs[0]
            raise MergeError(
                f"dtype mismatch: {get_idx_path(first.prefix)} holds {first.dtype} tokens but "
                f"{get_idx_path(prefix)} holds {info.dtype}: the inputs were tokenized with "
                f"vocabularies of different sizes; re-run tools/preprocess_data.py with one tokenizer")
        inputs.append(MergeInput(prefix=prefix, sequences=info.sequences, tokens=info.tokens,
                                 dtype=info.dtype))
    if not inputs:
        raise MergeError(f"every input in {os.path.dirname(prefixes[0])} is empty: nothing to merge")
    return inputs


def check_output(output_prefix: str, prefixes: Sequence[str]) -> None:
    """Refuse an output that is one of the inputs (e.g. ``--output-prefix`` inside ``--input``
    on a re-run): the builder would truncate the file it is about to read."""
    from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path

    outputs = {os.path.realpath(f(output_prefix)) for f in (get_bin_path, get_idx_path)}
    for prefix in prefixes:
        for path in (get_bin_path(prefix), get_idx_path(prefix)):
            if os.path.realpath(path) in outputs:
                raise MergeError(
                    f"--output-prefix {output_prefix} would overwrite the input {path}; choose an "
                    f"output prefix outside --input {os.path.dirname(prefix)} (or another name)")


def merge(input_dir: str, output_prefix: str) -> Dict[str, object]:
    """Merge the pairs in ``input_dir`` into ``{output_prefix}.bin/.idx``; return a summary.

    Raises :class:`MergeError` on bad input, before anything is written.
    """
    import numpy

    with warnings.catch_warnings():  # megatron-core's import-time "Transformer Engine/Apex" notices
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.datasets.indexed_dataset import (
            IndexedDatasetBuilder,
            get_bin_path,
            get_idx_path,
        )
        from megatron.training.data.datasets import check_indexed_files

    prefixes = find_prefixes(input_dir)
    check_output(output_prefix, prefixes)
    inputs = check_inputs(prefixes)

    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    bin_path, idx_path = get_bin_path(output_prefix), get_idx_path(output_prefix)
    builder = IndexedDatasetBuilder(bin_path, dtype=numpy.dtype(inputs[0].dtype).type)
    ok = False
    try:
        for item in inputs:
            builder.add_index(item.prefix)
        builder.finalize(idx_path)
        ok = True
    finally:
        if not ok:
            builder.data_file.close()
            for path in (bin_path, idx_path):
                if os.path.exists(path):
                    os.remove(path)

    merged = check_indexed_files(output_prefix)
    expected = (sum(i.sequences for i in inputs), sum(i.tokens for i in inputs))
    if (merged.sequences, merged.tokens) != expected:  # a contract of add_index, checked where relied on
        raise MergeError(f"{output_prefix}: merged {merged.sequences} sequences / {merged.tokens} tokens, "
                         f"expected {expected[0]} / {expected[1]} from the inputs")
    _log(f"merged {len(inputs)} input(s) from {input_dir}: {merged.sequences} documents, "
         f"{merged.tokens} tokens ({merged.dtype}) -> {bin_path}, {idx_path}")
    return {"inputs": [i.prefix for i in inputs], "output_prefix": output_prefix,
            "sequences": merged.sequences, "tokens": merged.tokens, "dtype": merged.dtype}


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Merge every .bin/.idx pair in a directory (sorted by name) into one dataset")
    p.add_argument("--input", required=True, metavar="DIR",
                   help="directory holding the .bin/.idx pairs to merge")
    p.add_argument("--output-prefix", required=True, metavar="PREFIX",
                   help="writes PREFIX.bin and PREFIX.idx (use as --data-path PREFIX)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = get_args(argv)
    try:
        merge(args.input, args.output_prefix)
    except MergeError as e:
        _log(f"error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
