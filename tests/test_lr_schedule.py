"""The learning-rate schedule: sample-based and WSD schedules as megatron-core computes them from
Megatron-LM's flags, and what a resume does with a schedule that is not the checkpoint's
(``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler`` / an error naming
the difference).

The resume runs train a tiny GPT in one gloo process (several ``pretrain`` calls in a row); the
schedule itself is checked against the formulas written out here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List

import pytest

from dist_harness import run_distributed

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "8",
        "--device", "cpu", "--eval-iters", "0", "--log-interval", "1"]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")


class _Optimizer:
    """What OptimizerParamScheduler touches of an optimizer: its param groups."""

    def __init__(self) -> None:
        self.param_groups: List[Dict] = [{"max_lr": 0.0, "min_lr": 0.0, "default_config": True}]


def _lrs(argv: List[str], steps: int) -> List[float]:
    """The lr after each of ``steps`` iterations of the schedule these flags build."""
    from megatron.training.arguments import parse_args
    from megatron.training.lr_schedule import build_scheduler

    args = parse_args(TINY + argv)
    opt = _Optimizer()
    opt.param_groups[0].update(max_lr=args.lr, min_lr=args.min_lr)
    scheduler = build_scheduler(args, opt)
    out = []
    for _ in range(steps):
        scheduler.step(increment=args.global_batch_size)
        out.append(opt.param_groups[0]["lr"])
    return out


def test_sample_based_schedule() -> None:
    from megatron.training.arguments import parse_args

    # 100 samples of 8: 12 iterations; warmup 16 samples (2 iterations), decay over 80 samples
    argv = ["--train-samples", "100", "--global-batch-size", "8", "--lr", "1e-3",
            "--min-lr", "1e-4", "--lr-warmup-samples", "16", "--lr-decay-samples", "80"]
    args = parse_args(TINY + argv)
    assert (args.train_iters, args.lr_decay_steps, args.lr_warmup_steps) == (12, 80, 16)
    want = []
    for it in range(1, 13):
        s = 8 * it
        want.append(1e-3 * s / 16 if s <= 16 else
                    1e-4 if s > 80 else 1e-4 + 9e-4 * (1 - (s - 16) / 64))
    assert _lrs(argv, 12) == pytest.approx(want, rel=1e-12)
    # --lr-warmup-fraction applies to the sample horizon too; --lr-decay-samples defaults to it
    args = parse_args(TINY + ["--train-samples", "64", "--global-batch-size", "8", "--lr", "1e-3",
                              "--lr-warmup-fraction", "0.25"])
    assert (args.train_iters, args.lr_decay_steps, args.lr_warmup_steps) == (8, 64, 16)


def test_wsd_schedule() -> None:
    # 10 iterations of 4 samples; the last 4 iterations decay, linearly, to --min-lr
    argv = ["--train-iters", "10", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr",
            "1e-4", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "4",
            "--lr-wsd-decay-style", "linear"]
    want = [1e-3 if it <= 6 else 1e-4 + 9e-4 * (1 - (it - 6) / 4) for it in range(1, 11)]
    assert _lrs(argv, 10) == pytest.approx(want, rel=1e-12)
    # sample-based WSD, megatron-core's default 'exponential' decay phase
    argv = ["--train-samples", "80", "--global-batch-size", "8", "--lr", "1e-3", "--min-lr",
            "0", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "32"]
    want = [1e-3 if 8 * it <= 48 else 1e-3 * (2 * 0.5 ** ((8 * it - 48) / 32) - 1)
            for it in range(1, 11)]
    assert _lrs(argv, 10) == pytest.approx(want, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("argv, message", [
    (["--train-iters", "4", "--lr-decay-samples", "8"], "--lr-decay-samples counts samples"),
    (["--train-samples", "64", "--lr-decay-iters", "8"], "--lr-decay-iters counts iterations"),
    (["--train-iters", "4", "--train-samples", "64"], "exclusive"),
    (["--lr-decay-iters", "4"], "give one of --train-iters and --train-samples"),
    (["--train-iters", "4", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "8"],
     "--rampup-batch-size needs sample-based training"),
    (["--train-samples", "64", "--global-batch-size", "8", "--rampup-batch-size", "3", "1", "8"],
     "multiples of --micro-batch-size"),
    (["--train-iters", "4", "--lr-decay-style", "WSD"], "needs --lr-wsd-decay-iters"),
    (["--train-iters", "4", "--override-opt_param-scheduler",
      "--use-checkpoint-opt_param-scheduler"], "exclusive"),
])
def test_schedule_flag_errors(argv, message, capsys) -> None:
    from megatron.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(TINY + ["--lr", "1e-3"] + argv)
    assert message in capsys.readouterr().err.splitlines()[-1]


# ----------------------------------------------------------------------------- resume
def _resume_worker(rank: int, world: int, tmp: str) -> Dict:
    """Save at iteration 4, then resume it in the ways a user may; returns what each logged."""
    from megatron.core import parallel_state

    from megatron.training.arguments import parse_args
    from megatron.training.errors import StartupError
    from megatron.training.pretrain import pretrain

    def run(name: str, argv: List[str]) -> List[Dict]:
        log = Path(tmp) / f"{name}.jsonl"
        args = parse_args(TINY + ["--global-batch-size", "4", "--jsonl-log", str(log)] + argv)
        try:
            pretrain(args)
        finally:
            parallel_state.destroy_model_parallel()
        return [r for r in map(json.loads, log.read_text().splitlines()) if r["type"] == "train"]

    ckpt, short = str(Path(tmp) / "ckpt"), str(Path(tmp) / "short")
    out: Dict = {}
    out["saved"] = run("saved", ["--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-iters", "1000",
                                 "--train-iters", "4", "--save", ckpt])
    new = ["--lr", "1e-5", "--min-lr", "1e-6", "--lr-decay-iters", "8", "--train-iters", "8",
           "--load", ckpt]
    try:
        run("refused", new)
        out["refused"] = None
    except StartupError as exc:
        out["refused"] = str(exc)
    out["override"] = run("override", new + ["--override-opt_param-scheduler"])
    out["checkpoint"] = run("checkpoint", new + ["--use-checkpoint-opt_param-scheduler"])
    # without the optimizer state the schedule still resumes (and is still checked)
    out["no_optim"] = run("no_optim", new + ["--use-checkpoint-opt_param-scheduler",
                                             "--no-load-optim"])
    try:
        run("refused_no_optim", new + ["--no-load-optim"])
        out["refused_no_optim"] = None
    except StartupError as exc:
        out["refused_no_optim"] = str(exc)
    # decays to 0 over its 4 iterations (the default horizon is --train-iters), then run longer
    out["short"] = run("short", ["--lr", "1e-3", "--train-iters", "4", "--save", short])
    out["longer"] = run("longer", ["--lr", "1e-3", "--train-iters", "8", "--load", short,
                                   "--override-opt_param-scheduler"])
    return out


def test_resume_with_another_schedule(tmp_path: Path) -> None:
    res = run_distributed(1, _resume_worker, tmp_path, str(tmp_path), trace=False)[0]
    assert "__error__" not in res, res.get("__error__")
    lr = lambda name: [(r["iteration"], r["lr"]) for r in res[name]]  # noqa: E731

    # neither flag: one line with both values of every difference and both flags
    line = res["refused"]
    assert line is not None and "\n" not in line
    for part in ("--lr 1e-05 (checkpoint: 0.0003)", "--min-lr 1e-06 (checkpoint: 3e-05)",
                 "--lr-decay-iters 8 (checkpoint: 1000)", "--override-opt_param-scheduler",
                 "--use-checkpoint-opt_param-scheduler"):
        assert part in line, line
    # --override-opt_param-scheduler: this run's lr / min-lr / horizon, from sample 16 on
    assert lr("override") == [(i, pytest.approx(1e-6 + 9e-6 * (1 - i / 8), rel=1e-9))
                              for i in range(5, 9)]
    # --use-checkpoint-opt_param-scheduler: the checkpoint's schedule continues
    assert lr("checkpoint") == [(i, pytest.approx(3e-5 + 2.7e-4 * (1 - i / 1000), rel=1e-9))
                                for i in range(5, 9)]
    assert lr("saved")[-1] == (4, pytest.approx(3e-5 + 2.7e-4 * (1 - 4 / 1000), rel=1e-9))
    # --no-load-optim: the same schedule, not a restart at step 0 with this run's --lr
    assert lr("no_optim") == lr("checkpoint")
    assert res["refused_no_optim"] == line
    # a longer run with --override-opt_param-scheduler decays over the new horizon, not at lr 0
    assert lr("short")[-1] == (4, 0.0)
    assert lr("longer") == [(i, pytest.approx(1e-3 * (1 - i / 8), rel=1e-9)) for i in range(5, 9)]
    assert all(r["lr"] > 0 for r in res["longer"][:-1])


# ----------------------------------------------------------------------------- units
class _Scheduler:
    """The attributes of megatron-core's scheduler the resume check reads."""

    def __init__(self, **kw) -> None:
        self.optimizer = _Optimizer()
        self.__dict__.update(kw)
        self.loaded = None

    def load_state_dict(self, state: Dict) -> None:
        self.loaded = state


