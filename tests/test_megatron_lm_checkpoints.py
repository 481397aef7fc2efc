"""Checkpoints made by Megatron-LM load.

What: the model weights of Megatron-LM's ``torch`` layout (``iter_N/mp_rank_XX/
model_optim_rng.pt``) and of its torch_dist load with ``--finetune`` or ``--no-load-optim
--no-load-rng`` (then the learning-rate schedule continues too), a ``release`` checkpoint
(either layout, either of our formats) loads as with ``--finetune``, and whatever does not fit
the run is refused in one line naming it (:mod:`megatron.training.checkpoint.megatron_lm_format`).
Why: that layout is not ours, and its ``release`` tracker names no iteration; a checkpoint that
loads into another model, or restarts its schedule, must not do so silently.

How: the checkpoints are written here with ``torch.save`` in Megatron-LM's layout from a tiny
GPT this test builds (TP=2 on two gloo ranks; TP=1 with two data-parallel ranks), the loading
model's weights are changed, and after ``load_checkpoint`` every tensor must equal the source's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import sys
import types
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from dist_harness import run_distributed
from megatron.training.checkpoint import megatron_lm_format as mlm
from megatron.training.checkpoint.discovery import LoadTarget, find_checkpoint_to_load
from megatron.training.checkpoint.layout import read_tracker
from megatron.training.errors import StartupError

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "8",
        "--device", "cpu", "--global-batch-size", "4", "--train-iters", "4", "--lr", "3e-3",
        "--bf16", "--use-distributed-optimizer", "--eval-iters", "0"]
TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
            "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}


def _args(load: Path, **kw: Any) -> argparse.Namespace:
    return argparse.Namespace(load=str(load), save=None, ckpt_step=None,
                              exit_on_missing_checkpoint=False, **kw)


def _megatron_lm_layout(iter_dir: Path, tp: int = 1, pp: int = 1) -> None:
    """Empty rank files in Megatron-LM's folder names (enough for the resolution)."""
    for t in range(tp):
        for p in range(pp):
            d = iter_dir / mlm.rank_dir_name(t, p, pp)
            d.mkdir(parents=True)
            (d / mlm.MODEL_FILE).write_bytes(b"x")


# ----------------------------------------------------------------------------- resolution
def test_a_release_tracker_names_the_release_folder(tmp_path: Path) -> None:
    root = tmp_path / "converted"
    _megatron_lm_layout(root / "release", tp=2)
    (root / "latest_checkpointed_iteration.txt").write_text("release\n")
    assert read_tracker(str(root)) is None    # no iteration: not a damaged tracker either
    assert find_checkpoint_to_load(_args(root)) == LoadTarget(
        str(root), 0, str(root / "release"), release=True)
    folder = find_checkpoint_to_load(_args(root / "release"))
    assert (folder.release, folder.by_folder, folder.iteration) == (True, True, 0)
    step = _args(root / "release")
    step.ckpt_step = 3
    with pytest.raises(StartupError, match="is a release checkpoint .* but --ckpt-step 3"):
        find_checkpoint_to_load(step)
    shutil.rmtree(root / "release")
    with pytest.raises(StartupError, match=r"latest_checkpointed_iteration\.txt says release "
                                           r"\(a release checkpoint.*release does not exist"):
        find_checkpoint_to_load(_args(root))
    (root / "release").mkdir()
    (root / "release" / "notes.txt").write_text("")
    with pytest.raises(StartupError, match=r"holds no checkpoint files \(found: notes\.txt\)"):
        find_checkpoint_to_load(_args(root))


