"""Where the training step reads the device back: the loss once, after megatron-core's gradient
norm has waited for the device, and nothing after the optimizer's update is queued.

Why: on a GPU every ``.item()`` / ``float(tensor)`` / ``bool(tensor)`` makes the host wait until
the stream has run everything queued before it. Read after the update, the step's loss (or the
constant loss scale of a bf16 run, which megatron-core keeps in a CUDA tensor) made the host
wait for the optimizer, instead of loading the next batch and queuing the next forward while the
GPU still updates. There is no GPU here, so the reads are recorded on CPU ranks by their caller:
a read whose immediate caller is in the trainer (``megatron/training``) or in the quantized
layer (``megatron/distributed/quant``) is one a GPU run would make on a device tensor.
megatron-core's own reads (its gradient norm) and the CPU mode's device mapping are not ours and
are not counted.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from typing import Any, Dict, List

import pytest
import torch

from dist_harness import run_distributed

SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
OURS = (os.sep + os.path.join("megatron", "training") + os.sep,
        os.sep + os.path.join("megatron", "distributed", "quant") + os.sep)
NOT_A_DEVICE_READ = (os.path.join("megatron", "training", "cpu_mode.py"),)
"""The CPU mode maps CUDA factory calls to the CPU; what it converts there is the caller's."""
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "10", "--lr", "3e-3", "--mock-data",
        "--vocab-size", "128", "--make-vocab-size-divisible-by", "8", "--device", "cpu",
        "--use-distributed-optimizer", "--clip-grad", "1.0"]
FP16 = ["--fp16", "--initial-loss-scale", "128"]
SDP4BIT = ["--quantized-weights", "--quantized-gradients", "--hadamard-transform", "--loco",
           "--data-parallel-intra-node-size", "1", "--overlap-grad-reduce",
           "--overlap-param-gather"]


class StepRecorder:
    """Records, in order, the trainer's and the quantized layer's device reads and the moment
    the optimizer's update is queued."""

    def __init__(self) -> None:
        self.events: List[str] = []
        self.active = False
        self._originals: Dict[str, Any] = {}

    def _wrap(self, name: str) -> None:
        original = getattr(torch.Tensor, name)
        self._originals[name] = original
        recorder = self

        def recorded(tensor, *args, **kwargs):
            if recorder.active:
                caller = sys._getframe(1)
                path = caller.f_code.co_filename
                if any(d in path for d in OURS) and not path.endswith(NOT_A_DEVICE_READ):
                    short = path[path.index(os.sep + "megatron" + os.sep) + 1:]
                    recorder.events.append(f"read {short}:{caller.f_lineno} ({name})")
            return original(tensor, *args, **kwargs)

        setattr(torch.Tensor, name, recorded)

    def __enter__(self) -> "StepRecorder":
        for name in SYNC_METHODS:
            self._wrap(name)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)

    def mark(self, optimizer, method: str, label: str) -> None:
        """Record ``label`` when ``optimizer.<method>`` returns."""
        call = getattr(optimizer, method)

        def marked(*args, **kwargs):
            result = call(*args, **kwargs)
            if self.active:
                self.events.append(label)
            return result

        setattr(optimizer, method, marked)


def _step_events(rank: int, world: int, extra: List[str]) -> Dict[str, Any]:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    from megatron.training.arguments import parse_args
    from megatron.training.model.config_builders import build_transformer_config
    from megatron.training.initialize import initialize_megatron, set_random_seed
    from megatron.training.components import (configure_schedule, get_model,
                                                       get_optimizer_and_scheduler)
    from megatron.training.step import forward_step, train_step
    from tools.paro_strategy_table import synthetic_batches

    args = parse_args(TINY + extra)
    initialize_megatron(args)
    set_random_seed(1234, "cpu")
    config = build_transformer_config(args)
    args.padded_vocab_size = 128
    model = get_model(args, config, 128)
    opt, sched = get_optimizer_and_scheduler(args, model)
    configure_schedule(args, config, model, opt)
    micro = args.global_batch_size // (args.micro_batch_size * world)
    batches = synthetic_batches(rank, 0, 3, micro=micro, mbs=2, seq=32, vocab=128)
    steps = []
    with StepRecorder() as recorder:
        recorder.mark(opt, "get_grad_norm", "norm")        # megatron-core's read: a drained stream
        recorder.mark(opt, "step_with_ready_grads", "update")
        for _ in range(3):
            recorder.events = []
            recorder.active = True
            loss, ok, _, _ = train_step(args, partial(forward_step, args), batches, model,
                                        opt, sched, torch.device("cpu"))
            recorder.active = False
            assert ok
            steps.append({"events": list(recorder.events), "loss": loss})
    return {"steps": steps}


