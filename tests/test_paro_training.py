"""PaRO strategies train: every effective strategy reproduces ZeRO-1, with the modelled memory and bytes.

Why these tests: the PaRO engine (megatron/distributed/quant/paro/engine.py) re-implements data
parallelism -- parameter gathers and releases, per-micro-step gradient reduce-scatters, the
boundary sync and the optimizer -- so each strategy could silently train something else, keep
more memory than the strategy promises or move other bytes than the startup report says. On 4
gloo ranks laid out as 2 groups x 2 (so I and G differ and both links carry traffic), one spawned
job builds the same tiny GPT once per strategy and checks, against megatron-core's
DDP + DistributedOptimizer (NNG):

* per-step losses and grad norms (fp32: rel 1e-6; bf16: 1e-4, see FP32_RTOL / BF16_RTOL);
* the persistent model-state bytes per rank, measured from the storages of the resident
  tensors, equal ``paro.cost.model_state_memory`` for the padded parameter count (the sum of the
  separately padded buckets);
* the bytes counted on the intra / inter links in one step equal ``paro.cost.communication_volume``;
* gathers, releases and gradient reduce-scatters are per bucket: the peak parameter + gradient
  bytes stay within the persistent bytes plus one bucket in use (plus the tied-embedding bucket),
  well below DDP's full parameters + gradients for IIG / GGG;
* with SDP4Bit's quantized collectives inside the groups (TLq gradients, qWD weights), the bytes
  equal the model's quantized bytes and training tracks the exact run.
"""

from __future__ import annotations

import dataclasses
import os
from functools import partial
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from dist_harness import run_distributed
from megatron.distributed.quant.paro import cost as paro_cost
from megatron.distributed.quant.paro.cost import StateBytes, communication_volume, model_state_memory
from megatron.distributed.quant.paro.strategy import VALID_STRATEGIES
from tools.paro_strategy_table import synthetic_batches

WORLD, GROUP = 4, 2
STEPS, MICRO = 3, 2
MBS, SEQ, VOCAB = 2, 32, 128
FP32_RTOL = 1e-6
"""fp32: strategies differ from ZeRO-1 only in summation order (hierarchical vs flat reductions,
reduce per micro-step vs accumulate first). Measured: <= 1.3e-8 relative over 3 steps."""
BF16_RTOL = 1e-4
"""bf16: the same order differences, but the updated fp32 master is rounded to bf16 (8 bits of
mantissa) before the next forward, so a tiny fp32 difference can flip a bf16 rounding and move the
loss by ~1e-5. Measured: identical losses over 3 steps."""

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
        "--micro-batch-size", str(MBS), "--global-batch-size", str(MBS * WORLD * MICRO),
        "--train-iters", "10", "--lr", "3e-3", "--mock-data", "--vocab-size", str(VOCAB),
        "--make-vocab-size-divisible-by", "8", "--device", "cpu", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--paro-group-size", str(GROUP), "--weight-decay", "0.1",
        "--clip-grad", "1.0", "--paro-strategy", "NNG", "--use-distributed-optimizer"]


def _batches(rank: int, first_step: int, steps: int):
    """Deterministic synthetic micro-batches of this DP rank (same for every strategy)."""
    return synthetic_batches(rank, first_step, steps, micro=MICRO, mbs=MBS, seq=SEQ, vocab=VOCAB)


def _setup(rank: int, world: int, extra: List[str]):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_megatron

    args = parse_args(TINY + extra)
    initialize_megatron(args)
    return args


BUCKET_CAP = 20_000
"""Bucket-size cap (elements) of the fp32 strategy runs: the 2-layer model's transformer layers
(49,984 elements each) are split into attention / MLP pieces, so a bucket is a small part of the
model. The bf16, quantized, SGD and resume runs use the default (one bucket per layer)."""


