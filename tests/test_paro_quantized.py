"""SDP4Bit's full feature set on a PaRO strategy with globally partitioned optimizer states.

Why these tests: the PaRO engine used to carry its own quantized reduce-scatter, weight gather,
seeding and byte counter, without LoCo, the start iteration or the NaN/Inf skip. It now calls the
model's :class:`~megatron.distributed.quant.runtime.QuantizationRuntime`, the object
megatron-core's bucket groups use, so each feature must work there too. On 4 gloo ranks laid out
as 2 groups x 2 (NIG: parameters and gradients replicated, optimizer states partitioned over all
ranks, so the boundary reduce-scatter is the two-level TLq), one spawned job trains the same tiny
GPT:

* exact NIG, and NIG with TLq-HS + LoCo + qWD: the quantized run tracks the exact one
  (:data:`QUANT_RTOL`), keeps LoCo error buffers, sends 4-bit codes on the inter-node link, and
  every rank reconstructs bit-identical weights;
* the same without the Hadamard transform trains differently (TLq-HS really ran);
* ``--gradients-quantization-start-iteration 3``: the first two updates are bit-identical to the
  exact run, the third is not;
* ``--quantization-error-interval 2``: the run is bit-identical to the unmonitored one and reports
  the relative error / cosine of the quantized gradients and weights;
* a NaN injected into one rank's gradient: the step is skipped on every rank (reason 'nan',
  optimizer state unchanged, LoCo buffers dropped, one agreed non-finite event), and the next
  step trains;
* ``--overlap-grad-reduce`` (NIG, NGG) and ``--overlap-param-gather`` (GGG): the engine's
  reduce-scatters and parameter gathers on the communication stages (worker threads, and fake
  CUDA streams under the allocation check) give the inline path's numbers bit for bit.
"""

from __future__ import annotations

import contextlib
import os
from functools import partial
from typing import Any, Dict, List

import pytest
import torch

from dist_harness import run_distributed
from tools.paro_strategy_table import synthetic_batches

WORLD, GROUP = 4, 2
STEPS, MICRO, MBS, SEQ, VOCAB = 4, 2, 2, 32, 128
QUANT_RTOL = 1e-2
"""Quantized vs exact per-step loss over 4 steps of the tiny model (TLq-HS 8/4-bit gradients,
4-bit qWD weights, LoCo). Measured 2026-11-24: at most 8.3e-4 relative (step 4); a broken
reduction (wrong layout, a missing shard) is off by far more."""

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
        "--micro-batch-size", str(MBS), "--global-batch-size", str(MBS * WORLD * MICRO),
        "--train-iters", "10", "--lr", "3e-3", "--mock-data", "--vocab-size", str(VOCAB),
        "--make-vocab-size-divisible-by", "8", "--device", "cpu", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--paro-group-size", str(GROUP), "--paro-strategy", "NIG",
        "--clip-grad", "1.0", "--data-parallel-intra-node-size", str(GROUP)]
SDP4BIT = ["--quantized-gradients", "--quantized-weights", "--hadamard-transform",
           "--gq-group-size-inter", "128"]
RUNS = {
    "exact": [],
    "sdp4bit_loco": SDP4BIT + ["--loco"],
    "no_hadamard_loco": ["--quantized-gradients", "--quantized-weights", "--loco"],
    "start3": ["--quantized-gradients", "--gradients-quantization-start-iteration", "3"],
    "monitor2": SDP4BIT + ["--loco", "--quantization-error-interval", "2"],
    # --overlap-grad-reduce: the per-bucket gradient reduce-scatters on the communication stages
    # (g = I: intra scope; NGG, g = G: the two-level one), bit-identical to the inline path
    "exact_overlap": ["--overlap-grad-reduce"],
    "sdp4bit_loco_overlap": SDP4BIT + ["--loco", "--overlap-grad-reduce"],
    "ngg_exact": ["--paro-strategy", "NGG"],
    "ngg_exact_overlap": ["--paro-strategy", "NGG", "--overlap-grad-reduce"],
    "ngg_sdp4bit_loco": ["--paro-strategy", "NGG"] + SDP4BIT + ["--loco"],
    "ngg_sdp4bit_loco_overlap": ["--paro-strategy", "NGG"] + SDP4BIT + ["--loco",
                                                                        "--overlap-grad-reduce"],
    "ngg_monitor2_overlap": ["--paro-strategy", "NGG"] + SDP4BIT + [
        "--loco", "--overlap-grad-reduce", "--quantization-error-interval", "2"],
    # --overlap-param-gather (p = G): the hooks' parameter gathers on the weights stage, one
    # bucket ahead, bit-identical to the inline gathers
    "ggg_sdp4bit_loco": ["--paro-strategy", "GGG"] + SDP4BIT + ["--loco"],
    "ggg_sdp4bit_loco_overlap": ["--paro-strategy", "GGG", "--use-distributed-optimizer"]
    + SDP4BIT + ["--loco", "--overlap-grad-reduce", "--overlap-param-gather"],
}
FAKE_CUDA_RUNS = {"ngg_exact_overlap_fake_cuda": "ngg_exact_overlap",
                  "ngg_sdp4bit_loco_overlap_fake_cuda": "ngg_sdp4bit_loco_overlap",
                  "ggg_sdp4bit_loco_overlap_fake_cuda": "ggg_sdp4bit_loco_overlap"}
