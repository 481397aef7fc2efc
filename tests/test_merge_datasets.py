"""tools/merge_datasets.py: a round trip through tools/preprocess_data.py, and the refusals.

The round trip checks what training reads: the merged dataset's sequence lengths, token ids and
document boundaries must be the inputs' concatenated in name order.
"""

import json
import os
import subprocess
import sys
from typing import List

import numpy as np
import pytest

from tools import merge_datasets as md
from tools import preprocess_data as pp
from tools import train_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CORPORA = {  # output name -> documents; written in this (unsorted) order
    "c_shard": ["class C:\n    pass\n", "third corpus, " * 9],
    "a_shard": ["def f(x):\n    return x * 2\n", "alpha beta gamma " * 6, "", "naïve café 東京"],
    "b_shard": [f"second corpus document {i}: " + "lorem ipsum " * (i + 1) for i in range(5)],
}


def _write_jsonl(path, texts):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


def _load(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(str(prefix))


def _docs(ds) -> List[List[int]]:
    return [np.asarray(ds[i]).tolist() for i in range(len(ds))]


def _build(prefix, documents, dtype):
    """A dataset written directly with megatron-core's builder: ``documents`` is a list of
    documents, each a list of sequences (several sequences make a non-trivial boundary)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in documents:
        b.add_document(np.concatenate([np.asarray(s) for s in doc]), [len(s) for s in doc])
    b.finalize(f"{prefix}.idx")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("merge")
    all_text = d / "all.jsonl"
    _write_jsonl(all_text, [t for texts in CORPORA.values() for t in texts])
    vocab, merges, _ = train_tokenizer.train(str(all_text), str(d / "tok"), vocab_size=300, min_frequency=1)
    shard_dir = d / "shards"
    for name, texts in CORPORA.items():
        _write_jsonl(d / f"{name}.jsonl", texts)
        argv = ["--input", str(d / f"{name}.jsonl"), "--output-prefix", str(shard_dir / name),
                "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
                "--append-eod"]
        assert pp.main(argv) == 0
    # a hand-built shard whose documents span several sequences: boundaries that are not 1:1
    _build(shard_dir / "d_multi_text_document", [[[5, 6, 7], [8]], [[9]], [[10, 11], [12], [13, 14]]],
           np.uint16)
    return dict(dir=d, shards=shard_dir)


def test_merge_roundtrip_preserves_documents_in_name_order(shards):
    out = shards["dir"] / "merged" / "all_text_document"
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "merge_datasets.py"),
                        "--input", str(shards["shards"]), "--output-prefix", str(out)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stderr
    assert f"merged 4 input(s) from {shards['shards']}" in r.stderr
    names = ["a_shard_text_document", "b_shard_text_document", "c_shard_text_document",
             "d_multi_text_document"]  # sorted by name, not in the order they were written
    inputs = [_load(shards["shards"] / n) for n in names]
    merged = _load(out)

    assert merged.index.dtype == np.uint16
    assert _docs(merged) == [seq for ds in inputs for seq in _docs(ds)]
    assert merged.sequence_lengths.tolist() == [n for ds in inputs for n in ds.sequence_lengths.tolist()]
    expected_bounds, offset = [0], 0
    for ds in inputs:
        expected_bounds += [offset + int(b) for b in ds.document_indices[1:]]
        offset += len(ds)
    assert merged.document_indices.tolist() == expected_bounds
    # the hand-built shard's multi-sequence documents survive as documents
    assert merged.document_indices.tolist()[-4:] == [offset - 6, offset - 4, offset - 3, offset]
    # and the first shard is the tokenized a_shard corpus (3 non-empty texts, each ending in EOD)
    assert len(inputs[0]) == 3 and all(doc[-1] == 0 for doc in _docs(inputs[0]))
    assert os.path.getsize(f"{out}.bin") == sum(os.path.getsize(shards["shards"] / f"{n}.bin") for n in names)


def test_empty_input_is_skipped(shards, tmp_path, capsys):
    d = tmp_path / "in"
    d.mkdir()
    _build(d / "a", [[[1, 2]], [[3]]], np.uint16)
    _build(d / "b_empty", [], np.uint16)
    assert md.main(["--input", str(d), "--output-prefix", str(tmp_path / "out")]) == 0
    assert f"note: {d / 'b_empty'} has no documents; skipped" in capsys.readouterr().err
    assert _docs(_load(tmp_path / "out")) == [[1, 2], [3]]
    for name in ("a.bin", "a.idx"):
        os.remove(d / name)
    assert md.main(["--input", str(d), "--output-prefix", str(tmp_path / "out2")]) == 1
    assert f"every input in {d} is empty: nothing to merge" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out2.bin")


def _error(capsys, *argv) -> str:
    assert md.main(list(argv)) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    return err


def test_no_pairs(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = str(tmp_path / "out")
    assert "contains no .bin/.idx pairs" in _error(capsys, "--input", str(empty), "--output-prefix", out)
    (empty / "README.txt").write_text("not a shard")
    assert "contains no .bin/.idx pairs" in _error(capsys, "--input", str(empty), "--output-prefix", out)
    assert f"--input {tmp_path / 'nope'} does not exist" in _error(
        capsys, "--input", str(tmp_path / "nope"), "--output-prefix", out)
    assert "is not a directory" in _error(capsys, "--input", str(empty / "README.txt"), "--output-prefix", out)
    assert not os.path.exists(f"{out}.bin")


def test_half_pairs_are_named(tmp_path, capsys):
    d = tmp_path / "in"
    d.mkdir()
    _build(d / "a", [[[1, 2]]], np.uint16)
    _build(d / "b", [[[3]]], np.uint16)
    os.remove(d / "b.idx")
    err = _error(capsys, "--input", str(d), "--output-prefix", str(tmp_path / "out"))
    assert f"{d / 'b'}.bin has no {d / 'b'}.idx" in err
    os.remove(d / "b.bin")
    _build(d / "c", [[[3]]], np.uint16)
    os.remove(d / "c.bin")
    assert f"{d / 'c'}.idx has no {d / 'c'}.bin" in _error(capsys, "--input", str(d), "--output-prefix",
                                                          str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out.bin")


def test_dtype_mismatch_names_both_files(tmp_path, capsys):
    d = tmp_path / "in"
    d.mkdir()
    _build(d / "a", [[[1, 2]]], np.uint16)
    _build(d / "b", [[[70000]]], np.int32)
    err = _error(capsys, "--input", str(d), "--output-prefix", str(tmp_path / "out"))
    assert f"dtype mismatch: {d / 'a'}.idx holds uint16 tokens but {d / 'b'}.idx holds int32" in err
    assert not os.path.exists(tmp_path / "out.bin") and not os.path.exists(tmp_path / "out.idx")


def test_truncated_bin_is_refused_before_writing(tmp_path, capsys):
    d = tmp_path / "in"
    d.mkdir()
    _build(d / "a", [[[1, 2]]], np.uint16)
    _build(d / "b", [[[3, 4, 5]], [[6]]], np.uint16)
    with open(d / "b.bin", "r+b") as f:
        f.truncate(5)  # 4 tokens = 8 bytes described by the .idx
    err = _error(capsys, "--input", str(d), "--output-prefix", str(tmp_path / "out"))
    assert f"input {d / 'b'}: {d / 'b'}.bin is 5 bytes but its index {d / 'b'}.idx describes 8 bytes" in err
    assert not os.path.exists(tmp_path / "out.bin") and not os.path.exists(tmp_path / "out.idx")


def test_output_colliding_with_an_input_is_refused(tmp_path, capsys):
    d = tmp_path / "in"
    d.mkdir()
    _build(d / "a", [[[1, 2]]], np.uint16)
    _build(d / "b", [[[3]]], np.uint16)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    err = _error(capsys, "--input", str(d), "--output-prefix", str(d / "b"))
    assert f"--output-prefix {d / 'b'} would overwrite the input {d / 'b'}.bin" in err
    # the same file through another spelling of the path
    err = _error(capsys, "--input", str(d), "--output-prefix", str(d / ".." / "in" / "a"))
    assert f"would overwrite the input {d / 'a'}.bin" in err
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    # an output inside --input that is not an input is allowed (a re-run would then be refused)
    assert md.main(["--input", str(d), "--output-prefix", str(d / "merged")]) == 0
    assert _docs(_load(d / "merged")) == [[1, 2], [3]]
    capsys.readouterr()
    assert "would overwrite the input" in _error(capsys, "--input", str(d), "--output-prefix", str(d / "merged"))
