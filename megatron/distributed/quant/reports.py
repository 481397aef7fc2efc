"""The quantized layer's reports: startup warnings, the memory and strategy lines, and the bytes,
bits and exposed time of every log interval (dense buffers, expert buffers as ``expert_*``, PaRO
engine bytes). The trainer reaches them through :mod:`.integration`."""

from __future__ import annotations

import os
import weakref
from typing import Any, Dict, List, Optional

import torch

from . import chunks
from .chunks import engine_chunks, runtimes_of
from .config import QuantizationConfig

__all__ = ["startup_warnings", "memory_report", "strategy_report", "communication_report"]


def startup_warnings(quant_config: QuantizationConfig, model_chunks: List[torch.nn.Module], *,
                     device: str, overlap: bool, tensor_parallel: int, sequence_parallel: bool,
                     environ: Optional[Dict[str, str]] = None) -> List[str]:
    """What the trainer warns about at startup: a rank placement that splits a node's ranks over
    several hosts (:mod:`.placement`), and ``CUDA_DEVICE_MAX_CONNECTIONS=1`` where it removes
    the overlap of the quantized collectives (:func:`.streams.single_hardware_queue_warning`;
    ``overlap``: gradient reduce or parameter gather overlapped, the other arguments its)."""
    from .streams import single_hardware_queue_warning

    notes = [note for rt in runtimes_of(model_chunks) for note in rt.startup_notes]
    if quant_config.enabled and not chunks.nobody_to_talk_to():
        queue = single_hardware_queue_warning(
            dict(os.environ if environ is None else environ), device=device,
            overlap=bool(overlap), tensor_parallel=tensor_parallel,
            sequence_parallel=bool(sequence_parallel))
        if queue is not None:
            notes.append(queue)
    return notes


def memory_report(model_chunks: List[torch.nn.Module]) -> Optional[str]:
    """The startup line of what the quantized layer adds to each GPU's memory for this run's
    buckets (:func:`.memory.layer_memory`, parameters stored as the config says), or None when
    no bucket is quantized."""
    from .memory import LayerMemory, layer_memory

    estimates = []
    for rt in runtimes_of(model_chunks):  # dense, then expert buffers over their own group
        numels = [n for n in rt.buffer_numel.values() if n]
        if numels:
            estimates.append(layer_memory(rt.config, numels, rt.groups.dp_size,
                                          rt.groups.intra_size, int(rt.config.paro.param_bytes)))
    if not estimates:
        return None
    # one bucket's temporaries at a time; every buffer's state held
    return LayerMemory(max(e.transient_bytes for e in estimates),
                       sum(e.persistent_bytes for e in estimates),
                       max(e.largest_bucket for e in estimates)).describe()


def strategy_report(quant_config: QuantizationConfig, model_chunks: List[torch.nn.Module],
                    optimizer: Any) -> Optional[str]:
    """The startup report of the run's strategy (``quant_config.paro``: model-state memory and
    bytes per link of one step, from the cost model; for the PaRO engine also the resident bytes
    it measures), or None without a strategy."""
    from .paro.integration import strategy_report as report

    return report(quant_config, model_chunks, optimizer)


