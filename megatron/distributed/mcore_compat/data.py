"""megatron-core's ``datasets``: reading an ``.idx`` and the per-split document ranges.

Why a module of its own: 0.16 has no public index reader that leaves the ``.bin`` alone, and no
public function for the document ranges each split gets; the trainer's data checks
(``megatron/training/data/datasets.py``) and ``tools/merge_datasets.py`` need both.

Touch points (megatron-core name -- what we rely on -- who uses it):

* ``datasets.indexed_dataset._IndexReader`` (and ``IndexedDataset.index``, an ``_IndexReader``)
  -- reads an ``.idx`` without memory-mapping the ``.bin``; attributes ``sequence_count``,
  ``document_indices``, ``sequence_pointers`` (byte offsets), ``sequence_lengths``, ``dtype``,
  ``dtype_size`` -- :func:`read_index_summary`, :func:`index_token_count`, used by
  ``megatron/training/data/datasets.py`` and ``tools/merge_datasets.py``.
* ``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits`` and the constructor signature
  it calls dataset classes with -- the per-split document ranges -- :func:`dataset_split_parts`,
  used by data.py. A ``None`` bookend in ``split_matrix`` skips that split (data.py builds no
  unused split).
* ``GPTDataset._get_num_epochs`` -- loops forever when a requested split has no tokens; the
  reason data.py checks every used split before megatron-core builds it (contract test only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence


@dataclass(frozen=True)
class IndexSummary:
    """What an ``.idx`` says, read from its header and last entries only."""

    sequence_count: int
    first_document: Optional[int]
    """``document_indices[0]`` (0 for a well-formed index), None when it is empty."""
    last_document: Optional[int]
    """``document_indices[-1]`` (the sequence count for a well-formed index)."""
    dtype: Any
    """numpy dtype class of the tokens (e.g. ``numpy.uint16``)."""
    dtype_size: int
    data_bytes: int
    """Bytes the ``.bin`` must have: last pointer + last length * token size (0 if empty)."""


def read_index_summary(idx_path: str) -> IndexSummary:
    """Read an ``.idx`` with megatron-core's ``_IndexReader`` (any parse error propagates).

    Why the private reader: the public ``IndexedDataset`` also memory-maps the ``.bin``, which fails
    for a 0-byte ``.bin``. Only the header and the last entries are touched."""
    from megatron.core.datasets.indexed_dataset import _IndexReader

    index = _IndexReader(idx_path, multimodal=False)
    try:
        sequences = int(index.sequence_count)
        doc_idx = index.document_indices
        first = int(doc_idx[0]) if len(doc_idx) else None
        last = int(doc_idx[-1]) if len(doc_idx) else None
        dtype, itemsize = index.dtype, int(index.dtype_size)
        data = (int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * itemsize
                if sequences else 0)
        del doc_idx
    finally:
        del index  # closes the .idx memory map
    return IndexSummary(sequences, first, last, dtype, itemsize, data)


def index_token_count(indexed_dataset: Any, indices: Sequence[int]) -> int:
    """Tokens in the documents ``indices`` of a megatron-core ``IndexedDataset``.

    Why here: it reads the ``_IndexReader`` behind ``IndexedDataset.index``. megatron-core's
    splits are contiguous ranges and ``sequence_pointers`` are byte offsets of consecutive
    documents, so two pointers give the count without reading every length; anything else is
    summed."""
    if len(indices) == 0:
        return 0
    first, last = int(indices[0]), int(indices[-1])
    index = indexed_dataset.index
    if last - first + 1 == len(indices):
        end = (int(index.sequence_pointers[last])
               + int(index.sequence_lengths[last]) * index.dtype_size)
        return (end - int(index.sequence_pointers[first])) // index.dtype_size
    return int(index.sequence_lengths[indices].sum(dtype="int64"))


def _split_probe_class() -> type:
    """A GPTDataset stand-in that builds nothing and keeps what megatron-core hands it (the
    builder calls ``cls(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split,
    config)``)."""
    from megatron.core.datasets.gpt_dataset import GPTDataset

    class _SplitProbe(GPTDataset):
        def __init__(self, indexed_dataset: Any, dataset_path: Any, indexed_indices: Any,
                     num_samples: Any, index_split: Any, config: Any) -> None:
            self.dataset = indexed_dataset
            self.indices = indexed_indices

    return _SplitProbe


def dataset_split_parts(prefix: str, config: Any) -> List[Optional[Any]]:
    """Per split (train, validation, test): what megatron-core hands that split's dataset, or None.

    Each part has ``.indices`` and ``.dataset`` (the file's ``IndexedDataset``); None where
    ``config.split_matrix`` has a ``None`` bookend. Why the private method: running it on a
    stand-in class gives the real build's ranges by construction. No barrier."""
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder

    sizes = [0, 0, 0]
    builder = BlendedMegatronDatasetBuilder(_split_probe_class(), sizes, lambda: True, config)
    return builder._build_megatron_dataset_splits(prefix, config.split_matrix, sizes, False)


__all__ = ["IndexSummary", "read_index_summary", "index_token_count", "dataset_split_parts"]
