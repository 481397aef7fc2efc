"""Damaged checkpoints are refused, naming the file (issue 26, item 1).

Why: 8 flipped bytes in a ``.pt`` or a ``.distcp`` shard loaded silently (a resumed loss of
2.9e3; a diverging grad norm), and a truncated ``.pt`` gave a raw ``PytorchStreamReader``
traceback naming no file.  Every checkpoint now has a manifest of its files' sizes and digests,
written before the tracker moves and checked at load (:mod:`megatron.training.checkpoint.integrity`).

How the damage is made: the bytes flipped are the middle of the saved word-embedding weights,
found in the file by their exact bytes.  So a load that skips the check (``--no-verify-checkpoint``)
really does succeed with wrong weights -- the silent corruption of the issue -- and the check is
what stops it.  One spawned 2-rank job trains a tiny GPT for 4 steps, saves iterations 2 and 4 in
both formats, and tries every load; the CLI and ``convert_to_hf.py`` then run on its checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch

from dist_harness import run_distributed
from megatron.training.checkpoint import integrity as ci

WORLD = 2
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "8",
        "--device", "cpu", "--global-batch-size", "4", "--train-iters", "4", "--lr", "3e-3",
        "--bf16", "--use-distributed-optimizer", "--eval-iters", "0"]
FORMATS = ("torch", "torch_dist")


# ----------------------------------------------------------------------------- unit
def _iteration(root: Path, it: int, payload: Dict[str, Any]) -> Path:
    d = root / f"iter_{it:07d}"
    d.mkdir(parents=True)
    entry = ci.save_torch(payload, str(d / "model.pt"), str(d))
    (d / "extra.bin").write_bytes(b"written by someone else")  # unclaimed: hashed by the manifest
    ci.write_manifest(str(d), it, [entry])
    return d


def test_digest_while_writing_equals_the_file_and_manifest_covers_every_file(tmp_path) -> None:
    d = _iteration(tmp_path, 4, {"w": torch.randn(600, 1000)})  # chunks above PARALLEL_MIN
    m = ci.read_manifest(str(d))
    assert {f.name for f in m.files} == {"model.pt", "extra.bin", ci.WRITER_NOTE}
    for f in m.files:
        assert (f.size, f.digest) == ci.digest_file(str(d / f.name), m.algorithm)
    assert m.algorithm == "xxh3_128" and m.iteration == 4
    assert ci.verify(str(d), m) is None
    assert not list(d.glob("*.part"))


@pytest.mark.parametrize("damage, expected", [
    ("flip", "does not match its xxh3_128 digest in the manifest"),
    ("truncate", "is truncated: 1000 bytes, the manifest says"),
    ("delete", "is missing"),
    ("grow", "bytes, the manifest says"),
])
def test_verify_names_the_damaged_file_and_the_previous_checkpoint(tmp_path, damage,
                                                                   expected) -> None:
    _iteration(tmp_path, 2, {"w": torch.zeros(3)})
    d = _iteration(tmp_path, 4, {"w": torch.randn(500, 500)})
    path = d / "model.pt"
    if damage == "flip":
        _flip(path, path.stat().st_size // 2)
    elif damage == "truncate":
        os.truncate(path, 1000)
    elif damage == "delete":
        path.unlink()
    else:
        with open(path, "ab") as f:
            f.write(b"\0")
    found = ci.verify(str(d), ci.read_manifest(str(d)))
    assert found is not None and found[0] == str(path) and expected in found[1]
    msg = ci.damaged(str(d), *found)
    assert msg.startswith(f"checkpoint {d} (iteration 4) is damaged: {path} ")
    assert msg.endswith("the previous complete checkpoint is iteration 2: load it with "
                        "--ckpt-step 2")


def test_truncated_pt_is_a_clear_error_not_a_zip_traceback(tmp_path) -> None:
    d = _iteration(tmp_path, 4, {"w": torch.randn(100, 100)})
    os.truncate(d / "model.pt", 500)
    with pytest.raises(ci.CheckpointIntegrityError) as exc:
        ci.torch_load(str(d / "model.pt"), str(d), weights_only=False)
    msg = str(exc.value)
    assert f"is damaged: {d / 'model.pt'} cannot be read: it is truncated or corrupt" in msg
    assert f"there is no earlier complete checkpoint in {tmp_path}" in msg
    assert "If you are seeing this error" not in msg  # torch's generic advice is cut


def test_files_are_split_over_the_ranks_each_checked_once() -> None:
    files = tuple(ci.FileDigest(f"f{i}", size, "0") for i, size in
                  enumerate([900, 10, 500, 500, 30, 0, 70]))
    m = ci.Manifest(1, "xxh3_128", files)
    shares = [ci.files_for_rank(m, r, 3) for r in range(3)]
    assert sorted(f.name for s in shares for f in s) == sorted(f.name for f in files)
    assert max(sum(f.size for f in s) for s in shares) == 900  # the big file alone


def test_unreadable_manifest_is_itself_an_error(tmp_path) -> None:
    d = _iteration(tmp_path, 4, {"w": torch.zeros(3)})
    (d / ci.MANIFEST).write_text("{not json")
    with pytest.raises(ci.CheckpointIntegrityError, match=f"{d / ci.MANIFEST} cannot be read"):
        ci.read_manifest(str(d))


def test_a_changed_manifest_blames_itself_not_an_intact_file(tmp_path) -> None:
    """Issue 32, item 3: one changed byte in manifest.json blamed an intact data file ("does
    not match its digest", "is truncated") and sent the user to an older checkpoint; an altered
    algorithm name named neither the manifest nor the checkpoint. The manifest now carries its
    own digest."""
    import json

    _iteration(tmp_path, 2, {"w": torch.zeros(3)})
    d = _iteration(tmp_path, 4, {"w": torch.randn(50, 50)})
    path = d / ci.MANIFEST
    original = path.read_text()
    raw = json.loads(original)
    entry = raw["files"]["model.pt"]
    other_first = "1" if entry["digest"][0] == "0" else "0"   # the data is random: so is the digest
    for changed in (original.replace(entry["digest"], other_first + entry["digest"][1:]),
                    original.replace(f'"size": {entry["size"]}', f'"size": {entry["size"] + 1}'),
                    original.replace('"xxh3_128"', '"xxh3_129"')):
        assert changed != original
        path.write_text(changed)
        with pytest.raises(ci.CheckpointIntegrityError) as info:
            ci.read_manifest(str(d))
        msg = str(info.value)
        assert f"is damaged: {path} does not match its own digest" in msg, msg
        assert "model.pt" not in msg and "--no-verify-checkpoint" in msg
        assert "previous complete checkpoint is iteration 2" in msg
    # an unknown algorithm in a manifest that is otherwise consistent: named, with the manifest
    body = {k: v for k, v in raw.items() if k != "self_sha256"}
    body["algorithm"] = "xxh3_129"
    path.write_text(json.dumps({**body, "self_sha256": ci._self_digest(body)}))
    with pytest.raises(ci.CheckpointIntegrityError,
                       match=f"{d} \\(iteration 4\\) is damaged: {path} names the digest "
                             "algorithm 'xxh3_129'"):
        ci.read_manifest(str(d))
    # a manifest of version 1 (no digest of its own) still reads
    old = {k: v for k, v in raw.items() if k != "self_sha256"}
    old["version"] = 1
    path.write_text(json.dumps(old))
    assert ci.verify(str(d), ci.read_manifest(str(d))) is None


def test_a_missing_manifest_is_refused_where_the_writer_wrote_one(tmp_path) -> None:
    """Issue 32, item 2: deleting manifest.json turned verification off with a note that the
    checkpoint predated manifests; a flipped byte then trained on. A checkpoint whose writer
    wrote a manifest (checkpoint_writer.json) is refused without it, naming the way out."""
    _iteration(tmp_path, 2, {"w": torch.zeros(3)})
    d = _iteration(tmp_path, 4, {"w": torch.zeros(3)})
    assert ci.WRITER_NOTE in {f.name for f in ci.read_manifest(str(d)).files}
    (d / ci.MANIFEST).unlink()
    with pytest.raises(ci.CheckpointIntegrityError) as info:
        ci.require_manifest(str(d))
    msg = str(info.value)
    assert f"{d / ci.MANIFEST} is missing, but the checkpoint was written with one" in msg
    assert "--ckpt-step 2" in msg and "--no-verify-checkpoint" in msg
    (d / ci.WRITER_NOTE).unlink()          # written before manifests: loads, unverified
    assert ci.require_manifest(str(d)) is None


# ----------------------------------------------------------------------------- training job
def _flip(path: Path, offset: int, n: int = 8) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def _embedding(model) -> torch.Tensor:
    return next(p for n, p in model[0].named_parameters() if "word_embeddings" in n)


def _flip_embedding_bytes(iter_dir: Path, needle: bytes) -> Path:
    """Flip 8 bytes in the middle of the saved embedding weights; the file they are in."""
    for path in sorted(p for p in iter_dir.rglob("*") if p.suffix in (".pt", ".distcp")):
        pos = path.read_bytes().find(needle)
        if pos >= 0:
            _flip(path, pos + len(needle) // 2)
            return path
    raise AssertionError(f"the embedding weights are in no file of {iter_dir}")


def _job(rank: int, world: int, root: str) -> Dict[str, Any]:
    """Train 4 steps, save 2 and 4 in both formats, then try each load (every rank takes part;
    rank 0 damages and restores the files between barriers)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    from megatron.training.checkpoint import save_load as checkpointing
    from megatron.training.arguments import parse_args
    from megatron.training.model.config_builders import build_transformer_config
    from megatron.training.errors import StartupError
    from megatron.training.initialize import initialize_megatron
    from megatron.training.components import (configure_schedule, get_model,
                                                       get_optimizer_and_scheduler)
    from megatron.training.step import forward_step, train_step
    from tools.paro_strategy_table import synthetic_batches

    args = parse_args(TINY)
    initialize_megatron(args)
    args.padded_vocab_size = 128
    config = build_transformer_config(args)
    model = get_model(args, config, 128)
    opt, sched = get_optimizer_and_scheduler(args, model)
    configure_schedule(args, config, model, opt)
    batches = synthetic_batches(rank, 0, 4, micro=1, mbs=2, seq=32, vocab=128)
    weights: Dict[int, torch.Tensor] = {}
    for step in (1, 2, 3, 4):
        _, ok, _, _ = train_step(args, partial(forward_step, args), batches, model, opt,
                                 sched, torch.device("cpu"))
        assert ok
        if step in (2, 4):
            weights[step] = _embedding(model).detach().clone()
            for fmt in FORMATS:
                args.save, args.ckpt_format = os.path.join(root, fmt), fmt
                checkpointing.save_checkpoint(args, step, model, opt, sched,
                                              {"consumed_train_samples": 4 * step})
    args.save = None
    needle = weights[4].contiguous().view(torch.uint8).numpy().tobytes()

    def load(path: str, ckpt_step: Optional[int] = None, verify: bool = True,
             damage: Optional[Callable[[], Any]] = None) -> Dict[str, Any]:
        backup = os.path.join(root, "backup")
        damaged = None
        if rank == 0 and damage is not None:
            shutil.copytree(path, backup)
            damaged = str(damage())
        torch.distributed.barrier()
        args.load, args.ckpt_step, args.verify_checkpoint = path, ckpt_step, verify
        try:
            it, _ = checkpointing.load_checkpoint(args, model, opt, sched)
            emb = _embedding(model).detach()
            out = {"iteration": it, "weights": next((k for k, w in weights.items()
                                                     if torch.equal(w, emb)), "other")}
        except StartupError as exc:
            out = {"error": str(exc)}
        torch.distributed.barrier()
        if rank == 0 and damage is not None:
            shutil.rmtree(path)
            shutil.move(backup, path)
        torch.distributed.barrier()
        return {**out, "damaged": damaged}

    out: Dict[str, Any] = {}
    for fmt in FORMATS:
        ckpt = os.path.join(root, fmt)
        it4 = Path(ckpt) / "iter_0000004"
        flip = partial(_flip_embedding_bytes, it4, needle)
        out[fmt] = {
            "latest": load(ckpt),
            "iter_folder": load(os.path.join(ckpt, "iter_0000002")),
            "ckpt_step": load(ckpt, ckpt_step=2),
            "flipped": load(ckpt, damage=flip),
            "flipped_unverified": load(ckpt, verify=False, damage=flip),
        }
    # Format-independent paths, once (the torch format loads fastest).
    ckpt = os.path.join(root, "torch")
    it4 = Path(ckpt) / "iter_0000004"
    flip = partial(_flip_embedding_bytes, it4, needle)
    out["torch"]["flipped_via_folder"] = load(str(it4), damage=flip)
    out["torch"]["previous_of_flipped"] = load(ckpt, ckpt_step=2, damage=flip)
    truncate = partial(lambda p: (os.truncate(p, p.stat().st_size // 2), p)[1],
                       it4 / "mp_rank_00_000_dp_000.pt")
    out["torch"]["truncated"] = load(ckpt, damage=truncate)
    out["torch"]["truncated_unverified"] = load(ckpt, verify=False, damage=truncate)
    no_manifest = partial(lambda p: (p.unlink(), p)[1], it4 / ci.MANIFEST)
    out["torch"]["manifest_deleted"] = load(ckpt, damage=no_manifest)
    out["torch"]["manifest_deleted_unverified"] = load(ckpt, verify=False, damage=no_manifest)
    dist4 = Path(root) / "torch_dist" / "iter_0000004"
    no_rank1 = partial(lambda p: (p.unlink(), p)[1], dist4 / "rank_state" / "tp00_pp000_dp00001.pt")
    out["torch_dist"]["rank_state_deleted_unverified"] = load(
        os.path.join(root, "torch_dist"), verify=False, damage=no_rank1)
    half = partial(lambda p: (os.truncate(p, p.stat().st_size // 2), p)[1], dist4 / "common.pt")
    out["torch_dist"]["common_truncated_unverified"] = load(
        os.path.join(root, "torch_dist"), verify=False, damage=half)
    garbled = partial(lambda p: (p.write_text('{"sharded_backend": '), p)[1],
                      dist4 / "metadata.json")
    out["torch_dist"]["metadata_damaged_unverified"] = load(
        os.path.join(root, "torch_dist"), verify=False, damage=garbled)
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Dict[str, Any]:
    root = tmp_path_factory.mktemp("integrity")
    (root / "out").mkdir()
    results = run_distributed(WORLD, _job, root / "out", str(root))
    return {"root": root, "results": results}


def test_a_deleted_manifest_is_refused_on_every_rank_unless_told(job) -> None:
    """Issue 32, item 2, on a real checkpoint: refused on every rank naming the manifest, the
    previous checkpoint and --no-verify-checkpoint, which loads it."""
    for r in job["results"]:
        msg = r["torch"]["manifest_deleted"].get("error", "")
        assert "manifest.json is missing, but the checkpoint was written with one" in msg, r
        assert "--ckpt-step 2" in msg and "--no-verify-checkpoint" in msg
        assert r["torch"]["manifest_deleted_unverified"]["iteration"] == 4


def test_a_missing_rank_state_of_torch_dist_is_refused_without_verification(job) -> None:
    """Issue 32, item 4: with --no-verify-checkpoint (or no manifest) a missing
    rank_state/tp00_pp000_dp00001.pt loaded silently: rank 1 took rank 0's RNG state and
    restarted its LoCo and stochastic-rounding state. Now every rank stops naming the file."""
    for r in job["results"]:
        msg = r["torch_dist"]["rank_state_deleted_unverified"].get("error", "")
        assert "rank_state/tp00_pp000_dp00001.pt is missing: this rank's RNG state" in msg, r
        assert "--ckpt-step 2" in msg


def test_torch_dist_common_files_damaged_without_verification_are_named(job) -> None:
    """Issue 32, item 5: a truncated common.pt or a damaged metadata.json with verification
    off gave megatron-core's traceback naming no file; now one error naming it, every rank."""
    for r in job["results"]:
        for case, name in (("common_truncated_unverified", "common.pt cannot be read: it is "
                            "truncated or corrupt"),
                           ("metadata_damaged_unverified", "metadata.json cannot be read")):
            msg = r["torch_dist"][case].get("error", "")
            assert "iter_0000004 (iteration 4) is damaged: " in msg and name in msg, (case, r)
            assert "--ckpt-step 2" in msg


@pytest.mark.parametrize("fmt", FORMATS)
def test_manifest_lists_every_file_of_the_checkpoint(job, fmt) -> None:
    for it in (2, 4):
        d = job["root"] / fmt / f"iter_{it:07d}"
        manifest = json.loads((d / ci.MANIFEST).read_text())
        on_disk = {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()} - {ci.MANIFEST}
        assert set(manifest["files"]) == on_disk and manifest["iteration"] == it
        for name, entry in manifest["files"].items():
            assert entry["size"] == (d / name).stat().st_size
    if fmt == "torch_dist":  # megatron-core's shards and our per-rank files are all covered
        assert any(n.endswith(".distcp") for n in manifest["files"])
        assert "rank_state/tp00_pp000_dp00001.pt" in manifest["files"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_paths_and_ckpt_step_load_the_iteration_named(job, fmt) -> None:
    r = job["results"][0][fmt]
    assert {k: (r[k]["iteration"], r[k]["weights"]) for k in
            ("latest", "iter_folder", "ckpt_step")} == {
        "latest": (4, 4), "iter_folder": (2, 2), "ckpt_step": (2, 2)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_flipped_bytes_are_refused_naming_the_file_on_every_rank(job, fmt) -> None:
    root = job["root"] / fmt
    r0, r1 = job["results"][0][fmt], job["results"][1][fmt]
    flipped = r0["flipped"]
    assert "error" in flipped, flipped
    expected = (f"checkpoint {root / 'iter_0000004'} (iteration 4) is damaged: "
                f"{flipped['damaged']} does not match its xxh3_128 digest in the manifest")
    assert flipped["error"].startswith(expected)
    assert flipped["damaged"].endswith(".distcp" if fmt == "torch_dist" else ".pt")
    assert flipped["error"].endswith("the previous complete checkpoint is iteration 2: load it "
                                     "with --ckpt-step 2")
    assert r1["flipped"]["error"] == flipped["error"]  # every rank stops, with one message


def test_the_advice_follows_the_load_form_and_works(job) -> None:
    r = job["results"][0]["torch"]
    # --load given as the folder: the advice is a folder too.
    assert r["flipped_via_folder"]["error"].endswith(
        f"load it with --load {job['root'] / 'torch' / 'iter_0000002'}")
    # The advice works: iteration 2 loads although 4 is damaged.
    assert (r["previous_of_flipped"]["iteration"], r["previous_of_flipped"]["weights"]) == (2, 2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_verify_checkpoint_skips_the_check(job, fmt) -> None:
    """What the check prevents: unchecked, the flipped checkpoint loads with wrong weights."""
    r = job["results"][0][fmt]["flipped_unverified"]
    assert (r.get("iteration"), r.get("weights")) == (4, "other"), r


def test_truncated_pt_is_refused_with_or_without_the_check(job) -> None:
    r = job["results"][0]["torch"]
    path = job["root"] / "torch" / "iter_0000004" / "mp_rank_00_000_dp_000.pt"
    assert f"is damaged: {path} is truncated: " in r["truncated"]["error"]
    unchecked = r["truncated_unverified"]["error"]
    assert f"is damaged: {path} cannot be read: it is truncated or corrupt (PytorchStreamReader" \
        in unchecked
    assert unchecked.endswith("load it with --ckpt-step 2")
    assert job["results"][1]["torch"]["truncated_unverified"]["error"] == unchecked


def test_cli_refuses_a_flipped_checkpoint_in_one_line(job, tmp_path, run_pretrain) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(job["root"] / "torch", ckpt)
    path = ckpt / "iter_0000004" / "mp_rank_00_000_dp_001.pt"
    _flip(path, path.stat().st_size // 2)
    res = run_pretrain(["--global-batch-size", "4", "--train-iters", "4", "--lr", "3e-3",
                        "--bf16", "--use-distributed-optimizer", "--eval-iters", "0",
                        "--load", str(ckpt)])
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-3000:]
    assert res.stderr.count(f"error: checkpoint {ckpt / 'iter_0000004'} (iteration 4) is "
                            f"damaged: {path} does not match") == 1, res.stderr[-3000:]
    # No rank's traceback (torchrun still reports the exit status with its own).
    assert "checkpoint_integrity.py" not in res.stderr and "checkpointing.py" not in res.stderr
    assert "loaded checkpoint" not in res.stdout


def test_convert_to_hf_verifies_what_it_reads(job, tmp_path, capsys) -> None:
    from tools.checkpoint.convert_to_hf import ConversionError, load_megatron_checkpoint, main

    for fmt in FORMATS:
        ckpt = tmp_path / fmt
        shutil.copytree(job["root"] / fmt, ckpt)
        _, sd, info = load_megatron_checkpoint(str(ckpt))
        assert info["verified"] and info["iteration"] == 4
        # A damaged file the export reads: refused, naming it, with this tool's flag.
        name = "mp_rank_00_000_dp_000.pt" if fmt == "torch" else next(
            p.name for p in (ckpt / "iter_0000004").glob("*.distcp"))
        path = ckpt / "iter_0000004" / name
        _flip(path, path.stat().st_size // 2)
        assert main(["--load", str(ckpt), "--output", str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err
        assert f"is damaged: {path} does not match its xxh3_128 digest" in err
        assert "load it with --iteration 2" in err
        if fmt == "torch":
            os.truncate(path, 4096)  # unchecked, it is still a clear error
            with pytest.raises(ConversionError, match=f"{path} cannot be read: it is truncated"):
                load_megatron_checkpoint(str(ckpt), verify=False)
    # A file the export does not read (rank 1's optimizer shard) does not stop it.
    ckpt = tmp_path / "torch"
    shutil.rmtree(ckpt)
    shutil.copytree(job["root"] / "torch", ckpt)
    other = ckpt / "iter_0000004" / "mp_rank_00_000_dp_001.pt"
    _flip(other, other.stat().st_size // 2)
    assert load_megatron_checkpoint(str(ckpt))[2]["verified"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
