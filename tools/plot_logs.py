#!/usr/bin/env python3
"""Turn training logs into a loss-curve comparison PNG.

Each run is given as ``LABEL=PATH``, where PATH is either a JSON-lines metrics file written by
``pretrain_gpt.py --jsonl-log`` (one object per log interval, with an ``iteration`` key) or a
tensorboard log directory written via ``--tensorboard-dir``. Usage::

    python tools/plot_logs.py baseline=runs/base/metrics.jsonl sdp4bit=runs/sdp/tb \
        --metric "lm loss" --output loss.png

Besides the picture it prints a small markdown table (final value per run and its difference to
the first run) so the numbers behind the plot are in the log too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List, Sequence, Tuple

Series = List[Tuple[int, float]]

# metric -> (record "type" in the trainer's --jsonl-log, its keys there, tensorboard tags).
# The trainer writes train and validation records with the same "lm_loss" key, so the record type
# must select them; records without a "type" (other tools' logs) match any metric.
METRICS = {
    "lm loss": ("train", ("lm_loss", "lm loss", "loss"), ("lm loss",)),
    "validation loss": ("valid", ("lm_loss", "lm loss", "val_loss"), ("lm loss validation",)),
    "grad norm": ("train", ("grad_norm", "grad norm"), ("grad-norm",)),
    "learning rate": ("train", ("lr",), ("learning-rate",)),
}


def _spec(metric: str):
    return METRICS.get(metric, (None, (metric,), (metric,)))


def read_jsonl(path: str, metric: str) -> Series:
    """(iteration, value) pairs of `metric` from a JSON-lines file; other records are skipped."""
    record_type, keys, _ = _spec(metric)
    series: Series = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            if "iteration" not in record:
                continue
            if record_type is not None and record.get("type", record_type) != record_type:
                continue
            for key in keys:
                if record.get(key) is not None:
                    series.append((int(record["iteration"]), float(record[key])))
                    break
    return series


def read_tensorboard(logdir: str, metric: str) -> Series:
    """(step, value) pairs of the first tag matching `metric` in a tensorboard log directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags().get("scalars", [])
    for name in _spec(metric)[2]:
        if name in tags:
            return [(e.step, e.value) for e in acc.Scalars(name)]
    raise ValueError(f"{logdir}: no scalar tag for {metric!r}; tags present: {sorted(tags)}")


def read_run(path: str, metric: str) -> Series:
    """The run's (iteration, value) points in iteration order. An iteration logged twice (a
    resumed run appends to its --jsonl-log and repeats the iterations after its checkpoint)
    keeps its last value, the one the finished run trained through."""
    if os.path.isdir(path):
        series = read_tensorboard(path, metric)
    elif os.path.isfile(path):
        series = read_jsonl(path, metric)
    else:
        raise FileNotFoundError(f"no such log file or directory: {path}")
    if not series:
        raise ValueError(f"{path}: no values for metric {metric!r}")
    return sorted(dict(series).items())


def parse_run_spec(spec: str) -> Tuple[str, str]:
    if "=" not in spec:
        return os.path.basename(os.path.normpath(spec)), spec
    label, path = spec.split("=", 1)
    return label, path


def run_labels(specs: Sequence[str]) -> List[Tuple[str, str]]:
    """(label, path) per ``LABEL=PATH`` or ``PATH``. A label derived from a path is its last
    component, widened with parent directories until it differs from the others' (two
    ``metrics.jsonl`` of two runs: ``base/metrics.jsonl``, ``sdp/metrics.jsonl``); the same
    explicit label twice is an error (the second run would replace the first)."""
    parsed = [(parse_run_spec(s), "=" in s) for s in specs]
    explicit = [label for (label, _), given in parsed if given]
    twice = sorted({label for label in explicit if explicit.count(label) > 1})
    if twice:
        raise ValueError(f"label(s) {', '.join(twice)} given to more than one run")
    labels = [label for (label, _), _ in parsed]
    depth = {i: 1 for i, (_, given) in enumerate(parsed) if not given}
    while True:
        clash = [i for i in depth if labels.count(labels[i]) > 1]
        parts = {i: os.path.normpath(parsed[i][0][1]).split(os.sep) for i in clash}
        grow = [i for i in clash if depth[i] < len(parts[i])]
        if not grow:
            break
        for i in grow:
            depth[i] += 1
            labels[i] = "/".join(parts[i][-depth[i]:])
    if len(set(labels)) != len(labels):
        raise ValueError("two runs have the same path: give them labels (LABEL=PATH)")
    return [(label, path) for label, ((_, path), _) in zip(labels, parsed)]


