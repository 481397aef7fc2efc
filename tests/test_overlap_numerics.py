"""Overlap, bucket order and ``--gradient-alltoall-pipeline`` never change the numbers.

Why: with ``--overlap-grad-reduce`` the quantized reduce-scatter of every bucket runs on worker
stages (megatron/distributed/quant/streams.py) while backward goes on, with
``--overlap-param-gather`` the quantized weight all-gather of the next bucket group runs while
forward computes, and ``--gradient-alltoall-pipeline K`` cuts each bucket's exchanges into K
chunks whose middle requantization must round exactly like the whole bucket's. Any of these could
silently change which random numbers a group draws, or read a buffer before it is final. So a 2x2
layout (4 ranks, 2 "nodes" of 2) trains SDP4Bit (TLq-HS 8/4-bit + qWD 4-bit) and SDP4Bit+LoCo
with every combination on the same bucket layout, and the losses and parameters must be
bit-identical.

megatron-core builds one bucket without ``--overlap-grad-reduce`` and honours ``bucket_size``
only with it, so the comparison runs on two layouts: one bucket (synchronous path vs overlap vs
overlap + pipeline) and several buckets (gradient overlap only vs both overlaps vs both + pipeline).
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from test_integration_ddp import build, run_distributed, same_on_all_ranks, train

STEPS = 4
SDP4BIT = {"quantized_gradients": True, "quantized_weights": True, "hadamard_transform": True,
           "gq_group_size_intra": 128, "gq_group_size_inter": 128, "wq_group_size": 128,
           "data_parallel_intra_node_size": 2}
RECIPES = {"sdp4bit": SDP4BIT, "sdp4bit_loco": {**SDP4BIT, "loco": True}}
ONE_BUCKET = {  # variant -> (DDP config overrides, --gradient-alltoall-pipeline)
    "sync": ({}, 1),
    "overlap": ({"overlap_grad_reduce": True, "overlap_param_gather": True,
                 "bucket_size": 10 ** 9}, 1),
    "overlap_pipeline3": ({"overlap_grad_reduce": True, "overlap_param_gather": True,
                           "bucket_size": 10 ** 9}, 3),
}
MANY_BUCKETS = {
    "grad_overlap": ({"overlap_grad_reduce": True, "bucket_size": 3000}, 1),
    "both_overlaps": ({"overlap_grad_reduce": True, "overlap_param_gather": True,
                       "bucket_size": 3000}, 1),
    "both_overlaps_pipeline3": ({"overlap_grad_reduce": True, "overlap_param_gather": True,
                                 "bucket_size": 3000}, 3),
    # --quantization-error-interval 2: iterations 0 and 2 run inline with the exact
    # reduce-scatter beside the quantized one; the numbers must not move.
    "both_overlaps_monitor2": ({"overlap_grad_reduce": True, "overlap_param_gather": True,
                                "bucket_size": 3000}, 1, {"quantization_error_interval": 2}),
    # --overlap-param-gather-with-optimizer-step: every gather starts right after the step
    "both_overlaps_gather_after_step": ({"overlap_grad_reduce": True, "overlap_param_gather": True,
                                         "bucket_size": 3000}, 1, {},
                                        {"overlap_param_gather_with_optimizer_step": True}),
}

SKIPPED_STEP = {"both_overlaps": None,
                "gather_after_step": {"overlap_param_gather_with_optimizer_step": True}}


def _scenarios(rank: int, world: int) -> Dict[str, Any]:
    from megatron.distributed.quant import integration
    from megatron.distributed.quant.collectives.gradients import pipeline_bounds

    res: Dict[str, Any] = {}
    for recipe, qkw in RECIPES.items():
        for layout, variants in (("one", ONE_BUCKET), ("many", MANY_BUCKETS)):
            for name, (ddpkw, k, *extra) in variants.items():
                chunks, opt, qc = build({**qkw, "gradient_alltoall_pipeline": k,
                                         **(extra[0] if extra else {})}, ddpkw,
                                        optkw=extra[1] if len(extra) > 1 else None)
                # right after each step: which bucket groups already have their gather in flight
                in_flight: List[List[bool]] = []
                out = train(chunks, opt, rank, STEPS, on_step=lambda it, c=chunks: in_flight.append(
                    [g.param_gather_dispatched and g.param_gather_handle is not None
                     for g in c[0].bucket_groups]))
                key = f"{recipe}/{layout}/{name}"
                res[key] = {"losses": out["losses"], "params": out["params"], "in_flight": in_flight,
                            "oks": out["oks"], "same_on_ranks": same_on_all_ranks(out["params"]),
                            "errors": {k: v for k, v in integration.communication_report(
                                chunks).items() if k.startswith("quant_error_")}}
                groups = chunks[0].bucket_groups
                res[key]["buckets"] = sum(len(g.buckets) for g in groups)
                # how many chunks the pipeline really cut each bucket into
                shards = [b.grad_data.numel() // world for g in groups for b in g.buckets]
                res[key]["chunks"] = [len(pipeline_bounds(s, 128, k)) for s in shards]
        # A NaN gradient on rank 1 in step 1 (a tensor hook, so it is in place before the
        # overlapped reduce-scatter reads the bucket): the step is skipped on every rank, with
        # and without the gathers started after the step; nothing is dispatched after the skip.
        for name, optkw in SKIPPED_STEP.items():
            chunks, opt, _ = build({**qkw}, MANY_BUCKETS["both_overlaps"][0], optkw=optkw)
            poison = {"on": False}
            first = next(p for p in chunks[0].module.parameters() if p.requires_grad)
            if rank == 1:
                first.register_hook(lambda g: torch.full_like(g, float("nan")) if poison["on"]
                                    else None)
            in_flight = []

            def after_step(it: int, c=chunks) -> None:
                in_flight.append([g.param_gather_dispatched and g.param_gather_handle is not None
                                  for g in c[0].bucket_groups])
                poison["on"] = it == 0  # poison the backward of step 1

            out = train(chunks, opt, rank, STEPS, on_step=after_step)
            res[f"{recipe}/skipped/{name}"] = {"losses": out["losses"], "params": out["params"],
                                               "oks": out["oks"], "in_flight": in_flight,
                                               "same_on_ranks": same_on_all_ranks(out["params"])}
    return res


@pytest.fixture(scope="module")
def results() -> List[Dict[str, Any]]:
    return run_distributed(_scenarios, 4)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("layout,variants", [("one", ONE_BUCKET), ("many", MANY_BUCKETS)])
def test_overlap_and_pipeline_bit_identical(results, recipe: str, layout: str,
                                            variants: Dict[str, Any]) -> None:
    for rank, res in enumerate(results):
        runs = {name: res[f"{recipe}/{layout}/{name}"] for name in variants}
        first_name, first = next(iter(runs.items()))
        assert all(first["oks"]) and len(first["losses"]) == STEPS
        for name, run in runs.items():
            assert run["same_on_ranks"], (rank, name)
            assert run["losses"] == first["losses"], (rank, name, first_name, run["losses"],
                                                      first["losses"])
            assert torch.equal(run["params"], first["params"]), (rank, name, first_name)
        expected_buckets = 1 if layout == "one" else 2
        assert min(r["buckets"] for r in runs.values()) >= expected_buckets
        piped = [r for n, r in runs.items() if n.endswith("pipeline3")]
        assert piped and all(max(r["chunks"]) > 1 for r in piped), \
            "the pipelined variant must really cut buckets into chunks"
    # quantization really acted: the two recipes differ (LoCo changes the rounding)
    a = results[0][f"sdp4bit/{layout}/{next(iter(variants))}"]["losses"]
    b = results[0][f"sdp4bit_loco/{layout}/{next(iter(variants))}"]["losses"]
    assert a != b


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_error_monitor_reports_without_changing_the_numbers(results, recipe: str) -> None:
    """``--quantization-error-interval``: the monitored run is bit-identical (checked above, it
    is a variant of the many-bucket layout) and reports plausible errors; the others report
    none. Bounds: 8/4-bit TLq-HS gradients and 4-bit qWD weights of this model measure a few
    percent relative error (a broken comparison -- wrong shard, wrong layout -- gives ~1.4 or
    more, cosine near 0)."""
    for res in results:
        errors = res[f"{recipe}/many/both_overlaps_monitor2"]["errors"]
        assert 0.0 < errors["quant_error_grad_rel"] < 0.5, errors
        assert errors["quant_error_grad_cos"] > 0.9, errors
        assert 0.0 < errors["quant_error_weight_rel"] < 0.5, errors
        assert errors["quant_error_weight_cos"] > 0.9, errors
        assert res[f"{recipe}/many/both_overlaps"]["errors"] == {}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_gather_after_optimizer_step_dispatches_every_group(results, recipe: str) -> None:
    """``--overlap-param-gather-with-optimizer-step`` (bit-identical: a variant above): after
    every step, every bucket group's weight gather is already in flight; without the flag none
    is (megatron-core dispatches them from the next forward's pre-hooks)."""
    for res in results:
        after = res[f"{recipe}/many/both_overlaps_gather_after_step"]["in_flight"]
        assert len(after) == STEPS and len(after[0]) >= 2
        assert all(all(step) for step in after), after
        plain = res[f"{recipe}/many/both_overlaps"]["in_flight"]
        assert not any(any(step) for step in plain), plain


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_skipped_step_with_gathers_after_the_step(results, recipe: str) -> None:
    """A NaN gradient skips step 1 on every rank; with the gathers started after each step the
    run stays bit-identical to the one without (the skipped step dispatches nothing, the next
    forward gathers on demand and the update after it is dispatched again)."""
    for res in results:
        plain = res[f"{recipe}/skipped/both_overlaps"]
        after = res[f"{recipe}/skipped/gather_after_step"]
        assert plain["oks"] == after["oks"] == [True, False, True, True]
        assert plain["losses"] == after["losses"] and torch.equal(plain["params"], after["params"])
        assert plain["same_on_ranks"] and after["same_on_ranks"]
        assert [all(s) for s in after["in_flight"]] == [True, False, True, True]
        assert [any(s) for s in after["in_flight"]] == [True, False, True, True]
        assert not any(any(s) for s in plain["in_flight"])
