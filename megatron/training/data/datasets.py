"""Training data for pretrain_gpt.py: startup checks, then megatron-core's dataset builder.

Why checks of our own first: megatron-core 0.16.1 hangs forever on a used split without tokens,
misses a ``.bin`` that does not match its ``.idx``, and asserts or runs out mid-run on a blend
too small for the run. Here a split the run does not use is not built; every used split must have
documents in every ``--data-path`` file (counted with megatron-core's own split code, through
:mod:`megatron.distributed.mcore_compat.data`); sizes are checked against the index. Every rank
checks its own files, then the ranks agree, so one :class:`StartupError` stops every rank. See
[Note: data checks before megatron-core] in docs/architecture.md.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from megatron.training.data.blend import data_blend
from megatron.training.errors import StartupError
from megatron.training.logging_utils import print_rank_0

SPLIT_NAMES: Tuple[str, str, str] = ("train", "validation", "test")
REPREPROCESS = "re-run tools/preprocess_data.py"


# ----------------------------------------------------------------------------- what the run uses
@dataclass(frozen=True)
class SplitRequest:
    """Which of train/validation/test the run reads, and how many samples it asks of each.

    ``used[i]`` false means the split is not built at all (megatron-core would otherwise build,
    and on an empty split hang, even for a request of 0 samples).  The test split is never used:
    the trainer does not evaluate on it.
    """

    used: Tuple[bool, bool, bool]
    samples: Tuple[int, int, int]


def split_request(args: argparse.Namespace) -> SplitRequest:
    """Megatron-LM's sample counts: every training step (--train-samples, or --train-iters x
    --global-batch-size), and every evaluation run.

    Validation is read whenever ``--eval-iters`` > 0: every ``--eval-interval`` steps and once at
    the end of training (so it is used even without an interval).
    """
    gbs = args.global_batch_size
    eval_runs = (args.train_iters // args.eval_interval + 1) if args.eval_interval else 1
    train_used = not args.skip_train and args.train_iters > 0
    valid_used = args.eval_iters > 0
    return SplitRequest(used=(train_used, valid_used, False),
                        samples=((getattr(args, "train_samples", None) or args.train_iters * gbs)
                                 if train_used else 0,
                                 eval_runs * args.eval_iters * gbs if valid_used else 0, 0))


def dataset_config(args: argparse.Namespace, tokenizer: Any, request: SplitRequest):
    """(megatron-core's GPTDatasetConfig for this run, the split matrix ``--split`` gives).

    The split matrix is computed by megatron-core from ``--split`` as always (so train and
    validation keep exactly their documents); in the config only the bookends of unused splits
    are then set to None, which makes megatron-core skip them.  The untouched matrix is returned
    too, to tell "weight 0 in --split" from "not used by this run".
    """
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length,
        blend=data_blend(args.data_path) if args.data_path else None,
        split=args.split, tokenizer=tokenizer, reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False, path_to_cache=args.data_cache_path,
        mmap_bin_files=getattr(args, "mmap_bin_files", True))
    full_matrix = list(config.split_matrix)
    config.split_matrix = [b if used else None for b, used in zip(full_matrix, request.used)]
    return config, full_matrix


# ----------------------------------------------------------------------------- .bin / .idx
@dataclass(frozen=True)
class IndexedFileInfo:
    """What a prefix's ``.idx`` says, after its ``.bin`` was found to match it."""

    prefix: str
    sequences: int  # megatron-core splits GPT data by sequence (= document for our preprocessor)
    tokens: int  # the .bin's size over the token size (the size was just checked)
    dtype: str
    bin_bytes: int


def check_indexed_files(prefix: str) -> IndexedFileInfo:
    """Check ``{prefix}.bin`` against ``{prefix}.idx``; raise :class:`StartupError` naming the file.

    The ``.idx`` must be readable by megatron-core (header, version, a valid dtype code, arrays as
    long as the header says), its document index must end at its sequence count (megatron-core
    only asserts this), and the ``.bin`` must be exactly ``last pointer + last length * itemsize``
    bytes (the pointers are byte offsets): shorter is a truncated file, longer or shorter both
    happen when the two files come from different preprocessing runs.  Only the .idx header and
    last entries are read (every rank does this; the arrays can be gigabytes).
    """
    from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path
    from megatron.distributed.mcore_compat.data import read_index_summary

    idx_path, bin_path = get_idx_path(prefix), get_bin_path(prefix)
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise StartupError(f"data file {path} (from --data-path {prefix}) does not exist")
    try:
        summary = read_index_summary(idx_path)
        sequences, doc_first, doc_last = (summary.sequence_count, summary.first_document,
                                          summary.last_document)
        dtype, itemsize, expected = summary.dtype, summary.dtype_size, summary.data_bytes
    except Exception as exc:  # noqa: BLE001 -- any failure to parse is the same user error
        raise StartupError(
            f"{idx_path} cannot be read as a megatron-core index ({type(exc).__name__}: {exc}): "
            f"not an .idx written by tools/preprocess_data.py, or corrupt; {REPREPROCESS}") from None
    if doc_first != 0 or doc_last != sequences:
        raise StartupError(
            f"{idx_path} is inconsistent: its document index runs from {doc_first} to {doc_last} "
            f"but it lists {sequences} sequences; {REPREPROCESS}")
    actual = os.path.getsize(bin_path)
    if actual != expected:
        raise StartupError(
            f"{bin_path} is {actual} bytes but its index {idx_path} describes {expected} bytes: "
            f"truncated or from another preprocessing run; {REPREPROCESS}")
    if sequences == 0:
        raise StartupError(
            f"data file {prefix} contains no documents (its index {idx_path} lists none): was "
            f"the corpus empty? {REPREPROCESS} on a non-empty corpus, or drop it from --data-path")
    return IndexedFileInfo(prefix=prefix, sequences=sequences, tokens=actual // itemsize,
                           dtype=dtype.__name__, bin_bytes=actual)


# ----------------------------------------------------------------------------- splits
def split_parts(prefix: str, config) -> List[Optional[Any]]:
    """Per split (train, validation, test): what megatron-core hands that split's dataset, or None.

    Each part has ``.indices`` (the document indices the split will use) and ``.dataset`` (the
    file's megatron-core IndexedDataset).  Runs megatron-core's own split code on a stand-in
    class, so the ranges are by construction the ones the real build uses (0.16.1 has no public
    function for them; the rounding lives in ``_build_megatron_dataset_splits``).  None: the split
    is not built (weight 0 in ``--split``, or not used by the run).  No barrier: every rank
    runs this on its own.
    """
    from megatron.distributed.mcore_compat.data import dataset_split_parts

    return dataset_split_parts(prefix, config)


def split_tokens(indexed_dataset: Any, indices: Sequence[int]) -> int:
    """Tokens in the documents ``indices`` of a megatron-core IndexedDataset.

    megatron-core's splits are contiguous ranges and the .idx pointers are byte offsets of
    consecutive documents, so two pointers give the count without reading every length (what
    every rank would otherwise do for every file); anything else is summed.
    """
    from megatron.distributed.mcore_compat.data import index_token_count

    return index_token_count(indexed_dataset, indices)


@dataclass(frozen=True)
class SplitStats:
    """One file's share of one split."""

    prefix: str
    split: str
    documents: int
    tokens: int
    first: int  # document range [first, first + documents)


def _need(name: str, args: argparse.Namespace, samples: int) -> str:
    if name == "train" and getattr(args, "train_samples", None):
        return f"training needs {samples} samples (--train-samples)"
    if name == "train":
        return (f"training needs {samples} samples (--train-iters {args.train_iters} x "
                f"--global-batch-size {args.global_batch_size})")
    return (f"evaluation needs {samples} samples (--eval-iters {args.eval_iters} x "
            f"--global-batch-size {args.global_batch_size} per evaluation)")


def _fix(name: str) -> str:
    if name == "train":
        return "Use more data, or give the train split a larger weight in --split."
    return ("Use more data, give the validation split a larger weight (e.g. --split 90,10,0), "
            "or train without evaluation: --eval-iters 0 (and --split 100,0,0 to train on every "
            "document).")


def check_split_weights(args: argparse.Namespace, request: SplitRequest, full_matrix) -> None:
    """A split the run reads must have a weight in ``--split`` (else it is silently missing)."""
    if request.used[0] and full_matrix[0] is None:
        raise StartupError(
            f"--split {args.split} gives the train split weight 0, so there is no training "
            f"data; give it a weight (e.g. --split 98,2,0), or pass --skip-train to only evaluate")
    if request.used[1] and full_matrix[1] is None:
        raise StartupError(
            f"--eval-iters {args.eval_iters} asks for evaluation but --split {args.split} gives "
            f"the validation split weight 0, so there is no validation data; pass --eval-iters 0 "
            f"to train without evaluation, or give validation a weight (e.g. --split 98,2,0)")


def check_splits(args: argparse.Namespace, config, request: SplitRequest,
                 files: Sequence[IndexedFileInfo], weighted: bool) -> List[SplitStats]:
    """Every used split must have documents (and tokens) in every file; returns what each gets.

    With several files and no weights megatron-core takes one epoch of each file's split, so
    there each split must also hold at least one whole sample (``--seq-length`` tokens plus the
    extra label token), or megatron-core's BlendedDataset asserts.
    """
    stats: List[SplitStats] = []
    one_epoch_each = len(files) > 1 and not weighted
    min_tokens = args.seq_length + int(config.add_extra_token_to_sequence)
    for info in files:
        for i, (name, part) in enumerate(zip(SPLIT_NAMES, split_parts(info.prefix, config))):
            if not request.used[i] or part is None:
                continue
            idx = part.indices
            tokens = split_tokens(part.dataset, idx)
            first = int(idx[0]) if len(idx) else 0
            stats.append(SplitStats(info.prefix, name, len(idx), tokens, first))
            if len(idx) == 0 or tokens == 0:
                what = ("0" if len(idx) == 0 else f"{len(idx)} documents but 0 tokens") + \
                    f" of the file's {info.sequences} documents"
                raise StartupError(
                    f"the {name} split of data file {info.prefix} is empty: --split {args.split} "
                    f"assigns it {what}, but {_need(name, args, request.samples[i])}. {_fix(name)}")
            if one_epoch_each and tokens < min_tokens:
                raise StartupError(
                    f"the {name} split of data file {info.prefix} has {tokens} tokens, fewer than "
                    f"one sample needs ({min_tokens}: --seq-length {args.seq_length} + 1): an "
                    f"unweighted multi-file --data-path uses each file's split once, and "
                    f"megatron-core cannot blend a file that contributes no sample. {_fix(name)} "
                    f"Or give the files weights (--data-path W1 PREFIX1 W2 PREFIX2 ...), which "
                    f"repeats small files.")
    return stats


def check_built_lengths(args: argparse.Namespace, request: SplitRequest,
                        train: Any, valid: Any) -> None:
    """Built datasets must hold what the run reads (only an unweighted blend can fall short).

    Training reads each sample once: a shorter dataset would end the run mid-way on an exhausted
    iterator.  Evaluation cycles, but a dataset shorter than one micro-batch step of all
    data-parallel ranks yields no batch and would cycle forever.
    """
    if request.used[0] and (train is None or len(train) < request.samples[0]):
        have = 0 if train is None else len(train)
        raise StartupError(
            f"the train split of --data-path holds {have} samples of --seq-length "
            f"{args.seq_length} tokens, but {_need('train', args, request.samples[0])}: an "
            f"unweighted multi-file --data-path uses each file once; give the files weights "
            f"(--data-path W1 PREFIX1 W2 PREFIX2 ...) to repeat them, use more data, or fewer "
            f"--train-iters")
    step = args.micro_batch_size * args.data_parallel_size
    if request.used[1] and (valid is None or len(valid) < step):
        have = 0 if valid is None else len(valid)
        raise StartupError(
            f"the validation split of --data-path holds {have} samples of --seq-length "
            f"{args.seq_length} tokens, fewer than one evaluation step reads (--micro-batch-size "
            f"{args.micro_batch_size} x {args.data_parallel_size} data-parallel ranks = {step}). "
            f"{_fix('validation')}")


def check_data(args: argparse.Namespace, config, request: SplitRequest,
               full_matrix) -> List[SplitStats]:
    """All the checks that need no built dataset, on this rank's files (raises StartupError)."""
    check_split_weights(args, request, full_matrix)
    if not args.data_path:
        return []  # --mock-data: megatron-core's synthetic dataset, nothing on disk
    prefixes, weights = data_blend(args.data_path)
    files = [check_indexed_files(p) for p in prefixes]
    return check_splits(args, config, request, files, weighted=weights is not None)


# ----------------------------------------------------------------------------- agreement
def collective_device() -> Any:
    """Where a small agreement tensor lives: the current GPU on NCCL, else the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) \
        if torch.distributed.get_backend() == "nccl" else torch.device("cpu")


def raise_if_any_rank_failed(problem: Optional[str], device: Any) -> None:
    """Raise :class:`StartupError` on every rank when any rank found a problem.

    The message is that of the lowest such rank (broadcast, so rank 0 -- which prints -- has it
    even when only another node's copy of a file is bad).  One small all-reduce when all is well.
    """
    import torch

    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        world = torch.distributed.get_world_size()
        flag = torch.tensor([torch.distributed.get_rank() if problem else world],
                            dtype=torch.int64, device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        first = int(flag.item())
        if first == world:
            return
        message = [problem]
        torch.distributed.broadcast_object_list(message, src=first)
        problem = message[0]
    if problem:
        raise StartupError(problem)


def _checked(fn, *args: Any) -> Tuple[Any, Optional[str]]:
    try:
        return fn(*args), None
    except StartupError as exc:
        return None, str(exc)


# ----------------------------------------------------------------------------- build
def build_datasets(args: argparse.Namespace, tokenizer: Any):
    """(train, validation, None): checked first, then built by megatron-core for the whole run.

    Sizes follow Megatron-LM (every step of training, every evaluation run); the test split is
    never built (the trainer does not use it), nor is validation with ``--eval-iters 0``.
    """
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    request = split_request(args)
    config, full_matrix = dataset_config(args, tokenizer, request)
    stats, problem = _checked(check_data, args, config, request, full_matrix)
    raise_if_any_rank_failed(problem, device)
    for prefix in dict.fromkeys(s.prefix for s in stats):
        print_rank_0(f" > data file {prefix}: " + ", ".join(
            f"{s.split} documents [{s.first}, {s.first + s.documents}) ({s.tokens} tokens)"
            for s in stats if s.prefix == prefix))
    unused = [n for n, used in zip(SPLIT_NAMES, request.used) if not used]
    if unused:
        print_rank_0(f" > not built (this run does not read it): {' and '.join(unused)} split")

    cls = MockGPTDataset if args.mock_data else GPTDataset
    train, valid, _ = BlendedMegatronDatasetBuilder(
        cls, list(request.samples), lambda: True, config).build()
    _, problem = _checked(check_built_lengths, args, request, train, valid)
    raise_if_any_rank_failed(problem, device)
    return train, valid, None