"""The same runs with the stages on CUDA streams: the fake ``torch.cuda`` of fake_cuda.py over
CPU tensors, under its allocation check (no GPU here)."""


def _build(args):
    from megatron.training.model.config_builders import build_transformer_config
    from megatron.training.initialize import set_random_seed
    from megatron.training.components import (configure_schedule, get_model,
                                                       get_optimizer_and_scheduler)

    set_random_seed(1234, "cpu")
    config = build_transformer_config(args)
    args.padded_vocab_size = VOCAB
    model = get_model(args, config, VOCAB)
    opt, sched = get_optimizer_and_scheduler(args, model)
    configure_schedule(args, config, model, opt)
    return model, opt, sched


def _step(args, model, opt, sched, rank: int, step: int):
    from megatron.distributed.quant import integration
    from megatron.training.step import forward_step, train_step

    integration.set_iteration(model, step + 1)  # as the training loop does (1-based)
    it = synthetic_batches(rank, step, 1, micro=MICRO, mbs=MBS, seq=SEQ, vocab=VOCAB)
    return train_step(args, partial(forward_step, args), it, model, opt, sched,
                      torch.device("cpu"))


@contextlib.contextmanager
def _fake_cuda_stages(on: bool):
    """With ``on``: every stage the engine creates is a (fake) CUDA stream, and the allocation
    check watches which stage allocates and reads what; yields the check (None when off)."""
    if not on:
        yield None
        return
    from fake_cuda import FakeCuda, StreamAllocationCheck
    from megatron.distributed.quant import streams as streams_mod

    mp = pytest.MonkeyPatch()
    fake = FakeCuda()
    fake.install(mp, names=iter(lambda: "stage", None))
    original_stage = streams_mod._CudaStage.__init__

    def named_stage(self, name, device):   # the fake stream carries its stage's name
        original_stage(self, name, device)
        self.stream.name = name
    mp.setattr(streams_mod._CudaStage, "__init__", named_stage)
    mp.setattr(streams_mod.CommStreams, "for_device",
               classmethod(lambda cls, device: cls("cuda", torch.device("cuda", 0))))
    check = StreamAllocationCheck(fake)
    try:
        with check:
            yield check
    finally:
        mp.undo()


