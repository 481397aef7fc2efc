"""The log intervals' communication counts add up to the run's totals.

Why: with ``--overlap-param-gather`` the parameter all-gather of an update runs at the *next*
forward pass, so the last update's gather happens after the last log line (at the end-of-run
evaluation, or the checkpoint's forced sync). The summary's totals counted it but no interval
did, so the per-interval weight bytes summed to one gather less than the total. The trainer now
reports what happened after the last log line as a final interval (``final_interval`` record);
the same closes the gap for a run whose length is not a multiple of ``--log-interval``.
"""

from __future__ import annotations

import json
from pathlib import Path


def test_intervals_sum_to_totals_with_overlapped_param_gather(tmp_path: Path, run_pretrain) -> None:
    jsonl = tmp_path / "log.jsonl"
    res = run_pretrain([
        "--global-batch-size", "4", "--train-iters", "5", "--lr", "1e-3", "--bf16",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--quantized-weights", "--quantized-gradients", "--log-interval", "2",
        "--eval-interval", "100", "--eval-iters", "1", "--jsonl-log", str(jsonl)])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    final = [r for r in records if r["type"] == "final_interval"]
    summary = records[-1]
    assert summary["type"] == "summary" and [r["iteration"] for r in train] == [2, 4]
    assert len(final) == 1 and final[0]["iterations"] == 1  # iteration 5 + the end-of-run eval
    assert " final interval (after the last log line, to iteration 5) |" in res.stdout

    counts = [k for k in summary if k.endswith(("_bytes", "_calls"))]
    assert {"weight_total_bytes", "weight_calls", "grad_total_bytes", "grad_calls"} <= set(counts)
    for key in counts:
        assert sum(r.get(key, 0.0) for r in train + final) == summary[key], key
    for key in ("skipped_iterations", "nan_iterations"):
        assert sum(r[key] for r in train + final) == summary[key]
    # Total vs exposed communication time per iteration (streams.CommTiming) is in every line.
    for r in train:
        for key in ("comm_grad_intra_ms", "comm_grad_inter_ms", "comm_grad_exposed_ms",
                    "comm_weight_ms", "comm_weight_exposed_ms"):
            assert r[key] >= 0.0, (key, r)
        assert r["comm_grad_intra_ms"] > 0.0 and r["comm_weight_ms"] > 0.0
    assert "comm_grad_exposed_ms: " in res.stdout
    # The iteration line is Megatron-LM's plus at most four communication figures (issue 23:
    # it was ~2,000 characters); everything else is in the jsonl records above.
    from megatron.training.log import LOG_LINE_COMM_KEYS

    lines = [l for l in res.stdout.splitlines() if l.startswith(" iteration ")]
    assert len(lines) == 2
    for line in lines:
        names = {f.split(":")[0].strip() for f in line.split("|") if ":" in f}
        extra = {n for n in names if "_" in n}
        assert extra and extra <= set(LOG_LINE_COMM_KEYS), extra
        assert len(line) < 500, len(line)
    # The log lines alone miss gathers: the lines at iterations 2 and 4 saw 3 of the 5 (each
    # update's gather runs in the next iteration's forward).
    assert sum(r["weight_calls"] for r in train) == 3 and summary["weight_calls"] == 5
