"""Communication-volume accounting for the quantized collectives.

Per collective: the payload bytes (codes and scales) this rank sends, by link ('intra' or
'inter'), counted the same way for the quantized path and megatron-core's baseline so that
``ratio`` on a link is the compression alone. "Bits per element" is ``8 * bytes / elements``.
"""
# See [Note: byte accounting convention] in docs/architecture.md

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, Iterable, Optional, Sequence, Tuple

from .kernels.reference import QuantizedTensor

if TYPE_CHECKING:
    from .config import HopSpec

__all__ = ["CommAccounting", "LinkCounter"]

_LINKS = ("intra", "inter")
_KINDS = ("grad", "weight")


def _two_level_shares(peers_intra: int, peers_inter: int) -> "tuple[int, int]":
    """(intra, inter) multiples of a rank's N/P that a reduce-scatter / all-gather moves in its
    two-level form over D = peers_intra + 1 ranks per node x M nodes: (D-1)*M and M-1. Per peer
    (peers_intra, peers_inter) when the group is not such a grid."""
    d = peers_intra + 1
    p = d + peers_inter
    if p % d:
        return peers_intra, peers_inter
    m = p // d
    return (d - 1) * m, m - 1


@dataclass
class LinkCounter:
    """Bytes and carried elements on one link, plus what the baseline would have sent there."""

    bytes: int = 0
    elements: int = 0
    baseline_bytes: int = 0
    baseline_elements: int = 0

    def add(self, other: "LinkCounter") -> None:
        self.bytes += other.bytes
        self.elements += other.elements
        self.baseline_bytes += other.baseline_bytes
        self.baseline_elements += other.baseline_elements

    def summary(self) -> Dict[str, Optional[float]]:
        return {
            "bytes": self.bytes,
            "elements": self.elements,
            "bits_per_element": 8.0 * self.bytes / self.elements if self.elements else None,
            "baseline_bytes": self.baseline_bytes,
            "baseline_bits_per_element": (8.0 * self.baseline_bytes / self.baseline_elements
                                          if self.baseline_elements else None),
            "ratio_vs_baseline": self.bytes / self.baseline_bytes if self.baseline_bytes else None,
        }


@dataclass
class _CollectiveStats:
    kind: str
    links: Dict[str, LinkCounter] = field(default_factory=lambda: {k: LinkCounter() for k in _LINKS})
    model_elements: int = 0
    """Gradient (fp32) / weight (bf16) elements the collective represents, i.e. the bucket size N."""
    calls: int = 0

    def add(self, other: "_CollectiveStats") -> None:
        for k in _LINKS:
            self.links[k].add(other.links[k])
        self.model_elements += other.model_elements
        self.calls += other.calls


def _check_kind(kind: str) -> None:
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")


