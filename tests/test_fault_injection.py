"""A NaN or Inf in ONE rank's gradient: the step is skipped on every rank, on every engine.

Why: each engine / quantization mode meets a non-finite gradient differently -- megatron-core's
exact reduce-scatter spreads it into a NaN grad norm; the quantized reduce-scatter (TLq) refuses
to quantize it and must make every DP rank agree before any payload moves; the PaRO engine runs
its own hop-by-hop collectives inside the backward pass, where an exception on some ranks leaves
the others blocked in the next hop. Whatever the path, the outcome must be the same: no
parameter or optimizer state changes on any rank, the trainer counts the iteration as a "nan
iteration" (and a skipped one, as Megatron-LM), and training continues finitely afterwards.

One spawned job of 4 gloo ranks (PaRO: 2 groups x 2; SDP4Bit: 2 emulated nodes x 2) trains the
tiny GPT of tests/test_paro_training.py through the trainer's own ``train_step`` once per
scenario: a clean step, a NaN injected into one element of one parameter's gradient on rank 1,
a clean step, an Inf on rank 2, a clean step.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Dict, List

import pytest
import torch

from dist_harness import run_distributed
from test_paro_training import TINY, _batches, _build, _setup

WORLD = 4
PLAN = [(None, None), (1, float("nan")), (None, None), (2, float("inf")), (None, None)]
"""Per step: (rank whose gradient is poisoned, value), or (None, None) for a clean step."""
SDP4BIT = ["--quantized-weights", "--quantized-gradients", "--hadamard-transform",
           "--data-parallel-intra-node-size", "2"]
SCENARIOS = {  # label -> (flags, strategy, PaRO engine)
    "megatron-core": ([], "NNG", False),
    "sdp4bit": (SDP4BIT, "NNG", False),
    "sdp4bit+loco": (SDP4BIT + ["--loco"], "NNG", False),
    "paro:NIG": (["--paro-strategy", "NIG"], "NIG", True),
    "paro:NIG+qgrad": (["--paro-strategy", "NIG", "--quantized-gradients"], "NIG", True),
}


def _leaves(opt: Any) -> List[Any]:
    return getattr(opt, "chained_optimizers", None) or [opt]


def _state(model: List[torch.nn.Module], opt: Any) -> torch.Tensor:
    """This rank's model parameters and optimizer master parameters, flattened (fp32)."""
    parts = [p.detach().float().reshape(-1) for p in model[0].module.parameters()]
    parts += [p.detach().float().reshape(-1) for o in _leaves(opt) for p in o.get_parameters()]
    return torch.cat(parts)


def _poison(model: List[torch.nn.Module], value: float):
    """Hook one element of one weight's gradient to ``value`` (before DDP / the PaRO engine
    accumulate it), for every micro-batch of the step; returns the handle to remove."""
    name, param = next((n, p) for n, p in model[0].module.named_parameters()
                       if "linear_fc1.weight" in n)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = value
        return grad

    return param.register_hook(hook)


def _nonfinite_events(model: List[torch.nn.Module]) -> int:
    """Quantized collectives of this rank that met NaN/Inf (0 on the exact paths)."""
    rt = getattr(model[0], "quant_runtime", None)
    if rt is not None:
        return int(rt.nonfinite_events)
    return int(getattr(model[0], "nonfinite_events", 0))


def _worker(rank: int, world: int) -> Dict[str, Any]:
    import torch.distributed as dist

    from megatron.distributed.quant import integration
    from megatron.training.arguments import parse_args
    from megatron.training.step import forward_step, step_outcome, train_step

    _setup(rank, world, ["--bf16"])
    out: Dict[str, Any] = {}
    for label, (flags, strategy, engine) in SCENARIOS.items():
        args = parse_args(TINY + ["--bf16"] + flags)
        model, opt, sched = _build(args, strategy, engine)
        batches = _batches(rank, 0, len(PLAN))
        steps = []
        for it, (bad_rank, value) in enumerate(PLAN):
            integration.set_iteration(model, it + 1)
            before = _state(model, opt)
            handle = _poison(model, value) if bad_rank == rank else None
            loss, ok, norm, reason = train_step(args, partial(forward_step, args), batches,
                                                model, opt, sched, torch.device("cpu"))
            if handle is not None:
                handle.remove()
            after = _state(model, opt)
            skipped, nan = step_outcome(ok, reason, loss)
            steps.append({"ok": ok, "reason": reason, "skipped": skipped, "nan": nan,
                          "loss": loss, "norm": norm, "unchanged": torch.equal(before, after),
                          "finite": bool(torch.isfinite(after).all())})
        params = torch.cat([p.detach().float().reshape(-1) for p in model[0].module.parameters()])
        gathered = [torch.empty_like(params) for _ in range(world)]
        dist.all_gather(gathered, params)
        out[label] = {"steps": steps, "events": _nonfinite_events(model),
                      "replicas_identical": all(torch.equal(gathered[0], g) for g in gathered)}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> List[Dict[str, Any]]:
    return run_distributed(WORLD, _worker, tmp_path_factory.mktemp("faults"))


@pytest.mark.parametrize("label", list(SCENARIOS))
def test_poisoned_step_is_skipped_on_every_rank(results, label):
    for rank, r in enumerate(results):
        for it, (bad_rank, value) in enumerate(PLAN):
            step = r[label]["steps"][it]
            if bad_rank is None:
                continue
            assert (step["ok"], step["reason"]) == (False, "nan"), (label, rank, it, step)
            assert step["unchanged"], (label, rank, it)  # parameters and master weights
            assert (step["skipped"], step["nan"]) == (True, True)  # nan iterations: 1
            assert math.isfinite(step["loss"])  # only the gradient was poisoned
        # The trainer's counters over the run: two nan (and skipped) iterations, nothing else.
        assert sum(s["nan"] for s in r[label]["steps"]) == 2
        assert sum(s["skipped"] for s in r[label]["steps"]) == 2


@pytest.mark.parametrize("label", list(SCENARIOS))
def test_training_continues_finitely(results, label):
    for rank, r in enumerate(results):
        for it, (bad_rank, _) in enumerate(PLAN):
            step = r[label]["steps"][it]
            if bad_rank is not None:
                continue
            assert (step["ok"], step["reason"]) == (True, ""), (label, rank, it, step)
            assert not step["unchanged"] and step["finite"], (label, rank, it)
            assert math.isfinite(step["loss"]) and math.isfinite(step["norm"])
        assert r[label]["replicas_identical"], (label, rank)
        assert [s["loss"] for s in r[label]["steps"]] == [s["loss"] for s in results[0][label]["steps"]]


@pytest.mark.parametrize("label", [l for l in SCENARIOS if "sdp4bit" in l or "qgrad" in l])
def test_quantized_paths_refuse_to_quantize_the_non_finite_values(results, label):
    """TLq's agreement step saw the NaN / Inf (no payload moved): reported as events."""
    assert all(r[label]["events"] >= 2 for r in results), [r[label]["events"] for r in results]
