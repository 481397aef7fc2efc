"""The planner's table and its recommendation.

Why this recommendation rule: the fastest variant that fits in the GPU's memory, unless it is
within the model's own error of the baseline (5 %), where nothing is worth a change of numerics;
every row shows what the prediction is made of, so a user can see which term decides.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from .timeline import Prediction

__all__ = ["format_table", "recommend", "NOT_WORTH"]

NOT_WORTH = 0.05
"""Predicted gains below this fraction are inside the model's own error: keep the baseline."""


def recommend(rows: Sequence[Prediction], memory_limit: float) -> Tuple[Optional[Prediction], str]:
    """(the recommended row, why)."""
    fits = [r for r in rows if r.memory_bytes <= memory_limit]
    if not fits:
        return None, (f"nothing fits in {memory_limit / 2**30:.0f} GiB per GPU: more tensor / "
                      "pipeline parallelism, recomputation or a PaRO strategy that shards more")
    best = min(fits, key=lambda r: r.iteration_s)
    base = next((r for r in fits if r.variant == "baseline"), None)
    if base is not None and best is not base and base.iteration_s <= best.iteration_s * (1 + NOT_WORTH):
        return base, (f"{best.variant} is predicted only {base.iteration_s / best.iteration_s:.2f}x "
                      "faster: within the model's error, keep the baseline")
    why = f"fastest that fits in {memory_limit / 2**30:.0f} GiB"
    if base is not None and best is not base:
        why += f", {base.iteration_s / best.iteration_s:.2f}x the baseline's speed"
    return best, why


def _mb(x: float) -> str:
    return f"{x / 1e6:.1f}"


def format_table(rows: Sequence[Prediction], skipped: Sequence[Tuple[str, str]] = ()) -> str:
    """A markdown table, one row per variant; an MoE run with expert buffers (EP > 1) gets their
    bytes per link in columns of their own (``expert inter``, ``expert intra``) beside the dense
    buffers'."""
    base = next((r for r in rows if r.variant == "baseline"), None)
    experts = any(r.bytes_per_link.get("expert_inter", 0) or r.bytes_per_link.get("expert_intra", 0)
                  for r in rows)
    head = ("| variant | ms/iter | TFLOP/s/GPU | vs baseline | compute ms | grad exposed ms | "
            "weight exposed ms | optimizer ms | contention ms | inter MB/GPU | "
            "intra MB/GPU | " + ("expert inter MB/GPU | expert intra MB/GPU | " if experts else "")
            + "memory GiB/GPU |")
    columns = head.count("|") - 1
    lines: List[str] = [head, "|---|" + "---:|" * (columns - 1)]
    for r in rows:
        speed = f"{base.iteration_s / r.iteration_s:.2f}x" if base else "-"
        lines.append(
            f"| {r.variant} | {1e3 * r.iteration_s:.1f} | {r.tflops_per_gpu:.1f} | {speed} | "
            f"{1e3 * r.compute_s:.1f} | {1e3 * r.grad_exposed_s:.1f} | {1e3 * r.weight_exposed_s:.1f} | "
            f"{1e3 * r.optimizer_s:.1f} | {1e3 * r.contention_s:.1f} | "
            f"{_mb(r.bytes_per_link['inter'])} | {_mb(r.bytes_per_link['intra'])} | "
            + (f"{_mb(r.bytes_per_link.get('expert_inter', 0.0))} | "
               f"{_mb(r.bytes_per_link.get('expert_intra', 0.0))} | " if experts else "")
            + f"{r.memory_bytes / 2**30:.1f} |")
    for label, why in skipped:
        lines.append(f"| {label} | n/a: {why} |" + " |" * (columns - 2))
    return "\n".join(lines)
