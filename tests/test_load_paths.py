"""``--load`` says what it loads (issue 26, item 3).

Why: ``--load .../iter_0000030`` (a complete checkpoint folder) and ``--load`` on a checkpoint
*file* both trained from iteration 0 with exit 0.  The rules (:func:`find_checkpoint_to_load`):
an ``iter_*`` folder loads that iteration, ``--ckpt-step N`` picks N, a file or a folder holding
something other than a checkpoint is an error naming what was found, and the logged fresh start
remains only for a ``--load`` directory that does not exist (Megatron-LM's first launch of
``--save D --load D``) or an empty ``--load`` that is also ``--save``.

These are checks of the resolution alone (no model, milliseconds); that the resolved iteration
is really what gets loaded is checked end to end in tests/test_checkpoint_integrity.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import pytest

from megatron.training.checkpoint.discovery import LoadTarget, find_checkpoint_to_load
from megatron.training.errors import StartupError


def _args(load: Path, save: Optional[Path] = None, **kw) -> argparse.Namespace:
    return argparse.Namespace(load=str(load), save=str(save) if save else None, ckpt_step=None,
                              exit_on_missing_checkpoint=False, **kw)


def _checkpoint(root: Path, *iterations: int, tracker: Optional[int] = None) -> Path:
    """A --save directory with torch-format iteration folders (the file contents do not matter
    to the resolution)."""
    for it in iterations:
        d = root / f"iter_{it:07d}"
        d.mkdir(parents=True)
        (d / "mp_rank_00_000_dp_000.pt").write_bytes(b"x")
        (d / "manifest.json").write_text("{}")
    if tracker is not None:
        (root / "latest_checkpointed_iteration.txt").write_text(str(tracker))
    return root


def test_root_loads_the_tracker_iteration_and_ckpt_step_another(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt", 2, 4, tracker=4)
    assert find_checkpoint_to_load(_args(root)) == LoadTarget(
        str(root), 4, str(root / "iter_0000004"))
    step = _args(root)
    step.ckpt_step = 2
    assert find_checkpoint_to_load(step) == LoadTarget(str(root), 2, str(root / "iter_0000002"))
    step.ckpt_step = 3
    with pytest.raises(StartupError, match=r"--ckpt-step 3: .*iter_0000003 does not exist "
                                           r"\(--load .* has iterations 2, 4\)"):
        find_checkpoint_to_load(step)


def test_iteration_folder_loads_that_iteration(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt", 2, 4, tracker=4)
    target = find_checkpoint_to_load(_args(root / "iter_0000002"))
    assert (target.iteration, target.directory, target.root) == (
        2, str(root / "iter_0000002"), str(root))
    assert target.by_folder and target.load_flag(1) == f"--load {root / 'iter_0000001'}"
    trailing_slash = find_checkpoint_to_load(_args(Path(str(root / "iter_0000002") + "/")))
    assert trailing_slash.iteration == 2
    conflict = _args(root / "iter_0000002")
    conflict.ckpt_step = 4
    with pytest.raises(StartupError, match="folder of iteration 2 but --ckpt-step 4"):
        find_checkpoint_to_load(conflict)


def test_a_file_is_an_error_naming_it_and_the_folder_to_pass(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt", 4, tracker=4)
    pt = root / "iter_0000004" / "mp_rank_00_000_dp_000.pt"
    with pytest.raises(StartupError) as exc:
        find_checkpoint_to_load(_args(pt))
    msg = str(exc.value)
    assert f"--load {pt} is a file (1 bytes), not a checkpoint directory" in msg
    assert f"pass --load {root / 'iter_0000004'}" in msg
    assert "does not exist" not in msg  # the old, wrong message


def test_folder_without_checkpoint_is_an_error_naming_what_was_found(tmp_path: Path) -> None:
    hf = tmp_path / "hf_export"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    with pytest.raises(StartupError, match=r"holds no checkpoint \(no latest_checkpointed_"
                                           r"iteration\.txt, no iter_\* folder\): found "
                                           r"config\.json, model\.safetensors"):
        find_checkpoint_to_load(_args(hf))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(StartupError, match="holds no checkpoint .*: it is empty"):
        find_checkpoint_to_load(_args(empty, save=tmp_path / "elsewhere"))


def test_iteration_folders_without_tracker_ask_which_one(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ckpt", 2, 4)
    with pytest.raises(StartupError, match=r"has no latest_checkpointed_iteration\.txt but holds "
                                           r"iteration folders \(iter_0000002, iter_0000004\): "
                                           r"choose one with --ckpt-step N \(e\.g\. --ckpt-step 4\)"):
        find_checkpoint_to_load(_args(root))


def test_fresh_start_only_for_a_missing_folder_or_an_empty_save_folder(tmp_path: Path,
                                                                       capsys) -> None:
    missing = tmp_path / "not_yet"
    assert find_checkpoint_to_load(_args(missing, save=missing)) is None
    assert (f"WARNING: --load {missing}: no checkpoint found (the directory does not exist); "
            "training starts from iteration 0") in capsys.readouterr().out
    # --save D --load D after `mkdir -p D`, or after a first save that was killed.
    auto = tmp_path / "auto"
    (auto / ".tmp_iter_0000002").mkdir(parents=True)
    assert find_checkpoint_to_load(_args(auto, save=auto)) is None
    assert "holds no checkpoint yet, only .tmp_iter_0000002" in capsys.readouterr().out
    strict = _args(missing, save=missing)
    strict.exit_on_missing_checkpoint = True
    with pytest.raises(StartupError, match="--exit-on-missing-checkpoint is set"):
        find_checkpoint_to_load(strict)
    step = _args(missing)
    step.ckpt_step = 3
    with pytest.raises(StartupError, match="does not exist, so --ckpt-step 3 cannot be loaded"):
        find_checkpoint_to_load(step)


def test_checkpoint_files_in_a_folder_not_named_iter_are_refused(tmp_path: Path) -> None:
    best = tmp_path / "best"
    best.mkdir()
    (best / "metadata.json").write_text("{}")
    with pytest.raises(StartupError, match="holds the files of one checkpoint but is not named "
                                           "iter_NNNNNNN"):
        find_checkpoint_to_load(_args(best))
    hollow = tmp_path / "iter_0000007"
    hollow.mkdir()
    with pytest.raises(StartupError, match="named like an iteration folder but holds no "
                                           "checkpoint files"):
        find_checkpoint_to_load(_args(hollow))


def test_ckpt_step_needs_load(capsys) -> None:
    from megatron.training.arguments import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                    "--seq-length", "32", "--max-position-embeddings", "32", "--mock-data",
                    "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
                    "--ckpt-step", "3"])
    assert exc.value.code == 2
    assert "--ckpt-step needs --load DIR" in capsys.readouterr().err


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage\x81", b"", b"  \n", b"latest",
                                     b"-4", b"4.0"])
def test_a_damaged_tracker_is_one_error_naming_it_and_the_way_out(tmp_path: Path,
                                                                  content: bytes) -> None:
    """Issue 32, item 1: random bytes gave a raw UnicodeDecodeError traceback on every rank, an
    empty or non-numeric tracker a RuntimeError raised outside the path where the ranks agree
    (a node that does not see the bad file waited in the next collective)."""
    root = _checkpoint(tmp_path / "ckpt", 2, 4)
    (root / "latest_checkpointed_iteration.txt").write_bytes(content)
    with pytest.raises(StartupError) as info:
        find_checkpoint_to_load(_args(root))
    msg = str(info.value)
    assert f"{root / 'latest_checkpointed_iteration.txt'} is damaged" in msg
    assert "--ckpt-step 4" in msg and "iterations 2, 4" in msg
    step = _args(root)
    step.ckpt_step = 2       # the way out named: the tracker is not read
    assert find_checkpoint_to_load(step).iteration == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "latest_checkpointed_iteration.txt").write_bytes(content)
    with pytest.raises(StartupError, match="holds no iter_\\* folder: remove"):
        find_checkpoint_to_load(_args(empty))


def _damaged_on_one_rank_worker(rank: int, world: int, root: str) -> dict:
    from megatron.training.checkpoint import discovery as checkpoint_discovery

    try:
        target = checkpoint_discovery.agreed_checkpoint_to_load(
            _args(Path(root) / ("damaged" if rank == 1 else "ckpt")))
        return {"iteration": None if target is None else target.iteration}
    except StartupError as exc:
        return {"error": str(exc)}


def test_a_tracker_damaged_on_one_rank_stops_every_rank(tmp_path: Path) -> None:
    """One node sees a damaged tracker (its copy of a shared filesystem): every rank stops
    with that rank's error instead of the others waiting in the next collective."""
    from dist_harness import run_distributed

    _checkpoint(tmp_path / "ckpt", 4, tracker=4)
    damaged = _checkpoint(tmp_path / "damaged", 4)
    (damaged / "latest_checkpointed_iteration.txt").write_bytes(b"\x00\x00")
    (tmp_path / "out").mkdir()
    results = run_distributed(2, _damaged_on_one_rank_worker, tmp_path / "out", str(tmp_path))
    assert all("latest_checkpointed_iteration.txt is damaged" in r.get("error", "")
               for r in results), results