def summary_table(runs: Dict[str, Series], metric: str) -> str:
    """Markdown table of each run's final value and its relative difference to the first run."""
    labels = list(runs)
    ref = runs[labels[0]][-1][1]
    lines = [f"| run | final iteration | final {metric} | vs {labels[0]} |", "|---|---|---|---|"]
    for label in labels:
        it, value = runs[label][-1]
        rel = (value - ref) / abs(ref) * 100 if ref else math.nan
        lines.append(f"| {label} | {it} | {value:.4f} | {rel:+.2f}% |")
    return "\n".join(lines)


def read_summary(path: str) -> Dict[str, object]:
    """The end-of-run ``summary`` record of a ``--jsonl-log`` file ({} if it has none)."""
    if not os.path.isfile(path):
        return {}
    summary: Dict[str, object] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{") and '"summary"' in line:
                record = json.loads(line)
                if record.get("type") == "summary":
                    summary = record  # the last one: a resumed run appends another
    return summary


def communication_table(summaries: Dict[str, Dict[str, object]]) -> str:
    """Markdown table of each run's final losses and the bits per element it sent between nodes.

    An unquantized run logs no bit counts; its row shows what a quantized run of the table
    reports the unquantized wire would carry (``*_inter_baseline_bits_per_element``)."""
    def bits(summary: Dict[str, object], kind: str) -> str:
        value = summary.get(f"{kind}_inter_bits_per_element")
        if value is not None:
            return f"{float(value):.2f}"
        for other in summaries.values():
            base = other.get(f"{kind}_inter_baseline_bits_per_element")
            if base is not None:
                return f"{float(base):.2f} (unquantized)"
        return "n/a"

    def num(value: object) -> str:
        return f"{float(value):.4f}" if isinstance(value, (int, float)) else "n/a"

    lines = ["| run | final train loss | final validation loss | ms/iteration | inter-node bits/"
             "element, gradients | inter-node bits/element, weights |", "|---|---|---|---|---|---|"]
    for label, summary in summaries.items():
        lines.append(f"| {label} | {num(summary.get('final_lm_loss'))} | "
                     f"{num(summary.get('final_val_loss'))} | "
                     f"{float(summary.get('ms_per_iteration', math.nan)):.1f} | "
                     f"{bits(summary, 'grad')} | {bits(summary, 'weight')} |")
    return "\n".join(lines)


def plot(runs: Dict[str, Series], metric: str, output: str, title: str | None = None,
         logy: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, series in runs.items():
        xs, ys = zip(*series)
        ax.plot(xs, ys, label=label, linewidth=1.4)
    ax.set_xlabel("iteration")
    ax.set_ylabel(metric)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title or f"{metric} by iteration")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="LABEL=PATH (JSONL metrics file or tensorboard dir)")
    parser.add_argument("--metric", default="lm loss")
    parser.add_argument("--output", default="loss_curves.png")
    parser.add_argument("--title", default=None)
    parser.add_argument("--logy", action="store_true")
    args = parser.parse_args(argv)

    runs: Dict[str, Series] = {}
    try:
        labelled = run_labels(args.runs)
        for label, path in labelled:
            runs[label] = read_run(path, args.metric)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    plot(runs, args.metric, args.output, args.title, args.logy)
    print(summary_table(runs, args.metric))
    summaries = {label: read_summary(path) for label, path in labelled}
    if any(summaries.values()):
        print()
        print(communication_table({k: v for k, v in summaries.items() if v}))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