def _build(args, strategy: str, engine: bool, seed: int = 1234, bucket_numel=None):
    """Model, optimizer and scheduler of ``strategy``, from the same seed as every other build."""
    from megatron.core.transformer.module import Float16Module
    from megatron.distributed.quant import integration
    from megatron.training.model.config_builders import build_ddp_config, build_transformer_config
    from megatron.training.initialize import set_random_seed
    from megatron.training.components import (configure_schedule, get_model,
                                                       get_optimizer_and_scheduler,
                                                       model_provider)

    set_random_seed(seed, "cpu")
    args.paro_strategy = strategy
    args.use_distributed_optimizer = strategy == "NNG" and not engine
    config = build_transformer_config(args)
    vocab = args.padded_vocab_size = 128
    if engine:  # force the engine even for NNN / NNG, to measure it
        chunk = model_provider(args, config, vocab, True, True)
        if args.bf16:
            chunk = Float16Module(config, chunk)
        ddp_config = build_ddp_config(args)
        if bucket_numel is not None:  # the engine's bucket-size cap (None: one per layer)
            ddp_config.bucket_size = bucket_numel
        model = integration.wrap_model(config, ddp_config, [chunk], args.quant_config,
                                       strategy=strategy, group_size=args.paro_group_size,
                                       engine=True)
    else:
        model = get_model(args, config, vocab)
    opt, sched = get_optimizer_and_scheduler(args, model)
    configure_schedule(args, config, model, opt)
    return model, opt, sched


def _train(args, model, opt, sched, first_step: int, steps: int, rank: int,
           measure: bool = False) -> Dict[str, Any]:
    from megatron.distributed.quant.paro.engine import ParoDataParallel
    from megatron.distributed.quant.paro.optimizer import model_state_bytes
    from megatron.training.step import forward_step, train_step

    it = _batches(rank, first_step, steps)
    out: Dict[str, Any] = {"losses": [], "norms": []}
    for step in range(steps):
        engine = model[0] if isinstance(model[0], ParoDataParallel) else None
        if engine is not None:
            engine.counter.reset()
        loss, ok, norm, _ = train_step(args, partial(forward_step, args), it, model, opt,
                                       sched, torch.device("cpu"))
        assert ok
        out["losses"].append(loss)
        out["norms"].append(norm)
        if engine is not None and measure and step == steps - 1:
            out["bytes"] = dict(engine.counter.bytes)
            out["memory"] = model_state_bytes(engine, opt)
            # Partitioned parameters really are released between steps.
            out["param_storage_bytes"] = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                                              for p in engine.module.parameters()}.values())
            out["peak"] = engine.peak_bytes
            out["padded_numel"] = engine.padded_numel
            out["num_params"] = engine.num_params
            out["buckets"] = engine.bucket_bytes()
    return out


# The quantized runs are engine runs (_build sets the strategy): parsed with an engine strategy,
# since fp32 quantized weights are refused on megatron-core's optimizer (no separate fp32 master).
RUN_FLAGS = {"fp32": [], "bf16": ["--bf16"],
             "qgw": ["--quantized-gradients", "--quantized-weights", "--paro-strategy", "IIG"],
             "qw": ["--quantized-weights", "--paro-strategy", "IIG"], "sgd": ["--optimizer", "sgd"]}


def _strategies_worker(rank: int, world: int, runs: List[tuple]) -> Dict[str, Any]:
    """One job, every strategy: runs = [(label, strategy, engine, flags key of RUN_FLAGS)]."""
    args32 = _setup(rank, world, [])
    from megatron.training.arguments import parse_args

    all_args = {k: (args32 if not v else parse_args(TINY + v)) for k, v in RUN_FLAGS.items()}
    res = {}
    for label, strategy, engine, kind in runs:
        args = all_args[kind]
        cap = BUCKET_CAP if (engine and kind == "fp32") else None
        model, opt, sched = _build(args, strategy, engine, bucket_numel=cap)
        res[label] = _train(args, model, opt, sched, 0, STEPS, rank, measure=engine)
    # auto: with room for only ~0.6 MB of model states per rank, ZeRO-1 does not fit.
    # (the PaRO settings live in the run's config, read once from the flags at validation)
    args32.paro_strategy, args32.paro_gpu_memory_gb = "auto", 0.0006
    paro = dataclasses.replace(args32.quant_config.paro, strategy="auto", gpu_memory_gb=0.0006)
    args32.quant_config = dataclasses.replace(args32.quant_config, paro=paro)
    from megatron.training.model.config_builders import build_transformer_config
    from megatron.training.initialize import set_random_seed
    from megatron.training.components import (configure_schedule, get_model,
                                                       get_optimizer_and_scheduler)
    from megatron.training.step import optimizer_step

    set_random_seed(1234, "cpu")
    config = build_transformer_config(args32)
    model = get_model(args32, config, 128)
    opt, sched = get_optimizer_and_scheduler(args32, model)
    configure_schedule(args32, config, model, opt)
    res["auto"] = {"chosen": args32.paro_strategy, "engine": type(model[0]).__name__,
                   "num_params": sum(p.numel() for p in model[0].module.parameters()),
                   **_train(args32, model, opt, sched, 0, 1, rank)}
    # A non-finite local gradient on one rank: the boundary sync spreads it, and the trainer's
    # optimizer_step must skip the step on every rank.
    engine = model[0]
    before = (opt.master.detach().clone(), engine.param_level_storage().clone())
    engine.zero_grad_buffer()
    if rank == 3:
        (engine.grad_buffer if engine.grad_buffer is not None else engine.grad_shard)[0] = float("nan")
    engine.finalize_model_grads()
    ok, norm, reason = optimizer_step(opt)
    res["nan_step"] = {"ok": ok, "reason": reason, "unchanged":
                       torch.equal(before[0], opt.master.detach()) and
                       torch.equal(before[1], engine.param_level_storage())}
    return res


