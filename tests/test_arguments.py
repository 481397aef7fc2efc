"""Flags: every Megatron-LM flag we promise parses and lands in args; bad combinations fail
with a message that names the fix; --dry-run prints the configs and exits 0.

Why: launch scripts written for Megatron-LM must keep working, and a misconfigured job should
die at parse time with a clear reason instead of deep inside megatron-core.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from megatron.training.arguments import parse_args
from megatron.training.arguments.parser import build_parser
from megatron.training.arguments.validation import ArgumentError, validate_args

REPO = Path(__file__).resolve().parent.parent
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
        "--mock-data", "--device", "cpu"]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")


def test_every_listed_flag_parses_and_acts(tmp_path: Path) -> None:
    argv = BASE + [
        "--ffn-hidden-size", "96", "--max-position-embeddings", "64",
        "--lr-decay-iters", "8", "--lr-decay-style", "cosine", "--min-lr", "1e-5",
        "--adam-beta1", "0.8", "--adam-beta2", "0.95", "--adam-eps", "1e-6",
        "--weight-decay", "0.1", "--lr-warmup-fraction", "0.1", "--clip-grad", "0.5",
        "--loss-scale", "128", "--initial-loss-scale", "1024", "--loss-scale-window", "50",
        "--hysteresis", "3", "--min-loss-scale", "2", "--bf16", "--use-distributed-optimizer",
        "--overlap-grad-reduce", "--overlap-param-gather",
        "--accumulate-allreduce-grads-in-fp32", "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "1", "--global-batch-size", "8",
        "--vocab-size", "300", "--split", "90,5,5", "--log-interval", "3",
        "--timing-log-level", "2", "--save-interval", "5", "--eval-interval", "4",
        "--eval-iters", "2", "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
        "--log-throughput", "--tensorboard-dir", str(tmp_path / "tb"),
        "--tensorboard-log-interval", "2", "--wandb-project", "", "--wandb-save-dir", "w",
        "--wandb-exp-name", "x", "--recompute-activations", "--distributed-backend", "gloo",
        "--save", str(tmp_path / "s"), "--load", str(tmp_path / "l"), "--no-load-optim",
        "--no-load-rng", "--exit-duration-in-mins", "5", "--exit-interval", "7", "--seed", "7",
        "--no-async-tensor-model-parallel-allreduce", "--normalization", "RMSNorm", "--swiglu",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--disable-bias-linear", "--attention-dropout", "0.2", "--hidden-dropout", "0.3",
        "--init-method-std", "0.01", "--make-vocab-size-divisible-by", "64", "--log-loss-scale",
        "--jsonl-log", str(tmp_path / "m.jsonl"), "--tokenizer-type", "NullTokenizer"]
    a = parse_args(argv)
    assert (a.ffn_hidden_size, a.max_position_embeddings, a.lr_decay_iters) == (96, 64, 8)
    assert (a.adam_beta1, a.adam_beta2, a.adam_eps, a.weight_decay) == (0.8, 0.95, 1e-6, 0.1)
    assert (a.loss_scale, a.initial_loss_scale, a.loss_scale_window, a.hysteresis,
            a.min_loss_scale) == (128, 1024, 50, 3, 2)
    assert a.bf16 and a.use_distributed_optimizer and a.overlap_param_gather
    assert a.accumulate_allreduce_grads_in_fp32
    assert a.recompute_granularity == "selective"
    assert (a.normalization, a.swiglu, a.position_embedding_type) == ("RMSNorm", True, "rope")
    assert a.untie_embeddings_and_output_weights and a.add_bias_linear is False
    assert (a.attention_dropout, a.hidden_dropout, a.init_method_std) == (0.2, 0.3, 0.01)
    assert a.data_parallel_size == 1 and a.global_batch_size == 8
    assert a.quant_config.enabled is False and a.seed == 7 and a.exit_interval == 7

    from megatron.training.model.config_builders import (build_ddp_config, build_optimizer_config,
                                                   build_transformer_config)

    tc = build_transformer_config(a)
    assert tc.gated_linear_unit and tc.normalization == "RMSNorm" and not tc.add_bias_linear
    assert tc.ffn_hidden_size == 96 and tc.recompute_granularity == "selective"
    ddp = build_ddp_config(a)
    assert ddp.grad_reduce_in_fp32 and ddp.overlap_param_gather and ddp.use_distributed_optimizer
    oc = build_optimizer_config(a)
    assert (oc.clip_grad, oc.adam_beta2, oc.loss_scale) == (0.5, 0.95, 128)


def test_bf16_accumulates_in_fp32_unless_asked() -> None:
    assert parse_args(BASE + ["--bf16"]).accumulate_allreduce_grads_in_fp32 is True
    a = parse_args(BASE + ["--bf16", "--grad-accum-dtype", "bf16"])
    assert a.accumulate_allreduce_grads_in_fp32 is False
    assert parse_args(BASE).accumulate_allreduce_grads_in_fp32 is False


def test_quantization_config_built_from_args() -> None:
    a = parse_args(BASE + ["--use-distributed-optimizer", "--quantized-grad-bits", "4",
                           "--quantized-weights", "--bf16"])
    assert a.quant_config.quantized_gradients and a.quant_config.quantized_weights
    assert a.quant_config.gradient_quantization_bits_inter == 4


@pytest.mark.parametrize("extra,message", [
    (["--quantized-weights"], "needs --use-distributed-optimizer"),
    (["--quantized-grad-bits", "4"], "needs --use-distributed-optimizer"),
    (["--bf16", "--fp16"], "mutually exclusive"),
    (["--openai-gelu", "--swiglu"], "--openai-gelu and --swiglu are mutually exclusive"),
    (["--global-batch-size", "5"], "must be divisible by --micro-batch-size"),
    (["--overlap-param-gather", "--overlap-grad-reduce"], "needs --use-distributed-optimizer"),
    # fp32 parameters: megatron-core's optimizer has no separate master copy to quantize against
    (["--quantized-weights", "--use-distributed-optimizer"],
     "--quantized-weights needs --bf16 (or --fp16) on megatron-core's distributed optimizer"),
    (["--overlap-param-gather-with-optimizer-step", "--use-distributed-optimizer"],
     "--overlap-param-gather-with-optimizer-step needs --overlap-param-gather"),
    (["--loco", "--use-distributed-optimizer"],
     "--loco acts only with --quantized-gradients (or --quantized-grad-bits N)"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], "only one of"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/nonexistent/vocab.json",
      "--merge-file", "/nonexistent/merges.txt"], "does not exist"),
    (["--save-interval", "5"], "needs --save"),
    # accepted and ignored before: documents still attended to each other
    (["--reset-attention-mask"], "--reset-attention-mask is not supported"),
])
def test_bad_combinations_fail_clearly(extra: List[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(BASE + extra)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("extra,flags,switch", [
    (["--hadamard-transform"], "--hadamard-transform", "--quantized-gradients"),
    (["--gradient-quantization-bits-intra", "4"], "--gradient-quantization-bits-intra",
     "--quantized-gradients"),
    (["--gradient-quantization-bits-inter", "2"], "--gradient-quantization-bits-inter",
     "--quantized-gradients"),
    (["--gq-group-size-intra", "256"], "--gq-group-size-intra", "--quantized-gradients"),
    (["--gq-group-size-inter", "64"], "--gq-group-size-inter", "--quantized-gradients"),
    (["--gradients-quantization-start-iteration", "5"], "--gradients-quantization-start-iteration",
     "--quantized-gradients"),
    (["--loco"], "--loco", "--quantized-gradients"),
    (["--quantized-weights", "--loco"], "--loco", "--quantized-gradients"),
    (["--quantized-gradients", "--loco-error-beta", "0.5"], "--loco-error-beta", "--loco"),
    (["--quantized-gradients", "--loco-reset-interval", "10"], "--loco-reset-interval", "--loco"),
    (["--quantized-gradients", "--loco-error-bits", "32"], "--loco-error-bits", "--loco"),
    (["--quantized-gradients", "--hadamard-block-size", "16"], "--hadamard-block-size",
     "--hadamard-transform"),
    (["--weight-quantization-bits", "8"], "--weight-quantization-bits", "--quantized-weights"),
    (["--quantized-gradients", "--wq-group-size", "1024"], "--wq-group-size",
     "--quantized-weights"),
    (["--weight-quantization-mode", "direct"], "--weight-quantization-mode",
     "--quantized-weights"),
    (["--no-stochastic-rounding"], "--no-stochastic-rounding", "--quantized-weights or "),
    (["--quantization-error-interval", "5"], "--quantization-error-interval",
     "--quantized-weights or "),
    # Given explicitly counts, even with the default value (the user meant to configure it).
    (["--wq-group-size", "2048"], "--wq-group-size", "--quantized-weights"),
    (["--hadamard-transform", "--gq-group-size-inter", "64"],
     "--gq-group-size-inter, --hadamard-transform act only with", "--quantized-gradients"),
])
def test_sub_flag_without_its_switch_is_refused(extra: List[str], flags: str, switch: str) -> None:
    """A sub-flag whose path is off used to be accepted and silently do nothing (a 'TLq-HS' run
    that trained unquantized)."""
    args = parse_args(BASE + ["--use-distributed-optimizer"] + extra, validate=False)
    with pytest.raises(ArgumentError) as e:
        validate_args(args)
    assert flags in str(e.value) and switch in str(e.value), str(e.value)


@pytest.mark.parametrize("extra", [
    ["--quantized-gradients", "--hadamard-transform", "--hadamard-block-size", "16",
     "--gq-group-size-inter", "64", "--gradients-quantization-start-iteration", "3",
     "--loco", "--loco-error-beta", "0.5", "--no-stochastic-rounding"],
    ["--quantized-grad-bits", "4", "--gradient-quantization-bits-intra", "4"],
    ["--quantized-grad-bits", "4", "--gradient-quantization-bits-inter", "4"],
    ["--quantized-weights", "--weight-quantization-mode", "direct", "--weight-quantization-bits",
     "8", "--wq-group-size", "1024", "--no-stochastic-rounding", "--bf16"],
    ["--data-parallel-intra-node-size", "1", "--grad-accum-dtype", "fp32"],  # no switch needed
    ["--quantized-weights", "--quantization-error-interval", "10", "--bf16"],
])
def test_sub_flags_with_their_switch_are_accepted(extra: List[str]) -> None:
    a = parse_args(BASE + ["--use-distributed-optimizer"] + extra)
    assert a.explicit_flags and "use_distributed_optimizer" in a.explicit_flags


def test_short_form_contradicting_inter_bits_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--use-distributed-optimizer", "--quantized-grad-bits", "4",
                           "--gradient-quantization-bits-inter", "8"])
    assert "--quantized-grad-bits 4" in capsys.readouterr().err


def test_explicit_flags_are_the_given_ones() -> None:
    """parse_args records what was given (defaults excluded, default values given included);
    flags_given falls back to 'differs from the default' for other namespaces."""
    from megatron.training.arguments.parser import flags_given

    a = parse_args(BASE + ["--seed", "1234", "--use-distributed-optimizer"])
    assert {"seed", "use_distributed_optimizer", "num_layers"} <= flags_given(a)
    assert "wq_group_size" not in flags_given(a) and "bf16" not in flags_given(a)
    assert a.seed == 1234 and a.wq_group_size == 2048  # the real parse keeps the defaults
    ns = build_parser().parse_args(BASE + ["--seed", "1234", "--hadamard-transform"])
    assert "hadamard_transform" in flags_given(ns) and "seed" not in flags_given(ns)


@pytest.mark.parametrize("world,local,extra,intra,message", [
    ("4", None, ["--quantized-gradients"], "3",
     "--data-parallel-intra-node-size 3 does not divide the data-parallel size 4 (= world size 4 "
     "/ (--tensor-model-parallel-size 1 x --pipeline-model-parallel-size 1))"),
    # Stated explicitly it must fit whatever the path.
    ("4", None, [], "3", "--data-parallel-intra-node-size 3 does not divide the data-parallel size 4"),
    ("12", None, ["--quantized-weights", "--bf16", "--pipeline-model-parallel-size", "2",
                  "--num-layers", "4"],
     "4", "--data-parallel-intra-node-size 4 does not divide the data-parallel size 6 (= world size "
     "12 / (--tensor-model-parallel-size 1 x --pipeline-model-parallel-size 2))"),
    # The default comes from the launcher (LOCAL_WORLD_SIZE // TP).
    ("24", "8", ["--quantized-gradients", "--pipeline-model-parallel-size", "2"], None,
     "the intra-node data-parallel size 8 (LOCAL_WORLD_SIZE 8 // --tensor-model-parallel-size 1; "
     "set --data-parallel-intra-node-size to override) does not divide the data-parallel size 12"),
])
def test_intra_node_size_must_divide_dp_size(monkeypatch, world, local, extra, intra,
                                             message) -> None:
    """Was a ValueError traceback at model build, on every rank."""
    monkeypatch.setenv("WORLD_SIZE", world)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    base = BASE + ["--use-distributed-optimizer", "--global-batch-size", "48"] + extra
    bad = base + (["--data-parallel-intra-node-size", intra] if intra else [])
    with pytest.raises(ArgumentError) as e:
        validate_args(parse_args(bad, validate=False))
    assert message in str(e.value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", world)  # one node: the default fits
    assert validate_args(parse_args(base, validate=False)).data_parallel_size == int(world) // (
        2 if "--pipeline-model-parallel-size" in extra else 1)


@pytest.mark.parametrize("argv_extra", [["--no-such-flag"], ["--bf16", "--fp16"],
                                        ["--hadamard-transform"]])
def test_errors_are_printed_by_rank_0_only(monkeypatch, capsys, argv_extra) -> None:
    """Every rank parses the same line: rank 0 prints usage + message; other ranks exit with
    the same status and at most one short line (torchrun stops them first in practice)."""
    from megatron.training.arguments import parser

    monkeypatch.setattr(parser, "NONZERO_RANK_ERROR_GRACE_S", 0.0)
    with pytest.raises(SystemExit) as e:
        parse_args(BASE + argv_extra)
    err0 = capsys.readouterr().err
    assert e.value.code == 2 and err0.startswith("usage:") and "error:" in err0
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit) as e:
        parse_args(BASE + argv_extra)
    err3 = capsys.readouterr().err
    assert e.value.code == 2 and "usage" not in err3
    assert err3.count("\n") == 1 and "error (rank 3):" in err3
    assert err3.split("error (rank 3): ")[1] == err0.split("error: ")[-1]  # same message


def test_missing_data_source_is_an_error() -> None:
    argv = [x for x in BASE if x != "--mock-data"]
    args = build_parser().parse_args(argv)
    with pytest.raises(ArgumentError, match="--data-path.*--mock-data"):
        validate_args(args)
    args = build_parser().parse_args(argv + ["--data-path", "/nonexistent/prefix_text_document"])
    with pytest.raises(ArgumentError, match="does not exist"):
        validate_args(args)


def test_global_batch_checked_against_world_size(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    a = parse_args(BASE + ["--global-batch-size", "16"])
    assert a.data_parallel_size == 4
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--global-batch-size", "6"])
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--tensor-model-parallel-size", "3"])


def test_dry_run_prints_json_and_exits_zero() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore", WORLD_SIZE="1")
    res = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *BASE, "--bf16",
                          "--use-distributed-optimizer", "--quantized-grad-bits", "4",
                          "--swiglu", "--dry-run"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = {l.split(" ", 1)[0]: json.loads(l.split(" ", 1)[1])
           for l in res.stdout.splitlines() if l.startswith("DRY_RUN_")}
    assert out["DRY_RUN_ARGS"]["num_layers"] == 2 and out["DRY_RUN_ARGS"]["bf16"] is True
    assert out["DRY_RUN_QUANT"]["quantized_gradients"] is True
    assert out["DRY_RUN_QUANT"]["gradient_quantization_bits_inter"] == 4
    assert out["DRY_RUN_CONFIGS"]["transformer"]["gated_linear_unit"] is True
    assert out["DRY_RUN_CONFIGS"]["ddp"]["grad_reduce_in_fp32"] is True
    assert "Traceback" not in res.stderr


def test_paro_strategy_flags():
    """Every effective PaRO strategy is accepted; NNN / NNG (megatron-core) need the matching
    --use-distributed-optimizer setting; ineffective ones are rejected with the reason."""
    from megatron.training.arguments import parse_args
    from megatron.training.arguments.validation import ArgumentError, validate_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--vocab-size", "128"]

    def validated(*extra):
        return validate_args(parse_args(base + list(extra), validate=False))

    assert validated("--paro-strategy", "zero1", "--use-distributed-optimizer").paro_strategy == "NNG"
    assert validated("--paro-strategy", "ddp").paro_strategy == "NNN"
    with pytest.raises(ArgumentError, match="needs --use-distributed-optimizer"):
        validated("--paro-strategy", "NNG")
    # The other 12 run on the PaRO engine (tests/test_paro_training.py); auto resolves at startup.
    assert validated("--paro-strategy", "NIG").paro_strategy == "NIG"
    assert validated("--paro-strategy", "pIIg", "--use-distributed-optimizer").paro_strategy == "IIG"
    assert validated("--paro-strategy", "auto").paro_strategy == "auto"
    with pytest.raises(ArgumentError, match="less finely than gradients"):
        validated("--paro-strategy", "NGI")
    with pytest.raises(ArgumentError, match="not --fp16"):
        validated("--paro-strategy", "NIG", "--fp16")
    with pytest.raises(ArgumentError):
        validated("--paro-strategy", "XYZ")
    # The PaRO engine has no sharded state dict: torch_dist is refused before anything is built.
    with pytest.raises(ArgumentError, match="--ckpt-format torch_dist .* --paro-strategy NIG"):
        validated("--paro-strategy", "NIG", "--ckpt-format", "torch_dist")
    assert validated("--paro-strategy", "NNG", "--use-distributed-optimizer", "--ckpt-format",
                     "torch_dist").ckpt_format == "torch_dist"


def test_data_blend_forms():
    """--data-path PREFIX... and W1 PREFIX1 W2 PREFIX2 ... both reach megatron-core's blend shape."""
    from megatron.training.data.blend import data_blend

    assert data_blend(["data/a_text_document"]) == (["data/a_text_document"], None)
    assert data_blend(["a", "b"]) == (["a", "b"], None)
    assert data_blend(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])


