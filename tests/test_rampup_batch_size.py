"""``--rampup-batch-size`` (with ``--train-samples``) and ``--calculate-per-token-loss`` on two
gloo ranks.

Ramp-up: every step takes megatron-core's current global batch size -- the micro-batches of the
step, the samples the resumable sampler hands out, the consumed samples and the schedule's
increment -- and a run interrupted during the ramp-up resumes bit-exactly.  Per-token loss: the
gradient is the global batch's token mean's, the same however the batch is split into
micro-batches (the default, a mean per micro-batch, is not when their token counts differ); on
the quantized path too, the division by the token count follows the summing reduce-scatter.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List

import pytest

from dist_harness import run_distributed

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "8",
        "--device", "cpu", "--eval-iters", "0", "--log-interval", "1", "--lr", "1e-3"]
RAMPUP = ["--global-batch-size", "12", "--rampup-batch-size", "4", "4", "16",
          "--train-samples", "64", "--lr-warmup-samples", "8"]


def _worker(rank: int, world: int, tmp: str) -> Dict[str, List[Dict]]:
    from megatron.core import parallel_state

    from megatron.training.arguments import parse_args
    from megatron.training.pretrain import pretrain

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))

    def run(name: str, argv: List[str]) -> List[Dict]:
        log = Path(tmp) / f"{name}.jsonl"
        args = parse_args(TINY + ["--jsonl-log", str(log)] + argv)
        try:
            pretrain(args)
        finally:
            parallel_state.destroy_model_parallel()
        if rank:
            return []
        return [r for r in map(json.loads, log.read_text().splitlines()) if r["type"] == "train"]

    ckpt = str(Path(tmp) / "ckpt")
    out = {"full": run("full", RAMPUP),
           "first": run("first", RAMPUP + ["--save", ckpt, "--exit-interval", "3"]),
           "resumed": run("resumed", RAMPUP + ["--load", ckpt])}
    # one step of the same 8 samples, split into 1 or 4 micro-batches per rank; documents'
    # EOD tokens masked, so micro-batches hold different numbers of loss tokens
    one_step = ["--global-batch-size", "8", "--train-iters", "1", "--clip-grad", "0",
                "--eod-mask-loss", "--hidden-dropout", "0", "--attention-dropout", "0"]
    for name, extra in (("mean_mbs1", ["--micro-batch-size", "1"]),
                        ("mean_mbs4", ["--micro-batch-size", "4"]),
                        ("per_token_mbs1", ["--micro-batch-size", "1", "--calculate-per-token-loss"]),
                        ("per_token_mbs4", ["--micro-batch-size", "4", "--calculate-per-token-loss"]),
                        ("mean_q4", ["--use-distributed-optimizer", "--quantized-gradients"]),
                        ("per_token_q4", ["--use-distributed-optimizer", "--quantized-gradients",
                                          "--calculate-per-token-loss"])):
        out[name] = run(name, one_step + extra)
    return out


def test_rampup_and_per_token_loss(tmp_path: Path) -> None:
    res = run_distributed(2, _worker, tmp_path, str(tmp_path), trace=False)
    assert all("__error__" not in r for r in res), [r.get("__error__") for r in res]
    out = res[0]
    full, first, resumed = out["full"], out["first"], out["resumed"]

    # START 4 + INCR 4 every 8 samples of the first 16, then 12: 7 steps for 64 samples
    assert [r["global_batch_size"] for r in full] == [4, 4, 8, 12, 12, 12, 12]
    assert [r["consumed_samples"] for r in full] == [4, 8, 16, 28, 40, 52, 64]
    # the schedule advanced by each step's batch: warmup over 8 samples, then linear to 0 at 64
    want = [1e-3 * c / 8 if c <= 8 else 1e-3 * (1 - (c - 8) / 56)
            for c in (r["consumed_samples"] for r in full)]
    assert [r["lr"] for r in full] == pytest.approx(want, rel=1e-9, abs=1e-15)
    # tokens/s and TFLOP/s are of the step's own batch, not of --global-batch-size's 12
    for r in full:
        seconds = r["ms_per_iteration"] / 1000.0
        assert r["tokens_per_s"] * seconds == pytest.approx(r["global_batch_size"] * 32, rel=1e-9)
    flops = [r["tflops_per_gpu"] * r["ms_per_iteration"] / r["global_batch_size"] for r in full]
    assert flops == pytest.approx([flops[0]] * len(full), rel=1e-9)

    # interrupted at iteration 3 (inside the ramp-up) and resumed: the same steps, bit-exact
    assert [r["iteration"] for r in first] == [1, 2, 3]
    assert [r["iteration"] for r in resumed] == [4, 5, 6, 7]
    key = lambda r: (r["iteration"], r["global_batch_size"], r["consumed_samples"],  # noqa: E731
                     r["lm_loss"], r["lr"], r["grad_norm"])
    assert [key(r) for r in first + resumed] == [key(r) for r in full]

    # per-token loss: the gradient of the global batch's token mean, however it is split into
    # micro-batches; the default (a mean per micro-batch, averaged) depends on the split
    step = {name: out[name][0] for name in out if name.startswith(("mean", "per_token"))}
    assert step["per_token_mbs1"]["grad_norm"] == pytest.approx(step["per_token_mbs4"]["grad_norm"],
                                                                rel=1e-5)
    assert step["mean_mbs1"]["grad_norm"] != pytest.approx(step["mean_mbs4"]["grad_norm"],
                                                           rel=1e-4)   # ~9e-4 apart here
    for r in step.values():   # the logged loss is the token mean either way
        assert r["lm_loss"] == pytest.approx(step["mean_mbs4"]["lm_loss"], rel=1e-5)
    # the quantized reduce-scatter sums, and the division by the token count follows it
    assert step["per_token_q4"]["grad_norm"] == pytest.approx(step["mean_q4"]["grad_norm"],
                                                              rel=0.05)


def test_a_missing_batch_size_calculator_is_an_error(monkeypatch) -> None:
    """The loop's batch size is the calculator's: without one it stops, naming the setup step,
    rather than counting --global-batch-size samples a ramp-up step did not run."""
    from megatron.training.arguments import parse_args
    from megatron.training.step import current_global_batch_size

    def no_calculator() -> int:
        raise AttributeError("'NoneType' object has no attribute 'get_current_global_batch_size'")

    monkeypatch.setattr(
        "megatron.core.num_microbatches_calculator.get_current_global_batch_size", no_calculator)
    with pytest.raises(RuntimeError, match=r"no num-microbatches calculator .*"
                                           r"--global-batch-size 12.*init_num_microbatches"):
        current_global_batch_size(parse_args(TINY + RAMPUP))


@pytest.mark.parametrize("train_samples, iterations", [
    (64, 7), (28, 4), (27, 3), (16, 3), (12, 2), (10, 2)])
def test_sample_based_iterations_fit_in_train_samples(monkeypatch, train_samples: int,
                                                      iterations: int) -> None:
    """The steps --train-samples gives (ramp-up batches 4, 4, 8, then 12) consume at most
    --train-samples -- the training split's size -- and a step ending exactly on it counts; one
    more step would not fit."""
    from megatron.core.num_microbatches_calculator import \
        RampupBatchsizeNumMicroBatchesCalculator

    from megatron.training.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = TINY + ["--global-batch-size", "12", "--rampup-batch-size", "4", "4", "16",
                   "--train-samples", str(train_samples)]
    args = parse_args(argv)
    assert args.train_iters == iterations
    calc = RampupBatchsizeNumMicroBatchesCalculator(12, 2, 1, False, -1, 4, 4, 16)
    consumed = 0
    for _ in range(args.train_iters + 1):
        calc.update(consumed, consistency_check=False)
        consumed += calc.get_current_global_batch_size()
        if _ < args.train_iters:
            assert consumed <= train_samples
    assert consumed > train_samples