ENGINE = list(VALID_STRATEGIES)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> List[Dict[str, Any]]:
    runs = [("core:NNG", "NNG", False, "fp32")] + [(s, s, True, "fp32") for s in ENGINE]
    runs += [("core:NNG:bf16", "NNG", False, "bf16")] + [
        (f"{s}:bf16", s, True, "bf16") for s in ("NIG", "IIG", "GGG")]
    runs += [("core:NNN:sgd", "NNN", False, "sgd"), ("IIG:sgd", "IIG", True, "sgd")]
    runs += [(f"{s}:qgw", s, True, "qgw") for s in QUANT_GRADS]
    runs += [(f"{s}:qw", s, True, "qw") for s in QUANT_WEIGHTS_ONLY]
    return run_distributed(WORLD, _strategies_worker, tmp_path_factory.mktemp("paro"), runs)


QUANT_GRADS = [s for s in VALID_STRATEGIES if s[2] == "G"]
"""Quantized gradients need every gradient collective to be a reduce-scatter (os = G)."""
QUANT_WEIGHTS_ONLY = ["NNI", "NII"]
"""Their post-step sync is an intra all-gather (I -> N); gradients stay exact."""
QUANT_RTOL = 5e-3
"""8/4-bit gradients and 4-bit weight differences, stochastic rounding: 3 steps stay within 0.5%
of the exact run (measured: see docs/paro.md)."""


def _close(a: List[float], b: List[float], rtol: float) -> bool:
    return all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b)) and len(a) == len(b)


@pytest.mark.parametrize("strategy", ENGINE)
def test_strategy_trains_like_zero1(results, strategy):
    ref = results[0]["core:NNG"]
    got = results[0][strategy]
    assert ref["losses"][-1] < ref["losses"][0]  # it learns at all
    assert _close(got["losses"], ref["losses"], FP32_RTOL), (strategy, got["losses"], ref["losses"])
    assert _close(got["norms"], ref["norms"], FP32_RTOL), (strategy, got["norms"], ref["norms"])
    for r in results[1:]:  # losses are DP-reduced: identical on every rank
        assert r[strategy]["losses"] == got["losses"]


@pytest.mark.parametrize("strategy", ["NIG", "IIG", "GGG"])
def test_bf16_strategies_track_zero1(results, strategy):
    ref = results[0]["core:NNG:bf16"]["losses"]
    got = results[0][f"{strategy}:bf16"]["losses"]
    assert _close(got, ref, BF16_RTOL), (strategy, got, ref)


def test_sgd_with_momentum_tracks_ddp(results):
    """megatron-core's distributed optimizer is Adam-only: SGD is checked against its plain DDP."""
    ref, got = results[0]["core:NNN:sgd"], results[0]["IIG:sgd"]
    assert _close(got["losses"], ref["losses"], FP32_RTOL), (got["losses"], ref["losses"])
    assert _close(got["norms"], ref["norms"], FP32_RTOL)


def _check_peak(got: Dict[str, Any], strategy: str) -> None:
    """Granular gathers / reduce-scatters: the peak parameter + gradient bytes stay within the
    persistent bytes plus one bucket in use (its full parameters for p = I / G, its temporary full
    gradient for g = I / G) plus the full parameters of buckets kept gathered across the forward or
    backward pass (several owners: the tied word-embedding / output weight)."""
    buckets = got["buckets"]
    persistent = got["memory"]["params"] + got["memory"]["grads"]
    pinned = sum(b["params"] for b in buckets if b["owners"] > 1)
    largest = max(b["params"] + b["grads"] for b in buckets)
    if strategy[:2] == "NN":
        assert got["peak"] == persistent
    else:
        assert persistent < got["peak"] <= persistent + pinned + largest, (got["peak"], persistent,
                                                                           pinned, largest)


