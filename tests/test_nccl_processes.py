"""bench/nccl_processes.py, the 4-process check a GPU session runs on NCCL, in its CPU form
(gloo): every check of its report passes here, so on the GPU a FAIL is the GPU's (issue 36).

Why a test: the script is what a 15-minute device session runs first; a flag it passes that the
trainer refuses, or a comparison that can never pass, would spend that session on nothing. Here
it runs for real: overlap on vs off and a save / resume bit for bit, the loss against the
baseline, the NaN step skipped, PaRO IIG on the engine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_the_four_process_check_passes_on_gloo(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, str(REPO / "bench" / "nccl_processes.py"),
                          "--device", "cpu", "--out", str(tmp_path), "--iters", "6"],
                         cwd=REPO, capture_output=True, text=True, timeout=1500)
    report = (tmp_path / "report.md").read_text() if (tmp_path / "report.md").exists() else ""
    assert res.returncode == 0, report + res.stdout[-3000:] + res.stderr[-3000:]
    rows = [line for line in report.splitlines()
            if line.startswith("| ") and not line.startswith("| check |")]
    assert len(rows) == 6 and all("| PASS |" in row for row in rows), report
    assert "skipped at [3]" in report and "equal" in report