def _agree_worker(rank: int, world: int, root: str, rank1_tracker: Optional[int],
                  rank1_fails: bool) -> dict:
    """Every rank resolves --load; on rank 1 the tracker reads another iteration (a stale
    cache), or the resolution fails."""
    from megatron.training.checkpoint import discovery as checkpoint_discovery

    if rank == 1 and rank1_tracker is not None:   # a stale view: the newer folders unseen too
        checkpoint_discovery.tracker_entry = lambda load: rank1_tracker
        checkpoint_discovery._newer_complete_checkpoints = lambda root, iteration: []
    args = _args(Path(root) / ("missing" if rank == 1 and rank1_fails else "ckpt"))
    if rank == 1 and rank1_fails:
        args.ckpt_step = 4       # --ckpt-step on a --load that does not exist: an error
    try:
        target = checkpoint_discovery.agreed_checkpoint_to_load(args)
        return {"iteration": None if target is None else target.iteration}
    except StartupError as exc:
        return {"error": str(exc)}


@pytest.mark.parametrize("rank1_tracker,rank1_fails,expect", [
    (None, False, {"iteration": 4}),
    (2, False, "the ranks found different checkpoints to load (iteration 2 on some, "
               "iteration 4 on others)"),
    (None, True, "--ckpt-step 4 cannot be loaded"),
])
def test_every_rank_loads_the_same_checkpoint_or_none_does(tmp_path: Path, rank1_tracker,
                                                           rank1_fails, expect) -> None:
    """Ranks read the tracker on their own: another job saving into --load, or a shared
    filesystem's stale cache on some nodes, made them load different iterations silently, and
    a rank whose resolution failed left the others in the next collective. Now both ranks get
    the same answer, or the same error."""
    from dist_harness import run_distributed

    _checkpoint(tmp_path / "ckpt", 2, 4, tracker=4)
    (tmp_path / "out").mkdir()
    results = run_distributed(2, _agree_worker, tmp_path / "out", str(tmp_path), rank1_tracker,
                              rank1_fails)
    if isinstance(expect, dict):
        assert results == [expect, expect]
    else:
        assert all(expect in r.get("error", "") for r in results), results