@pytest.mark.parametrize("strategy", ENGINE)
def test_measured_memory_follows_paro_formula(results, strategy):
    for rank, r in enumerate(results):
        got = r[strategy]
        S, buckets = got["padded_numel"], got["buckets"]
        # Each bucket padded on its own, only to a multiple of n.
        assert S == sum(b["size"] for b in buckets) and all(b["size"] % WORLD == 0 for b in buckets)
        assert 0 <= S - got["num_params"] < WORLD * len(buckets)
        assert len(buckets) > 5  # granular: not one whole-model bucket
        want = model_state_memory(strategy, S, WORLD, GROUP,
                                  state_bytes=StateBytes(param=4, grad=4, optim=12))
        assert got["memory"]["params"] == want.params, (rank, got["memory"], want)
        assert got["memory"]["grads"] == want.grads, (rank, got["memory"], want)
        assert got["memory"]["optimizer_states"] == want.optimizer_states
        released = strategy[0] != "N"
        assert (got["param_storage_bytes"] == 0) == released
        _check_peak(got, strategy)
        if strategy[0] != "N" and strategy[1] != "N":  # e.g. IIG, GGG: well below DDP's p + g
            assert got["peak"] < 0.75 * S * (4 + 4), (got["peak"], S * 8)


@pytest.mark.parametrize("strategy", ENGINE)
def test_measured_bytes_match_report(results, strategy):
    for r in results:
        got = r[strategy]
        want = communication_volume(strategy, got["padded_numel"], WORLD, GROUP,
                                    micro_steps=MICRO, state_bytes=StateBytes(param=4, grad=4))
        assert got["bytes"]["intra"] == pytest.approx(want.intra, rel=1e-12), (strategy, got["bytes"])
        assert got["bytes"]["inter"] == pytest.approx(want.inter, rel=1e-12), (strategy, got["bytes"])


@pytest.mark.parametrize("label", [f"{s}:qgw" for s in QUANT_GRADS] + [f"{s}:qw" for s in QUANT_WEIGHTS_ONLY])
def test_quantized_collectives_inside_groups(results, label):
    """SDP4Bit's TLq / qWD inside the PaRO groups: training tracks the exact run, the link bytes
    are the cost model's quantized bytes (codes + fp32 scales), memory still follows the formula."""
    from megatron.distributed.quant.config import QuantizationConfig

    strategy, kind = label.split(":")
    cfg = QuantizationConfig(quantized_gradients=kind == "qgw", quantized_weights=True)
    exact = results[0][strategy]["losses"]
    for r in results:
        got = r[label]
        assert _close(got["losses"], exact, QUANT_RTOL), (label, got["losses"], exact)
        assert got["losses"] != exact  # the quantized path really ran
        S = got["padded_numel"]
        assert S % (WORLD * 2048) == 0  # whole weight groups in every shard
        want = communication_volume(strategy, S, WORLD, GROUP, micro_steps=MICRO,
                                    state_bytes=StateBytes(param=4, grad=4), quant_config=cfg)
        assert got["bytes"]["intra"] == pytest.approx(want.intra, rel=1e-12), (label, got["bytes"], want)
        assert got["bytes"]["inter"] == pytest.approx(want.inter, rel=1e-12), (label, got["bytes"], want)
        exact_vol = communication_volume(strategy, S, WORLD, GROUP, micro_steps=MICRO,
                                         state_bytes=StateBytes(param=4, grad=4))
        assert got["bytes"]["intra"] + got["bytes"]["inter"] < exact_vol.intra + exact_vol.inter
        mem = model_state_memory(strategy, S, WORLD, GROUP, state_bytes=StateBytes(4, 4, 12))
        assert got["memory"]["total"] == mem.total
        _check_peak(got, strategy)  # default layout: one bucket per transformer layer


def test_auto_picks_what_the_model_says(results):
    got = results[0]["auto"]
    want = paro_cost.choose_strategy_auto(
        got["num_params"], WORLD, GROUP, 0.0006e9, 150e9, 12.5e9, micro_steps=MICRO,
        state_bytes=StateBytes(param=4, grad=4, optim=12))
    assert got["chosen"] == want.strategy.name
    assert got["chosen"] not in ("NNN", "NNG") and got["engine"] == "ParoDataParallel"
    assert all(r["auto"]["chosen"] == got["chosen"] for r in results)
    assert got["losses"][0] == pytest.approx(results[0]["core:NNG"]["losses"][0], rel=FP32_RTOL)