def test_megatron_lm_iteration_folders_are_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "mlm"
    _megatron_lm_layout(root / "iter_0000007", tp=2, pp=2)
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    it7 = root / "iter_0000007"
    assert find_checkpoint_to_load(_args(root)).iteration == 7
    assert find_checkpoint_to_load(_args(it7)).iteration == 7
    assert mlm.is_megatron_lm_checkpoint(str(it7))
    assert sorted(mlm.rank_dirs(str(it7)).values()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    assert mlm.saved_parallel_sizes(str(it7)) == (2, 2)
    # a checkpoint of ours is never taken for Megatron-LM's (its integrity checks stay strict)
    (it7 / "manifest.json").write_text("{}")
    assert not mlm.is_megatron_lm_checkpoint(str(it7))


# ----------------------------------------------------------------------------- matching
def _model_sd() -> Dict[str, Any]:
    return {"embedding.word_embeddings.weight": torch.zeros(8, 4),
            "decoder.layers.0.input_layernorm.weight": torch.zeros(4),
            "decoder.layers.0.self_attention.linear_qkv.weight": torch.zeros(12, 4),
            "decoder.layers.0.self_attention.linear_qkv._extra_state": None,
            "decoder.final_layernorm.weight": torch.zeros(4)}


def test_transformer_engine_names_map_to_the_local_spec() -> None:
    saved = {"embedding.word_embeddings.weight": torch.ones(8, 4),
             "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": torch.ones(4),
             "decoder.layers.0.self_attention.linear_qkv.weight": torch.ones(12, 4),
             "decoder.layers.0.self_attention.linear_qkv._extra_state": io.BytesIO(),
             "decoder.layers.0.self_attention.core_attention._extra_state": io.BytesIO(b"fp8"),
             "decoder.final_layernorm.weight": torch.ones(4)}
    mapped, problems, notes = mlm.match_state_dict(saved, _model_sd())
    assert problems == []
    assert set(mapped) == set(_model_sd())
    assert mapped["decoder.layers.0.input_layernorm.weight"] is \
        saved["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"]
    assert notes == ["1 Transformer Engine layer-norm name(s) mapped to this run's spec",
                     "1 Transformer Engine _extra_state entr(ies) (FP8 scaling state) left out: "
                     "this run's layers have none"]


def test_what_does_not_fit_is_named() -> None:
    saved = {k: v.clone() if torch.is_tensor(v) else v for k, v in _model_sd().items()}
    saved["embedding.word_embeddings.weight"] = torch.zeros(16, 4)
    del saved["decoder.final_layernorm.weight"]
    saved["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.zeros(4)
    saved["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"] = torch.zeros(4)
    _, problems, _ = mlm.match_state_dict(saved, _model_sd())
    assert problems == [
        "both decoder.layers.0.input_layernorm.weight and decoder.layers.0.self_attention."
        "linear_qkv.layer_norm_weight name decoder.layers.0.input_layernorm.weight",
        "1 tensor(s) of this run's model are not in it (decoder.final_layernorm.weight)",
        "1 tensor(s) of it are not in this run's model "
        "(decoder.layers.0.self_attention.q_layernorm.weight)",
        "other shapes: embedding.word_embeddings.weight [16, 4] (this run: [8, 4])"]
    legacy = {"language_model.embedding.word_embeddings.weight": torch.zeros(8, 4)}
    _, problems, _ = mlm.match_state_dict(legacy, _model_sd())
    assert "legacy Megatron-LM model, not megatron-core's GPTModel" in problems[-1]


def test_architecture_differences_name_the_flags() -> None:
    ours = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4,
                              group_query_attention=False, num_query_groups=1, kv_channels=None,
                              swiglu=False, normalization="LayerNorm")
    theirs = argparse.Namespace(**{**vars(ours), "num_attention_heads": 8, "swiglu": True,
                                   "num_query_groups": None, "kv_channels": 8})
    assert mlm.architecture_diff(theirs, ours) == [   # kv channels, query groups: derived
        "--num-attention-heads 8 (this run: 4)", "--swiglu True (this run: False)"]
    gqa = argparse.Namespace(**{**vars(ours), "group_query_attention": True,
                                "num_query_groups": 2, "kv_channels": 32})
    assert mlm.architecture_diff(gqa, ours) == [
        "--num-query-groups 2 (this run: 4)", "--kv-channels 32 (this run: 16)"]
    assert mlm.architecture_diff(argparse.Namespace(), ours) == []   # not recorded: not compared


def test_settings_that_change_what_the_model_computes_are_compared() -> None:
    """Same tensors, another function: RoPE's base / percent / scaling, the norm epsilon
    (Megatron-LM's norm_epsilon, our layernorm_epsilon), the activation -- a Llama-3 checkpoint
    without --rotary-base 500000 must not load."""
    from megatron.training.arguments import parse_args

    ours = parse_args(TINY + ["--position-embedding-type", "rope"])
    theirs = argparse.Namespace(position_embedding_type="rope", rotary_base=500000,
                                rotary_percent=0.5, rotary_interleaved=True,
                                use_rope_scaling=True, rope_scaling_factor=8.0,
                                norm_epsilon=1e-6, openai_gelu=True, squared_relu=False,
                                swiglu=False)
    assert mlm.architecture_diff(theirs, ours) == [
        "--rotary-base 500000 (this run: 10000)", "--rotary-percent 0.5 (this run: 1.0)",
        "--rotary-interleaved (not supported here) True (this run: False)",
        "--use-rope-scaling True (this run: False)", "--norm-epsilon 1e-06 (this run: 1e-05)",
        "--openai-gelu True (this run: False)"]
    same = argparse.Namespace(position_embedding_type="rope", rotary_base=10000,
                              rotary_percent=1.0, rotary_interleaved=False,
                              use_rope_scaling=False, rope_scaling_factor=4.0,
                              norm_epsilon=1e-5, openai_gelu=False, squared_relu=True,
                              swiglu=False)
    assert mlm.architecture_diff(same, ours) == [   # the factor only matters with scaling on
        "--squared-relu (not supported here) True (this run: False)"]
    learned = argparse.Namespace(**{**vars(same), "squared_relu": False, "rotary_base": 500000})
    ours.position_embedding_type = "learned_absolute"
    learned.position_embedding_type = "learned_absolute"
    assert mlm.architecture_diff(learned, ours) == []   # no RoPE: its base does nothing


# ----------------------------------------------------------------------------- loading
def _build(tp: int):
    from megatron.training.arguments import parse_args
    from megatron.training.components import get_model, get_optimizer_and_scheduler
    from megatron.training.initialize import initialize_megatron
    from megatron.training.model.config_builders import build_transformer_config

    args = parse_args(TINY + ["--tensor-model-parallel-size", str(tp)])
    initialize_megatron(args)
    args.padded_vocab_size = 128
    model = get_model(args, build_transformer_config(args), 128)
    opt, sched = get_optimizer_and_scheduler(args, model)
    return args, model, opt, sched


def _megatron_lm_args(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    """What Megatron-LM keeps in a checkpoint's ``args`` (the fields this loader reads)."""
    fields = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "group_query_attention", "num_query_groups", "kv_channels", "padded_vocab_size",
              "swiglu", "normalization", "position_embedding_type", "add_bias_linear",
              "untie_embeddings_and_output_weights", "tensor_model_parallel_size",
              "pipeline_model_parallel_size")
    ns = argparse.Namespace(**{f: getattr(args, f) for f in fields})
    ns.consumed_train_samples, ns.consumed_valid_samples, ns.params_dtype = 56, 8, torch.bfloat16
    for k, v in changes.items():
        setattr(ns, k, v)
    return ns


def _write(iter_dir: Path, tp_rank: int, state: Dict[str, Any]) -> None:
    """Megatron-LM's file of one TP rank (pipeline size 1)."""
    d = iter_dir / mlm.rank_dir_name(tp_rank, 0, 1)
    d.mkdir(parents=True, exist_ok=True)
    torch.save(state, d / mlm.MODEL_FILE)


def _megatron_lm_state(model_sd: Dict[str, Any], args: argparse.Namespace, iteration: int,
                       schedule: Any = None, **arg_changes: Any) -> Dict[str, Any]:
    """Megatron-LM's file; ``schedule``: its ``opt_param_scheduler`` (left out when None)."""
    state = {"model": model_sd, "iteration": iteration, "checkpoint_version": 3.0,
             "args": _megatron_lm_args(args, **arg_changes),
             "optimizer": {"optimizer": {"state": {}}}, "rng_state": [{"random_rng_state": None}]}
    if schedule is not None:
        state["opt_param_scheduler"] = schedule
    return state


def _weights(model) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model[0].module.state_dict().items()
            if torch.is_tensor(v)}