def _flatten(report: Dict[str, Any]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for kind in ("grad", "weight"):
        entry = report.get(kind)
        if not entry or not entry.get("calls"):
            continue
        for link in ("intra", "inter", "total"):
            s = entry[link]
            if not s["bytes"] and not s["baseline_bytes"]:
                continue
            out[f"{kind}_{link}_bytes"] = float(s["bytes"])
            out[f"{kind}_{link}_baseline_bytes"] = float(s["baseline_bytes"])
            for metric in ("bits_per_element", "baseline_bits_per_element", "ratio_vs_baseline"):
                if s[metric] is not None:
                    out[f"{kind}_{link}_{metric}"] = float(s[metric])
        if entry["bits_per_model_element"] is not None:
            out[f"{kind}_bits_per_model_element"] = float(entry["bits_per_model_element"])
        out[f"{kind}_calls"] = float(entry["calls"])
    return out


def communication_report(model_chunks: List[torch.nn.Module], reset: bool = True,
                         totals: bool = False) -> Dict[str, float]:
    """Bytes/bits per element on each link since the last call (empty when quantization is off
    and no chunk is a PaRO engine); with ``totals``, over the whole run instead (for the
    end-of-run summary; resets nothing).

    Keys ``{grad|weight}_{intra|inter|total}_{bytes|bits_per_element|ratio_vs_baseline|...}``,
    ``{kind}_bits_per_model_element`` (bytes on all links per bucket element), ``{kind}_calls``,
    ``nonfinite_events`` (quantized collectives that met NaN/Inf in the interval; the expert
    buffers' as ``expert_nonfinite_events``),
    ``comm_{grad_intra|grad_inter|grad_exposed|weight|weight_exposed}_ms`` (per iteration: time
    the collectives took vs time the training thread waited for them, streams.CommTiming),
    ``quant_error_{grad|weight}_{rel|cos}`` (``--quantization-error-interval``: relative L2 error
    and cosine of the monitored quantized results vs the exact ones, this rank's shards, in
    intervals that held a monitored iteration), with LoCo ``loco_error_bytes_per_param`` (error-buffer memory on this rank per local parameter),
    and for PaRO-engine chunks ``paro_{intra|inter}_bytes`` (every byte the engine sent on each
    link, quantized or not, in the cost model's convention: comparable with its report).
    """
    merged: Dict[str, float] = {}
    rts = runtimes_of(model_chunks)
    if rts:
        merged.update(_runtime_report(rts, model_chunks, reset, totals))
    merged.update(_engine_bytes(model_chunks, reset, totals))
    return merged


def _runtime_report(rts: List[Any], model_chunks: List[torch.nn.Module], reset: bool,
                    totals: bool) -> Dict[str, float]:
    merged: Dict[str, float] = {}
    nonfinite: Dict[str, float] = {"nonfinite_events": 0.0}
    for rt in rts:
        report = rt.accounting.totals() if totals else rt.accounting.interval_report()
        prefix = f"{rt.name}_" if rt.name else ""  # expert buffers: expert_grad_inter_bytes ...
        for k, v in ((prefix + k, v) for k, v in _flatten(report).items()):
            if "bits" in k or "ratio" in k:
                merged.setdefault(k, v)  # one dense (and one expert) runtime per model
            else:
                merged[k] = merged.get(k, 0.0) + v
        # per runtime (the expert one as expert_nonfinite_events): a step both flag counts once in each
        key = prefix + "nonfinite_events"
        nonfinite[key] = nonfinite.get(key, 0.0) + float(
            rt.nonfinite_events if totals else rt.nonfinite_events_interval)
        if not totals:  # total vs exposed communication ms per iteration (per runtime)
            # Only the kinds this layer sends (and times): megatron-core's own exact collectives
            # are not timed, and a 0.000 for them would read as "free".
            timed = ("comm_grad" if rt.config.quantized_gradients else None,
                     "comm_weight" if rt.config.quantized_weights else None)
            merged.update({prefix + k: v for k, v in rt.timing.interval_report(reset=reset).items()
                           if k.startswith(tuple(t for t in timed if t))})
            # --quantization-error-interval: quantized vs exact over the interval's samples
            merged.update({prefix + k: v for k, v in rt.errors.report(reset=reset).items()})
        if reset and not totals:
            rt.accounting.reset_interval()
            rt.nonfinite_events_interval = 0
    merged.update(nonfinite)
    locos = [rt.loco for rt in rts if rt.loco is not None]
    if locos:
        # LoCo's memory overhead on this rank, per local model parameter (int8 codes + scales).
        n_params = sum(p.numel() for chunk in model_chunks for p in chunk.parameters())
        merged["loco_error_bytes_per_param"] = sum(l.memory_bytes() for l in locos) / max(1, n_params)
    return merged


_ENGINE_RUN_BYTES: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[str, float]]" = (
    weakref.WeakKeyDictionary())
"""Per PaRO-engine chunk, the bytes of the intervals already reported (the engine's counter holds
only those since the last report)."""


def _engine_bytes(model_chunks: List[torch.nn.Module], reset: bool,
                  totals: bool) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for chunk in engine_chunks(model_chunks):
        run = _ENGINE_RUN_BYTES.setdefault(chunk, {"intra": 0.0, "inter": 0.0})
        counted = chunk.counter.bytes
        for link in ("intra", "inter"):
            key = f"paro_{link}_bytes"
            out[key] = out.get(key, 0.0) + counted[link] + (run[link] if totals else 0.0)
        if reset and not totals:
            for link in ("intra", "inter"):
                run[link] += counted[link]
            chunk.counter.reset()
    return out
