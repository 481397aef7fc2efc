"""The learning-rate schedule: megatron-core's OptimizerParamScheduler built from the flags, its
checkpoint state, and what a resume does when the run's schedule is not the checkpoint's.

Resume, as in Megatron-LM: ``--override-opt_param-scheduler`` trains with this run's flags,
``--use-checkpoint-opt_param-scheduler`` keeps the checkpoint's; with neither, a differing
schedule stops the run with one line naming each difference and both flags (megatron-core's own
assertion names neither; this check runs first). :func:`scheduler_state_dict` adds what
megatron-core's state dict lacks (the WSD decay phase, ``--decoupled-lr`` /
``--decoupled-min-lr``), checked and restored like the rest.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Tuple

from megatron.training.errors import StartupError

WSD_KEYS = ("wsd_decay_steps", "lr_wsd_decay_style")
"""What :func:`scheduler_state_dict` adds to megatron-core's state dict (WSD's decay phase)."""
DECOUPLED_KEYS = ("decoupled_lr", "decoupled_min_lr")
"""--decoupled-lr / --decoupled-min-lr, added to the state dict: megatron-core keeps them only in
the optimizer's param groups, which a resume replaces with the checkpoint's."""
OUR_KEYS = WSD_KEYS + DECOUPLED_KEYS
"""Keys of :func:`scheduler_state_dict` that megatron-core's ``load_state_dict`` does not take."""


def scheduler_resume_policy(args: argparse.Namespace) -> Tuple[bool, bool]:
    """(use_checkpoint_opt_param_scheduler, override_opt_param_scheduler) for megatron-core.

    Without either flag the checkpoint's values are used, which :func:`load_scheduler_state` has
    checked to be this run's (so the choice cannot change the schedule)."""
    override = bool(getattr(args, "override_opt_param_scheduler", False))
    return (not override), override


def scheduler_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """OptimizerParamScheduler's arguments; the steps (samples) are the ones validation derived
    (``args.lr_decay_steps`` ..., :func:`~.arguments.validation.derive_lr_schedule_steps`)."""
    use_checkpoint, override = scheduler_resume_policy(args)
    return dict(init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
                lr_warmup_steps=args.lr_warmup_steps, lr_decay_steps=args.lr_decay_steps,
                lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
                end_wd=args.weight_decay, wd_incr_steps=args.wd_incr_steps,
                wd_incr_style="constant", use_checkpoint_opt_param_scheduler=use_checkpoint,
                override_opt_param_scheduler=override, wsd_decay_steps=args.lr_wsd_decay_steps,
                lr_wsd_decay_style=args.lr_wsd_decay_style)


