"""The corpus readers of ``tools/preprocess_data.py``: JSON lines (optionally gzip), parquet and
HF ``datasets`` directories, each record numbered so a bad one is reported by its line.

Why the readers do not decode JSON: a line is decoded in the worker, so that a bad byte is
reported with its line number instead of failing the whole stream.
"""

import gzip
import os


class PreprocessError(Exception):
    """A user-facing error (bad input, bad arguments); printed without a traceback."""


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
