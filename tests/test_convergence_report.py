"""bench/convergence.py's multi-seed report: the statistics behind "exceeds the seed noise".

Why: the convergence study's conclusion (which quantized variant's final loss differs from the
baseline's by more than the seeds' spread) is computed here; a wrong pairing of seeds, a
population instead of a sample deviation or a swapped test would silently change what
docs/results.md claims. Synthetic jsonl files, no training.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def conv():
    spec = importlib.util.spec_from_file_location("bench_convergence", ROOT / "bench" / "convergence.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_convergence"] = mod
    spec.loader.exec_module(mod)
    return mod


def _write_run(out: Path, name: str, seed: int, final_val: float, iters: int = 100) -> None:
    path = out / name / f"seed{seed}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    recs = [{"type": "train", "iteration": i, "lm_loss": final_val + 1.0 + 10.0 / i,
             **({"grad_total_bytes": 1.0, "grad_intra_bits_per_element": 8.06,
                 "grad_inter_bits_per_element": 4.25} if name != "baseline" else {})}
            for i in range(20, iters + 1, 20)]
    recs += [{"type": "valid", "iteration": i, "lm_loss": final_val + (iters - i) / 100.0}
             for i in range(50, iters + 1, 50)]
    recs.append({"type": "summary", "iterations": iters})
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def test_welch_and_paired_tests_match_scipy_and_the_textbook(conv) -> None:
    from scipy import stats

    base = [5.00, 5.02, 4.98]
    other = [5.10, 5.13, 5.08]
    res = conv.compare(base, other, paired=True)
    assert res["delta"] == pytest.approx(statistics.fmean(other) - statistics.fmean(base))
    # Welch by hand: t = d / sqrt(s1^2/n1 + s2^2/n2), Welch-Satterthwaite degrees of freedom
    v1, v2 = statistics.variance(other) / 3, statistics.variance(base) / 3
    t = res["delta"] / (v1 + v2) ** 0.5
    df = (v1 + v2) ** 2 / (v1 ** 2 / 2 + v2 ** 2 / 2)
    assert res["welch_p"] == pytest.approx(2 * stats.t.sf(abs(t), df), rel=1e-9)
    diffs = [o - b for o, b in zip(other, base)]
    tp = statistics.fmean(diffs) / (statistics.stdev(diffs) / 3 ** 0.5)
    assert res["paired_p"] == pytest.approx(2 * stats.t.sf(abs(tp), 2), rel=1e-9)
    assert res["paired_std"] == pytest.approx(statistics.stdev(diffs))
    # unpaired seeds: no paired test; one seed: no test at all
    assert conv.compare(base, other, paired=False)["paired_p"] != conv.compare(base, other, paired=False)["paired_p"]
    one = conv.compare([5.0], [5.1], paired=True)
    assert one["welch_p"] != one["welch_p"] and one["paired_p"] != one["paired_p"]  # NaN


def test_report_flags_only_differences_beyond_the_seed_spread(conv, tmp_path: Path) -> None:
    a = conv.parse_args(["--variants", "baseline", "qW-4bit", "SDP4Bit", "--seeds", "1", "2", "3",
                         "--iters", "100", "--out", str(tmp_path)])
    finals = {"baseline": [5.00, 5.03, 4.97],
              "qW-4bit": [5.20, 5.24, 5.19],     # far outside the spread
              "SDP4Bit": [5.01, 5.00, 4.99]}     # inside it
    for name, vals in finals.items():
        for seed, v in zip(a.seeds, vals):
            _write_run(tmp_path, name, seed, v)
    md = conv.report(a, tmp_path, times={"baseline/seed1": 10.0})
    rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines()
            if line.startswith("| ") and " ± " in line}
    assert "**yes** (higher)" in rows["qW-4bit"]
    assert "| no |" in rows["SDP4Bit"]
    summary = json.loads((tmp_path / "convergence.json").read_text())
    q = summary["variants"]["qW-4bit"]
    assert q["final_val"] == finals["qW-4bit"] and q["seeds"] == [1, 2, 3]
    assert q["val_mean"] == pytest.approx(statistics.fmean(finals["qW-4bit"]))
    assert q["val_std"] == pytest.approx(statistics.stdev(finals["qW-4bit"]))  # sample std
    assert q["welch_p"] < 0.05 < summary["variants"]["SDP4Bit"]["welch_p"]
    assert "5.0000 ± 0.0300" in rows["baseline"]  # mean ± sample std of the baseline
    assert (tmp_path / "loss_curves.png").stat().st_size > 0
    # a run without its summary record (killed) is not counted
    (tmp_path / "SDP4Bit" / "seed3.jsonl").write_text(
        "\n".join(line for line in (tmp_path / "SDP4Bit" / "seed3.jsonl").read_text().splitlines()
                  if '"summary"' not in line) + "\n")
    conv.report(a, tmp_path, times={})
    summary = json.loads((tmp_path / "convergence.json").read_text())
    assert summary["variants"]["SDP4Bit"]["seeds"] == [1, 2]
    assert summary["variants"]["SDP4Bit"]["paired_p"] != summary["variants"]["SDP4Bit"]["paired_p"]