def build_scheduler(args: argparse.Namespace, optimizer: Any) -> Any:
    """megatron-core's OptimizerParamScheduler for ``optimizer`` (sets its lr for step 0)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(optimizer, **scheduler_kwargs(args))


def scheduler_state_dict(scheduler: Any, args: argparse.Namespace) -> Dict[str, Any]:
    """megatron-core's state dict plus the WSD decay phase (megatron-core's ignores it) and
    --decoupled-lr / --decoupled-min-lr (megatron-core's keeps them in the param groups only)."""
    state = scheduler.state_dict()
    state.update({key: getattr(scheduler, key, None) for key in WSD_KEYS})
    state.update({key: getattr(args, key, None) for key in DECOUPLED_KEYS})
    return state


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _steps(args: argparse.Namespace, steps: Any) -> str:
    """A step count (megatron-core counts samples) in this run's unit: iterations of
    --global-batch-size for an iteration-based run, samples for a sample-based one."""
    if getattr(args, "train_samples", None) is not None:
        return str(steps)
    return _fmt(steps / args.global_batch_size if steps % args.global_batch_size else
                steps // args.global_batch_size)


SCHEDULE_FIELDS: Tuple[Tuple[str, str, str, bool], ...] = (
    ("max_lr", "--lr", "--lr", False),
    ("min_lr", "--min-lr", "--min-lr", False),
    ("lr_warmup_steps", "warmup (--lr-warmup-iters)", "warmup (--lr-warmup-samples)", True),
    ("lr_decay_steps", "--lr-decay-iters", "--lr-decay-samples", True),
    ("lr_decay_style", "--lr-decay-style", "--lr-decay-style", False),
    ("wsd_decay_steps", "--lr-wsd-decay-iters", "--lr-wsd-decay-samples", True),
    ("lr_wsd_decay_style", "--lr-wsd-decay-style", "--lr-wsd-decay-style", False),
    ("start_wd", "--weight-decay", "--weight-decay", False),
    ("decoupled_lr", "--decoupled-lr", "--decoupled-lr", False),
    ("decoupled_min_lr", "--decoupled-min-lr", "--decoupled-min-lr", False),
)
"""(scheduler attribute, its flag in an iteration-based run, in a sample-based run, whether it
counts steps) of every compared field."""


def schedule_differences(args: argparse.Namespace, scheduler: Any,
                         state: Dict[str, Any]) -> List[str]:
    """'FLAG VALUE (checkpoint: VALUE)' for every schedule field where this run differs from
    the checkpoint's state (fields the checkpoint lacks are not compared; WSD's only under WSD)."""
    wsd = scheduler.lr_decay_style == "WSD" or state.get("lr_decay_style") == "WSD"
    by_samples = getattr(args, "train_samples", None) is not None
    out = []
    for key, iters_flag, samples_flag, steps in SCHEDULE_FIELDS:
        if key not in state or (key in WSD_KEYS and not wsd):
            continue
        mine = getattr(args, key, None) if key in DECOUPLED_KEYS else getattr(scheduler, key)
        theirs = state[key]
        if mine == theirs:
            continue
        shown = [_steps(args, v) if steps else _fmt(v) for v in (mine, theirs)]
        out.append(f"{samples_flag if by_samples else iters_flag} {shown[0]} "
                   f"(checkpoint: {shown[1]})")
    return out


def run_lr_bounds(args: argparse.Namespace, group: Dict[str, Any]) -> Tuple[float, float]:
    """(max_lr, min_lr) this run gives an optimizer param group: --lr / --min-lr, or
    --decoupled-lr / --decoupled-min-lr for the group megatron-core built for them (the one
    group whose lr is not the default schedule's)."""
    if group.get("default_config", True) or getattr(args, "decoupled_lr", None) is None:
        return args.lr, args.min_lr
    min_lr = args.decoupled_min_lr if args.decoupled_min_lr is not None else args.min_lr
    return args.decoupled_lr, min_lr


def override_param_group_lrs(args: argparse.Namespace, optimizer: Any) -> None:
    """Put this run's lr bounds (--lr / --min-lr, --decoupled-lr / --decoupled-min-lr) into the
    param groups, which a loaded optimizer state fills with the checkpoint's values.

    Why: megatron-core's scheduler reads each group's own ``max_lr`` / ``min_lr`` before its
    own, so ``--override-opt_param-scheduler`` must change the groups, not only the scheduler."""
    for group in optimizer.param_groups:
        if "max_lr" in group:
            group["max_lr"], group["min_lr"] = run_lr_bounds(args, group)


def checkpoint_param_group_lrs(state: Dict[str, Any], optimizer: Any) -> None:
    """Put the checkpoint's lr bounds (``state``: its scheduler state) into the param groups
    (``--use-checkpoint-opt_param-scheduler``): needed when the optimizer state was not loaded
    (``--no-load-optim``), as the groups then hold this run's.  --decoupled-lr's group is left
    alone when the checkpoint does not record its bounds."""
    for group in optimizer.param_groups:
        if "max_lr" not in group:
            continue
        if group.get("default_config", True):
            group["max_lr"] = state.get("max_lr", state.get("start_lr"))  # older Megatron-LM
            group["min_lr"] = state["min_lr"]
        elif state.get("decoupled_lr") is not None:
            min_lr = state.get("decoupled_min_lr")
            group["max_lr"] = state["decoupled_lr"]
            group["min_lr"] = state["min_lr"] if min_lr is None else min_lr


def load_scheduler_state(args: argparse.Namespace, scheduler: Any,
                         state: Dict[str, Any]) -> None:
    """Resume the schedule from a checkpoint's state: the difference check (neither flag),
    the checkpoint's WSD phase (``--use-checkpoint-opt_param-scheduler``), then megatron-core's
    ``load_state_dict``, which moves the schedule to the checkpoint's consumed samples.

    Raises StartupError, on every rank alike, when the schedules differ and neither flag says
    which one to use."""
    if getattr(args, "override_opt_param_scheduler", False):
        override_param_group_lrs(args, scheduler.optimizer)
    elif getattr(args, "use_checkpoint_opt_param_scheduler", False):
        for key in WSD_KEYS:
            if state.get(key) is not None:
                setattr(scheduler, key, state[key])
        checkpoint_param_group_lrs(state, scheduler.optimizer)
    else:
        differences = schedule_differences(args, scheduler, state)
        if differences:
            raise StartupError(
                f"--load {args.load}: this run's learning-rate schedule differs from the "
                f"checkpoint's: {'; '.join(differences)}. Add --override-opt_param-scheduler to "
                "train with this run's schedule, or --use-checkpoint-opt_param-scheduler to "
                "keep the checkpoint's")
    scheduler.load_state_dict({k: v for k, v in state.items() if k not in OUR_KEYS})


def saved_scheduler_state(state: Dict[str, Any]) -> Any:
    """A checkpoint's scheduler state (``opt_param_scheduler``; older Megatron-LM checkpoints:
    ``lr_scheduler``), or None when it has none (saved with --no-save-optim)."""
    saved = state.get("opt_param_scheduler", state.get("lr_scheduler"))
    if isinstance(saved, dict) and ("num_steps" in saved or "num_iters" in saved):
        return saved
    return None


def resume_schedule(args: argparse.Namespace, scheduler: Any, state: Dict[str, Any],
                    consumed_samples: int) -> str:
    """Put the schedule where a run continuing at a checkpoint's iteration is, with or without
    its optimizer state: the checkpoint's scheduler state through :func:`load_scheduler_state`
    (its checks and flags), or -- a checkpoint without one -- this run's schedule advanced to
    the checkpoint's ``consumed_samples``, so warmup and decay never restart at step 0.
    Returns what was done, for the log."""
    saved = saved_scheduler_state(state)
    if saved is not None:
        load_scheduler_state(args, scheduler, saved)
        which = ("this run's (--override-opt_param-scheduler)"
                 if getattr(args, "override_opt_param_scheduler", False) else "the checkpoint's")
        return (f"learning-rate schedule: {which}, continued from the checkpoint's scheduler "
                f"state at {scheduler.num_steps} samples")
    scheduler.step(increment=consumed_samples)
    return ("learning-rate schedule: the checkpoint has no scheduler state; this run's "
            f"schedule continues at the checkpoint's {consumed_samples} consumed samples")
