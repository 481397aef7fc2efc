"""A step skipped for NaN/Inf gradients logs its real (finite) forward loss, not ``NAN``.

Why (issue 26, small item): when only the gradients were poisoned -- the quantized
reduce-scatter met a NaN, every rank agreed (``agree_nonfinite``) and ``prepare_grads`` reported
``found_inf`` -- the forward loss of that step was finite, yet the iteration line printed
``lm loss: NAN`` (and the ``--jsonl-log`` record ``"nan"``): the loop dropped the loss of every
"nan iteration" from the interval's average, and an interval with no loss left printed NaN.
A loss that is itself NaN (the forward produced it) must still print ``NAN``.

The real trainer loop (``pretrain``, 2 gloo ranks; quantized gradients crossing the slow link,
and megatron-core's exact path) with a forward-step wrapper (``pretrain``'s
``forward_step_func``) that uses the gradient-poisoning hook of tests/test_fault_injection.py:
step 2's gradient is poisoned on rank 1 (forward untouched), step 4's forward output is NaN on
rank 0. The wrapper also keeps every micro-batch's own [loss sum, token count], so the step's
true forward loss is known independently of the trainer's reduction. (In process, not through
``run_pretrain``: pretrain_gpt.py has no way to poison a gradient from the command line.)
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Dict, List

import pytest

from conftest import TINY_GPT
from dist_harness import run_distributed

WORLD = 2
ITERS = 5
GRAD_NAN_STEP, GRAD_NAN_RANK = 2, 1   # gradient poisoned, forward loss finite
LOSS_NAN_STEP, LOSS_NAN_RANK = 4, 0   # forward output NaN: the loss is NaN
FLAGS = ["--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "3e-3", "--bf16",
         "--use-distributed-optimizer", "--log-interval", "1", "--eval-iters", "0",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
PATHS = {  # how the poisoned gradient is met: both skip with reason 'nan'
    # the quantized reduce-scatter refuses it; the ranks agree (agree_nonfinite -> found_inf)
    "quantized-gradients": ["--quantized-gradients", "--data-parallel-intra-node-size", "1"],
    # megatron-core's exact reduce-scatter spreads it; the global grad norm is NaN
    "megatron-core": [],
}
LINE_RE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: (\S+) \|.*?"
                     r"number of skipped iterations:\s+(\d+) \| number of nan iterations:\s+(\d+)")


def _worker(rank: int, world: int, jsonl: str, path_flags: List[str]) -> Dict[str, Any]:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    from megatron.training import step as training_step
    from megatron.training.arguments import parse_args
    from megatron.training.pretrain import pretrain
    from test_fault_injection import _poison

    args = parse_args(TINY_GPT + FLAGS + path_flags + ["--jsonl-log", jsonl])
    n_micro = args.global_batch_size // (args.micro_batch_size * world)
    state = {"calls": 0, "handle": None}
    reports: Dict[int, List[List[float]]] = {}  # step -> this rank's [loss sum, tokens] per mb

    def forward_step(data_iterator, model):
        step, first = state["calls"] // n_micro + 1, state["calls"] % n_micro == 0
        state["calls"] += 1
        if first:
            if state["handle"] is not None:
                state["handle"].remove()
                state["handle"] = None
            if step == GRAD_NAN_STEP and rank == GRAD_NAN_RANK:
                state["handle"] = _poison([model], float("nan"))
        output, loss_func = training_step.forward_step(args, data_iterator, model)
        if step == LOSS_NAN_STEP and rank == LOSS_NAN_RANK:
            output = output * float("nan")

        def recording_loss_func(output_tensor):
            loss, tokens, report = loss_func(output_tensor)
            reports.setdefault(step, []).append(report["lm loss"].double().tolist())
            return loss, tokens, report

        return output, recording_loss_func

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = pretrain(args, forward_step_func=forward_step)
    return {"stdout": out.getvalue(), "reports": reports, "summary": summary}


def _forward_loss(results: List[Dict[str, Any]], step: int) -> float:
    """The step's token-mean forward loss over every rank's micro-batches."""
    total = sum(s for r in results for s, _ in r["reports"][step])
    tokens = sum(n for r in results for _, n in r["reports"][step])
    return total / tokens


@pytest.mark.parametrize("path", list(PATHS))
def test_gradient_nan_step_logs_its_forward_loss(tmp_path: Path, path: str) -> None:
    jsonl = tmp_path / "log.jsonl"
    results = run_distributed(WORLD, _worker, tmp_path, str(jsonl), PATHS[path])
    stdout = results[0]["stdout"]
    lines = {int(m.group(1)): m for m in LINE_RE.finditer(stdout)}
    assert sorted(lines) == list(range(1, ITERS + 1)), stdout[-3000:]
    records = {r["iteration"]: r for r in map(json.loads, jsonl.read_text().splitlines())
               if r["type"] == "train"}

    for step in range(1, ITERS + 1):
        m, rec = lines[step], records[step]
        printed = float(m.group(2))
        counters = (int(m.group(3)), int(m.group(4)))
        if step == LOSS_NAN_STEP:  # the forward itself produced NaN: still NAN
            assert m.group(2) == "NAN", m.group(0)
            assert rec["lm_loss"] == "nan", rec
            assert counters == (1, 1)
            continue
        real = _forward_loss(results, step)
        assert math.isfinite(real)
        assert printed == float(f"{real:.6E}"), (step, m.group(0), real)
        assert math.isclose(rec["lm_loss"], real, rel_tol=1e-9), (step, rec, real)
        assert counters == ((1, 1) if step == GRAD_NAN_STEP else (0, 0)), m.group(0)
        assert (rec["skipped_iterations"], rec["nan_iterations"]) == counters

    summary = results[0]["summary"]
    assert (summary["skipped_iterations"], summary["nan_iterations"]) == (2, 2)
    assert math.isclose(summary["final_lm_loss"], _forward_loss(results, ITERS), rel_tol=1e-9)