def test_schedule_check_names_the_difference_or_takes_a_side() -> None:
    from megatron.training.arguments import parse_args
    from megatron.training.errors import StartupError
    from megatron.training.lr_schedule import load_scheduler_state

    args = parse_args(TINY + ["--train-samples", "64", "--global-batch-size", "8", "--lr",
                              "1e-3", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "16",
                              "--load", "ckpt"])
    mine = dict(max_lr=1e-3, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=64,
                lr_decay_style="WSD", wsd_decay_steps=16, lr_wsd_decay_style="exponential",
                start_wd=0.01)
    state = dict(mine, wsd_decay_steps=32, lr_decay_steps=48, num_steps=24)
    with pytest.raises(StartupError) as exc:
        load_scheduler_state(args, _Scheduler(**mine), state)
    assert "--lr-decay-samples 64 (checkpoint: 48)" in str(exc.value)
    assert "--lr-wsd-decay-samples 16 (checkpoint: 32)" in str(exc.value)
    # the same schedule loads without a flag; the WSD phase is not passed to megatron-core's
    sched = _Scheduler(**mine)
    load_scheduler_state(args, sched, dict(mine, num_steps=24))
    assert sched.loaded == dict({k: v for k, v in mine.items()
                                 if k not in ("wsd_decay_steps", "lr_wsd_decay_style")},
                                num_steps=24)
    # the checkpoint's WSD phase with --use-checkpoint-opt_param-scheduler
    args.use_checkpoint_opt_param_scheduler = True
    sched = _Scheduler(**mine)
    load_scheduler_state(args, sched, state)
    assert sched.wsd_decay_steps == 32
    # this run's lr bounds back in the param groups with --override-opt_param-scheduler
    args.use_checkpoint_opt_param_scheduler, args.override_opt_param_scheduler = False, True
    sched = _Scheduler(**mine)
    sched.optimizer.param_groups = [{"max_lr": 5.0, "min_lr": 4.0, "default_config": True},
                                    {"max_lr": 5.0, "min_lr": 4.0, "default_config": False}]
    load_scheduler_state(args, sched, state)
    assert [(g["max_lr"], g["min_lr"]) for g in sched.optimizer.param_groups] == \
        [(1e-3, 0.0), (1e-3, 0.0)]
    args.decoupled_lr, args.decoupled_min_lr = 2e-3, 1e-5
    load_scheduler_state(args, sched, state)
    assert [(g["max_lr"], g["min_lr"]) for g in sched.optimizer.param_groups] == \
        [(1e-3, 0.0), (2e-3, 1e-5)]
    assert math.isclose(sched.max_lr, 1e-3)


