"""Startup data checks (megatron/training/data/datasets.py): nothing hangs, nothing is silently wrong.

Why: megatron-core 0.16.1's GPTDataset loops forever when a split that is asked for samples has
no documents, and the trainer used to ask for test samples it threw away -- a ~100 document
corpus with the default --split hung without output.  A .bin that does not match its .idx was
not noticed at all.  These tests pin the fixes: unused splits are not built, every used split has
documents or the run stops at once naming split, file and fix, and a .bin of the wrong size stops
the run naming the file -- printed once, by rank 0, with every rank exiting (no hang).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import numpy as np
import pytest
from dist_harness import free_port, run_distributed

from tools import preprocess_data as pp
from tools import train_tokenizer

REPO = Path(__file__).resolve().parent.parent
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-3", "--device", "cpu"]


def _texts(n: int, short: bool = False) -> List[str]:
    if short:  # a few tokens each: less than one 33-token sample
        return [f"note {i}: the fox" for i in range(n)]
    return [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 4 + 1)
            for i in range(n)]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """One tokenizer; preprocessed corpora of 100 documents and of 12 short ones."""
    d = tmp_path_factory.mktemp("data_checks")
    big = d / "big.jsonl"
    big.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(100)))
    vocab, merges, _ = train_tokenizer.train(str(big), str(d / "tok"), vocab_size=300,
                                             min_frequency=1)
    out = {"dir": d, "vocab": vocab, "merges": merges}
    for name, n in (("c100", 100), ("c12", 12)):
        src = d / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(n, n < 100)))
        argv = ["--input", str(src), "--output-prefix", str(d / name), "--tokenizer-type",
                "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod"]
        assert pp.main(argv) == 0
        out[name] = str(d / f"{name}_text_document")
    return out


def _args(corpora, prefix: str, *extra: str):
    from megatron.training.arguments import parse_args

    return parse_args([*MODEL, "--train-iters", "4", "--vocab-file", corpora["vocab"],
                       "--merge-file", corpora["merges"], "--data-path", prefix,
                       "--data-cache-path", str(corpora["dir"] / "cache"), *extra])


def _tokenizer(args):
    from megatron.training.data.tokenizer import build_tokenizer

    return build_tokenizer(args)


def _copy(prefix: str, dst: Path) -> str:
    dst.mkdir(parents=True, exist_ok=True)
    out = str(dst / Path(prefix).name)
    for ext in (".bin", ".idx"):
        shutil.copyfile(prefix + ext, out + ext)
    return out


# ----------------------------------------------------------------------------- .bin / .idx
def test_index_check_accepts_preprocessed_file(corpora):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.training.data.datasets import check_indexed_files

    info = check_indexed_files(corpora["c100"])
    ds = IndexedDataset(corpora["c100"])
    assert info.sequences == len(ds) == 100
    assert info.tokens == int(ds.sequence_lengths.sum())  # from the .bin size
    assert info.bin_bytes == os.path.getsize(corpora["c100"] + ".bin")
    assert info.dtype == "uint16"  # vocab 300


@pytest.mark.parametrize("cut", ["few_bytes", "half", "appended"])
def test_bin_size_mismatch_names_file(corpora, tmp_path, cut):
    from megatron.training.data.datasets import check_indexed_files
    from megatron.training.errors import StartupError

    prefix = _copy(corpora["c100"], tmp_path)
    bin_path = prefix + ".bin"
    size = os.path.getsize(bin_path)
    data = open(bin_path, "rb").read()
    data = {"few_bytes": data[:-3], "half": data[:size // 2], "appended": data + b"\0\0"}[cut]
    open(bin_path, "wb").write(data)
    with pytest.raises(StartupError) as exc:
        check_indexed_files(prefix)
    assert str(exc.value) == (
        f"{bin_path} is {len(data)} bytes but its index {prefix}.idx describes {size} bytes: "
        f"truncated or from another preprocessing run; re-run tools/preprocess_data.py")


@pytest.mark.parametrize("damage", ["dtype_code", "truncated_idx", "not_an_index"])
def test_unreadable_index_names_file(corpora, tmp_path, damage):
    from megatron.training.data.datasets import check_indexed_files
    from megatron.training.errors import StartupError

    prefix = _copy(corpora["c100"], tmp_path)
    idx = bytearray(open(prefix + ".idx", "rb").read())
    if damage == "dtype_code":
        idx[17] = 99  # after the 9-byte magic and the 8-byte version
    elif damage == "truncated_idx":
        idx = idx[:len(idx) // 2]
    else:
        idx = bytearray(b"not an index at all, just text\n" * 4)
    open(prefix + ".idx", "wb").write(bytes(idx))
    with pytest.raises(StartupError) as exc:
        check_indexed_files(prefix)
    msg = str(exc.value)
    assert msg.startswith(f"{prefix}.idx cannot be read as a megatron-core index (")
    assert msg.endswith("re-run tools/preprocess_data.py")
    if damage == "dtype_code":
        assert "99 is not a valid DType" in msg


# ----------------------------------------------------------------------------- splits
def test_split_request_reads_only_what_the_run_uses(corpora):
    from megatron.training.data.datasets import split_request

    r = split_request(_args(corpora, corpora["c100"], "--eval-iters", "3", "--eval-interval", "2"))
    assert r.used == (True, True, False)  # the test split is never read by the trainer
    assert r.samples == (4 * 8, (4 // 2 + 1) * 3 * 8, 0)
    assert split_request(_args(corpora, corpora["c100"], "--eval-iters", "0")).used == \
        (True, False, False)
    assert split_request(_args(corpora, corpora["c100"], "--skip-train")).used == \
        (False, True, False)


def test_split_ranges_are_megatron_cores(corpora):
    """The stand-in run of megatron-core's split code gives the indices the real build uses."""
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.training.data.datasets import (SplitRequest, dataset_config, split_parts,
                                        split_tokens)

    args = _args(corpora, corpora["c100"], "--split", "80,15,5")
    everything = SplitRequest((True, True, True), (8, 8, 8))
    config, full = dataset_config(args, _tokenizer(args), everything)
    assert config.split_matrix == full and all(b is not None for b in full)
    parts = split_parts(corpora["c100"], config)
    built = BlendedMegatronDatasetBuilder(GPTDataset, [8, 8, 8], lambda: True, config).build()
    for part, ds in zip(parts, built):
        assert np.array_equal(part.indices, ds.indices)
    assert sum(len(p.indices) for p in parts) == 100 and all(len(p.indices) for p in parts)
    for part in parts:  # the pointer shortcut counts what summing the lengths counts
        assert split_tokens(part.dataset, part.indices) == \
            int(part.dataset.sequence_lengths[part.indices].sum())
        assert split_tokens(part.dataset, part.indices[::2]) == \
            int(part.dataset.sequence_lengths[part.indices[::2]].sum())