def _worker(rank: int, world: int) -> Dict[str, Any]:
    import torch.distributed as dist

    from megatron.distributed.quant import integration
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_megatron

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    first = True
    out: Dict[str, Any] = {}
    for label, extra in [*RUNS.items(), *((k, RUNS[v]) for k, v in FAKE_CUDA_RUNS.items())]:
        args = parse_args(TINY + extra)
        if first:
            initialize_megatron(args)
            first = False
        with _fake_cuda_stages(label in FAKE_CUDA_RUNS) as check:
            model, opt, sched = _build(args)
            losses: List[float] = []
            for step in range(STEPS):
                loss, ok, _, _ = _step(args, model, opt, sched, rank, step)
                assert ok, (label, step)
                losses.append(loss)
        reduction = getattr(model[0], "grad_reduction", None)   # PaRO engine chunks only
        gathering = getattr(model[0], "param_gathers", None)
        stages = None if reduction is None else reduction.stages
        gathers = None if gathering is None else gathering.stages
        res: Dict[str, Any] = {"losses": losses, "engine": type(model[0]).__name__,
                               "grad_stages": None if stages is None else stages.kind,
                               "param_stages": None if gathers is None else gathers.kind,
                               "params": model[0].param_level_storage().detach().clone(),
                               "hazards": None if check is None else check.hazards()}
        rt = getattr(model[0], "quant_runtime", None)
        if rt is not None:
            report = integration.communication_report(model, totals=True)
            res["report"] = {k: v for k, v in report.items()
                             if k.startswith(("grad_inter", "weight_total", "nonfinite"))}
            res["loco_bytes"] = rt.loco.memory_bytes() if rt.loco is not None else None
            interval = integration.communication_report(model)
            res["errors"] = {k: v for k, v in interval.items() if k.startswith("quant_error_")}
            res["comm_ms"] = {k: v for k, v in interval.items() if k.startswith("comm_")}
            buf = model[0].param_level_storage().detach().float()
            digest = torch.tensor([float(buf.double().sum()), float((buf.double() ** 2).sum())],
                                  dtype=torch.float64)
            everyone = [torch.zeros_like(digest) for _ in range(world)]
            dist.all_gather(everyone, digest)
            res["replicas_identical"] = all(torch.equal(d, everyone[0]) for d in everyone)
        if label == "sdp4bit_loco":
            # A NaN in one parameter's gradient on rank 3 only.
            handle = None
            if rank == 3:
                param = next(p for p in model[0].module.parameters() if p.dim() == 2)
                handle = param.register_hook(lambda g: torch.full_like(g, float("nan")))
            master = opt.master.detach().clone()
            loss, ok, _, reason = _step(args, model, opt, sched, rank, STEPS)
            if handle is not None:
                handle.remove()
            res["nan_step"] = {"ok": ok, "reason": reason,
                               "master_unchanged": torch.equal(master, opt.master.detach()),
                               "loco_bytes_after": rt.loco.memory_bytes(),
                               "events": rt.nonfinite_events}
            loss, ok, _, _ = _step(args, model, opt, sched, rank, STEPS + 1)
            res["after_nan"] = {"ok": ok, "loss": loss}
        out[label] = res
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> List[Dict[str, Any]]:
    return run_distributed(WORLD, _worker, tmp_path_factory.mktemp("paro_quant"))


def test_sdp4bit_with_loco_trains_on_nig(results):
    exact = results[0]["exact"]["losses"]
    for r in results:
        got = r["sdp4bit_loco"]
        assert got["engine"] == "ParoDataParallel"
        assert got["losses"] != exact  # the quantized path really ran
        for a, b in zip(got["losses"], exact):
            assert a == pytest.approx(b, rel=QUANT_RTOL), (got["losses"], exact)
        assert got["loco_bytes"] > 0  # LoCo keeps error buffers for the engine's buckets
        # 4-bit codes (+ scales) on the inter-node link, 4-bit qWD weights: far below 32 bits.
        assert got["report"]["grad_inter_bits_per_element"] < 6
        assert got["report"]["weight_total_bytes"] > 0
        assert got["replicas_identical"]
    assert all(r["sdp4bit_loco"]["losses"] == results[0]["sdp4bit_loco"]["losses"] for r in results)


def test_the_engines_quantized_collectives_are_timed(results):
    """The engine's quantized collectives ran on an untimed runner: every comm_*_ms read 0.000.
    Now the inline ones count as exposed time and the overlapped ones as stage time; a kind this
    layer does not send (megatron-core's exact gathers with --quantized-gradients alone) has no
    figure rather than a 0 that reads as free."""
    for r in results:
        inline, overlapped = r["sdp4bit_loco"]["comm_ms"], r["ngg_sdp4bit_loco_overlap"]["comm_ms"]
        assert inline["comm_grad_exposed_ms"] > 0 and inline["comm_weight_exposed_ms"] > 0, inline
        assert overlapped["comm_grad_intra_ms"] + overlapped["comm_grad_inter_ms"] > 0, overlapped
        grads_only = r["start3"]["comm_ms"]
        assert grads_only and not any(k.startswith("comm_weight") for k in grads_only), grads_only