def test_decoupled_lr_is_part_of_the_schedule() -> None:
    """--decoupled-lr / --decoupled-min-lr live in the param groups, which a resume replaces:
    a difference is named, and the checkpoint's side writes its bounds to the groups."""
    from megatron.training.arguments import parse_args
    from megatron.training.errors import StartupError
    from megatron.training.lr_schedule import load_scheduler_state, scheduler_state_dict

    args = parse_args(TINY + ["--train-iters", "8", "--global-batch-size", "8", "--lr", "1e-3",
                              "--decoupled-lr", "2e-3", "--load", "ckpt"])
    mine = dict(max_lr=1e-3, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=64,
                lr_decay_style="linear", start_wd=0.01)
    sched = _Scheduler(**mine, state_dict=lambda: dict(mine, num_steps=0))
    assert {k: scheduler_state_dict(sched, args)[k] for k in ("decoupled_lr", "decoupled_min_lr")} \
        == {"decoupled_lr": 2e-3, "decoupled_min_lr": None}
    state = dict(mine, num_steps=16, decoupled_lr=5e-3, decoupled_min_lr=1e-4)
    with pytest.raises(StartupError) as exc:
        load_scheduler_state(args, _Scheduler(**mine), state)
    assert "--decoupled-lr 0.002 (checkpoint: 0.005); --decoupled-min-lr None (checkpoint: " \
        "0.0001)" in str(exc.value)
    args.use_checkpoint_opt_param_scheduler = True
    sched = _Scheduler(**mine)
    sched.optimizer.param_groups = [{"max_lr": 1e-3, "min_lr": 0.0, "default_config": True},
                                    {"max_lr": 2e-3, "min_lr": 0.0, "default_config": False}]
    load_scheduler_state(args, sched, state)
    assert [(g["max_lr"], g["min_lr"]) for g in sched.optimizer.param_groups] == \
        [(1e-3, 0.0), (5e-3, 1e-4)]
    assert "decoupled_lr" not in sched.loaded   # not megatron-core's