def test_corpus_without_documents_is_an_error(corpora, tmp_path):
    from megatron.training.data.datasets import check_indexed_files
    from megatron.training.errors import StartupError

    src = tmp_path / "empty.jsonl"
    src.write_text(json.dumps({"text": ""}) + "\n")
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "empty"), "--tokenizer-type",
            "GPT2BPETokenizer", "--vocab-file", corpora["vocab"], "--merge-file", corpora["merges"]]
    assert pp.main(argv) == 0  # preprocessing warns, writes empty files
    prefix = str(tmp_path / "empty_text_document")
    with pytest.raises(StartupError, match="^" + re.escape(f"data file {prefix} contains no documents")):
        check_indexed_files(prefix)


def test_empty_validation_split_is_an_error(corpora):
    from megatron.training.data.datasets import (SplitRequest, check_data, dataset_config,
                                        split_parts, split_request)
    from megatron.training.errors import StartupError

    prefix = corpora["c12"]
    args = _args(corpora, prefix, "--eval-iters", "2")
    assert args.split == "969,30,1"  # the default
    request = split_request(args)
    config, full = dataset_config(args, _tokenizer(args), request)
    probe, _ = dataset_config(args, _tokenizer(args), SplitRequest((True,) * 3, (0,) * 3))
    n_valid = len(split_parts(prefix, probe)[1].indices)
    assert n_valid == 0  # 12 documents: 969/1000 and 999/1000 of 12 round to the same document
    with pytest.raises(StartupError) as exc:
        check_data(args, config, request, full)
    samples = (4 // 1000 + 1) * 2 * 8
    assert str(exc.value) == (
        f"the validation split of data file {prefix} is empty: --split 969,30,1 assigns it 0 of "
        f"the file's 12 documents, but evaluation needs {samples} samples (--eval-iters 2 x "
        f"--global-batch-size 8 per evaluation). Use more data, give the validation split a "
        f"larger weight (e.g. --split 90,10,0), or train without evaluation: --eval-iters 0 (and "
        f"--split 100,0,0 to train on every document).")
    # without evaluation the same corpus is fine: validation (and test) are not looked at
    args = _args(corpora, prefix, "--eval-iters", "0")
    request = split_request(args)
    config, full = dataset_config(args, _tokenizer(args), request)
    stats = check_data(args, config, request, full)
    assert [(s.split, s.documents) for s in stats] == [("train", len(split_parts(prefix, probe)[0].indices))]


def test_zero_weight_split_the_run_reads_is_an_error(corpora):
    from megatron.training.data.datasets import check_data, dataset_config, split_request
    from megatron.training.errors import StartupError

    for extra, words in ((["--split", "100,0,0", "--eval-iters", "5"],
                          "--eval-iters 5 asks for evaluation but --split 100,0,0 gives the "
                          "validation split weight 0"),
                         (["--split", "0,1,0", "--eval-iters", "0"],
                          "--split 0,1,0 gives the train split weight 0")):
        args = _args(corpora, corpora["c100"], *extra)
        request = split_request(args)
        config, full = dataset_config(args, _tokenizer(args), request)
        with pytest.raises(StartupError, match="^" + re.escape(words)):
            check_data(args, config, request, full)


def test_unweighted_blend_needs_a_sample_per_file(corpora):
    from megatron.training.data.datasets import check_data, dataset_config, split_request
    from megatron.training.errors import StartupError

    # two files, no weights: one epoch of each file's split; 12 short documents at 90,10,0 leave
    # the small file a validation split (one document) of fewer tokens than one 33-token sample
    args = _args(corpora, corpora["c100"], "--split", "90,10,0", "--eval-iters", "1")
    args.data_path = [corpora["c100"], corpora["c12"]]
    request = split_request(args)
    config, full = dataset_config(args, _tokenizer(args), request)
    with pytest.raises(StartupError) as exc:
        check_data(args, config, request, full)
    assert str(exc.value).startswith(f"the validation split of data file {corpora['c12']} has ")
    assert "fewer than one sample needs (33: --seq-length 32 + 1)" in str(exc.value)
    args.data_path = ["0.5", corpora["c100"], "0.5", corpora["c12"]]  # weights: repeated, fine
    config, full = dataset_config(args, _tokenizer(args), request)
    assert {s.prefix for s in check_data(args, config, request, full)} == \
        {corpora["c100"], corpora["c12"]}


def test_build_skips_unused_splits_and_keeps_train_data(corpora):
    """Not building the test split changes no train/validation sample."""
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.training.data.datasets import SplitRequest, build_datasets, dataset_config

    args = _args(corpora, corpora["c100"], "--split", "90,5,5", "--eval-iters", "2",
                 "--eval-interval", "2")
    train, valid, test = build_datasets(args, _tokenizer(args))
    assert test is None and len(train) >= 4 * 8 and len(valid) >= 3 * 2 * 8
    # megatron-core as the trainer used to call it: all three splits, test samples requested
    old_sizes = [4 * 8, 3 * 2 * 8, 2 * 8]
    config, _ = dataset_config(args, _tokenizer(args), SplitRequest((True,) * 3, (0,) * 3))
    ref = BlendedMegatronDatasetBuilder(GPTDataset, old_sizes, lambda: True, config).build()
    assert ref[2] is not None and len(ref[2]) > 0
    for ours, theirs in ((train, ref[0]), (valid, ref[1])):
        assert len(ours) == len(theirs)
        for i in range(len(ours)):
            assert np.array_equal(ours[i]["tokens"], theirs[i]["tokens"])

    args = _args(corpora, corpora["c100"], "--split", "100,0,0", "--eval-iters", "0")
    train, valid, test = build_datasets(args, _tokenizer(args))
    assert valid is None and test is None and len(train) >= 4 * 8


def _agree_worker(rank: int, world: int, problem_rank: int) -> dict:
    from megatron.training.data.datasets import raise_if_any_rank_failed
    from megatron.training.errors import StartupError

    import torch

    try:
        raise_if_any_rank_failed(f"bad file seen by rank {rank}" if rank == problem_rank else None,
                                 torch.device("cpu"))
        return {"raised": None}
    except StartupError as exc:
        return {"raised": str(exc)}


def test_every_rank_stops_with_the_message_of_the_rank_that_saw_it(tmp_path):
    results = run_distributed(2, _agree_worker, str(tmp_path), 1)
    assert [r["raised"] for r in results] == ["bad file seen by rank 1"] * 2
    results = run_distributed(2, _agree_worker, str(tmp_path), -1)  # nobody: nobody raises
    assert [r["raised"] for r in results] == [None, None]


# ----------------------------------------------------------------------------- end to end
def _pretrain(corpora, prefix: str, *extra: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """torchrun pretrain_gpt.py on 2 CPU ranks; a hang fails the test (TimeoutExpired)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(REPO / "pretrain_gpt.py"),
           *MODEL, "--vocab-file", corpora["vocab"], "--merge-file", corpora["merges"],
           "--data-path", prefix, "--train-iters", "4", "--log-interval", "2", *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_tiny_corpus_trains_with_split_100_and_eval_off(corpora, tmp_path):
    prefix = _copy(corpora["c100"], tmp_path)
    res = _pretrain(corpora, prefix, "--split", "100,0,0", "--eval-iters", "0")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f" > data file {prefix}: train documents [0, 100)" in res.stdout
    assert " > not built (this run does not read it): validation and test split" in res.stdout
    assert " iteration        4/       4 |" in res.stdout
    assert "validation loss" not in res.stdout


def test_hundred_documents_default_split_trains_and_evaluates(corpora, tmp_path):
    """The run that used to hang forever building an empty test split."""
    prefix = _copy(corpora["c100"], tmp_path)
    res = _pretrain(corpora, prefix, "--eval-iters", "1", "--eval-interval", "2")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert " > not built (this run does not read it): test split" in res.stdout
    assert " iteration        4/       4 |" in res.stdout
    assert "validation loss at iteration 4 | lm loss value:" in res.stdout


def _once(res: subprocess.CompletedProcess, message: str) -> None:
    both = res.stdout + res.stderr
    assert res.returncode != 0
    assert both.count(message) == 1, both[-4000:]
    assert f"error: {message}" in res.stderr
    assert " iteration " not in res.stdout


def test_empty_validation_split_fails_fast_once(corpora, tmp_path):
    prefix = _copy(corpora["c12"], tmp_path)
    res = _pretrain(corpora, prefix, "--eval-iters", "2")
    _once(res, f"the validation split of data file {prefix} is empty: --split 969,30,1 assigns "
               f"it 0 of the file's 12 documents")
    assert "--eval-iters 0" in res.stderr and "--split 100,0,0" in res.stderr


def test_truncated_bin_fails_at_startup_once(corpora, tmp_path):
    prefix = _copy(corpora["c100"], tmp_path)
    size = os.path.getsize(prefix + ".bin")
    os.truncate(prefix + ".bin", size - 5)
    res = _pretrain(corpora, prefix, "--eval-iters", "0", "--split", "100,0,0")
    _once(res, f"{prefix}.bin is {size - 5} bytes but its index {prefix}.idx describes {size} "
               f"bytes: truncated or from another preprocessing run; re-run "
               f"tools/preprocess_data.py")