def test_hadamard_changes_the_quantized_run(results):
    for r in results:
        assert r["no_hadamard_loco"]["losses"] != r["sdp4bit_loco"]["losses"]
        assert r["no_hadamard_loco"]["losses"][0] == r["exact"]["losses"][0]  # same start


def test_start_iteration_keeps_the_first_updates_exact(results):
    for r in results:
        got, exact = r["start3"]["losses"], r["exact"]["losses"]
        assert got[:3] == exact[:3]  # iterations 1, 2 reduce exactly (bit-identical)
        assert got[3] != exact[3]    # iteration 3's update was quantized


def test_nan_on_one_rank_skips_the_step_everywhere(results):
    for r in results:
        nan = r["sdp4bit_loco"]["nan_step"]
        assert nan == {"ok": False, "reason": "nan", "master_unchanged": True,
                       "loco_bytes_after": 0, "events": 1}, nan
        after = r["sdp4bit_loco"]["after_nan"]
        assert after["ok"] and after["loss"] == after["loss"]  # finite again


def test_error_monitor_on_the_engine(results):
    """Bounds as in tests/test_overlap_numerics.py: a few percent measured, a broken comparison
    gives ~1.4 or more."""
    for r in results:
        assert r["monitor2"]["losses"] == r["sdp4bit_loco"]["losses"]  # monitoring changes nothing
        errors = r["monitor2"]["errors"]
        assert 0.0 < errors["quant_error_grad_rel"] < 0.5, errors
        assert errors["quant_error_grad_cos"] > 0.9, errors
        assert 0.0 < errors["quant_error_weight_rel"] < 0.5, errors
        assert r["sdp4bit_loco"]["errors"] == {}


@pytest.mark.parametrize("inline,overlapped", [
    ("exact", "exact_overlap"), ("sdp4bit_loco", "sdp4bit_loco_overlap"),
    ("ngg_exact", "ngg_exact_overlap"), ("ngg_sdp4bit_loco", "ngg_sdp4bit_loco_overlap"),
    ("ggg_sdp4bit_loco", "ggg_sdp4bit_loco_overlap")])
def test_overlapped_gradient_reduces_are_bit_identical(results, inline: str, overlapped: str):
    """Issue 25 item 9: with --overlap-grad-reduce the engine's gradient reduce-scatters run on
    the communication stages (worker threads here) over their own communicators while backward
    goes on; losses and parameters equal the inline path's bit for bit."""
    for r in results:
        assert r[inline]["grad_stages"] is None and r[overlapped]["grad_stages"] == "thread"
        assert r[overlapped]["losses"] == r[inline]["losses"]
        assert torch.equal(r[overlapped]["params"], r[inline]["params"])
        # parameters partitioned (GGG) and --overlap-param-gather: the gathers on a stage too
        assert r[overlapped]["param_stages"] == ("thread" if inline.startswith("ggg") else None)
    assert results[0]["ngg_sdp4bit_loco"]["losses"] != results[0]["ngg_exact"]["losses"]


def test_monitoring_iterations_do_not_change_overlapped_runs(results):
    """--quantization-error-interval runs every second iteration's collectives inline (LoCo's
    errors are then made on the compute stream and replaced on the stage the next iteration:
    their hand-over is tests/test_cuda_stream_lifetimes.py's); the losses are the unmonitored
    run's."""
    for r in results:
        assert r["ngg_monitor2_overlap"]["losses"] == r["ngg_sdp4bit_loco_overlap"]["losses"]


@pytest.mark.parametrize("fake,real", sorted(FAKE_CUDA_RUNS.items()))
def test_overlapped_gradient_reduces_on_cuda_stages(results, fake: str, real: str):
    """The engine's overlapped path with CUDA stages (fake torch.cuda, CPU tensors): the same
    numbers as the worker-thread stages, and no tensor allocated on one stage is read by another
    without ``record_stream``."""
    for r in results:
        assert r[fake]["grad_stages"] == "cuda" and r[real]["grad_stages"] == "thread"
        assert r[fake]["param_stages"] == ("cuda" if real.startswith("ggg") else None)
        assert r[fake]["losses"] == r[real]["losses"]
        assert torch.equal(r[fake]["params"], r[real]["params"])
        assert r[fake]["hazards"] == []