@pytest.mark.parametrize("flags", [["--bf16"], ["--bf16"] + SDP4BIT, FP16 + SDP4BIT],
                         ids=["baseline", "sdp4bit-loco-overlap", "fp16-sdp4bit-loco-overlap"])
def test_no_device_read_after_the_update_is_queued(tmp_path, flags) -> None:
    """fp16 adds the loss scale (megatron-core keeps it in a device tensor): read once per step,
    beside the loss, after prepare_grads has updated it; the next step takes it from there (it
    was read before the optimizer step, waiting for the backward, and again after the update).
    Only the first step reads it up front."""
    fp16 = "--fp16" in flags
    results = run_distributed(2, partial(_step_events, extra=flags), tmp_path)
    for rank, result in enumerate(results):
        for i, step in enumerate(result["steps"]):
            events = step["events"]
            assert events.count("update") == 1 and events.count("norm") == 1, (rank, i, events)
            after = events[events.index("update"):][1:]
            assert after == [], f"rank {rank}, step {i}: read after the update: {after}"
            # the step's loss (and fp16's scale): read by the trainer after the gradient norm
            # has waited for the device (the quantized layer adds its once-per-step agreement on
            # non-finite gradients before it, tests/test_host_sync_budget.py)
            trainer_reads = [j for j, e in enumerate(events) if "megatron/training/" in e]
            if fp16 and i == 0:
                assert trainer_reads[0] < events.index("norm"), events   # the initial scale
                trainer_reads = trainer_reads[1:]
            assert len(trainer_reads) == (2 if fp16 else 1), (rank, i, events)
            assert all(events.index("norm") < j < events.index("update")
                       for j in trainer_reads), events
            assert torch.isfinite(torch.tensor(step["loss"]))
    assert results[0]["steps"][-1]["loss"] == results[1]["steps"][-1]["loss"]


def test_fp16_scale_changes_still_reach_the_quantized_layer(monkeypatch) -> None:
    """The scale each step compares against is the one the previous step left (read inside
    before_update): a grown scale rescales LoCo's errors, an overflow passes its ratio on."""
    from megatron.training import step as training_step

    class Fp16Optimizer:
        grad_scaler = object()

        def __init__(self) -> None:
            self.scale = torch.tensor(128.0)

        def get_loss_scale(self) -> torch.Tensor:
            return self.scale

        def zero_grad(self) -> None:
            pass

    class Chunk:
        def zero_grad_buffer(self) -> None:
            pass

    class Scheduler:
        def step(self, increment: int) -> None:
            pass

    # per step: the scale prepare_grads leaves, and the verdict
    steps = iter([(256.0, True, ""), (128.0, False, "overflow"), (128.0, True, "")])

    def fake_optimizer_step(optimizer, before_update=None):
        scale, ok, reason = next(steps)
        optimizer.scale = torch.tensor(scale)
        before_update()
        return ok, 1.0, reason

    calls: List[Any] = []
    monkeypatch.setattr(training_step, "optimizer_step", fake_optimizer_step)
    monkeypatch.setattr(training_step, "_sum_losses",
                        lambda losses, device: torch.tensor([6.0, 3.0], dtype=torch.float64))
    monkeypatch.setattr("megatron.core.pipeline_parallel.get_forward_backward_func",
                        lambda: (lambda **kw: []))
    monkeypatch.setattr("megatron.core.num_microbatches_calculator.get_num_microbatches",
                        lambda: 1)
    monkeypatch.setattr(
        "megatron.core.num_microbatches_calculator.get_current_global_batch_size", lambda: 1)
    monkeypatch.setattr(training_step.integration, "on_loss_scale_changed",
                        lambda model, factor: calls.append(("rescale", factor)))
    monkeypatch.setattr(training_step.integration, "on_step_skipped",
                        lambda model, ratio: calls.append(("skipped", ratio)))

    class Args:
        seq_length = micro_batch_size = global_batch_size = 1

    opt = Fp16Optimizer()
    for _ in range(3):
        loss, *_ = training_step.train_step(Args, None, None, [Chunk()], opt, Scheduler(), "cpu")
        assert loss == 2.0
    assert calls == [("rescale", 2.0), ("skipped", 0.5)]