class CommAccounting:
    """Per-rank counters of bytes sent by the quantized collectives, by link and by collective.

    Two horizons: the *interval* (since the last :meth:`reset_interval`, e.g. a log interval) and
    the *totals* (the whole run). The collectives call :meth:`record_all_to_all`,
    :meth:`record_all_gather` and :meth:`record_baseline`; the trainer calls
    :meth:`interval_report` / :meth:`format_report` and :meth:`reset_interval`.
    """

    def __init__(self) -> None:
        self._interval: Dict[str, _CollectiveStats] = {}
        self._total: Dict[str, _CollectiveStats] = {}

    # -- recording ----------------------------------------------------------------------------
    def _stats(self, name: str, kind: str) -> tuple:
        _check_kind(kind)
        pair = []
        for table in (self._interval, self._total):
            st = table.get(name)
            if st is None:
                st = table[name] = _CollectiveStats(kind=kind)
            elif st.kind != kind:
                raise ValueError(f"collective {name!r} was recorded as {st.kind!r}, now as {kind!r}")
            pair.append(st)
        return tuple(pair)

    def _add_link(self, name: str, kind: str, link: str, nbytes: int, elements: int,
                  baseline_bytes: int = 0, baseline_elements: int = 0) -> None:
        if link not in _LINKS:
            raise ValueError(f"link must be one of {_LINKS}, got {link!r}")
        if min(nbytes, elements, baseline_bytes, baseline_elements) < 0:
            raise ValueError("byte and element counts must be non-negative")
        for st in self._stats(name, kind):
            c = st.links[link]
            c.bytes += nbytes
            c.elements += elements
            c.baseline_bytes += baseline_bytes
            c.baseline_elements += baseline_elements

    def record_all_to_all(self, name: str, *, kind: str, total_bytes: int, total_elements: int,
                          group_size: int, peers_intra: int, peers_inter: int) -> None:
        """Record an equal-split all-to-all: ``total_bytes`` (codes+scales) carrying
        ``total_elements`` values, split into ``group_size`` pieces, one per group member.
        ``peers_intra + peers_inter`` must be ``group_size - 1`` (the self piece is not sent)."""
        if group_size <= 0 or peers_intra + peers_inter != group_size - 1:
            raise ValueError(f"peers_intra ({peers_intra}) + peers_inter ({peers_inter}) must equal "
                             f"group_size - 1 ({group_size - 1})")
        if total_bytes % group_size or total_elements % group_size:
            raise ValueError(f"all-to-all of {total_bytes} bytes / {total_elements} elements does not "
                             f"split evenly over {group_size} ranks")
        pb, pe = total_bytes // group_size, total_elements // group_size
        self._add_link(name, kind, "intra", pb * peers_intra, pe * peers_intra)
        self._add_link(name, kind, "inter", pb * peers_inter, pe * peers_inter)

    def record_all_gather(self, name: str, *, kind: str, shard_bytes: int, shard_elements: int,
                          peers_intra: int, peers_inter: int) -> None:
        """Record an all-gather of this rank's shard (``shard_bytes`` of codes+scales carrying
        ``shard_elements`` values) over a group with ``peers_intra`` other ranks on this node and
        ``peers_inter`` on others, in its two-level form (module docstring)."""
        intra, inter = _two_level_shares(peers_intra, peers_inter)
        self._add_link(name, kind, "intra", shard_bytes * intra, shard_elements * intra)
        self._add_link(name, kind, "inter", shard_bytes * inter, shard_elements * inter)

    def record_baseline(self, name: str, *, kind: str, numel: int, elem_size: int, dp_size: int,
                        peers_intra: int, peers_inter: int) -> None:
        """Record what megatron-core's unquantized reduce-scatter / all-gather of ``numel``
        elements of ``elem_size`` bytes over ``dp_size`` ranks would have sent (in the two-level
        form of the module docstring), and count ``numel`` as the elements this collective
        represents."""
        if dp_size <= 0 or numel % dp_size:
            raise ValueError(f"numel {numel} is not divisible by the DP size {dp_size}")
        if peers_intra + peers_inter != dp_size - 1:
            raise ValueError(f"peers_intra ({peers_intra}) + peers_inter ({peers_inter}) must equal "
                             f"dp_size - 1 ({dp_size - 1})")
        shard = numel // dp_size
        intra, inter = _two_level_shares(peers_intra, peers_inter)
        self._add_link(name, kind, "intra", 0, 0, shard * elem_size * intra, shard * intra)
        self._add_link(name, kind, "inter", 0, 0, shard * elem_size * inter, shard * inter)
        for st in self._stats(name, kind):
            st.model_elements += numel
            st.calls += 1

    def record_two_level_reduce_scatter(self, name: str, *, numel: int, elem_size: int,
                                        dp_size: int, intra_size: int, intra: "HopSpec",
                                        inter: "HopSpec") -> None:
        """Record one bucket's quantized gradient reduce-scatter (TLq / TLq-HS) of ``numel``
        elements of ``elem_size`` bytes over ``dp_size`` ranks, ``intra_size`` per node, each hop
        encoded as its :class:`~.config.HopSpec` says: the
        baseline it replaces, the first hop's all-to-all (intra-node, or inter-node when
        ``intra_size`` is 1) and, across a two-level grid, the inter-node hop's. The collective
        and the speed planner both record through this, so their bytes cannot differ."""
        p, d = dp_size, intra_size
        m = p // d
        self.record_baseline(name, kind="grad", numel=numel, elem_size=elem_size, dp_size=p,
                             peers_intra=d - 1, peers_inter=p - d)
        if d > 1:
            bits1, gs1, size1 = intra.bits, intra.group_size, d
        else:
            bits1, gs1, size1 = inter.bits, inter.group_size, m
        self.record_all_to_all(name, kind="grad", total_bytes=QuantizedTensor.wire_bytes(numel, bits1, gs1),
                               total_elements=numel, group_size=size1,
                               peers_intra=size1 - 1 if d > 1 else 0,
                               peers_inter=0 if d > 1 else size1 - 1)
        if d > 1 and m > 1:
            self.record_all_to_all(name, kind="grad",
                                   total_bytes=QuantizedTensor.wire_bytes(numel // d, inter.bits,
                                                                          inter.group_size),
                                   total_elements=numel // d, group_size=m, peers_intra=0,
                                   peers_inter=m - 1)

    def record_quantized_all_gather(self, name: str, *, shard_numel: int, elem_size: int,
                                    spec: "HopSpec",
                                    hops: "Sequence[Tuple[int, int]]") -> None:
        """Record one quantized weight all-gather of a ``shard_numel``-element shard (elements of
        ``elem_size`` bytes in the gathered output, encoded as ``spec`` says) over ``hops``, each
        hop a group given as
        (peers on this node, peers on other nodes); a later hop forwards what the earlier ones
        gathered. One hop of mixed peers is counted in :meth:`record_all_gather`'s two-level form.
        The collective and the speed planner both record through this."""
        world = math.prod(pi + pe + 1 for pi, pe in hops)
        n_intra = math.prod(pi + 1 for pi, _ in hops) - 1
        self.record_baseline(name, kind="weight", numel=shard_numel * world, elem_size=elem_size,
                             dp_size=world, peers_intra=n_intra, peers_inter=world - 1 - n_intra)
        held = shard_numel
        for pi, pe in hops:
            self.record_all_gather(name, kind="weight",
                                   shard_bytes=QuantizedTensor.wire_bytes(held, spec.bits,
                                                                          spec.group_size),
                                   shard_elements=held, peers_intra=pi, peers_inter=pe)
            held *= pi + pe + 1

    # -- reporting ----------------------------------------------------------------------------
    @staticmethod
    def _report(table: Dict[str, _CollectiveStats]) -> Dict[str, dict]:
        out: Dict[str, dict] = {}
        for kind in _KINDS:
            agg = _CollectiveStats(kind=kind)
            for st in table.values():
                if st.kind == kind:
                    agg.add(st)
            total = LinkCounter()
            for k in _LINKS:
                total.add(agg.links[k])
            entry = {k: agg.links[k].summary() for k in _LINKS}
            entry["total"] = total.summary()
            entry["model_elements"] = agg.model_elements
            entry["bits_per_model_element"] = (8.0 * total.bytes / agg.model_elements
                                               if agg.model_elements else None)
            entry["calls"] = agg.calls
            out[kind] = entry
        out["per_collective"] = {
            name: {"kind": st.kind, "calls": st.calls, "model_elements": st.model_elements,
                   **{k: st.links[k].summary() for k in _LINKS}}
            for name, st in sorted(table.items())
        }
        return out

    def link_bytes(self, kind: str) -> Dict[str, int]:
        """Bytes sent on each link by ``kind`` collectives over the whole run (no report built:
        cheap enough to read around every call, as the PaRO engine's cost-model counter does)."""
        _check_kind(kind)
        out = dict.fromkeys(_LINKS, 0)
        for st in self._total.values():
            if st.kind == kind:
                for link in _LINKS:
                    out[link] += st.links[link].bytes
        return out

    def interval_report(self) -> Dict[str, dict]:
        """Counters since the last :meth:`reset_interval`, aggregated per kind ('grad', 'weight')
        and per link ('intra', 'inter', 'total'), plus a per-collective breakdown."""
        return self._report(self._interval)

    def totals(self) -> Dict[str, dict]:
        """Same structure as :meth:`interval_report`, over the whole run (for the final summary)."""
        return self._report(self._total)

    def reset_interval(self) -> None:
        self._interval.clear()

    def format_report(self, report: Optional[Dict[str, dict]] = None) -> str:
        """One log line, e.g. ``comm grad: intra 8.06 b/el (x0.25) inter 4.25 b/el (x0.07) | ...``."""
        report = self.interval_report() if report is None else report
        parts = []
        for kind in _KINDS:
            entry = report[kind]
            if not entry["calls"] and not entry["total"]["bytes"]:
                continue
            links = []
            for k in _LINKS:
                s = entry[k]
                if not s["bytes"] and not s["baseline_bytes"]:
                    continue
                bpe = f"{s['bits_per_element']:.2f}" if s["bits_per_element"] is not None else "-"
                ratio = f"{s['ratio_vs_baseline']:.3f}" if s["ratio_vs_baseline"] is not None else "-"
                links.append(f"{k} {_fmt_bytes(s['bytes'])} {bpe} b/el (x{ratio} vs baseline)")
            parts.append(f"{kind}: " + ", ".join(links))
        return "comm " + (" | ".join(parts) if parts else "(nothing recorded)")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.2f}{unit}"
        n /= 1024.0
    return f"{n:.2f}GiB"


def links_of_peers(peers: Iterable[str]) -> Dict[str, int]:
    """Count 'intra'/'inter' labels (helper for callers that classify peers one by one)."""
    counts = {k: 0 for k in _LINKS}
    for p in peers:
        if p not in counts:
            raise ValueError(f"link label must be one of {_LINKS}, got {p!r}")
        counts[p] += 1
    return counts