def _loader(args, model, opt, sched):
    """load(path, **flags) -> {"iteration", "train_state", "equal" (to the source), "log"} or
    {"error"}; the model's weights are changed first, so only a load makes them equal."""
    from megatron.training.checkpoint import save_load

    def load(path: Path, source: Dict[str, torch.Tensor], finetune: bool = False,
             no_load_optim: bool = False, no_load_rng: bool = False) -> Dict[str, Any]:
        with torch.no_grad():
            for p in model[0].parameters():
                p.add_(1.0)
        args.load, args.finetune = str(path), finetune
        args.no_load_optim, args.no_load_rng = no_load_optim, no_load_rng
        sched.num_steps = 0   # a fresh scheduler, as in a run that loads
        sched.step(increment=0)
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):
                it, train_state = save_load.load_checkpoint(args, model, opt, sched)
        except StartupError as exc:
            return {"error": str(exc)}
        now = _weights(model)
        return {"iteration": it, "train_state": train_state, "log": log.getvalue(),
                "schedule_steps": sched.num_steps,
                "equal": sorted(now) == sorted(source) and
                all(torch.equal(now[k], source[k]) for k in now)}
    return load


def _tp2_job(rank: int, world: int, root: str) -> Dict[str, Any]:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    args, model, opt, sched = _build(tp=2)
    root_p = Path(root)
    source = _weights(model)
    sd = model[0].module.state_dict()

    def write(name: str, state: Dict[str, Any], folder: str = "iter_0000007",
              tracker: str = "7", ranks=(0, 1)) -> Path:
        if rank in ranks:
            _write(root_p / name / folder, rank, state)
        if rank == 0:
            (root_p / name / "latest_checkpointed_iteration.txt").write_text(tracker)
        torch.distributed.barrier()
        return root_p / name

    schedule = dict(sched.state_dict(), num_steps=48)   # Megatron-LM's: a plain dict
    ckpt = write("mlm", _megatron_lm_state(sd, args, 7, schedule))
    other_lr = write("mlm_other_lr", _megatron_lm_state(sd, args, 7, dict(schedule, max_lr=1e-4)))
    no_schedule = write("mlm_no_schedule", _megatron_lm_state(sd, args, 7))
    te_sd = {}
    for key, value in sd.items():
        layer, _, rest = key.partition(".layers.")
        i, _, name = rest.partition(".")
        te_sd[f"{layer}.layers.{i}.{TE_NAMES[name]}" if name in TE_NAMES else key] = value
        if key.endswith("linear_qkv._extra_state"):   # TE's: an empty buffer without FP8
            te_sd[key] = io.BytesIO()
            te_sd[key.replace("linear_qkv", "core_attention")] = io.BytesIO(b"fp8 meta")
    te_release = write("mlm_te", _megatron_lm_state(te_sd, args, 0), "release", "release")
    missing = {k: v for k, v in sd.items() if k != "decoder.final_layernorm.bias"}
    missing["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.zeros(16)
    bad_keys = write("mlm_keys", _megatron_lm_state(missing, args, 7))
    ambiguous = dict(sd)
    ambiguous["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"] = torch.zeros(64)
    bad_names = write("mlm_ambiguous", _megatron_lm_state(ambiguous, args, 7))
    bad_arch = write("mlm_arch", _megatron_lm_state(sd, args, 7, hidden_size=128))
    chunked = _megatron_lm_state(sd, args, 7)
    chunked["model0"] = chunked["model1"] = chunked.pop("model")
    vpp = write("mlm_vpp", chunked)
    tp1 = write("mlm_tp1", _megatron_lm_state(sd, args, 7), ranks=(0,))
    if rank == 0:
        _megatron_lm_layout(root_p / "mlm_pp2" / "iter_0000007", tp=2, pp=2)
        (root_p / "mlm_pp2" / "latest_checkpointed_iteration.txt").write_text("7")
    torch.distributed.barrier()

    load = _loader(args, model, opt, sched)
    return {
        "finetune": load(ckpt, source, finetune=True),
        "continue": load(ckpt, source, no_load_optim=True, no_load_rng=True),
        "other_lr": load(other_lr, source, no_load_optim=True, no_load_rng=True),
        "no_schedule": load(no_schedule, source, no_load_optim=True, no_load_rng=True),
        "no_flags": load(ckpt, source),
        "only_no_load_optim": load(ckpt, source, no_load_optim=True),
        "te_release": load(te_release, source),
        "keys": load(bad_keys, source, finetune=True),
        "ambiguous": load(bad_names, source, finetune=True),
        "arch": load(bad_arch, source, finetune=True),
        "vpp": load(vpp, source, finetune=True),
        "tp1": load(tp1, source, finetune=True),
        "pp2": load(root_p / "mlm_pp2", source, finetune=True),
    }


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> Dict[str, Any]:
    root = tmp_path_factory.mktemp("mlm_tp2")
    (root / "out").mkdir()
    results = run_distributed(2, _tp2_job, root / "out", str(root))
    return {"root": root, "results": results}


def test_megatron_lm_layout_tp2_loads_the_weights_exactly(tp2) -> None:
    for r in tp2["results"]:
        assert (r["finetune"]["iteration"], r["finetune"]["train_state"],
                r["finetune"]["equal"]) == (0, {}, True), r["finetune"]
        cont = r["continue"]
        assert (cont["iteration"], cont["train_state"], cont["equal"]) == (
            7, {"consumed_train_samples": 56, "consumed_valid_samples": 8}, True), cont
    log = tp2["results"][0]["finetune"]["log"]
    ckpt = tp2["root"] / "mlm" / "iter_0000007"
    assert (f" > checkpoint {ckpt} was written by Megatron-LM, not by this trainer: it has no "
            "manifest.json, so its files are loaded without digest verification") in log
    assert (f" > loaded the model weights of {ckpt} (Megatron-LM's torch layout, TP=2, PP=1, "
            "checkpoint_version 3.0; --finetune: iteration 0)") in log


def test_continuing_at_its_iteration_continues_its_schedule(tp2) -> None:
    """--no-load-optim --no-load-rng keeps the iteration, and so the schedule's position: the
    checkpoint's opt_param_scheduler (checked as ours is), or this run's schedule advanced to
    the consumed samples when it has none -- never warmup and decay from step 0."""
    for r in tp2["results"]:
        assert r["continue"]["schedule_steps"] == 48, r["continue"]
        assert r["no_schedule"]["schedule_steps"] == 56, r["no_schedule"]
        assert r["no_schedule"]["iteration"] == 7
        err = r["other_lr"].get("error", "")
        assert "\n" not in err and "--lr 0.003 (checkpoint: 0.0001)" in err, r["other_lr"]
        assert "--override-opt_param-scheduler" in err
    log = tp2["results"][0]
    assert ("iteration 7, optimizer and RNG freshly initialized, learning-rate schedule "
            "continued at the checkpoint's consumed samples (next line))") in log["continue"]["log"]
    assert (" > learning-rate schedule: the checkpoint's, continued from the checkpoint's "
            "scheduler state at 48 samples") in log["continue"]["log"]
    assert (" > learning-rate schedule: the checkpoint has no scheduler state; this run's "
            "schedule continues at the checkpoint's 56 consumed samples") \
        in log["no_schedule"]["log"]


def test_without_finetune_or_no_load_flags_it_is_refused_in_one_line(tp2) -> None:
    ckpt = tp2["root"] / "mlm" / "iter_0000007"
    expected = (f"checkpoint {ckpt} is in Megatron-LM's torch layout (mp_rank_XX/"
                "model_optim_rng.pt): its optimizer and RNG states are Megatron-LM's and are not "
                "read by this trainer. Load its model weights with --finetune (training starts "
                "at iteration 0) or with --no-load-optim --no-load-rng (training continues at "
                "iteration 7)")
    for r in tp2["results"]:
        assert r["no_flags"] == {"error": expected}
        assert r["only_no_load_optim"] == {"error": expected}


def test_release_with_transformer_engine_names_loads_as_finetune(tp2) -> None:
    for r in tp2["results"]:
        rel = r["te_release"]
        assert (rel.get("iteration"), rel.get("train_state"), rel.get("equal")) == (
            0, {}, True), rel
    assert ("a release checkpoint: iteration 0, as with --finetune); 2 Transformer Engine "
            "_extra_state entr(ies) (FP8 scaling state) left out: this run's layers have none; "
            "8 Transformer Engine layer-norm name(s) mapped to this run's spec") \
        in tp2["results"][0]["te_release"]["log"]


@pytest.mark.parametrize("case, expected", [
    ("keys", "does not fit this run's model: 1 tensor(s) of this run's model are not in it "
             "(decoder.final_layernorm.bias); 1 tensor(s) of it are not in this run's model "
             "(decoder.layers.0.self_attention.q_layernorm.weight) (in mp_rank_0{r}/"
             "model_optim_rng.pt, entry 'model')"),
    ("ambiguous", "does not fit this run's model: both decoder.layers.1.input_layernorm.weight "
                  "and decoder.layers.1.self_attention.linear_qkv.layer_norm_weight name "
                  "decoder.layers.1.input_layernorm.weight"),
    ("arch", "holds another model: --hidden-size 128 (this run: 64)"),
    ("vpp", "holds 2 model chunk(s) (model0, model1: virtual pipeline stages), this run has 1"),
    ("tp1", "was written with --tensor-model-parallel-size 1 (this run: 2): it loads only into "
            "the same TP/PP layout. Run with that layout, or convert it with Megatron-LM's "
            "tools/checkpoint/convert.py --target-tensor-parallel-size 2 "
            "--target-pipeline-parallel-size 1"),
    ("pp2", "was written with --pipeline-model-parallel-size 2 (this run: 1)"),
])
def test_what_does_not_fit_is_refused_in_one_line(tp2, case, expected) -> None:
    for rank, r in enumerate(tp2["results"]):
        msg = r[case].get("error", "")
        assert "\n" not in msg and expected.format(r=0) in msg, \
            (case, r[case])
        assert msg.startswith("checkpoint ") and "(Megatron-LM's torch layout)" in msg


# ----------------------------------------------------------------------------- TP=1, DP=2
class Unpicklable:
    """An object of a module the loading process does not have (Megatron-LM's own classes in
    its saved args)."""


def _tp1_job(rank: int, world: int, root: str) -> Dict[str, Any]:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    from megatron.training.checkpoint import save_load

    args, model, opt, sched = _build(tp=1)
    root_p = Path(root)
    source = _weights(model)
    # Megatron-LM's args hold objects of its own modules: a module only the writer has.
    gone = types.ModuleType("megatron_lm_only")
    Unpicklable.__module__ = gone.__name__
    gone.Unpicklable = Unpicklable
    sys.modules[gone.__name__] = gone
    state = _megatron_lm_state(model[0].module.state_dict(), args, 3)
    state["args"].tokenizer_state = Unpicklable()
    if rank == 0:   # one file for both data-parallel ranks
        _write(root_p / "mlm" / "iter_0000003", 0, state)
        (root_p / "mlm" / "latest_checkpointed_iteration.txt").write_text("3")
    del sys.modules[gone.__name__]
    torch.distributed.barrier()
    # our own formats, renamed into a release checkpoint (weights only, as a converter saves)
    releases, args.no_save_optim = {}, True
    for fmt in ("torch", "torch_dist"):
        args.save, args.ckpt_format = os.path.join(root, fmt), fmt
        save_load.save_checkpoint(args, 5, model, opt, sched, {"consumed_train_samples": 20})
        if rank == 0:
            os.rename(os.path.join(root, fmt, "iter_0000005"), os.path.join(root, fmt, "release"))
            (root_p / fmt / "latest_checkpointed_iteration.txt").write_text("release")
        releases[fmt] = root_p / fmt
    args.save = None
    # Megatron-LM's torch_dist: megatron-core's files, its args an argparse.Namespace
    from megatron.training.checkpoint.torch_dist_format import _dist_checkpointing

    mlm_dist = root_p / "mlm_dist"
    if rank == 0:
        (mlm_dist / "iter_0000003").mkdir(parents=True)
        (mlm_dist / "latest_checkpointed_iteration.txt").write_text("3")
    torch.distributed.barrier()
    _dist_checkpointing().save({"model": model[0].module.sharded_state_dict(), "iteration": 3,
                                "args": _megatron_lm_args(args), "checkpoint_version": 3.0,
                                "opt_param_scheduler": dict(sched.state_dict(), num_steps=24)},
                               str(mlm_dist / "iter_0000003"))
    torch.distributed.barrier()

    load = _loader(args, model, opt, sched)
    out = {"mlm": load(root_p / "mlm", source, finetune=True),
           "mlm_dist": load(mlm_dist, source, finetune=True),
           "mlm_dist_no_flags": load(mlm_dist, source),
           "mlm_dist_continue": load(mlm_dist, source, no_load_optim=True, no_load_rng=True)}
    out.update({fmt: load(path, source) for fmt, path in releases.items()})
    args.padded_vocab_size = 136   # another padding: refused before any tensor is read
    out.update({f"{fmt}_vocab": load(path, source) for fmt, path in releases.items()})
    args.padded_vocab_size = 128
    damaged = root_p / "torch" / "release" / "mp_rank_00_000_dp_001.pt"
    if rank == 0:
        os.truncate(damaged, damaged.stat().st_size // 2)
    torch.distributed.barrier()
    out["damaged_release"] = load(releases["torch"], source)
    return out


@pytest.fixture(scope="module")
def tp1(tmp_path_factory) -> Dict[str, Any]:
    root = tmp_path_factory.mktemp("mlm_tp1")
    (root / "out").mkdir()
    results = run_distributed(2, _tp1_job, root / "out", str(root))
    return {"root": root, "results": results}


def test_megatron_lm_layout_tp1_loads_on_every_data_parallel_rank(tp1) -> None:
    for r in tp1["results"]:
        assert (r["mlm"].get("iteration"), r["mlm"].get("equal")) == (0, True), r["mlm"]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_our_formats_in_a_release_folder_load_as_finetune(tp1, fmt) -> None:
    for r in tp1["results"]:
        assert (r[fmt].get("iteration"), r[fmt].get("train_state"), r[fmt].get("equal")) == (
            0, {}, True), r[fmt]
    log = tp1["results"][0][fmt]["log"]
    release = tp1["root"] / fmt / "release"
    assert f" > verified checkpoint {release}: " in log
    assert (f" > loaded the release checkpoint {release}: model weights only, training starts "
            "at iteration 0 (as with --finetune)") in log


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_another_padded_vocabulary_is_refused_naming_the_flags(tp1, fmt) -> None:
    release = tp1["root"] / fmt / "release"
    for r in tp1["results"]:
        assert r[f"{fmt}_vocab"] == {"error": (
            f"checkpoint {release} has a padded vocabulary of 128 rows, written with "
            "--make-vocab-size-divisible-by 8 and --tensor-model-parallel-size 1; this run pads "
            "to 136 rows (--make-vocab-size-divisible-by 8 x --tensor-model-parallel-size 1)")}


def test_megatron_lm_torch_dist_loads_its_weights_with_finetune(tp1) -> None:
    """Megatron-LM's torch_dist (megatron-core's files, its args a Namespace, no per-rank
    files of ours): its weights load (resharded as ours are), its schedule continues with
    --no-load-optim --no-load-rng, and without those or --finetune it is refused as the torch
    layout is."""
    ckpt = tp1["root"] / "mlm_dist" / "iter_0000003"
    for r in tp1["results"]:
        got = r["mlm_dist"]
        assert (got.get("iteration"), got.get("equal")) == (0, True), got
        assert r["mlm_dist_no_flags"] == {"error": (
            f"checkpoint {ckpt} is in Megatron-LM's torch_dist format: its optimizer and RNG "
            "states are Megatron-LM's and are not read by this trainer. Load its model weights "
            "with --finetune (training starts at iteration 0) or with --no-load-optim "
            "--no-load-rng (training continues at iteration 3)")}
        cont = r["mlm_dist_continue"]
        assert (cont.get("iteration"), cont.get("schedule_steps")) == (3, 24), cont
    log = tp1["results"][0]["mlm_dist"]["log"]
    assert f" > checkpoint {ckpt} was written by Megatron-LM, not by this trainer: it has no " \
        "manifest.json, so its files are loaded without digest verification" in log
    assert (f" > loaded the model weights of {ckpt} (Megatron-LM's torch_dist, written with "
            "TP=1, PP=1, resharded to this run's layout; iteration 0)") in log


def test_a_damaged_release_of_ours_is_still_refused(tp1) -> None:
    path = tp1["root"] / "torch" / "release" / "mp_rank_00_000_dp_001.pt"
    for r in tp1["results"]:
        msg = r["damaged_release"].get("error", "")
        assert f"checkpoint {path.parent} is damaged: {path} is truncated: " in msg, r


# ----------------------------------------------------------------------------- pretrain_gpt.py
CLI = ["--global-batch-size", "2", "--lr", "0.0", "--hidden-dropout", "0", "--attention-dropout",
       "0", "--eval-iters", "0", "--log-interval", "1"]


def _first_loss(path: Path) -> float:
    import json

    return next(r["lm_loss"] for r in map(json.loads, path.read_text().splitlines())
                if r["type"] == "train" and r["iteration"] == 1)


def test_pretrain_gpt_loads_a_converted_release_exactly(tmp_path: Path, run_pretrain) -> None:
    """End to end: the weights of a run (--lr 0: they stay the initial ones) written in
    Megatron-LM's layout as a release checkpoint give a run with another initialization the
    same first loss on the same batch. (The refusals are the same lines in-process: above.)"""
    ours = tmp_path / "ours"
    res = run_pretrain(CLI + ["--train-iters", "1", "--save", str(ours), "--save-interval", "1",
                              "--no-save-optim", "--jsonl-log", str(tmp_path / "a.jsonl")],
                       nproc=1)
    assert res.returncode == 0, res.stderr[-3000:]
    saved = torch.load(ours / "iter_0000001" / "mp_rank_00_000_dp_000.pt", weights_only=False)
    mlm_root = tmp_path / "mlm"
    (mlm_root / "release" / "mp_rank_00").mkdir(parents=True)
    torch.save({"model": saved["model"][0], "iteration": 0, "checkpoint_version": 3.0,
                "args": argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4,
                                           padded_vocab_size=128)},
               mlm_root / "release" / "mp_rank_00" / mlm.MODEL_FILE)
    (mlm_root / "latest_checkpointed_iteration.txt").write_text("release")
    res = run_pretrain(CLI + ["--train-iters", "1", "--init-method-std", "0.05", "--load",
                              str(mlm_root), "--jsonl-log", str(tmp_path / "b.jsonl")], nproc=1)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "loaded without digest verification" in res.stdout
    assert f" > loaded the model weights of {mlm_root / 'release'}" in res.stdout
    assert _first_loss(tmp_path / "b.jsonl") == _first_loss(tmp_path / "a.jsonl")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