def test_torch_format_optimizer_state_in_other_buckets_is_named() -> None:
    """The torch format keeps the distributed optimizer's state in megatron-core's
    dp-reshardable form, keyed by gradient bucket: resumed with another --ddp-bucket-size or
    --overlap-grad-reduce it failed inside megatron-core's loader; now the flags are named."""
    import torch

    from megatron.training.checkpoint import torch_format as checkpoint_torch_format

    class Leaf:   # what the check reads of a DistributedOptimizer: its buckets per buffer
        gbuf_ranges = [{torch.float32: [{}, {}, {}]}]
        loaded = None

        def load_state_dict(self, sd) -> None:
            self.loaded = sd

    same = {"param_state": {0: {torch.float32: [[], [], []]}, "per_bucket_numel": {}}}
    leaf = Leaf()
    checkpoint_torch_format.load_optimizer_state(leaf, [same])
    assert leaf.loaded is same
    other = {"param_state": {0: {torch.float32: [[]]}}}
    with pytest.raises(StartupError, match=r"--ddp-bucket-size or --overlap-grad-reduce"):
        checkpoint_torch_format.load_optimizer_state(Leaf(), [other])
    checkpoint_torch_format.load_optimizer_state(Leaf(), [{"no": "param_state"}])   # other optimizers


def test_a_tracker_behind_newer_complete_checkpoints_is_refused(tmp_path: Path, capsys) -> None:
    """Issue 32, item 6: a tracker naming iteration 10 while complete iterations 15 and 20 were
    there loaded 10, and the run's saves later replaced 15 and 20 without a word."""
    root = _checkpoint(tmp_path / "ckpt", 10, 15, 20, tracker=10)
    with pytest.raises(StartupError) as info:
        find_checkpoint_to_load(_args(root, save=root))
    msg = str(info.value)
    assert "names iteration 10, but the newer complete checkpoints 15, 20 are there" in msg
    assert "saves into --save" in msg and "--ckpt-step 20" in msg and "--ckpt-step 10" in msg
    # saving elsewhere replaces nothing: the tracker's iteration loads, with a warning
    assert find_checkpoint_to_load(_args(root, save=tmp_path / "other")).iteration == 10
    assert "WARNING" in capsys.readouterr().out
    chosen = _args(root, save=root)
    chosen.ckpt_step = 10          # the user's choice: loads, and says what the saves replace
    assert find_checkpoint_to_load(chosen).iteration == 10
    assert "saves at those iterations will replace them" in capsys.readouterr().out
    (root / "iter_0000020" / "manifest.json").unlink()   # an incomplete save is not "newer"
    (root / "iter_0000015" / "manifest.json").unlink()
    assert find_checkpoint_to_load(_args(root, save=root)).iteration == 10