def test_megatron_gradient_reduction_knobs_resolve_in_one_place() -> None:
    """--grad-reduce-in-bf16 / --ddp-reduce-scatter-with-fp32-accumulation /
    --ddp-average-in-collective: Megatron-LM's names, their DDP config, and every contradiction
    refused naming both flags."""
    from megatron.training.model.config_builders import build_ddp_config

    base = BASE + ["--global-batch-size", "8", "--bf16", "--use-distributed-optimizer"]
    args = parse_args(base + ["--grad-reduce-in-bf16", "--ddp-reduce-scatter-with-fp32-accumulation",
                              "--overlap-grad-reduce"])
    assert (args.grad_accum_dtype, args.accumulate_allreduce_grads_in_fp32) == ("bf16", False)
    ddp = build_ddp_config(args)
    assert (ddp.grad_reduce_in_fp32, ddp.reduce_scatter_with_fp32_accumulation,
            ddp.average_in_collective) == (False, True, False)
    ddp = build_ddp_config(parse_args(base + ["--grad-reduce-in-bf16", "--ddp-average-in-collective"]))
    assert (ddp.grad_reduce_in_fp32, ddp.average_in_collective) == (False, True)
    assert build_ddp_config(parse_args(base)).grad_reduce_in_fp32 is True  # Megatron's default

    def refused(*extra: str) -> str:
        with pytest.raises(ArgumentError) as err:
            validate_args(parse_args(BASE + ["--global-batch-size", "8"] + list(extra),
                                     validate=False))
        return str(err.value)

    assert "--grad-reduce-in-bf16 needs --bf16" in refused("--grad-reduce-in-bf16")
    assert "--grad-reduce-in-bf16 contradicts --grad-accum-dtype fp32" in refused(
        "--bf16", "--grad-reduce-in-bf16", "--grad-accum-dtype", "fp32")
    assert "contradicts --accumulate-allreduce-grads-in-fp32" in refused(
        "--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32")
    assert "needs --use-distributed-optimizer" in refused(
        "--bf16", "--grad-reduce-in-bf16", "--ddp-reduce-scatter-with-fp32-accumulation")
    assert "add --grad-reduce-in-bf16" in refused(
        "--bf16", "--use-distributed-optimizer", "--ddp-reduce-scatter-with-fp32-accumulation")
    assert "contradicts --ddp-average-in-collective" in refused(
        "--bf16", "--use-distributed-optimizer", "--grad-reduce-in-bf16",
        "--ddp-reduce-scatter-with-fp32-accumulation", "--ddp-average-in-collective")
    assert "contradicts --quantized-gradients" in refused(
        "--bf16", "--use-distributed-optimizer", "--grad-reduce-in-bf16", "--quantized-gradients",
        "--ddp-reduce-scatter-with-fp32-accumulation", "--data-parallel-intra-node-size", "1")
    assert "--ddp-average-in-collective: megatron-core DDP options; --paro-strategy NIG" in refused(
        "--bf16", "--paro-strategy", "NIG", "--ddp-average-in-collective")
    # Quantized gradients with bf16 accumulation (the same as --grad-accum-dtype bf16) is fine.
    q = parse_args(base + ["--grad-reduce-in-bf16", "--quantized-gradients",
                           "--data-parallel-intra-node-size", "1"])
    assert q.quant_config.grad_accum_dtype == "bf16"


def test_risky_settings_warn_with_the_measured_reason(capsys) -> None:
    """2-bit codes are outside what the error study found safe: the config names the flag and the
    measurement (the trainer prints these at startup); SDP4Bit's defaults warn about nothing."""
    sdp = parse_args(BASE + ["--use-distributed-optimizer", "--quantized-weights", "--bf16",
                             "--quantized-gradients"]).quant_config
    assert sdp.fidelity_warnings() == []
    risky = parse_args(BASE + ["--use-distributed-optimizer", "--quantized-weights", "--bf16",
                               "--weight-quantization-bits", "2", "--quantized-grad-bits", "2"]
                       ).quant_config
    warnings = risky.fidelity_warnings()
    assert len(warnings) == 2
    assert warnings[0].startswith("--gradient-quantization-bits-inter 2:") and "cosine" in warnings[0]
    assert warnings[1].startswith("--weight-quantization-bits 2:")
    assert all("--quantization-error-interval" in w for w in warnings)
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--use-distributed-optimizer", "--quantized-weights",
                           "--quantization-error-interval", "-1"])
    assert "--quantization-error-interval must be >= 0, got -1" in capsys.readouterr().err