def test_non_finite_gradient_skips_the_step_everywhere(results):
    for r in results:
        assert r["nan_step"] == {"ok": False, "reason": "nan", "unchanged": True}


# ------------------------------------------------------------------------------------------------
# resume
# ------------------------------------------------------------------------------------------------

def _resume_worker(rank: int, world: int, root: str) -> Dict[str, Any]:
    from megatron.training.checkpoint import save_load as checkpointing

    from megatron.training.arguments import parse_args

    plain = _setup(rank, world, [])
    quant = parse_args(TINY + RUN_FLAGS["qgw"])
    out = {}
    for label, strategy, args in (("NIG", "NIG", plain), ("IIG", "IIG", plain),
                                  ("IIG:qgw", "IIG", quant)):
        model, opt, sched = _build(args, strategy, True)
        full = _train(args, model, opt, sched, 0, 4, rank)["losses"]
        model, opt, sched = _build(args, strategy, True)
        first = _train(args, model, opt, sched, 0, 2, rank)["losses"]
        args.save = os.path.join(root, label.replace(":", "_"))
        checkpointing.save_checkpoint(args, 2, model, opt, sched, {"consumed_train_samples": 2})
        model, opt, sched = _build(args, strategy, True, seed=999)  # other weights: load must win
        args.load = args.save
        it, _ = checkpointing.load_checkpoint(args, model, opt, sched)
        rest = _train(args, model, opt, sched, 2, 2, rank)["losses"]
        args.save = args.load = None
        out[label] = {"full": full, "resumed": first + rest, "iteration": it}
    return out


def test_resume_reproduces_uninterrupted_run(tmp_path: Path):
    (tmp_path / "out").mkdir()
    results = run_distributed(WORLD, _resume_worker, tmp_path / "out", str(tmp_path))
    for label in ("NIG", "IIG", "IIG:qgw"):  # IIG:qgw also restores the stochastic-rounding RNG
        r = results[0][label]
        assert r["iteration"] == 2
        assert r["resumed"] == r["full"], (label, r)  # bit-exact
    assert sorted(p.name for p in (tmp_path / "IIG" / "iter_0000002").iterdir()) == [
        "checkpoint_writer.json", "manifest.json",
        *(f"mp_rank_00_000_dp_{d:03d}.pt" for d in range(WORLD))]


# ------------------------------------------------------------------------------------------------
# flags
# ------------------------------------------------------------------------------------------------

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
        "--mock-data", "--vocab-size", "128"]


def _validated(monkeypatch, *extra, world: int = 4):
    from megatron.training.arguments import parse_args
    from megatron.training.arguments.validation import validate_args

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return validate_args(parse_args(BASE + list(extra), validate=False))


@pytest.mark.parametrize("strategy", ENGINE)
def test_every_effective_strategy_is_accepted(monkeypatch, strategy):
    extra = ["--use-distributed-optimizer"] if strategy == "NNG" else []
    args = _validated(monkeypatch, "--paro-strategy", strategy.lower(), "--paro-group-size", "2",
                      *extra)
    assert args.paro_strategy == strategy and args.paro_group_size == 2


def test_auto_and_rejections(monkeypatch):
    from megatron.training.arguments.validation import ArgumentError

    assert _validated(monkeypatch, "--paro-strategy", "auto").paro_strategy == "auto"
    assert _validated(monkeypatch, "--paro-strategy", "NIG").paro_group_size == 4  # one group
    with pytest.raises(ArgumentError, match="less finely than parameters"):
        _validated(monkeypatch, "--paro-strategy", "GNI")
    with pytest.raises(ArgumentError, match="does not divide"):
        _validated(monkeypatch, "--paro-strategy", "NIG", "--paro-group-size", "3")
    with pytest.raises(ArgumentError, match="not --fp16"):
        _validated(monkeypatch, "--paro-strategy", "IIG", "--fp16")
    with pytest.raises(ArgumentError, match="needs --tensor-model-parallel-size 1"):
        _validated(monkeypatch, "--paro-strategy", "NIG", "--tensor-model-parallel-size", "2")
    assert _validated(monkeypatch, "--paro-strategy", "GGG", "--use-distributed-optimizer",
                      "--overlap-grad-reduce", "--overlap-param-gather").overlap_param_gather
    with pytest.raises(ArgumentError, match="p = N.*drop --overlap-param-gather"):
        _validated(monkeypatch, "--paro-strategy", "NIG", "--use-distributed-optimizer",
                   "--overlap-grad-reduce", "--overlap-param-gather")
    with pytest.raises(ArgumentError, match="drop --overlap-param-gather-with-optimizer-step"):
        _validated(monkeypatch, "--paro-strategy", "GGG", "--use-distributed-optimizer",
                   "--overlap-grad-reduce", "--overlap-param-gather",
                   "--overlap-param-gather-with-optimizer-step")
    assert _validated(monkeypatch, "--paro-strategy", "GGG",
                      "--overlap-grad-reduce").overlap_grad_reduce
    assert _validated(monkeypatch, "--paro-strategy", "NIG", "--quantized-gradients",
                      "--quantized-weights").quant_config.enabled
    with pytest.raises(ArgumentError, match="is an all-reduce, which has no quantized collective"):
        _validated(monkeypatch, "--paro-strategy", "NII", "--quantized-gradients")
    loco = _validated(monkeypatch, "--paro-strategy", "NIG", "--quantized-gradients", "--loco",
                      "--gradients-quantization-start-iteration", "3").quant_config
    assert loco.loco and loco.gradients_quantization_start_iteration == 3  # the shared runtime's
    with pytest.raises(ArgumentError, match="direct: the per-micro-step parameter gathers"):
        _validated(monkeypatch, "--paro-strategy", "IIG", "--quantized-weights",
                   "--weight-quantization-mode", "direct")
    with pytest.raises(ArgumentError, match="auto cannot be combined with quantized"):
        _validated(monkeypatch, "--paro-strategy", "auto", "--use-distributed-optimizer",
                   "--quantized-weights")


def test_engine_rejects_fp16_optimizer():
    from types import SimpleNamespace

    from megatron.distributed.quant.paro.optimizer import ParoOptimizer

    with pytest.raises(NotImplementedError, match="not fp16"):
        ParoOptimizer(SimpleNamespace(), SimpleNamespace(fp16=True, optimizer="adam"))


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------

def test_pretrain_gpt_nig_four_ranks(run_pretrain, tmp_path):
    """``pretrain_gpt.py --paro-strategy NIG --paro-group-size 2`` on 4 CPU ranks, bf16: loss falls
    and the logged link bytes are the report's."""
    import json
    import re

    jsonl = tmp_path / "log.jsonl"

    res = run_pretrain(["--global-batch-size", "16", "--train-iters", "12", "--lr", "3e-3",
                        "--bf16", "--paro-strategy", "NIG", "--paro-group-size", "2",
                        "--log-interval", "4", "--eval-interval", "100", "--eval-iters", "1",
                        "--jsonl-log", str(jsonl)],
                       nproc=4, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "PaRO strategy NIG: n=4 ranks, m=2 per group, g=2 groups" in res.stdout
    # The log line keeps Megatron-LM's fields; the engine's bytes are in the jsonl records.
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    rows = [(r["lm_loss"], r["paro_intra_bytes"], r["paro_inter_bytes"])
            for r in records if r["type"] == "train"]
    assert len(rows) == 3, res.stdout[-3000:]
    losses = [float(r[0]) for r in rows]
    assert losses[-1] < losses[0] - 0.5, losses
    n_params = int(re.search(r"model parallel rank \(0, 0\): (\d+)", res.stdout).group(1))
    S = -(-n_params // 4) * 4
    want = communication_volume("NIG", S, 4, 2, micro_steps=2, state_bytes=StateBytes(param=2, grad=4))
    for _, intra, inter in rows:  # 4 iterations per log line
        assert float(intra) == pytest.approx(4 * want.intra)
        assert float(inter) == pytest.approx(4 * want.inter)
    # The summary carries the run's totals (12 iterations; printed with 5 significant digits).
    total = re.search(r"training summary .*\| paro_intra_bytes: ([\d.E+-]+) \| "
                      r"paro_inter_bytes: ([\d.E+-]+) \|", res.stdout)
    assert total, res.stdout[-2000:]
    assert float(total.group(1)) == pytest.approx(12 * want.intra, rel=1e-4)
    assert float(total.group(2)) == pytest.approx(12 * want.inter, rel=1e-4)
